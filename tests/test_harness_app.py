"""The Hydra app: configs compose, bad configs fail clearly, runs resume, reports."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import MissingConfigException

from curvbench import app, records, report

TINY = ["problem.width=3", "problem.depth=1", "problem.batch_size=8",
        "measure.spectra.references=[ggn]", "measure.timing.repeats=2",
        "measure.timing.warmup=0", "measure.training.num_steps=4",
        "measure.training.eval_every=2", "measure.training.eval_size=50",
        "progress=false"]


def make_cfg(*overrides):
  with initialize_config_dir(config_dir=str(app.CONF_DIR), version_base=None):
    return compose("config", overrides=list(overrides))


def test_every_config_option_composes():
  for group in ("problem", "curvature", "optimizer", "measure"):
    for path in sorted((app.CONF_DIR / group).glob("*.yaml")):
      assert make_cfg(f"{group}={path.stem}")[group] is not None
  for launcher in ("basic", "joblib", "submitit_slurm"):
    with initialize_config_dir(config_dir=str(app.CONF_DIR),
                               version_base=None):
      cfg = compose("config", overrides=[f"launcher={launcher}"],
                    return_hydra_config=True)
    assert launcher.split("_")[0] in cfg.hydra.launcher._target_.lower()
  for path in sorted((app.CONF_DIR / "experiment").glob("*.yaml")):
    with initialize_config_dir(config_dir=str(app.CONF_DIR),
                               version_base=None):
      cfg = compose("config", overrides=[f"+experiment={path.stem}"],
                    return_hydra_config=True)
    assert cfg.name == path.stem and cfg.hydra.sweeper.params


@pytest.mark.parametrize("override,message", [
    ("problem.name=resnet", "Unknown problem.name 'resnet'"),
    ("curvature.mode=fisher", "Unknown curvature.mode 'fisher'"),
    ("curvature.block_type=lowrank", "Unknown curvature.block_type 'lowrank'"),
    ("curvature.estimator=magic", "Unknown curvature.estimator 'magic'"),
    ("optimizer.name=lbfgs", "Unknown optimizer.name 'lbfgs'"),
    ("measure.kind=profile", "Unknown measure.kind 'profile'"),
    ("measure.spectra.precision=float16", "precision 'float16'"),
])
def test_config_errors_name_the_choices(tmp_path, override, message):
  with pytest.raises(ValueError, match=message):
    app.run(make_cfg(override), tmp_path / "run")
  assert not (tmp_path / "run" / records.MARKER).exists()


def test_unknown_config_group_option():
  with pytest.raises(MissingConfigException, match="problem"):
    make_cfg("problem=resnet")


def test_too_large_dense_matrix(tmp_path):
  cfg = make_cfg("curvature=explicit_exact", "curvature.max_dense_gib=1e-9",
                 *TINY)
  with pytest.raises(MemoryError, match="implicit_exact"):
    app.run(cfg, tmp_path / "run")
  assert (tmp_path / "run" / "ERROR.json").exists()
  assert not (tmp_path / "run" / records.MARKER).exists()


RUNS = {
    "spectra_kfac": ["measure=spectra", "curvature=kfac"],
    "spectra_diag": ["measure=spectra", "curvature=diagonal",
                     "curvature.mode=fisher_empirical"],
    "timing_kfac": ["measure=timing", "curvature=kfac"],
    "training_kfac": ["measure=training", "curvature=kfac"],
    "training_adam": ["measure=training", "optimizer=adam"],
    "spectra_adam": ["measure=spectra", "optimizer=adam"],  # skipped
}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
  root = tmp_path_factory.mktemp("sweep")
  status = {name: app.run(make_cfg(*o, *TINY), root / name)
            for name, o in RUNS.items()}
  return root, status


def test_runs_write_records_and_metadata(sweep):
  root, status = sweep
  assert status == dict.fromkeys(RUNS, "complete") | {"spectra_adam": "skipped"}
  run = records.RunDir(root / "spectra_kfac")
  for name in ("config.yaml", "environment.json", "metadata.json",
               "registration.json", "spectra.parquet", "quality.parquet"):
    assert (run.path / name).stat().st_size > 0, name
  blocks = json.loads((run.path / "registration.json").read_text())["blocks"]
  assert [b["block_class"] for b in blocks] == ["DenseTwoKroneckerFactored"] * 2
  quality = run.tables()["quality"]
  assert {"problem", "method", "block_type", "mode", "metric", "value",
          "reference"} <= set(quality.columns)
  assert "skipped" == records.RunDir(root / "spectra_adam").marker()["status"]


def test_report_merges_tables_and_figures(sweep, tmp_path):
  root, _ = sweep
  assert report.main([str(root), "--out", str(tmp_path / "rep")]) == 0
  out = tmp_path / "rep"
  for name in ("report.md", "quality.csv", "timing.csv", "training.csv",
               "spectra_all.csv"):
    assert (out / name).stat().st_size > 0, name
  figures = {p.name for p in (out / "figures").iterdir()}
  for kind in ("spectra", "quality", "training", "timing"):
    for ext in ("png", "pdf"):
      assert f"{kind}_mlp.{ext}" in figures
      assert (out / "figures" / f"{kind}_mlp.{ext}").stat().st_size > 1000
  text = (out / "report.md").read_text()
  assert "kfac[kfac/ggn_exact]" in text and "adam" in text
  with pytest.raises(FileNotFoundError, match="No finished runs"):
    report.write(tmp_path / "empty")


def test_resume_skips_finished_and_redoes_interrupted(sweep, monkeypatch,
                                                      tmp_path):
  root, _ = sweep
  done = records.RunDir(root / "timing_kfac")
  before = {p.name: p.read_bytes() for p in done.path.iterdir()}
  cfg = make_cfg(*RUNS["timing_kfac"], *TINY)
  assert app.run(cfg, done.path) == "cached"
  assert {p.name: p.read_bytes() for p in done.path.iterdir()} == before

  from curvbench import timing

  def interrupted(*args, **kwargs):
    raise KeyboardInterrupt
  monkeypatch.setattr(timing, "measure", interrupted)
  with pytest.raises(KeyboardInterrupt):
    app.run(cfg, tmp_path / "cut")
  assert not records.RunDir(tmp_path / "cut").done
  monkeypatch.undo()
  assert app.run(cfg, tmp_path / "cut") == "complete"
  assert "timing" in records.RunDir(tmp_path / "cut").tables()


def _cli(*args, cwd):
  return subprocess.run([sys.executable, "-m", "curvbench", *args], cwd=cwd,
                        capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_every_variant_sweep_end_to_end_with_resume(tmp_path):
  """Every estimator and block type, and every mode, through the CLI; then a
  rerun (all cached) and the report."""
  repo = Path(app.__file__).resolve().parents[1]
  sweep_dir = tmp_path / "sweep"
  common = ["-m", f"hydra.sweep.dir={sweep_dir}", *TINY, "measure=spectra"]
  estimators = ["curvature=kfac,diagonal,full,identity,explicit_exact,"
                "implicit_exact,implicit_hessian"]
  modes = ["curvature=kfac", "curvature.mode=fisher_gradients,"
           "fisher_empirical,fisher_curvature_prop,fisher_exact,"
           "ggn_curvature_prop"]
  for args in (estimators, modes):
    result = _cli(*common, *args, cwd=repo)
    assert result.returncode == 0, result.stderr[-3000:]
  runs = records.find_runs(sweep_dir)
  assert [r.marker()["status"] for r in runs] == ["complete"] * 12
  again = _cli(*common, *estimators, cwd=repo)
  assert again.returncode == 0 and again.stdout.count("finished earlier") == 7
  rep = _cli("report", str(sweep_dir), cwd=repo)
  assert rep.returncode == 0, rep.stderr[-3000:]
  quality = (sweep_dir / "report" / "quality.csv").read_text()
  for block in ("kfac", "diagonal", "full", "identity", "explicit_exact"):
    assert f"{block}/ggn_exact" in quality
  for mode in ("fisher_gradients", "fisher_empirical", "fisher_curvature_prop",
               "fisher_exact", "ggn_curvature_prop"):
    assert f"kfac/{mode}" in quality
  assert "implicit_exact/ggn_exact" in quality
  assert "implicit_hessian/hessian" in quality
