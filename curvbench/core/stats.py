"""The statistics every report table uses, so that each summary comes from
one set of samples: a median with the quartiles of the same values, a mean
with the interval of the same values, and comparisons between two methods
with the interval that says whether the samples tell them apart.

Comparisons rest on intervals that hold their level at any number of
samples and for any distribution, so that a verdict from three seeds means
what one from thirty does (Hollander, Wolfe & Chicken, *Nonparametric
Statistical Methods*, 3rd ed., 2014, sec. 3.6 and 4.3):

- two independent groups (`difference`): the Hodges-Lehmann shift, the
  median of every difference `a_i - b_j`, with the exact Mann-Whitney
  interval (order statistics of those differences);
- paired samples (`paired_difference`) and one group (`median_interval`):
  the median, with the exact sign-test interval (order statistics of the
  values, their coverage from the binomial distribution).

Where the samples are too few for any such interval at the level (fewer
than 6 for one group or pairs, fewer than 4 and 4 for two groups at 95 %),
the interval is NaN and the comparison is *too few samples to tell*: a
percentile bootstrap over 2 or 3 samples would print an interval that
covers far less often than it says. A diverged run (infinite loss) is a
sample like any other to these rank methods: it ranks last.

Table means (`interval`) are described with Student's t interval, exact
for normal samples. `inconsistencies` checks a summary table against these
rules: a median within its quartiles or interval, a mean within its
interval.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pandas as pd
from scipy import stats as scipy_stats

LEVEL = 0.95
# Two groups up to this many pairs get the exact Mann-Whitney distribution;
# larger ones its normal approximation (within 1e-3 of it from here on).
EXACT_PAIRS = 10_000


class Interval(tuple):
  """`(centre, low, high)` of a comparison, with the sample `sizes` it
  rests on and the `method` that gave it; unpacks as the three numbers.
  `low` and `high` are NaN where the samples are too few for the level."""

  sizes: tuple[int, ...]
  method: str

  def __new__(cls, centre, low, high, sizes=(), method=""):
    self = super().__new__(cls, (float(centre), float(low), float(high)))
    self.sizes, self.method = tuple(int(n) for n in sizes), method
    return self

  @property
  def too_few(self) -> bool:
    """Whether the samples were too few for an interval at the level."""
    return bool(np.isnan(self[1]) or np.isnan(self[2]))

  def samples(self) -> str:
    """'n = 4 and 5' (or 'n = 6 paired')."""
    if not self.sizes:
      return "no samples"
    paired = " paired" if "paired" in self.method else ""
    return "n = " + " and ".join(map(str, self.sizes)) + paired

  def words(self, digits: int = 3) -> str:
    """'centre [95 % interval low, high] (method, n = ...)', or why there is
    no interval."""
    centre, low, high = self
    if not np.isfinite(centre) and np.isnan(centre):
      return "none (no finite samples)"
    if self.too_few:
      return (
        f"{centre:.{digits}g}, too few samples to tell ({self.samples()}; "
        f"{needed(len(self.sizes), 'paired' in self.method)})"
      )
    return (
      f"{centre:.{digits}g} [{percent()} interval {low:.{digits}g}, "
      f"{high:.{digits}g}] ({self.method}, {self.samples()})"
    )


def needed(groups: int = 1, paired: bool = False, level: float = LEVEL) -> str:
  """What an exact interval at `level` needs, in words."""
  if groups == 2 and not paired:
    m = next(n for n in range(1, 100) if enough(n, n, level=level))
    return f"an exact {percent(level)} interval needs at least {m} per group"
  n = next(n for n in range(1, 100) if enough(n, level=level))
  return f"an exact {percent(level)} interval needs at least {n} samples"


def percent(level: float = LEVEL) -> str:
  """'95 %'."""
  return f"{level * 100:g} %"


def enough(*sizes: int, level: float = LEVEL) -> bool:
  """Whether an exact interval at `level` exists from samples of `sizes`:
  one size (one group, or pairs) for the sign test, two for Mann-Whitney
  (the most extreme arrangement must be rarer than the level allows)."""
  alpha = (1 - level) / 2
  if len(sizes) == 1:
    return sizes[0] >= 1 and 0.5 ** sizes[0] <= alpha
  m, n = sizes
  return m >= 1 and n >= 1 and 1 / math.comb(m + n, m) <= alpha


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


def interval(values, level: float = LEVEL) -> tuple[float, float, float]:
  """`(mean, low, high)`: the mean of `values` and Student's t interval of
  the mean (a description for tables; comparisons use `difference`);
  infinite values (diverged runs) make all three infinite. NaN where there
  are no values, and the interval NaN for one value."""
  values = np.asarray(values, np.float64)
  values = values[~np.isnan(values)]
  if values.size == 0:
    return (np.nan, np.nan, np.nan)
  if not np.isfinite(values).all():
    return (np.inf, np.inf, np.inf)
  mean = float(values.mean())
  if values.size == 1:
    return (mean, np.nan, np.nan)
  half = float(
    scipy_stats.t.ppf((1 + level) / 2, values.size - 1)
    * values.std(ddof=1)
    / np.sqrt(values.size)
  )
  return (mean, mean - half, mean + half)


def _rank(values: np.ndarray, level: float) -> int | None:
  """How many order statistics to cut from each end of `values` sorted
  (the sign test's k): the interval between the next ones covers the median
  with at least `level`; None where no such interval exists."""
  n = values.size
  if not enough(n, level=level):
    return None
  # The largest k with P(Binomial(n, 1/2) < k) <= (1 - level) / 2.
  k = int(scipy_stats.binom.ppf((1 - level) / 2, n, 0.5))
  while k > 0 and scipy_stats.binom.cdf(k - 1, n, 0.5) > (1 - level) / 2:
    k -= 1
  while scipy_stats.binom.cdf(k, n, 0.5) <= (1 - level) / 2:
    k += 1
  return k


def median_interval(values, level: float = LEVEL) -> Interval:
  """The median of `values` with its distribution-free interval (the sign
  test's order statistics); NaN ends where they are too few. Infinite
  values (diverged runs) rank as they are; NaN ones are left out."""
  values = np.sort(_finite_or_infinite(values))
  if values.size == 0:
    return Interval(np.nan, np.nan, np.nan, (0,), "sign test")
  centre = (
    float(np.median(values))
    if np.isfinite(values).all()
    else (
      float(values[(values.size - 1) // 2] / 2 + values[values.size // 2] / 2)
    )
  )
  k = _rank(values, level)
  if k is None:
    return Interval(centre, np.nan, np.nan, (values.size,), "sign test")
  return Interval(
    centre, values[k - 1], values[values.size - k], (values.size,), "sign test"
  )


def _finite_or_infinite(values) -> np.ndarray:
  values = np.asarray(values, np.float64).ravel()
  return values[~np.isnan(values)]


@functools.lru_cache(maxsize=256)
def mann_whitney_cdf(m: int, n: int) -> np.ndarray:
  """`P(U <= u)` for `u = 0..mn` under the null: `U` the number of pairs
  `(a_i, b_j)` with `a_i > b_j` when `m + n` exchangeable values split at
  random. Built up by where the largest value falls (an `a`: it beats all
  `n` b's; a `b`: it beats none), so every term is a probability."""
  table = {(0, j): np.ones(1) for j in range(n + 1)}
  for i in range(1, m + 1):
    table[(i, 0)] = np.ones(1)
    for j in range(1, n + 1):
      p = np.zeros(i * j + 1)
      p[j:] += i / (i + j) * table[(i - 1, j)]
      p[: (i * (j - 1)) + 1] += j / (i + j) * table[(i, j - 1)]
      table[(i, j)] = p
    for j in range(n + 1):
      table.pop((i - 1, j), None)
  return np.cumsum(table[(m, n)])


def _shift_rank(m: int, n: int, level: float) -> int | None:
  """How many of the `mn` sorted differences to cut from each end for the
  Mann-Whitney interval at `level`; None where none exists."""
  if not enough(m, n, level=level):
    return None
  alpha = (1 - level) / 2
  if m * n <= EXACT_PAIRS:
    cdf = mann_whitney_cdf(min(m, n), max(m, n))
    # The largest k with P(U <= k - 1) <= alpha.
    return int(np.searchsorted(cdf, alpha, side="right"))
  mean, sd = m * n / 2, math.sqrt(m * n * (m + n + 1) / 12)
  return max(1, int(mean - scipy_stats.norm.ppf(1 - alpha) * sd))


def _minus(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """`a - b`, two runs diverged alike (both +inf or both -inf) a tie."""
  with np.errstate(invalid="ignore"):
    d = a - b
  return np.where(np.isnan(d), 0.0, d)


def difference(a, b, level: float = LEVEL) -> Interval:
  """`a` against `b`, two independent groups: the Hodges-Lehmann shift
  (the median of every `a_i - b_j`) with the exact Mann-Whitney interval;
  NaN ends where the groups are too small for the level. Exactly
  `-difference(b, a)` mirrored."""
  a, b = _finite_or_infinite(a), _finite_or_infinite(b)
  sizes = (a.size, b.size)
  method = "Hodges-Lehmann shift, exact Mann-Whitney interval"
  if a.size == 0 or b.size == 0:
    return Interval(np.nan, np.nan, np.nan, sizes, method)
  d = np.sort(_minus(a[:, None], b[None, :]).ravel())
  centre = (d[(d.size - 1) // 2] + d[d.size // 2]) / 2
  if np.isnan(centre):  # +inf and -inf in the middle
    centre = 0.0
  k = _shift_rank(a.size, b.size, level)
  if k is None:
    return Interval(centre, np.nan, np.nan, sizes, method)
  return Interval(centre, d[k - 1], d[d.size - k], sizes, method)


def paired_difference(a, b, level: float = LEVEL) -> Interval:
  """`a` against `b` where `a[i]` and `b[i]` were measured on the same
  seed and batch: the median of the differences with the sign test's
  interval, so that what a pair shares (the batch's own difficulty)
  cancels. NaN ends where the pairs are too few for the level."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  if a.shape != b.shape:
    raise ValueError(
      f"paired samples need as many of each, got {a.size} and {b.size}"
    )
  keep = ~(np.isnan(a) | np.isnan(b))
  found = median_interval(_minus(a[keep], b[keep]), level)
  centre, low, high = found
  return Interval(
    centre, low, high, found.sizes, "median of paired differences, sign test"
  )


def ordering(diff) -> str:
  """Whether `diff`, the interval of `a` against `b`, puts a 'lower' or
  'higher' than b, or says they are 'tied' (the interval holds 0);
  'unknown' without an interval (too few samples)."""
  centre, low, high = diff
  if np.isnan([centre, low, high]).any():
    return "unknown"
  return "lower" if high < 0 else "higher" if low > 0 else "tied"


def verdict(
  best: str,
  other: str,
  diff: Interval,
  what: str,
  samples: str = "seeds",
) -> str:
  """Words for `diff`, the interval of `best` against `other` in `what`,
  measured over `samples`."""
  centre = diff[0]
  if np.isnan(centre):
    return f"{best} vs {other}: cannot compare ({what}: no samples)"
  if ordering(diff) == "unknown":
    return (
      f"{best} vs {other}: too few {samples} to tell ({what} difference "
      f"{centre:.3g}; {diff.samples()}: "
      f"{needed(len(diff.sizes), 'paired' in diff.method)})"
    )
  words = {
    "lower": f"lower than {other}",
    "higher": f"higher than {other}",
    "tied": f"not told apart from {other}",
  }[ordering(diff)]
  return f"{best} {words}: {what} difference {diff.words()} over {samples}"


# --- checking a summary table -------------------------------------------------

# A centre and the two ends that must hold it, by column suffix.
SPREADS = (
  ("median", "q25", "q75"),
  ("median", "ci_low", "ci_high"),
  ("mean", "ci_low", "ci_high"),
)


def _groups(columns) -> list[tuple[str, str, str]]:
  """The `(centre, low, high)` column triples of a table: `median` with
  `q25` and `q75`, and `ci_low` and `ci_high` with the `mean` where there
  is one, else with the `median` (its own interval), bare or after a
  common prefix (`error_mean`, `error_ci_low`, ...)."""
  found = []
  for centre, low, high in SPREADS:
    for column in columns:
      if column == centre or column.endswith(f"_{centre}"):
        prefix = column[: -len(centre)]
        if (
          low == "ci_low" and centre == "median" and f"{prefix}mean" in columns
        ):
          continue  # the interval is the mean's
        if f"{prefix}{low}" in columns and f"{prefix}{high}" in columns:
          found.append((column, f"{prefix}{low}", f"{prefix}{high}"))
  return found


def inconsistencies(
  name: str, df: pd.DataFrame, rtol: float = 1e-9
) -> list[str]:
  """Rows of the summary table `name` whose centre lies outside its own
  spread: a median outside its quartiles or interval, a mean outside its
  interval
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
  "EXACT_PAIRS",
  "Interval",
  "LEVEL",
  "SPREADS",
  "difference",
  "enough",
  "inconsistencies",
  "interval",
  "median_interval",
  "needed",
  "percent",
  "ordering",
  "over_runs",
  "paired_difference",
  "quartiles",
  "verdict",
]
