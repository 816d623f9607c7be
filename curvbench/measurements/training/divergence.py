"""Why a training run diverged, read from its own rows: how the damping,
learning rate and update norm moved before the loss stopped being finite,
and which setting to change (`diagnose`). The settings come from the
optimizer (`knobs`); an optimizer that records none of those columns gets
the bare step."""

from collections.abc import Mapping

import numpy as np
import pandas as pd

# Columns a trainer may record per step (`trace`) for the diagnosis.
TRACED = ("damping", "learning_rate", "momentum", "rho", "update_norm")
# An update norm this many times its start counts as grown.
GROWN = 3.0
# The damping counts as fallen at a tenth of its start.
FALLEN = 10.0


def _power_of_ten_above(value: float) -> float:
  return float(10.0 ** np.ceil(np.log10(value)))


def _series(rows: pd.DataFrame, column: str) -> pd.Series:
  """`column` per step (one value a step), finite values only."""
  if column not in rows:
    return pd.Series(dtype=float)
  s = rows.drop_duplicates("step").set_index("step")[column].astype(float)
  return s[np.isfinite(s)]


def diagnose(rows: pd.DataFrame | list[dict], knobs: Mapping) -> str:
  """The diverged run's reason: the step its loss stopped being finite and,
  from the recorded `damping`, `learning_rate` and `update_norm` columns,
  what moved before it and what to change.

  Args:
    rows: the run's training rows (`step`, `diverged`, and the traced
      columns where recorded).
    knobs: the optimizer's settings by role (`KFAC.divergence_knobs`):
      `damping_floor` and `damping` (a setting's name and value, or None)
      and `learning_rate` and `norm_constraint` (the same).
  """
  rows = pd.DataFrame(rows)
  rows = rows[rows.step > 0].sort_values("step")
  bad = rows[rows.diverged.astype(bool)] if "diverged" in rows else rows[:0]
  at = int(bad.step.iloc[0]) if len(bad) else int(rows.step.iloc[-1])
  head = f"non-finite loss at step {at}"
  damping, norm = _series(rows, "damping"), _series(rows, "update_norm")
  rate = _series(rows, "learning_rate")
  if "update_norm" not in rows and damping.empty:
    return head + "."
  seen, todo = [], []
  grown_at = None
  overflow = rows.drop_duplicates("step").set_index("step")
  overflow = (
    overflow.index[~np.isfinite(overflow.update_norm.astype(float))]
    if "update_norm" in overflow
    else overflow.index[:0]
  )
  if "update_norm" not in rows:
    seen.append(
      "no update norms were recorded (optimizer.include_norms_in_stats=true "
      "records them)"
    )
  if len(overflow):
    grown_at = int(overflow[0])
    seen.append(f"the update norm was not finite from step {grown_at}")
  if len(norm):
    start = float(np.median(norm.iloc[: min(5, len(norm))]))
    top_step = int(norm.idxmax())
    growth = float(norm.max()) / start if start > 0 else np.inf
    if growth >= GROWN:
      grown = int(norm.index[norm > GROWN * start][0])
      grown_at = grown if grown_at is None else min(grown, grown_at)
      seen.append(
        f"the update norm grew {growth:.3g}x (from {start:.3g} over the "
        f"first steps to {norm.max():.3g} at step {top_step})"
      )
    elif not len(overflow):
      seen.append(
        f"the update norm stayed within {growth:.3g}x of its start "
        f"({start:.3g}; last {norm.iloc[-1]:.3g} at step {norm.index[-1]})"
      )
  fell = False
  if len(damping):
    first, low = float(damping.iloc[0]), float(damping.min())
    low_at = int(damping.index[damping <= low * 1.0001][0])
    fell = low * FALLEN <= first
    if fell:
      seen.insert(
        0, f"the damping fell from {first:.3g} to {low:.3g} at step {low_at}"
      )
    else:
      span = float(damping.max())
      seen.insert(
        0,
        f"the damping stayed at {low:.3g}"
        if span == low
        else f"the damping stayed between {low:.3g} and {span:.3g}",
      )
  if len(rate):
    seen.append(f"the learning rate was {rate.iloc[-1]:.3g} at its last step")
  floor, fixed = knobs.get("damping_floor"), knobs.get("damping")
  lr, nc = knobs.get("learning_rate"), knobs.get("norm_constraint")
  held = (
    float(damping[damping.index <= grown_at].iloc[-1])
    if grown_at is not None and len(damping[damping.index <= grown_at])
    else None
  )
  if fell and floor is not None:
    # A floor at the damping held when the update norm began to grow.
    wanted = _power_of_ten_above(max(held or 0.0, 100 * float(damping.min())))
    why = (
      "the damping held when the update norm began to grow"
      if held is not None and held >= 100 * float(damping.min())
      else "100x the lowest damping it reached"
    )
    todo.append(
      f"raise {floor[0]} (now {floor[1]:.3g}; e.g. to {wanted:.3g}, {why}, "
      "rounded up)"
    )
  if lr is not None and (grown_at is not None or not fell):
    todo.append(f"lower {lr[0]} (now {lr[1]:.3g}; e.g. to {lr[1] / 10:.3g})")
  if fixed is not None and not fell:
    todo.append(
      f"raise {fixed[0]} (now {fixed[1]:.3g}; e.g. to {fixed[1] * 10:.3g})"
    )
  if nc is not None:
    todo.append(f"set {nc} to bound the update's length")
  out = f"{head}: " + ", ".join(seen) if seen else head
  if todo:
    out += ". Try: " + "; or ".join(todo)
  return out + "."


def traced_rows(rows: list[dict], trace: Mapping[int, Mapping]) -> list[dict]:
  """`rows` with the traced columns of their step (NaN where none)."""
  columns = sorted({k for values in trace.values() for k in values})
  empty = dict.fromkeys(columns, np.nan)
  return [dict(row, **{**empty, **trace.get(row["step"], {})}) for row in rows]


__all__ = ["TRACED", "diagnose", "traced_rows"]
