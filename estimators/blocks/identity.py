"""`ScaledIdentity`: a constant `scale * I`, for layers nothing else knows."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from estimators.blocks import base, norms


class ScaledIdentity(base.CurvatureBlock):
  """Curvature `scale * I`; it learns nothing from data, its state is a cache.

  Any layer tag is accepted. With damping `λ` its powers are
  `(scale + λ) ** power` times the identity.
  """

  _MAY_BE_SINGULAR = False

  def __init__(
    self, layer_tag_eq: Any, name: str | None = None, scale: base.Numeric = 1.0
  ):
    """Builds the block.

    Args:
      layer_tag_eq: any layer tag's jaxpr equation.
      name: the block's name in messages.
      scale: the constant in front of the identity.
    """
    super().__init__(layer_tag_eq, name)
    self._scale = scale

  def fixed_scale(self) -> base.Numeric:
    """The `scale` given at construction."""
    return self._scale

  def _init(self, rng, exact_powers, approx_powers, cache_eigenvalues):
    del rng, exact_powers, approx_powers, cache_eigenvalues
    return base.CurvatureBlock.State(cache={})

  def _batch_statistics(self, estimation_data, batch_size):
    return None

  def _fold_statistics(self, state, stats, ema_old, ema_new):
    return state

  def _multiply_matpower_unscaled(
    self, state, vector, identity_weight, power, exact_power, use_cached
  ):
    if use_cached:
      factor = state.cache[base.cache_key(power, exact=exact_power)]
    else:
      weight = jnp.asarray(identity_weight, self.parameters_dtype)
      factor = jnp.power(1 + weight, power)
    return tuple(v * factor for v in vector)

  def _eigenvalues_unscaled(self, state):
    return jnp.ones([self.dim], self.parameters_dtype)

  def _norm_unscaled(self, state, norm_type):
    return norms.psd_matrix_norm(
      jnp.ones([self.dim], self.parameters_dtype), norm_type=norm_type
    )

  def _undamped_diagonal_unscaled(self, state):
    return tuple(
      jnp.ones(s, self.parameters_dtype) for s in self.parameters_shapes
    )

  def _update_cache(
    self,
    state,
    identity_weight,
    exact_powers,
    approx_powers,
    eigenvalues,
    state_scale,
  ):
    one = jnp.asarray(state_scale, self.parameters_dtype)
    updates = {
      key: jnp.power(one + identity_weight, p)
      for key, p in base.power_cache_keys(exact_powers, approx_powers)
    }
    if eigenvalues:
      updates["eigenvalues"] = one * jnp.ones([self.dim], self.parameters_dtype)
    return updates
