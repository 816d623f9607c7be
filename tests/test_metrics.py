"""Approximation-quality metrics."""

import numpy as np
import pytest

from curvbench import metrics


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
