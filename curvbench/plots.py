"""Figures of a merged sweep; each saved as PNG and PDF.

- spectra: density of log10 eigenvalues, exact (black) vs each approximation
- quality: metrics per block type, one bar group per estimation mode
- training: loss against steps and against wall time
- timing: time per phase relative to a gradient step
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from curvbench import metrics  # noqa: E402


def _save(fig, path: Path) -> list[Path]:
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.tight_layout()
  paths = [path.with_suffix(".png"), path.with_suffix(".pdf")]
  for p in paths:
    fig.savefig(p, dpi=120)
  plt.close(fig)
  return paths


def _grid(n, width=4.0, height=3.0, cols=3):
  cols = min(cols, n)
  rows = -(-n // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows),
                           squeeze=False)
  for ax in axes.flat[n:]:
    ax.set_visible(False)
  return fig, axes.flat


def _log_density(df, grid, floor, bandwidth=0.15):
  values = metrics.log_spectrum(df["eigenvalue"], floor)
  weights = df["weight"].fillna(1.0).to_numpy()
  return metrics.density(values, weights, grid, bandwidth)


def spectra(df: pd.DataFrame, out: Path) -> list[Path]:
  """Per problem and exact matrix: its density against each approximation's."""
  paths = []
  approx = df[df.source == "approx"]
  exact = df[df.source == "exact"].drop_duplicates(
      ["problem", "matrix", "seed", "index"])
  for problem, ex in exact.groupby("problem"):
    ap = approx[approx.problem == problem]
    references = sorted(ex.matrix.unique())
    fig, axes = _grid(len(references))
    for ax, ref in zip(axes, references):
      e = ex[ex.matrix == ref]
      top = np.abs(e.eigenvalue).max()
      floor = 1e-8 * top if top > 0 else 1e-12
      grid = np.linspace(np.log10(floor) - 0.5, np.log10(max(top, floor)) + 1,
                         400)
      ax.plot(grid, _log_density(e, grid, floor), "k", lw=2, label=f"exact {ref}")
      matching = ap[ap.reference == ref]
      for label, a in matching.groupby("method"):
        ax.plot(grid, _log_density(a, grid, floor), lw=1, label=label)
      ax.set(title=f"{problem}: {ref}", xlabel="log10 eigenvalue",
             ylabel="density")
      ax.legend(fontsize=6)
    paths += _save(fig, out / f"spectra_{problem}")
  return paths


def quality(df: pd.DataFrame, out: Path) -> list[Path]:
  """Per problem: one panel per metric, bars by block type, grouped by mode."""
  paths = []
  for problem, p in df.groupby("problem"):
    metric_names = sorted(p.metric.unique())
    fig, axes = _grid(len(metric_names))
    for ax, metric in zip(axes, metric_names):
      table = p[p.metric == metric].pivot_table(
          index="mode", columns="curvature", values="value", aggfunc="mean")
      table.plot.bar(ax=ax, rot=30, fontsize=7)
      ax.set(title=metric, xlabel="")
      ax.legend(fontsize=6)
    paths += _save(fig, out / f"quality_{problem}")
  return paths


def training(df: pd.DataFrame, out: Path) -> list[Path]:
  """Per problem: training loss vs step and vs wall time, test loss markers."""
  paths = []
  for problem, p in df.groupby("problem"):
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for method, m in p.sort_values("step").groupby("method"):
      for ax, x in zip(axes, ("step", "wall_s")):
        line, = ax.plot(m[x], m.train_loss, lw=1, label=method)
        test = m.dropna(subset=["test_loss"])
        ax.plot(test[x], test.test_loss, "o", ms=3, color=line.get_color())
    for ax, x in zip(axes, ("step", "wall time (s)")):
      ax.set(xlabel=x, ylabel="loss (line: train batch, dots: test)",
             yscale="log", title=problem)
    axes[0].legend(fontsize=6)
    paths += _save(fig, out / f"training_{problem}")
  return paths


def timing(df: pd.DataFrame, out: Path) -> list[Path]:
  """Per problem: median time of each phase as a multiple of a gradient step."""
  paths = []
  for problem, p in df.groupby("problem"):
    table = p.pivot_table(index="method", columns="phase",
                          values="ratio_to_grad_step", aggfunc="mean")
    fig, ax = plt.subplots(figsize=(8, 3.5))
    table.plot.bar(ax=ax, rot=20, fontsize=7, logy=True)
    device = ", ".join(p.device_kind.unique())
    ax.set(ylabel="time / gradient step", xlabel="",
           title=f"{problem} ({device})")
    ax.axhline(1.0, color="k", lw=0.5)
    ax.legend(fontsize=6)
    paths += _save(fig, out / f"timing_{problem}")
  return paths


def all_figures(tables: dict[str, pd.DataFrame], out: Path) -> list[Path]:
  paths = []
  if "spectra" in tables:
    paths += spectra(tables["spectra"], out)
  if "quality" in tables:
    paths += quality(tables["quality"], out)
  if "training" in tables:
    paths += training(tables["training"], out)
  if "timing" in tables:
    paths += timing(tables["timing"], out)
  return paths
