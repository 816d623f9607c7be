"""`curvbench report`: a sweep's records merged into tables and figures."""

import shutil

import pandas as pd
import pytest

from curvbench import records, report


def test_report_merges_tables_and_figures(sweep, tmp_path):
  root, _ = sweep
  assert report.main([str(root), "--out", str(tmp_path / "rep")]) == 0
  out = tmp_path / "rep"
  for name in ("report.md", "quality.csv", "timing.csv", "training.csv",
               "spectra_all.csv"):
    assert (out / name).stat().st_size > 0, name
  figures = {p.name for p in (out / "figures").iterdir()}
  for kind in ("spectra_mlp_batch_ggn", "training_mlp",
               "timing_mlp", "quality_steps_mlp_ggn_batch",
               "statistics_mlp"):
    for ext in ("png", "pdf"):
      assert f"{kind}.{ext}" in figures, sorted(figures)
      assert (out / "figures" / f"{kind}.{ext}").stat().st_size > 1000
  assert any(name.startswith("heatmaps_mlp") for name in figures)
  text = (out / "report.md").read_text()
  assert "kfac[kfac/ggn_exact]" in text and "adam" in text
  assert "preconditioned_sgd[explicit_exact/ggn_exact]" in text
  assert "kept their labels" not in text
  with pytest.raises(FileNotFoundError, match="No finished runs"):
    report.write(tmp_path / "empty")


def test_records_from_before_preconditioned_sgd_keep_their_label(sweep,
                                                                 tmp_path):
  """Until optimizer=preconditioned_sgd existed, optimizer=kfac with an exact
  curvature ran that algorithm; such records are noted, not relabelled."""
  root, _ = sweep
  old = tmp_path / "old"
  shutil.copytree(root / "training_exact", old / "run")
  run = records.RunDir(old / "run")
  table = run.tables()["training"].assign(
      optimizer="kfac", method="kfac[explicit_exact/ggn_exact]")
  run.write_table("training", table)
  report.write(old)
  text = (old / "report" / "report.md").read_text()
  assert "kfac[explicit_exact/ggn_exact]" in text
  assert "kept their labels" in text
  merged = pd.read_csv(old / "report" / "training_all.csv")
  assert set(merged.method) == {"kfac[explicit_exact/ggn_exact]"}
