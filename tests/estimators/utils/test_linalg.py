"""PSD linear algebra (estimators.utils.linalg) against numpy (float64)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from estimators import utils
from tests.groundtruth import numpy_psd_power, random_normal


def test_pi_adjusted_damping_guards_zero_traces():
  a, g = jnp.zeros((2, 2)), jnp.eye(3)
  da, dg = utils.pi_adjusted_kronecker_damping(a, g, 4.0)
  np.testing.assert_allclose(da, 2 * np.eye(2))
  np.testing.assert_allclose(dg, 3 * np.eye(3))


def test_psd_matrix_power():
  m = np.asarray(random_normal(0, 4, 4))
  m = m @ m.T + 0.1 * np.eye(4)
  for power in (1, -1, -0.5, 2, 0):
    np.testing.assert_allclose(
      utils.psd_matrix_power(m, power),
      numpy_psd_power(m, power),
      rtol=1e-8,
      atol=1e-10,
    )
  np.testing.assert_allclose(
    np.sort(
      utils.kronecker_product_eigenvalues(
        jnp.array([1.0, 2.0]), jnp.array([3.0, 5.0])
      )
    ),
    [3, 5, 6, 10],
  )


# psd_inverse: one LAPACK Cholesky solve up to 512 rows, a Schur-complement
# split above (1100 splits twice).
@pytest.mark.parametrize("n", [5, 300, 513, 1100])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_psd_inverse_matches_numpy(n, dtype):
  rows = np.random.RandomState(n).randn(2 * n, n)
  matrix = rows.T @ rows / (2 * n) + 1e-2 * np.eye(n)
  want = np.linalg.inv(matrix)
  got = jax.jit(utils.psd_inverse)(jnp.asarray(matrix, dtype))
  assert got.dtype == dtype
  tol = 1e-9 if dtype == np.float64 else 2e-5
  np.testing.assert_allclose(
    np.asarray(got, np.float64) / np.abs(want).max(),
    want / np.abs(want).max(),
    atol=tol,
  )


# Kept whole up to 512 rows, in blocks above (1100 splits twice).
@pytest.mark.parametrize("n", [300, 1100])
def test_psd_inverse_root_is_the_inverse_cholesky_factor(n):
  rows = np.random.RandomState(n).randn(2 * n, n)
  matrix = rows.T @ rows / (2 * n) + 1e-2 * np.eye(n)

  @jax.jit
  def assembled(matrix):
    root, eye = utils.psd_inverse_root(matrix), jnp.eye(n, dtype=matrix.dtype)
    return (
      utils.inverse_root_multiply(root, eye),
      utils.inverse_root_multiply(root, eye, transpose=True),
    )

  root, root_t = map(np.asarray, assembled(jnp.asarray(matrix)))
  np.testing.assert_array_equal(root, np.tril(root))
  np.testing.assert_allclose(
    root @ np.linalg.cholesky(matrix), np.eye(n), atol=1e-8
  )
  np.testing.assert_allclose(root_t, root.T, atol=1e-12)
