"""Approximation-quality metrics."""

import numpy as np
import pytest

from curvbench.core import metrics


def test_metrics_basics():
  rng = np.random.default_rng(0)
  a = rng.normal(size=(6, 6))
  a = a @ a.T
  assert metrics.relative_frobenius(a, a) == 0
  u = metrics.top_eigenvectors(a, 2)
  assert metrics.subspace_overlap(u, u) == pytest.approx(1.0)
  assert metrics.subspace_overlap(u, metrics.top_eigenvectors(-a, 2)) < 0.5
  eigs = np.linalg.eigvalsh(a)
  assert metrics.log_wasserstein(eigs, eigs, 1e-8) == 0
  assert metrics.log_wasserstein(10 * eigs, eigs, 1e-8) == pytest.approx(1.0)


# --- signed spectra -----------------------------------------------------------


def test_spectral_distance_by_hand():
  # W1 moves each half of the mass by 1; the exact width is 4.
  assert metrics.spectral_distance([-1, 1], [-2, 2]) == pytest.approx(0.25)
  # Weights 3/4 on -1 against 1/2: a quarter of the mass moves by 2.
  assert metrics.spectral_distance(
    [-1, 1], [-1, 1], exact_weights=[3, 1]
  ) == pytest.approx(0.25)
  # A spectrum of one point is scaled by its magnitude, or not at all at 0.
  assert metrics.spectral_distance([1, 1], [3, 3]) == pytest.approx(2 / 3)
  assert metrics.spectral_distance([1], [0]) == pytest.approx(1.0)


def test_spectral_distance_is_zero_for_equal_and_free_of_scale():
  rng = np.random.default_rng(1)
  b = rng.normal(size=(8, 8))
  exact = np.linalg.eigvalsh(b + b.T)
  approx = exact + rng.normal(size=8)
  assert exact.min() < 0 < exact.max()
  assert metrics.spectral_distance(exact, exact) == 0
  value = metrics.spectral_distance(approx, exact)
  assert value > 0
  assert metrics.spectral_distance(10 * approx, 10 * exact) == pytest.approx(
    value, rel=1e-12
  )


def test_condition_number_ignores_the_null_space():
  values = [-4.0, 2.0, 1e-12, 0.0, 0.5]
  assert metrics.condition_number(values, 1e-8) == pytest.approx(8.0)
  assert metrics.condition_number(values, 0.0) == pytest.approx(4e12)
  assert np.isnan(metrics.condition_number([1e-9, 0.0], 1e-8))


def test_num_outliers_counts_the_eigenvalues_above_the_gap():
  bulk = list(np.linspace(1.0, 0.1, 10))
  assert metrics.num_outliers([100, 50, 20] + bulk, k=5) == 3
  assert metrics.num_outliers(1.1 ** -np.arange(20), k=10) == 0
  # Negative eigenvalues are not outliers, however large.
  assert metrics.num_outliers([-1000, 10, 1, 0.9, 0.8], k=3) == 1
  # At most k: the gap below the third value is not looked at.
  assert metrics.num_outliers([100, 50, 20, 1], k=2) == 2
  assert metrics.num_outliers([3, 2, 1.5], k=2, min_gap=1.6) == 0


def test_negative_mass_and_ratio_by_hand():
  values = [-1.0, -0.5, 1.0, 2.0]
  assert metrics.negative_mass(values) == pytest.approx(0.5)
  assert metrics.negative_mass(values, [1, 2, 3, 4]) == pytest.approx(0.3)
  assert metrics.negative_mass(values, [0.4, 0.3, 0.2, 0.1]) == (
    pytest.approx(0.7)
  )
  assert metrics.negative_ratio([-2.0, 1.0, 4.0]) == pytest.approx(0.5)
  assert metrics.negative_ratio([1.0, 4.0]) == 0
  assert np.isnan(metrics.negative_ratio([-1.0, -2.0]))
