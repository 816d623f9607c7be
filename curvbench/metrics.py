"""Approximation-quality metrics, in float64 numpy.

Spectra may be weighted samples `(values, weights)`: weights are 1/P for a
full eigendecomposition and the quadrature weights for stochastic Lanczos.
"""

from __future__ import annotations

import numpy as np
from scipy.stats import wasserstein_distance


def relative_frobenius(approx: np.ndarray, exact: np.ndarray) -> float:
  """`||A - E||_F / ||E||_F` (0 for an exact estimate)."""
  approx, exact = np.asarray(approx, np.float64), np.asarray(exact, np.float64)
  return float(np.linalg.norm(approx - exact) / np.linalg.norm(exact))


def log_spectrum(values, floor: float) -> np.ndarray:
  """`log10(max(value, floor))`: zero and negative eigenvalues sit at the floor."""
  return np.log10(np.maximum(np.asarray(values, np.float64), floor))


def log_wasserstein(approx, exact, floor: float, approx_weights=None,
                    exact_weights=None) -> float:
  """1-Wasserstein distance between the log10-spectra (in decades)."""
  return float(wasserstein_distance(log_spectrum(approx, floor),
                                    log_spectrum(exact, floor),
                                    approx_weights, exact_weights))


def cosine(u, v) -> float:
  u, v = np.ravel(u).astype(np.float64), np.ravel(v).astype(np.float64)
  return float(u @ v / (np.linalg.norm(u) * np.linalg.norm(v)))


def top_eigenvectors(matrix, k: int) -> np.ndarray:
  """The `k` eigenvectors of largest eigenvalue, as columns."""
  _, vecs = np.linalg.eigh(np.asarray(matrix, np.float64))
  return vecs[:, ::-1][:, :k]


def subspace_overlap(u: np.ndarray, v: np.ndarray) -> float:
  """`||Uᵀ V||_F^2 / k` for orthonormal columns: 1 when the spans agree."""
  k = min(u.shape[1], v.shape[1])
  return float(np.linalg.norm(u[:, :k].T @ v[:, :k]) ** 2 / k)


def density(values, weights, grid, bandwidth: float) -> np.ndarray:
  """A Gaussian-smoothed density of weighted samples on `grid`."""
  values, weights = np.asarray(values, np.float64), np.asarray(weights)
  z = (np.asarray(grid)[:, None] - values[None, :]) / bandwidth
  kernel = np.exp(-0.5 * z ** 2) / (bandwidth * np.sqrt(2 * np.pi))
  return kernel @ (weights / weights.sum())
