"""The intervals every comparison rests on: exact at any number of samples
(checked against brute-force enumeration and by their coverage on skewed
draws), no verdict where the samples are too few for the level, diverged
runs ranked rather than lost."""

import itertools

import numpy as np
import pandas as pd
import pytest

from curvbench.core import stats


def test_the_mann_whitney_distribution_is_the_enumerated_one():
  for m, n in ((1, 1), (2, 3), (3, 4), (4, 4)):
    counts = np.zeros(m * n + 1)
    for a in itertools.combinations(range(m + n), m):
      counts[sum(i > j for i in a for j in range(m + n) if j not in a)] += 1
    np.testing.assert_allclose(
      stats.mann_whitney_cdf(m, n), np.cumsum(counts) / counts.sum()
    )


@pytest.mark.parametrize(
  "sizes,enough",
  [((5,), False), ((6,), True), ((3, 3), False), ((3, 4), False)]
  + [((4, 4), True), ((3, 5), True)],
)
def test_an_exact_interval_exists_from_the_smallest_sizes_only(sizes, enough):
  assert stats.enough(*sizes) is enough


def test_three_seeds_give_no_verdict_whatever_they_show():
  a, b = [1.0, 1.1, 0.9], [5.0, 5.1, 4.9]
  for diff in (stats.difference(a, b), stats.paired_difference(a, b)):
    assert diff.too_few and stats.ordering(diff) == "unknown"
  words = stats.verdict("a", "b", stats.difference(a, b), "loss")
  assert "too few seeds to tell" in words and "at least 4 per group" in words
  assert "at least 6 samples" in stats.median_interval(a).words()


def test_the_shift_and_its_interval_from_four_seeds_each():
  diff = stats.difference([1.0, 1.1, 0.9, 1.05], [2.0, 2.1, 1.9, 2.2])
  assert diff[0] == pytest.approx(-1.025)  # the median of the 16 differences
  # k = 1: the interval runs from the smallest to the largest difference.
  assert (diff[1], diff[2]) == pytest.approx((-1.3, -0.8))
  assert stats.ordering(diff) == "lower" and diff.sizes == (4, 4)
  # One comparison stated both ways gives one interval, mirrored.
  rng = np.random.default_rng(0)
  a, b = rng.normal(0.0, 1.0, 5), rng.normal(0.5, 1.0, 7)
  forward, backward = stats.difference(a, b), stats.difference(b, a)
  assert tuple(forward) == pytest.approx(
    (-backward[0], -backward[2], -backward[1])
  )


@pytest.mark.parametrize("sizes", [(4, 4), (5, 7), (12, 9)])
def test_the_shift_interval_covers_at_its_level_on_skewed_draws(sizes):
  rng = np.random.default_rng(1)
  covered = [
    low <= -0.3 <= high
    for _, low, high in (
      stats.difference(
        rng.exponential(size=sizes[0]), rng.exponential(size=sizes[1]) + 0.3
      )
      for _ in range(2000)
    )
  ]
  # The exact interval covers at least 95 %; 2,000 draws put the estimate
  # within 0.015 of its coverage (three standard errors).
  assert np.mean(covered) >= 0.95 - 0.015


@pytest.mark.parametrize("n", [6, 9, 25])
def test_the_median_interval_covers_at_its_level_on_skewed_draws(n):
  rng = np.random.default_rng(2)
  covered = [
    low <= np.log(2) <= high
    for _, low, high in (
      stats.median_interval(rng.exponential(size=n)) for _ in range(2000)
    )
  ]
  assert np.mean(covered) >= 0.95 - 0.015


def test_paired_samples_tell_apart_what_unpaired_ones_cannot():
  """Two methods measured on the same batches: the batches' own spread is
  shared, so the paired difference is clear where the unpaired one is
  not."""
  rng = np.random.default_rng(3)
  batch = rng.normal(0, 1.0, 9)
  a, b = batch + 0.5, batch + 0.6 + rng.normal(0, 0.01, 9)
  assert stats.ordering(stats.difference(a, b)) == "tied"
  assert stats.ordering(stats.paired_difference(a, b)) == "lower"
  with pytest.raises(ValueError, match="paired samples"):
    stats.paired_difference(a, b[:3])


def test_diverged_runs_rank_last_instead_of_ending_the_comparison():
  diverged = [np.inf, np.inf, 3.0, np.inf]
  finite = [1.0, 1.1, 0.9, 1.2]
  assert stats.ordering(stats.difference(finite, diverged)) == "lower"
  assert stats.ordering(stats.difference(diverged, diverged)) == "tied"
  assert stats.median_interval([np.inf] * 6).too_few is False


def test_the_table_mean_has_students_interval():
  rng = np.random.default_rng(0)
  few, many = rng.normal(1.0, 0.1, 4), rng.normal(1.0, 0.1, 64)
  mean, low, high = stats.interval(few)
  half = 3.182446305284263 * few.std(ddof=1) / 2  # t(0.975, 3)
  assert (mean, low, high) == pytest.approx(
    (few.mean(), mean - half, mean + half)
  )
  _, low_many, high_many = stats.interval(many)
  assert high_many - low_many < high - low
  assert stats.interval([0.1, np.inf]) == (np.inf,) * 3  # diverged
  assert np.isnan(stats.interval([])).all()
  assert np.isnan(stats.interval([0.3])[1:]).all()


def test_every_summary_is_checked_against_its_own_spread():
  good = pd.DataFrame(
    dict(
      median=[1.0, 2.0],
      q25=[0.5, 2.0],
      q75=[1.5, 2.0],
      error_mean=[0.3, np.nan],
      error_ci_low=[0.2, np.nan],
      error_ci_high=[0.4, np.nan],
      diff_median=[0.1, 0.2],
      diff_ci_low=[0.0, 0.1],
      diff_ci_high=[0.2, 0.3],
    )
  )
  assert stats.inconsistencies("good", good) == []
  bad = good.assign(
    q25=[1.1, 2.0], error_ci_high=[0.25, np.nan], diff_ci_low=[0.0, 0.25]
  )
  found = stats.inconsistencies("bad", bad)
  assert len(found) == 3
  assert "bad row 0: median=1 outside [q25=1.1, q75=1.5]" in found
  assert any("error_mean=0.3 outside" in f for f in found)
  assert any("diff_median=0.2 outside" in f for f in found)
  # Beside a mean, the interval is the mean's: a median outside it is not
  # a defect (a skewed sample's median need not lie in the mean's interval).
  skewed = pd.DataFrame(
    dict(median=[1.0], q25=[0.9], q75=[5.0], mean=[3.0], ci_low=[2.0])
  ).assign(ci_high=[4.0])
  assert stats.inconsistencies("skewed", skewed) == []
  assert len(stats.inconsistencies("skewed", skewed.assign(mean=[5.0]))) == 1
