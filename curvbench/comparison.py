"""Training runs compared as a reviewer would accept: at equal time, against
a stated target, with intervals over seeds.

A run's `outcomes` are read off its training rows: its final and best
error, the steps and seconds (compilation excluded) it took to reach the
target error, and its error at a given time (the last evaluation at or
before it). Over the seeds of a setting, numbers are means with a 95 %
bootstrap interval (seeds resampled with replacement; `interval`), and two
settings are compared by the interval of their difference of means
(`difference`). With three seeds such intervals are wide: they say how
little three seeds can tell, which is the point.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

LEVEL = 0.95
ROUNDS = 4000  # bootstrap resamples


def interval(values, level: float = LEVEL, seed: int = 0
             ) -> tuple[float, float, float]:
  """`(mean, low, high)`: the mean of `values` (one per seed) and the
  percentile bootstrap interval of the mean; infinite values (diverged
  runs) make the mean infinite. NaN where there are no values, and the
  interval NaN for one value (one seed gives no interval)."""
  values = np.asarray(values, np.float64)
  values = values[~np.isnan(values)]
  if values.size == 0:
    return (np.nan, np.nan, np.nan)
  if not np.isfinite(values).all():
    return (np.inf, np.inf, np.inf)
  if values.size == 1:
    return (float(values[0]), np.nan, np.nan)
  draws = np.random.default_rng(seed).choice(values, (ROUNDS, values.size))
  low, high = np.quantile(draws.mean(axis=1), [(1 - level) / 2,
                                               (1 + level) / 2])
  return (float(values.mean()), float(low), float(high))


def difference(a, b, level: float = LEVEL, seed: int = 0
               ) -> tuple[float, float, float]:
  """`(mean(a) - mean(b), low, high)`, the interval from resampling each
  group's seeds independently."""
  a, b = (np.asarray(x, np.float64) for x in (a, b))
  a, b = a[~np.isnan(a)], b[~np.isnan(b)]
  if a.size == 0 or b.size == 0:
    return (np.nan, np.nan, np.nan)
  if not (np.isfinite(a).all() and np.isfinite(b).all()):
    return (np.mean(a) - np.mean(b),) * 3
  if a.size == 1 or b.size == 1:  # no interval from one seed
    return (float(a.mean() - b.mean()), np.nan, np.nan)
  rng = np.random.default_rng(seed)
  diffs = (rng.choice(a, (ROUNDS, a.size)).mean(axis=1)
           - rng.choice(b, (ROUNDS, b.size)).mean(axis=1))
  low, high = np.quantile(diffs, [(1 - level) / 2, (1 + level) / 2])
  return (float(a.mean() - b.mean()), float(low), float(high))


def outcomes(rows: pd.DataFrame, column: str = "train_error",
             target: float | None = None,
             at_time: float | None = None) -> pd.DataFrame:
  """One row per run (`run_id`) of training `rows`: `final` and `best`
  value of `column` over its evaluations, `steps`, `seconds` (steady-state
  wall time at its end), `diverged`, and where given, `steps_to_target`
  and `seconds_to_target` (NaN where it never got there) and
  `value_at_time` (at the last evaluation no later than `at_time` seconds;
  infinite where the run diverged by then)."""
  out = []
  for run_id, run in rows.sort_values("step").groupby("run_id"):
    evaluated = run.dropna(subset=[column])
    diverged = bool(run.diverged.any()) if "diverged" in run else False
    row = dict(run_id=run_id, steps=int(run.step.iloc[-1]),
               seconds=float(run.wall_s.iloc[-1]), diverged=diverged,
               final=np.inf if diverged else evaluated[column].iloc[-1],
               best=evaluated[column].min())
    if target is not None:
      reached = evaluated[evaluated[column] <= target]
      row.update(steps_to_target=reached.step.iloc[0] if len(reached)
                 else np.nan,
                 seconds_to_target=reached.wall_s.iloc[0] if len(reached)
                 else np.nan)
    if at_time is not None:
      before = evaluated[evaluated.wall_s <= at_time]
      row["value_at_time"] = (
          np.inf if diverged and run.wall_s.iloc[-1] <= at_time
          else before[column].iloc[-1] if len(before) else np.nan)
    out.append(row)
  return pd.DataFrame(out)


def grid_edges(settings: pd.Series, best: str) -> list[str]:
  """The tuned keys whose value in the `best` setting lies at an edge of
  the values tried (`settings`: every tried setting, as `key=value, ...`);
  a best value at an edge says the grid should go further."""
  parsed = [dict(kv.split("=", 1) for kv in s.split(", ") if "=" in kv)
            for s in settings]
  chosen = dict(kv.split("=", 1) for kv in best.split(", ") if "=" in kv)
  edges = []
  for key, value in chosen.items():
    tried = sorted({float(p[key]) for p in parsed if key in p
                    and _number(p[key])})
    if len(tried) > 1 and _number(value) and float(value) in (tried[0],
                                                              tried[-1]):
      end = "lowest" if float(value) == tried[0] else "highest"
      edges.append(f"{key}={value} (the {end} of {len(tried)} tried)")
  return edges


def _number(text: str) -> bool:
  try:
    float(text)
  except ValueError:
    return False
  return True


def ordering(diff: tuple[float, float, float]) -> str:
  """Whether `diff`, the interval of `mean(a) - mean(b)`, puts a 'lower'
  or 'higher' than b, or says they are 'tied' (the interval holds 0);
  'unknown' without an interval or with non-finite values."""
  mean, low, high = diff
  if not np.isfinite([mean, low, high]).all():
    return "unknown"
  return "lower" if high < 0 else "higher" if low > 0 else "tied"


def verdict(best: str, other: str, diff: tuple[float, float, float],
            what: str) -> str:
  """Words for `diff`, the interval of `mean(best) - mean(other)` of a
  quantity where lower is better."""
  mean, low, high = diff
  if not np.isfinite(mean):
    return f"{best} vs {other}: cannot compare ({what} not finite)"
  if np.isnan([low, high]).any():
    return (f"{best} vs {other}: {what} difference {mean:.4g}, no interval "
            "(one seed); run more seeds to tell them apart")
  words = {"lower": f"lower than {other}", "higher": f"higher than {other}",
           "tied": f"not told apart from {other}"}[ordering(diff)]
  return (f"{best} {words}: {what} difference {mean:.4g} "
          f"[{low:.4g}, {high:.4g}] (95 % bootstrap interval over seeds)")
