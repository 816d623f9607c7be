"""The spectra measurement's figures, each saved as PNG and PDF:

- spectra: per problem, data and exact matrix, a panel per training step:
  the exact matrix's signed eigenvalue density (symlog axis) as a grey
  filled reference, each approximation of it a coloured line over it
- heatmaps: |entries| of the exact and approximate matrix and of their
  inverses on a subsample of parameters (Martens & Grosse 2015, Fig. 2)
- quality: a figure per metric (metrics differ in scale and direction,
  so they are not set side by side), bars per method (one step) or lines
  against the step (several); each titled in words with which way is
  better (`metrics.title`)
- quality per block type: a figure per metric, a bar group per block type
  (attention, MLP, ...), a bar per method
- statistics: a figure per spectral statistic, bars per matrix (one step)
  or lines against the step (several)

Each method keeps its colour and marker (`plots.Looks`); bars carry the
marker's hatch.

Quality tables written before block types lack `level`; it is read from
`block` (`quality_levels`).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib import colors, scale, ticker
from matplotlib.lines import Line2D

from curvbench.core import metrics, plots
from curvbench.measurements.spectra import summary


def symlog(values, linthresh: float) -> np.ndarray:
  """matplotlib's symlog coordinate divided by `linthresh`: one unit per
  decade beyond the threshold, linear (through 0) within it."""
  t = scale.SymmetricalLogTransform(10, linthresh, 1)
  return t.transform(np.asarray(values, np.float64)) / linthresh


def symlog_inverse(u, linthresh: float) -> np.ndarray:
  """The eigenvalues at symlog coordinates `u`."""
  t = scale.SymmetricalLogTransform(10, linthresh, 1).inverted()
  return t.transform(np.asarray(u, np.float64) * linthresh)


def symlog_density(
  eigenvalues,
  weights,
  grid,
  linthresh: float,
  bandwidth: float = 0.1,
  nonnegative: bool = False,
) -> np.ndarray:
  """Gaussian-smoothed density of a signed spectrum per unit of the symlog
  coordinate, at `grid` (in that coordinate); NaN weights count as uniform.
  A `nonnegative` spectrum (a PSD matrix's) is smoothed with its kernels
  reflected at zero, so its density is zero below zero and still
  integrates to one."""
  lam = np.asarray(eigenvalues, np.float64)
  w = np.asarray(weights, np.float64)
  keep = np.isfinite(lam)
  lam, w = lam[keep], w[keep]
  if lam.size == 0:
    return np.zeros(len(grid))
  w = np.where(np.isfinite(w) & (w >= 0), w, 1.0 / lam.size)
  if w.sum() <= 0:
    w = np.ones_like(lam)
  u = symlog(lam, linthresh)
  if not nonnegative:
    return metrics.density(u, w, grid, bandwidth)
  u = np.maximum(u, 0.0)  # round-off below zero
  grid = np.asarray(grid, np.float64)
  reflected = metrics.density(u, w, grid, bandwidth) + metrics.density(
    -u, w, grid, bandwidth
  )
  return np.where(grid >= 0, reflected, 0.0)


def nonnegative(eigenvalues, relative: float = 1e-8) -> bool:
  """Whether a spectrum is a PSD matrix's: no eigenvalue below zero by
  more than `relative` times the largest magnitude (round-off)."""
  lam = np.asarray(eigenvalues, np.float64)
  lam = lam[np.isfinite(lam)]
  return bool(lam.size) and lam.min() >= -relative * np.abs(lam).max()


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
  df = plots.complete(df, "step", "data")
  df = plots.finite(df, "eigenvalue")
  df = df[df.source.isin(["exact", "approx"]) & df.eigenvalue.notna()]
  exact = df.source == "exact"
  if "reference" not in df:
    df["reference"] = np.nan
  df["reference"] = df.reference.where(~exact, df.matrix)
  df["series"] = plots.series(df).where(~exact, "exact")
  same = [
    "problem",
    "data",
    "matrix",
    "step",
    *(["seed"] if "seed" in df else []),
  ]
  df = pd.concat([plots.one_run(df[exact], same), df[~exact]])
  run = [c for c in ("seed", "run", "run_dir") if c in df]
  df["w"] = _pooled_weights(df, ["step", "series", *run]) if len(df) else []
  return df


def _symlog_axis(ax, linthresh: float):
  """x = eigenvalue on a symlog axis with ticks at whole decades."""
  ax.axvline(0, color="0.4", lw=0.6, ls=":")
  ax.set_xscale("symlog", linthresh=linthresh)
  ax.xaxis.set_major_locator(
    ticker.SymmetricalLogLocator(base=10, linthresh=linthresh, subs=[1.0])
  )
  ax.xaxis.get_major_locator().set_params(numticks=7)
  ax.xaxis.set_minor_locator(ticker.NullLocator())
  ax.set(
    xlabel="Eigenvalue λ (symmetric-log scale)",
    ylabel="Density per symlog unit (log scale)",
  )
  ax.tick_params(labelsize=6)


def _overlay(
  ax, x, curves: dict, floor: float, colour: dict[str, str], reference: str
):
  """One step's panel: the exact density filled grey, each approximation's
  a coloured line over it."""
  if "exact" in curves:
    exact = np.maximum(curves["exact"], floor)
    ax.fill_between(
      x, floor, exact, color="0.82", lw=0, label=f"exact {reference}"
    )
    ax.plot(x, exact, color="0.45", lw=0.7)
  for name in sorted(set(curves) - {"exact"}):
    ax.plot(
      x,
      np.maximum(curves[name], floor),
      lw=1.2,
      color=colour[name],
      marker=plots.marker(colour, name),
      markevery=(sorted(curves).index(name) * 7, 60),
      ms=4,
      label=name,
    )
  if not curves:
    plots.no_values(ax, "no spectrum")


def spectra(
  df: pd.DataFrame,
  out: Path,
  linthresh_fraction: float = 1e-4,
  bandwidth: float = 0.1,
  colour: dict[str, str] | None = None,
) -> list[Path]:
  """Per problem, data and exact matrix, a panel per training step: the
  exact matrix's signed density with each approximation's over it
  (`colour`: the report's, by label). A PSD matrix's density stays at or
  above zero (`nonnegative`); where every spectrum drawn is one, the axis
  starts at zero."""
  paths = []
  df = _spectra_rows(df)
  colours = plots.series_colours(df[df.series != "exact"], colour)
  for (problem, data, ref), p in df.groupby(["problem", "data", "reference"]):
    top = np.abs(p.eigenvalue).max()
    small = linthresh_fraction * top if top > 0 else 1.0
    linthresh = 10.0 ** np.floor(np.log10(small))  # ticks at whole decades
    groups = dict(list(p.groupby(["step", "series"])))
    psd = {k: nonnegative(q.eigenvalue) for k, q in groups.items()}
    u = symlog(p.eigenvalue, linthresh)
    low = 0.0 if all(psd.values()) else u.min() - 4 * bandwidth
    grid = np.linspace(low, u.max() + 4 * bandwidth, 600)
    curves = {
      k: symlog_density(
        q.eigenvalue, q.w, grid, linthresh, bandwidth, nonnegative=psd[k]
      )
      for k, q in groups.items()
    }
    peak = max((c.max() for c in curves.values()), default=1.0) or 1.0
    floor = 1e-5 * peak
    steps = sorted(p.step.unique())
    fig, axes = plots.grid(len(steps), width=4.5, sharex=True, sharey=True)
    for ax, step in zip(axes, steps):
      _overlay(
        ax,
        symlog_inverse(grid, linthresh),
        {s: c for (t, s), c in curves.items() if t == step},
        floor,
        colours,
        ref,
      )
      _symlog_axis(ax, linthresh)
      if low == 0.0:
        ax.set_xlim(left=0.0)
      ax.set_yscale("log")
      ax.set_ylim(floor, 2 * peak)
      ax.set_title(
        plots.title("eigenvalue density", p[p.step == step]),
        fontsize="medium",
        wrap=True,
      )
    plots.legend_below(fig, axes[0])
    paths += plots.save(fig, out / f"spectra_{plots.slug(problem, data, ref)}")
  return paths


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
  m = rows.pivot_table(
    index="row", columns="col", values="value", aggfunc="mean"
  ).reindex(index=range(n), columns=range(n))
  row_blocks = rows.groupby("row").row_block.first().reindex(range(n))
  col_blocks = rows.groupby("col").col_block.first().reindex(range(n))
  return (
    m.to_numpy(np.float64),
    row_blocks.fillna("?").tolist(),
    col_blocks.fillna("?").tolist(),
  )


def draw_blocks(ax, row_blocks, col_blocks):
  """Thin lines at block boundaries and block names as tick labels."""
  rows, row_names = block_boundaries(row_blocks)
  cols, col_names = block_boundaries(col_blocks)
  for y in rows:
    ax.axhline(y, color="k", lw=0.4)
  for x in cols:
    ax.axvline(x, color="k", lw=0.4)
  ax.set_yticks(
    [c for c, _ in row_names], [n for _, n in row_names], fontsize=5
  )
  ax.set_xticks(
    [c for c, _ in col_names],
    [n for _, n in col_names],
    fontsize=5,
    rotation=90,
  )
  return rows, cols


def _log_norm(mats) -> colors.LogNorm:
  vals = np.concatenate(
    [m[np.isfinite(m) & (m > 0)] for m in mats] + [np.empty(0)]
  )
  if vals.size == 0:
    return colors.LogNorm(1e-12, 1.0)
  hi = vals.max()
  return colors.LogNorm(max(vals.min(), 1e-10 * hi), hi)


def heatmaps(df: pd.DataFrame, out: Path) -> list[Path]:
  """Per problem, method, step and data: |exact| and |approximate| matrix
  (top) and their inverses (bottom), one log colour scale per row."""
  paths = []
  df = plots.finite(plots.complete(df, "step", "data"), "value")
  where = ["problem", "step", "data", "reference"]
  exact, approx = df[df.source == "exact"], df[df.source == "approx"]
  for (problem, method, ref, step, data), a in approx.groupby(
    ["problem", "method", "reference", "step", "data"]
  ):
    e = exact[
      (exact.problem == problem)
      & (exact.reference == ref)
      & (exact.step == step)
      & (exact.data == data)
    ]
    if (e.method == method).any():
      e = e[e.method == method]
    e, a = plots.one_run(e, where), plots.one_run(a, where)
    fig, axes = plt.subplots(
      2,
      3,
      figsize=plots.figsize(8.6, 7.6),
      gridspec_kw=dict(width_ratios=[1, 1, 0.05]),
    )
    for r, kind in enumerate(["matrix", "inverse"]):
      parts = [(f"exact {ref}", e[e.kind == kind]), (method, a[a.kind == kind])]
      mats = [_square(rows) if len(rows) else None for _, rows in parts]
      norm = _log_norm([np.abs(m[0]) for m in mats if m is not None])
      image = None
      for ax, (title, _), m in zip(axes[r, :2], parts, mats):
        ax.set_title(
          f"{title}{' inverse' if kind == 'inverse' else ''}", fontsize=8
        )
        if m is None:
          ax.text(0.5, 0.5, "not measured", ha="center", transform=ax.transAxes)
          ax.set(xticks=[], yticks=[])
          continue
        mag = np.abs(m[0])
        mag = np.ma.masked_where(~np.isfinite(mag) | (mag <= 0), mag)
        image = ax.imshow(
          mag, norm=norm, cmap="magma_r", interpolation="nearest"
        )
        draw_blocks(ax, m[1], m[2])
      if image is not None:
        fig.colorbar(image, cax=axes[r, 2]).ax.tick_params(labelsize=6)
      else:
        axes[r, 2].set_visible(False)
    fig.suptitle(
      f"{problem}: magnitude of the entries of the exact {ref} and of "
      f"{method} (top) and of their damped inverses (bottom), on {data} at "
      f"step {step}; log colour scale per row",
      fontsize="medium",
      wrap=True,
    )
    name = f"heatmaps_{plots.slug(problem, method, data)}_step{step}"
    paths += plots.save(fig, out / name, data=pd.concat([e, a]))
  return paths


def _metric_panel(ax, metric: str):
  """Titles a metric's panel; a dashed line at 1 where 1 is best."""
  ax.set_title(metrics.title(metric), fontsize="medium", wrap=True)
  ax.set_ylabel(metrics.described(metric).axis())
  if metrics.described(metric).better == "1":
    ax.axhline(1.0, color="k", lw=0.6, ls="--")


def _per_metric(
  p: pd.DataFrame,
  column: str,
  draw,
  suptitle,
  stem,
  out,
  legend=(),
  panels: str | None = None,
):
  """A figure per value of `column` in `p` (a metric or statistic, in
  `summary.metric_order`), drawn by `draw(ax, rows, name)` on one panel
  or, with `panels` (a column), a panel per value of that column sharing
  the metric and its axis,
  `suptitle` over it, its legend below (`legend`: `plots.legend_below`'s
  handles, labels and title, else the panel's) and `stem_<name>` its
  file, the rows it drew from beside it; the paths written."""
  paths = []
  for name in summary.metric_order(p[column]):
    rows = p[p[column] == name]
    if panels is None:
      fig, axes = plots.grid(1, width=6.0, height=3.6)
      draw(axes[0], rows, name)
    else:
      values = sorted(rows[panels].astype(str).unique())
      fig, axes = plots.grid(len(values), width=4.5, sharey=True)
      for ax, value in zip(axes, values):
        draw(ax, rows[rows[panels].astype(str) == value], name)
        ax.set_title(f"{ax.get_title()}\nvs exact {value}", wrap=True)
    fig.suptitle(suptitle, fontsize="small", wrap=True)
    plots.legend_below(fig, axes[0], *legend)
    paths += plots.save(
      fig,
      out / f"{stem}_{plots.slug(name)}",
      data=rows.drop(columns=["context", "exact"], errors="ignore"),
    )
  return paths


def _context(p: pd.DataFrame, head: pd.Series | None = None) -> pd.Series:
  """Each row's exact reference (after `head`, only where it varies), with
  its data and step where these vary within `p`: the x groups of a bar
  chart."""
  parts = [] if head is None else [head.astype(str)]
  for col, prefix in (("reference", "vs "), ("data", "on "), ("step", "step ")):
    if p[col].nunique() > 1 or (col == "reference" and head is None):
      parts.append(prefix + p[col].astype(str))
  return parts[0].str.cat(parts[1:], sep="\n") if parts[1:] else parts[0]


def quality_levels(df: pd.DataFrame) -> pd.DataFrame:
  """A quality table with its `level` filled in where older records lack
  it: "network" on block "all", else "layer" (block types came later)."""
  level = np.where(df["block"] == "all", "network", "layer")
  return df.assign(
    level=df["level"].fillna(pd.Series(level, df.index))
    if "level" in df
    else level
  )


def _metric_bars(
  ax, rows: pd.DataFrame, metric: str, colours: dict, order=None
):
  """A metric's panel: a bar per `series` grouped by `context` (in `order`
  where given), the median over the samples with its quartiles as error
  bars."""
  _metric_panel(ax, metric)
  g = rows.groupby(["context", "series"]).value
  table = g.median().unstack("series")
  if table.empty:
    plots.no_values(ax)
    return
  if order is not None:
    table = table.reindex([c for c in order if c in table.index])
  low = (table - g.quantile(0.25).unstack("series")).reindex_like(table)
  high = (g.quantile(0.75).unstack("series") - table).reindex_like(table)
  width = 0.8 / len(table.columns)
  x = np.arange(len(table))
  for i, name in enumerate(table.columns):
    ax.bar(
      x + (i - (len(table.columns) - 1) / 2) * width,
      table[name],
      width,
      color=colours[name],
      hatch=plots.hatch(colours, name),
      edgecolor="0.15",
      linewidth=0.4,
      label=name,
      yerr=np.clip([low[name].fillna(0), high[name].fillna(0)], 0, None),
      capsize=2,
      error_kw=dict(lw=0.8),
    )
  ax.set_xticks(x, table.index, fontsize="small")


def quality(
  df: pd.DataFrame, out: Path, colour: dict[str, str] | None = None
) -> list[Path]:
  """Per problem: a panel per metric on the whole network ("all"), a bar per
  method and setting (`colour`: the report's, by label), grouped by
  exact reference (and data and step where they vary)."""
  paths = []
  df = plots.finite(plots.complete(df, "step", "data", "block"), "value")
  df = df[df.block == "all"].assign(series=plots.series)
  colours = plots.series_colours(df, colour)
  for problem, p in df.groupby("problem"):
    paths += _per_metric(
      p.assign(context=_context(p)),
      "metric",
      lambda ax, rows, metric: _metric_bars(ax, rows, metric, colours),
      plots.title("approximation quality, whole network", p)
      + "; bars: median, whiskers: quartiles over samples",
      f"quality_{problem}",
      out,
    )
  return paths


# The order block types are drawn in; others (a problem's own) follow by name.


ROLE_ORDER = ("attention", "mlp", "embedding", "norm", "conv", "dense", "other")


def role_order(roles) -> list[str]:
  """`roles` once each, in `ROLE_ORDER` and then by name."""
  roles = {str(r) for r in roles}
  known = [r for r in ROLE_ORDER if r in roles]
  return known + sorted(roles - set(known))


def quality_per_block_type(
  df: pd.DataFrame, out: Path, colour: dict[str, str] | None = None
) -> list[Path]:
  """Per problem: a panel per metric on each block type (the quality rows
  of `level` "role", `block` the type), a bar group per type (with the
  exact reference, data and step where they vary) and a bar per method
  and setting (`colour`: the report's, by label)."""
  paths = []
  df = plots.finite(
    quality_levels(plots.complete(df, "step", "data", "block")), "value"
  )
  df = df[df.level == "role"].assign(series=plots.series)
  colours = plots.series_colours(df, colour)
  for problem, p in df.groupby("problem"):
    p = p.assign(context=_context(p, head=p.block))
    order = [
      c
      for role in role_order(p.block)
      for c in sorted(set(p.context[p.block.astype(str) == role]))
    ]
    paths += _per_metric(
      p,
      "metric",
      lambda ax, rows, metric, order=order: _metric_bars(
        ax, rows, metric, colours, order
      ),
      plots.title("approximation quality per block type", p)
      + "; bars: median, whiskers: quartiles over samples",
      f"quality_block_types_{problem}",
      out,
    )
  return paths


BLOCK_STYLES = ("--", ":", "-.", (0, (3, 1, 1, 1)))


def _quality_legend(
  series: list[str], blocks: list[str], colours: dict[str, str]
) -> tuple[list, list[str]]:
  """Legend entries: a thick line per method and setting (the whole
  network), a thin grey one per block's line style."""
  handles = [
    Line2D([], [], color=colours[s], lw=2.2, marker=plots.marker(colours, s))
    for s in series
  ]
  handles += [
    Line2D([], [], color="0.4", lw=0.8, ls=BLOCK_STYLES[i % len(BLOCK_STYLES)])
    for i in range(len(blocks))
  ]
  return handles, [*series, *(f"block {b}" for b in blocks)]


def _quality_lines(
  ax, rows: pd.DataFrame, blocks: list[str], colours: dict[str, str]
):
  """A metric against the step, a line per method and block (the whole
  network, "all", thicker)."""
  mean = rows.groupby(["series", "block", "step"]).value.mean().dropna()
  for (name, block), s in mean.groupby(level=["series", "block"]):
    s = s.droplevel(["series", "block"]).sort_index()
    whole = block == "all"
    ax.plot(
      s.index,
      s.to_numpy(),
      marker=plots.marker(colours, name),
      ms=5 if whole else 3,
      lw=2.2 if whole else 0.8,
      alpha=1 if whole else 0.7,
      ls="-" if whole else BLOCK_STYLES[blocks.index(block) % 4],
      color=colours[name],
    )
  if mean.empty:
    plots.no_values(ax)


def quality_through_training(
  df: pd.DataFrame, out: Path, colour: dict[str, str]
) -> list[Path]:
  """Per problem and data, a figure per metric against the step, a panel
  per exact reference (one metric, one axis), a line per method and
  setting and block (the whole network, "all", thicker)."""
  paths = []
  df = plots.finite(
    quality_levels(plots.complete(df, "step", "data", "block")), "value"
  )
  df = df[df.level != "role"].assign(series=plots.series)
  colours = plots.series_colours(df, colour)
  for (problem, data), p in df.groupby(["problem", "data"]):
    blocks, steps = sorted(set(p.block) - {"all"}), p.step.unique()

    def draw(ax, rows, metric, blocks=blocks, steps=steps):
      _quality_lines(ax, rows, blocks, colours)
      _metric_panel(ax, metric)
      plots.step_axis(ax, steps)

    paths += _per_metric(
      p,
      "metric",
      draw,
      plots.title("approximation quality", p) + "; mean over samples",
      f"quality_steps_{plots.slug(problem, data)}",
      out,
      panels="reference",
      legend=(
        *_quality_legend(sorted(set(p.series)), blocks, colours),
        "thick: whole network; thin: one layer block",
      ),
    )
  return paths


def _statistic_rows(df: pd.DataFrame) -> pd.DataFrame:
  """The statistics with finite values and `stderr`, each row's `series`:
  "exact <matrix>" or the approximation's name (and data where several)."""
  df = plots.finite(
    plots.complete(df, "step", "data"),
    "value",
    *(["stderr"] if "stderr" in df else []),
  )
  if "stderr" not in df:
    df["stderr"] = np.nan
  exact = df.source.astype(str).str.startswith("exact")
  series = df.matrix.astype(str).where(~exact, "exact " + df.matrix.astype(str))
  several = df.groupby("problem").data.transform("nunique") > 1
  df["series"] = series.where(~several, series + " on " + df.data.astype(str))
  df["exact"] = exact
  return df


def _statistic_colours(
  df: pd.DataFrame, colour: dict[str, str] | None
) -> plots.Looks:
  """Exact matrices in greys, solid; approximations in their method's
  colour and marker."""
  greys = sorted(set(df.series[df.exact]))
  out = plots.Looks(
    {
      s: colors.to_hex(str(0.15 + 0.5 * i / max(len(greys) - 1, 1)))
      for i, s in enumerate(greys)
    }
  )
  if (~df.exact).any():
    found = plots.series_colours(df[~df.exact], colour)
    out.update(found)
    out.marker.update(found.marker)
  return out


def _statistic_bars(ax, s: pd.DataFrame, colours: plots.Looks):
  """One measured step: a bar per matrix, error bars from `stderr`."""
  x = np.arange(len(s))
  ax.bar(
    x,
    s.value,
    0.6,
    yerr=s.stderr.abs().fillna(0),
    capsize=2,
    color=[colours[n] for n in s.index],
    hatch=[plots.hatch(colours, n) for n in s.index],
    edgecolor="0.15",
    linewidth=0.4,
  )
  ax.set_xticks(
    x,
    s.index,
    rotation=30,
    ha="right",
    rotation_mode="anchor",
    fontsize="x-small",
  )


def _statistic_lines(
  ax, s: pd.DataFrame, colours: plots.Looks, exact: set[str]
):
  """Several steps: a line per matrix against the step (exact solid,
  approximations dashed), error bars from `stderr`."""
  for name, q in s.groupby(level="series"):
    ax.errorbar(
      q.index.get_level_values("step"),
      q.value,
      yerr=q.stderr.abs().fillna(0),
      marker=plots.marker(colours, name),
      ms=4,
      lw=1,
      capsize=2,
      label=name,
      color=colours[name],
      ls="-" if name in exact else "--",
    )


def statistics(
  df: pd.DataFrame, out: Path, colour: dict[str, str] | None = None
) -> list[Path]:
  """Per problem, a figure per spectral statistic: with one measured step
  a bar per matrix, with several a line per matrix against the step
  (exact matrices grey; approximations in the report's `colour`, by
  label); error bars from `stderr`."""
  paths = []
  df = _statistic_rows(df)
  colours = _statistic_colours(df, colour)
  for problem, p in df.groupby("problem"):
    one_step = p.step.nunique() == 1
    exact = set(p.series[p.exact])

    def draw(ax, rows, name, one_step=one_step, exact=exact, steps=p.step):
      s = (
        rows.groupby(["series"] if one_step else ["series", "step"])[
          ["value", "stderr"]
        ]
        .mean()
        .dropna(subset=["value"])
      )
      if one_step:
        _statistic_bars(ax, s, colours)
        ax.set_title(metrics.title(name), fontsize="medium", wrap=True)
      else:
        _statistic_lines(ax, s, colours, exact)
        plots.step_panel(ax, metrics.title(name), steps.unique())
      ax.set_ylabel(metrics.described(name).axis())
      if s.empty:
        plots.no_values(ax)
      plots.log_if_decades(ax, s.value)

    paths += _per_metric(
      p,
      "statistic",
      draw,
      plots.title("spectral statistics", p),
      f"statistics_{problem}",
      out,
    )
  return paths
