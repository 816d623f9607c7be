"""The training measurement's figures, each saved as PNG and PDF: the
training error (median and quartiles over seeds) against iterations and
against seconds; with a tuning sweep, the best settings, every setting,
and the score against each tuned hyperparameter."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from curvbench.core import metrics, plots

# The curve drawn: the first of these the table has (`metrics.TRAINING`).
TRAINING_CURVES = ("train_error", "train_loss", "batch_loss")


def _common_steps(runs: pd.DataFrame) -> pd.DataFrame:
  """The rows up to the last step every seed reached (diverged seeds
  aside): runs to a time budget end at different steps, and a median over
  the seeds that ran longest would jump where the others stop."""
  ends = runs.groupby("run_id").step.max()
  if "diverged" in runs:
    finished = ~runs.groupby("run_id").diverged.any().astype(bool)
    ends = ends[finished] if finished.any() else ends
  return runs[runs.step <= ends.min()]


def _seconds_curve(runs: pd.DataFrame, y: str):
  """`(x, median, q25, q75)` of `y` against seconds: on the time grid
  where the runs have one (every seed evaluated at the same seconds),
  else at each step's median seconds."""
  grid = runs.get("time_point_s")
  if grid is not None and grid.notna().any():
    g = runs[grid.notna()].groupby("time_point_s")[y]
  else:
    steps = _common_steps(runs)
    g = steps.groupby(steps.groupby("step").wall_s.transform("median"))[y]
  curve = g.median().dropna()
  return (
    curve.index,
    curve,
    g.quantile(0.25)[curve.index],
    g.quantile(0.75)[curve.index],
  )


def training(
  df: pd.DataFrame, out: Path, colour: dict[str, str], name: str = "training"
) -> list[Path]:
  """Per problem: the training error (else loss) against the step and
  against steady-state seconds (on the time grid where the runs had one),
  the median over seeds with the interquartile band, test error as dots;
  each step curve up to the step all its seeds reached. Colours are the
  report's, by label (`colour`); a method's settings differ in line
  style."""
  paths = []
  y = next(
    (c for c in TRAINING_CURVES if c in df and df[c].notna().any()),
    TRAINING_CURVES[-1],
  )
  test = y.replace("train_", "test_") if y.startswith("train_") else None
  styles = ["-", "--", ":", "-."]
  colours = plots.series_colours(df.assign(series=df.label), colour)
  for problem, p in df.groupby("problem"):
    fig, axes = plots.grid(2, width=5.0, height=3.8, cols=2, sharey=True)
    grid = "time_point_s" in p and p.time_point_s.notna().any()
    for _method, m in p.groupby("method"):
      for i, (label, runs) in enumerate(m.groupby("label")):
        n, c = runs.run_id.nunique(), colours[label]
        # Against the step, the evaluations every seed makes at the same
        # steps (a grid point after the start falls on each seed's own).
        by_step = runs[~(runs.time_point_s > 0)] if grid else runs
        g = _common_steps(by_step).groupby("step")
        curve = g[y].median().dropna()
        if curve.empty:
          continue
        lines = [
          (
            curve.index,
            curve,
            g[y].quantile(0.25)[curve.index],
            g[y].quantile(0.75)[curve.index],
          ),
          _seconds_curve(runs, y),
        ]
        for ax, (x, mid, lo, hi) in zip(axes, lines):
          ax.plot(
            x,
            mid,
            color=c,
            ls=styles[i % 4],
            lw=1.4,
            marker=plots.marker(colours, label),
            ms=4,
            markevery=None if ax is axes[1] and grid else 0.1,
            label=f"{label} (n={n})",
          )
          if n > 1:
            plots.band(ax, x, lo, hi, c)
        if test and test in runs:
          t = g[test].median().dropna()
          axes[0].plot(t.index, t, color=c, ls="none", marker="o", ms=3)
        diverged = (
          runs[runs.diverged.astype(bool)]
          if "diverged" in runs
          else runs.iloc[:0]
        )
        for ax, x in zip(axes, ("step", "wall_s")):
          ax.plot(
            diverged[x], np.full(len(diverged), curve.max()), "x", color=c, ms=7
          )
    axes[0].set(
      xlabel="Iteration (optimizer steps)",
      # Two lines: a paper's column is narrower than the words.
      ylabel=metrics.title(y).replace(" (", "\n(", 1),
      yscale="log",
      title=f"{problem}: against iterations",
    )
    axes[1].set(
      xlabel="Seconds of training (s"
      + (", on the time grid" if grid else "")
      + ")",
      yscale="log",
      title=f"{problem}: against seconds",
    )
    plots.legend_below(
      fig,
      axes[0],
      title="median over seeds (to the step all reached), "
      "band: quartiles; dots: test; seconds exclude "
      "compilation and evaluation",
    )
    paths += plots.save(fig, out / f"{name}_{problem}")
  return paths


def sensitivity(
  table: pd.DataFrame, out: Path, colour: dict[str, str]
) -> list[Path]:
  """Per problem: each method's tuning score against each tuned
  hyperparameter, the others held at the method's best setting."""
  paths = []
  for problem, p in table.groupby("problem"):
    keys = sorted(
      {k.split("=")[0] for s in p.setting for k in s.split(", ") if "=" in k}
    )
    if not keys:
      continue
    fig, axes = plots.grid(len(keys), width=4.5, height=3.5)
    for ax, key in zip(axes, keys):
      for method, m in p.groupby("method"):
        parsed = m.setting.map(
          lambda s: dict(kv.split("=", 1) for kv in s.split(", ") if "=" in kv)
        )
        if not all(key in d for d in parsed):
          continue
        best = parsed[m.best].iloc[0]
        same = parsed.map(
          lambda d, best=best, key=key: all(
            d.get(k) == v for k, v in best.items() if k != key
          )
        )
        points = sorted(
          (float(d[key]), score)
          for d, score in zip(parsed[same], m.score[same])
        )
        xs = [x for x, _ in points]
        ys = [v if np.isfinite(v) else np.nan for _, v in points]
        ax.plot(
          xs,
          ys,
          "-",
          marker=plots.marker(colour, method),
          color=colour[method],
          label=method,
        )
        ax.plot(
          [float(best[key])],
          [m.score[m.best].iloc[0]],
          "*",
          ms=12,
          color=colour[method],
        )
        diverged = [x for x, v in points if not np.isfinite(v)]
        if diverged:
          ax.plot(
            diverged,
            [np.nanmax(ys) if np.isfinite(ys).any() else 1] * len(diverged),
            "x",
            color=colour[method],
            ms=8,
          )
      all_x = np.concatenate([line.get_xdata() for line in ax.lines] or [[]])
      all_y = np.concatenate([line.get_ydata() for line in ax.lines] or [[]])
      plots.log_if_decades(ax, all_x, "x", decades=1)
      plots.log_if_decades(ax, all_y, "y", decades=1)
      ax.set(
        xlabel=f"{key} (the others at the chosen setting)",
        ylabel=metrics.title(p.metric.iloc[0]),
        title=f"{problem}: tuning score against {key}",
      )
    plots.legend_below(fig, axes[0], title="star: chosen; x: diverged")
    paths += plots.save(fig, out / f"tuning_{problem}")
  return paths


def tuned_curves(train: pd.DataFrame, tuning: pd.DataFrame) -> pd.DataFrame:
  """The training rows of each problem's chosen settings (and of methods
  that were not tuned)."""
  best = tuning[tuning.best]
  chosen = {
    (p, f"{m} ({s})" if s else str(m))
    for p, m, s in zip(best.problem, best.method, best.setting)
  }
  tuned = set(zip(tuning.problem, tuning.method))
  keep = [
    (p, m) not in tuned or (p, label) in chosen
    for p, m, label in zip(train.problem, train.method, train.label)
  ]
  return train[keep]
