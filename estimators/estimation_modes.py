"""Estimation modes: which loss-input tangents are backpropagated.

Every mode produces, for each registered loss, tangents with a leading
"sample" axis S. Backpropagating sample s gives per-example gradients g_si,
and the curvature estimate is `(1/batch) * sum_s sum_i g_si g_siᵀ`:

- `fisher_gradients`: one gradient of the loss at targets sampled from the
  model's predictive distribution (unbiased for the Fisher).
- `fisher_empirical`: the gradient at the data targets (empirical Fisher).
- `fisher_curvature_prop` / `ggn_curvature_prop`: the loss's Fisher / GGN
  factor times a random ±1 vector (unbiased).
- `fisher_exact` / `ggn_exact`: the factor times every one-hot vector of the
  factor's inner space, one sample each (exact).

With several losses, sampled modes add the losses' independent samples in one
backward pass (cross terms vanish in expectation); exact modes stack each
loss's one-hot samples, with zeros for the other losses.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ESTIMATION_MODES = (
  "fisher_gradients",
  "fisher_empirical",
  "fisher_curvature_prop",
  "fisher_exact",
  "ggn_curvature_prop",
  "ggn_exact",
)
# The matrices a mode can estimate, each with the mode that gives it exactly.
EXACT_MODE_OF_MATRIX = {
  "ggn": "ggn_exact",
  "fisher": "fisher_exact",
  "empirical_fisher": "fisher_empirical",
}


# Modes that read the gradient of the model function itself instead of
# backpropagating loss tangents: only `BlockDiagonalCurvature` has them.
DIRECT_ESTIMATION_MODES = (
  "fisher_empirical_direct",
  "fisher_empirical_direct_synced",
)


def check_estimation_mode(
  mode: str, valid: Sequence[str] = ESTIMATION_MODES
) -> str:
  """Checks that `mode` names an estimation mode.

  Args:
    mode: the name to check.
    valid: the modes accepted (an estimator's `valid_estimation_modes`).

  Returns:
    `mode`, unchanged.

  Raises:
    ValueError: for a name not in `valid`.
  """
  if mode not in valid:
    extra = ""
    if mode in DIRECT_ESTIMATION_MODES:
      extra = " (only BlockDiagonalCurvature has the direct modes)"
    raise ValueError(
      f"Unknown estimation mode {mode!r}{extra}; choose one of "
      f"{', '.join(valid)}."
    )
  return mode


def direct_gradient_scale(batch_size: Any, dtype: Any) -> jax.Array:
  """The factor on the gradient of the (batch-averaged) loss in the
  `fisher_empirical_direct*` modes: `sqrt(batch_size)`.

  The blocks divide the square of what they get by the batch size, so the
  estimate is `g gᵀ` (its diagonal for diagonal blocks), `g` the gradient
  of the mean loss: the statistic of Adam's and RMSProp's second moments.
  This follows KFAC-JAX after 0.0.8, which fixed 0.0.8's `g gᵀ / batch`.

  Args:
    batch_size: the number of examples the loss averages over.
    dtype: the gradient's dtype.

  Returns:
    `sqrt(batch_size)`.
  """
  return jnp.sqrt(jnp.asarray(batch_size, dtype))


def matrix_type(mode: str) -> str:
  """The matrix an estimation mode estimates.

  Args:
    mode: one of `ESTIMATION_MODES`.

  Returns:
    'fisher', 'empirical_fisher' or 'ggn'.

  Raises:
    ValueError: for an unknown mode.
  """
  check_estimation_mode(mode, ESTIMATION_MODES + DIRECT_ESTIMATION_MODES)
  if mode.startswith("fisher_empirical"):
    return "empirical_fisher"
  return mode.split("_")[0]


def exact_mode(matrix: str) -> str:
  """The estimation mode that gives a matrix exactly.

  Args:
    matrix: 'ggn', 'fisher' or 'empirical_fisher'.

  Returns:
    The mode's name, from `EXACT_MODE_OF_MATRIX`.

  Raises:
    ValueError: for any other matrix name.
  """
  if matrix not in EXACT_MODE_OF_MATRIX:
    raise ValueError(
      f"No estimation mode computes {matrix!r}; choose one of "
      f"{', '.join(EXACT_MODE_OF_MATRIX)}."
    )
  return EXACT_MODE_OF_MATRIX[matrix]


def _factor_products(loss, kind):
  if kind == "fisher":
    return loss.multiply_fisher_factor, loss.fisher_factor_inner_shape
  return loss.multiply_ggn_factor, loss.ggn_factor_inner_shape


def _one_loss_tangents(loss, mode, rng):
  if mode == "fisher_gradients":
    return tuple(g[None] for g in loss.grad_of_evaluate_on_sample(rng, "sqrt"))
  if mode == "fisher_empirical":
    if loss.targets is None:
      raise ValueError(
        f"estimation_mode='fisher_empirical' needs the data targets, but a "
        f"{type(loss).__name__} was registered without them: pass "
        "targets= to its register_* call."
      )
    return tuple(g[None] for g in loss.grad_of_evaluate(None, "regular"))
  kind = mode.split("_")[0]
  multiply_factor, inner_shape = _factor_products(loss, kind)
  inner_shape = tuple(inner_shape)
  if mode.endswith("curvature_prop"):
    v = jax.random.rademacher(rng, inner_shape, dtype=loss.dtype)
    return tuple(t[None] for t in multiply_factor(v))
  # Exact: the factor times the one-hot vector of every inner coordinate,
  # replicated over the batch.
  k = int(np.prod(inner_shape[1:], dtype=np.int64))
  one_hots = jnp.eye(k, dtype=loss.dtype).reshape((k, 1) + inner_shape[1:])
  one_hots = jnp.broadcast_to(one_hots, (k,) + inner_shape)
  return tuple(jax.vmap(multiply_factor)(one_hots))


def loss_tangents(
  losses: Sequence[Any], mode: str, rng: jax.Array
) -> tuple[tuple[jax.Array, ...], ...]:
  """The loss-input tangents to backpropagate for one estimation mode.

  Args:
    losses: the registered losses (`LossFunction`s), in tag order.
    mode: one of `ESTIMATION_MODES`.
    rng: a PRNG key for the sampled modes.

  Returns:
    One tuple per loss, with one tangent per parameter-dependent input of
    that loss, shaped `(S, *input_shape)`; S is the same for all losses.

  Raises:
    ValueError: for an unknown mode, or `fisher_empirical` on a loss
      registered without targets.
  """
  check_estimation_mode(mode)
  rngs = jax.random.split(rng, len(losses))
  per_loss = [
    _one_loss_tangents(loss, mode, r) for loss, r in zip(losses, rngs)
  ]
  if not mode.endswith("exact") or len(losses) == 1:
    return tuple(per_loss)
  sizes = [t[0].shape[0] for t in per_loss]
  total, out, offset = sum(sizes), [], 0
  for tangents, size in zip(per_loss, sizes):
    pad = ((offset, total - offset - size),)
    out.append(
      tuple(jnp.pad(t, pad + ((0, 0),) * (t.ndim - 1)) for t in tangents)
    )
    offset += size
  return tuple(out)
