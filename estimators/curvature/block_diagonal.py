"""The block-diagonal estimator: one curvature block per layer tag."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeAlias, cast

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np

from estimators import blocks as curvature_blocks
from estimators import estimation_modes, graph_matcher, tracer, utils
from estimators.blocks.base import Numeric, ScalarOrSequence
from estimators.curvature.base import (
  CurvatureBlockCtor,
  CurvatureEstimator,
  build_block,
  canonical_tag_name,
  check_params_tree,
  get_default_tag_to_block_ctor,
  powers_tuple,
  update_block_estimate,
)
from estimators.utils import distributed, newton
from estimators.utils.types import FuncArgs, Params

_LOG = logging.getLogger(__name__)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockDiagonalState:
  """State of a `BlockDiagonalCurvature`.

  Attributes:
    blocks_states: one `CurvatureBlock.State` per block, in `blocks` order.
    synced: whether the statistics are known to agree across devices: True
      after `init` and `sync`, False after an estimate update (keyword-only;
      the cache is never synchronised).
  """

  blocks_states: tuple
  synced: jax.Array = dataclasses.field(
    default_factory=lambda: jnp.asarray(True), kw_only=True
  )


class _OuterSumBlock(Protocol):
  """What a block whose `outer_sum_is_cheaper()` is True offers."""

  def multiply_inverse_outer_sum(
    self,
    state: Any,
    inputs: Sequence[jax.Array],
    outputs_cotangent: Sequence[jax.Array],
  ) -> tuple[jax.Array, ...]: ...


def _block_name(paths, indices, tag_name):
  keys = [jax.tree_util.keystr(paths[i]) for i in indices]
  return f"{keys[0] if len(keys) == 1 else ','.join(keys)} [{tag_name}]"


# The modes that draw random samples, which `num_samples` repeats.
SAMPLED_MODES = (
  "fisher_gradients",
  "fisher_curvature_prop",
  "ggn_curvature_prop",
)
# How `update_cache` raises damped matrices to approximate powers.
MATRIX_POWER_METHODS = ("decomposition", "newton")
# With 'newton', every block's cache holds this flag: whether the iteration
# failed at some refresh (`BlockDiagonalCurvature.newton_failures`).
NEWTON_FAILED = "newton_failed"


class BlockDiagonalCurvature(CurvatureEstimator):
  """One curvature block per layer tag; the blocks form a block diagonal.

  The blocks are built on the first `init` from the traced model: each layer
  tag (registered by hand or found by the graph matcher) gets the block
  class that `index_to_block_ctor`, then `layer_tag_to_block_ctor`, names.
  Cross-layer curvature is dropped.
  """

  State: TypeAlias = BlockDiagonalState

  def __init__(
    self,
    func: Callable | None = None,
    func_and_grad: Callable | None = None,
    default_estimation_mode: str | None = None,
    layer_tag_to_block_ctor: Mapping[str, CurvatureBlockCtor] | None = None,
    index_to_block_ctor: Mapping[tuple[int, ...], CurvatureBlockCtor]
    | None = None,
    auto_register_tags: bool = True,
    distributed_multiplies: bool = True,
    distributed_cache_updates: bool = True,
    num_samples: int = 1,
    should_vmap_samples: bool = False,
    auto_register_kwargs: Mapping[str, Any] | None = None,
    *,
    params_index: int = 0,
    batch_index: int = 1,
    matrix_power_method: str = "decomposition",
    newton_max_iterations: int = newton.DEFAULT_MAX_ITERATIONS,
    fisher_empirical_normalization: str = "batch_squared",
    **kwargs,
  ):
    """Prepares the tracing of `func`; blocks are built by `init`.

    Args:
      func: the model function, with at least one registered loss,
        returning only the loss value (averaged over the batch for the
        `fisher_empirical_direct*` modes). Give it or `func_and_grad`.
      params_index: which of `func`'s positional arguments are the
        parameters.
      default_estimation_mode: one of `estimators.ESTIMATION_MODES`; None
        means "ggn_curvature_prop", as in KFAC-JAX 0.0.8.
      layer_tag_to_block_ctor: block constructors by tag name (e.g.
        "dense_tag"), overriding `get_default_tag_to_block_ctor`.
      index_to_block_ctor: block constructors for the tags whose parameters
        have these flat indices; they take precedence over the above.
      auto_register_tags: whether to tag layers with the graph matcher;
        otherwise only hand-registered tags are used.
      distributed_multiplies: with a `pmap_axis_name`, each device computes
        the products of its share of the blocks (balanced by estimated
        cost) and the results are summed across devices; otherwise every
        device computes every block.
      distributed_cache_updates: the same for `update_cache`.
      matrix_power_method: how `update_cache` raises damped matrices to
        approximate powers: 'decomposition' (Cholesky for inverses,
        eigendecompositions otherwise) or 'newton' (the coupled Newton
        iteration of `utils.newton`, matrix products only, equal-size
        matrices stacked, all in one loop; powers -1/p only). Exact powers
        and eigenbases always use eigendecompositions.
      newton_max_iterations: the most Newton steps; a matrix that needs
        more (singular or too badly conditioned: too little damping) gets a
        NaN power, and its block is named by `newton_failures`.
      fisher_empirical_normalization: in `fisher_empirical` mode, what the
        blocks' second moments of the per-example loss gradients `d_i` are
        divided by. 'batch_squared' (KFAC-JAX's block-diagonal estimator):
        `B²`, since the gradient of the mean loss is `(1/B) sum_i d_i`; a
        block then estimates `(1/B) mean_i d_i d_iᵀ`. 'batch': `B`, the mean
        of the per-example outer products, which `ExplicitExactCurvature`
        and `ImplicitExactCurvature` always estimate (as KFAC-JAX's do).
        Other modes are unaffected.
      func_and_grad: instead of `func`, a function returning `(value,
        gradient)`; the `fisher_empirical_direct*` modes read its gradient.
      batch_index: which of the function's positional arguments is the
        batch.
      num_samples: in the sampled modes (`fisher_gradients`,
        `fisher_curvature_prop`, `ggn_curvature_prop`), each update folds in
        the mean of this many independent sampled estimates (0: updates
        leave the estimate as it is). Other modes ignore it.
      should_vmap_samples: with `num_samples > 1`, draw all samples in one
        vectorised pass (memory grows with `num_samples`) instead of a loop
        over them; the estimate is the same.
      auto_register_kwargs: passed to the graph matcher, as KFAC-JAX takes
        them (merged with `**kwargs`).
      **kwargs: passed to the graph matcher (e.g. `register_only_generic`,
        `patterns_to_skip`).

    Raises:
      ValueError: for an unknown estimation mode, matrix power method,
        normalization or number of samples.
    """
    auto_register_kwargs = {**(auto_register_kwargs or {}), **kwargs}
    super().__init__(
      func,
      func_and_grad,
      params_index,
      batch_index,
      default_estimation_mode,
    )
    func = self.func
    if isinstance(num_samples, bool) or int(num_samples) != num_samples:
      raise ValueError(f"num_samples={num_samples!r}: give an int >= 0.")
    if num_samples < 0:
      raise ValueError(f"num_samples={num_samples}: give an int >= 0.")
    self.num_samples = int(num_samples)
    self.should_vmap_samples = bool(should_vmap_samples)
    if matrix_power_method not in MATRIX_POWER_METHODS:
      raise ValueError(
        f"matrix_power_method={matrix_power_method!r}: choose one of "
        f"{', '.join(map(repr, MATRIX_POWER_METHODS))}."
      )
    if int(newton_max_iterations) < 1:
      raise ValueError(
        f"newton_max_iterations={newton_max_iterations}: give at least 1."
      )
    if fisher_empirical_normalization not in ("batch_squared", "batch"):
      raise ValueError(
        f"fisher_empirical_normalization={fisher_empirical_normalization!r}"
        ": choose 'batch_squared' (KFAC-JAX's block-diagonal estimator) or "
        "'batch' (the mean of per-example outer products)."
      )
    self.fisher_empirical_normalization = fisher_empirical_normalization
    self.matrix_power_method = matrix_power_method
    self.newton_max_iterations = int(newton_max_iterations)
    self._layer_tag_to_block_ctor = {
      canonical_tag_name(k): v
      for k, v in dict(layer_tag_to_block_ctor or {}).items()
    }
    self._index_to_block_ctor = dict(index_to_block_ctor or {})
    self.distributed_multiplies = distributed_multiplies
    self.distributed_cache_updates = distributed_cache_updates
    graph_matcher.check_patterns_to_skip(
      auto_register_kwargs.get("patterns_to_skip", ()),
      auto_register_kwargs.get(
        "graph_patterns", graph_matcher.DEFAULT_GRAPH_PATTERNS
      ),
    )
    if not auto_register_tags:
      auto_register_kwargs["auto_register_tags"] = False
    self._traced = tracer.traced_function(
      func, params_index, **auto_register_kwargs
    )
    # The same tags on a trace that keeps the function's value (the one
    # above computes only the loss tags' operands).
    value_kwargs = dict(auto_register_kwargs)
    if auto_register_tags:
      value_kwargs["compute_only_loss_tags"] = False
    self._value_traced = tracer.traced_function(
      func, params_index, **value_kwargs
    )
    # Built from the traced model by the first `init` (`_finalize`).
    self._blocks: tuple[curvature_blocks.CurvatureBlock, ...] | None = None
    self._jaxpr: tracer.ProcessedJaxpr | None = None

  # --- structure ---------------------------------------------------------

  def layer_tag_to_block_ctor(self, layer_tag_eq: Any) -> CurvatureBlockCtor:
    """The block class for a tag equation (user mapping, then the default).

    Args:
      layer_tag_eq: a layer tag's jaxpr equation.

    Returns:
      The block constructor.

    Raises:
      ValueError: if no block is known for the tag.
    """
    name = layer_tag_eq.primitive.name
    ctor = self._layer_tag_to_block_ctor.get(name)
    ctor = ctor or get_default_tag_to_block_ctor(name)
    if ctor is None:
      raise ValueError(
        f"No curvature block is known for the tag {name!r}: pass"
        " layer_tag_to_block_ctor={"
        f"'{name}': <block class>"
        "}."
      )
    return ctor

  def index_to_block_ctor(
    self, indices: Sequence[int]
  ) -> CurvatureBlockCtor | None:
    """The constructor given for the tag on these flat parameter indices.

    Args:
      indices: the flat indices of a tag's parameters.

    Returns:
      The constructor from `index_to_block_ctor`, or None.
    """
    return self._index_to_block_ctor.get(tuple(indices))

  def _finalize(self, func_args):
    if self._jaxpr is not None:
      return
    func_args = tuple(func_args)
    jaxpr = self._traced.processed(func_args)
    params = func_args[self.params_index]
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    blocks = []
    for eqn, idx in zip(jaxpr.layer_tags, jaxpr.layer_indices):
      ctor = self.index_to_block_ctor(idx) or self.layer_tag_to_block_ctor(eqn)
      stacked = isinstance(eqn, tracer.StackedLayerTag)
      try:
        block = build_block(
          ctor,
          eqn.inner if stacked else eqn,
          _block_name(paths, idx, eqn.primitive.name),
        )
        if not stacked:
          block.set_parameter_positions(idx)
        blocks.append(
          curvature_blocks.Stacked(block, eqn.length) if stacked else block
        )
      except (ValueError, TypeError, NotImplementedError) as e:
        raise ValueError(
          f"Cannot build a {getattr(ctor, '__name__', ctor)} block for the "
          f"{eqn.primitive.name} on params {idx}: {e}"
        ) from e
    self._jaxpr = jaxpr
    self._set_structure(
      tuple(blocks),
      jaxpr.params_tree,
      [v.aval for v in jaxpr.params_vars_flat],
      jaxpr.layer_indices,
    )

  def _set_structure(self, blocks, params_tree, params_avals, layer_indices):
    """Records the blocks and which parameters each covers."""
    self._blocks = blocks
    self._params_tree = params_tree
    self._param_shapes = [tuple(a.shape) for a in params_avals]
    self._params_dtype = jnp.result_type(*[a.dtype for a in params_avals])
    self._layer_indices = tuple(tuple(idx) for idx in layer_indices)
    self._param_sizes = [
      int(np.prod(shape, dtype=np.int64)) for shape in self._param_shapes
    ]

  def _require_finalized(self) -> tuple[curvature_blocks.CurvatureBlock, ...]:
    """The blocks, once `init` has built them."""
    if self._blocks is None:
      raise RuntimeError(
        "The estimator has not seen the model yet: call "
        "init(rng, func_args, ...) first."
      )
    return self._blocks

  @property
  def blocks(self) -> tuple[curvature_blocks.CurvatureBlock, ...] | None:
    """The blocks, one per layer tag in parameter order (None before init)."""
    return self._blocks

  @property
  def num_blocks(self) -> int:
    """The number of blocks."""
    return len(self._require_finalized())

  @property
  def block_dims(self) -> tuple[int, ...]:
    """Each block's number of parameter elements."""
    return tuple(b.dim for b in self._require_finalized())

  @property
  def dim(self) -> int:
    """The number of parameter elements."""
    self._require_finalized()
    return int(sum(self._param_sizes))

  @property
  def jaxpr(self) -> tracer.ProcessedJaxpr:
    """The traced model the blocks were built from."""
    self._require_finalized()
    # Set with the blocks.
    return cast(tracer.ProcessedJaxpr, self._jaxpr)

  @property
  def num_params_variables(self) -> int:
    """The number of parameter arrays (leaves of the params pytree)."""
    self._require_finalized()
    return len(self._param_shapes)

  @property
  def params_structure_vector_of_indices(self) -> Params:
    """The params pytree with each leaf replaced by its flat index."""
    return jax.tree.unflatten(
      self._params_tree, list(range(self.num_params_variables))
    )

  @property
  def indices_to_block_map(
    self,
  ) -> dict[tuple[int, ...], curvature_blocks.CurvatureBlock]:
    """Each block keyed by the flat indices of its parameters."""
    return dict(zip(self._layer_indices, self._require_finalized()))

  @property
  def params_block_index(self) -> Params:
    """The params pytree with each leaf replaced by its block's index."""
    which: list[int | None] = [None] * self.num_params_variables
    for b, idx in enumerate(self._layer_indices):
      for i in idx:
        which[i] = b
    return jax.tree.unflatten(self._params_tree, which)

  def params_vector_to_blocks_vectors(
    self, parameter_structured_vector: Params
  ) -> tuple[tuple[jax.Array, ...], ...]:
    """Splits a params-shaped pytree into block vectors.

    Args:
      parameter_structured_vector: a pytree shaped like the parameters.

    Returns:
      For each block, the tuple of its parameters' leaves.

    Raises:
      ValueError: if the pytree does not have the parameters' structure.
    """
    self._require_finalized()
    check_params_tree(self._params_tree, parameter_structured_vector, "vector")
    leaves = jax.tree.leaves(parameter_structured_vector)
    return tuple(tuple(leaves[i] for i in idx) for idx in self._layer_indices)

  def blocks_vectors_to_params_vector(
    self, blocks_vectors: Sequence[Sequence[jax.Array]]
  ) -> Params:
    """Inverts `params_vector_to_blocks_vectors`.

    Args:
      blocks_vectors: for each block, one array per parameter.

    Returns:
      A pytree shaped like the parameters.
    """
    leaves = [None] * self.num_params_variables
    for idx, vecs in zip(self._layer_indices, blocks_vectors):
      for i, v in zip(idx, vecs):
        leaves[i] = v
    return jax.tree.unflatten(self._params_tree, leaves)

  def _per_block(self, value, what):
    if isinstance(value, (list, tuple)):
      if len(value) != self.num_blocks:
        raise ValueError(
          f"{what} has {len(value)} entries but the estimator "
          f"has {self.num_blocks} blocks."
        )
      return tuple(value)
    return (value,) * self.num_blocks

  # --- state -------------------------------------------------------------

  def init(
    self,
    rng: jax.Array,
    func_args: FuncArgs,
    exact_powers_to_cache: ScalarOrSequence = None,
    approx_powers_to_cache: ScalarOrSequence = None,
    cache_eigenvalues: bool = False,
  ) -> BlockDiagonalState:
    """Builds the blocks on the first call; see `CurvatureEstimator.init`."""
    self._finalize(func_args)
    rngs = jax.random.split(rng, self.num_blocks)
    states = [
      b.init(
        r,
        powers_tuple(exact_powers_to_cache),
        powers_tuple(approx_powers_to_cache),
        cache_eigenvalues=cache_eigenvalues,
      )
      for b, r in zip(self._require_finalized(), rngs)
    ]
    if self.matrix_power_method == "newton":
      states = [
        dataclasses.replace(
          s, cache={**s.cache, NEWTON_FAILED: jnp.zeros((), bool)}
        )
        for s in states
      ]
    return self.State(tuple(states))

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
    mode = self._mode(estimation_mode)
    self._finalize(func_args)
    n = self.num_samples if mode in SAMPLED_MODES else 1
    if n == 0:
      return state
    fold = functools.partial(
      self._fold,
      batch_size=batch_size,
      pmap_axis_name=pmap_axis_name,
      mode=mode,
      identity_weight=identity_weight,
    )
    if n == 1 or self.should_vmap_samples:
      data = self.blocks_estimation_data(
        func_args,
        rng,
        mode,
        batch_size,
        num_samples=n,
        pmap_axis_name=pmap_axis_name,
      )
      return fold(state, data, ema_old, ema_new)

    # One sample at a time: the first replaces `ema_old`'s share, each adds
    # `ema_new / n`, so the result is the vectorised one's.
    keys = jax.random.split(rng, n)  # the vectorised pass's samples

    def one_sample(k, carry):
      data = self.blocks_estimation_data(func_args, keys[k], mode, batch_size)
      return fold(carry, data, jnp.where(k == 0, ema_old, 1.0), ema_new / n)

    return jax.lax.fori_loop(0, n, one_sample, state)

  def _fold(
    self,
    state,
    data,
    ema_old,
    ema_new,
    batch_size,
    pmap_axis_name,
    mode,
    identity_weight,
  ):
    """Each block's data folded into its state (the update's last step)."""
    blocks = self._require_finalized()
    try:
      new = tuple(
        update_block_estimate(
          block,
          block_state,
          block_data,
          ema_old,
          ema_new,
          batch_size,
          pmap_axis_name,
          identity_weight=identity_weight,
        )
        for block, block_state, block_data in zip(
          blocks, state.blocks_states, data
        )
      )
    except ValueError as e:
      if mode not in estimation_modes.DIRECT_ESTIMATION_MODES:
        raise
      raise ValueError(
        f"estimation_mode={mode!r} gives the blocks only the gradient of "
        "the parameters, as KFAC-JAX's does: use blocks that need nothing "
        f"else (NaiveDiagonal, NaiveFull, ...). {e}"
      ) from e
    return dataclasses.replace(
      state, blocks_states=new, synced=jnp.asarray(False)
    )

  def _direct_data(self, func_args, batch_size, pmap_axis_name):
    """Blocks' data for the `fisher_empirical_direct*` modes: the gradient
    of the function, one sample, times `sqrt(batch_size)` (see
    `estimation_modes.direct_gradient_scale`)."""
    func_args = tuple(func_args)
    if self.func_and_grad is not None:
      grads = self.func_and_grad(*func_args)[1]
    else:
      grads = jax.grad(self.func, self.params_index)(*func_args)
    if pmap_axis_name is not None:
      grads = utils.pmean_if_pmap(grads, pmap_axis_name)
    check_params_tree(self._params_tree, grads, "gradient of func_and_grad")
    leaves = [
      g[None] * estimation_modes.direct_gradient_scale(batch_size, g.dtype)
      for g in jax.tree.leaves(grads)
    ]
    return [
      dict(params_tangent=tuple(leaves[i] for i in idx))
      for idx in self._layer_indices
    ]

  def blocks_estimation_data(
    self,
    func_args: FuncArgs,
    rng: jax.Array,
    estimation_mode: str | None = None,
    batch_size: Numeric | None = None,
    num_samples: int = 1,
    pmap_axis_name: str | None = None,
  ) -> list[dict[str, tuple]]:
    """Each block's estimation data for one batch, from one vmapped pass.

    Args:
      func_args: the arguments of `func` for this batch.
      rng: a PRNG key for the sampled modes.
      estimation_mode: as for `update_curvature_matrix_estimate`.
      batch_size: the batch size the blocks normalise by; with it, in
        `fisher_empirical` mode under `fisher_empirical_normalization=
        'batch_squared'`, the tangents are divided by its square root.
      num_samples: in the sampled modes, draw this many independent samples
        (tangents divided by its square root, so the blocks' sums over
        samples are means).
      pmap_axis_name: in `fisher_empirical_direct_synced` mode, the
        gradient is averaged over this axis when it is bound.

    Returns:
      Per block, in `blocks` order, the mapping its
      `update_curvature_matrix_estimate` takes.
    """
    mode = self._mode(estimation_mode)
    self._finalize(func_args)
    if mode in estimation_modes.DIRECT_ESTIMATION_MODES:
      if batch_size is None:
        raise ValueError(f"estimation_mode={mode!r} needs the batch_size.")
      axis = pmap_axis_name if mode.endswith("_synced") else None
      return self._direct_data(func_args, batch_size, axis)
    _, losses, values, tangents_fn = tracer.layer_tags_vjp_parts(
      self._traced, tuple(func_args)
    )
    if num_samples != 1 and mode in SAMPLED_MODES:
      loss_tangents = jax.vmap(
        lambda key: estimation_modes.loss_tangents(losses, mode, key)
      )(jax.random.split(rng, num_samples))
      # (n, 1, ...) -> (n, ...), scaled so that sums over samples are means.
      loss_tangents = jax.tree.map(
        lambda t: t.reshape((-1,) + t.shape[2:])
        / jnp.sqrt(jnp.asarray(num_samples, t.dtype)),
        loss_tangents,
      )
    else:
      loss_tangents = estimation_modes.loss_tangents(losses, mode, rng)
    if (
      mode == "fisher_empirical"
      and batch_size is not None
      and self.fisher_empirical_normalization == "batch_squared"
    ):
      # The blocks divide the tangents' second moments by the batch size;
      # this makes it the square of the batch size (see `__init__`).
      loss_tangents = jax.tree.map(
        lambda t: t / jnp.sqrt(jnp.asarray(batch_size, t.dtype)), loss_tangents
      )
    layer_tangents = jax.vmap(tangents_fn)(loss_tangents)
    return [
      dict(value, outputs_tangent=outs_t, params_tangent=params_t)
      for value, (outs_t, params_t) in zip(values, layer_tangents)
    ]

  def update_cache(
    self,
    state: BlockDiagonalState,
    identity_weight: Numeric | Sequence[Numeric],
    exact_powers: ScalarOrSequence = None,
    approx_powers: ScalarOrSequence = None,
    eigenvalues: bool = False,
    pmap_axis_name: str | None = None,
    norm_to_scale_identity_weight_per_block: str | None = None,
  ) -> BlockDiagonalState:
    blocks = self._require_finalized()
    weights = self._block_weights(
      state, identity_weight, norm_to_scale_identity_weight_per_block
    )
    # Powers not named at `init` get room, as KFAC-JAX's estimator allows.
    state = dataclasses.replace(
      state,
      blocks_states=tuple(
        b.with_cache_room(
          s,
          powers_tuple(exact_powers),
          powers_tuple(approx_powers),
          eigenvalues,
        )
        for b, s in zip(blocks, state.blocks_states)
      ),
    )
    fns = [
      functools.partial(
        b.update_cache,
        identity_weight=w,
        exact_powers=powers_tuple(exact_powers),
        approx_powers=powers_tuple(approx_powers),
        eigenvalues=eigenvalues,
      )
      for b, w in zip(blocks, weights)
    ]
    costs = [distributed.refresh_cost(s) for s in state.blocks_states]
    axis = pmap_axis_name if self.distributed_cache_updates else None
    return dataclasses.replace(
      state,
      blocks_states=self._newton_verdicts(
        state.blocks_states,
        self._refresh(fns, state.blocks_states, costs, axis),
      ),
    )

  def _block_weights(self, state, identity_weight, norm_type):
    """One identity weight per block, each times its block's norm when
    `norm_type` names one (see `update_cache`)."""
    weights = self._per_block(identity_weight, "identity_weight")
    if norm_type is None or norm_type == "none":
      return weights
    return tuple(
      w * b.norm(s, norm_type)
      for w, b, s in zip(
        weights, self._require_finalized(), state.blocks_states
      )
    )

  def _refresh(self, fns, args, costs, axis):
    """`distributed.map_blocks` of refreshes, their damped powers by
    `matrix_power_method`."""
    refresh = lambda: distributed.map_blocks(fns, args, costs, axis)
    if self.matrix_power_method == "decomposition":
      return refresh()
    # Shared among devices, each block's refresh is traced inside its own
    # branch, out of reach of one batched iteration.
    return newton.by_products(
      refresh, batched=axis is None, max_iterations=self.newton_max_iterations
    )

  def _newton_verdicts(self, old_states, new_states) -> tuple:
    """The refreshed block states, each with its sticky NEWTON_FAILED flag
    set where the refresh left non-finite powers from finite statistics:
    a factor the Newton iteration could not invert (with non-finite
    statistics the run diverged for other reasons)."""
    new_states = tuple(new_states)
    if self.matrix_power_method != "newton":
      return new_states
    finite = lambda tree: jnp.all(
      jnp.stack(
        [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
        or [jnp.asarray(True)]
      )
    )
    out = []
    for old, new in zip(old_states, new_states):
      powers = {k: v for k, v in new.cache.items() if k != NEWTON_FAILED}
      failed = old.cache[NEWTON_FAILED] | (
        ~finite(powers) & finite(dataclasses.replace(new, cache={}))
      )
      out.append(
        dataclasses.replace(new, cache={**powers, NEWTON_FAILED: failed})
      )
    return tuple(out)

  def newton_failures(self, state: BlockDiagonalState) -> list[str]:
    """The names of the blocks whose Newton iteration failed at some
    refresh (`matrix_power_method='newton'`; reads the device)."""
    if self.matrix_power_method != "newton":
      return []
    return [
      b.name
      for b, s in zip(self._require_finalized(), state.blocks_states)
      if bool(np.any(s.cache[NEWTON_FAILED]))
    ]

  def _blocks_matpower(
    self,
    which,
    states,
    vectors,
    weights,
    power,
    exact_power,
    use_cached,
    pmap_axis_name,
  ):
    """The products of the blocks `which`, shared among the devices of
    `pmap_axis_name` when `distributed_multiplies`."""

    def product(block, weight):
      return lambda args: block.multiply_matpower(
        *args, weight, power, exact_power=exact_power, use_cached=use_cached
      )

    blocks = self._require_finalized()
    fns = [product(blocks[j], weights[j]) for j in which]
    args = [(states[j], vectors[j]) for j in which]
    costs = [distributed.product_cost(states[j], blocks[j].dim) for j in which]
    axis = pmap_axis_name if self.distributed_multiplies else None
    return dict(zip(which, distributed.map_blocks(fns, args, costs, axis)))

  # --- products ------------------------------------------------------------

  def multiply_matpower(
    self,
    state: BlockDiagonalState,
    parameter_structured_vector: Params,
    identity_weight: Numeric | Sequence[Numeric],
    power: float,
    exact_power: bool,
    use_cached: bool,
    pmap_axis_name: str | None = None,
    norm_to_scale_identity_weight_per_block: str | None = None,
  ) -> Params:
    vectors = self.params_vector_to_blocks_vectors(parameter_structured_vector)
    weights = self._per_block(identity_weight, "identity_weight")
    if not use_cached:  # cached products use the last update_cache's weight
      weights = self._block_weights(
        state, weights, norm_to_scale_identity_weight_per_block
      )
    results = self._blocks_matpower(
      range(self.num_blocks),
      state.blocks_states,
      vectors,
      weights,
      power,
      exact_power,
      use_cached,
      pmap_axis_name,
    )
    return self.blocks_vectors_to_params_vector(
      tuple(results[j] for j in range(self.num_blocks))
    )

  def multiply_inverse_of_gradient(
    self,
    state: BlockDiagonalState,
    grads: Params,
    func_args: FuncArgs,
    identity_weight: Numeric | Sequence[Numeric] = 0.0,
    exact_power: bool = True,
    use_cached: bool = False,
    pmap_axis_name: str | None = None,
  ) -> Params:
    """`multiply_inverse(grads)` for the gradient of `func` at `func_args`.

    A dense layer's gradient is a sum of outer products, one per input row.
    Where that is cheaper (a layer wider than the batch has rows), its block
    preconditions those rows (cached approximate inverses only) and skips its
    part of `grads`. That needs the layer's parameters to reach the value
    only through the layer, e.g. no L2 term on them inside the loss; the
    jaxpr is checked for it, and other blocks use `grads`.

    Args:
      state: the estimator state.
      grads: the gradient of `func`'s scalar value at `func_args`, averaged
        over `pmap_axis_name`.
      func_args: the arguments `grads` was computed at.
      identity_weight: as for `multiply_inverse`.
      exact_power: as for `multiply_inverse`; the row route needs False.
      use_cached: as for `multiply_inverse`; the row route needs True.
      pmap_axis_name: when not None, the row route's results are averaged
        over this axis, as `grads` is.

    Returns:
      The preconditioned gradient, shaped like the parameters; equal to
      `multiply_inverse(state, grads, ...)` up to rounding.
    """
    func_args = tuple(func_args)
    self._finalize(func_args)
    blocks = self._require_finalized()
    chosen = []
    if use_cached and not exact_power:
      chosen = [j for j, b in enumerate(blocks) if b.outer_sum_is_cheaper()]
    if chosen:
      proc = self._value_traced.processed(func_args)
      same_tags = proc.layer_indices == self.jaxpr.layer_indices
      chosen = [
        j
        for j in chosen
        if same_tags and proc.params_reach_outputs_only_through_layer(j)
      ]
    if not chosen:
      return self.multiply_inverse(
        state,
        grads,
        identity_weight,
        exact_power=exact_power,
        use_cached=use_cached,
      )
    rows = dict(
      zip(
        chosen,
        tracer.layer_tags_value_vjp(self._value_traced, func_args, chosen),
      )
    )
    vectors = self.params_vector_to_blocks_vectors(grads)
    weights = self._per_block(identity_weight, "identity_weight")
    results = self._blocks_matpower(
      [j for j in range(self.num_blocks) if j not in rows],
      state.blocks_states,
      vectors,
      weights,
      -1,
      exact_power,
      use_cached,
      pmap_axis_name,
    )
    for j, block_rows in rows.items():
      # Each device has its own rows; the product is linear in the gradient,
      # so the mean of the devices' results is the result for the mean
      # gradient.
      # Chosen for its `outer_sum_is_cheaper()`, so it offers the product.
      block = cast(_OuterSumBlock, blocks[j])
      result = block.multiply_inverse_outer_sum(
        state.blocks_states[j], *block_rows
      )
      if pmap_axis_name is not None:
        result = jax.lax.pmean(result, pmap_axis_name)
      results[j] = result
    return self.blocks_vectors_to_params_vector(
      tuple(results[j] for j in range(self.num_blocks))
    )

  def block_eigenvalues(
    self, state: BlockDiagonalState, use_cached: bool = False
  ) -> tuple[jax.Array, ...]:
    """Each block's eigenvalues.

    Args:
      state: the estimator state.
      use_cached: whether to return the cached eigenvalues.

    Returns:
      One `(block_dim,)` array per block, in `blocks` order.
    """
    return tuple(
      b.eigenvalues(s, use_cached=use_cached)
      for b, s in zip(self._require_finalized(), state.blocks_states)
    )

  def eigenvalues(
    self, state: BlockDiagonalState, use_cached: bool = False
  ) -> jax.Array:
    """The blocks' eigenvalues concatenated in `blocks` order, unsorted."""
    return jnp.concatenate(self.block_eigenvalues(state, use_cached=use_cached))

  @property
  def valid_estimation_modes(self) -> tuple[str, ...]:
    """`ESTIMATION_MODES` and the `fisher_empirical_direct*` modes."""
    return (
      estimation_modes.ESTIMATION_MODES
      + estimation_modes.DIRECT_ESTIMATION_MODES
    )

  @property
  def param_order(self) -> np.ndarray:
    """The params' leaf indices block by block (in `blocks` order), in
    leaf order within each block: the order of the rows of
    `to_diagonal_block_dense_matrix`, one block after the other. Given to
    `ExplicitExactCurvature(param_order=...)`, its dense matrix has these
    blocks on its diagonal, in this order."""
    self._require_finalized()
    return np.array(
      [i for idx in self._layer_indices for i in sorted(idx)], dtype=int
    )

  def log_registrations(self) -> None:
    """Logs (at INFO level) every block: its class and its parameters."""
    blocks = self._require_finalized()
    _LOG.info("BlockDiagonalCurvature blocks:")
    for block in blocks:
      _LOG.info("%s: %s", type(block).__name__, block.name)

  def sync(
    self, state: BlockDiagonalState, pmap_axis_name: str | None
  ) -> BlockDiagonalState:
    """Each block's `sync`; marks the state as synced. Outside a mapped
    axis of that name the state is returned unchanged."""
    if not utils.in_pmap(pmap_axis_name):
      return state
    return dataclasses.replace(
      state,
      blocks_states=tuple(
        b.sync(s, pmap_axis_name)
        for b, s in zip(self._require_finalized(), state.blocks_states)
      ),
      synced=jnp.asarray(True),
    )

  def undamped_diagonal(self, state: BlockDiagonalState) -> Params:
    """The diagonal of the undamped estimate, shaped like the params."""
    return self.blocks_vectors_to_params_vector(
      tuple(
        b.undamped_diagonal(s)
        for b, s in zip(self._require_finalized(), state.blocks_states)
      )
    )

  def to_diagonal_block_dense_matrix(
    self, state: BlockDiagonalState
  ) -> tuple[jax.Array, ...]:
    """Each block's undamped estimate as a dense matrix, its rows in the
    order of the params' leaves (as in `to_dense_matrix`)."""
    out = []
    for block, s, idx in zip(
      self._require_finalized(), state.blocks_states, self._layer_indices
    ):
      sizes = [self._param_sizes[i] for i in idx]
      starts = np.concatenate([[0], np.cumsum(sizes)])
      order = np.concatenate(
        [np.arange(starts[k], starts[k + 1]) for k in np.argsort(idx)]
      )
      out.append(block.to_dense_matrix(s)[np.ix_(order, order)])
    return tuple(out)

  def to_dense_matrix(
    self,
    state: BlockDiagonalState,
    use_cached: bool = False,
    identity_weight: Numeric | Sequence[Numeric] = 0.0,
    exact_power: bool = True,
    power: float = 1,
  ) -> jax.Array:
    """The block-diagonal matrix `(C + identity_weight I) ** power`, densely.

    Args:
      state: the estimator state.
      use_cached: as for `multiply_matpower`.
      identity_weight: as for `multiply_matpower`.
      exact_power: as for `multiply_matpower`.
      power: as for `multiply_matpower`.

    Returns:
      A `(dim, dim)` array in `ravel_pytree` order, zero between blocks.
    """
    blocks = self._require_finalized()
    offsets = np.concatenate([[0], np.cumsum(self._param_sizes)])
    dtype = self._params_dtype
    matrix = jnp.zeros((self.dim, self.dim), dtype)
    shapes = self._param_shapes
    weights = self._per_block(identity_weight, "identity_weight")
    for block, s, idx, w in zip(
      blocks, state.blocks_states, self._layer_indices, weights
    ):
      sizes = [self._param_sizes[i] for i in idx]
      split = np.cumsum(sizes)[:-1]

      def apply(col, block=block, s=s, idx=idx, w=w, split=split):
        parts = jnp.split(col, split)
        vec = tuple(p.reshape(shapes[i]) for p, i in zip(parts, idx))
        out = block.multiply_matpower(
          s, vec, w, power, exact_power=exact_power, use_cached=use_cached
        )
        return jnp.concatenate([o.ravel() for o in out])

      dense = jax.vmap(apply, out_axes=1)(jnp.eye(sum(sizes), dtype=dtype))
      where = np.concatenate(
        [np.arange(offsets[i], offsets[i + 1]) for i in idx]
      )
      matrix = matrix.at[np.ix_(where, where)].set(dense)
    return matrix
