"""Timing: seconds per phase of the curvature and of the optimizer's step,
each against a baseline optimizer's step timed beside it, with the
machine's load while it ran (`clock`, `load`)."""

import dataclasses
from typing import Any

import jax
import numpy as np
import pandas as pd

from curvbench.components import Choice, ListOf, Number, OneOf, Whole, setting
from curvbench.core import stats
from curvbench.core.sections import Section, Table, spread, wide
from curvbench.measurements import MEASUREMENTS, Measurement, Outcome
from curvbench.measurements.timing import clock, figures, load
from curvbench.optimizers import OPTIMIZERS

POSITIVE = Number(0, low_in=False)
BUSY = ("measure", "wait", "refuse")


@MEASUREMENTS.register
@dataclasses.dataclass
class Timing(Measurement):
  """Per phase: compile time apart, then `repeats` rounds (after `warmup`
  untimed ones) that each time every phase once, the optimizer's step and
  the baseline's by whole cycles; every ratio is taken round by round."""

  name = "timing"
  tables = ("timing", "timing_samples")
  needs_device_alone = True

  phases: list[str] = setting(
    list(clock.PHASES),
    ListOf(OneOf(clock.PHASES)),
    "the phases to time (baseline_step always is; curvature phases only "
    "where the optimizer uses a curvature)",
  )
  warmup: int = setting(2, Whole(0), "untimed rounds first")
  repeats: int = setting(
    30,
    Whole(1),
    "timed rounds; each times every "
    "phase once, in turn (with 30, two runs on an idle "
    "machine gave step ratios within 10 % of each other)",
  )
  damping: float = setting(1e-3, POSITIVE, "of the curvature phases")
  learning_rate: float = setting(1e-2, POSITIVE, "of grad_step")
  baseline: Any = setting(
    None,
    Choice(OPTIMIZERS, default="adam"),
    "the first-order optimizer "
    "every phase is timed against (measure/timing/baseline=NAME, its "
    "settings measure.timing.baseline.KEY)",
  )
  busy_share: float = setting(
    0.1,
    Number(0, 1),
    "other processes' share of the CPUs above which "
    "the machine counts as busy and the timing as contended",
  )
  when_busy: str = setting(
    "measure",
    OneOf(BUSY),
    "on a busy machine: measure (time anyway, "
    "the figures flagged), wait (up to busy_wait_s for a quiet one) or "
    "refuse (stop the run, naming the load)",
  )
  busy_wait_s: float = setting(
    300.0, Number(0), "the longest wait for a quiet machine (when_busy=wait)"
  )

  def uses_optimizer(self, run):
    return True

  def uses_curvature(self, run):
    return run.optimizer.uses_curvature

  def batches(self, run):
    key = (
      "measure.batch_size"
      if run.measure.batch_size is not None
      else "problem.batch_size"
    )
    return [(key, run.measure.batch_size or run.problem.batch_size)]

  def run_disagreements(self, run, prefix):
    if self.baseline is not None and self.baseline.uses_curvature:
      first_order = [
        n for n in OPTIMIZERS if not OPTIMIZERS.get(n).uses_curvature
      ]
      yield (
        f"{prefix}.baseline: {self.baseline.name} uses a curvature; "
        "the baseline is a first-order optimizer, the unit every phase "
        f"is measured in (choose one of {', '.join(first_order)})."
      )

  def measure(self, ctx):
    problem = ctx.problem
    state = None
    if problem.has_state:
      dtype = jax.tree.leaves(ctx.params)[0].dtype
      state = (problem.next_model_state, problem.init_model_state(dtype))
    return Outcome(
      clock.measure(
        problem.loss_fn,
        ctx.curvature,
        ctx.params,
        ctx.batch,
        self,
        ctx.run.optimizer,
        ctx.rng,
        progress=ctx.run.progress,
        mesh=ctx.mesh,
        model_state_update=state,
        log=ctx.log,
      )
    )

  def headline(self, tables):
    rows = tables.get("timing")
    if rows is None or rows.empty:
      return super().headline(tables)
    phases = ", ".join(
      f"{row.phase} {1e3 * row.median_s:.3g} ms "
      f"[{1e3 * row.q25_s:.3g}, {1e3 * row.q75_s:.3g}]"
      + (
        f" ({row.ratio_to_baseline:.3g}x {row.baseline} "
        f"[{row.ratio_q25:.3g}, {row.ratio_q75:.3g}])"
        if np.isfinite(row.ratio_to_baseline)
        else ""
      )
      for row in rows.itertuples()
    )
    first = rows.iloc[0]
    load = (
      "contended: other processes held the cores"
      if first.get("contended") in (True, 1)  # NaN: not known, not contended
      else f"others used {first.get('others_cpu_share', float('nan')):.0%} "
      "of the CPUs"
    )
    return (
      f"per phase: {phases} (median [quartiles] of "
      f"{int(rows.repeats.min())} repeats, steady state, on "
      f"{first.get('device_kind', 'this device')}; {load})"
    )

  # --- the report --------------------------------------------------------

  def section(self, report, out):
    rows = report.tables.get("timing")
    if rows is None:
      return None
    samples = report.tables.get("timing_samples")
    found = Section(
      "Timing",
      "What does one step cost, in steps of the baseline "
      "optimizer timed beside it on the same machine?",
    )
    if samples is None:
      found.notes.append(
        "These timings were recorded before paired "
        "samples: rerun them for ratios with their spread."
      )
      return found
    ratios = phase_ratios(rows, samples)
    mib = memory(rows)
    steps = ratios[ratios.phase == "optimizer_step"]
    found.findings += [
      finding(group)
      for _, group in steps.groupby(["problem", "device_kind"], sort=True)
    ]
    found.findings += contention(rows)
    found.tables += [
      Table(
        "step_ratio",
        "Optimizer step / baseline step: the median "
        "[quartiles] of the ratios paired round by round, pooled over "
        "runs; step ms the same over its seconds; × baseline "
        "flops the ratio of XLA's operation counts (a time ratio far "
        "above it is overhead, not arithmetic); compile s the "
        "median over runs; others' CPU the largest share other "
        "processes took in a run",
        steps,
        view=step_view(steps),
      ),
      Table(
        "timing",
        "Every phase / the baseline step: median "
        "[quartiles] of the paired ratios, pooled over runs",
        ratios,
        view=wide(ratios, ["problem", "device_kind", "label"], "phase"),
        detail=True,
      ),
      Table(
        "timing_memory",
        "Memory per phase (MiB): XLA's figure for "
        "its program; the device's peak where measured; median "
        "[quartiles] over runs",
        mib,
        view=wide(mib, ["problem", "device_kind", "label"], "phase"),
        detail=True,
      ),
    ]
    found.figures += figures.timing(ratios, out)
    return found


INDEX = ["problem", "device_kind", "label"]


def phase_ratios(rows: pd.DataFrame, samples: pd.DataFrame) -> pd.DataFrame:
  """Per problem, device kind, label and phase: the median, `q25` and
  `q75` of the paired ratios to the baseline of every timed round of every
  run, the same of the seconds (`seconds_median`, ...), the median compile
  seconds and XLA flop ratio to the baseline (`flop_ratio`) over runs,
  `n` runs, `samples` rounds in all, the baseline, and the largest share
  of the CPUs other processes took in a run."""
  if "flop_ratio_to_baseline" not in rows:  # recorded before flop counts
    rows = rows.assign(flop_ratio_to_baseline=float("nan"))
  if "mode" not in rows:
    rows = rows.assign(mode=None)
  labelled = samples.merge(
    rows[
      [
        "run_id",
        "phase",
        "device_kind",
        "baseline",
        "compile_s",
        "others_cpu_share",
        "contended",
        "flop_ratio_to_baseline",
        "mode",
      ]
    ],
    on=["run_id", "phase"],
    how="left",
    suffixes=("", "_row"),
  )
  labelled = labelled.drop(columns=[c for c in labelled if c.endswith("_row")])
  out = []
  for key, group in labelled.groupby(
    [*INDEX, "phase"], dropna=False, sort=False
  ):
    median, q25, q75 = stats.quartiles(group.ratio_to_baseline)
    s_median, s_q25, s_q75 = stats.quartiles(group.seconds)
    per_run = group.groupby("run_id")
    out.append(
      dict(
        zip([*INDEX, "phase"], key),
        baseline=group.baseline.iloc[0],
        mode=group["mode"].iloc[0],
        median=median,
        q25=q25,
        q75=q75,
        seconds_median=s_median,
        seconds_q25=s_q25,
        seconds_q75=s_q75,
        compile_s=per_run.compile_s.first().median(),
        flop_ratio=per_run.flop_ratio_to_baseline.first().median(),
        n=group.run_id.nunique(),
        samples=len(group),
        others_cpu_share=per_run.others_cpu_share.first().max(),
        contended=int(per_run.contended.first().astype(bool).sum()),
      )
    )
  return pd.DataFrame(out)


def step_view(steps: pd.DataFrame) -> pd.DataFrame:
  """The step ratios as the page shows them: one row per method."""
  return pd.DataFrame(
    {
      "problem": steps.problem,
      "device": steps.device_kind,
      "method": steps.label,
      "estimation mode": steps["mode"].fillna("—"),
      "baseline": steps.baseline,
      "× baseline step": [
        spread(m, lo, hi)
        for m, lo, hi in zip(steps["median"], steps.q25, steps.q75)
      ],
      "step ms": [
        spread(1e3 * m, 1e3 * lo, 1e3 * hi)
        for m, lo, hi in zip(
          steps.seconds_median, steps.seconds_q25, steps.seconds_q75
        )
      ],
      "× baseline flops": steps.flop_ratio.round(2),
      "compile s": steps.compile_s.round(2),
      "runs × rounds": [
        f"{n} × {s // max(n, 1)}" for n, s in zip(steps.n, steps.samples)
      ],
      "others' CPU": [f"{100 * x:.0f} %" for x in steps.others_cpu_share],
    }
  )


def finding(steps: pd.DataFrame) -> str:
  """The headline of one problem's step ratios, costliest step first."""
  first = steps.iloc[0]
  parts = []
  for step in steps.sort_values("median", ascending=False).itertuples():
    flag = (
      f", contended in {step.contended} of {step.n} runs"
      if step.contended
      else ""
    )
    flops = (
      ""
      if np.isnan(step.flop_ratio)
      else f", {step.flop_ratio:.3g}x in XLA's flop count"
    )
    parts.append(
      f"{step.label} {spread(step.median, step.q25, step.q75)} "
      f"({step.n} runs x {step.samples // max(step.n, 1)} "
      f"rounds{flag}){flops}"
    )
  return (
    f"{first.problem} ({first.device_kind}), one optimizer step in "
    f"{first.baseline} steps, median [quartiles] of the paired rounds: "
    + "; ".join(parts)
    + "."
  )


def contention(rows: pd.DataFrame) -> list[str]:
  """A line naming the runs timed on a busy machine, and by how much."""
  per_run = rows.groupby("run_id").first()
  busy = per_run[per_run.contended.astype(bool)]
  if busy.empty:
    return []
  return [
    f"{len(busy)} of {len(per_run)} timing runs ran while other "
    f"processes used more of the CPUs than busy_share allows (up to "
    f"{100 * busy.others_cpu_share.max():.0f} %, load average up to "
    f"{busy.load_average.max():.2f} on {int(busy.cpu_count.max())} "
    "CPUs): their figures are flagged; rerun on an idle machine, or "
    "with measure.timing.when_busy=wait."
  ]


def memory(rows: pd.DataFrame) -> pd.DataFrame:
  """MiB per phase, median over runs with quartiles and `n` runs: XLA's
  figure for the phase's compiled program and, where the device measured
  one, the device's peak over the whole run (phase `device peak`)."""
  mib = rows.assign(mib=rows.program_bytes / 2**20)
  peaks = rows.get("device_peak_bytes")
  if peaks is not None and peaks.notna().any():
    peak = (
      rows.groupby([*INDEX, "run_id"], dropna=False)["device_peak_bytes"]
      .max()
      .reset_index()
    )
    mib = pd.concat(
      [
        mib,
        peak.assign(phase="device peak", mib=peak.device_peak_bytes / 2**20),
      ]
    )
  return stats.over_runs(mib, INDEX, "phase", "mib")


__all__ = ["Timing", "load", "memory", "phase_ratios"]
