"""Training: the loss and error against steps and seconds, with any
optimizer, to a budget of steps or of seconds; with a tuning grid
(`tuning.grid`), each optimizer's best setting (`curvbench.tuning`); and in
the report, each method at equal time and against a target error, with
intervals over seeds (`curvbench.comparison`)."""

import dataclasses
import functools
from typing import Any

import numpy as np
import pandas as pd

from components import Number, Parsed, Whole, setting
from curvbench import (checkpoints, comparison, plots, provenance, training,
                       tuning)
from curvbench.measurements import MEASUREMENTS, Measurement

STEPS = Parsed(lambda v: training.measurement_steps(v, 2**62),
               "a list of whole numbers >= 0, or 'log:N' (N >= 2)")


def save_checkpoint(ctx, step: int, params, model_state) -> None:
  """Saves `params` and the model's state as the run's checkpoint of
  `step`."""
  path = checkpoints.path_for("checkpoints", step)
  checkpoints.save(ctx.run_dir.own(str(path)), params, step=step,
                   problem=ctx.problem.name, model_state=model_state)


@MEASUREMENTS.register
@dataclasses.dataclass
class Training(Measurement):
  """The loss curve of the run's optimizer: one row per logged step, the
  loss and error on fixed training and test examples every `eval_every`
  steps, wall time with compilation apart."""

  name = "training"
  tables = ("training",)
  tuned = True

  num_steps: int = setting(200, Whole(1), "training steps (at most, with "
                           "budget_s)")
  budget_s: float | None = setting(
      None, Number(0, low_in=False, null=True), "stop once training has run "
      "this many seconds, compilation and evaluation excluded (null: run "
      "num_steps): the budget every method of a comparison gets")
  target_error: float | None = setting(
      None, Number(null=True), "the training error the report gives each "
      "method's steps and seconds to reach (null: none)")
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
                        on_step=functools.partial(save_checkpoint, ctx),
                        mesh=ctx.mesh)
    return dict(training=rows)

  # --- the report --------------------------------------------------------

  def summaries(self, report):
    if "training" not in report.tables:
      return []
    rows = report.once("curves", curves)
    out = []
    tuned = report.once("tuning", tuning_table)
    if tuned is not None:
      out.append(("tuning", "Tuning: each setting's score over seeds (mean, "
                  "95 % bootstrap interval); edge: a best value at the edge "
                  "of its grid", tuned))
    out.append(("training", "Training: each quantity over seeds (mean with "
                "its 95 % bootstrap interval; median with quartiles)",
                summary(rows)))
    compared = report.once("equal_time", equal_time)
    if compared is not None:
      out.append(("comparison", "At equal time and to the target: each "
                  "method (its best setting, where tuned), over seeds (mean, "
                  "95 % bootstrap interval)", compared))
    return out

  def figures(self, report, out):
    if "training" not in report.tables:
      return []
    train = report.once("curves", curves)
    tuned = report.once("tuning", tuning_table)
    if tuned is None:
      return plots.training(train, out, report.colour)
    return (plots.training(plots.tuned_curves(train, tuned), out,
                           report.colour)
            + plots.training(train, out, report.colour, name="training_all")
            + plots.sensitivity(tuned, out, report.colour))

  def notes(self, report):
    if "training" not in report.tables:
      return []
    notes = []
    tuned = report.once("tuning", tuning_table)
    if tuned is not None:
      best = tuned[tuned.best]
      notes.append(
          f"Tuned by {best.metric.iloc[0]} (mean over seeds); the main "
          "training figure shows each optimizer's best setting: " + "; ".join(
              f"{r.problem} {r.method}: {r.setting or 'its only setting'}"
              for r in best.itertuples()))
      notes += [f"{r.problem} {r.method}: its best setting sits at the edge "
                f"of the grid ({r.edge}), so a better one may lie beyond it; "
                "widen the grid." for r in best.itertuples() if r.edge]
      notes += [f"{r.problem} {r.method}: {r.vs_runner_up}"
                for r in best.itertuples() if r.vs_runner_up]
    notes += report.once("claims", claims)
    return notes


def curves(report) -> pd.DataFrame:
  """The training rows, one copy of each curve: spectra runs that measured
  different curvatures along one optimizer's trajectory record it alike."""
  rows = report.tables["training"]
  same = ["problem", "label", *(k for k in provenance.SEED_KEYS
                                if k in rows)]
  first = rows.groupby(same, dropna=False).run_id.transform("first")
  return rows[rows.run_id == first]


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
  """Each tuned setting's score over seeds (mean and interval), the best
  per problem and method, whether its best values sit at a grid's edge, and
  how it compares with the runner-up; None where the sweep tuned nothing."""
  tuned = _tuned_runs(report.done)
  if tuned.empty or "training" not in report.tables:
    return None
  metrics = tuned["config:tuning.metric"].unique()
  if len(metrics) > 1:
    raise ValueError(f"The tuned runs under {report.root} use different "
                     f"tuning.metric values {sorted(metrics)}; report them "
                     "apart.")
  scores = tuning.run_scores(report.once("curves", curves), metrics[0])
  table = tuning.select(tuned, scores, ["problem", "method"])
  per_setting = tuned[["run_id", "problem", "method", "setting"]].merge(
      scores.rename("score"), left_on="run_id", right_index=True)
  samples = {key: group.score.to_numpy() for key, group in
             per_setting.groupby(["problem", "method", "setting"])}
  bounds = [comparison.interval(samples[key])[1:] for key in zip(
      table.problem, table.method, table.setting)]
  table.insert(table.columns.get_loc("score") + 1, "ci_low",
               [b[0] for b in bounds])
  table.insert(table.columns.get_loc("ci_low") + 1, "ci_high",
               [b[1] for b in bounds])
  table["edge"], table["vs_runner_up"] = "", ""
  for (problem, method), group in table.groupby(["problem", "method"]):
    best = group[group.best].iloc[0]
    table.loc[best.name, "edge"] = ", ".join(
        comparison.grid_edges(group.setting, best.setting))
    if len(group) > 1:
      runner = group[~group.best].iloc[0]
      table.loc[best.name, "vs_runner_up"] = comparison.verdict(
          best.setting or method, runner.setting,
          comparison.difference(samples[problem, method, best.setting],
                                samples[problem, method, runner.setting]),
          metrics[0])
  return table.assign(metric=metrics[0])


def _chosen(report) -> pd.DataFrame:
  """The training rows of each method's chosen setting (all where the
  sweep tuned nothing)."""
  rows = report.once("curves", curves)
  tuned = report.once("tuning", tuning_table)
  return rows if tuned is None else plots.tuned_curves(rows, tuned)


def _compared(report) -> dict:
  """Per problem with two methods or a target: `(equal time, target,
  {label: its seeds' comparison.outcomes})` for each method's chosen
  setting; the equal time is the shortest of the methods' median final
  times (the budget, where they had one)."""
  rows = _chosen(report)
  targets = report.done.get("config:measure.training.target_error")
  out = {}
  for problem, p in rows.groupby("problem"):
    runs = report.done[report.done.problem == problem]
    target = (targets[runs.index].dropna().unique() if targets is not None
              else [])
    if len(target) > 1:
      raise ValueError(f"The {problem} runs under {report.root} state "
                       f"different target errors {sorted(target)}; report "
                       "them apart.")
    target = float(target[0]) if len(target) else None
    if p.label.nunique() < 2 and target is None:
      continue
    ends = p.groupby(["label", "run_id"]).wall_s.max().groupby(
        "label").median()
    equal = float(ends.min())
    out[problem] = (equal, target, {
        label: comparison.outcomes(runs_of, target=target, at_time=equal)
        for label, runs_of in p.groupby("label")})
  return out


def equal_time(report) -> pd.DataFrame | None:
  """Per problem and method (its chosen setting): the error at equal time
  and the steps and seconds to the target error, over seeds (`_compared`);
  None where no problem has two methods or a target."""
  optimizers = report.done.set_index("run_id").get("config:optimizer.name")
  out = []
  for problem, (equal, target, seeds) in report.once(
      "compared", _compared).items():
    for label, o in seeds.items():
      row = dict(problem=problem, label=label, optimizer=None if optimizers
                 is None else optimizers.get(o.run_id.iloc[0]),
                 n=len(o), equal_time_s=equal)
      row.update(_mean_and_interval("error_at_equal_time", o.value_at_time))
      if target is not None:
        reached = o.dropna(subset=["seconds_to_target"])
        row.update(target_error=target,
                   reached=f"{len(reached)} of {len(o)}")
        row.update(_mean_and_interval("seconds_to_target",
                                      reached.seconds_to_target))
        row.update(_mean_and_interval("steps_to_target",
                                      reached.steps_to_target))
      out.append(row)
  return pd.DataFrame(out) if out else None


def _mean_and_interval(name: str, values) -> dict:
  return dict(zip((f"{name}_mean", f"{name}_ci_low", f"{name}_ci_high"),
                  comparison.interval(values)))


def claims(report) -> list[str]:
  """Whether the optimizer a sweep's `tuning.claim` names reached a lower
  training error at equal time than each other method, per problem."""
  column = report.done.get("config:tuning.claim")
  named = column.dropna().unique() if column is not None else []
  compared = report.once("equal_time", equal_time)
  if not len(named) or compared is None:
    return []
  notes = []
  for problem, (equal, _, seeds) in report.once("compared",
                                                _compared).items():
    p = compared[compared.problem == problem]
    errors = {label: o.value_at_time for label, o in seeds.items()}
    for claimed in named:
      own = p.label[p.optimizer == claimed]
      if own.empty:
        continue
      own = own.iloc[0]
      diffs = {other: comparison.difference(errors[own], errors[other])
               for other in errors if other != own}
      orders = {comparison.ordering(d) for d in diffs.values()}
      outcome = ("holds" if orders == {"lower"} else "does not hold"
                 if "higher" in orders else "is not settled (an interval "
                 "holds 0, or one seed gives none)")
      notes.append(f"Claim ({problem}, {equal:.3g} s each): {claimed} "
                   "reaches a lower training error than every other method "
                   f"in the same time. On these runs it {outcome}: "
                   + "; ".join(comparison.verdict(
                       own, other, d, "training error at equal time")
                               for other, d in diffs.items()) + ".")
  return notes


QUANTITIES = (("final_train_error", "train_error", "last"),
              ("final_test_error", "test_error", "last"),
              ("best_train_error", "train_error", "min"),
              ("final_train_loss", "train_loss", "last"),
              ("final_test_loss", "test_loss", "last"))


def summary(rows: pd.DataFrame) -> pd.DataFrame:
  """Per problem, label and quantity (final and best errors and losses,
  steps, seconds, compile seconds): the mean over seeds with its 95 %
  bootstrap interval, the median with its quartiles, `n` seeds and how
  many diverged."""
  out = []
  for (problem, label), group in rows.groupby(["problem", "label"],
                                              dropna=False):
    per_run = []
    for _, run in group.sort_values("step").groupby("run_id"):
      values = dict(steps=run.step.iloc[-1], seconds=run.wall_s.iloc[-1],
                    compile_seconds=run.compile_s.iloc[-1]
                    if "compile_s" in run else np.nan)
      for name, column, how in QUANTITIES:
        seen = run[column].dropna() if column in run else pd.Series([])
        values[name] = (np.nan if seen.empty else seen.iloc[-1]
                        if how == "last" else seen.min())
      values["diverged"] = bool(run.diverged.any()) if "diverged" in run \
          else False
      per_run.append(values)
    per_run = pd.DataFrame(per_run)
    for quantity in [q for q, _, _ in QUANTITIES] + [
        "steps", "seconds", "compile_seconds"]:
      values = per_run[quantity].to_numpy(np.float64)
      if np.isnan(values).all():
        continue
      mean, low, high = comparison.interval(values)
      q25, median, q75 = np.nanquantile(values, [0.25, 0.5, 0.75])
      out.append(dict(problem=problem, label=label, quantity=quantity,
                      mean=mean, ci_low=low, ci_high=high, median=median,
                      q25=q25, q75=q75, n=len(per_run),
                      diverged=int(per_run.diverged.sum())))
  return pd.DataFrame(out)


__all__ = ["Training", "claims", "curves", "equal_time", "save_checkpoint",
           "summary", "tuning_table"]
