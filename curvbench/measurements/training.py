"""Training: the loss and error against steps and seconds, with any
optimizer; with a tuning grid (`tuning.grid`), each optimizer's best
setting (`curvbench.tuning`)."""

import dataclasses
from typing import Any

import numpy as np
import pandas as pd

from components import Parsed, Whole, setting
from curvbench import checkpoints, plots, training, tuning
from curvbench.measurements import MEASUREMENTS, Measurement

STEPS = Parsed(lambda v: training.measurement_steps(v, 2**62),
               "a list of whole numbers >= 0, or 'log:N' (N >= 2)")


def save_checkpoint(ctx, step: int, params) -> None:
  """Saves `params` as the run's checkpoint of `step`."""
  path = checkpoints.path_for("checkpoints", step)
  checkpoints.save(ctx.run_dir.own(str(path)), params, step=step,
                   problem=ctx.problem.name)


@MEASUREMENTS.register
@dataclasses.dataclass
class Training(Measurement):
  """The loss curve of the run's optimizer: one row per logged step, the
  loss and error on fixed training and test examples every `eval_every`
  steps, wall time with compilation apart."""

  name = "training"
  tables = ("training",)
  tuned = True

  num_steps: int = setting(200, Whole(1), "training steps")
  log_every: int = setting(1, Whole(1), "steps between rows")
  eval_every: int = setting(20, Whole(1), "steps between evaluations of "
                            "loss and error")
  train_eval_size: int | None = setting(
      1000, Whole(1, null=True), "the first training examples evaluated "
      "(null: all; the default takes all where there are fewer)")
  eval_size: int | None = setting(None, Whole(1, null=True),
                                  "the first test examples (null: all)")
  checkpoint_steps: Any = setting([], STEPS, "save the parameters after "
                                  "these steps (or log:N)")

  def uses_optimizer(self, run):
    return True

  def uses_curvature(self, run):
    return run.optimizer.uses_curvature

  def batches(self, run):
    return [("problem.batch_size", run.problem.batch_size)]

  def run_disagreements(self, run, prefix):
    try:
      training.measurement_steps(self.checkpoint_steps, self.num_steps)
    except ValueError as e:
      yield f"{prefix}.checkpoint_steps: {e}"
    sizes = run.problem.data.sizes()
    defaults = Training()
    for key, asked, split, have in zip(
        ("train_eval_size", "eval_size"),
        (self.train_eval_size, self.eval_size), ("training", "test"),
        sizes or (None, None)):
      given = asked != getattr(defaults, key)  # the default takes what there is
      if given and asked is not None and have is not None and asked > have:
        yield (f"{prefix}.{key}={asked} is more than the {have} {split} "
               f"examples of dataset {run.problem.data.name!r}: lower it "
               "(null: all of them).")

  def measure(self, ctx):
    steps = training.measurement_steps(self.checkpoint_steps, self.num_steps)
    optimizer = ctx.run.optimizer.make(ctx.problem.loss_fn, ctx.curvature,
                                       ctx.mesh)
    rows = training.run(ctx.problem, optimizer, ctx.params, self, ctx.rng,
                        ctx.run.data_seed, progress=ctx.run.progress,
                        at_steps=steps,
                        on_step=lambda step, point: save_checkpoint(
                            ctx, step, point), mesh=ctx.mesh)
    return dict(training=rows)

  # --- the report --------------------------------------------------------

  def summaries(self, report):
    out = []
    tuned = report.once("tuning", tuning_table)
    if tuned is not None:
      out.append(("tuning", "Tuning: each setting's score (mean over seeds)",
                  tuned))
    if "training" in report.tables:
      out.append(("training", "Training: final errors and losses",
                  summary(report.tables["training"])))
    return out

  def figures(self, report, out):
    train = report.tables.get("training")
    if train is None:
      return []
    tuned = report.once("tuning", tuning_table)
    if tuned is None:
      return plots.training(train, out, report.colour)
    return (plots.training(plots.tuned_curves(train, tuned), out,
                           report.colour)
            + plots.training(train, out, report.colour, name="training_all")
            + plots.sensitivity(tuned, out, report.colour))

  def notes(self, report):
    tuned = report.once("tuning", tuning_table)
    if tuned is None:
      return []
    best = tuned[tuned.best]
    return [f"Tuned by {best.metric.iloc[0]} (mean over seeds); the main "
            "training figure shows each optimizer's best setting: " + "; ".join(
                f"{r.problem} {r.method}: {r.setting or 'its only setting'}"
                for r in best.itertuples())]


def _tuned_runs(done: pd.DataFrame) -> pd.DataFrame:
  """The training runs of optimizers their sweep tuned over a grid."""
  grid_cols = [c for c in done.columns if c.startswith("config:tuning.grid.")]
  if not grid_cols or "config:optimizer.name" not in done:
    return done.iloc[:0]
  tuned = done.apply(lambda r: any(
      c.startswith(f"config:tuning.grid.{r['config:optimizer.name']}.")
      and pd.notna(r[c]) for c in grid_cols), axis=1)
  return done[tuned & (done.measure == "training")]


def tuning_table(report) -> pd.DataFrame | None:
  """Each tuned setting's score (mean over seeds) and the best ones; None
  where the sweep tuned nothing."""
  tuned = _tuned_runs(report.done)
  if tuned.empty or "training" not in report.tables:
    return None
  metrics = tuned["config:tuning.metric"].unique()
  if len(metrics) > 1:
    raise ValueError(f"The tuned runs under {report.root} use different "
                     f"tuning.metric values {sorted(metrics)}; report them "
                     "apart.")
  scores = tuning.run_scores(report.tables["training"], metrics[0])
  table = tuning.select(tuned, scores, ["problem", "method"])
  return table.assign(metric=metrics[0])


def summary(rows: pd.DataFrame) -> pd.DataFrame:
  """Per problem and label: medians over seeds of each run's final training
  and test error and loss, steps, wall and compile seconds; `n` seeds and
  how many of them diverged."""
  finals = []
  for run_id, run in rows.sort_values("step").groupby("run_id"):
    last = run.iloc[-1]
    row = dict(problem=last.problem, label=last.label, run_id=run_id,
               steps=last.step, wall_s=last.wall_s,
               diverged=bool(run.diverged.any()) if "diverged" in run
               else False)
    for column in ("compile_s", "train_error", "test_error", "train_loss",
                   "test_loss"):
      if column in run:
        values = run[column].dropna()
        row[f"final_{column}" if column != "compile_s" else column] = (
            values.iloc[-1] if len(values) else np.nan)
    finals.append(row)
  finals = pd.DataFrame(finals)
  g = finals.groupby(["problem", "label"], dropna=False)
  numbers = [c for c in finals.columns
             if c not in ("problem", "label", "run_id", "diverged")]
  return g[numbers].median().join(g.agg(
      n=("run_id", "nunique"), diverged=("diverged", "sum"))).reset_index()


__all__ = ["Training", "save_checkpoint", "summary", "tuning_table"]
