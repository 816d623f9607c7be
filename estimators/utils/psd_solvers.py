"""Inverses, solves, inverse square roots and norms of PSD matrices, with
the two process-wide switches KFAC-JAX's `utils` exposes.

A matrix argument may also be a vector (the diagonal of a diagonal matrix)
or a scalar (a 1 x 1 matrix) where the docstring says so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.experimental.sparse import linalg as sparse_linalg

from estimators.utils.linalg import psd_eigvalsh, psd_inverse, psd_matrix_power

# Whether `pi_adjusted_kronecker_factors` treats factors with a zero norm
# specially (each becomes `damping^(1/k) I`) instead of dividing by zero.
_special_case_zero_inv = True
# Whether `psd_inv` and `psd_solve` go through a Cholesky factor rather than
# an LU factorisation.
_use_cholesky_inversion = False


def set_special_case_zero_inv(value: bool) -> None:
  """Sets whether `pi_adjusted_kronecker_factors` handles zero factors
  (on by default)."""
  global _special_case_zero_inv
  _special_case_zero_inv = bool(value)


def get_special_case_zero_inv() -> bool:
  """Whether `pi_adjusted_kronecker_factors` handles zero factors."""
  return _special_case_zero_inv


def set_use_cholesky_inversion(value: bool) -> None:
  """Sets whether `psd_inv`/`psd_solve` use a Cholesky factor (off by
  default: LU, which tolerates smaller damping)."""
  global _use_cholesky_inversion
  _use_cholesky_inversion = bool(value)


def get_use_cholesky_inversion() -> bool:
  """Whether `psd_inv` and `psd_solve` use a Cholesky factor."""
  return _use_cholesky_inversion


def _check_square(matrix: jax.Array, what: str) -> None:
  if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1]:
    raise ValueError(f"{what} takes a square matrix, got shape {matrix.shape}.")


def _not_finite(matrix: jax.Array) -> jax.Array:
  return jnp.logical_not(jnp.all(jnp.isfinite(matrix)))


def psd_inv(matrix: jax.Array) -> jax.Array:
  """The inverse of a positive definite matrix.

  Uses `psd_inverse` (Cholesky) when `get_use_cholesky_inversion()`, else
  an LU inverse; a matrix with a NaN or infinite entry gives all NaNs
  rather than reaching the factorisation.
  """
  _check_square(matrix, "psd_inv")
  if get_use_cholesky_inversion():
    return psd_inverse(matrix)
  return jax.lax.cond(
    _not_finite(matrix),
    lambda m: jnp.full_like(m, jnp.nan),
    jnp.linalg.inv,
    matrix,
  )


def psd_solve(matrix: jax.Array, vector: jax.Array) -> jax.Array:
  """`x` with `matrix x = vector` for a positive definite matrix.

  Cholesky when `get_use_cholesky_inversion()`, else LU; a matrix with a
  NaN or infinite entry gives a NaN solution.
  """
  _check_square(matrix, "psd_solve")
  if get_use_cholesky_inversion():
    return jax.scipy.linalg.solve(matrix, vector, assume_a="pos")
  return jax.lax.cond(
    _not_finite(matrix),
    lambda m, v: jnp.full_like(v, jnp.nan),
    jnp.linalg.solve,
    matrix,
    vector,
  )


def _solve_without_last_index(a: jax.Array, b: jax.Array) -> jax.Array:
  x = psd_solve(a[..., :-1, :-1], b[..., :-1])
  return jnp.concatenate([x, jnp.zeros_like(b[..., :1])], axis=-1)


def psd_solve_maybe_zero_last_idx(a: jax.Array, b: jax.Array) -> jax.Array:
  """`psd_solve(a, b)`, except that when the last row and column of `a` are
  zero the system without its last index is solved and the last entry of
  the solution is 0."""
  last_is_zero = jnp.all(a[..., -1] == 0) & jnp.all(a[..., -1, :] == 0)
  return jax.lax.cond(last_is_zero, _solve_without_last_index, psd_solve, a, b)


def invert_psd_matrices(matrices: Any) -> Any:
  """The inverse of every matrix of a pytree (`psd_inv` for 2D leaves, the
  reciprocal for diagonals and scalars)."""
  return jax.tree.map(
    lambda m: psd_inv(m) if jnp.ndim(m) == 2 else 1.0 / m, matrices
  )


def inverse_sqrt_psd_matrices(matrices: Any) -> Any:
  """`m^(-1/2)` for every matrix `m` of a pytree (diagonals and scalars
  elementwise).

  KFAC-JAX 0.0.8 calls a module it does not ship for 2D leaves (a
  NameError); here they go through `psd_matrix_power(m, -0.5)`.
  """
  return jax.tree.map(
    lambda m: psd_matrix_power(m, -0.5) if jnp.ndim(m) == 2 else m**-0.5,
    matrices,
  )


def _two_norm(matrix: jax.Array, method: str, rng_key: Any) -> jax.Array:
  if method == "exact":
    return psd_eigvalsh(matrix)[-1]
  if method == "lobpcg":
    if matrix.shape[0] <= 5:
      # LOBPCG needs more than 5 rows for one vector; take all eigenvalues.
      return psd_eigvalsh(matrix)[-1]
    key = jax.random.PRNGKey(123) if rng_key is None else rng_key
    start = jax.random.normal(key, (matrix.shape[0], 1), matrix.dtype)
    return sparse_linalg.lobpcg_standard(matrix, start, m=300, tol=1e-8)[0][0]
  if method == "power_iteration":
    return optax.power_iteration(matrix, num_iters=300, error_tolerance=1e-7)[0]
  raise ValueError(
    f"Unknown method_2norm {method!r}: use 'lobpcg', 'power_iteration' or "
    "'exact'."
  )


# Each norm from a scalar, the diagonal of a diagonal matrix, a square matrix.
NORM_FUNCTIONS: dict[str, tuple[Callable[[jax.Array], Any], ...]] = {
  "avg_diag": (
    lambda s: s,
    lambda d: jnp.sum(d) / d.shape[0],
    lambda m: jnp.trace(m) / m.shape[0],
  ),
  "median_diag": (lambda s: s, jnp.median, lambda m: jnp.median(jnp.diag(m))),
  "trace": (lambda s: s, jnp.sum, jnp.trace),
  "median_eig": (
    lambda s: s,
    jnp.median,
    lambda m: jnp.median(jnp.linalg.eigvalsh(m)),
  ),
  "one_over_dim": (
    lambda s: 1.0,
    lambda d: 1.0 / d.shape[0],
    lambda m: 1.0 / m.shape[0],
  ),
  "1_norm": (lambda s: s, jnp.max, lambda m: jnp.linalg.norm(m, ord=1)),
  "avg_fro": (
    lambda s: s,
    lambda d: jnp.linalg.norm(d) / jnp.sqrt(d.shape[0]),
    lambda m: jnp.linalg.norm(m) / jnp.sqrt(m.shape[0]),
  ),
  "fro": (lambda s: s, jnp.linalg.norm, jnp.linalg.norm),
}


def psd_matrix_norm(
  matrix: jax.Array,
  norm_type: str = "avg_diag",
  method_2norm: str = "lobpcg",
  rng_key: Any = None,
) -> Any:
  """A norm (or norm-like scale) of a PSD matrix.

  Args:
    matrix: a square matrix, a vector (its diagonal) or a scalar.
    norm_type: "2_norm" (largest eigenvalue), "avg_diag" (trace / dim),
      "median_diag", "trace", "median_eig", "one_over_dim" (1 / dim, not a
      norm), "1_norm" (max absolute column sum), "avg_fro" (Frobenius /
      sqrt(dim)) or "fro".
    method_2norm: for "2_norm": "lobpcg" (exact eigenvalues for matrices of
      at most 5 rows, which LOBPCG cannot take), "power_iteration", or
      "exact" (all eigenvalues; not in KFAC-JAX).
    rng_key: the key of LOBPCG's start vector (a fixed one when None).

  Returns:
    The norm, a scalar.

  Raises:
    ValueError: for an unknown norm type or method, or an array that is
      neither a scalar, a vector nor a square matrix.
  """
  matrix = jnp.asarray(matrix)
  if norm_type != "2_norm" and norm_type not in NORM_FUNCTIONS:
    raise ValueError(
      f"Unknown norm_type {norm_type!r}: use one of {['2_norm', *NORM_FUNCTIONS]}."
    )
  square = matrix.ndim == 2 and matrix.shape[0] == matrix.shape[1]
  if matrix.ndim > 2 or (matrix.ndim == 2 and not square):
    raise ValueError(
      f"psd_matrix_norm takes a scalar, a vector or a square matrix, got "
      f"shape {matrix.shape}."
    )
  if norm_type == "2_norm":
    if matrix.ndim == 2:
      return _two_norm(matrix, method_2norm, rng_key)
    return matrix if matrix.ndim == 0 else jnp.max(matrix)
  return NORM_FUNCTIONS[norm_type][matrix.ndim](matrix)
