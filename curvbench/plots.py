"""Figures of a merged sweep's tables, each saved as PNG and PDF; the
measurements (`curvbench.measurements`) pick the ones of their tables.

- spectra: per problem, data and exact matrix, a panel per training step:
  the exact matrix's signed eigenvalue density (symlog axis) as a grey
  filled reference, each approximation of it a coloured line over it
- heatmaps: |entries| of the exact and approximate matrix and of their
  inverses on a subsample of parameters (Martens & Grosse 2015, Fig. 2)
- quality: a panel per metric, bars per method (one step) or lines against
  the step (several); each panel says which way is better (`BETTER`)
- quality per block type: a panel per metric, a bar group per block type
  (attention, MLP, ...), a bar per method
- statistics: spectral statistics, bars per matrix (one step) or lines
  against the step (several)
- training: training error (median and quartiles over seeds) against
  iterations and against seconds; with a tuning sweep, the best settings,
  every setting, and the score against each tuned hyperparameter
- timing: time per phase as a multiple of the same run's Adam step, the
  median over runs with the interquartile range

Every title names the problem and, where the table has them, the exact
reference matrix, the data and the step (`_title`). Figures of many lines
hold one legend below their panels (`_legend_below`). Each method has one
colour in every figure (`palette`); several settings of a method are shades
of it (`_series_colours`).

Tables written before curvature was measured along training lack `step`,
`data` and `block`; they read as step 0, data "batch" and block "all".
Quality tables written before block types lack `level`; it is read from
`block` (`quality_levels`).
"""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib import colors, layout_engine, scale, ticker  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from curvbench import aggregate, metrics  # noqa: E402
from curvbench.timing import BASELINE_PHASE, PHASES  # noqa: E402

DEFAULTS = dict(step=0, data="batch", block="all")
LEGEND_FONTSIZE = 7

# Which way each approximation-quality metric is better (`curvbench.spectra`).
BETTER = {"relative_frobenius": "lower is better",
          "spectral_distance": "lower is better",
          "log_wasserstein": "lower is better",
          "diagonal_relative_error": "lower is better",
          "natural_gradient_cosine": "higher is better",
          "top_k_overlap": "higher is better",
          "top_eigenvalue_ratio": "1 is best",
          "trace_ratio": "1 is best"}


def save(fig, path: Path) -> list[Path]:
  """Writes `fig` as PNG and PDF at `path` (suffix replaced), closes it."""
  path.parent.mkdir(parents=True, exist_ok=True)
  _constrained(fig)
  paths = [path.with_suffix(".png"), path.with_suffix(".pdf")]
  for p in paths:
    fig.savefig(p, dpi=120)
  plt.close(fig)
  return paths


def _constrained(fig) -> layout_engine.ConstrainedLayoutEngine:
  """`fig`'s constrained layout engine, set where it has none."""
  if not isinstance(fig.get_layout_engine(),
                    layout_engine.ConstrainedLayoutEngine):
    fig.set_layout_engine("constrained")
  return fig.get_layout_engine()


def _grid(n, width=4.0, height=3.0, cols=3, **kw):
  cols = min(cols, n)
  rows = -(-n // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows),
                           squeeze=False, layout="constrained", **kw)
  for ax in axes.flat[n:]:
    ax.set_visible(False)
  return fig, axes.flat


def _slug(*parts) -> str:
  """A file-name stem from labels such as "kfac/ggn_exact" or "batches:8"."""
  return "_".join(re.sub(r"[^A-Za-z0-9_.-]+", "-", str(p)) for p in parts)


def _values(rows: pd.DataFrame, column: str) -> str:
  return ", ".join(sorted({str(v) for v in rows[column].dropna()}))


def _title(what: str, rows: pd.DataFrame) -> str:
  """`what` placed by the problem, exact reference, data and step of `rows`
  (those columns it has; several values listed), e.g. "mlp: quality vs
  exact ggn on batch at step 10"."""
  parts = [f"{_values(rows, 'problem')}: {what}"]
  if "reference" in rows and rows.reference.notna().any():
    parts.append(f"vs exact {_values(rows, 'reference')}")
  if "data" in rows and rows.data.notna().any():
    parts.append(f"on {_values(rows, 'data')}")
  if "step" in rows and rows.step.notna().any():
    steps = sorted({int(s) for s in rows.step.dropna()})
    parts.append(f"at step {steps[0]}" if len(steps) == 1
                 else f"over steps {steps[0]}-{steps[-1]}")
  return " ".join(parts)


def _figure_handles(fig) -> tuple[list, list[str]]:
  """The labelled artists of every panel of `fig`, once per label."""
  found = {}
  for ax in fig.axes:
    for handle, label in zip(*ax.get_legend_handles_labels()):
      found.setdefault(label, handle)
  return list(found.values()), list(found)


def _legend_below(fig, ax, handles=None, labels=None, title=None):
  """The figure's one legend, below its panels in as many columns as fit
  its width, the figure made taller to hold it; it is `ax`'s legend.
  `handles` default to the labelled artists of every panel."""
  if handles is None:
    handles, labels = _figure_handles(fig)
  if not handles:
    return None
  kw = {"loc": "upper center", "bbox_transform": fig.transFigure,
        "bbox_to_anchor": (0.5, 0), "fontsize": LEGEND_FONTSIZE,
        "frameon": False}
  renderer = fig.canvas.get_renderer()
  column = ax.legend(handles, labels, ncol=1, **kw).get_window_extent(
      renderer).width / fig.dpi
  ncol = int(np.clip(0.95 * fig.get_figwidth() // column, 1, len(handles)))
  legend = ax.legend(handles, labels, ncol=ncol, title=title,
                     title_fontsize=LEGEND_FONTSIZE, **kw)
  legend.set_in_layout(False)
  height = legend.get_window_extent(renderer).height / fig.dpi + 0.1
  fig.set_figheight(fig.get_figheight() + height)
  below = height / fig.get_figheight()
  legend.set_bbox_to_anchor((0.5, below), transform=fig.transFigure)
  _constrained(fig).set(rect=(0, below, 1, 1 - below))
  return legend


def _complete(df: pd.DataFrame, *columns: str) -> pd.DataFrame:
  """`df` with the named location columns filled in for older tables."""
  df = df.copy()
  for col in columns:
    df[col] = df[col].fillna(DEFAULTS[col]) if col in df else DEFAULTS[col]
  if "step" in columns:
    df["step"] = df["step"].astype(int)
  return df


def _finite(df: pd.DataFrame, *columns: str) -> pd.DataFrame:
  """`df` with inf read as NaN in `columns`."""
  df = df.copy()
  for col in columns:
    df[col] = pd.to_numeric(df[col], errors="coerce").replace(
        [np.inf, -np.inf], np.nan)
  return df


def _one_run(df: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
  """Rows of one run per group of `keys` (runs may repeat a measurement)."""
  run = next((c for c in ("run", "run_dir") if c in df), None)
  if run is None or df.empty:
    return df
  first = df.groupby(keys, dropna=False)[run].transform("first")
  return df[df[run].astype(str) == first.astype(str)]


def _series(df: pd.DataFrame) -> pd.Series:
  """What a line or bar stands for: the row's label (method and setting),
  else its method."""
  method = df["method"].astype(str)
  if "label" not in df:
    return method
  return df["label"].where(df["label"].notna() & (df["label"] != ""),
                           method).astype(str)


def _shade(colour: str, i: int, n: int) -> str:
  """The `i`-th of `n` shades of `colour`, darker to lighter."""
  if n == 1:
    return colour
  t = -0.45 + 0.9 * i / (n - 1)
  rgb = np.asarray(colors.to_rgb(colour))
  return colors.to_hex(rgb + abs(t) * (float(t > 0) - rgb))


def _series_colours(df: pd.DataFrame, colour: dict[str, str] | None,
                    series: str = "series") -> dict[str, str]:
  """A colour per value of `df[series]`: its method's (`colour`, else
  `palette`), in shades where a method has several."""
  colour = {**palette(df["method"]), **(colour or {})}
  out = {}
  for method, names in df.groupby(df["method"].astype(str))[series]:
    names = sorted(set(names))
    for i, name in enumerate(names):
      out[name] = _shade(colour[method], i, len(names))
  return out


def _log_if_decades(ax, values, axis="y", decades=2):
  """A log scale on `axis` where the finite `values` are positive and span
  `decades` decades or more."""
  v = np.asarray(values, np.float64)
  v = v[np.isfinite(v)]
  if v.size and v.min() > 0 and v.max() >= 10.0 ** decades * v.min():
    (ax.set_yscale if axis == "y" else ax.set_xscale)("log")


def _no_values(ax, text="no finite values"):
  ax.text(0.5, 0.5, text, ha="center", transform=ax.transAxes)


def _step_axis(ax, steps):
  """x = training step; symlog when the steps span two decades or more."""
  positive = np.asarray([s for s in steps if s > 0])
  if positive.size and positive.max() >= 100 * positive.min():
    ax.set_xscale("symlog", linthresh=positive.min())
    ax.set_xlim(left=-0.2 * positive.min())
  ax.set_xlabel("training step")


def _step_panel(ax, title, steps):
  """Finishes a panel drawn against the training step."""
  ax.set_title(title, fontsize=8)
  _step_axis(ax, steps)
  ax.tick_params(labelsize=7)


# --- signed spectral densities -----------------------------------------------


def symlog(values, linthresh: float) -> np.ndarray:
  """matplotlib's symlog coordinate divided by `linthresh`: one unit per
  decade beyond the threshold, linear (through 0) within it."""
  t = scale.SymmetricalLogTransform(10, linthresh, 1)
  return t.transform(np.asarray(values, np.float64)) / linthresh


def symlog_inverse(u, linthresh: float) -> np.ndarray:
  """The eigenvalues at symlog coordinates `u`."""
  t = scale.SymmetricalLogTransform(10, linthresh, 1).inverted()
  return t.transform(np.asarray(u, np.float64) * linthresh)


def symlog_density(eigenvalues, weights, grid, linthresh: float,
                   bandwidth: float = 0.1) -> np.ndarray:
  """Gaussian-smoothed density of a signed spectrum per unit of the symlog
  coordinate, at `grid` (in that coordinate); NaN weights count as uniform."""
  lam = np.asarray(eigenvalues, np.float64)
  w = np.asarray(weights, np.float64)
  keep = np.isfinite(lam)
  lam, w = lam[keep], w[keep]
  if lam.size == 0:
    return np.zeros(len(grid))
  w = np.where(np.isfinite(w) & (w >= 0), w, 1.0 / lam.size)
  if w.sum() <= 0:
    w = np.ones_like(lam)
  return metrics.density(symlog(lam, linthresh), w, grid, bandwidth)


def _pooled_weights(df: pd.DataFrame, keys: list[str]) -> pd.Series:
  """Weights normalised within each run, so runs count equally when pooled."""
  w = df["weight"] if "weight" in df else pd.Series(np.nan, df.index)
  n = df.groupby(keys, dropna=False)["eigenvalue"].transform("size")
  w = w.fillna(1.0 / n).clip(lower=0)
  total = w.groupby([df[k] for k in keys], dropna=False).transform("sum")
  return (w / total.where(total > 0)).fillna(1.0 / n)


def _spectra_rows(df: pd.DataFrame) -> pd.DataFrame:
  """The exact and approximate spectra (one run of each exact matrix per
  step and seed), each row's `series` ("exact" or the approximation's
  label) and its pooling weight `w`."""
  df = _complete(df, "step", "data")
  df = _finite(df, "eigenvalue")
  df = df[df.source.isin(["exact", "approx"]) & df.eigenvalue.notna()]
  exact = df.source == "exact"
  if "reference" not in df:
    df["reference"] = np.nan
  df["reference"] = df.reference.where(~exact, df.matrix)
  df["series"] = _series(df).where(~exact, "exact")
  same = ["problem", "data", "matrix", "step", *(["seed"] if "seed" in df
                                                 else [])]
  df = pd.concat([_one_run(df[exact], same), df[~exact]])
  run = [c for c in ("seed", "run", "run_dir") if c in df]
  df["w"] = _pooled_weights(df, ["step", "series", *run]) if len(df) else []
  return df


def _symlog_axis(ax, linthresh: float):
  """x = eigenvalue on a symlog axis with ticks at whole decades."""
  ax.axvline(0, color="0.4", lw=0.6, ls=":")
  ax.set_xscale("symlog", linthresh=linthresh)
  ax.xaxis.set_major_locator(ticker.SymmetricalLogLocator(
      base=10, linthresh=linthresh, subs=[1.0]))
  ax.xaxis.get_major_locator().set_params(numticks=7)
  ax.xaxis.set_minor_locator(ticker.NullLocator())
  ax.set(xlabel="eigenvalue", ylabel="density (per symlog unit)")
  ax.tick_params(labelsize=6)


def _overlay(ax, x, curves: dict, floor: float, colour: dict[str, str],
             reference: str):
  """One step's panel: the exact density filled grey, each approximation's
  a coloured line over it."""
  if "exact" in curves:
    exact = np.maximum(curves["exact"], floor)
    ax.fill_between(x, floor, exact, color="0.82", lw=0,
                    label=f"exact {reference}")
    ax.plot(x, exact, color="0.45", lw=0.7)
  for name in sorted(set(curves) - {"exact"}):
    ax.plot(x, np.maximum(curves[name], floor), lw=1.2, color=colour[name],
            label=name)
  if not curves:
    _no_values(ax, "no spectrum")


def spectra(df: pd.DataFrame, out: Path, linthresh_fraction: float = 1e-4,
            bandwidth: float = 0.1,
            colour: dict[str, str] | None = None) -> list[Path]:
  """Per problem, data and exact matrix, a panel per training step: the
  exact matrix's signed density with each approximation's over it
  (`colour`: by method, default `palette`)."""
  paths = []
  df = _spectra_rows(df)
  colours = _series_colours(df[df.series != "exact"], colour)
  for (problem, data, ref), p in df.groupby(["problem", "data", "reference"]):
    top = np.abs(p.eigenvalue).max()
    small = linthresh_fraction * top if top > 0 else 1.0
    linthresh = 10.0 ** np.floor(np.log10(small))  # ticks at whole decades
    u = symlog(p.eigenvalue, linthresh)
    grid = np.linspace(u.min() - 4 * bandwidth, u.max() + 4 * bandwidth, 600)
    curves = {key: symlog_density(q.eigenvalue, q.w, grid, linthresh,
                                  bandwidth)
              for key, q in p.groupby(["step", "series"])}
    peak = max((c.max() for c in curves.values()), default=1.0) or 1.0
    floor = 1e-5 * peak
    steps = sorted(p.step.unique())
    fig, axes = _grid(len(steps), width=4.5, sharex=True, sharey=True)
    for ax, step in zip(axes, steps):
      _overlay(ax, symlog_inverse(grid, linthresh),
               {s: c for (t, s), c in curves.items() if t == step}, floor,
               colours, ref)
      _symlog_axis(ax, linthresh)
      ax.set_yscale("log")
      ax.set_ylim(floor, 2 * peak)
      ax.set_title(_title("spectra", p[p.step == step]), fontsize=8)
    _legend_below(fig, axes[0])
    paths += save(fig, out / f"spectra_{_slug(problem, data, ref)}")
  return paths


# --- heatmaps ----------------------------------------------------------------


def block_boundaries(blocks) -> tuple[list[float], list[tuple[float, str]]]:
  """Where consecutive positions change block (between them, at i - 0.5) and
  each block's centre and name, for labels along `blocks` in order."""
  blocks = [str(b) for b in blocks]
  cuts = [i for i in range(1, len(blocks)) if blocks[i] != blocks[i - 1]]
  starts, ends = [0, *cuts], [*cuts, len(blocks)]
  lines = [c - 0.5 for c in cuts]
  names = [((s + e - 1) / 2, blocks[s]) for s, e in zip(starts, ends)]
  return lines, names


def _square(rows: pd.DataFrame):
  """The matrix of `rows` (row, col, value) and its row and column blocks."""
  n = int(max(rows.row.max(), rows.col.max())) + 1
  m = rows.pivot_table(index="row", columns="col", values="value",
                       aggfunc="mean").reindex(index=range(n), columns=range(n))
  row_blocks = rows.groupby("row").row_block.first().reindex(range(n))
  col_blocks = rows.groupby("col").col_block.first().reindex(range(n))
  return (m.to_numpy(np.float64), row_blocks.fillna("?").tolist(),
          col_blocks.fillna("?").tolist())


def draw_blocks(ax, row_blocks, col_blocks):
  """Thin lines at block boundaries and block names as tick labels."""
  rows, row_names = block_boundaries(row_blocks)
  cols, col_names = block_boundaries(col_blocks)
  for y in rows:
    ax.axhline(y, color="k", lw=0.4)
  for x in cols:
    ax.axvline(x, color="k", lw=0.4)
  ax.set_yticks([c for c, _ in row_names], [n for _, n in row_names],
                fontsize=5)
  ax.set_xticks([c for c, _ in col_names], [n for _, n in col_names],
                fontsize=5, rotation=90)
  return rows, cols


def _log_norm(mats) -> colors.LogNorm:
  vals = np.concatenate([m[np.isfinite(m) & (m > 0)] for m in mats]
                        + [np.empty(0)])
  if vals.size == 0:
    return colors.LogNorm(1e-12, 1.0)
  hi = vals.max()
  return colors.LogNorm(max(vals.min(), 1e-10 * hi), hi)


def heatmaps(df: pd.DataFrame, out: Path) -> list[Path]:
  """Per problem, method, step and data: |exact| and |approximate| matrix
  (top) and their inverses (bottom), one log colour scale per row."""
  paths = []
  df = _finite(_complete(df, "step", "data"), "value")
  where = ["problem", "step", "data", "reference"]
  exact, approx = df[df.source == "exact"], df[df.source == "approx"]
  for (problem, method, ref, step, data), a in approx.groupby(
      ["problem", "method", "reference", "step", "data"]):
    e = exact[(exact.problem == problem) & (exact.reference == ref)
              & (exact.step == step) & (exact.data == data)]
    if (e.method == method).any():
      e = e[e.method == method]
    e, a = _one_run(e, where), _one_run(a, where)
    fig, axes = plt.subplots(2, 3, figsize=(8.6, 7.6),
                             gridspec_kw=dict(width_ratios=[1, 1, 0.05]))
    for r, kind in enumerate(["matrix", "inverse"]):
      parts = [(f"exact {ref}", e[e.kind == kind]), (method, a[a.kind == kind])]
      mats = [_square(rows) if len(rows) else None for _, rows in parts]
      norm = _log_norm([np.abs(m[0]) for m in mats if m is not None])
      image = None
      for ax, (title, _), m in zip(axes[r, :2], parts, mats):
        ax.set_title(f"{title}{' inverse' if kind == 'inverse' else ''}",
                     fontsize=8)
        if m is None:
          ax.text(0.5, 0.5, "not measured", ha="center",
                  transform=ax.transAxes)
          ax.set(xticks=[], yticks=[])
          continue
        mag = np.abs(m[0])
        mag = np.ma.masked_where(~np.isfinite(mag) | (mag <= 0), mag)
        image = ax.imshow(mag, norm=norm, cmap="magma_r",
                          interpolation="nearest")
        draw_blocks(ax, m[1], m[2])
      if image is not None:
        fig.colorbar(image, cax=axes[r, 2]).ax.tick_params(labelsize=6)
      else:
        axes[r, 2].set_visible(False)
    fig.suptitle(f"{problem}: |{ref}| on {data}, step {step}", fontsize=9)
    paths += save(fig, out / f"heatmaps_{_slug(problem, method, data)}"
                              f"_step{step}")
  return paths


# --- quality -----------------------------------------------------------------


def metric_title(metric: str) -> str:
  """The metric's name and which way it is better (`BETTER`)."""
  better = BETTER.get(metric)
  return f"{metric} ({better})" if better else metric


def _metric_panel(ax, metric: str):
  """Titles a metric's panel; a dashed line at 1 where 1 is best."""
  ax.set_title(metric_title(metric), fontsize=8)
  if BETTER.get(metric) == "1 is best":
    ax.axhline(1.0, color="k", lw=0.6, ls="--")
  ax.tick_params(labelsize=7)


def _context(p: pd.DataFrame, head: pd.Series | None = None) -> pd.Series:
  """Each row's exact reference (after `head`, only where it varies), with
  its data and step where these vary within `p`: the x groups of a bar
  chart."""
  parts = [] if head is None else [head.astype(str)]
  for col, prefix in (("reference", "vs "), ("data", "on "),
                      ("step", "step ")):
    if p[col].nunique() > 1 or (col == "reference" and head is None):
      parts.append(prefix + p[col].astype(str))
  return parts[0].str.cat(parts[1:], sep="\n") if parts[1:] else parts[0]


def quality_levels(df: pd.DataFrame) -> pd.DataFrame:
  """A quality table with its `level` filled in where older records lack
  it: "network" on block "all", else "layer" (block types came later)."""
  level = np.where(df["block"] == "all", "network", "layer")
  return df.assign(level=df["level"].fillna(pd.Series(level, df.index))
                   if "level" in df else level)


def _metric_bars(ax, rows: pd.DataFrame, metric: str, colours: dict,
                 order=None):
  """A metric's panel: bars per `series` grouped by `context` (in `order`
  where given)."""
  table = rows.pivot_table(index="context", columns="series", values="value",
                           aggfunc="mean")
  _metric_panel(ax, metric)
  if table.empty:
    _no_values(ax)
    return
  if order is not None:
    table = table.reindex([c for c in order if c in table.index])
  table.plot.bar(ax=ax, rot=0, fontsize=7, legend=False, xlabel="",
                 color=[colours[c] for c in table.columns])


def quality(df: pd.DataFrame, out: Path,
            colour: dict[str, str] | None = None) -> list[Path]:
  """Per problem: a panel per metric on the whole network ("all"), a bar per
  method and setting (`colour`: by method, default `palette`), grouped by
  exact reference (and data and step where they vary)."""
  paths = []
  df = _finite(_complete(df, "step", "data", "block"), "value")
  df = df[df.block == "all"].assign(series=_series)
  colours = _series_colours(df, colour)
  for problem, p in df.groupby("problem"):
    p = p.assign(context=_context(p))
    metric_names = sorted(p.metric.unique())
    fig, axes = _grid(len(metric_names))
    for ax, metric in zip(axes, metric_names):
      _metric_bars(ax, p[p.metric == metric], metric, colours)
    fig.suptitle(_title("approximation quality", p), fontsize=9)
    _legend_below(fig, axes[0])
    paths += save(fig, out / f"quality_{problem}")
  return paths


# The order block types are drawn in; others (a problem's own) follow by name.
ROLE_ORDER = ("attention", "mlp", "embedding", "norm", "conv", "dense",
              "other")


def role_order(roles) -> list[str]:
  """`roles` once each, in `ROLE_ORDER` and then by name."""
  roles = {str(r) for r in roles}
  known = [r for r in ROLE_ORDER if r in roles]
  return known + sorted(roles - set(known))


def quality_per_block_type(df: pd.DataFrame, out: Path,
                           colour: dict[str, str] | None = None
                           ) -> list[Path]:
  """Per problem: a panel per metric on each block type (the quality rows
  of `level` "role", `block` the type), a bar group per type (with the
  exact reference, data and step where they vary) and a bar per method
  and setting (`colour`: by method, default `palette`)."""
  paths = []
  df = _finite(quality_levels(_complete(df, "step", "data", "block")),
               "value")
  df = df[df.level == "role"].assign(series=_series)
  colours = _series_colours(df, colour)
  for problem, p in df.groupby("problem"):
    p = p.assign(context=_context(p, head=p.block))
    order = [c for role in role_order(p.block)
             for c in sorted(set(p.context[p.block.astype(str) == role]))]
    metric_names = sorted(p.metric.unique())
    fig, axes = _grid(len(metric_names), width=max(4.0, 0.9 * len(order)))
    for ax, metric in zip(axes, metric_names):
      _metric_bars(ax, p[p.metric == metric], metric, colours, order)
    fig.suptitle(_title("approximation quality per block type", p),
                 fontsize=9)
    _legend_below(fig, axes[0])
    paths += save(fig, out / f"quality_block_types_{problem}")
  return paths


BLOCK_STYLES = ("--", ":", "-.", (0, (3, 1, 1, 1)))


def _quality_legend(series: list[str], blocks: list[str],
                    colours: dict[str, str]) -> tuple[list, list[str]]:
  """Legend entries: a thick line per method and setting (the whole
  network), a thin grey one per block's line style."""
  handles = [Line2D([], [], color=colours[s], lw=2.2, marker="o", ms=3)
             for s in series]
  handles += [Line2D([], [], color="0.4", lw=0.8,
                     ls=BLOCK_STYLES[i % len(BLOCK_STYLES)])
              for i in range(len(blocks))]
  return handles, [*series, *(f"block {b}" for b in blocks)]


def _quality_lines(ax, rows: pd.DataFrame, blocks: list[str],
                   colours: dict[str, str]):
  """A metric against the step, a line per method and block (the whole
  network, "all", thicker)."""
  mean = rows.groupby(["series", "block", "step"]).value.mean().dropna()
  for (name, block), s in mean.groupby(level=["series", "block"]):
    s = s.droplevel(["series", "block"]).sort_index()
    whole = block == "all"
    ax.plot(s.index, s.to_numpy(), marker="o", ms=3 if whole else 2,
            lw=2.2 if whole else 0.8, alpha=1 if whole else 0.7,
            ls="-" if whole else BLOCK_STYLES[blocks.index(block) % 4],
            color=colours[name])
  if mean.empty:
    _no_values(ax)


def quality_through_training(df: pd.DataFrame, out: Path,
                             colour: dict[str, str]) -> list[Path]:
  """Per problem, reference and data: each metric against the step, a line
  per method and setting and block (the whole network, "all", thicker)."""
  paths = []
  df = _finite(quality_levels(_complete(df, "step", "data", "block")),
               "value")
  df = df[df.level != "role"].assign(series=_series)
  colours = _series_colours(df, colour)
  for (problem, ref, data), p in df.groupby(["problem", "reference", "data"]):
    metric_names = sorted(p.metric.unique())
    blocks = sorted(set(p.block) - {"all"})
    fig, axes = _grid(len(metric_names), width=4.5)
    for ax, metric in zip(axes, metric_names):
      _quality_lines(ax, p[p.metric == metric], blocks, colours)
      _metric_panel(ax, metric)
      _step_axis(ax, p.step.unique())
    fig.suptitle(_title("approximation quality", p), fontsize=9)
    _legend_below(fig, axes[0], *_quality_legend(sorted(set(p.series)),
                                                 blocks, colours),
                  title="thick: whole network; thin: one layer block")
    paths += save(fig, out / f"quality_steps_{_slug(problem, ref, data)}")
  return paths


# --- spectral statistics -----------------------------------------------------


def _statistic_rows(df: pd.DataFrame) -> pd.DataFrame:
  """The statistics with finite values and `stderr`, each row's `series`:
  "exact <matrix>" or the approximation's name (and data where several)."""
  df = _finite(_complete(df, "step", "data"), "value",
               *(["stderr"] if "stderr" in df else []))
  if "stderr" not in df:
    df["stderr"] = np.nan
  exact = df.source.astype(str).str.startswith("exact")
  series = df.matrix.astype(str).where(~exact, "exact " + df.matrix.astype(str))
  several = df.groupby("problem").data.transform("nunique") > 1
  df["series"] = series.where(~several, series + " on " + df.data.astype(str))
  df["exact"] = exact
  return df


def _statistic_colours(df: pd.DataFrame,
                       colour: dict[str, str] | None) -> dict[str, str]:
  """Exact matrices in greys; approximations in their method's colour."""
  greys = sorted(set(df.series[df.exact]))
  out = {s: str(0.15 + 0.5 * i / max(len(greys) - 1, 1))
         for i, s in enumerate(greys)}
  if (~df.exact).any():
    out.update(_series_colours(df[~df.exact], colour))
  return out


def _statistic_bars(ax, s: pd.DataFrame, colours: dict[str, str]):
  """One measured step: a bar per matrix, error bars from `stderr`."""
  x = np.arange(len(s))
  ax.bar(x, s.value, 0.6, yerr=s.stderr.abs().fillna(0), capsize=2,
         color=[colours[n] for n in s.index])
  ax.set_xticks(x, s.index, rotation=30, ha="right", rotation_mode="anchor",
                fontsize=6)


def _statistic_lines(ax, s: pd.DataFrame, colours: dict[str, str],
                     exact: set[str]):
  """Several steps: a line per matrix against the step (exact solid,
  approximations dashed), error bars from `stderr`."""
  for name, q in s.groupby(level="series"):
    ax.errorbar(q.index.get_level_values("step"), q.value,
                yerr=q.stderr.abs().fillna(0), marker="o", ms=3, lw=1,
                capsize=2, label=name, color=colours[name],
                ls="-" if name in exact else "--")


def statistics(df: pd.DataFrame, out: Path,
               colour: dict[str, str] | None = None) -> list[Path]:
  """Per problem, a panel per spectral statistic: with one measured step a
  bar per matrix, with several a line per matrix against the step (exact
  matrices grey; approximations in `colour`, by method, default
  `palette`); error bars from `stderr`."""
  paths = []
  df = _statistic_rows(df)
  colours = _statistic_colours(df, colour)
  for problem, p in df.groupby("problem"):
    names = sorted(p.statistic.unique())
    one_step = p.step.nunique() == 1
    exact = set(p.series[p.exact])
    fig, axes = _grid(len(names))
    for ax, name in zip(axes, names):
      s = p[p.statistic == name].groupby(
          ["series"] if one_step else ["series", "step"])[
              ["value", "stderr"]].mean().dropna(subset=["value"])
      if one_step:
        _statistic_bars(ax, s, colours)
        ax.set_title(name, fontsize=8)
        ax.tick_params(axis="y", labelsize=7)
      else:
        _statistic_lines(ax, s, colours, exact)
        _step_panel(ax, name, p.step.unique())
      if s.empty:
        _no_values(ax)
      _log_if_decades(ax, s.value)
    fig.suptitle(_title("spectral statistics", p), fontsize=9)
    if not one_step:
      _legend_below(fig, axes[0])
    paths += save(fig, out / f"statistics_{problem}")
  return paths


# --- training and timing -----------------------------------------------------

TRAINING_CURVES = (("train_error", "training error"),
                   ("train_loss", "training loss"),
                   ("batch_loss", "minibatch loss"))


def palette(methods) -> dict[str, str]:
  """One colour per method, the same in every figure of a report."""
  methods = sorted({str(m) for m in methods})
  cmap = plt.get_cmap("tab10" if len(methods) <= 10 else "tab20")
  return {m: colors.to_hex(cmap(i % cmap.N)) for i, m in enumerate(methods)}


def _band(ax, x, lo, hi, colour):
  ax.fill_between(x, lo, hi, color=colour, alpha=0.2, lw=0)


def _common_steps(runs: pd.DataFrame) -> pd.DataFrame:
  """The rows up to the last step every seed reached (diverged seeds
  aside): runs to a time budget end at different steps, and a median over
  the seeds that ran longest would jump where the others stop."""
  ends = runs.groupby("run_id").step.max()
  if "diverged" in runs:
    finished = ~runs.groupby("run_id").diverged.any().astype(bool)
    ends = ends[finished] if finished.any() else ends
  return runs[runs.step <= ends.min()]


def training(df: pd.DataFrame, out: Path, colour: dict[str, str],
             name: str = "training") -> list[Path]:
  """Per problem: the training error (else loss) against the step and
  against steady-state seconds, the median over seeds with the
  interquartile band, test error as dots; each curve up to the step all
  its seeds reached."""
  paths = []
  y, what = next(((c, w) for c, w in TRAINING_CURVES
                  if c in df and df[c].notna().any()), TRAINING_CURVES[-1])
  test = y.replace("train_", "test_") if y.startswith("train_") else None
  styles = ["-", "--", ":", "-."]
  for problem, p in df.groupby("problem"):
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True,
                             layout="constrained")
    for method, m in p.groupby("method"):
      for i, (label, runs) in enumerate(m.groupby("label")):
        n = runs.run_id.nunique()
        g = _common_steps(runs).groupby("step")
        curve = g[y].median().dropna()
        if curve.empty:
          continue
        lo, hi = g[y].quantile(0.25)[curve.index], g[y].quantile(0.75)[
            curve.index]
        wall = g.wall_s.median()[curve.index]
        for ax, x in zip(axes, (curve.index, wall)):
          ax.plot(x, curve, color=colour[method], ls=styles[i % 4], lw=1.4,
                  label=f"{label} (n={n})")
          if n > 1:
            _band(ax, x, lo, hi, colour[method])
          if test and test in runs:
            t = g[test].median().dropna()
            tx = t.index if ax is axes[0] else g.wall_s.median()[t.index]
            ax.plot(tx, t, color=colour[method], ls="none", marker="o", ms=3)
        diverged = runs[runs.diverged.astype(bool)] if "diverged" in runs \
            else runs.iloc[:0]
        for ax, x in zip(axes, ("step", "wall_s")):
          ax.plot(diverged[x], np.full(len(diverged), curve.max()), "x",
                  color=colour[method], ms=7)
    axes[0].set(xlabel="iteration", ylabel=what, yscale="log",
                title=f"{problem}")
    axes[1].set(xlabel="seconds (compilation excluded)", yscale="log",
                title=f"{problem}")
    _legend_below(fig, axes[0],
                  title="median over seeds (to the step all reached), band: "
                  "quartiles; dots: test")
    paths += save(fig, out / f"{name}_{problem}")
  return paths


def sensitivity(table: pd.DataFrame, out: Path,
                colour: dict[str, str]) -> list[Path]:
  """Per problem: each method's tuning score against each tuned
  hyperparameter, the others held at the method's best setting."""
  paths = []
  for problem, p in table.groupby("problem"):
    keys = sorted({k.split("=")[0] for s in p.setting for k in s.split(", ")
                   if "=" in k})
    if not keys:
      continue
    fig, axes = _grid(len(keys), width=4.5, height=3.5)
    for ax, key in zip(axes, keys):
      for method, m in p.groupby("method"):
        parsed = m.setting.map(lambda s: dict(
            kv.split("=", 1) for kv in s.split(", ") if "=" in kv))
        if not parsed.map(lambda d: key in d).all():
          continue
        best = parsed[m.best].iloc[0]
        same = parsed.map(lambda d: all(d.get(k) == v for k, v in
                                        best.items() if k != key))
        points = sorted((float(d[key]), score) for d, score in
                        zip(parsed[same], m.score[same]))
        xs = [x for x, _ in points]
        ys = [v if np.isfinite(v) else np.nan for _, v in points]
        ax.plot(xs, ys, "o-", color=colour[method], label=method)
        ax.plot([float(best[key])], [m.score[m.best].iloc[0]], "*",
                ms=12, color=colour[method])
        diverged = [x for x, v in points if not np.isfinite(v)]
        if diverged:
          ax.plot(diverged, [np.nanmax(ys) if np.isfinite(ys).any() else 1]
                  * len(diverged), "x", color=colour[method], ms=8)
      xs = np.concatenate([l.get_xdata() for l in ax.lines] or [[]])
      ys = np.concatenate([l.get_ydata() for l in ax.lines] or [[]])
      _log_if_decades(ax, xs, "x", decades=1)
      _log_if_decades(ax, ys, "y", decades=1)
      ax.set(xlabel=key, ylabel=p.metric.iloc[0], title=problem)
    _legend_below(fig, axes[0], title="star: chosen; x: diverged")
    paths += save(fig, out / f"tuning_{problem}")
  return paths


def _unit(df: pd.DataFrame) -> str:
  """The phase that timings are a multiple of: the Adam step, else (older
  tables) the gradient step."""
  return BASELINE_PHASE if (df.phase == BASELINE_PHASE).any() else "grad_step"


def _repeat_quartile(rows: pd.DataFrame, q: str, unit: str) -> pd.Series:
  """Each run's quartile `q` ("q25", "q75") of its phase's ratio over its
  timed repeats: paired with the Adam sample of the same repeat where
  recorded (`ratio_to_adam_q25`), else the phase's quartile seconds over
  the unit's median, else the ratio itself."""
  own = rows[f"{q}_s"] / rows.unit_s if f"{q}_s" in rows else rows.ratio
  paired = f"ratio_to_adam_{q}"
  if unit == BASELINE_PHASE and paired in rows:
    own = rows[paired].where(rows[paired].notna(), own)
  return own.fillna(rows.ratio)


def phase_ratios(df: pd.DataFrame) -> pd.DataFrame:
  """Each phase's time over the same run's Adam step (`_unit`) per device
  kind, label and phase (the unit's own phase left out): the `median` over
  runs, the quartiles `q25` and `q75` over runs or, for a single run, over
  its timed repeats (`_repeat_quartile`), `n` runs and the `unit`."""
  df = df.assign(run_id=df.get("run_id", "run"))
  unit = _unit(df)
  run = ["problem", "device_kind", "label", "run_id"]
  base = df[df.phase == unit].groupby(run).median_s.median().rename("unit_s")
  rows = df[df.phase != unit].join(base, on=run)
  rows = rows.assign(ratio=rows.median_s / rows.unit_s)
  rows = rows.assign(low=_repeat_quartile(rows, "q25", unit),
                     high=_repeat_quartile(rows, "q75", unit))
  index = ["device_kind", "label", "phase"]
  out = aggregate.over_runs(rows, index[:2], "phase", "ratio").join(
      rows.groupby(index)[["low", "high"]].median(), on=index)
  one = out.n == 1
  return out.assign(q25=out.q25.where(~one, out.low),
                    q75=out.q75.where(~one, out.high),
                    unit=unit).drop(columns=["low", "high"])


def _phase_order(phases) -> list[str]:
  known = [p for p in (*PHASES, BASELINE_PHASE) if p in set(phases)]
  return known + sorted(set(phases) - set(known))


def _phase_bars(ax, ratios: pd.DataFrame):
  """A bar group per label (and device kind where several), a bar per
  phase with its interquartile error bar; n (runs) under each group."""
  several = ratios.device_kind.nunique() > 1
  ratios = ratios.assign(group=ratios.label.astype(str) + np.where(
      several, " on " + ratios.device_kind.astype(str), ""))
  groups = sorted(ratios.group.unique())
  phases = _phase_order(ratios.phase)
  width = 0.8 / len(phases)
  cmap = plt.get_cmap("tab10")
  for i, phase in enumerate(phases):
    r = ratios[ratios.phase == phase].set_index("group").reindex(groups)
    err = np.clip([r["median"] - r.q25, r.q75 - r["median"]], 0, None)
    ax.bar(np.arange(len(groups)) + (i - (len(phases) - 1) / 2) * width,
           r["median"], width, yerr=np.nan_to_num(err), capsize=2,
           label=phase,
           color=cmap(PHASES.index(phase) if phase in PHASES else i))
  n = ratios.groupby("group").n.max()
  ax.set_xticks(np.arange(len(groups)), [f"{g} (n={n[g]})" for g in groups],
                rotation=20, ha="right", rotation_mode="anchor", fontsize=7)


def timing(df: pd.DataFrame, out: Path) -> list[Path]:
  """Per problem: each phase's time as a multiple of the same run's Adam
  step (else, for older tables, of its gradient step), a bar group per
  method and setting, the median over runs with interquartile error bars."""
  paths = []
  for problem, p in df.groupby("problem"):
    ratios = phase_ratios(p)
    unit = "Adam step" if _unit(p) == BASELINE_PHASE else "gradient step"
    ylabel = f"× {unit} (median, IQR)" + (
        "" if unit == "Adam step" else ": no Adam step recorded")
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * ratios.label.nunique()
                                        + 2), 4.0), layout="constrained")
    if ratios.empty:
      _no_values(ax, f"only the {unit} was timed")
    else:
      _phase_bars(ax, ratios)
    _log_if_decades(ax, ratios["median"], decades=1)
    ax.axhline(1.0, color="k", lw=0.6, ls="--", label=f"one {unit}")
    ax.set(ylabel=ylabel, title=_title(
        f"time per phase ({_values(p, 'device_kind')})", p))
    _legend_below(fig, ax, title="n: runs; error bars: interquartile range "
                  "over runs (over timed repeats where n=1)")
    paths += save(fig, out / f"timing_{problem}")
  return paths


STYLE = {"font.size": 10, "axes.titlesize": 10, "axes.labelsize": 10,
         "xtick.labelsize": 8, "ytick.labelsize": 8, "legend.fontsize": 8,
         "figure.dpi": 120}


def style():
  """The figures' style, for a block that draws them."""
  return plt.rc_context(STYLE)


def tuned_curves(train: pd.DataFrame, tuning: pd.DataFrame) -> pd.DataFrame:
  """The training rows of each problem's chosen settings (and of methods
  that were not tuned)."""
  best = tuning[tuning.best]
  chosen = {(p, f"{m} ({s})" if s else str(m))
            for p, m, s in zip(best.problem, best.method, best.setting)}
  tuned = set(zip(tuning.problem, tuning.method))
  keep = [(p, m) not in tuned or (p, l) in chosen
          for p, m, l in zip(train.problem, train.method, train.label)]
  return train[keep]
