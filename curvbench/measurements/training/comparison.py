"""Training runs compared as a reviewer would accept: at equal time on the
time grid, against a stated target, with intervals over seeds
(`curvbench.core.stats`).

A run's `outcomes` are read off its training rows: its final and best
error, the steps and seconds (compilation excluded) it took to reach the
target error, and its error at a point of its time grid (the parameters it
held at that second: `curvbench.core.training.run`). Runs budgeted in steps
have no time grid: methods stop at different times, so no equal-time
comparison is read off them.
"""

from __future__ import annotations

import numpy as np
import pandas as pd


def outcomes(
  rows: pd.DataFrame,
  column: str = "train_error",
  target: float | None = None,
  at_time: float | None = None,
) -> pd.DataFrame:
  """One row per run (`run_id`) of training `rows`: `final` and `best`
  value of `column` over its evaluations, `steps`, `seconds` (steady-state
  wall time at its end), `diverged`, and where given, `steps_to_target`
  and `seconds_to_target` (NaN where it never got there) and
  `value_at_time` (at its time-grid point `at_time`; infinite where the
  run diverged by then, NaN where it has no such point)."""
  out = []
  for run_id, run in rows.sort_values("step", kind="stable").groupby("run_id"):
    evaluated = run.dropna(subset=[column])
    diverged = bool(run.diverged.any()) if "diverged" in run else False
    row = dict(
      run_id=run_id,
      steps=int(run.step.iloc[-1]),
      seconds=float(run.wall_s.iloc[-1]),
      diverged=diverged,
      final=np.inf if diverged else evaluated[column].iloc[-1],
      best=evaluated[column].min(),
    )
    if target is not None:
      reached = evaluated[evaluated[column] <= target].sort_values(
        "wall_s", kind="stable"
      )
      row.update(
        steps_to_target=reached.step.iloc[0] if len(reached) else np.nan,
        seconds_to_target=reached.wall_s.iloc[0] if len(reached) else np.nan,
      )
    if at_time is not None:
      point = evaluated[
        np.isclose(
          evaluated.get("time_point_s", pd.Series(np.nan, evaluated.index)),
          at_time,
        )
      ]
      row["value_at_time"] = (
        np.inf
        if diverged and run.wall_s.iloc[-1] <= at_time
        else point[column].iloc[-1]
        if len(point)
        else np.nan
      )
    out.append(row)
  return pd.DataFrame(out)


def grid_edges(settings: pd.Series, best: str) -> list[str]:
  """The tuned keys whose value in the `best` setting lies at an edge of
  the values tried (`settings`: every tried setting, as `key=value, ...`);
  a best value at an edge says the grid should go further."""
  parsed = [
    dict(kv.split("=", 1) for kv in s.split(", ") if "=" in kv)
    for s in settings
  ]
  chosen = dict(kv.split("=", 1) for kv in best.split(", ") if "=" in kv)
  edges = []
  for key, value in chosen.items():
    tried = sorted(
      {float(p[key]) for p in parsed if key in p and _number(p[key])}
    )
    if (
      len(tried) > 1
      and _number(value)
      and float(value) in (tried[0], tried[-1])
    ):
      end = "lowest" if float(value) == tried[0] else "highest"
      edges.append(f"{key}={value} (the {end} of {len(tried)} tried)")
  return edges


def _number(text: str) -> bool:
  try:
    float(text)
  except ValueError:
    return False
  return True


__all__ = ["grid_edges", "outcomes"]
