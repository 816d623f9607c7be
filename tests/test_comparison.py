"""Comparisons over seeds: intervals, grid edges, equal time, targets and
claims, checked on synthetic sweeps whose true ordering is known."""

import numpy as np
import pandas as pd
import pytest

from curvbench import comparison, report
from curvbench.measurements import training

SEEDS = range(4)
# method -> {learning rate: final training error}; every seed lands within
# +-0.01 of it. K-FAC steps take 10x as long as the others'.
FINAL = {"kfac[kfac/ggn]": {0.1: 0.10},
         "adam": {0.001: 0.70, 0.01: 0.50, 0.1: 0.30},
         "sgd": {0.01: 0.60, 0.1: 0.40, 1.0: 0.45}}
GRID = {"adam": [0.001, 0.01, 0.1], "sgd": [0.01, 0.1, 1.0]}
STEP_S = {"kfac[kfac/ggn]": 0.1, "adam": 0.01, "sgd": 0.01}


def _sweep(target=0.35, claim="kfac"):
  """A tuned training sweep's runs and curves: each run's error falls
  linearly from 1 to its final value over 100 steps."""
  runs, curves = [], []
  for method, finals in FINAL.items():
    for lr, final in finals.items():
      for seed in SEEDS:
        run_id = f"{method}-{lr}-{seed}"
        end = final + 0.01 * (seed - 1.5) / 1.5
        runs.append({"run_id": run_id, "status": "complete",
                     "problem": "mlp", "measure": "training",
                     "method": method,
                     "config:optimizer.name": method.split("[")[0],
                     "config:optimizer.learning_rate": lr,
                     "config:seed": seed, "config:tuning.metric":
                     "final_train_error", "config:tuning.claim": claim,
                     "config:measure.training.target_error": target,
                     **{f"config:tuning.grid.{m}.learning_rate": str(g)
                        for m, g in GRID.items()}})
        for step in range(0, 101, 10):
          curves.append(dict(run_id=run_id, problem="mlp", method=method,
                             seed=seed,
                             step=step, wall_s=step * STEP_S[method],
                             train_error=1 + (end - 1) * step / 100,
                             diverged=False))
  runs = pd.DataFrame(runs)
  done = report.settings(runs)
  tables = {"training": report.with_labels(pd.DataFrame(curves), done)}
  return report.Report(None, runs, done, tables, {})


def test_interval_covers_the_mean_and_shrinks_with_more_seeds():
  rng = np.random.default_rng(0)
  few, many = rng.normal(1.0, 0.1, 4), rng.normal(1.0, 0.1, 64)
  mean, low, high = comparison.interval(few)
  assert low < mean < high and mean == pytest.approx(few.mean())
  _, low_many, high_many = comparison.interval(many)
  assert high_many - low_many < high - low
  assert comparison.interval([0.1, np.inf]) == (np.inf,) * 3  # diverged
  assert np.isnan(comparison.interval([])).all()
  mean, low, high = comparison.difference([1.0, 1.1, 0.9], [2.0, 2.1, 1.9])
  assert mean == pytest.approx(-1.0) and high < 0


def test_tuning_flags_a_best_setting_at_its_grid_edge_and_its_runner_up():
  table = training.tuning_table(_sweep()).set_index(["method", "setting"])
  best = table[table.best]
  assert set(best.index) == {("adam", "learning_rate=0.1"),
                             ("sgd", "learning_rate=0.1")}  # kfac: no grid
  assert "learning_rate=0.1 (the highest of 3 tried)" in best.edge[
      "adam", "learning_rate=0.1"]
  assert best.edge["sgd", "learning_rate=0.1"] == ""  # inside its grid
  assert "lower than learning_rate=1" in best.vs_runner_up[
      "sgd", "learning_rate=0.1"]
  adam = best.loc["adam", "learning_rate=0.1"]
  assert adam.ci_low <= adam.score <= adam.ci_high
  assert adam.score == pytest.approx(0.30)


def test_equal_time_and_target_compare_the_chosen_settings():
  sweep = _sweep()
  table = training.equal_time(sweep).set_index("label")
  # Only each method's chosen setting, labelled by what trained.
  assert set(table.index) == {"kfac[kfac/ggn]", "adam (learning_rate=0.1)",
                              "sgd (learning_rate=0.1)"}
  # The baselines end at 1 s, so that is the equal time: K-FAC has made 10
  # of its 100 steps (error 0.91), the others all 100.
  assert set(table.equal_time_s) == {1.0}
  at = table.error_at_equal_time_mean
  assert at["kfac[kfac/ggn]"] == pytest.approx(0.91, abs=1e-3)
  assert at["adam (learning_rate=0.1)"] == pytest.approx(0.30, abs=1e-3)
  # Target 0.35: Adam and K-FAC reach it (K-FAC at step 80, later in
  # seconds), SGD's best setting (0.40) never does.
  assert table.reached["sgd (learning_rate=0.1)"] == "0 of 4"
  assert table.reached["kfac[kfac/ggn]"] == "4 of 4"
  assert (table.seconds_to_target_mean["kfac[kfac/ggn]"]
          > table.seconds_to_target_mean["adam (learning_rate=0.1)"])
  assert table.steps_to_target_mean["kfac[kfac/ggn]"] == pytest.approx(80)
  [claim] = training.claims(sweep)
  assert "On these runs it does not hold" in claim
  assert "kfac[kfac/ggn] higher than adam (learning_rate=0.1)" in claim


def test_a_claim_that_holds_is_said_to_hold():
  fast = dict(STEP_S, **{"kfac[kfac/ggn]": 0.01})  # K-FAC as fast per step as the others
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(f"{__name__}.STEP_S", fast)
    [claim] = training.claims(_sweep(claim="kfac"))
  assert "On these runs it holds" in claim
  assert training.claims(_sweep(claim=None)) == []


def test_one_seed_gives_no_interval_and_no_verdict():
  assert np.isnan(comparison.interval([0.3])[1:]).all()
  diff = comparison.difference([0.1], [0.2, 0.3])
  assert comparison.ordering(diff) == "unknown"
  assert "no interval (one seed)" in comparison.verdict("a", "b", diff, "x")
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(f"{__name__}.SEEDS", range(1))
    [claim] = training.claims(_sweep())
  assert "is not settled" in claim


def test_a_curve_along_a_spectra_run_is_labelled_by_its_optimizer():
  runs = pd.DataFrame([
      {"run_id": c, "status": "complete", "problem": "mlp",
       "measure": "spectra", "method": c, "config:curvature.name": c,
       "config:optimizer.name": "adam"} for c in ("kfac", "ekfac")])
  done = report.settings(runs)
  rows = pd.DataFrame(dict(run_id=["kfac", "ekfac"], method="adam", seed=0,
                           step=0, wall_s=0.0, train_error=1.0))
  labelled = report.with_labels(rows, done)
  assert list(labelled.label) == ["adam", "adam"]
