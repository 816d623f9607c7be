"""The optimizer's quadratic model of the loss and what it decides.

Along the update directions `V = (precon, velocity)` the loss is modelled
as `q(w) = ½ wᵀ (A + l2_reg R + λ D) w + bᵀ w` with `A = Vᵀ C V` (C the
curvature), `D = Vᵀ V` (the damping term), `R = Vᵀ L V` (L the diagonal 0/1
mask of the L2-regularised parameters) and `b = Vᵀ g`. Minimising it
chooses the learning rate and momentum (Martens & Grosse 2015, sec. 7); the
ratio of the loss change to its predicted change adapts the damping
`λ` (the Levenberg–Marquardt rule, ibid. sec. 6.5).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from estimators import utils
from estimators.utils.types import Array, Numeric, Params

# (A, D, R, b) of the module docstring.
QuadModelParams = tuple[Array, Array, Array, Array]

# Parameter names to leave out of the L2 term (for
# `regularized_parameters_path_exclusions`): Haiku's biases ("b", "bias"),
# and also its normalisation layers' scales and offsets.
HAIKU_BIASES = "b,bias"
HAIKU_BIASES_AND_NORMS = "b,bias,scale,offset"


def parse_exclusions(exclusions: str | None) -> tuple[str, ...]:
  """The names in a comma-separated exclusion list (empty names dropped;
  None: none)."""
  if exclusions is None:
    return ()
  if not isinstance(exclusions, str):
    raise TypeError(
      "regularized_parameters_path_exclusions must be a comma-separated "
      f"string such as 'b,bias'; got {type(exclusions).__name__}."
    )
  return tuple(name.strip() for name in exclusions.split(",") if name.strip())


def _path_names(path: Sequence[Any]) -> list[str]:
  names = []
  for key in path:
    if isinstance(key, jax.tree_util.DictKey):
      names.append(str(key.key))
    elif isinstance(key, jax.tree_util.GetAttrKey):
      names.append(key.name)
  return names


def is_excluded(path: Sequence[Any], exclusions: Sequence[str]) -> bool:
  """Whether a parameter's tree path has a dict key or attribute name that
  is one of `exclusions` (so it is not L2-regularised)."""
  names = _path_names(path)
  return any(name in names for name in exclusions)


def mask_unregularized(params: Params, exclusions: Sequence[str]) -> Params:
  """`params` with the excluded parameters (see `is_excluded`) zeroed."""
  if not exclusions:
    return params
  return jax.tree_util.tree_map_with_path(
    lambda path, x: jnp.zeros_like(x) if is_excluded(path, exclusions) else x,
    params,
  )


def solve_coefficients(
  damped_quad: Array,
  linear: Array,
  neg_learning_rate: Numeric | None,
  momentum: Numeric | None,
  first_step: Array | bool,
) -> Array:
  """`w = (α, μ)` minimising `½ wᵀ Q w + bᵀ w`, the given entries fixed.

  Args:
    damped_quad: the `(2, 2)` matrix `Q = A + l2_reg R + λ D`.
    linear: `b`, shape `(2,)`.
    neg_learning_rate: `α` (minus the learning rate), or None to solve.
    momentum: `μ`, or None to solve.
    first_step: on the first step the velocity is zero, so `μ` is 0.

  Returns:
    The coefficients, shape `(2,)`.
  """
  dtype = damped_quad.dtype
  if neg_learning_rate is None and momentum is None:
    (a, b), (c, d) = damped_quad
    rhs = -linear
    det = a * d - b * c
    # Cramer's rule: a LAPACK solve would cost more than the whole model.
    solved = jnp.stack([d * rhs[0] - b * rhs[1], a * rhs[1] - c * rhs[0]]) / det
    only_lr = -linear[0] / damped_quad[0, 0]
    # Where the two directions are parallel under Q, `det` is lost to
    # rounding (it cancels to within eps * a * d) and the 2x2 solution is
    # noise; the model then varies along one line, whose minimum the
    # learning rate alone reaches. Below sqrt(eps) of `a * d`, at least
    # half of `det`'s digits are rounding.
    parallel = det <= jnp.sqrt(jnp.finfo(dtype).eps) * a * d
    return jnp.where(
      first_step | parallel, jnp.array([only_lr, 0.0], dtype), solved
    )
  alpha: Any = neg_learning_rate
  mu: Any = None if momentum is None else jnp.where(first_step, 0.0, momentum)
  if alpha is None:  # momentum fixed, learning rate solved
    alpha = -(linear[0] + damped_quad[0, 1] * mu) / damped_quad[0, 0]
  if mu is None:  # learning rate fixed, momentum solved
    mu = jnp.where(
      first_step,
      0.0,
      -(linear[1] + damped_quad[1, 0] * alpha) / damped_quad[1, 1],
    )
  return jnp.stack([jnp.asarray(alpha, dtype), jnp.asarray(mu, dtype)])


def coefficients_and_change(
  terms: QuadModelParams,
  l2_reg: Numeric,
  damping: Numeric,
  neg_learning_rate: Numeric | None,
  momentum: Numeric | None,
  first_step: Array | bool,
  include_damping_in_change: bool,
) -> tuple[Array, Array]:
  """The coefficients `w` (`solve_coefficients`) and the model's change.

  Args:
    terms: `(A, D, R, b)`.
    l2_reg: the L2 coefficient.
    damping: `λ`.
    neg_learning_rate: `α`, or None to solve for it.
    momentum: `μ`, or None to solve for it.
    first_step: whether the velocity is still zero.
    include_damping_in_change: whether the change counts `λ D` (the L2
      term always counts).

  Returns:
    `w` and `q(w)`.
  """
  curv, gram, regularized, linear = terms
  quad = curv + l2_reg * regularized
  damped = quad + damping * gram
  coefficients = solve_coefficients(
    damped, linear, neg_learning_rate, momentum, first_step
  )
  used = damped if include_damping_in_change else quad
  return coefficients, model_change(used, linear, coefficients)


def model_change(quad: Array, linear: Array, coefficients: Array) -> Array:
  """`q(w) = ½ wᵀ Q w + bᵀ w`, the predicted change of the loss."""
  return 0.5 * coefficients @ quad @ coefficients + coefficients @ linear


def adapt_damping(
  damping: Array,
  rho: Array,
  decay_factor: Numeric,
  lower_threshold: Numeric,
  upper_threshold: Numeric,
  min_damping: Numeric,
  max_damping: Numeric,
) -> Array:
  """The Levenberg–Marquardt rule: divide the damping by `decay_factor`
  when `rho < lower_threshold` (a NaN `rho` counts as that), multiply it
  when `rho > upper_threshold`, then clip to `[min_damping, max_damping]`."""
  rho = jnp.nan_to_num(rho, nan=-100.0)
  new = jnp.where(
    rho < lower_threshold,
    damping / decay_factor,
    jnp.where(rho > upper_threshold, damping * decay_factor, damping),
  )
  return jnp.clip(new, min_damping, max_damping).astype(damping.dtype)


def gram_and_linear(
  vectors: Sequence[Params], grads: Params
) -> tuple[Array, Array]:
  """`(D, b) = (vᵢᵀ vⱼ, gᵀ vᵢ)` from one Gram matrix of vectors and grads."""
  n = len(vectors)
  gram = utils.gram_matrix([*vectors, grads])
  return gram[:n, :n], gram[:n, n]


def curvature_gram(
  losses: Sequence[Any],
  jvp: Callable[[Params], Any],
  vectors: Sequence[Params],
  matrix_type: str,
) -> Array:
  """`vᵢᵀ Jᵀ M J vⱼ` summed over the batch: `J` the Jacobian of the losses'
  inputs (`jvp` pushes a vector through it), `M` each loss's GGN or Fisher
  (`matrix_type` 'ggn' or 'fisher'); divide by the batch size for `A`."""
  # Pushing the vectors one at a time keeps them apart: stacking them for a
  # vmap would copy every parameter twice.
  tangents = [jvp(v) for v in vectors]
  multiplies = [
    loss.multiply_ggn if matrix_type == "ggn" else loss.multiply_fisher
    for loss in losses
  ]
  products = [
    [multiply(tuple(t)) for multiply, t in zip(multiplies, ts)]
    for ts in tangents
  ]
  return utils.gram_matrix(tangents, products)
