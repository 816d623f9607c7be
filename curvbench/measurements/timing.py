"""Timing: seconds per phase of the curvature and of the optimizer's step,
against an Adam step on the same batch (`curvbench.timing`)."""

import dataclasses

import jax
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
  repeats: int = setting(30, Whole(1), "timed repeats; each repeat of the "
                         "two steps times one cycle of each, in turn (with "
                         "30, two runs on an idle machine gave step ratios "
                         "within 10 % of each other)")
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
        progress=ctx.run.progress, mesh=ctx.mesh,
        model_state_update=(ctx.problem.next_model_state,
                            ctx.problem.init_model_state(
                                jax.tree.leaves(ctx.params)[0].dtype))
        if ctx.problem.has_state else None))

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
      out.append(("step_ratio", "Optimizer step / Adam step (same problem, "
                  "same process): median over runs with quartiles over "
                  "runs, or for one run over its paired repeats; n runs, "
                  "repeats per run", step_ratio(steps, index)))
    unit, of = (("ratio_to_adam_step", "an Adam step")
                if "ratio_to_adam_step" in t
                else ("ratio_to_grad_step", "a gradient step"))
    out.append(("timing", f"Time per phase / time of {of}: median over runs, "
                "quartiles, n runs", aggregate.over_runs(t, index, "phase",
                                                        unit)))
    seconds = t.melt([*index, "run_id", "phase"], ["median_s", "compile_s"],
                     "what", "seconds")
    seconds["phase"] = seconds.phase + " " + seconds.what.str.removesuffix(
        "_s").str.replace("median", "run")
    out.append(("timing_seconds", "Seconds per phase (run: the median of a "
                "run's repeats; compile: once): median over runs, quartiles, "
                "n runs", aggregate.over_runs(seconds, index, "phase",
                                              "seconds")))
    if "program_bytes" in t:  # records from before memory was recorded
      out.append(("timing_memory", "Memory per phase (MiB): XLA's figure for "
                  "its program; the device's peak where measured",
                  memory(t, index)))
    return out

  def figures(self, report, out):
    if "timing" not in report.tables:
      return []
    return plots.timing(report.tables["timing"], out)


def step_ratio(steps: pd.DataFrame, index: list[str]) -> pd.DataFrame:
  """Per `index`: the optimizer step's seconds and compile seconds and its
  ratio to the Adam step (median over runs), the ratio's quartiles (over
  runs; for one run, over its repeats, each paired with the Adam sample
  beside it), `n` runs and `repeats` per run."""
  def one(group):
    ratio = group.ratio_to_adam_step
    alone = len(group) == 1 and "ratio_to_adam_q25" in group
    return pd.Series(dict(
        step_s=group.median_s.median(), compile_s=group.compile_s.median(),
        ratio_to_adam_step=ratio.median(),
        q25=group.ratio_to_adam_q25.iloc[0] if alone else ratio.quantile(.25),
        q75=group.ratio_to_adam_q75.iloc[0] if alone else ratio.quantile(.75),
        spread_over="repeats" if alone else "runs",
        n=group.run_id.nunique(), repeats=group.repeats.median()))

  return steps.groupby(index, dropna=False).apply(
      one, include_groups=False).reset_index()


def memory(rows: pd.DataFrame, index: list[str]) -> pd.DataFrame:
  """MiB per phase, median over runs with quartiles and `n` runs: XLA's
  figure for the phase's compiled program and, where the device measured
  one, the device's peak over the whole run (phase `device peak`)."""
  mib = rows.assign(mib=rows.program_bytes / 2 ** 20)
  peaks = rows.get("device_peak_bytes")
  if peaks is not None and peaks.notna().any():
    peak = rows.groupby([*index, "run_id"], dropna=False)[
        "device_peak_bytes"].max().reset_index()
    mib = pd.concat([mib, peak.assign(phase="device peak",
                                      mib=peak.device_peak_bytes / 2 ** 20)])
  return aggregate.over_runs(mib, index, "phase", "mib")
