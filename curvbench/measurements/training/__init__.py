"""Training: the loss and error against steps and seconds, with any
optimizer, to a budget of steps or of seconds (then also on a grid of
seconds); with a tuning grid (`tuning.grid`), each optimizer's best
setting (`curvbench.core.tuning`); and in the report, each method at equal time
(time-budgeted runs) and against a target error, with intervals over
seeds (`comparison`, `curvbench.core.stats`). The loop itself is
`curvbench.core.training`, which the spectra measurement trains with too."""

import dataclasses
import functools
from typing import Any, cast

import numpy as np
import pandas as pd

from curvbench.components import Number, Parsed, Whole, setting
from curvbench.core import checkpoints, records, stats, training, tuning
from curvbench.core.sections import Section, Table, spread, wide
from curvbench.measurements import MEASUREMENTS, Measurement, Outcome
from curvbench.measurements.timing import load
from curvbench.measurements.training import comparison, divergence, figures

STEPS = Parsed(
  lambda v: training.measurement_steps(v, 2**62),
  "a list of whole numbers >= 0, or 'log:N' (N >= 2)",
)


# Lanczos steps per sharpness: on problem=mlp (width 16 and 64) and
# convnet, either loss, at initialisation and at the edge of stability
# (top eigenvalues crowding near 2/η), 20 steps came within 2e-5 of the
# exact top eigenvalue (relative) and 30 within float32 round-off (3e-7).
SHARPNESS_ITERATIONS = 30


def training_headline(rows: pd.DataFrame | None) -> str:
  """The last evaluated step's training loss and errors, for a run's end
  line (a diverged run's last finite ones)."""
  if rows is None or "train_loss" not in rows:
    return "no training rows"
  evaluated = rows[np.isfinite(rows.train_loss.astype(float))]
  if evaluated.empty:
    return "no finite training loss"
  last = evaluated.loc[evaluated.step.idxmax()]
  diverged = "diverged" in rows and rows.diverged.astype(bool).any()
  final = "last finite" if diverged else "final"
  out = f"{final} training loss {last.train_loss:.4g} (step {int(last.step)})"
  for key, what in (("train_error", "training"), ("test_error", "test")):
    value = last.get(key)
    if value is not None and np.isfinite(value):
      out += f", {what} error {100 * value:.3g} %"
  return out


def save_checkpoint(ctx, step: int, params, model_state) -> None:
  """Saves `params` and the model's state as the run's checkpoint of
  `step`."""
  path = checkpoints.path_for("checkpoints", step)
  checkpoints.save(
    ctx.run_dir.own(str(path)),
    params,
    step=step,
    problem=ctx.problem.name,
    model_state=model_state,
  )


@MEASUREMENTS.register
@dataclasses.dataclass
class Training(Measurement):
  """The loss curve of the run's optimizer: one row per logged step, the
  loss and error on fixed training and test examples every `eval_every`
  steps and, with a time budget, at `time_grid` evenly spaced seconds;
  wall time with compilation apart."""

  name = "training"
  tables = ("training",)
  tuned = True

  num_steps: int = setting(
    200, Whole(1), "training steps (at most, with budget_s)"
  )
  budget_s: float | None = setting(
    None,
    Number(0, low_in=False, null=True),
    "stop once training has run "
    "this many seconds, compilation and evaluation excluded (null: run "
    "num_steps): the budget every method of a comparison gets",
  )
  target_error: float | None = setting(
    None,
    Number(null=True),
    "the training error the report gives each "
    "method's steps and seconds to reach (null: none)",
  )
  time_grid: int = setting(
    20,
    Whole(0),
    "with budget_s: evaluations at this many evenly spaced "
    "seconds of the budget, of the parameters held then (what equal-time "
    "comparisons read; 0: none)",
  )
  batch_growth_steps: int | None = setting(
    None,
    Whole(2, null=True),
    "grow the batch exponentially from "
    "problem.batch_size to the whole training set, reached at this step "
    "(Martens & Grosse 2015, sec. 13; null: a fixed batch)",
  )
  batch_ladder: float = setting(
    2.0,
    Number(1, low_in=False),
    "with batch_growth_steps: each batch "
    "size is rounded down to problem.batch_size times a power of this "
    "(or the whole set), so that few step programs are compiled",
  )
  average_decay: float | None = setting(
    None,
    Number(0, 1, null=True),
    "also evaluate the "
    "running average of the iterates, ξ times itself plus 1 - ξ times "
    "each new one (kept on the clock), and report the lower error of the "
    "two (Martens & Grosse 2015 use 0.99; null: the iterates only)",
  )
  log_every: int = setting(1, Whole(1), "steps between rows")
  eval_every: int = setting(
    20, Whole(1), "steps between evaluations of loss and error"
  )
  train_eval_size: int | None = setting(
    1000,
    Whole(1, null=True),
    "the first training examples evaluated "
    "(null: all; the default takes all where there are fewer)",
  )
  eval_size: int | None = setting(
    None, Whole(1, null=True), "the first test examples (null: all)"
  )
  checkpoint_steps: Any = setting(
    [], STEPS, "save the parameters after these steps (or log:N)"
  )
  sharpness_every: int | None = setting(
    None,
    Whole(1, null=True),
    "every this many steps, and at the first and the last, the sharpness "
    "(Cohen et al. 2021): the top eigenvalue of the training loss's "
    "Hessian on the train_eval_size examples, by Lanczos, off the clock "
    "(column sharpness; null: not measured)",
  )
  sharpness_iterations: int = setting(
    SHARPNESS_ITERATIONS,
    Whole(1),
    "with sharpness_every: Lanczos steps (Hessian-vector products) per "
    "sharpness (the default reached float32 round-off on problem=mlp and "
    "convnet, at the edge of stability too)",
  )

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
      (self.train_eval_size, self.eval_size),
      ("training", "test"),
      sizes or (None, None),
    ):
      given = asked != getattr(defaults, key)  # the default takes what there is
      if given and asked is not None and have is not None and asked > have:
        yield (
          f"{prefix}.{key}={asked} is more than the {have} {split} "
          f"examples of dataset {run.problem.data.name!r}: lower it "
          "(null: all of them)."
        )

  def ignored(self):
    out = {}
    if self.sharpness_every is None:
      out["sharpness_iterations"] = (
        "without measure.training.sharpness_every no sharpness is measured"
      )
    if self.budget_s is None:
      out["time_grid"] = (
        "without measure.training.budget_s there are no "
        "seconds to lay a grid over"
      )
    if self.batch_growth_steps is None:
      out["batch_ladder"] = (
        "without measure.training.batch_growth_steps the batch does not grow"
      )
    return out

  def measure(self, ctx):
    steps = training.measurement_steps(self.checkpoint_steps, self.num_steps)
    optimizer = ctx.run.optimizer.make(
      ctx.problem.loss_fn, ctx.curvature, ctx.mesh
    )
    trace = getattr(optimizer, "trace", None)  # K-FAC's step statistics
    if trace is not None:
      optimizer.start_trace()
    with load.Monitor(min_seconds=0.0) as monitor:
      rows = training.run(
        ctx.problem,
        optimizer,
        ctx.params,
        self,
        ctx.rng,
        ctx.run.data_seed,
        progress=ctx.run.progress,
        at_steps=steps,
        on_step=functools.partial(save_checkpoint, ctx),
        mesh=ctx.mesh,
      )
    measured = cast(load.Load, monitor.load)  # set on leaving the block
    for row in rows:  # the load its seconds were read under
      row["others_cpu_share"] = measured.others_share
    if trace is not None:
      rows = divergence.traced_rows(rows, trace())
    end = rows[-1]
    if end["diverged"]:
      knobs = ctx.run.optimizer.divergence_knobs()
      return Outcome(
        dict(training=rows),
        "diverged",
        step=end["step"],
        reason=divergence.diagnose(rows, knobs),
      )
    return Outcome(dict(training=rows))

  def headline(self, tables):
    return training_headline(tables.get("training"))

  # --- the report --------------------------------------------------------

  def section(self, report, out):
    if "training" not in report.tables:
      return None
    found = Section(
      "Training",
      "Which optimizer reaches the lowest training error, "
      "per step, per second and, where every method had the same seconds, "
      "at equal time?",
    )
    rows = report.once("curves", curves)
    tuned = report.once("tuning", tuning_table)
    compared = report.once("equal_time", equal_time)
    found.findings += report.once("claims", claims)
    found.findings += findings(report)
    if tuned is not None:
      found.tables.append(
        Table(
          "tuning",
          "Tuning: each setting's score over seeds (mean [95 % t "
          "interval]); edge: a best value at the edge of its grid",
          tuned,
          view=tuned.assign(
            score=[
              spread(m, lo, hi)
              for m, lo, hi in zip(tuned.score, tuned.ci_low, tuned.ci_high)
            ]
          ).drop(columns=["ci_low", "ci_high"]),
          detail=True,
        )
      )
    quantities = summary(rows)
    found.tables.append(
      Table(
        "training",
        "Training: each quantity over seeds, mean [95 % t "
        "interval] (the CSV has the median and quartiles too)",
        quantities,
        view=wide(
          quantities,
          ["problem", "label"],
          "quantity",
          "mean",
          "ci_low",
          "ci_high",
        ),
      )
    )
    if compared is not None:
      found.tables.append(
        Table(
          "comparison",
          "At equal time (on the time grid) and to the "
          "target: each method (its best setting, where tuned), over seeds "
          "(mean [95 % t interval])",
          compared,
          view=comparison_view(compared),
        )
      )
    found.notes += notes(report)
    found.figures += self.figures(report, rows, tuned, out)
    return found

  @staticmethod
  def figures(report, train, tuned, out):
    """The training figures, written under `out`; their paths: the
    curves of `train`, or where the sweep tuned (`tuned`) those of each
    method's chosen settings, then of every setting, and each method's
    tuning score against each hyperparameter."""
    if tuned is None:
      return figures.training(train, out, report.colour)
    return (
      figures.training(figures.tuned_curves(train, tuned), out, report.colour)
      + figures.training(train, out, report.colour, name="training_all")
      + figures.sensitivity(tuned, out, report.colour)
    )


def notes(report) -> list[str]:
  """What the tuning chose, and what the equal-time comparison cannot
  say."""
  out = []
  tuned = report.once("tuning", tuning_table)
  if tuned is not None:
    best = tuned[tuned.best]
    out.append(
      f"Tuned by {best.metric.iloc[0]} (mean over seeds); the main "
      "training figure shows each optimizer's best setting: "
      + "; ".join(
        f"{r.problem} {r.method}: {r.setting or 'its only setting'}"
        for r in best.itertuples()
      )
    )
    out += [
      f"{r.problem} {r.method}: its best setting sits at the edge "
      f"of the grid ({r.edge}), so a better one may lie beyond it; "
      "widen the grid."
      for r in best.itertuples()
      if r.edge
    ]
    out += [
      f"{r.problem} {r.method}: {r.vs_runner_up}"
      for r in best.itertuples()
      if r.vs_runner_up
    ]
  out += diverged_notes(report.done)
  for problem, (budget, _, _) in report.once("compared", _compared).items():
    if budget is None:
      out.append(
        f"{problem}: the runs are budgeted in steps, so each method "
        "stops at its own time and no equal-time comparison is "
        "made; give every method the same seconds "
        "(measure.training.budget_s) for one."
      )
  return out


def diverged_notes(done: pd.DataFrame) -> list[str]:
  """Each diverged training run with its reason: what its records show
  moved before the loss stopped being finite, and what to change
  (`divergence.diagnose`, written when the run ended)."""
  if "status" not in done or "reason" not in done:
    return []
  runs = done[(done.status == "diverged") & (done.measure == "training")]
  out = []
  for _, r in runs.iterrows():
    who = r.get("label") if pd.notna(r.get("label")) else r.get("method")
    seed = r.get("config:seed")
    seed = f" seed {seed}" if pd.notna(seed) else ""
    out.append(f"{r.problem} {who}{seed} diverged: {r.reason}")
  return out


def curves(report) -> pd.DataFrame:
  """The training rows, one copy of each curve: spectra runs that measured
  different curvatures along one optimizer's trajectory record it alike."""
  rows = report.tables["training"]
  same = ["problem", "label", *(k for k in records.SEED_KEYS if k in rows)]
  first = rows.groupby(same, dropna=False).run_id.transform("first")
  return rows[rows.run_id == first]


def _tuned_runs(done: pd.DataFrame) -> pd.DataFrame:
  """The training runs of optimizers their sweep tuned over a grid."""
  grid_cols = [c for c in done.columns if c.startswith("config:tuning.grid.")]
  if not grid_cols or "config:optimizer.name" not in done:
    return done.iloc[:0]
  tuned = done.apply(
    lambda r: any(
      c.startswith(f"config:tuning.grid.{r['config:optimizer.name']}.")
      and pd.notna(r[c])
      for c in grid_cols
    ),
    axis=1,
  )
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
    raise ValueError(
      f"The tuned runs under {report.root} use different "
      f"tuning.metric values {sorted(metrics)}; report them "
      "apart."
    )
  scores = tuning.run_scores(report.once("curves", curves), metrics[0])
  table = tuning.select(tuned, scores, ["problem", "method"])
  per_setting = tuned[["run_id", "problem", "method", "setting"]].merge(
    scores.rename("score"), left_on="run_id", right_index=True
  )
  samples = {
    key: group.score.to_numpy()
    for key, group in per_setting.groupby(["problem", "method", "setting"])
  }
  bounds = [
    stats.interval(samples[key])[1:]
    for key in zip(table.problem, table.method, table.setting)
  ]
  table.insert(
    table.columns.get_loc("score") + 1, "ci_low", [b[0] for b in bounds]
  )
  table.insert(
    table.columns.get_loc("ci_low") + 1, "ci_high", [b[1] for b in bounds]
  )
  table["edge"], table["vs_runner_up"] = "", ""
  for (problem, method), group in table.groupby(["problem", "method"]):
    best = group[group.best].iloc[0]
    table.loc[best.name, "edge"] = ", ".join(
      comparison.grid_edges(group.setting, best.setting)
    )
    if len(group) > 1:
      runner = group[~group.best].iloc[0]
      table.loc[best.name, "vs_runner_up"] = stats.verdict(
        best.setting or method,
        runner.setting,
        stats.difference(
          samples[problem, method, best.setting],
          samples[problem, method, runner.setting],
        ),
        metrics[0],
      )
  return table.assign(metric=metrics[0])


def _chosen(report) -> pd.DataFrame:
  """The training rows of each method's chosen setting (all where the
  sweep tuned nothing)."""
  rows = report.once("curves", curves)
  tuned = report.once("tuning", tuning_table)
  return rows if tuned is None else figures.tuned_curves(rows, tuned)


def _compared(report) -> dict:
  """Per problem with two methods or a target: `(budget, target, {label:
  its seeds' comparison.outcomes})` for each method's chosen setting. The
  budget is the seconds every run had (`measure.training.budget_s`),
  read on the time grid; None where the runs are budgeted in steps."""
  rows = _chosen(report)
  done = report.done
  out = {}
  for problem, p in rows.groupby("problem"):
    runs = done[done.run_id.isin(p.run_id.unique())]
    target = _one(
      runs,
      "config:measure.training.target_error",
      problem,
      report,
      "target errors",
    )
    budget = _one(
      runs, "config:measure.training.budget_s", problem, report, "time budgets"
    )
    grid = runs.get("config:measure.training.time_grid")
    if grid is not None and (grid.fillna(0) == 0).any():
      budget = None  # no time grid to read equal time on
    if p.label.nunique() < 2 and target is None:
      continue
    out[problem] = (
      budget,
      target,
      {
        label: comparison.outcomes(runs_of, target=target, at_time=budget)
        for label, runs_of in p.groupby("label")
      },
    )
  return out


def _one(
  runs: pd.DataFrame, column: str, problem: str, report, what: str
) -> float | None:
  """The one value of `column` over `runs` (None where unset)."""
  values = runs[column].dropna().unique() if column in runs else []
  if len(values) > 1:
    raise ValueError(
      f"The {problem} runs under {report.root} state "
      f"different {what} {sorted(values)}; report them "
      "apart."
    )
  return float(values[0]) if len(values) else None


def equal_time(report) -> pd.DataFrame | None:
  """Per problem and method (its chosen setting): the error at equal time
  (time-budgeted runs, on the time grid) and the steps and seconds to the
  target error, over seeds (`_compared`); None where no problem has two
  methods or a target."""
  optimizers = report.done.set_index("run_id").get("config:optimizer.name")
  out = []
  for problem, (budget, target, seeds) in report.once(
    "compared", _compared
  ).items():
    for label, o in seeds.items():
      row = dict(
        problem=problem,
        label=label,
        optimizer=None
        if optimizers is None
        else optimizers.get(o.run_id.iloc[0]),
        n=len(o),
        equal_time_s=budget,
      )
      if budget is not None:
        row.update(_mean_and_interval("error_at_equal_time", o.value_at_time))
      if target is not None:
        reached = o.dropna(subset=["seconds_to_target"])
        row.update(target_error=target, reached=f"{len(reached)} of {len(o)}")
        row.update(
          _mean_and_interval("seconds_to_target", reached.seconds_to_target)
        )
        row.update(
          _mean_and_interval("steps_to_target", reached.steps_to_target)
        )
      out.append(row)
  if not out or all(
    r["equal_time_s"] is None and "target_error" not in r for r in out
  ):
    return None
  return pd.DataFrame(out)


def comparison_view(compared: pd.DataFrame) -> pd.DataFrame:
  """The comparison as the page shows it: each quantity's mean [interval]
  in one cell."""
  view = compared[
    [
      c
      for c in (
        "problem",
        "label",
        "n",
        "equal_time_s",
        "target_error",
        "reached",
      )
      if c in compared
    ]
  ]
  for name in ("error_at_equal_time", "seconds_to_target", "steps_to_target"):
    if f"{name}_mean" in compared:
      view = view.assign(
        **{
          name: [
            spread(m, lo, hi)
            for m, lo, hi in zip(
              compared[f"{name}_mean"],
              compared[f"{name}_ci_low"],
              compared[f"{name}_ci_high"],
            )
          ]
        }
      )
  return view


def _mean_and_interval(name: str, values) -> dict:
  return dict(
    zip(
      (f"{name}_mean", f"{name}_ci_low", f"{name}_ci_high"),
      stats.interval(values),
    )
  )


def claims(report) -> list[str]:
  """Whether the optimizer a sweep's `tuning.claim` names reached a lower
  training error at equal time than each other method, per problem: on
  the time grid, at the budget every method had."""
  column = report.done.get("config:tuning.claim")
  named = column.dropna().unique() if column is not None else []
  compared = report.once("equal_time", equal_time)
  if not len(named) or compared is None:
    return []
  notes = []
  for problem, (budget, _, seeds) in report.once("compared", _compared).items():
    p = compared[compared.problem == problem]
    for claimed in named:
      own = p.label[p.optimizer == claimed]
      if own.empty:
        continue
      own = own.iloc[0]
      if budget is None:
        notes.append(
          f"Claim ({problem}): {claimed} reaches a lower training "
          "error than every other method in the same time. Not "
          "judged: these runs are budgeted in steps, not seconds."
        )
        continue
      errors = {label: o.value_at_time for label, o in seeds.items()}
      diffs = {
        other: stats.difference(errors[own], errors[other])
        for other in errors
        if other != own
      }
      orders = {stats.ordering(d) for d in diffs.values()}
      outcome = (
        "holds"
        if orders == {"lower"}
        else "does not hold"
        if "higher" in orders
        else "is not settled (an interval holds 0)"
        if "tied" in orders
        else "cannot be told (too few seeds for an exact interval)"
      )
      notes.append(
        f"Claim ({problem}, {budget:.3g} s each, "
        f"{tuning_words(report, problem)}): {claimed} "
        "reaches a lower training error than every other method "
        f"in the same time. On these runs it {outcome}: "
        + "; ".join(
          stats.verdict(own, other, d, "training error at equal time")
          for other, d in diffs.items()
        )
        + "."
      )
  return notes


def tuning_words(report, problem: str) -> str:
  """Whether `problem`'s methods were tuned, and over how many settings
  of which keys each, in words."""
  tuned = report.once("tuning", tuning_table)
  mine = None if tuned is None else tuned[tuned.problem == problem]
  if mine is None or mine.empty:
    return "untuned: each method at one setting"
  return (
    "tuned by "
    + mine.metric.iloc[0]
    + ": "
    + ", ".join(
      f"{method} best of {len(group)} settings"
      + (
        f" (best at the grid's edge: {edge})"
        if (edge := group[group.best].edge.iloc[0])
        else ""
      )
      for method, group in mine.groupby("method")
    )
  )


def findings(report) -> list[str]:
  """Per problem: the method with the lowest training error at the end
  (at equal time on the time grid, where the runs had a time budget),
  with the interval of its difference to the runner-up."""
  out = []
  per_problem = report.once("compared", _compared)
  rows = _chosen(report)
  for problem, p in rows.groupby("problem"):
    budget = per_problem.get(problem, (None,))[0]
    if budget is not None:
      values = {
        label: o.value_at_time for label, o in per_problem[problem][2].items()
      }
      what = f"training error at {budget:.3g} s (the time grid)"
    else:
      values = {
        label: o.final
        for label, o in (
          (label, comparison.outcomes(r)) for label, r in p.groupby("label")
        )
      }
      ends = p.groupby("run_id").step.max()
      what = (
        f"final training error after {int(ends.median())} steps"
        if ends.nunique() == 1
        else "final training error"
      )
    finite = {k: np.asarray(v, float) for k, v in values.items()}
    ranked = sorted(
      finite,
      key=lambda k: np.nanmean(
        np.where(np.isfinite(finite[k]), finite[k], np.inf)
      ),
    )
    best = ranked[0]
    mean = spread(*stats.interval(finite[best]))
    line = (
      f"{problem} ({tuning_words(report, problem)}): {best} reaches the "
      f"lowest {what}, {mean} (mean [95 % t interval] over "
      f"{len(finite[best])} seeds)"
    )
    if len(ranked) > 1:
      runner = ranked[1]
      line += "; " + stats.verdict(
        best, runner, stats.difference(finite[best], finite[runner]), "error"
      )
    out.append(line + ".")
  return out


QUANTITIES = (
  ("final_train_error", "train_error", "last"),
  ("final_test_error", "test_error", "last"),
  ("best_train_error", "train_error", "min"),
  ("final_train_loss", "train_loss", "last"),
  ("final_test_loss", "test_loss", "last"),
)


def summary(rows: pd.DataFrame) -> pd.DataFrame:
  """Per problem, label and quantity (final and best errors and losses,
  steps, seconds, compile seconds): the mean over seeds with its 95 %
  t interval, the median with its quartiles, `n` seeds and how
  many diverged."""
  out = []
  for (problem, label), group in rows.groupby(
    ["problem", "label"], dropna=False
  ):
    per_run = []
    for _, run in group.sort_values("step").groupby("run_id"):
      values = dict(
        steps=run.step.iloc[-1],
        seconds=run.wall_s.iloc[-1],
        compile_seconds=run.compile_s.iloc[-1]
        if "compile_s" in run
        else np.nan,
      )
      for name, column, how in QUANTITIES:
        seen = run[column].dropna() if column in run else pd.Series([])
        values[name] = (
          np.nan
          if seen.empty
          else seen.iloc[-1]
          if how == "last"
          else seen.min()
        )
      values["diverged"] = (
        bool(run.diverged.any()) if "diverged" in run else False
      )
      per_run.append(values)
    per_run = pd.DataFrame(per_run)
    for quantity in [q for q, _, _ in QUANTITIES] + [
      "steps",
      "seconds",
      "compile_seconds",
    ]:
      values = per_run[quantity].to_numpy(np.float64)
      if np.isnan(values).all():
        continue
      mean, low, high = stats.interval(values)
      median, q25, q75 = stats.quartiles(values)
      out.append(
        dict(
          problem=problem,
          label=label,
          quantity=quantity,
          mean=mean,
          ci_low=low,
          ci_high=high,
          median=median,
          q25=q25,
          q75=q75,
          n=len(per_run),
          diverged=int(per_run.diverged.sum()),
        )
      )
  return pd.DataFrame(out)


__all__ = [
  "Training",
  "claims",
  "curves",
  "diverged_notes",
  "equal_time",
  "findings",
  "save_checkpoint",
  "summary",
  "tuning_table",
]
