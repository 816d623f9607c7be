"""The timing measurement's figure: per problem, each phase's time as a
multiple of the baseline step timed beside it, the median of the paired
ratios with their interquartile range."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from curvbench.core import palette, plots
from curvbench.measurements.timing import clock

ORDER = (*clock.PHASES, "model_state_update")


def _phase_order(phases) -> list[str]:
  known = [p for p in ORDER if p in set(phases)]
  return known + sorted(set(phases) - set(known))


def _phase_bars(ax, ratios: pd.DataFrame):
  """A bar group per label (and device kind where several), a bar per
  phase with its interquartile error bar; runs and rounds under each
  group."""
  several = ratios.device_kind.nunique() > 1
  ratios = ratios.assign(
    group=ratios.label.astype(str)
    + np.where(several, " on " + ratios.device_kind.astype(str), "")
  )
  groups = sorted(ratios.group.unique())
  phases = _phase_order(ratios.phase)
  width = 0.8 / len(phases)
  for i, phase in enumerate(phases):
    # A phase keeps its hue and hatch in every figure (its place in ORDER).
    at = ORDER.index(phase) if phase in ORDER else len(ORDER) + i
    r = ratios[ratios.phase == phase].set_index("group").reindex(groups)
    err = np.clip([r["median"] - r.q25, r.q75 - r["median"]], 0, None)
    ax.bar(
      np.arange(len(groups)) + (i - (len(phases) - 1) / 2) * width,
      r["median"],
      width,
      yerr=np.nan_to_num(err),
      capsize=2,
      label=phase.replace("_", " "),
      color=palette.HUES[at % len(palette.HUES)],
      hatch=palette.HATCHES[at % len(palette.HATCHES)],
      edgecolor="0.15",
      linewidth=0.4,
    )
  counts = ratios.groupby("group")[["n", "samples"]].max()
  ax.set_xticks(
    np.arange(len(groups)),
    [f"{g}\n({counts.n[g]} runs, {counts.samples[g]} rounds)" for g in groups],
    rotation=20,
    ha="right",
    rotation_mode="anchor",
    fontsize=7,
  )


def timing(ratios: pd.DataFrame, out: Path) -> list[Path]:
  """Per problem (`phase_ratios` rows): each phase's time as a multiple of
  the baseline step timed beside it, a bar group per method and setting,
  the median of the paired ratios with interquartile error bars."""
  paths = []
  for problem, p in ratios.groupby("problem"):
    shown = p[p.phase != clock.BASELINE_PHASE]
    baseline = plots.listed(p, "baseline")
    fig, (ax,) = plots.grid(
      1, width=max(6.0, 1.4 * shown.label.nunique() + 2), height=4.2
    )
    if shown.empty:
      plots.no_values(ax, f"only the {baseline} step was timed")
    else:
      _phase_bars(ax, shown)
    plots.log_if_decades(ax, shown["median"], decades=1)
    ax.axhline(1.0, color="k", lw=0.6, ls="--", label=f"one {baseline} step")
    ax.set(
      ylabel=f"Time per phase (× one {baseline} step, lower is better)",
      title=f"{problem}: time of each phase of a step, on "
      f"{plots.listed(p, 'device_kind')}"
      + (f"; K-FAC in {modes}" if (modes := plots.listed(p, "mode")) else ""),
    )
    ax.title.set_wrap(True)
    plots.legend_below(
      fig,
      ax,
      title="error bars: interquartile range of "
      "the ratios paired round by round",
    )
    paths += plots.save(fig, out / f"timing_{problem}", data=p)
  return paths
