"""Scalar sizes of PSD matrices, used to scale a block's damping.

`psd_matrix_norm` takes a square PSD matrix, a vector holding the diagonal
of a diagonal matrix, or a scalar (a 1x1 matrix). Not every kind is a norm
("one_over_dim" is a constant); the names are KFAC-JAX's.
"""

from __future__ import annotations

from estimators.utils import psd_solvers
from estimators.utils.types import Array, Numeric

NORM_TYPES = ("2_norm", *psd_solvers.NORM_FUNCTIONS)


def psd_matrix_norm(
  matrix: Array, norm_type: str = "avg_diag", **unused_kwargs
) -> Numeric:
  """`utils.psd_matrix_norm`, its 2-norm the exact largest eigenvalue (the
  blocks' matrices are small enough to decompose).

  Args:
    matrix: a `(n, n)` PSD matrix, the `(n,)` diagonal of a diagonal one, or
      a scalar.
    norm_type: one of `NORM_TYPES`.
    **unused_kwargs: accepted for KFAC-JAX's `method_2norm` and `rng_key`.

  Raises:
    ValueError: for an unknown `norm_type` or a shape that is not a scalar,
      a vector or a square matrix.
  """
  del unused_kwargs
  return psd_solvers.psd_matrix_norm(matrix, norm_type, method_2norm="exact")
