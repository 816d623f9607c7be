"""Every measurement's figures on small synthetic tables: every figure is
written as PNG and PDF, for tables along training and for older tables
without step, data and block; the signed density (and a PSD matrix's,
which stays above zero) and the heatmap block lines are checked, and what
each figure draws (overlays, titles, better directions, bars, error bars,
legends outside the panels, one colour per method) is read off its
matplotlib objects."""

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
from matplotlib.collections import PolyCollection
from matplotlib.container import BarContainer, ErrorbarContainer

from curvbench.approximations import CURVATURES
from curvbench.core import metrics, palette, plots
from curvbench.measurements.spectra import Spectra, completed, compute
from curvbench.measurements.spectra import figures as spectra_figures
from curvbench.measurements.timing import figures as timing_figures
from curvbench.measurements.training import figures as training_figures
from curvbench.optimizers import OPTIMIZERS
from curvbench.report import colour_map

IDENTITY = dict(
  problem="mlp",
  curvature="kfac",
  block_type="kfac",
  mode="ggn_exact",
  optimizer="kfac",
  seed=0,
  run="r0",
)
METHODS = ("kfac/ggn_exact", "diagonal/ggn_exact")
STEPS = (0, 10, 1000)


@pytest.fixture
def drawn(monkeypatch):
  """The figures `plots.save` is given, by file stem."""
  figures = {}
  save = plots.save

  def capture(fig, path, **kw):
    figures[path.name] = fig
    return save(fig, path, **kw)

  monkeypatch.setattr(plots, "save", capture)
  return figures


def _legend_outside(fig):
  """The figure's legend, checked to cover none of its panels."""
  fig.canvas.draw()
  legend = next(ax.get_legend() for ax in fig.axes if ax.get_legend())
  box = legend.get_window_extent()
  for ax in fig.axes:
    if ax.get_visible():
      assert not box.overlaps(ax.get_window_extent()), ax.get_title()
  return legend


def _written(paths, prefix):
  names = {p.name for p in paths if p.name.startswith(prefix)}
  assert names, f"no {prefix} figure among {[p.name for p in paths]}"
  for p in paths:
    assert p.stat().st_size > 1000, p
  stems = {p.stem for p in paths}
  for stem in stems:
    assert {f"{stem}.png", f"{stem}.pdf"} <= {p.name for p in paths}, stem
  return names


def _spectrum_rows(
  rng, matrix, source, reference, method, step, data, signed, n=40
):
  lam = rng.lognormal(-2, 2, n) * (1 + step / 50)
  if signed:
    lam[: n // 4] *= -0.1
  weight = np.full(n, 1 / n) if source == "exact" else rng.uniform(0, 1, n)
  return pd.DataFrame(
    dict(
      IDENTITY,
      method=method,
      step=step,
      data=data,
      source=source,
      matrix=matrix,
      reference=reference,
      index=np.arange(n),
      eigenvalue=lam,
      weight=weight,
    )
  )


@pytest.fixture
def spectra_table():
  rng = np.random.default_rng(0)
  parts = []
  for data, ref, signed in (
    ("batch", "ggn", False),
    ("batch", "hessian", True),
    ("batches:8", "hessian", True),
  ):
    for step in STEPS:
      parts.append(
        _spectrum_rows(rng, ref, "exact", ref, METHODS[0], step, data, signed)
      )
      for method in METHODS:
        parts.append(
          _spectrum_rows(rng, method, "approx", ref, method, step, data, signed)
        )
  top = _spectrum_rows(
    rng, "ggn", "exact_top_k", "ggn", METHODS[0], 0, "batch", False, n=5
  ).assign(weight=np.nan)
  table = pd.concat([*parts, top], ignore_index=True)
  table.loc[3, "eigenvalue"] = np.inf
  table.loc[5, "weight"] = np.nan
  return table


def test_spectra_per_problem_data_and_reference(spectra_table, tmp_path):
  names = _written(spectra_figures.spectra(spectra_table, tmp_path), "spectra_")
  assert "spectra_mlp_batches-8_hessian.png" in names
  assert len(names) == 3 * 2


def test_spectra_of_an_older_table(spectra_table, tmp_path):
  old = spectra_table[
    (spectra_table.step == 0) & (spectra_table.data == "batch")
  ]
  old = old.drop(columns=["step", "data", "run"])
  names = _written(spectra_figures.spectra(old, tmp_path), "spectra_")
  assert names == {
    f"spectra_mlp_batch_{r}.{e}"
    for r in ("ggn", "hessian")
    for e in ("png", "pdf")
  }


def test_symlog_density_integrates_to_one_and_keeps_the_sign():
  rng = np.random.default_rng(1)
  lam = -(10.0 ** rng.uniform(-2, 2, 200))
  lam[:20] = 0.0
  linthresh = 1e-4 * np.abs(lam).max()
  u = spectra_figures.symlog(lam, linthresh)
  grid = np.linspace(u.min() - 1, u.max() + 1, 4000)
  density = spectra_figures.symlog_density(
    lam, np.full(lam.size, np.nan), grid, linthresh
  )
  assert np.trapezoid(density, grid) == pytest.approx(1.0, abs=1e-3)
  negative = grid < -0.5
  assert np.trapezoid(density[negative], grid[negative]) > 0.85
  x = spectra_figures.symlog_inverse(grid, linthresh)
  np.testing.assert_allclose(
    spectra_figures.symlog(x, linthresh), grid, atol=1e-9
  )
  assert (np.diff(x) > 0).all()


def test_symlog_density_of_a_positive_spectrum_with_weights():
  lam = np.array([1e-3, 1.0, 10.0])
  grid = np.linspace(-10, 10, 8001)
  density = spectra_figures.symlog_density(lam, [0.0, 0.0, 2.0], grid, 1e-6)
  assert np.trapezoid(density, grid) == pytest.approx(1.0, abs=1e-6)
  assert grid[np.argmax(density)] == pytest.approx(
    spectra_figures.symlog(10.0, 1e-6), abs=1e-2
  )
  assert np.trapezoid(density[grid < 0], grid[grid < 0]) < 1e-6


def test_block_boundaries():
  lines, names = spectra_figures.block_boundaries(
    ["a", "a", "a", "b", "c", "c"]
  )
  assert lines == [2.5, 3.5]
  assert names == [(1.0, "a"), (3.0, "b"), (4.5, "c")]
  assert spectra_figures.block_boundaries(["w"] * 4) == ([], [(1.5, "w")])


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
  return pd.DataFrame(
    dict(
      IDENTITY,
      method=method,
      step=step,
      data="batch",
      source=source,
      kind=kind,
      reference="ggn",
      row=row.ravel(),
      col=col.ravel(),
      row_block=b[row.ravel()],
      col_block=b[col.ravel()],
      value=m.ravel(),
    )
  )


def test_heatmaps_draw_exact_approx_and_inverses(tmp_path):
  blocks = ["dense_0"] * 5 + ["dense_1"] * 3 + ["out"] * 2
  runs = [(0, METHODS[0]), (10, METHODS[0]), (0, METHODS[1])]
  parts = [
    _heatmap_rows(blocks, step, source, kind, method)
    for step, method in runs
    for kind in ("matrix", "inverse")
    for source in ("exact", "approx")
  ]
  table = pd.concat(parts, ignore_index=True)
  table.loc[7, "value"] = np.nan
  names = _written(spectra_figures.heatmaps(table, tmp_path), "heatmaps_")
  assert "heatmaps_mlp_kfac-ggn_exact_batch_step10.png" in names
  assert len(names) == 3 * 2


def test_heatmaps_with_one_block_and_no_inverse(tmp_path):
  table = pd.concat(
    [
      _heatmap_rows(["w"] * 4, 0, s, "matrix", METHODS[0])
      for s in ("exact", "approx")
    ]
  )
  _written(spectra_figures.heatmaps(table, tmp_path), "heatmaps_")


def test_heatmap_lines_sit_at_block_boundaries():
  fig, ax = plt.subplots()
  rows, cols = spectra_figures.draw_blocks(ax, ["a", "a", "b"], ["a", "a", "b"])
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
          rows.append(
            dict(
              IDENTITY,
              method=method,
              step=step,
              data="batch",
              block=block,
              reference="ggn",
              metric=metric,
              value=rng.uniform(),
            )
          )
  table = pd.DataFrame(rows)
  table.loc[0, "value"] = np.inf
  table.loc[1, "value"] = np.nan
  if not with_location:
    table = table[table.block == "all"].drop(columns=["step", "data", "block"])
  return table


def test_quality_through_training(tmp_path):
  table = _quality_table(STEPS)
  names = _written(
    spectra_figures.quality_through_training(
      table, tmp_path, plots.colours(plots.series(table))
    ),
    "quality_steps_",
  )
  # A figure per metric: metrics differ in scale and direction.
  assert names == {
    f"quality_steps_mlp_batch_{metric}.{ext}"
    for metric in ("relative_frobenius", "log_wasserstein")
    for ext in ("png", "pdf")
  }


def test_quality_bars_for_one_step_and_older_tables(tmp_path):
  for table in (_quality_table([0]), _quality_table([0], False)):
    assert _written(spectra_figures.quality(table, tmp_path), "quality_") == {
      f"quality_mlp_{metric}.{ext}"
      for metric in ("relative_frobenius", "log_wasserstein")
      for ext in ("png", "pdf")
    }


def _statistics_table():
  rows = []
  for step in STEPS:
    for source, matrix in (("exact", "ggn"), ("approx", METHODS[0])):
      for stat in ("trace", "condition_number", "negative_ratio"):
        rows.append(
          dict(
            IDENTITY,
            method=METHODS[0],
            step=step,
            data="batch",
            source=source,
            matrix=matrix,
            statistic=stat,
            value=1.0 + step,
            stderr=0.1,
          )
        )
  table = pd.DataFrame(rows)
  table.loc[0, "stderr"] = np.nan
  table.loc[1, "value"] = np.inf
  return table


def test_the_spectra_measurement_draws_every_table_it_declares(
  spectra_table, tmp_path
):
  blocks = ["a"] * 3 + ["b"] * 3
  heat = pd.concat(
    [
      _heatmap_rows(blocks, 0, s, k, METHODS[0])
      for s in ("exact", "approx")
      for k in ("matrix", "inverse")
    ]
  )
  quality = pd.concat(
    [_quality_table(STEPS), _quality_table([0]).assign(problem="convnet")]
  )
  spectra = spectra_table[
    spectra_table.matrix.isin(["ggn", *METHODS])
    & (spectra_table.reference == "ggn")
  ]
  tables = dict(
    spectra=spectra,
    heatmaps=heat,
    quality=quality,
    statistics=_statistics_table(),
  )
  names = {
    p.stem
    for p in Spectra.figures(
      completed(tables), plots.colours(METHODS), tmp_path
    )
  }
  assert {
    "spectra_mlp_batch_ggn",
    "heatmaps_mlp_kfac-ggn_exact_batch_step0",
    "quality_steps_mlp_batch_relative_frobenius",
    "quality_convnet_relative_frobenius",
    "statistics_mlp_trace",
  } <= names
  assert not any(n.startswith("quality_mlp") for n in names)


def test_tuned_curves_are_chosen_per_problem():
  """Each problem keeps its own best setting; untuned methods stay."""
  train = pd.DataFrame(
    [
      dict(problem=p, method=m, label=f"{m} ({s})" if s else m, step=0)
      for p in ("a", "b")
      for m, s in (("sgd", "lr=0.1"), ("sgd", "lr=1"), ("kfac", ""))
    ]
  )
  tuning = pd.DataFrame(
    dict(
      problem=["a", "a", "b", "b"],
      method="sgd",
      setting=["lr=0.1", "lr=1"] * 2,
      best=[True, False, False, True],
    )
  )
  kept = training_figures.tuned_curves(train, tuning)
  assert sorted(zip(kept.problem, kept.label)) == [
    ("a", "kfac"),
    ("a", "sgd (lr=0.1)"),
    ("b", "kfac"),
    ("b", "sgd (lr=1)"),
  ]


# --- what the figures draw ---------------------------------------------------

LONG = [
  f"{m}[{m}/ggn_exact] (initial_damping={d})"
  for m in ("kfac", "ekfac", "tkfac", "diagonal", "full")
  for d in (0.1, 1.0)
]


def test_spectra_overlay_each_step_on_the_exact_spectrum(
  spectra_table, drawn, tmp_path
):
  spectra_figures.spectra(spectra_table, tmp_path)
  fig = drawn["spectra_mlp_batch_hessian"]
  panels = [ax for ax in fig.axes if ax.get_visible()]
  assert len(panels) == len(STEPS)
  for ax, step in zip(panels, STEPS):
    exact = [c for c in ax.collections if isinstance(c, PolyCollection)]
    assert [c.get_label() for c in exact] == ["exact hessian"]
    assert {line.get_label() for line in ax.lines} >= set(METHODS)
    title = ax.get_title()
    for words in ("mlp", "hessian", "batch", f"step {step}"):
      assert words in title, title
  colours = {line.get_label(): line.get_color() for line in panels[0].lines}
  assert colours[METHODS[0]] != colours[METHODS[1]]
  assert [t.get_text() for t in _legend_outside(fig).get_texts()] == [
    "exact hessian",
    *sorted(METHODS),
  ]


def test_every_quality_metric_says_which_way_is_better():
  rng = np.random.default_rng(4)
  a = rng.normal(size=(4, 4))
  a = a @ a.T + np.eye(4)
  b = a + 0.1 * np.eye(4)
  measured = compute.dense_metrics(
    a,
    b,
    {1e-3: np.ones(4)},
    {1e-3: np.ones(4)},
    2,
    1e-12,
    np.linalg.eigh(a),
    np.linalg.eigh(b),
  )
  assert {k[0] if isinstance(k, tuple) else k for k in measured} == set(
    metrics.QUALITY
  )
  assert metrics.title("relative_frobenius") == (
    "Relative Frobenius error ‖Ĉ − C‖ / ‖C‖ (lower is better)"
  )
  assert metrics.title("natural_gradient_cosine (rho=0.001)").startswith(
    "Natural-gradient cosine, damped Ĉ⁻¹g against C⁻¹g, at ρ = 0.001"
  )
  assert metrics.title("log_wasserstein").endswith("(decades, lower is better)")
  assert "higher is better" in metrics.title(
    "natural_gradient_cosine (rho=0.001)"
  )
  assert "1 is best" in metrics.title("trace_ratio")


def test_quality_titles_name_where_and_which_way(drawn, tmp_path):
  spectra_figures.quality(_quality_table([10]), tmp_path)
  for metric in ("relative_frobenius", "log_wasserstein"):
    fig = drawn[f"quality_mlp_{metric}"]
    for words in ("mlp", "ggn", "batch", "step 10"):
      assert words in fig.get_suptitle(), fig.get_suptitle()
    (ax,) = fig.axes
    assert ax.get_title() == metrics.title(metric)
    assert "lower is better" in ax.get_title()
    _legend_outside(fig)


def _many_methods_quality():
  """Ten labelled methods (five methods, two settings each), one of them
  measured with a ratio metric whose best value is 1."""
  rows = [
    dict(
      IDENTITY,
      method=label.split(" ")[0],
      label=label,
      step=step,
      data="batch",
      block=block,
      reference="ggn",
      metric=metric,
      value=1.0 + i + step / 100,
    )
    for i, label in enumerate(LONG)
    for step in STEPS
    for block in ("all", "dense_0")
    for metric in ("relative_frobenius", "top_eigenvalue_ratio")
  ]
  return pd.DataFrame(rows)


def test_quality_through_training_with_ten_methods(drawn, tmp_path):
  table = _many_methods_quality()
  spectra_figures.quality_through_training(
    table, tmp_path, plots.colours(plots.series(table))
  )
  fig = drawn["quality_steps_mlp_batch_relative_frobenius"]
  assert "mlp" in fig.get_suptitle() and "ggn" in fig.get_suptitle()
  (ratio,) = drawn["quality_steps_mlp_batch_top_eigenvalue_ratio"].axes
  assert ratio.get_title().endswith("(1 is best)\nvs exact ggn")
  assert any(list(line.get_ydata()) == [1.0, 1.0] for line in ratio.lines)
  legend = _legend_outside(fig)
  texts = [t.get_text() for t in legend.get_texts()]
  assert texts == [*sorted(LONG), "block dense_0"]
  assert legend.get_texts()[0].get_fontsize() <= 8
  colours = {h.get_color() for h in legend.legend_handles[: len(LONG)]}
  assert len(colours) == len(LONG)  # two settings of a method: two shades


def test_palette_tells_ten_methods_apart():
  assert len(set(plots.colours(LONG).values())) == 10


def test_statistics_of_one_step_are_bars(drawn, tmp_path):
  table = _statistics_table()
  table = table[table.step == 10].assign(value=[1e-3, 1.0, 2.0, 5.0, 1e2, 3.0])
  spectra_figures.statistics(table, tmp_path)
  panels = {}
  for name in ("trace", "condition_number", "negative_ratio"):
    fig = drawn[f"statistics_mlp_{name}"]
    for words in ("mlp", "batch", "step 10"):
      assert words in fig.get_suptitle(), fig.get_suptitle()
    (panels[name],) = fig.axes
    assert panels[name].get_title() == metrics.title(name)
  for ax in panels.values():
    assert len(ax.patches) == 2  # exact and approximation
    assert [t.get_text() for t in ax.get_xticklabels()] == [
      "exact ggn",
      METHODS[0],
    ]
    assert ax.get_ylim()[1] > 0.5  # not a degenerate axis around 0
  assert panels["trace"].get_yscale() == "log"  # 1e-3 to 1e2


def test_statistics_along_training_are_lines(drawn, tmp_path):
  spectra_figures.statistics(_statistics_table(), tmp_path)
  fig = drawn["statistics_mlp_trace"]
  assert "over steps 0-1000" in fig.get_suptitle()
  ax = fig.axes[0]
  assert not ax.patches and len(ax.lines) >= 2
  assert ax.get_xlabel() == "Training step"
  _legend_outside(fig)


def _timing_ratios():
  """Two labels' phase ratios (as `phase_ratios` gives them): the median
  and quartiles of their paired ratios to the Adam step."""
  rows = []
  for label, mode, n, scale in (
    ("kfac[kfac/ggn_exact]", "ggn_exact", 3, 1.0),
    ("sgd", None, 1, 0.8),
  ):
    for phase, (median, q25, q75) in (
      ("grad_step", (0.5, 0.45, 0.6)),
      ("optimizer_step", (5.0, 4.5, 5.5)),
      ("baseline_step", (1.0, 1.0, 1.0)),
    ):
      rows.append(
        dict(
          problem="mlp",
          device_kind="cpu",
          label=label,
          mode=mode,
          phase=phase,
          baseline="adam",
          median=median * scale,
          q25=q25 * scale,
          q75=q75 * scale,
          n=n,
          samples=10 * n,
        )
      )
  return pd.DataFrame(rows)


def _bars(ax, phase):
  """Heights and error-bar ends of a phase's bars."""
  bars = next(
    c
    for c in ax.containers
    if isinstance(c, BarContainer) and c.get_label() == phase.replace("_", " ")
  )
  assert isinstance(bars.errorbar, ErrorbarContainer)
  ends = [sorted(seg[:, 1]) for seg in bars.errorbar.lines[2][0].get_segments()]
  return [p.get_height() for p in bars.patches], ends


def test_timing_in_baseline_steps_with_interquartile_error_bars(
  drawn, tmp_path
):
  timing_figures.timing(_timing_ratios(), tmp_path)
  ax = drawn["timing_mlp"].axes[0]
  assert ax.get_ylabel() == "Time per phase (× one adam step, lower is better)"
  assert [t.get_text() for t in ax.get_xticklabels()] == [
    "kfac[kfac/ggn_exact]\n(3 runs, 30 rounds)",
    "sgd\n(1 runs, 10 rounds)",
  ]
  heights, ends = _bars(ax, "optimizer_step")
  np.testing.assert_allclose(heights, [5.0, 4.0])
  np.testing.assert_allclose(ends, [[4.5, 5.5], [3.6, 4.4]])
  heights, ends = _bars(ax, "grad_step")
  np.testing.assert_allclose(heights, [0.5, 0.4])
  np.testing.assert_allclose(ends[0], [0.45, 0.6])
  assert "baseline_step" not in {c.get_label() for c in ax.containers}
  assert "mlp" in ax.get_title() and "cpu" in ax.get_title()
  assert "K-FAC in ggn_exact" in ax.get_title()  # the mode it was timed in
  _legend_outside(drawn["timing_mlp"])


def test_training_legend_of_ten_methods_sits_outside(drawn, tmp_path):
  rows = [
    dict(
      problem="mlp",
      method=label.split(" ")[0],
      label=label,
      run_id=f"{label}{seed}",
      step=step,
      wall_s=0.1 * step,
      train_error=1.0 / (1 + step + i),
    )
    for i, label in enumerate(LONG)
    for seed in range(2)
    for step in range(0, 50, 10)
  ]
  table = pd.DataFrame(rows)
  training_figures.training(table, tmp_path, plots.colours(plots.series(table)))
  fig = drawn["training_mlp"]
  legend = _legend_outside(fig)
  assert fig.axes[0].get_legend() is legend
  assert len(legend.get_texts()) == len(LONG)


def test_training_curves_end_where_every_seed_has_a_value(drawn, tmp_path):
  """Seeds trained to a time budget end at different steps: the median is
  drawn to the last step all reached, a diverged seed aside."""
  rows = [
    dict(
      problem="mlp",
      method="adam",
      label="adam",
      run_id=run,
      step=step,
      wall_s=0.1 * step,
      train_error=1.0 / (1 + step),
      diverged=run == "c" and step == end,
    )
    for run, end in (("a", 30), ("b", 50), ("c", 10))
    for step in range(0, end + 1, 10)
  ]
  training_figures.training(pd.DataFrame(rows), tmp_path, {"adam": "C0"})
  steps_axis = drawn["training_mlp"].axes[0]
  assert max(steps_axis.lines[0].get_xdata()) == 30


def test_a_psd_spectrum_has_no_density_below_zero(
  spectra_table, drawn, tmp_path
):
  """Smoothing reflects a PSD spectrum's kernels at zero: nothing spills
  below it, the density still integrates to one, and a figure of PSD
  matrices only starts its axis at zero."""
  lam = np.array([0.0, 1e-12, 1e-3, 1.0, 10.0])
  density = lambda grid: spectra_figures.symlog_density(
    lam, np.full(5, 0.2), grid, 1e-6, nonnegative=True
  )
  assert (density(np.linspace(-5, -1e-9, 100)) == 0).all()
  grid = np.linspace(0, 12, 8001)
  assert np.trapezoid(density(grid), grid) == pytest.approx(1.0, abs=1e-4)
  assert spectra_figures.nonnegative([-1e-14, 0.0, 2.0])
  assert not spectra_figures.nonnegative([-0.1, 2.0])
  spectra_figures.spectra(spectra_table, tmp_path)
  psd = drawn["spectra_mlp_batch_ggn"].axes[0]
  assert psd.get_xlim()[0] >= 0
  signed = drawn["spectra_mlp_batch_hessian"].axes[0]
  assert signed.get_xlim()[0] < 0


def test_one_colour_per_method_in_every_figure():
  """A label has one colour wherever it is drawn; K-FAC's curvature and the
  K-FAC optimizer using it share a hue, which a component declares."""
  labels = [
    "kfac/ggn_exact",
    "kfac[kfac/ggn_exact]",
    "adam",
    "diagonal/ggn_exact",
    "kfac[diagonal/ggn_exact]",
    "kfac/fisher_gradients",
    "mine/ggn_exact",
  ]
  colour = plots.colours(
    labels, {"kfac": "tab:red", "adam": "tab:blue"}, {"adam": "+"}
  )
  assert colour["kfac/ggn_exact"] == colour["kfac[kfac/ggn_exact]"]
  assert colour["diagonal/ggn_exact"] == colour["kfac[diagonal/ggn_exact]"]
  assert colour["adam"] == "#1f77b4" and colour.marker["adam"] == "+"
  assert (
    colour.marker["kfac/ggn_exact"] == colour.marker["kfac[kfac/ggn_exact]"]
  )
  assert colour["kfac/fisher_gradients"] != colour["kfac/ggn_exact"]
  assert (
    len(
      {
        colour[x]
        for x in (
          "kfac/ggn_exact",
          "diagonal/ggn_exact",
          "adam",
          "mine/ggn_exact",
        )
      }
    )
    == 4
  )


def test_training_against_seconds_reads_the_time_grid(drawn, tmp_path):
  """Runs with a time grid: against seconds, one point per grid second
  (every seed evaluated there); against steps, the evaluations every seed
  makes at the same steps, the grid rows (each seed's own step) left
  out."""

  def row(seed, step, step_s, time_point_s):
    return dict(
      problem="mlp",
      method="adam",
      label="adam",
      run_id=f"s{seed}",
      step=step,
      wall_s=step * step_s,
      train_error=1.0 / (1 + step),
      time_point_s=time_point_s,
    )

  rows = []
  for seed, step_s in enumerate((0.01, 0.012, 0.015)):
    for step in range(0, 101, 10):
      rows.append(row(seed, step, step_s, 0.0 if step == 0 else np.nan))
    for t in (0.25, 0.5, 0.75, 1.0):
      rows.append(row(seed, int(t / step_s), step_s, t))
  training_figures.training(pd.DataFrame(rows), tmp_path, {"adam": "C0"})
  steps, seconds = drawn["training_mlp"].axes[:2]
  assert list(steps.lines[0].get_xdata()) == list(range(0, 101, 10))
  assert list(seconds.lines[0].get_xdata()) == [0.0, 0.25, 0.5, 0.75, 1.0]
  assert "the time grid" in seconds.get_xlabel()


# --- figures for papers ---------------------------------------------------------


def test_every_method_stands_apart_in_colour_or_marker():
  """Over every registered curvature and optimizer (more methods than any
  colour-blind-safe palette has hues), two methods either differ in colour
  by `palette.MIN_DELTA_E` (CIE76) or carry different markers; and no two
  share both. The declared hues are the palette's own, so colour-blind
  safety is the palette's."""
  names = sorted({*CURVATURES, *OPTIMIZERS})
  assert len(names) >= 15
  looks = colour_map({"runs": pd.DataFrame({"method": names})})
  declared = {
    c.colour
    for r in (CURVATURES, OPTIMIZERS)
    for c in map(r.get, r)
    if c.colour
  }
  assert declared <= {*palette.HUES, palette.BLACK, palette.GREY}
  close = 0
  component = {
    n: (CURVATURES if n in CURVATURES else OPTIMIZERS).get(n) for n in names
  }
  for i, a in enumerate(names):
    for b in names[i + 1 :]:
      if component[a] is component[b]:  # one method under two names
        continue
      assert (looks[a], looks.marker[a]) != (looks[b], looks.marker[b]), (a, b)
      if palette.delta_e(looks[a], looks[b]) < palette.MIN_DELTA_E:
        close += 1
        assert looks.marker[a] != looks.marker[b], (a, b)
  # EKFAC and Shampoo² were two near-identical purples.
  assert palette.delta_e(looks["ekfac"], looks["shampoo2"]) >= 40
  assert close < len(names)  # sharing a hue is the exception


def test_palette_hues_are_far_apart():
  hues = palette.HUES
  gaps = [
    palette.delta_e(a, b) for i, a in enumerate(hues) for b in hues[i + 1 :]
  ]
  assert min(gaps) >= palette.MIN_DELTA_E
  assert palette.delta_e("#000000", "#ffffff") == pytest.approx(100, abs=0.1)
  assert len(set(palette.HATCHES)) == len(palette.MARKERS)


def test_bars_carry_their_methods_hatch(drawn, tmp_path):
  table = _quality_table([0])
  looks = plots.colours(plots.series(table), markers={"diagonal": "s"})
  spectra_figures.quality(table, tmp_path, looks)
  (ax,) = drawn["quality_mlp_relative_frobenius"].axes
  hatches = {
    c.get_label(): c.patches[0].get_hatch()
    for c in ax.containers
    if isinstance(c, BarContainer)
  }
  assert hatches["diagonal/ggn_exact"] == palette.hatch("s") == "//"
  assert hatches["kfac/ggn_exact"] != hatches["diagonal/ggn_exact"]


def test_each_figure_has_its_rows_as_csv_beside_it(tmp_path):
  table = _quality_table([0])
  paths = spectra_figures.quality(table, tmp_path)
  for png in (p for p in paths if p.suffix == ".png"):
    rows = pd.read_csv(png.with_suffix(".csv"))
    metric = png.stem.removeprefix("quality_mlp_")
    assert set(rows.metric) == {metric} and len(rows) > 0
  # Where a figure is not given its rows, the points its panels show.
  fig, (ax,) = plots.grid(1)
  ax.plot([1, 2], [3, 4], label="kfac")
  ax.bar([0], [5.0], label="adam")
  ax.set_xticks([0], ["group"])
  ax.set(title="t", xlabel="step", ylabel="error")
  plots.save(fig, tmp_path / "drawn")
  rows = pd.read_csv(tmp_path / "drawn.csv")
  assert rows[["series", "x", "y"]].astype(str).values.tolist() == [
    ["kfac", "1", "3.0"],
    ["kfac", "2", "4.0"],
    ["adam", "group", "5.0"],
  ]
  assert set(rows.y_label) == {"error"}


@pytest.mark.parametrize(
  ("style", "width"), [("one-column", 3.25), ("two-column", 6.75)]
)
def test_a_paper_style_sets_the_figure_width(drawn, tmp_path, style, width):
  table = _quality_table(STEPS)
  with plots.style(style):
    spectra_figures.quality_through_training(table, tmp_path, {})
    fig, axes = plots.grid(6)
    assert fig.get_figwidth() == pytest.approx(width)
    assert len({ax.get_position().x0 for ax in axes}) == (
      1 if style == "one-column" else 3
    )
    assert plt.rcParams["font.size"] == 8
  fig = drawn["quality_steps_mlp_batch_relative_frobenius"]
  assert fig.get_figwidth() == pytest.approx(width)
  with plots.style():
    assert plots.grid(1)[0].get_figwidth() == 4.0  # the screen's, as before
  with pytest.raises(ValueError, match="one-column"):
    with plots.style("a4"):
      pass


def test_quantities_are_titled_in_words():
  for name in (*metrics.QUALITY, *metrics.STATISTICS, *metrics.TRAINING):
    title = metrics.title(name)
    assert name not in title and "_" not in title, title
  assert metrics.title("final_train_error") == (
    "Final training error (fraction misclassified, lower is better)"
  )
  assert metrics.title("unheard_of") == "Unheard of"
