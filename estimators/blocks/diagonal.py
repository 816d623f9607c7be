"""Diagonal blocks: keep only the diagonal of the curvature, per parameter."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from estimators import utils
from estimators.blocks import base, layers, norms


class Diagonal(base.CurvatureBlock):
  """The diagonal of the curvature, one moving average per parameter.

  A batch contributes `(1/B) sum_rows g ⊙ g`, `g` the per-example (and
  per-sample) parameter gradients. Powers are elementwise, so exact and
  approximate powers coincide. Layer subclasses provide
  `_per_example_gradients` (or override `_batch_statistics`).
  """

  @jax.tree_util.register_dataclass
  @dataclasses.dataclass(frozen=True)
  class State(base.CurvatureBlock.State):
    """Diagonal block state.

    Attributes:
      diagonal_factors: one WeightedMovingAverage per parameter, shaped like
        it, holding the estimated diagonal.
    """

    diagonal_factors: tuple[utils.WeightedMovingAverage, ...]

  if TYPE_CHECKING:
    # Given by the layer mixin a concrete block puts first (`layers`,
    # `embedding`): one `(rows, *shape)` array of gradients per parameter.
    def _per_example_gradients(self, data) -> tuple[jax.Array, ...]: ...

  def _init(self, rng, exact_powers, approx_powers, cache_eigenvalues):
    del rng, exact_powers, approx_powers, cache_eigenvalues
    return Diagonal.State(
      cache={},
      diagonal_factors=tuple(
        utils.WeightedMovingAverage.zeros(s, self.parameters_dtype)
        for s in self.parameters_shapes
      ),
    )

  def _batch_statistics(self, estimation_data, batch_size):
    grads = self._per_example_gradients(estimation_data)
    return tuple(jnp.sum(g * g, axis=0) / batch_size for g in grads)

  def _fold_statistics(self, state, stats, ema_old, ema_new):
    return dataclasses.replace(
      state,
      diagonal_factors=tuple(
        f.updated(s, ema_old, ema_new)
        for f, s in zip(state.diagonal_factors, stats)
      ),
    )

  def _powers(self, state, identity_weight, power, scale=1):
    return tuple(
      jnp.power(scale * f.value + identity_weight, power)
      for f in state.diagonal_factors
    )

  def _multiply_matpower_unscaled(
    self, state, vector, identity_weight, power, exact_power, use_cached
  ):
    if use_cached:
      factors = state.cache[base.cache_key(power, exact=exact_power)]
    else:
      factors = self._powers(state, identity_weight, power)
    return tuple(v * f for v, f in zip(vector, factors))

  def _eigenvalues_unscaled(self, state):
    return utils.flatten_arrays([f.value for f in state.diagonal_factors])

  def _norm_unscaled(self, state, norm_type):
    return utils.product(
      norms.psd_matrix_norm(f.value.ravel(), norm_type=norm_type)
      for f in state.diagonal_factors
    )

  def _undamped_diagonal_unscaled(self, state):
    return tuple(f.value for f in state.diagonal_factors)

  def _update_cache(
    self,
    state,
    identity_weight,
    exact_powers,
    approx_powers,
    eigenvalues,
    state_scale,
  ):
    updates = {
      key: self._powers(state, identity_weight, p, state_scale)
      for key, p in base.power_cache_keys(exact_powers, approx_powers)
    }
    if eigenvalues:
      updates["eigenvalues"] = state_scale * self._eigenvalues_unscaled(state)
    return updates


class NaiveDiagonal(Diagonal):
  """Diagonal of `(1/B) sum_s p_s p_sᵀ`, `p_s` the batch-summed gradient.

  It only needs the parameter gradients, so it works for any tag. This is an
  unbiased estimate of the curvature diagonal only for the sampled Fisher
  (`fisher_gradients`-style estimation, where cross-example terms vanish in
  expectation); for exact modes it is not the per-example diagonal.
  """

  _REQUIRED_DATA = ("params_tangent",)

  def _batch_statistics(self, estimation_data, batch_size):
    return tuple(
      jnp.sum(p * p, axis=0) / batch_size
      for p in estimation_data["params_tangent"]
    )


class DenseDiagonal(layers.DenseMixin, Diagonal):
  """Exact per-example diagonal for dense (and repeated dense) layers."""

  def _batch_statistics(self, estimation_data, batch_size):
    (x,), (dy,) = estimation_data["inputs"], estimation_data["outputs_tangent"]
    if x.ndim != 2:  # repeated dense: the per-example sums do not factor
      return super()._batch_statistics(estimation_data, batch_size)
    dy2 = jnp.sum(dy * dy, axis=0)  # samples add up: sum_s dy_si^2
    stats = [self.weight_from_matrix((x * x).T @ dy2 / batch_size)]
    if self.has_bias:
      stats.append(
        jnp.sum(dy2, axis=0).reshape(self.parameters_shapes[1]) / batch_size
      )
    return tuple(stats)


class Conv2DDiagonal(layers.PerExampleConv2DMixin, Diagonal):
  """Exact per-example diagonal for 2-D convolutions.

  Per-example kernel gradients come from the convolution's VJP, vmapped over
  at most `max_elements_for_vmap` examples at a time (default
  `get_max_parallel_elements()`) and looped over the rest.
  """

  def conv2d_tangent_squared(
    self, image_features_map: jax.Array, output_tangent: jax.Array
  ) -> jax.Array:
    """The squared kernel gradient of one example (KFAC-JAX's helper).

    Args:
      image_features_map: one example's input, without the batch axis.
      output_tangent: the tangent of that example's output, without the
        batch axis.

    Returns:
      The elementwise square of the kernel gradient, in the kernel's shape
      (the bias is left out, as in KFAC-JAX).
    """
    grads = self._single_example_gradients(image_features_map, output_tangent)
    return jnp.square(grads[0])


class ScaleAndShiftDiagonal(layers.ScaleAndShiftMixin, Diagonal):
  """Exact per-example diagonal for scale-and-shift layers."""
