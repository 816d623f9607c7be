"""The command: runs write their records, resume, refuse what will not fit,
and leave the process as they found it."""

import json
import logging
from pathlib import Path

import jax
import numpy as np
import pandas as pd
import pytest

import estimators
from curvbench import app, config, runs
from curvbench.core import checkpoints, records, training
from curvbench.measurements.timing import clock
from tests.conftest import SKIPPED, SWEEP, TINY, curvbench_cli


def test_runs_write_records_and_metadata(sweep):
  root, status = sweep
  assert status == {n: "skipped" if n in SKIPPED else "complete" for n in SWEEP}
  run = records.RunDir(root / "spectra_kfac")
  for name in (
    "config.yaml",
    "environment.json",
    "metadata.json",
    "registration.json",
    "spectra.parquet",
    "quality.parquet",
  ):
    assert (run.path / name).stat().st_size > 0, name
  blocks = json.loads((run.path / "registration.json").read_text())["blocks"]
  assert [b["block_class"] for b in blocks] == ["DenseTwoKroneckerFactored"] * 2
  quality = run.tables()["quality"]
  assert {
    "problem",
    "method",
    "block_type",
    "mode",
    "metric",
    "value",
    "reference",
  } <= set(quality.columns)
  methods = {
    name: records.RunDir(root / name)
    .tables()["training"]
    .method.unique()
    .tolist()
    for name in ("training_kfac", "training_adam", "training_exact")
  }
  assert methods == {
    "training_kfac": ["kfac[kfac/ggn_curvature_prop]"],
    "training_adam": ["adam"],
    "training_exact": ["preconditioned_sgd[explicit_exact/ggn_exact]"],
  }
  reason = records.RunDir(root / "training_kfac_exact").marker()["reason"]
  assert "cannot train with curvature=explicit_exact" in reason


def test_spectra_along_training_and_from_its_checkpoints(sweep, tmp_path):
  """Spectra at steps 0 and 2 of an SGD run carry step, data, sample and
  block; the same measurement from the run's saved checkpoint gives the
  same numbers on the same sample of the data, other ones on the next."""
  root, _ = sweep
  run = records.RunDir(root / "spectra_steps")
  tables = run.tables()
  for name in ("spectra", "quality", "statistics", "heatmaps"):
    assert sorted(tables[name].step.unique()) == [0, 2], name
    assert set(tables[name].data) == {"batch"}, name
    assert set(tables[name]["sample"]) == {0}, name  # TINY: samples=1
  assert set(tables["quality"].block) == {"all", "dense_0", "logits"}
  # num_steps=4, but training stops at the last step measured.
  assert set(tables["training"].step) == {0, 1, 2}
  assert set(tables["training"].method) == {"sgd"}
  cost = tables["cost"]
  assert {"phase", "compile_s", "run_s", "program_bytes"} <= set(cost.columns)
  # Host work (no program of its own): what lies between the phases, and
  # K-FAC's spectrum joined from its blocks' eigendecompositions.
  host = {"unaccounted", "eigh approx (from its blocks)"}
  programs = cost[~cost.phase.isin(host)]
  assert (programs.run_s > 0).all() and (programs.program_bytes > 0).all()
  # Every eigendecomposition is a phase of its own.
  assert {
    "eigh exact ggn",
    "eigh approx block dense_0",
    "eigh exact ggn block dense_0",
  } <= set(cost.phase)
  assert set(cost.phase[cost.program_bytes.isna()]) == host
  assert sorted(checkpoints.steps_in(run.path / "checkpoints")) == [0, 2]

  # From the checkpoint, on two samples of the data: the first is the
  # batch measured in training, the second another draw (the next batch).
  again = config.compose(
    *TINY,
    "measure.spectra.steps=[2]",
    "measure.spectra.samples=2",
    f"measure.spectra.checkpoint={run.path}/checkpoints",
  )
  assert runs.run(again, tmp_path / "again") == "complete"
  again_tables = records.RunDir(tmp_path / "again").tables()
  from_checkpoint = again_tables["quality"]
  assert set(from_checkpoint["sample"]) == {0, 1}
  assert set(again_tables["heatmaps"]["sample"]) == {0}  # the first only
  in_training = tables["quality"][tables["quality"].step == 2]
  columns = [
    "sample",
    "reference",
    "block",
    "metric",
    "relative_damping",
    "value",
  ]
  first = from_checkpoint[from_checkpoint["sample"] == 0]
  pd.testing.assert_frame_equal(
    first[columns].reset_index(drop=True),
    in_training[columns].reset_index(drop=True),
  )
  second = from_checkpoint[from_checkpoint["sample"] == 1]
  assert len(second) == len(first)
  assert not np.allclose(second.value, first.value, equal_nan=True)


def test_a_sweep_over_approximations_and_optimizers_trains_each_once(
  sweep, tmp_path
):
  """`measure/spectra/trainer=sgd` trains to the measured steps as
  `optimizer=sgd` does (the same numbers), so a sweep over the optimizer
  group measures spectra once, with the canonical optimizer's point; with
  `canonical.train_every_curvature=false`, K-FAC trains with the
  canonical curvature only; `measure.training.problems` trains on those
  problems only."""
  root, _ = sweep
  fixed = (
    "measure=spectra",
    "measure.spectra.steps=[0,2]",
    "measure/spectra/trainer=sgd",
    *TINY,
  )
  assert runs.run(config.compose(*fixed), tmp_path / "run") == "complete"
  tables = records.RunDir(tmp_path / "run").tables()
  expected = records.RunDir(root / "spectra_steps").tables()
  columns = ["step", "reference", "block", "metric", "value"]
  pd.testing.assert_frame_equal(
    tables["quality"][columns], expected["quality"][columns]
  )
  assert set(tables["training"].method) == {"sgd"}
  other = config.load(config.compose(*fixed, "optimizer=adam"))
  assert "does not use the optimizer" in runs.skip_reason(other)
  ekfac = ("measure=training", "curvature=ekfac", *TINY)
  assert runs.skip_reason(config.load(config.compose(*ekfac))) is None
  assert "runs with curvature=kfac only" in runs.skip_reason(
    config.load(config.compose(*ekfac, "canonical.train_every_curvature=false"))
  )
  only = config.load(
    config.compose(*ekfac, "measure.training.problems=[mlp,convnet]")
  )
  assert only.problem.name == "mlp" and runs.skip_reason(only) is None
  elsewhere = config.load(
    config.compose(*ekfac, "measure.training.problems=[convnet]")
  )
  assert runs.skip_reason(elsewhere) == (
    "measure.training.problems=['convnet'] leaves out problem=mlp"
  )
  with pytest.raises(
    config.ConfigError, match="Unknown measure.training.problems 'convnt'"
  ):
    config.compose("measure.training.problems=[convnt]", *TINY)
  with pytest.raises(
    config.ConfigError,
    match="null until chosen: give measure/spectra/trainer=NAME",
  ):
    config.compose("measure.spectra.trainer.learning_rate=0.1", *TINY)


@pytest.mark.slow
def test_a_sweeps_approximations_share_one_training_trajectory(
  tmp_path, monkeypatch
):
  """In a sweep folder, spectra runs that train the same way (a fixed
  trainer) train once: the second reads the first's trajectory, and
  measures what it measures when it trains itself."""
  calls = []
  real = training.run
  monkeypatch.setattr(
    training, "run", lambda *a, **k: calls.append(1) or real(*a, **k)
  )
  sweep = tmp_path / "sweep"
  sweep.mkdir()
  (sweep / records.SWEEP_MARKER).touch()
  fixed = (
    "measure=spectra",
    "measure.spectra.steps=[0,2]",
    "measure/spectra/trainer=sgd",
    *TINY,
  )
  for curvature in ("kfac", "diagonal"):
    assert (
      runs.run(
        config.compose(*fixed, f"curvature={curvature}"), sweep / curvature
      )
      == "complete"
    )
  assert len(calls) == 1
  assert (
    runs.run(config.compose(*fixed, "curvature=diagonal"), tmp_path / "alone")
    == "complete"
  )
  assert len(calls) == 2
  shared = records.RunDir(sweep / "diagonal").tables()
  alone = records.RunDir(tmp_path / "alone").tables()
  columns = ["step", "reference", "block", "metric", "value"]
  pd.testing.assert_frame_equal(
    shared["quality"][columns], alone["quality"][columns]
  )
  columns = ["step", "batch_loss", "train_loss"]
  pd.testing.assert_frame_equal(
    shared["training"][columns], alone["training"][columns]
  )


def test_bad_measurement_points_are_refused_by_name(sweep, tmp_path):
  root, _ = sweep
  with pytest.raises(
    ValueError,
    match=r"measure.spectra.steps: .*step 9, "
    r"beyond the training run's length",
  ):
    config.compose("measure.spectra.steps=[0,9]", *TINY)
  saved = root / "spectra_steps" / "checkpoints"
  with pytest.raises(ValueError, match=r"No checkpoint for steps \[1\]"):
    runs.run(
      config.compose(
        *TINY,
        "measure.spectra.steps=[1]",
        f"measure.spectra.checkpoint={saved}",
      ),
      tmp_path / "missing",
    )
  wider = config.compose(
    *TINY, "problem.width=4", f"measure.spectra.checkpoint={saved}"
  )
  with pytest.raises(ValueError, match="dense_0/w: checkpoint"):
    runs.run(wider, tmp_path / "wider")
  with pytest.raises(ValueError, match="'batches:N'"):
    config.compose("measure.spectra.data=everything")


def test_resume_skips_finished_and_redoes_interrupted(
  sweep, monkeypatch, tmp_path
):
  root, _ = sweep
  done = records.RunDir(root / "timing_kfac")
  before = {p.name: p.read_bytes() for p in done.path.iterdir()}
  cfg = config.compose(*SWEEP["timing_kfac"], *TINY)
  assert runs.run(cfg, done.path) == "cached"
  assert {p.name: p.read_bytes() for p in done.path.iterdir()} == before

  def interrupted(*args, **kwargs):
    raise KeyboardInterrupt

  monkeypatch.setattr(clock, "measure", interrupted)
  with pytest.raises(KeyboardInterrupt):
    runs.run(cfg, tmp_path / "cut")
  assert not records.RunDir(tmp_path / "cut").done
  monkeypatch.undo()
  assert runs.run(cfg, tmp_path / "cut") == "complete"
  assert "timing" in records.RunDir(tmp_path / "cut").tables()


def test_too_large_dense_matrix(tmp_path):
  cfg = config.compose(
    "curvature=explicit_exact", "curvature.max_dense_gib=1e-9", *TINY
  )
  with pytest.raises(MemoryError, match="implicit_exact"):
    runs.run(cfg, tmp_path / "run")
  assert (tmp_path / "run" / "ERROR.json").exists()
  assert not (tmp_path / "run" / records.MARKER).exists()


def test_a_run_restores_precision_and_log_levels(tmp_path):
  jax_logger = logging.getLogger("jax")
  before = (jax.config.jax_enable_x64, jax_logger.level)
  jax_logger.setLevel(logging.DEBUG)
  try:
    cfg = config.compose("measure=training", "optimizer=adam", *TINY)
    assert cfg.measure.training.precision == "float32"
    assert runs.run(cfg, tmp_path / "run") == "complete"
    assert jax.config.jax_enable_x64  # the tests' setting, not the run's
    assert jax_logger.level == logging.DEBUG
  finally:
    jax_logger.setLevel(before[1])


@pytest.mark.slow
def test_sweeps_end_to_end_with_resume(tmp_path):
  """Sweeps through the CLI: dense and matrix-free curvatures, and every
  estimation mode; then a rerun (all cached) and the report. (Every
  registered curvature runs in-process in tests/test_contracts.py.)"""
  repo = Path(app.__file__).resolve().parents[1]
  sweep_dir = tmp_path / "sweep"
  common = [
    "-m",
    f"hydra.sweep.dir={sweep_dir}",
    *TINY,
    "measure=spectra",
    f"compilation_cache={tmp_path / 'jax_cache'}",
  ]
  curvatures = ["curvature=diagonal,implicit_hessian"]
  modes = [
    "curvature=kfac",
    "curvature.mode=" + ",".join(estimators.ESTIMATION_MODES),
  ]
  for args in (curvatures, modes):
    result = curvbench_cli(*common, *args, cwd=repo)
    assert result.returncode == 0, result.stderr[-3000:]
  finished = records.find_runs(sweep_dir)
  count = 2 + len(estimators.ESTIMATION_MODES)
  assert [r.marker()["status"] for r in finished] == ["complete"] * count
  again = curvbench_cli(
    *common, *curvatures, cwd=repo
  )  # nothing left to launch
  assert again.returncode == 0
  assert "2 of 2 sweep points finished earlier" in again.stdout
  rep = curvbench_cli("report", str(sweep_dir), cwd=repo)
  assert rep.returncode == 0, rep.stderr[-3000:]
  quality = (sweep_dir / "report" / "quality.csv").read_text()
  assert "diagonal/ggn_exact" in quality
  assert "implicit_hessian/hessian" in quality
  for mode in estimators.ESTIMATION_MODES:
    assert f"kfac/{mode}" in quality


def test_a_failing_run_says_why_in_one_line(tmp_path, capsys):
  """A run that fails ends the command with its message (the traceback is
  the run's ERROR.json); so does a report of a folder that is not there."""
  bad = tmp_path / "bad.safetensors"
  bad.write_bytes(b"not a checkpoint")
  out = tmp_path / "run"
  failed = curvbench_cli(
    f"hydra.run.dir={out}",
    *TINY,
    f"measure.spectra.checkpoint={bad}",
    cwd=Path(app.__file__).resolve().parents[1],
  )
  assert failed.returncode == 1
  message = failed.stderr.strip().splitlines()[-1]
  assert message.startswith(
    f"curvbench: {out}: {bad} is not a safetensors file"
  ), failed.stderr[-2000:]
  assert "Traceback" not in failed.stderr
  error = json.loads((out / "ERROR.json").read_text())
  assert "Traceback" in error["traceback"]
  with pytest.raises(
    SystemExit, match="curvbench report: No sweep directory at /no/such/sweep"
  ):
    app.cli(["report", "/no/such/sweep"])


@pytest.mark.slow
@pytest.mark.skipif(
  not Path("/proc/self/maps").exists(),
  reason="counts the memory maps Linux lists per process",
)
def test_a_sweeps_runs_release_their_compiled_programs(tmp_path):
  """Each compiled program holds memory maps, and Linux allows a process
  65,530: the runs of a sweep, one process, release theirs, so the count
  stays where the first run left it (it grew by hundreds a run before)."""
  maps = lambda: sum(1 for _ in open("/proc/self/maps"))
  counts = []
  for seed in range(3):
    cfg = config.compose(*TINY, "measure=timing", f"seed={seed}")
    assert runs.run(cfg, tmp_path / str(seed)) == "complete"
    counts.append(maps())
  assert max(counts) - counts[0] < 50, counts
