"""Figures of a merged sweep's tables, each saved as PNG and PDF; the
measurements (`curvbench.measurements`) pick the ones of their tables.

- spectra: signed eigenvalue densities on a symlog axis, one curve per
  training step, the exact matrix beside each approximation of it
- heatmaps: |entries| of the exact and approximate matrix and of their
  inverses on a subsample of parameters (Martens & Grosse 2015, Fig. 2)
- quality: metrics by block type (one step) or against the step (several)
- statistics: spectral statistics against the step
- training: training error (median and quartiles over seeds) against
  iterations and against seconds; with a tuning sweep, the best settings,
  every setting, and the score against each tuned hyperparameter
- timing: time per phase relative to a gradient step

Each method has one colour in every figure (`palette`).

Tables written before curvature was measured along training lack `step`,
`data` and `block`; they read as step 0, data "batch" and block "all".
"""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib import colors, scale, ticker  # noqa: E402

from curvbench import metrics  # noqa: E402

DEFAULTS = dict(step=0, data="batch", block="all")


def save(fig, path: Path) -> list[Path]:
  """Writes `fig` as PNG and PDF at `path` (suffix replaced), closes it."""
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.tight_layout()
  paths = [path.with_suffix(".png"), path.with_suffix(".pdf")]
  for p in paths:
    fig.savefig(p, dpi=120)
  plt.close(fig)
  return paths


def _grid(n, width=4.0, height=3.0, cols=3, **kw):
  cols = min(cols, n)
  rows = -(-n // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows),
                           squeeze=False, **kw)
  for ax in axes.flat[n:]:
    ax.set_visible(False)
  return fig, axes.flat


def _slug(*parts) -> str:
  """A file-name stem from labels such as "kfac/ggn_exact" or "batches:8"."""
  return "_".join(re.sub(r"[^A-Za-z0-9_.-]+", "-", str(p)) for p in parts)


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


def _step_colours(steps) -> dict[int, tuple]:
  """A colour per training step along a sequential colormap (by rank)."""
  steps = sorted(set(steps))
  cmap = plt.get_cmap("viridis")
  return {s: cmap(0.85 * i / max(len(steps) - 1, 1))
          for i, s in enumerate(steps)}


def _step_axis(ax, steps):
  """x = training step; symlog when the steps span two decades or more."""
  positive = np.asarray([s for s in steps if s > 0])
  if positive.size and positive.max() >= 100 * positive.min():
    ax.set_xscale("symlog", linthresh=positive.min())
    ax.set_xlim(left=-0.2 * positive.min())
  ax.set_xlabel("training step")


def _step_panel(ax, title, steps):
  """Finishes a panel drawn against the training step."""
  ax.set_title(title)
  _step_axis(ax, steps)
  ax.tick_params(labelsize=7)
  if ax.lines:
    ax.legend(fontsize=5)


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
  df = _complete(df, "step", "data")
  df = _finite(df, "eigenvalue")
  df = df[df.source.isin(["exact", "approx"]) & df.eigenvalue.notna()]
  exact = df.source == "exact"
  if "reference" not in df:
    df["reference"] = np.nan
  df["reference"] = df.reference.where(~exact, df.matrix)
  df["panel"] = df.method.where(~exact, "exact")
  run = [c for c in ("seed", "run", "run_dir") if c in df]
  keys = ["step", "panel", *run]
  df["w"] = _pooled_weights(df, keys) if len(df) else []
  return df


def spectra(df: pd.DataFrame, out: Path, linthresh_fraction: float = 1e-4,
            bandwidth: float = 0.1) -> list[Path]:
  """Per problem, data and exact matrix: signed densities of the exact matrix
  and of each approximation of it, one curve per training step."""
  paths = []
  df = _spectra_rows(df)
  ex = df.source == "exact"
  same = ["problem", "data", "matrix", "step", *(["seed"] if "seed" in df
                                                 else [])]
  df = pd.concat([_one_run(df[ex], same), df[~ex]])
  for (problem, data, ref), p in df.groupby(["problem", "data", "reference"]):
    top = np.abs(p.eigenvalue).max()
    small = linthresh_fraction * top if top > 0 else 1.0
    linthresh = 10.0 ** np.floor(np.log10(small))  # ticks at whole decades
    u = symlog(p.eigenvalue, linthresh)
    grid = np.linspace(u.min() - 4 * bandwidth, u.max() + 4 * bandwidth, 600)
    x = symlog_inverse(grid, linthresh)
    panels = ["exact"] + sorted(set(p.panel) - {"exact"})
    colour = _step_colours(p.step)
    curves = {}
    for (panel, step), q in p.groupby(["panel", "step"]):
      curves[panel, step] = symlog_density(q.eigenvalue, q.w, grid,
                                           linthresh, bandwidth)
    peak = max((c.max() for c in curves.values()), default=1.0) or 1.0
    floor = 1e-5 * peak
    fig, axes = _grid(len(panels), sharex=True, sharey=True)
    for ax, panel in zip(axes, panels):
      for step in sorted(colour):
        if (panel, step) in curves:
          ax.plot(x, np.maximum(curves[panel, step], floor), lw=1,
                  color=colour[step], label=f"step {step}")
      if not any(k[0] == panel for k in curves):
        ax.text(0.5, 0.5, "no spectrum", ha="center", transform=ax.transAxes)
      ax.axvline(0, color="0.4", lw=0.6, ls=":")
      ax.set_xscale("symlog", linthresh=linthresh)
      ax.xaxis.set_major_locator(ticker.SymmetricalLogLocator(
          base=10, linthresh=linthresh, subs=[1.0]))
      ax.xaxis.get_major_locator().set_params(numticks=7)
      ax.xaxis.set_minor_locator(ticker.NullLocator())
      ax.set_yscale("log")
      ax.set_ylim(floor, 2 * peak)
      ax.set_title(f"exact {ref}" if panel == "exact" else panel, fontsize=8)
      ax.set(xlabel="eigenvalue", ylabel="density (per symlog unit)")
      ax.tick_params(labelsize=6)
    axes[0].legend(fontsize=6, title="training step", title_fontsize=6)
    fig.suptitle(f"{problem}: {ref} spectra on {data}", fontsize=9)
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


def quality(df: pd.DataFrame, out: Path) -> list[Path]:
  """Per problem: one panel per metric on the whole network ("all"), bars
  by block type, grouped by mode."""
  paths = []
  df = _finite(_complete(df, "step", "data", "block"), "value")
  df = df[df.block == "all"]
  for problem, p in df.groupby("problem"):
    metric_names = sorted(p.metric.unique())
    fig, axes = _grid(len(metric_names))
    for ax, metric in zip(axes, metric_names):
      table = p[p.metric == metric].pivot_table(
          index="mode", columns="curvature", values="value", aggfunc="mean")
      ax.set(title=metric, xlabel="")
      if table.empty:
        ax.text(0.5, 0.5, "no finite values", ha="center",
                transform=ax.transAxes)
        continue
      table.plot.bar(ax=ax, rot=30, fontsize=7)
      ax.legend(fontsize=6)
    paths += save(fig, out / f"quality_{problem}")
  return paths


def quality_through_training(df: pd.DataFrame, out: Path,
                             colour: dict[str, str]) -> list[Path]:
  """Per problem, reference and data: each metric against the step, a line
  per method and block (the whole network, "all", drawn thicker)."""
  paths = []
  df = _finite(_complete(df, "step", "data", "block"), "value")
  styles = ["--", ":", "-.", (0, (3, 1, 1, 1))]
  for (problem, ref, data), p in df.groupby(["problem", "reference", "data"]):
    metric_names = sorted(p.metric.unique())
    blocks = sorted(set(p.block) - {"all"})
    fig, axes = _grid(len(metric_names), width=4.5)
    for ax, metric in zip(axes, metric_names):
      mean = p[p.metric == metric].groupby(
          ["method", "block", "step"]).value.mean().dropna()
      for (method, block), s in mean.groupby(level=["method", "block"]):
        s = s.droplevel(["method", "block"]).sort_index()
        whole = block == "all"
        ax.plot(s.index, s.to_numpy(), marker="o", ms=3 if whole else 2,
                lw=2.2 if whole else 0.8, alpha=1 if whole else 0.7,
                ls="-" if whole else styles[blocks.index(block) % 4],
                color=colour[method],
                label=method if whole else f"{method}: {block}")
      _step_panel(ax, metric, p.step.unique())
    fig.suptitle(f"{problem}: quality vs exact {ref} on {data}", fontsize=9)
    paths += save(fig, out / f"quality_steps_{_slug(problem, ref, data)}")
  return paths


def statistics(df: pd.DataFrame, out: Path) -> list[Path]:
  """Per problem: each spectral statistic against the step, a line per
  matrix (exact solid, approximations dashed), error bars from `stderr`."""
  paths = []
  df = _finite(_complete(df, "step", "data"), "value",
               *(["stderr"] if "stderr" in df else []))
  if "stderr" not in df:
    df["stderr"] = np.nan
  for problem, p in df.groupby("problem"):
    names = sorted(p.statistic.unique())
    several = p.data.nunique() > 1
    fig, axes = _grid(len(names))
    for ax, name in zip(axes, names):
      s = p[p.statistic == name].groupby(
          ["source", "matrix", "data", "step"])[["value", "stderr"]].mean()
      s = s.dropna(subset=["value"])
      for (source, matrix, data), q in s.groupby(
          level=["source", "matrix", "data"]):
        steps = q.index.get_level_values("step")
        label = f"{matrix} ({source}{', ' + data if several else ''})"
        ax.errorbar(steps, q.value, yerr=q.stderr.abs().fillna(0), marker="o",
                    ms=3, lw=1, capsize=2, label=label,
                    ls="-" if source.startswith("exact") else "--")
      values = s.value.to_numpy()
      if values.size and values.min() > 0 and values.max() > 100 * values.min():
        ax.set_yscale("log")
      _step_panel(ax, name, p.step.unique())
    fig.suptitle(f"{problem}: spectral statistics", fontsize=9)
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


def training(df: pd.DataFrame, out: Path, colour: dict[str, str],
             name: str = "training") -> list[Path]:
  """Per problem: the training error (else loss) against the step and
  against steady-state seconds, the median over seeds with the
  interquartile band, test error as dots."""
  paths = []
  y, what = next(((c, w) for c, w in TRAINING_CURVES
                  if c in df and df[c].notna().any()), TRAINING_CURVES[-1])
  test = y.replace("train_", "test_") if y.startswith("train_") else None
  styles = ["-", "--", ":", "-."]
  for problem, p in df.groupby("problem"):
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for method, m in p.groupby("method"):
      for i, (label, runs) in enumerate(m.groupby("label")):
        n = runs.run_id.nunique()
        g = runs.groupby("step")
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
    axes[0].legend(fontsize=7, title="median, band: quartiles; dots: test",
                   title_fontsize=7)
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
      ys = ys[np.isfinite(ys)]
      if xs.size and xs.min() > 0 and xs.max() >= 10 * xs.min():
        ax.set_xscale("log")
      if ys.size and ys.min() > 0 and ys.max() > 10 * ys.min():
        ax.set_yscale("log")
      ax.set(xlabel=key, ylabel=p.metric.iloc[0], title=problem)
      if ax.lines:
        ax.legend(fontsize=7, title="star: chosen; x: diverged",
                  title_fontsize=7)
    paths += save(fig, out / f"tuning_{problem}")
  return paths


def timing(df: pd.DataFrame, out: Path) -> list[Path]:
  """Per problem and device: median time of each phase as a multiple of a
  gradient step, a bar group per method and setting."""
  paths = []
  for problem, p in df.groupby("problem"):
    table = p.pivot_table(index="label", columns="phase",
                          values="ratio_to_grad_step", aggfunc="median")
    fig, ax = plt.subplots(figsize=(8, 3.8))
    table.plot.bar(ax=ax, rot=20, logy=True)
    device = ", ".join(p.device_kind.unique())
    ax.set(ylabel="time / gradient step", xlabel="",
           title=f"{problem} ({device})")
    ax.axhline(1.0, color="k", lw=0.5)
    ax.legend(fontsize=7)
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
