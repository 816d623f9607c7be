"""`Stacked`: one block per iteration of a scan over stacked layer parameters.

Models built with `hk.experimental.layer_stack` (or any `lax.scan` over
stacked weights) apply the same layer `length` times, each time with its own
slice of the stacked parameters. Each slice is its own layer, so the
curvature is block diagonal over the slices: `Stacked` holds the state of the
wrapped block with a leading axis of size `length` and maps every hook over
that axis with `jax.vmap`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from estimators.blocks import base

# Estimation data: batched arrays lead with the layer axis, tangents with
# the sample axis and then the layer axis.
_DATA_AXIS = {
  "inputs": 0,
  "outputs": 0,
  "params": 0,
  "outputs_tangent": 1,
  "params_tangent": 1,
}


class Stacked(base.CurvatureBlock):
  """`length` independent copies of `block`, one per stacked layer.

  The state is the wrapped block's with a leading `(length,)` axis on every
  leaf, and so are block vectors; eigenvalues are those of all the layers.
  """

  def __init__(self, block: base.CurvatureBlock, length: int):
    """Wraps a block.

    Args:
      block: the block of one layer of the stack (not itself `Stacked`).
      length: the number of stacked layers.

    Raises:
      TypeError, ValueError: for another wrapper or a non-positive length.
    """
    if not isinstance(block, base.CurvatureBlock) or isinstance(block, Stacked):
      raise TypeError(
        "Stacked wraps one (non-stacked) CurvatureBlock, got "
        f"{type(block).__name__}."
      )
    if int(length) < 1:
      raise ValueError(f"Stacked needs a positive length, got {length}.")
    base_class = base.CurvatureBlock
    if (
      type(block).update_curvature_matrix_estimate
      is not base_class.update_curvature_matrix_estimate
      or type(block).update_cache is not base_class.update_cache
    ):
      # The stack maps the hooks over its layers; a block that adds work in
      # its public methods (EKFAC's basis) would silently lose it.
      raise ValueError(
        f"{type(block).__name__} (block {block.name!r}) cannot be stacked "
        "over a scanned layer: it overrides the public update methods. "
        "Use another block type for this layer (index_to_block_ctor)."
      )
    self._block = block
    self._length = int(length)
    self._REQUIRED_DATA = block._REQUIRED_DATA  # pylint: disable=invalid-name
    self._MAY_BE_SINGULAR = block._MAY_BE_SINGULAR  # pylint: disable=invalid-name
    super().__init__(block.layer_tag_eq, block.name)

  @property
  def block(self) -> base.CurvatureBlock:
    """The block of one layer of the stack."""
    return self._block

  @property
  def length(self) -> int:
    """The number of stacked layers."""
    return self._length

  def _stacked(self, shapes):
    return tuple((self._length,) + tuple(s) for s in shapes)

  @property
  def outputs_shapes(self) -> tuple[tuple[int, ...], ...]:
    return self._stacked(self._block.outputs_shapes)

  @property
  def inputs_shapes(self) -> tuple[tuple[int, ...], ...]:
    return self._stacked(self._block.inputs_shapes)

  @property
  def parameters_shapes(self) -> tuple[tuple[int, ...], ...]:
    return self._stacked(self._block.parameters_shapes)

  def _check_estimation_data(self, data, batch_size) -> None:
    per_layer = {}
    for key, values in data.items():
      axis = _DATA_AXIS.get(key)
      if axis is None or not values:
        continue
      shapes = [jnp.shape(v) for v in values]
      if any(len(s) <= axis or s[axis] != self._length for s in shapes):
        raise ValueError(
          f"Block {self.name!r}: estimation_data[{key!r}] has shapes "
          f"{shapes}; a stack of {self._length} layers needs axis {axis} of "
          f"size {self._length}."
        )
      per_layer[key] = tuple(
        jax.ShapeDtypeStruct(s[:axis] + s[axis + 1 :], jnp.result_type(v))
        for s, v in zip(shapes, values)
      )
    jax.eval_shape(
      lambda d: self._block._check_estimation_data(d, batch_size), per_layer
    )

  def _map(self, fn, *args, in_axes=0):
    return jax.vmap(fn, in_axes=in_axes)(*args)

  # --- hooks: the wrapped block's, mapped over the layer axis ---------------

  def _init(self, rng, exact_powers, approx_powers, cache_eigenvalues):
    rngs = jax.random.split(rng, self._length)
    return self._map(
      lambda r: self._block._init(
        r, exact_powers, approx_powers, cache_eigenvalues=cache_eigenvalues
      ),
      rngs,
    )

  def _batch_statistics(self, estimation_data, batch_size):
    data = {k: v for k, v in estimation_data.items() if k in _DATA_AXIS and v}
    axes = {k: _DATA_AXIS[k] for k in data}
    return self._map(
      lambda d: self._block._batch_statistics(d, batch_size),
      data,
      in_axes=(axes,),
    )

  def _fold_statistics(self, state, stats, ema_old, ema_new):
    return self._map(
      lambda s, t: self._block._fold_statistics(s, t, ema_old, ema_new),
      state,
      stats,
    )

  def _multiply_matpower_unscaled(
    self, state, vector, identity_weight, power, exact_power, use_cached
  ):
    # The wrapped block applies its own scale, per layer.
    return self._map(
      lambda s, v: self._block.multiply_matpower(
        s,
        v,
        identity_weight,
        power,
        exact_power=exact_power,
        use_cached=use_cached,
      ),
      state,
      vector,
    )

  def _eigenvalues_unscaled(self, state):
    return self.eigenvalues(state, use_cached=False)

  def _update_cache(
    self,
    state,
    identity_weight,
    exact_powers,
    approx_powers,
    eigenvalues,
    state_scale,
  ):
    del state_scale  # 1 here; the wrapped block scales each layer itself
    block = self._block
    return self._map(
      lambda s: block._update_cache(
        s,
        identity_weight / block.fixed_scale(),
        exact_powers,
        approx_powers,
        eigenvalues=eigenvalues,
        state_scale=block.state_dependent_scale(s),
      ),
      state,
    )

  def eigenvalues(
    self, state: base.CurvatureBlock.State, use_cached: bool
  ) -> jax.Array:
    """All layers' eigenvalues, layer after layer: a `(dim,)` array."""
    return self._map(
      lambda s: self._block.eigenvalues(s, use_cached=use_cached), state
    ).reshape(-1)
