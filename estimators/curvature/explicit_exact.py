"""The whole curvature as one dense block, from per-example gradients."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np

from estimators import blocks as curvature_blocks
from estimators import estimation_modes, tags, tracer
from estimators.blocks.base import Numeric, ScalarOrSequence
from estimators.curvature.base import (
  CurvatureBlockCtor,
  build_block,
  check_params_tree,
  update_block_estimate,
)
from estimators.curvature.block_diagonal import (
  BlockDiagonalCurvature,
  BlockDiagonalState,
)
from estimators.utils.tree_math import default_batch_size_extractor
from estimators.utils.types import FuncArgs


class ExplicitExactCurvature(BlockDiagonalCurvature):
  """The whole curvature as one block over every parameter, estimated from
  per-example gradients.

  Each example's gradient rows for the estimation mode (one per sample) are
  formed separately (a vmap over the batch, where the reference loops), so
  with `fisher_exact` or `ggn_exact` the estimate is the exact matrix, cross-
  layer terms included. By default the block is an `ExplicitFull` (a dense
  `(dim, dim)` matrix, memory `dim²`, which keeps the latest batch's rows for
  a fast spectrum); `layer_tag_to_block_ctor={"generic_tag": ...}` or
  `index_to_block_ctor` with all parameter indices picks another block for
  the rows (e.g. `NaiveDiagonal`: the exact diagonal). The state is a
  `BlockDiagonalCurvature.State` with that one block's state, and the
  block-diagonal introspection (`blocks`, `block_dims`, ...) describes it.
  """

  def __init__(
    self,
    func: Callable | None = None,
    func_and_grad: Callable | None = None,
    default_estimation_mode: str | None = None,
    layer_tag_to_block_ctor: Mapping[str, CurvatureBlockCtor] | None = None,
    auto_register_tags: bool = False,
    param_order: Sequence[int] | None = None,
    *,
    params_index: int = 0,
    batch_index: int = 1,
    index_to_block_ctor: Mapping[tuple[int, ...], CurvatureBlockCtor]
    | None = None,
    **auto_register_kwargs,
  ):
    """Prepares the per-example tracing of `func`.

    Args:
      func: the model function, with at least one registered loss. Give it
        or `func_and_grad`.
      params_index: which of `func`'s positional arguments are the
        parameters.
      batch_index: which of them is the batch, whose leading axis is split
        into examples.
      default_estimation_mode: one of `estimators.ESTIMATION_MODES`; None
        means "ggn_curvature_prop", as in KFAC-JAX 0.0.8.
      layer_tag_to_block_ctor: the block of all parameters under the key
        "generic_tag" (default `ExplicitFull`).
      index_to_block_ctor: the same, keyed by all parameters' flat indices.
      auto_register_tags: whether the graph matcher tags the model's layers
        when it is traced (to check it; the estimate does not use them).
      func_and_grad: instead of `func`, a function returning `(value,
        gradient)`.
      param_order: the order of the parameters' leaves (flat indices, a
        permutation) in the one block, and so in the rows and columns of
        `to_dense_matrix` and `to_diagonal_block_dense_matrix`; None keeps
        the leaves' order.
      **auto_register_kwargs: passed to the graph matcher.

    Raises:
      ValueError: for an unknown estimation mode.
    """
    if (
      auto_register_kwargs.get("fisher_empirical_normalization", "batch")
      != "batch"
    ):
      raise ValueError(
        "ExplicitExactCurvature's empirical Fisher is always the mean of "
        "per-example outer products, as KFAC-JAX's is: leave out "
        "fisher_empirical_normalization (BlockDiagonalCurvature takes it)."
      )
    if not auto_register_tags:
      # The one block covers every parameter: layer tags are not needed.
      auto_register_kwargs.setdefault("allow_left_out_params", True)
    super().__init__(
      func,
      func_and_grad,
      default_estimation_mode,
      layer_tag_to_block_ctor,
      index_to_block_ctor,
      auto_register_tags,
      params_index=params_index,
      batch_index=batch_index,
      **auto_register_kwargs,
    )
    self._dense_param_order = (
      None if param_order is None else tuple(int(i) for i in param_order)
    )
    self._loss_vjp = tracer.loss_tags_vjp(self.func, params_index)

  @property
  def valid_estimation_modes(self) -> tuple[str, ...]:
    """`ESTIMATION_MODES` (the direct modes need layer blocks)."""
    return estimation_modes.ESTIMATION_MODES

  def layer_tag_to_block_ctor(self, layer_tag_eq: Any) -> CurvatureBlockCtor:
    """The block class of all parameters: the user's for "generic_tag", else
    `ExplicitFull`."""
    name = layer_tag_eq.primitive.name
    return (
      self._layer_tag_to_block_ctor.get(name) or curvature_blocks.ExplicitFull
    )

  def _finalize(self, func_args):
    func_args = tuple(func_args)
    if self._blocks is not None:
      check_params_tree(
        self._params_tree, func_args[self.params_index], "params argument"
      )
      return
    if not 0 <= self.batch_index < len(func_args):
      raise ValueError(
        f"batch_index={self.batch_index} but the function "
        f"takes {len(func_args)} arguments."
      )
    jaxpr = self._traced.processed(func_args)  # checks the registration
    leaves = jax.tree.leaves(func_args[self.params_index])
    indices = tuple(range(len(leaves)))
    if self._dense_param_order is not None:
      if sorted(self._dense_param_order) != list(indices):
        raise ValueError(
          f"param_order={self._dense_param_order} is not a permutation of "
          f"the {len(leaves)} parameter leaves' indices."
        )
      indices = self._dense_param_order
    # One generic tag over every parameter: the equation the block reads.
    tag_eqn = jax.make_jaxpr(lambda *p: tags.register_generic(*p))(
      *[leaves[i] for i in indices]
    ).eqns[0]
    ctor = self.index_to_block_ctor(indices) or self.layer_tag_to_block_ctor(
      tag_eqn
    )
    try:
      block = build_block(ctor, tag_eqn, "all parameters [generic_tag]")
    except (ValueError, TypeError, NotImplementedError) as e:
      raise ValueError(
        f"Cannot build a {getattr(ctor, '__name__', ctor)} "
        f"block over all parameters: {e}"
      ) from e
    self._jaxpr = jaxpr
    self._set_structure(
      (block,),
      jaxpr.params_tree,
      [v.aval for v in jaxpr.params_vars_flat],
      [indices],
    )

  def init(
    self,
    rng: jax.Array,
    func_args: FuncArgs,
    exact_powers_to_cache: ScalarOrSequence = None,
    approx_powers_to_cache: ScalarOrSequence = None,
    cache_eigenvalues: bool = False,
  ) -> BlockDiagonalState:
    """As `BlockDiagonalCurvature.init`; an `ExplicitFull` block gets room
    for the rows of a batch like `func_args`' in the default mode."""
    state = super().init(
      rng,
      func_args,
      exact_powers_to_cache,
      approx_powers_to_cache,
      cache_eigenvalues,
    )
    block = self._require_finalized()[0]
    if not isinstance(block, curvature_blocks.ExplicitFull):
      return state
    rows = jax.eval_shape(
      lambda: self._per_example_rows(
        jax.random.PRNGKey(0), tuple(func_args), self.default_estimation_mode
      )
    ).shape[0]
    return self.State((block.with_factor_rows(state.blocks_states[0], rows),))

  def _per_example_rows(self, rng, func_args, mode):
    """Every example's gradient rows for `mode`, `(examples * samples, dim)`
    in `ravel_pytree` order."""
    batch = func_args[self.batch_index]
    num = default_batch_size_extractor(batch)

    def one_example(example, key):
      args = list(func_args)
      args[self.batch_index] = jax.tree.map(lambda x: x[None], example)
      losses, vjp = self._loss_vjp(tuple(args))
      tangents = estimation_modes.loss_tangents(losses, mode, key)
      grads = jax.vmap(vjp)(tangents)
      return jax.vmap(lambda g: jax.flatten_util.ravel_pytree(g)[0])(grads)

    rows = jax.vmap(one_example)(batch, jax.random.split(rng, num))
    return rows.reshape((-1, rows.shape[-1]))

  def update_curvature_matrix_estimate(
    self,
    state: BlockDiagonalState,
    ema_old: Numeric,
    ema_new: Numeric,
    batch_size: Numeric,
    rng: jax.Array,
    func_args: FuncArgs,
    pmap_axis_name: str | None = None,
    estimation_mode: str | None = None,
    identity_weight: Numeric | None = None,
  ) -> BlockDiagonalState:
    """As `CurvatureEstimator`'s: the block sees every example's rows as
    samples, averaged over `batch_size`."""
    del identity_weight  # the estimates do not depend on the damping
    func_args = tuple(func_args)
    self._finalize(func_args)
    rows = self._per_example_rows(rng, func_args, self._mode(estimation_mode))
    split = np.cumsum(self._param_sizes)[:-1]
    parts = [
      part.reshape((rows.shape[0],) + shape)
      for part, shape in zip(jnp.split(rows, split, axis=1), self._param_shapes)
    ]
    data = dict(params_tangent=tuple(parts[i] for i in self._layer_indices[0]))
    return self.State(
      (
        update_block_estimate(
          self._require_finalized()[0],
          state.blocks_states[0],
          data,
          ema_old,
          ema_new,
          batch_size,
          pmap_axis_name,
        ),
      )
    )

  def eigenvalues(
    self, state: BlockDiagonalState, use_cached: bool = False
  ) -> jax.Array:
    """The block's eigenvalues (ascending for `ExplicitFull`; see its Gram
    route, which needs a concrete state)."""
    return self.block_eigenvalues(state, use_cached=use_cached)[0]

  def to_dense_matrix(
    self,
    state: BlockDiagonalState,
    use_cached: bool = False,
    identity_weight: Numeric | Sequence[Numeric] = 0.0,
    exact_power: bool = True,
    power: float = 1,
  ) -> jax.Array:
    """As `BlockDiagonalCurvature.to_dense_matrix`; the estimate itself,
    without products, for an `ExplicitFull` block and the defaults."""
    block_state = state.blocks_states[0]
    if self._dense_param_order is not None:
      # In the block's (param_order's) order.
      return self.to_diagonal_block_dense_matrix(state)[0]
    if (
      isinstance(self._require_finalized()[0], curvature_blocks.ExplicitFull)
      and not use_cached
      and power == 1
      and isinstance(identity_weight, (int, float))
      and identity_weight == 0
    ):
      return block_state.matrix.value
    return super().to_dense_matrix(
      state, use_cached, identity_weight, exact_power, power
    )

  def to_diagonal_block_dense_matrix(
    self, state: BlockDiagonalState
  ) -> tuple[jax.Array, ...]:
    """The one block, rows in `param_order`'s order (the leaves' order by
    default)."""
    block = self._require_finalized()[0]
    return (block.to_dense_matrix(state.blocks_states[0]),)
