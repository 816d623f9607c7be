"""The tuning protocol: grids per optimizer, best setting by mean score."""

import numpy as np
import pandas as pd
import pytest
from hydra.errors import HydraException

from curvbench import planning
from curvbench.core import tuning


def _training(runs):
  """Training rows of synthetic runs: `{run_id: (final error, diverged)}`."""
  rows = []
  for run_id, (error, diverged) in runs.items():
    for step, value in ((0, 2.0), (10, error)):
      rows.append(
        dict(
          run_id=run_id,
          step=step,
          train_error=value,
          diverged=diverged and step == 10,
        )
      )
  return pd.DataFrame(rows)


def test_select_picks_the_best_mean_over_seeds_and_never_a_diverged_one():
  scores = {  # run: (final training error, diverged)
    "a1": (0.30, False),
    "a2": (0.10, False),
    "a3": (0.20, False),  # 0.2
    "b1": (0.05, False),
    "b2": (0.50, False),
    "b3": (0.35, False),  # 0.3
    "c1": (0.01, False),
    "c2": (0.01, False),
    "c3": (np.nan, True),  # inf
    "k1": (0.40, False),
  }
  runs = pd.DataFrame(
    [
      dict(
        run_id=r,
        problem="ae",
        method="kfac" if r[0] == "k" else "adam",
        setting={"a": "lr=0.001", "b": "lr=0.01", "c": "lr=0.1", "k": ""}[r[0]],
      )
      for r in scores
    ]
  )
  table = tuning.select(
    runs,
    tuning.run_scores(_training(scores), "final_train_error"),
    ["problem", "method"],
  )
  adam = table[table.method == "adam"].set_index("setting")
  assert adam.score.to_dict() == pytest.approx(
    {"lr=0.001": 0.2, "lr=0.01": 0.3, "lr=0.1": np.inf}
  )
  assert adam.best.to_dict() == {
    "lr=0.001": True,
    "lr=0.01": False,
    "lr=0.1": False,
  }
  assert adam.seeds.to_dict() == {"lr=0.001": 3, "lr=0.01": 3, "lr=0.1": 3}
  assert adam.diverged["lr=0.1"] == 1
  assert table[table.method == "kfac"].best.item()
  with pytest.raises(ValueError, match="tuning.metric 'accuracy'"):
    tuning.run_scores(_training(scores), "accuracy")


def test_best_test_error_uses_the_minimum_along_the_run():
  rows = pd.DataFrame(
    dict(
      run_id="r", step=[0, 5, 10], test_error=[0.9, 0.2, 0.4], diverged=False
    )
  )
  assert tuning.run_scores(rows, "best_test_error")["r"] == 0.2
  assert tuning.run_scores(rows, "final_test_error")["r"] == 0.4


def test_the_sweeper_expands_each_optimizers_grid_for_training_only():
  grid = {
    "adam": {"learning_rate": [0.001, 0.01]},
    "sgd": {"learning_rate": [0.1], "momentum": [0.9, 0.99]},
  }
  jobs = [
    ["optimizer=adam", "measure=training", "seed=0"],
    ["optimizer=sgd", "measure=training", "seed=0"],
    ["optimizer=kfac", "measure=training", "seed=0"],
    ["optimizer=adam", "measure=timing", "seed=0"],
  ]
  out = planning.expand(
    jobs, grid, default_optimizer="kfac", default_measure="training"
  )
  assert out == [
    jobs[0] + ["optimizer.learning_rate=0.001"],
    jobs[0] + ["optimizer.learning_rate=0.01"],
    jobs[1] + ["optimizer.learning_rate=0.1", "optimizer.momentum=0.9"],
    jobs[1] + ["optimizer.learning_rate=0.1", "optimizer.momentum=0.99"],
    jobs[2],
    jobs[3],
  ]
  with pytest.raises(ValueError, match="optimizer.learning_rate is both"):
    planning.expand(
      [jobs[0] + ["optimizer.learning_rate=1"]], grid, "kfac", "training"
    )


def test_the_sweeper_runs_the_union_of_its_sweeps():
  """Each sweep's product, with the common params and the command line
  (which wins) added; a point two sweeps share runs once."""
  params = {"seed": "0,1"}
  sweeps = [
    {"measure": "spectra", "curvature": "kfac,ekfac"},
    {"measure": "training", "optimizer": "adam,sgd"},
    {"measure": "spectra", "curvature": "kfac"},
  ]
  jobs = planning.union(params, sweeps, ["problem=mlp"])
  assert sorted(map(sorted, jobs)) == sorted(
    map(
      sorted,
      [
        [f"seed={s}", "problem=mlp", "measure=spectra", f"curvature={c}"]
        for s in (0, 1)
        for c in ("kfac", "ekfac")
      ]
      + [
        [f"seed={s}", "problem=mlp", "measure=training", f"optimizer={o}"]
        for s in (0, 1)
        for o in ("adam", "sgd")
      ],
    )
  )
  assert len(jobs) == 8
  only = planning.union(params, sweeps[:1], ["seed=3"])
  assert sorted(map(sorted, only)) == [
    sorted(["seed=3", "measure=spectra", f"curvature={c}"])
    for c in ("ekfac", "kfac")
  ]
  assert planning.union(params, None, ["a=1,2"]) == [
    ["seed=0", "a=1"],
    ["seed=0", "a=2"],
    ["seed=1", "a=1"],
    ["seed=1", "a=2"],
  ]
  for bad in ([], [["measure=spectra"]]):
    with pytest.raises(HydraException, match="hydra.sweeper.sweeps is"):
      planning.union(params, bad, [])
