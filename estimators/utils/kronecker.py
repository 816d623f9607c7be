"""Products with Kronecker-factored matrices and their damping.

Conventions: `rvec` flattens a tensor row-major, so `kron(f_1, ..., f_n)
rvec(v)` contracts factor `f_i` with the `i`-th axis (or group of axes) of
`v`. A factor may be a square matrix, a vector (a diagonal matrix) or a
scalar (a 1 x 1 matrix) where the docstring says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from estimators.utils.psd_solvers import (
  get_special_case_zero_inv,
  invert_psd_matrices,
  psd_matrix_norm,
)


def _axis_groups(v: jax.Array, axis_groups) -> tuple[tuple[int, ...], ...]:
  if axis_groups is None:
    return tuple((i,) for i in range(v.ndim))
  groups = tuple(tuple(int(a) for a in g) for g in axis_groups)
  if sum(groups, ()) != tuple(range(v.ndim)):
    raise ValueError(
      f"axis_groups {groups} must list the axes 0..{v.ndim - 1} of `v` in "
      "order, each once, in groups of consecutive axes."
    )
  return groups


def kronecker_product_axis_mul_v(
  factors: Sequence[jax.Array | None],
  v: jax.Array,
  axis_groups: Sequence[Sequence[int]] | None = None,
  transpose: bool | Sequence[bool] = False,
) -> jax.Array:
  """`kron(*factors) rvec(v)`, shaped like `v`.

  Args:
    factors: square matrices, or None for an identity; factor `i` acts on
      the axes `axis_groups[i]` of `v` (flattened together).
    v: the tensor to multiply.
    axis_groups: consecutive groups of axes of `v`, one per factor; None
      means one axis per factor.
    transpose: whether to use each factor's transpose (one flag for all, or
      one per factor).

  Returns:
    The product, with the shape of `v`.

  Raises:
    ValueError: if the groups do not cover the axes of `v` in order, or
      their number, or that of the transpose flags, is not that of the
      factors.
  """
  groups = _axis_groups(v, axis_groups)
  if len(factors) != len(groups):
    raise ValueError(
      f"{len(factors)} factors for {len(groups)} axis groups: pass one "
      "factor per group."
    )
  flags = (
    [transpose] * len(factors) if isinstance(transpose, bool) else transpose
  )
  if len(flags) != len(factors):
    raise ValueError(
      f"{len(flags)} transpose flags for {len(factors)} factors: pass one "
      "flag, or one per factor."
    )
  result = v
  for group, factor, flag in zip(groups, factors, flags):
    if factor is None:
      continue
    first, last = group[0], group[-1]
    merged = result.reshape(v.shape[:first] + (-1,) + v.shape[last + 1 :])
    matrix = factor.T if flag else factor
    # Contract the merged axis with the factor's columns, then put the new
    # axis back where it was.
    product = jnp.moveaxis(
      jnp.tensordot(matrix, merged, ((1,), (first,))), 0, first
    )
    result = product.reshape(v.shape)
  return result


def kronecker_eigen_basis_axis_mul_v(
  q_factors: Sequence[jax.Array],
  eigenvalues: jax.Array,
  v: jax.Array,
  axis_groups: Sequence[Sequence[int]] | None = None,
) -> jax.Array:
  """`Q diag(rvec(eigenvalues)) Qᵀ rvec(v)` with `Q = kron(*q_factors)`.

  Args:
    q_factors: square matrices (for instance each factor's eigenvectors).
    eigenvalues: the diagonal in the basis `Q`, shaped like `v`.
    v: the tensor to multiply.
    axis_groups: as for `kronecker_product_axis_mul_v`.

  Returns:
    The product, with the shape of `v`.

  Raises:
    ValueError: if `eigenvalues` is not shaped like `v`.
  """
  projected = kronecker_product_axis_mul_v(q_factors, v, axis_groups, True)
  if eigenvalues.shape != projected.shape:
    raise ValueError(
      f"eigenvalues of shape {eigenvalues.shape} for a tensor of shape "
      f"{projected.shape}: they must have the same shape."
    )
  return kronecker_product_axis_mul_v(
    q_factors, eigenvalues * projected, axis_groups
  )


def kronecker_product_mul_v(
  a: jax.Array, b: jax.Array, v: jax.Array, a_is_symmetric: bool
) -> jax.Array:
  """`unvec((a ⊗ b) vec(v)) = b v aᵀ`, `vec` stacking columns.

  `a_is_symmetric` is accepted for KFAC-JAX's signature; the product does
  not need it.
  """
  del a_is_symmetric
  return kronecker_product_axis_mul_v([b, a], v)


def kronecker_eigen_basis_mul_v(
  q_a: jax.Array, q_b: jax.Array, eigenvalues: jax.Array, v: jax.Array
) -> jax.Array:
  """`unvec((q_a ⊗ q_b) diag(vec(eigenvalues)) (q_a ⊗ q_b)ᵀ vec(v))`, `vec`
  stacking columns; `eigenvalues` is shaped like `v`."""
  return kronecker_eigen_basis_axis_mul_v([q_b, q_a], eigenvalues, v)


def _scaled_identity_like(factor: jax.Array, scale: Any) -> jax.Array:
  if factor.ndim == 2:
    return scale * jnp.eye(factor.shape[0], dtype=factor.dtype)
  return scale * jnp.ones_like(factor)


def pi_adjusted_kronecker_factors(
  *factors: jax.Array, damping: Any
) -> tuple[jax.Array, ...]:
  """Factors whose Kronecker product approximates `kron(*factors) + damping
  I`, by factored Tikhonov damping.

  Each factor is written `c_i u_i` with `avg_diag(u_i) = 1`; the scales'
  geometric mean `c` multiplies every returned factor, and the damping is
  shared equally: `c (u_i + damping^(1/k) / c I)` for `k` factors, so for
  two factors the split is that of the pi-adjusted damping of Martens &
  Grosse (2015, sec. 6.3). Scalar factors (size 1) get no damping and the
  others share it; when every factor is a scalar each becomes `(prod c_i +
  damping)^(1/k)`. With `get_special_case_zero_inv()` a factor of zero
  norm makes every factor `damping^(1/k) I`.

  Args:
    *factors: PSD square matrices, vectors (diagonals) or scalars.
    damping: the weight of the identity to add to the product.

  Returns:
    The damped factors, in the inputs' representations.
  """
  norms = jnp.array([psd_matrix_norm(f, norm_type="avg_diag") for f in factors])
  k = len(factors)
  num_non_scalars = sum(1 for f in factors if f.size != 1)

  def regular() -> tuple[jax.Array, ...]:
    units = [f / n for f, n in zip(factors, norms)]
    share: Any
    if num_non_scalars == 0:
      scale = jnp.power(jnp.prod(norms) + damping, 1.0 / k)
      share = 0.0
    else:
      # The geometric mean from the mean log: a product of many small norms
      # would underflow.
      scale = jnp.exp(jnp.mean(jnp.log(norms)))
      # Only the non-scalar factors take damping, so those carry the
      # scalars' share of `scale` too.
      share = jnp.power(damping, 1.0 / num_non_scalars) / scale ** (
        k / num_non_scalars
      )
    damped = []
    for u in units:
      if u.size == 1:
        damped.append(jnp.ones_like(u) * scale)
      else:
        damped.append((u + _scaled_identity_like(u, share)) * scale)
    return tuple(damped)

  def zero() -> tuple[jax.Array, ...]:
    root = jnp.power(damping, 1.0 / k)
    return tuple(_scaled_identity_like(f, root) for f in factors)

  if get_special_case_zero_inv():
    return jax.lax.cond(jnp.min(norms) > 0, regular, zero)
  return regular()


def pi_adjusted_kronecker_inverse(
  *factors: jax.Array, damping: Any
) -> tuple[jax.Array, ...]:
  """The inverses of `pi_adjusted_kronecker_factors(*factors,
  damping=damping)`, whose Kronecker product approximates the inverse of
  `kron(*factors) + damping I`."""
  return invert_psd_matrices(
    pi_adjusted_kronecker_factors(*factors, damping=damping)
  )


def tnt_scale(factors: Sequence[jax.Array]) -> Any:
  """The scale of a TNT factorization: `g^-(k-1)` for `k` factors and `g`
  the geometric mean of their traces (1 for one factor, and `g = 1` when a
  trace is not positive). Ren & Goldfarb, "Tensor normal training for deep
  learning models" (2021)."""
  if len(factors) == 1:
    return 1.0
  traces = jnp.asarray([jnp.trace(f) for f in factors])
  positive = jnp.min(traces) > 0
  mean_log = jnp.where(
    positive, jnp.mean(jnp.log(jnp.where(positive, traces, 1.0))), 0.0
  )
  return jnp.exp(-(len(factors) - 1) * mean_log)
