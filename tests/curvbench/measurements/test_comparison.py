"""Comparisons over seeds: intervals, grid edges, equal time on the time
grid, targets and claims, checked on synthetic sweeps whose true ordering
is known; and the time grid itself on a real training run."""

import numpy as np
import pandas as pd
import pytest

from curvbench import config, report, runs, sweep
from curvbench.core import records
from curvbench.measurements import training
from tests.conftest import TINY

SEEDS = range(4)
# method -> {learning rate: final training error}; every seed lands within
# +-0.01 of it. K-FAC steps take 10x as long as the others'.
FINAL = {
  "kfac[kfac/ggn]": {0.1: 0.10},
  "adam": {0.001: 0.70, 0.01: 0.50, 0.1: 0.30},
  "sgd": {0.01: 0.60, 0.1: 0.40, 1.0: 0.45},
}
GRID = {"adam": [0.001, 0.01, 0.1], "sgd": [0.01, 0.1, 1.0]}
STEP_S = {"kfac[kfac/ggn]": 0.1, "adam": 0.01, "sgd": 0.01}
STEPS = 100


def _point(run, step, step_s, error, **grid):
  """One row of `run`'s curve: its error at `step` (`grid` marks a point of
  the time grid)."""
  return dict(
    run_id=run["run_id"],
    problem="mlp",
    method=run["method"],
    seed=run["seed"],
    step=step,
    wall_s=step * step_s,
    train_error=error(step),
    **grid,
    diverged=False,
  )


def _sweep(target=0.35, claim="kfac", budget=None, points=10):
  """A tuned training sweep's runs and curves: each run's error falls
  linearly from 1 to its final value over 100 steps. With a `budget` of
  seconds, a run stops when it is spent and is also evaluated on a grid of
  `points` seconds (the parameters it held then), as `training.run`
  records it."""
  runs, curves = [], []
  for method, finals in FINAL.items():
    for lr, final in finals.items():
      for seed in SEEDS:
        run_id = f"{method}-{lr}-{seed}"
        end = final + 0.01 * (seed - 1.5) / 1.5
        error = lambda step, end=end: 1 + (end - 1) * step / STEPS
        runs.append(
          {
            "run_id": run_id,
            "status": "complete",
            "problem": "mlp",
            "measure": "training",
            "method": method,
            "config:optimizer.name": method.split("[")[0],
            "config:optimizer.learning_rate": lr,
            "config:seed": seed,
            "config:tuning.metric": "final_train_error",
            "config:tuning.claim": claim,
            "config:measure.training.target_error": target,
            "config:measure.training.budget_s": budget,
            "config:measure.training.time_grid": points,
            **{
              f"config:tuning.grid.{m}.learning_rate": str(g)
              for m, g in GRID.items()
            },
          }
        )
        step_s = STEP_S[method]
        last = (
          STEPS if budget is None else min(STEPS, int(round(budget / step_s)))
        )
        run = dict(run_id=run_id, method=method, seed=seed)
        for step in range(0, last + 1, 10):
          curves.append(_point(run, step, step_s, error))
        for k in range(1, points + 1) if budget is not None else ():
          t = budget * k / points
          held = min(int(np.floor(t / step_s + 1e-9)), last)
          curves.append(_point(run, held, step_s, error, time_point_s=t))
  runs = pd.DataFrame(runs)
  done = sweep.settings(runs)
  tables = {"training": sweep.with_labels(pd.DataFrame(curves), done)}
  return report.Report(None, runs, done, tables, {})


def test_tuning_flags_a_best_setting_at_its_grid_edge_and_its_runner_up():
  table = training.tuning_table(_sweep()).set_index(["method", "setting"])
  best = table[table.best]
  assert set(best.index) == {
    ("adam", "learning_rate=0.1"),
    ("sgd", "learning_rate=0.1"),
  }  # kfac: no grid
  assert (
    "learning_rate=0.1 (the highest of 3 tried)"
    in best.edge["adam", "learning_rate=0.1"]
  )
  assert best.edge["sgd", "learning_rate=0.1"] == ""  # inside its grid
  assert (
    "lower than learning_rate=1"
    in best.vs_runner_up["sgd", "learning_rate=0.1"]
  )
  adam = best.loc["adam", "learning_rate=0.1"]
  assert adam.ci_low <= adam.score <= adam.ci_high
  assert adam.score == pytest.approx(0.30)


def test_equal_time_reads_the_time_grid_of_the_chosen_settings():
  """Every run had 1 s: K-FAC (0.1 s a step) holds step 10 at 1 s (error
  0.91), the others step 100; the claim that K-FAC is ahead at equal time
  does not hold, and every figure comes from the grid point at 1 s."""
  rep = _sweep(budget=1.0)
  table = training.equal_time(rep).set_index("label")
  assert set(table.index) == {
    "kfac[kfac/ggn]",
    "adam (learning_rate=0.1)",
    "sgd (learning_rate=0.1)",
  }
  assert set(table.equal_time_s) == {1.0}
  at = table.error_at_equal_time_mean
  assert at["kfac[kfac/ggn]"] == pytest.approx(0.91, abs=1e-3)
  assert at["adam (learning_rate=0.1)"] == pytest.approx(0.30, abs=1e-3)
  assert (table.error_at_equal_time_ci_low <= at).all()
  [claim] = training.claims(rep)
  assert claim.startswith(
    "Claim (mlp, 1 s each, tuned by final_train_error: adam best of 3 "
    "settings (best at the grid's edge: learning_rate=0.1"
  )
  assert "On these runs it does not hold" in claim
  assert "kfac[kfac/ggn] higher than adam (learning_rate=0.1)" in claim
  [finding] = training.findings(rep)
  assert finding.startswith(
    "mlp (tuned by final_train_error: adam best of 3 settings"
  )
  assert (
    "adam (learning_rate=0.1) reaches the lowest training error at 1 s "
    "(the time grid)" in finding
  )


def test_a_claim_that_holds_is_said_to_hold():
  fast = dict(STEP_S, **{"kfac[kfac/ggn]": 0.01})  # as fast per step
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(f"{__name__}.STEP_S", fast)
    [claim] = training.claims(_sweep(claim="kfac", budget=1.0))
  assert "On these runs it holds" in claim
  assert training.claims(_sweep(claim=None, budget=1.0)) == []


def test_step_budgets_compare_targets_but_not_equal_time():
  """Runs of 100 steps each end at their own time: no error at equal time
  is read off them (a note says why), the claim is not judged, and the
  target is: Adam and K-FAC reach 0.35 (K-FAC at step 80, later in
  seconds), SGD's best setting (0.40) never does."""
  rep = _sweep()
  table = training.equal_time(rep).set_index("label")
  assert table.equal_time_s.isna().all()
  assert "error_at_equal_time_mean" not in table
  assert table.reached["sgd (learning_rate=0.1)"] == "0 of 4"
  assert table.reached["kfac[kfac/ggn]"] == "4 of 4"
  assert (
    table.seconds_to_target_mean["kfac[kfac/ggn]"]
    > table.seconds_to_target_mean["adam (learning_rate=0.1)"]
  )
  assert table.steps_to_target_mean["kfac[kfac/ggn]"] == pytest.approx(80)
  [claim] = training.claims(rep)
  assert "Not judged: these runs are budgeted in steps" in claim
  assert any(
    "budgeted in steps, so each method stops at its own time" in note
    for note in training.notes(rep)
  )
  [finding] = training.findings(rep)
  assert "final training error after 100 steps" in finding
  assert training.equal_time(_sweep(target=None)) is None


def test_three_seeds_give_no_verdict():
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(f"{__name__}.SEEDS", range(3))
    [claim] = training.claims(_sweep(budget=1.0))
  assert "cannot be told (too few seeds for an exact interval)" in claim


def test_a_curve_along_a_spectra_run_is_labelled_by_its_optimizer():
  runs_ = pd.DataFrame(
    [
      {
        "run_id": c,
        "status": "complete",
        "problem": "mlp",
        "measure": "spectra",
        "method": c,
        "config:curvature.name": c,
        "config:optimizer.name": "adam",
      }
      for c in ("kfac", "ekfac")
    ]
  )
  done = sweep.settings(runs_)
  rows = pd.DataFrame(
    dict(
      run_id=["kfac", "ekfac"],
      method="adam",
      seed=0,
      step=0,
      wall_s=0.0,
      train_error=1.0,
    )
  )
  labelled = sweep.with_labels(rows, done)
  assert list(labelled.label) == ["adam", "adam"]


@pytest.mark.slow
def test_a_time_budgeted_run_is_evaluated_on_its_time_grid(tmp_path):
  """Each grid point evaluates the parameters the run held at that second:
  those of the last step finished by then."""
  cfg = config.compose(
    *TINY,
    "measure=training",
    "optimizer=adam",
    "measure.training.num_steps=100000",
    "measure.training.budget_s=0.5",
    "measure.training.time_grid=5",
    "measure.training.eval_every=100000",
  )
  assert runs.run(cfg, tmp_path / "run") == "complete"
  rows = records.RunDir(tmp_path / "run").tables()["training"]
  grid = rows[rows.time_point_s.notna()]
  np.testing.assert_allclose(grid.time_point_s, [0, 0.1, 0.2, 0.3, 0.4, 0.5])
  assert (grid.wall_s <= grid.time_point_s + 1e-12).all()
  assert grid.train_error.notna().all()
  steps = rows[rows.time_point_s.isna()].set_index("step")
  for point in grid.itertuples():
    if point.step:  # the step after it finished past the grid point
      assert steps.wall_s[point.step + 1] >= point.time_point_s
  with pytest.raises(config.ConfigError, match="time_grid=5 is ignored"):
    config.compose(*TINY, "measure=training", "measure.training.time_grid=5")


def test_a_label_names_a_swapped_component_not_its_missing_settings():
  """Runs of one method that trained with different optimizers: the label
  says which optimizer (`name=sgd`), not each setting the other lacks, while
  a setting both have and differ in stays."""
  runs = pd.DataFrame(
    [
      {
        "run_id": "a",
        "status": "complete",
        "problem": "mlp",
        "measure": "spectra",
        "method": "kfac/ggn_exact",
        "config:optimizer.name": "sgd",
        "config:optimizer.momentum": 0.9,
        "config:optimizer.nesterov": False,
        "config:optimizer.learning_rate": 0.1,
      },
      {
        "run_id": "b",
        "status": "complete",
        "problem": "mlp",
        "measure": "spectra",
        "method": "kfac/ggn_exact",
        "config:optimizer.name": "kfac",
        "config:optimizer.learning_rate": 0.3,
      },
    ]
  )
  done = sweep.settings(runs).set_index("run_id")
  assert done.setting["a"] == "name=sgd, learning_rate=0.1"
  assert done.setting["b"] == "name=kfac, learning_rate=0.3"
