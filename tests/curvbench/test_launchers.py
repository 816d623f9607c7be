"""Launchers: a sweep through submitit's local executor records its runs,
points that repeat another are left out and never launched, and timing
runs that would share a device are refused before anything starts."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from curvbench import config, planning, provenance, runs
from curvbench import sweep as sweep_runs
from curvbench.core import records
from tests.conftest import TINY

CURVBENCH = Path(sys.executable).parent / "curvbench"


def sweep(sweep_dir, *overrides):
  """`curvbench -m` into `sweep_dir`; its exit code and its output (stdout
  and Hydra's log together)."""
  result = subprocess.run(
    [str(CURVBENCH), "-m", f"hydra.sweep.dir={sweep_dir}", *TINY, *overrides],
    cwd=sweep_dir.parent,
    capture_output=True,
    text=True,
    timeout=300,
  )
  return result.returncode, result.stdout + result.stderr


def run_dirs(sweep_dir):
  return sorted(
    p for p in sweep_dir.iterdir() if p.is_dir() and not p.name.startswith(".")
  )


@pytest.mark.slow
def test_submitit_local_sweep_records_both_runs(tmp_path):
  """Two training runs go through submitit's executor (the SLURM path) as
  subprocesses; their records land in the sweep directory, submitit's
  files beside them."""
  root = tmp_path / "sweep"
  code, out = sweep(
    root, "launcher=submitit_local", "measure=training", "optimizer=sgd,adam"
  )
  assert code == 0, out[-3000:]
  assert "Submitit 'local'" in out
  found = run_dirs(root)
  assert len(found) == 2
  for path in found:
    run = records.RunDir(path)
    assert run.marker()["status"] == "complete", path.name
    assert {"config", "training"} <= set(run.tables()), path.name
  assert (root / ".submitit").is_dir()


@pytest.mark.slow
def test_skipped_points_are_left_out_not_launched(tmp_path):
  """SGD does not use the curvature: of curvature=kfac,diagonal only kfac
  (the canonical one) is launched; diagonal is left out, named in one line
  with the reason, and leaves no folder for the report to list. The same
  point run on its own records a skipped run with that reason."""
  root = tmp_path / "sweep"
  code, out = sweep(
    root, "measure=training", "optimizer=sgd", "curvature=kfac,diagonal"
  )
  assert code == 0, out[-3000:]
  assert "Launching 1 jobs locally" in out
  reason = (
    "optimizer=sgd does not use the curvature; it runs with "
    "curvature=kfac, mode=ggn_curvature_prop only"
  )
  assert (
    f"1 of 2 sweep points repeat another and are left out ({reason})" in out
  )
  (launched,) = run_dirs(root)  # no folder for the left-out point
  assert OmegaConf.load(launched / "config.yaml").curvature.name == "kfac"
  assert (launched / ".hydra").is_dir()  # a launched job's Hydra record
  marker = records.RunDir(launched).marker()
  assert marker["status"] == "complete"
  # the config the sweeper composed is the one a run by hand composes
  assert marker["run_id"] == provenance.run_id(
    config.compose(*TINY, "measure=training", "optimizer=sgd", "curvature=kfac")
  )
  loaded = sweep_runs.load_sweep(root).runs
  assert list(loaded.status) == ["complete"]
  assert sweep_runs.not_in_results(loaded).empty
  alone = tmp_path / "alone"
  assert (
    runs.run(
      config.compose(
        *TINY, "measure=training", "optimizer=sgd", "curvature=diagonal"
      ),
      alone,
    )
    == "skipped"
  )
  skipped = records.RunDir(alone).marker()
  assert skipped["status"] == "skipped" and skipped["reason"] == reason


@pytest.mark.slow
def test_timing_runs_sharing_a_device_are_refused_before_launch(tmp_path):
  root = tmp_path / "sweep"
  code, out = sweep(
    root, "launcher=joblib", "measure=timing", "curvature=kfac,diagonal"
  )
  assert code != 0
  assert "Timing runs need the device to themselves" in out
  assert "hydra.launcher.n_jobs=1" in out
  assert not root.exists() or not run_dirs(root)  # nothing was launched


@pytest.mark.slow
def test_a_sweep_with_a_bad_point_launches_nothing(tmp_path):
  """One bad point of four stops the sweep before any run starts or any
  skip is recorded, naming the point and its setting."""
  root = tmp_path / "sweep"
  code, out = sweep(
    root,
    "measure=training",
    "optimizer=sgd,adam",
    "curvature=kfac,diagonal",
    "measure.training.num_steps=4,0",
  )
  assert code != 0
  assert "4 of 8 sweep points have a setting that is not allowed" in out
  assert "measure.training.num_steps=0 is not allowed" in out
  assert "Launching" not in out
  assert not root.exists() or not run_dirs(root)


def launcher(name, **settings):
  """The `hydra.launcher` config that `launcher=NAME` selects."""
  config.store()
  with initialize_config_dir(
    config_dir=str(config.CONF_DIR), version_base=None
  ):
    cfg = compose(
      "config", overrides=[f"launcher={name}"], return_hydra_config=True
    )
  return OmegaConf.merge(cfg.hydra.launcher, settings), cfg


@pytest.mark.parametrize(
  "name,settings,batch,timing,fix",
  [
    ("basic", {}, None, [True, True], None),
    ("submitit_slurm", {}, None, [True, True], None),
    ("joblib", {}, None, [True, False], "hydra.launcher.n_jobs=1"),
    ("joblib", {"n_jobs": 1}, None, [True, True], None),
    ("joblib", {}, None, [True], None),  # alone in its batch
    ("joblib", {}, None, [False, False], None),  # nothing timed
    ("submitit_local", {}, 2, [False, True], "hydra.sweeper.max_batch_size=1"),
    ("submitit_local", {}, 2, [False, False, True], None),  # last batch: 1
    ("submitit_local", {}, 1, [True, True], None),
    (
      "basic",
      {"_target_": "some.other.RayLauncher"},
      None,
      [True, False],
      "hydra.sweeper.max_batch_size=1",
    ),
  ],
)
def test_timing_alone_per_launcher(name, settings, batch, timing, fix):
  launcher_cfg, _ = launcher(name, **settings)
  if fix is None:
    planning.check_alone(timing, launcher_cfg, batch)
  else:
    with pytest.raises(ValueError, match=f"need the device.*{re.escape(fix)}"):
      planning.check_alone(timing, launcher_cfg, batch)


def test_local_parallel_launchers_do_not_preallocate_the_gpu():
  for name in ("joblib", "submitit_local"):
    _, cfg = launcher(name)
    assert cfg.hydra.job.env_set.XLA_PYTHON_CLIENT_PREALLOCATE == "false"
  _, cfg = launcher("submitit_local")
  assert cfg.hydra.launcher._target_.endswith("submitit_launcher.LocalLauncher")
  assert cfg.hydra.sweeper.max_batch_size == 2
  assert cfg.hydra.launcher.submitit_folder.startswith(cfg.hydra.sweep.dir)


def test_points_are_launched_one_at_a_time_only_where_they_run_in_turn():
  """Batches of one job (so each point's end is told as it comes) only for
  launchers that run a batch's jobs one after another anyway; SLURM's and
  a multi-worker joblib's jobs keep running at once."""

  def launcher(target, **kw):
    return OmegaConf.create({"_target_": target, **kw})

  basic = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
  joblib = "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"
  slurm = (
    "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
  )
  assert planning.runs_in_turn(launcher(basic))
  assert planning.runs_in_turn(launcher(joblib, n_jobs=1))
  assert not planning.runs_in_turn(launcher(joblib, n_jobs=2))
  assert not planning.runs_in_turn(launcher(slurm))
