"""Picking each optimizer's best setting from a sweep's training runs.

The protocol follows DeepOBS (Schneider, Balles & Hennig, 2019): every
optimizer is trained at each point of its own hyperparameter grid (the
sweeper's `tuning.grid`) with several seeds; a setting's score is a metric
of its runs averaged over seeds; the best score wins; and a run that
diverged scores +inf, so an unstable setting is never chosen.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

# metric name -> (training-table column, which step of a run counts)
METRICS = {
  "final_train_error": ("train_error", "last"),
  "final_train_loss": ("train_loss", "last"),
  "final_test_error": ("test_error", "last"),
  "final_test_loss": ("test_loss", "last"),
  "best_test_error": ("test_error", "min"),
  "best_test_loss": ("test_loss", "min"),
}


def run_scores(training: pd.DataFrame, metric: str) -> pd.Series:
  """The metric of each run (indexed by `run_id`); +inf for a diverged run.

  Args:
    training: training rows with `run_id`, `step`, `diverged` and the
      metric's column.
    metric: a key of `METRICS`.
  """
  if metric not in METRICS:
    raise ValueError(
      f"Unknown tuning.metric {metric!r}; choose one of {', '.join(METRICS)}."
    )
  column, how = METRICS[metric]
  rows = training.sort_values("step")
  scores = {}
  for run_id, run in rows.groupby("run_id"):
    values = run[column].dropna()
    if run.diverged.any() or values.empty or not np.isfinite(values).all():
      scores[run_id] = np.inf
    else:
      scores[run_id] = values.iloc[-1] if how == "last" else values.min()
  return pd.Series(scores, name=metric, dtype=float)


def select(
  runs: pd.DataFrame, scores: pd.Series, by: list[str], setting: str = "setting"
) -> pd.DataFrame:
  """The score of every setting (mean over seeds) and the best per group.

  Args:
    runs: one row per run: `run_id`, the `by` columns and `setting`.
    scores: `run_scores(...)`.
    by: the columns that define a group (e.g. problem and method).
    setting: the column naming a run's hyperparameter setting.

  Returns:
    One row per group and setting: the `by` columns, `setting`, `score`
    (mean over seeds), `seeds` (runs averaged), `diverged` (runs that
    diverged) and `best` (True for the group's lowest score; ties go to the
    first setting in sorted order).
  """
  joined = runs[["run_id", *by, setting]].merge(
    scores.rename("score"), left_on="run_id", right_index=True
  )
  table = (
    joined.groupby([*by, setting], dropna=False)
    .agg(
      score=("score", "mean"),
      seeds=("run_id", "nunique"),
      diverged=("score", lambda s: int(np.isinf(s).sum())),
    )
    .reset_index()
  )
  table = table.sort_values([*by, "score", setting], kind="stable")
  table["best"] = ~table.duplicated(by, keep="first")
  return table.reset_index(drop=True)
