"""Timing: seconds per phase of the curvature and of the optimizer's step,
against an Adam step on the same batch (`curvbench.timing`)."""

import dataclasses

import pandas as pd

from components import ListOf, Number, OneOf, Whole, setting
from curvbench import aggregate, plots, timing
from curvbench.measurements import MEASUREMENTS, Measurement
from curvbench.optimizers.adam import Adam

POSITIVE = Number(0, low_in=False)


@MEASUREMENTS.register
@dataclasses.dataclass
class Timing(Measurement):
  """Per phase: compile time apart, then the median of `repeats` timed
  calls after `warmup` untimed ones; the optimizer's step timed by whole
  cycles, interleaved with the Adam step of `baseline`."""

  name = "timing"
  tables = ("timing",)
  needs_device_alone = True

  phases: list[str] = setting(
      list(timing.PHASES), ListOf(OneOf(timing.PHASES)),
      "the phases to time (adam_step always is; curvature phases only "
      "where the optimizer uses a curvature)")
  warmup: int = setting(2, Whole(0), "untimed repeats first")
  repeats: int = setting(10, Whole(1), "timed repeats; each repeat of the "
                         "two steps times one cycle of each, in turn")
  damping: float = setting(1e-3, POSITIVE, "of the curvature phases")
  learning_rate: float = setting(1e-2, POSITIVE, "of grad_step")
  baseline: Adam = dataclasses.field(default_factory=Adam)

  def uses_optimizer(self, run):
    return True

  def uses_curvature(self, run):
    return run.optimizer.uses_curvature

  def batches(self, run):
    key = ("measure.batch_size" if run.measure.batch_size is not None
           else "problem.batch_size")
    return [(key, run.measure.batch_size or run.problem.batch_size)]

  def measure(self, ctx):
    return dict(timing=timing.measure(
        ctx.problem.loss_fn, ctx.curvature, ctx.params, ctx.batch,
        dataclasses.asdict(self), ctx.run.optimizer, self.baseline, ctx.rng,
        progress=ctx.run.progress, mesh=ctx.mesh))

  # --- the report --------------------------------------------------------

  def summaries(self, report):
    t = report.tables.get("timing")
    if t is None:
      return []
    index = ["problem", "device_kind", "label"]
    out = []
    steps = t[t.phase == "optimizer_step"] if "ratio_to_adam_step" in t \
        else t.iloc[:0]
    if not steps.empty:
      g = steps.groupby(index, dropna=False)
      out.append((
          "step_ratio", "Optimizer step / Adam step (same problem, same "
          "process)", g.agg(step_s=("median_s", "median"),
                            ratio_to_adam_step=("ratio_to_adam_step",
                                                "median"),
                            compile_s=("compile_s", "median"),
                            n=("run_id", "nunique")).reset_index()))
    out.append(("timing", "Time per phase / time of a gradient step",
                aggregate.medians(t, index, "phase", "ratio_to_grad_step")))
    seconds = t.pivot_table(index=index, columns="phase",
                            values=["median_s", "compile_s"],
                            aggfunc="median")
    seconds.columns = [f"{p}_{v}" for v, p in seconds.columns]
    out.append(("timing_seconds", "Seconds per phase (median) and compile "
                "time", seconds.reset_index()))
    if "program_bytes" in t:  # records from before memory was recorded
      out.append(("timing_memory", "Memory per phase (MiB): XLA's figure for "
                  "its program; the device's peak where measured",
                  memory(t, index)))
    return out

  def figures(self, report, out):
    if "timing" not in report.tables:
      return []
    return plots.timing(report.tables["timing"], out)


def memory(rows: pd.DataFrame, index: list[str]) -> pd.DataFrame:
  """MiB per phase: the median of XLA's figure for the phase's compiled
  program (`program_bytes`) and, where the device measured one, the median
  over runs of the device's peak (`device_peak_mib`)."""
  mib = rows.assign(program_mib=rows.program_bytes / 2 ** 20)
  table = aggregate.medians(mib, index, "phase", "program_mib")
  peaks = rows.get("device_peak_bytes")
  if peaks is not None and peaks.notna().any():
    per_run = rows.groupby([*index, "run_id"], dropna=False)[
        "device_peak_bytes"].max() / 2 ** 20
    peak = per_run.groupby(level=index, dropna=False).median()
    table = table.merge(peak.rename("device_peak_mib").reset_index(),
                        on=index, how="left")
  return table
