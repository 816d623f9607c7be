"""The statistics every report table uses, so that each summary comes from
one set of samples: a median with the quartiles of the same values, a mean
with the bootstrap interval of the same values, and differences between
two methods with the interval that says whether the samples tell them
apart.

Means are given with a 95 % percentile bootstrap interval (the samples
resampled with replacement, `interval`); two sets of samples are compared
by the interval of their difference of means, resampling each set on its
own (`difference`), or, where every sample of one has a partner in the
other (the same seed and batch), the pairs together (`paired_difference`).
With three seeds such intervals are wide: they say how little three seeds
can tell, which is the point.

`inconsistencies` checks a summary table against these rules: a median
within its quartiles, a mean within its interval.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

LEVEL = 0.95
ROUNDS = 4000  # bootstrap resamples


def quartiles(values) -> tuple[float, float, float]:
  """`(median, q25, q75)` of the non-NaN `values` (NaN for none)."""
  values = np.asarray(values, np.float64)
  values = values[~np.isnan(values)]
  if values.size == 0:
    return (np.nan, np.nan, np.nan)
  with np.errstate(invalid="ignore"):  # inf - inf between diverged runs
    q25, median, q75 = np.quantile(values, [0.25, 0.5, 0.75])
  return (float(median), float(q25), float(q75))


def over_runs(
  df: pd.DataFrame, index, quantity: str, value: str
) -> pd.DataFrame:
  """Per `index` and `quantity` (a column naming what `value` holds): the
  `median` of `value` over runs, its quartiles `q25` and `q75` over the
  same runs (equal to the median for one run) and the number of runs `n`.
  A run with several rows for one quantity counts once, by its median."""
  index = list(index)
  per_run = (
    df.groupby([*index, quantity, "run_id"], dropna=False)[value]
    .median()
    .dropna()
  )
  g = per_run.groupby(level=[*index, quantity], dropna=False)
  return pd.DataFrame(
    dict(
      median=g.median(), q25=g.quantile(0.25), q75=g.quantile(0.75), n=g.size()
    )
  ).reset_index()


def interval(
  values, level: float = LEVEL, seed: int = 0
) -> tuple[float, float, float]:
  """`(mean, low, high)`: the mean of `values` and the percentile
  bootstrap interval of the mean; infinite values (diverged runs) make the
  mean infinite. NaN where there are no values, and the interval NaN for
  one value (one sample gives no interval)."""
  values = np.asarray(values, np.float64)
  values = values[~np.isnan(values)]
  if values.size == 0:
    return (np.nan, np.nan, np.nan)
  if not np.isfinite(values).all():
    return (np.inf, np.inf, np.inf)
  mean = float(values.mean())
  if values.size == 1:
    return (mean, np.nan, np.nan)
  draws = np.random.default_rng(seed).choice(values, (ROUNDS, values.size))
  low, high = np.quantile(
    draws.mean(axis=1), [(1 - level) / 2, (1 + level) / 2]
  )
  # The mean is the centre of its bootstrap distribution; round-off in the
  # resampled means must not put it outside.
  return (mean, min(float(low), mean), max(float(high), mean))


def difference(
  a, b, level: float = LEVEL, seed: int = 0
) -> tuple[float, float, float]:
  """`(mean(a) - mean(b), low, high)`, the interval from resampling each
  group's samples independently."""
  a, b = (np.asarray(x, np.float64) for x in (a, b))
  a, b = a[~np.isnan(a)], b[~np.isnan(b)]
  if a.size == 0 or b.size == 0:
    return (np.nan, np.nan, np.nan)
  mean = float(np.mean(a) - np.mean(b))
  if not (np.isfinite(a).all() and np.isfinite(b).all()):
    return (mean,) * 3
  if a.size == 1 or b.size == 1:  # no interval from one sample
    return (mean, np.nan, np.nan)
  # The groups draw in an order fixed by their values, not by which is
  # passed first, so difference(b, a) is exactly -difference(a, b): a
  # report that states one comparison both ways gives one interval.
  rng = np.random.default_rng(seed)
  means = {}
  for name, values in sorted(
    (("a", a), ("b", b)),
    key=lambda item: (item[1].size, tuple(np.sort(item[1]))),
  ):
    means[name] = rng.choice(values, (ROUNDS, values.size)).mean(axis=1)
  diffs = means["a"] - means["b"]
  low, high = np.quantile(diffs, [(1 - level) / 2, (1 + level) / 2])
  return (mean, min(float(low), mean), max(float(high), mean))


def paired_difference(
  a, b, level: float = LEVEL, seed: int = 0
) -> tuple[float, float, float]:
  """`(mean(a - b), low, high)` for paired samples (`a[i]` and `b[i]`
  measured on the same seed and batch): the pairs resampled together, so
  what the pair shares (the batch's own difficulty) cancels."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  if a.shape != b.shape:
    raise ValueError(
      f"paired samples need as many of each, got {a.size} and {b.size}"
    )
  return interval(a - b, level, seed)


def ordering(diff: tuple[float, float, float]) -> str:
  """Whether `diff`, the interval of `mean(a) - mean(b)`, puts a 'lower'
  or 'higher' than b, or says they are 'tied' (the interval holds 0);
  'unknown' without an interval or with non-finite values."""
  mean, low, high = diff
  if not np.isfinite([mean, low, high]).all():
    return "unknown"
  return "lower" if high < 0 else "higher" if low > 0 else "tied"


def verdict(
  best: str,
  other: str,
  diff: tuple[float, float, float],
  what: str,
  samples: str = "seeds",
) -> str:
  """Words for `diff`, the interval of `mean(best) - mean(other)` of
  `what`, measured over `samples`."""
  mean, low, high = diff
  if not np.isfinite(mean):
    return f"{best} vs {other}: cannot compare ({what} not finite)"
  if np.isnan([low, high]).any():
    return (
      f"{best} vs {other}: {what} difference {mean:.3g}, no interval "
      f"(one sample); measure more {samples} to tell them apart"
    )
  words = {
    "lower": f"lower than {other}",
    "higher": f"higher than {other}",
    "tied": f"not told apart from {other}",
  }[ordering(diff)]
  return (
    f"{best} {words}: {what} difference {mean:.3g} "
    f"[{low:.3g}, {high:.3g}] (95 % bootstrap interval over {samples})"
  )


# --- checking a summary table -------------------------------------------------

# A centre and the two ends that must hold it, by column suffix.
SPREADS = (("median", "q25", "q75"), ("mean", "ci_low", "ci_high"))


def _groups(columns) -> list[tuple[str, str, str]]:
  """The `(centre, low, high)` column triples of a table: `median` with
  `q25` and `q75`, `mean` with `ci_low` and `ci_high`, bare or after a
  common prefix (`error_mean`, `error_ci_low`, ...)."""
  found = []
  for centre, low, high in SPREADS:
    for column in columns:
      if column == centre or column.endswith(f"_{centre}"):
        prefix = column[: -len(centre)]
        if f"{prefix}{low}" in columns and f"{prefix}{high}" in columns:
          found.append((column, f"{prefix}{low}", f"{prefix}{high}"))
  return found


def inconsistencies(
  name: str, df: pd.DataFrame, rtol: float = 1e-9
) -> list[str]:
  """Rows of the summary table `name` whose centre lies outside its own
  spread: a median outside its quartiles, a mean outside its interval
  (with a relative tolerance for round-off). Empty when there are none."""
  found = []
  for centre, low, high in _groups(list(df.columns)):
    c, lo, hi = (
      pd.to_numeric(df[k], errors="coerce").to_numpy(np.float64)
      for k in (centre, low, high)
    )
    slack = rtol * np.maximum(np.abs(c), 1e-300)
    with np.errstate(invalid="ignore"):
      bad = (c < lo - slack) | (c > hi + slack) | (lo > hi + slack)
    for i in np.flatnonzero(bad & np.isfinite(c)):
      found.append(
        f"{name} row {i}: {centre}={c[i]:.6g} outside "
        f"[{low}={lo[i]:.6g}, {high}={hi[i]:.6g}]"
      )
  return found


__all__ = [
  "LEVEL",
  "ROUNDS",
  "SPREADS",
  "difference",
  "inconsistencies",
  "interval",
  "ordering",
  "over_runs",
  "paired_difference",
  "quartiles",
  "verdict",
]
