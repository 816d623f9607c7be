"""curvbench.plots on small synthetic tables: every figure is written as PNG
and PDF, for tables along training and for older tables without step, data
and block; the signed density and the heatmap block lines are checked."""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from curvbench import plots, report
from curvbench.measurements.spectra import Spectra

IDENTITY = dict(problem="mlp", curvature="kfac", block_type="kfac",
                mode="ggn_exact", optimizer="kfac", seed=0, run="r0")
METHODS = ("kfac/ggn_exact", "diagonal/ggn_exact")
STEPS = (0, 10, 1000)


def _written(paths, prefix):
  names = {p.name for p in paths if p.name.startswith(prefix)}
  assert names, f"no {prefix} figure among {[p.name for p in paths]}"
  for p in paths:
    assert p.stat().st_size > 1000, p
  stems = {p.stem for p in paths}
  for stem in stems:
    assert {f"{stem}.png", f"{stem}.pdf"} <= {p.name for p in paths}, stem
  return names


def _spectrum_rows(rng, matrix, source, reference, method, step, data,
                   signed, n=40):
  lam = rng.lognormal(-2, 2, n) * (1 + step / 50)
  if signed:
    lam[: n // 4] *= -0.1
  weight = np.full(n, 1 / n) if source == "exact" else rng.uniform(0, 1, n)
  return pd.DataFrame(dict(IDENTITY, method=method, step=step, data=data,
                           source=source, matrix=matrix, reference=reference,
                           index=np.arange(n), eigenvalue=lam, weight=weight))


@pytest.fixture
def spectra_table():
  rng = np.random.default_rng(0)
  parts = []
  for data, ref, signed in (("batch", "ggn", False),
                            ("batch", "hessian", True),
                            ("batches:8", "hessian", True)):
    for step in STEPS:
      parts.append(_spectrum_rows(rng, ref, "exact", ref, METHODS[0], step,
                                  data, signed))
      for method in METHODS:
        parts.append(_spectrum_rows(rng, method, "approx", ref, method, step,
                                    data, signed))
  top = _spectrum_rows(rng, "ggn", "exact_top_k", "ggn", METHODS[0], 0,
                       "batch", False, n=5).assign(weight=np.nan)
  table = pd.concat([*parts, top], ignore_index=True)
  table.loc[3, "eigenvalue"] = np.inf
  table.loc[5, "weight"] = np.nan
  return table


def test_spectra_per_problem_data_and_reference(spectra_table, tmp_path):
  names = _written(plots.spectra(spectra_table, tmp_path), "spectra_")
  assert "spectra_mlp_batches-8_hessian.png" in names
  assert len(names) == 3 * 2


def test_spectra_of_an_older_table(spectra_table, tmp_path):
  old = spectra_table[(spectra_table.step == 0)
                      & (spectra_table.data == "batch")]
  old = old.drop(columns=["step", "data", "run"])
  names = _written(plots.spectra(old, tmp_path), "spectra_")
  assert names == {f"spectra_mlp_batch_{r}.{e}" for r in ("ggn", "hessian")
                   for e in ("png", "pdf")}


def test_symlog_density_integrates_to_one_and_keeps_the_sign():
  rng = np.random.default_rng(1)
  lam = -10.0 ** rng.uniform(-2, 2, 200)
  lam[:20] = 0.0
  linthresh = 1e-4 * np.abs(lam).max()
  u = plots.symlog(lam, linthresh)
  grid = np.linspace(u.min() - 1, u.max() + 1, 4000)
  density = plots.symlog_density(lam, np.full(lam.size, np.nan), grid,
                                 linthresh)
  assert np.trapezoid(density, grid) == pytest.approx(1.0, abs=1e-3)
  negative = grid < -0.5
  assert np.trapezoid(density[negative], grid[negative]) > 0.85
  x = plots.symlog_inverse(grid, linthresh)
  np.testing.assert_allclose(plots.symlog(x, linthresh), grid, atol=1e-9)
  assert (np.diff(x) > 0).all()


def test_symlog_density_of_a_positive_spectrum_with_weights():
  lam = np.array([1e-3, 1.0, 10.0])
  grid = np.linspace(-10, 10, 8001)
  density = plots.symlog_density(lam, [0.0, 0.0, 2.0], grid, 1e-6)
  assert np.trapezoid(density, grid) == pytest.approx(1.0, abs=1e-6)
  assert grid[np.argmax(density)] == pytest.approx(
      plots.symlog(10.0, 1e-6), abs=1e-2)
  assert np.trapezoid(density[grid < 0], grid[grid < 0]) < 1e-6


def test_block_boundaries():
  lines, names = plots.block_boundaries(["a", "a", "a", "b", "c", "c"])
  assert lines == [2.5, 3.5]
  assert names == [(1.0, "a"), (3.0, "b"), (4.5, "c")]
  assert plots.block_boundaries(["w"] * 4) == ([], [(1.5, "w")])


def _heatmap_rows(blocks, step, source, kind, method, seed=0):
  rng = np.random.default_rng(seed)
  n = len(blocks)
  m = rng.normal(size=(n, n))
  m = m @ m.T + np.eye(n)
  if kind == "inverse":
    m = np.linalg.inv(m)
  m[0, 1] = 0.0
  row, col = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
  b = np.asarray(blocks)
  return pd.DataFrame(dict(IDENTITY, method=method, step=step, data="batch",
                           source=source, kind=kind, reference="ggn",
                           row=row.ravel(), col=col.ravel(),
                           row_block=b[row.ravel()], col_block=b[col.ravel()],
                           value=m.ravel()))


def test_heatmaps_draw_exact_approx_and_inverses(tmp_path):
  blocks = ["dense_0"] * 5 + ["dense_1"] * 3 + ["out"] * 2
  runs = [(0, METHODS[0]), (10, METHODS[0]), (0, METHODS[1])]
  parts = [_heatmap_rows(blocks, step, source, kind, method)
           for step, method in runs for kind in ("matrix", "inverse")
           for source in ("exact", "approx")]
  table = pd.concat(parts, ignore_index=True)
  table.loc[7, "value"] = np.nan
  names = _written(plots.heatmaps(table, tmp_path), "heatmaps_")
  assert "heatmaps_mlp_kfac-ggn_exact_batch_step10.png" in names
  assert len(names) == 3 * 2


def test_heatmaps_with_one_block_and_no_inverse(tmp_path):
  table = pd.concat([_heatmap_rows(["w"] * 4, 0, s, "matrix", METHODS[0])
                     for s in ("exact", "approx")])
  _written(plots.heatmaps(table, tmp_path), "heatmaps_")


def test_heatmap_lines_sit_at_block_boundaries():
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots()
  rows, cols = plots.draw_blocks(ax, ["a", "a", "b"], ["a", "a", "b"])
  assert rows == cols == [1.5]
  assert [line.get_ydata()[0] for line in ax.lines[:1]] == [1.5]
  assert [t.get_text() for t in ax.get_yticklabels()] == ["a", "b"]
  plt.close(fig)


def _quality_table(steps, with_location=True):
  rng = np.random.default_rng(2)
  rows = []
  for step in steps:
    for method in METHODS:
      for block in ("all", "dense_0", "dense_1"):
        for metric in ("relative_frobenius", "log_wasserstein"):
          rows.append(dict(IDENTITY, method=method, step=step, data="batch",
                           block=block, reference="ggn", metric=metric,
                           value=rng.uniform()))
  table = pd.DataFrame(rows)
  table.loc[0, "value"] = np.inf
  table.loc[1, "value"] = np.nan
  if not with_location:
    table = table[table.block == "all"].drop(columns=["step", "data", "block"])
  return table


def test_quality_through_training(tmp_path):
  table = _quality_table(STEPS)
  names = _written(plots.quality_through_training(
      table, tmp_path, plots.palette(table.method)), "quality_steps_")
  assert names == {"quality_steps_mlp_ggn_batch.png",
                   "quality_steps_mlp_ggn_batch.pdf"}


def test_quality_bars_for_one_step_and_older_tables(tmp_path):
  for table in (_quality_table([0]), _quality_table([0], False)):
    assert _written(plots.quality(table, tmp_path), "quality_") == {
        "quality_mlp.png", "quality_mlp.pdf"}


def _statistics_table():
  rows = []
  for step in STEPS:
    for source, matrix in (("exact", "ggn"), ("approx", METHODS[0])):
      for stat in ("trace", "condition_number", "negative_ratio"):
        rows.append(dict(IDENTITY, method=METHODS[0], step=step, data="batch",
                         source=source, matrix=matrix, statistic=stat,
                         value=1.0 + step, stderr=0.1))
  table = pd.DataFrame(rows)
  table.loc[0, "stderr"] = np.nan
  table.loc[1, "value"] = np.inf
  return table


def test_the_spectra_measurement_draws_every_table_it_declares(spectra_table, tmp_path):
  blocks = ["a"] * 3 + ["b"] * 3
  heat = pd.concat([_heatmap_rows(blocks, 0, s, k, METHODS[0])
                    for s in ("exact", "approx")
                    for k in ("matrix", "inverse")])
  quality = pd.concat([
      _quality_table(STEPS),
      _quality_table([0]).assign(problem="convnet")])
  spectra = spectra_table[spectra_table.matrix.isin(["ggn", *METHODS])
                          & (spectra_table.reference == "ggn")]
  tables = dict(spectra=spectra, heatmaps=heat, quality=quality,
                statistics=_statistics_table())
  drawn = report.Report(Path("."), pd.DataFrame(), pd.DataFrame(), tables,
                        plots.palette(METHODS))
  names = {p.stem for p in Spectra().figures(drawn, tmp_path)}
  assert {"spectra_mlp_batch_ggn", "heatmaps_mlp_kfac-ggn_exact_batch_step0",
          "quality_steps_mlp_ggn_batch", "quality_convnet",
          "statistics_mlp"} <= names
  assert "quality_mlp" not in names


def test_tuned_curves_are_chosen_per_problem():
  """Each problem keeps its own best setting; untuned methods stay."""
  train = pd.DataFrame(
      [dict(problem=p, method=m, label=f"{m} ({s})" if s else m, step=0)
       for p in ("a", "b") for m, s in (("sgd", "lr=0.1"), ("sgd", "lr=1"),
                                        ("kfac", ""))])
  tuning = pd.DataFrame(dict(problem=["a", "a", "b", "b"], method="sgd",
                             setting=["lr=0.1", "lr=1"] * 2,
                             best=[True, False, False, True]))
  kept = plots.tuned_curves(train, tuning)
  assert sorted(zip(kept.problem, kept.label)) == [
      ("a", "kfac"), ("a", "sgd (lr=0.1)"), ("b", "kfac"), ("b", "sgd (lr=1)")]
