"""Curvature estimators: block-diagonal, explicit exact and implicit exact.

Parameter vectors are pytrees shaped like the model's params. Dense exports
(`to_dense_matrix`) and `dim` use the order of `jax.flatten_util.ravel_pytree`
(the params' leaves in tree order, each raveled).
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np

from estimators import blocks as curvature_blocks
from estimators import (distributed, estimation_modes, graph_matcher, tags,
                        tracer, utils)
from estimators.blocks.base import Numeric, ScalarOrSequence
from estimators.utils.types import FuncArgs, Params, StateType

CurvatureBlockCtor = Callable[..., curvature_blocks.CurvatureBlock]

_DEFAULT_TAG_TO_BLOCK_CTOR: dict[str, CurvatureBlockCtor] = {
    "dense_tag": curvature_blocks.DenseTwoKroneckerFactored,
    "repeated_dense_tag": curvature_blocks.RepeatedDenseTwoKroneckerFactored,
    "conv2d_tag": curvature_blocks.Conv2DTwoKroneckerFactored,
    "generic_tag": curvature_blocks.NaiveDiagonal,
    "scale_and_shift_tag": curvature_blocks.ScaleAndShiftDiagonal,
}


def set_default_tag_to_block_ctor(tag_name: str,
                                  block_ctor: CurvatureBlockCtor) -> None:
  """Sets the block class used by default for layers with this tag name.

  Args:
    tag_name: a layer tag primitive's name, e.g. "dense_tag".
    block_ctor: called as `block_ctor(layer_tag_eq, name)` to build a block.
  """
  _DEFAULT_TAG_TO_BLOCK_CTOR[tag_name] = block_ctor


def get_default_tag_to_block_ctor(tag_name: str) -> CurvatureBlockCtor | None:
  """The block class used by default for a tag name.

  Args:
    tag_name: a layer tag primitive's name, e.g. "dense_tag".

  Returns:
    The block constructor, or None for an unknown tag.
  """
  return _DEFAULT_TAG_TO_BLOCK_CTOR.get(tag_name)


def default_batch_size_extractor(batch: Any) -> int:
  """The batch size of a batch pytree.

  Args:
    batch: a pytree of arrays with the batch axis first.

  Returns:
    The size of the leading axis of its first leaf.
  """
  return jax.tree.leaves(batch)[0].shape[0]


def _as_tuple(powers) -> tuple:
  if powers is None:
    return ()
  if isinstance(powers, (int, float)):
    return (powers,)
  return tuple(powers)


class _InPlaceMovingAverage(utils.WeightedMovingAverage):
  """A moving average whose `update` also changes it in place, as blocks
  written to the reference's guide expect; only ever a private copy."""

  def update(self, value, ema_old, ema_new):
    new = super().update(value, ema_old, ema_new)
    object.__setattr__(self, "weight", new.weight)
    object.__setattr__(self, "raw_value", new.raw_value)
    return self


def _map_averages(fn, state):
  """`state` with `fn` applied to each of its moving averages."""
  is_average = lambda x: isinstance(x, utils.WeightedMovingAverage)
  return jax.tree.map(lambda x: fn(x) if is_average(x) else x, state,
                      is_leaf=is_average)


def _with_averages(state, cls):
  """`state` with every moving average rebuilt as a `cls`."""
  return _map_averages(lambda x: cls(x.weight, x.raw_value), state)


def update_block_estimate(block: curvature_blocks.CurvatureBlock, state: Any,
                          estimation_data: Mapping[str, tuple],
                          ema_old: Numeric, ema_new: Numeric,
                          batch_size: Numeric,
                          pmap_axis_name: str | None = None) -> Any:
  """`block.update_curvature_matrix_estimate`, fed as the block expects.

  A block with `estimation_data_has_sample_axis` takes all samples at
  once. Any other (a block written to the reference's guide) gets one
  sample at a time, tangents shaped `(batch, ...)`, and may update its
  moving averages in place. Curvature statistics are quadratic in the
  tangents and a batch's estimate sums them over samples, so sample `s`
  of `S` enters with its tangents times `sqrt(S)` and weight
  `ema_new / S`, the old estimate with `ema_old` once.

  Args:
    block: the block.
    state: its state.
    estimation_data: its data from `blocks_estimation_data` (tangents with
      a leading sample axis).
    ema_old: the factor on the old estimate.
    ema_new: the weight of this batch's estimate.
    batch_size: the number of examples in the batch.
    pmap_axis_name: as for `update_curvature_matrix_estimate`.

  Returns:
    The block's new state.
  """
  if block.estimation_data_has_sample_axis:
    return block.update_curvature_matrix_estimate(
        state, estimation_data, ema_old, ema_new, batch_size,
        pmap_axis_name)
  tangents = ("outputs_tangent", "params_tangent")
  num = jax.tree.leaves([estimation_data[k] for k in tangents])[0].shape[0]

  def one_sample(state, sample, ema_old):
    data = dict(estimation_data)
    for key in tangents:
      data[key] = tuple(t[sample] * np.sqrt(num).astype(t.dtype)
                        for t in estimation_data[key])
    state = block.update_curvature_matrix_estimate(
        _with_averages(state, _InPlaceMovingAverage), data, ema_old,
        ema_new / num, batch_size, pmap_axis_name)
    return _with_averages(state, utils.WeightedMovingAverage)

  state = one_sample(state, 0, ema_old)
  return jax.lax.fori_loop(1, num, lambda s, st: one_sample(st, s, 1.0),
                           state)


def _check_params_tree(expected, vector, what):
  got = jax.tree.structure(vector)
  if got != expected:
    raise ValueError(f"The {what} does not have the structure of the model's "
                     f"params: expected {expected}, got {got}.")


class CurvatureEstimator(abc.ABC, Generic[StateType]):
  """What every estimator provides: estimate updates, products, eigenvalues.

  The state holds the estimate `C` of the curvature of `func`'s registered
  losses (averaged over the batch) w.r.t. `func_args[params_index]`, plus a
  cache of values derived from it (matrix powers, eigenvalues). The cache is
  refreshed only by `update_cache`, so with `use_cached=True` results may be
  older than the estimate. Methods take a state and return a new one.

  Attributes:
    func: the model function, with at least one registered loss.
    params_index: which of `func`'s positional arguments are the parameters.
    default_estimation_mode: the mode `update_curvature_matrix_estimate`
      uses when given none.
  """

  def __init__(self, func: Callable, params_index: int = 0,
               default_estimation_mode: str = "fisher_gradients"):
    """Stores the model function and checks the estimation mode.

    Args:
      func: the model function, with at least one registered loss.
      params_index: which of `func`'s positional arguments are the
        parameters.
      default_estimation_mode: one of `estimators.ESTIMATION_MODES`.

    Raises:
      ValueError: for an unknown estimation mode.
    """
    self.func = func
    self.params_index = params_index
    self.default_estimation_mode = estimation_modes.check_estimation_mode(
        default_estimation_mode)

  @property
  def default_mat_type(self) -> str:
    """The kind of matrix the default mode estimates, as the reference
    names it: "fisher" for every `fisher_*` mode (the empirical Fisher too),
    "ggn" for the `ggn_*` modes."""
    return self.default_estimation_mode.split("_")[0]

  @property
  @abc.abstractmethod
  def dim(self) -> int:
    """Number of parameter elements."""

  @abc.abstractmethod
  def init(self, rng: jax.Array, func_args: FuncArgs,
           exact_powers_to_cache: ScalarOrSequence,
           approx_powers_to_cache: ScalarOrSequence,
           cache_eigenvalues: bool = False) -> Any:
    """The initial state: a zero estimate and an empty cache.

    Args:
      rng: a PRNG key for any randomness of the initialisation.
      func_args: example arguments of `func`; the model is traced on them.
      exact_powers_to_cache: None, a power or powers that will be used with
        `exact_power=True, use_cached=True`; the cache has room only for
        the powers named here.
      approx_powers_to_cache: the same for `exact_power=False`.
      cache_eigenvalues: whether to keep room for cached eigenvalues.

    Returns:
      The estimator state.
    """

  @abc.abstractmethod
  def update_curvature_matrix_estimate(
      self, state: Any, ema_old: Numeric, ema_new: Numeric,
      batch_size: Numeric, rng: jax.Array, func_args: FuncArgs,
      pmap_axis_name: str | None = None,
      estimation_mode: str | None = None,
      identity_weight: Numeric | None = None) -> Any:
    """Folds one batch's estimate into the moving average.

    The new estimate is `(ema_old * w * old + ema_new * batch) / (ema_old * w
    + ema_new)`, `w` the weight the average had; `ema_old=0, ema_new=1` keeps
    only this batch. The cache is left as it is.

    Args:
      state: the estimator state.
      ema_old: the factor on the old estimate.
      ema_new: the weight of this batch's estimate.
      batch_size: the number of examples in `func_args`' batch.
      rng: a PRNG key for the sampled modes.
      func_args: the arguments of `func` for this batch.
      pmap_axis_name: when not None, the batch estimate is averaged over
        this axis.
      estimation_mode: one of `estimators.ESTIMATION_MODES`; None uses
        `default_estimation_mode`.
      identity_weight: accepted from callers of newer KFAC-JAX releases; the
        estimates here do not depend on the damping.

    Returns:
      The state with the new estimate.
    """

  @abc.abstractmethod
  def update_cache(self, state: Any, identity_weight: Numeric,
                   exact_powers: ScalarOrSequence,
                   approx_powers: ScalarOrSequence, eigenvalues: bool,
                   pmap_axis_name: str | None = None) -> Any:
    """Refreshes cached powers and eigenvalues from the current estimate.

    Args:
      state: the estimator state.
      identity_weight: the weight `λ` of the identity added to the estimate
        before the powers are taken (the damping); block-wise estimators
        also take one weight per block.
      exact_powers: None, a power or powers named at `init` to refresh.
      approx_powers: the same for the approximate powers.
      eigenvalues: whether to refresh the cached (undamped) eigenvalues.
      pmap_axis_name: the mapped axis, if any; block-wise estimators may
        share the blocks' refreshes among its devices (see their
        `distributed_cache_updates`).

    Returns:
      The state with the refreshed cache entries.
    """

  @abc.abstractmethod
  def multiply_matpower(self, state: Any, parameter_structured_vector: Params,
                        identity_weight: Numeric, power: float,
                        exact_power: bool, use_cached: bool,
                        pmap_axis_name: str | None = None) -> Params:
    """`(C + identity_weight I) ** power @ v`.

    Args:
      state: the estimator state.
      parameter_structured_vector: `v`, a pytree shaped like the parameters.
      identity_weight: the weight `λ` of the identity (the damping); ignored
        with `use_cached=True`, where the `λ` of the last `update_cache`
        applies. Block-wise estimators also take one weight per block.
      power: a real power known at trace time.
      exact_power: False allows a cheaper approximation where a block has
        one (e.g. factored damping for Kronecker blocks).
      use_cached: whether to use the cached power (named at `init`)
        instead of computing it from the current estimate.
      pmap_axis_name: the mapped axis, if any; block-wise estimators may
        share the blocks' products among its devices (see their
        `distributed_multiplies`).

    Returns:
      The product, shaped like the parameters.
    """

  def multiply(self, state: Any, parameter_structured_vector: Params,
               identity_weight: Numeric = 0.0, exact_power: bool = True,
               use_cached: bool = False,
               pmap_axis_name: str | None = None) -> Params:
    """`(C + identity_weight I) @ v`; see `multiply_matpower`."""
    return self.multiply_matpower(state, parameter_structured_vector,
                                  identity_weight, 1, exact_power=exact_power,
                                  use_cached=use_cached,
                                  pmap_axis_name=pmap_axis_name)

  def multiply_inverse(self, state: Any, parameter_structured_vector: Params,
                       identity_weight: Numeric = 0.0,
                       exact_power: bool = True, use_cached: bool = False,
                       pmap_axis_name: str | None = None) -> Params:
    """`(C + identity_weight I) ** -1 @ v`; see `multiply_matpower`."""
    return self.multiply_matpower(state, parameter_structured_vector,
                                  identity_weight, -1, exact_power=exact_power,
                                  use_cached=use_cached,
                                  pmap_axis_name=pmap_axis_name)

  @abc.abstractmethod
  def eigenvalues(self, state: Any, use_cached: bool = False) -> jax.Array:
    """All eigenvalues of the (undamped) estimate.

    Args:
      state: the estimator state.
      use_cached: whether to return the eigenvalues cached by the last
        `update_cache(..., eigenvalues=True)`.

    Returns:
      A `(dim,)` array.
    """

  def to_dense_matrix(self, state: Any, use_cached: bool = False) -> jax.Array:
    """The (undamped) estimate as a dense matrix, for small models.

    Not part of the reference's abstract interface, so estimators written to
    it need not provide it.

    Args:
      state: the estimator state.
      use_cached: whether to use cached values where the estimator has them.

    Returns:
      A `(dim, dim)` array, rows and columns in `ravel_pytree` order.

    Raises:
      NotImplementedError: unless the estimator provides it.
    """
    raise NotImplementedError(
        f"{type(self).__name__} does not provide to_dense_matrix.")

  def sync(self, state: StateType, pmap_axis_name: str | None) -> StateType:
    """The state with its statistics averaged across the devices of
    `pmap_axis_name` (the cache is left as it is).

    The estimators here already average every update's statistics over the
    axis they are given, so this matters only for states that were updated
    without one.

    Args:
      state: the estimator state.
      pmap_axis_name: the mapped axis; None returns `state` unchanged.

    Returns:
      The synchronised state.
    """
    if pmap_axis_name is None:
      return state
    return _map_averages(lambda x: jax.lax.pmean(x, pmap_axis_name), state)

  def _mode(self, estimation_mode):
    return estimation_modes.check_estimation_mode(
        estimation_mode or self.default_estimation_mode)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _BlockDiagonalState:
  """State of a `BlockDiagonalCurvature`.

  Attributes:
    blocks_states: one `CurvatureBlock.State` per block, in `blocks` order.
  """
  blocks_states: tuple


def _block_name(paths, indices, tag_name):
  keys = [jax.tree_util.keystr(paths[i]) for i in indices]
  return f"{keys[0] if len(keys) == 1 else ','.join(keys)} [{tag_name}]"


class BlockDiagonalCurvature(CurvatureEstimator):
  """One curvature block per layer tag; the blocks form a block diagonal.

  The blocks are built on the first `init` from the traced model: each layer
  tag (registered by hand or found by the graph matcher) gets the block
  class that `index_to_block_ctor`, then `layer_tag_to_block_ctor`, names.
  Cross-layer curvature is dropped.
  """

  State = _BlockDiagonalState

  def __init__(self, func: Callable, params_index: int = 0,
               default_estimation_mode: str = "fisher_gradients",
               layer_tag_to_block_ctor: Mapping[str, CurvatureBlockCtor]
               | None = None,
               index_to_block_ctor: Mapping[tuple[int, ...],
                                            CurvatureBlockCtor] | None = None,
               auto_register_tags: bool = True,
               distributed_multiplies: bool = True,
               distributed_cache_updates: bool = True,
               **auto_register_kwargs):
    """Prepares the tracing of `func`; blocks are built by `init`.

    Args:
      func: the model function, with at least one registered loss.
      params_index: which of `func`'s positional arguments are the
        parameters.
      default_estimation_mode: one of `estimators.ESTIMATION_MODES`.
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
      **auto_register_kwargs: passed to the graph matcher (e.g.
        `register_only_generic`, `patterns_to_skip`).

    Raises:
      ValueError: for an unknown estimation mode.
    """
    super().__init__(func, params_index, default_estimation_mode)
    self._layer_tag_to_block_ctor = dict(layer_tag_to_block_ctor or {})
    self._index_to_block_ctor = dict(index_to_block_ctor or {})
    self.distributed_multiplies = distributed_multiplies
    self.distributed_cache_updates = distributed_cache_updates
    graph_matcher.check_patterns_to_skip(
        auto_register_kwargs.get("patterns_to_skip", ()),
        auto_register_kwargs.get("graph_patterns",
                                 graph_matcher.DEFAULT_GRAPH_PATTERNS))
    if not auto_register_tags:
      auto_register_kwargs["auto_register_tags"] = False
    self._traced = tracer.traced_function(func, params_index,
                                          **auto_register_kwargs)
    # The same tags on a trace that keeps the function's value (the one
    # above computes only the loss tags' operands).
    value_kwargs = dict(auto_register_kwargs)
    if auto_register_tags:
      value_kwargs["compute_only_loss_tags"] = False
    self._value_traced = tracer.traced_function(func, params_index,
                                                **value_kwargs)
    self._blocks = None
    self._jaxpr = None

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
      raise ValueError(f"No curvature block is known for the tag {name!r}: pass"
                       " layer_tag_to_block_ctor={" f"'{name}': <block class>" "}.")
    return ctor

  def index_to_block_ctor(
      self, indices: Sequence[int]) -> CurvatureBlockCtor | None:
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
        block = ctor(eqn.inner if stacked else eqn,
                     _block_name(paths, idx, eqn.primitive.name))
        if not stacked:
          block.set_parameter_positions(idx)
        blocks.append(curvature_blocks.Stacked(block, eqn.length)
                      if stacked else block)
      except (ValueError, TypeError, NotImplementedError) as e:
        raise ValueError(
            f"Cannot build a {getattr(ctor, '__name__', ctor)} block for the "
            f"{eqn.primitive.name} on params {idx}: {e}") from e
    self._jaxpr = jaxpr
    self._set_structure(tuple(blocks), jaxpr.params_tree,
                        [v.aval for v in jaxpr.params_vars_flat],
                        jaxpr.layer_indices)

  def _set_structure(self, blocks, params_tree, params_avals, layer_indices):
    """Records the blocks and which parameters each covers."""
    self._blocks = blocks
    self._params_tree = params_tree
    self._param_shapes = [tuple(a.shape) for a in params_avals]
    self._params_dtype = jnp.result_type(*[a.dtype for a in params_avals])
    self._layer_indices = tuple(tuple(idx) for idx in layer_indices)
    self._param_sizes = [int(np.prod(shape, dtype=np.int64))
                         for shape in self._param_shapes]

  def _require_finalized(self):
    if self._blocks is None:
      raise RuntimeError("The estimator has not seen the model yet: call "
                         "init(rng, func_args, ...) first.")

  @property
  def blocks(self) -> tuple[curvature_blocks.CurvatureBlock, ...] | None:
    """The blocks, one per layer tag in parameter order (None before init)."""
    return self._blocks

  @property
  def num_blocks(self) -> int:
    """The number of blocks."""
    self._require_finalized()
    return len(self._blocks)

  @property
  def block_dims(self) -> tuple[int, ...]:
    """Each block's number of parameter elements."""
    self._require_finalized()
    return tuple(b.dim for b in self._blocks)

  @property
  def dim(self) -> int:
    """The number of parameter elements."""
    self._require_finalized()
    return int(sum(self._param_sizes))

  @property
  def jaxpr(self) -> tracer.ProcessedJaxpr:
    """The traced model the blocks were built from."""
    self._require_finalized()
    return self._jaxpr

  @property
  def num_params_variables(self) -> int:
    """The number of parameter arrays (leaves of the params pytree)."""
    self._require_finalized()
    return len(self._param_shapes)

  @property
  def params_structure_vector_of_indices(self) -> Params:
    """The params pytree with each leaf replaced by its flat index."""
    return jax.tree.unflatten(self._params_tree,
                              list(range(self.num_params_variables)))

  @property
  def indices_to_block_map(
      self) -> dict[tuple[int, ...], curvature_blocks.CurvatureBlock]:
    """Each block keyed by the flat indices of its parameters."""
    self._require_finalized()
    return dict(zip(self._layer_indices, self._blocks))

  @property
  def params_block_index(self) -> Params:
    """The params pytree with each leaf replaced by its block's index."""
    which = [None] * self.num_params_variables
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
    _check_params_tree(self._params_tree, parameter_structured_vector,
                       "vector")
    leaves = jax.tree.leaves(parameter_structured_vector)
    return tuple(tuple(leaves[i] for i in idx) for idx in self._layer_indices)

  def blocks_vectors_to_params_vector(
      self, blocks_vectors: Sequence[Sequence[jax.Array]]) -> Params:
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
        raise ValueError(f"{what} has {len(value)} entries but the estimator "
                         f"has {self.num_blocks} blocks.")
      return tuple(value)
    return (value,) * self.num_blocks

  # --- state -------------------------------------------------------------

  def init(self, rng: jax.Array, func_args: FuncArgs,
           exact_powers_to_cache: ScalarOrSequence = None,
           approx_powers_to_cache: ScalarOrSequence = None,
           cache_eigenvalues: bool = False) -> _BlockDiagonalState:
    """Builds the blocks on the first call; see `CurvatureEstimator.init`."""
    self._finalize(func_args)
    rngs = jax.random.split(rng, self.num_blocks)
    return self.State(tuple(
        b.init(r, _as_tuple(exact_powers_to_cache),
               _as_tuple(approx_powers_to_cache),
               cache_eigenvalues=cache_eigenvalues)
        for b, r in zip(self._blocks, rngs)))

  def update_curvature_matrix_estimate(
      self, state: _BlockDiagonalState, ema_old: Numeric, ema_new: Numeric,
      batch_size: Numeric, rng: jax.Array, func_args: FuncArgs,
      pmap_axis_name: str | None = None,
      estimation_mode: str | None = None,
      identity_weight: Numeric | None = None) -> _BlockDiagonalState:
    del identity_weight  # the estimates do not depend on the damping
    data = self.blocks_estimation_data(func_args, rng, estimation_mode)
    return self.State(tuple(
        update_block_estimate(block, block_state, block_data, ema_old,
                              ema_new, batch_size, pmap_axis_name)
        for block, block_state, block_data in zip(
            self._blocks, state.blocks_states, data)))

  def blocks_estimation_data(self, func_args: FuncArgs, rng: jax.Array,
                             estimation_mode: str | None = None
                             ) -> list[dict[str, tuple]]:
    """Each block's estimation data for one batch, from one vmapped pass.

    Args:
      func_args: the arguments of `func` for this batch.
      rng: a PRNG key for the sampled modes.
      estimation_mode: as for `update_curvature_matrix_estimate`.

    Returns:
      Per block, in `blocks` order, the mapping its
      `update_curvature_matrix_estimate` takes.
    """
    mode = self._mode(estimation_mode)
    self._finalize(func_args)
    _, losses, values, tangents_fn = tracer.layer_tags_vjp_parts(
        self._traced, tuple(func_args))
    loss_tangents = estimation_modes.loss_tangents(losses, mode, rng)
    layer_tangents = jax.vmap(tangents_fn)(loss_tangents)
    return [dict(value, outputs_tangent=outs_t, params_tangent=params_t)
            for value, (outs_t, params_t) in zip(values, layer_tangents)]

  def update_cache(self, state: _BlockDiagonalState,
                   identity_weight: Numeric | Sequence[Numeric],
                   exact_powers: ScalarOrSequence = None,
                   approx_powers: ScalarOrSequence = None,
                   eigenvalues: bool = False,
                   pmap_axis_name: str | None = None) -> _BlockDiagonalState:
    self._require_finalized()
    weights = self._per_block(identity_weight, "identity_weight")
    fns = [functools.partial(b.update_cache, identity_weight=w,
                             exact_powers=_as_tuple(exact_powers),
                             approx_powers=_as_tuple(approx_powers),
                             eigenvalues=eigenvalues)
           for b, w in zip(self._blocks, weights)]
    costs = [distributed.refresh_cost(s) for s in state.blocks_states]
    axis = pmap_axis_name if self.distributed_cache_updates else None
    return self.State(tuple(distributed.map_blocks(
        fns, state.blocks_states, costs, axis)))

  def _blocks_matpower(self, which, states, vectors, weights, power,
                       exact_power, use_cached, pmap_axis_name):
    """The products of the blocks `which`, shared among the devices of
    `pmap_axis_name` when `distributed_multiplies`."""
    def product(block, weight):
      return lambda args: block.multiply_matpower(
          *args, weight, power, exact_power=exact_power, use_cached=use_cached)

    fns = [product(self._blocks[j], weights[j]) for j in which]
    args = [(states[j], vectors[j]) for j in which]
    costs = [distributed.product_cost(states[j], self._blocks[j].dim)
             for j in which]
    axis = pmap_axis_name if self.distributed_multiplies else None
    return dict(zip(which, distributed.map_blocks(fns, args, costs, axis)))

  # --- products ------------------------------------------------------------

  def multiply_matpower(self, state: _BlockDiagonalState,
                        parameter_structured_vector: Params,
                        identity_weight: Numeric | Sequence[Numeric],
                        power: float, exact_power: bool, use_cached: bool,
                        pmap_axis_name: str | None = None) -> Params:
    vectors = self.params_vector_to_blocks_vectors(parameter_structured_vector)
    weights = self._per_block(identity_weight, "identity_weight")
    results = self._blocks_matpower(
        range(self.num_blocks), state.blocks_states, vectors, weights, power,
        exact_power, use_cached, pmap_axis_name)
    return self.blocks_vectors_to_params_vector(
        tuple(results[j] for j in range(self.num_blocks)))

  def multiply_inverse_of_gradient(
      self, state: _BlockDiagonalState, grads: Params, func_args: FuncArgs,
      identity_weight: Numeric | Sequence[Numeric] = 0.0,
      exact_power: bool = True, use_cached: bool = False,
      pmap_axis_name: str | None = None) -> Params:
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
    chosen = []
    if use_cached and not exact_power:
      chosen = [j for j, b in enumerate(self._blocks)
                if b.outer_sum_is_cheaper()]
    if chosen:
      proc = self._value_traced.processed(func_args)
      same_tags = proc.layer_indices == self._jaxpr.layer_indices
      chosen = [j for j in chosen if same_tags
                and proc.params_reach_outputs_only_through_layer(j)]
    if not chosen:
      return self.multiply_inverse(state, grads, identity_weight,
                                   exact_power=exact_power,
                                   use_cached=use_cached)
    rows = dict(zip(chosen, tracer.layer_tags_value_vjp(
        self._value_traced, func_args, chosen)))
    vectors = self.params_vector_to_blocks_vectors(grads)
    weights = self._per_block(identity_weight, "identity_weight")
    results = self._blocks_matpower(
        [j for j in range(self.num_blocks) if j not in rows],
        state.blocks_states, vectors, weights, -1, exact_power, use_cached,
        pmap_axis_name)
    for j, block_rows in rows.items():
      # Each device has its own rows; the product is linear in the gradient,
      # so the mean of the devices' results is the result for the mean
      # gradient.
      result = self._blocks[j].multiply_inverse_outer_sum(
          state.blocks_states[j], *block_rows)
      if pmap_axis_name is not None:
        result = jax.lax.pmean(result, pmap_axis_name)
      results[j] = result
    return self.blocks_vectors_to_params_vector(
        tuple(results[j] for j in range(self.num_blocks)))

  def block_eigenvalues(self, state: _BlockDiagonalState,
                        use_cached: bool = False) -> tuple[jax.Array, ...]:
    """Each block's eigenvalues.

    Args:
      state: the estimator state.
      use_cached: whether to return the cached eigenvalues.

    Returns:
      One `(block_dim,)` array per block, in `blocks` order.
    """
    self._require_finalized()
    return tuple(b.eigenvalues(s, use_cached=use_cached)
                 for b, s in zip(self._blocks, state.blocks_states))

  def eigenvalues(self, state: _BlockDiagonalState,
                  use_cached: bool = False) -> jax.Array:
    """The blocks' eigenvalues concatenated in `blocks` order, unsorted."""
    return jnp.concatenate(self.block_eigenvalues(state, use_cached=use_cached))

  def to_dense_matrix(self, state: _BlockDiagonalState,
                      use_cached: bool = False,
                      identity_weight: Numeric | Sequence[Numeric] = 0.0,
                      exact_power: bool = True, power: float = 1) -> jax.Array:
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
    self._require_finalized()
    offsets = np.concatenate([[0], np.cumsum(self._param_sizes)])
    dtype = self._params_dtype
    matrix = jnp.zeros((self.dim, self.dim), dtype)
    shapes = self._param_shapes
    weights = self._per_block(identity_weight, "identity_weight")
    for block, s, idx, w in zip(self._blocks, state.blocks_states,
                                self._layer_indices, weights):
      sizes = [self._param_sizes[i] for i in idx]
      split = np.cumsum(sizes)[:-1]

      def apply(col, block=block, s=s, idx=idx, w=w, split=split):
        parts = jnp.split(col, split)
        vec = tuple(p.reshape(shapes[i]) for p, i in zip(parts, idx))
        out = block.multiply_matpower(s, vec, w, power,
                                      exact_power=exact_power,
                                      use_cached=use_cached)
        return jnp.concatenate([o.ravel() for o in out])

      dense = jax.vmap(apply, out_axes=1)(jnp.eye(sum(sizes), dtype=dtype))
      where = np.concatenate([np.arange(offsets[i], offsets[i + 1])
                              for i in idx])
      matrix = matrix.at[np.ix_(where, where)].set(dense)
    return matrix


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

  def __init__(self, func: Callable, params_index: int = 0,
               batch_index: int = 1,
               default_estimation_mode: str = "fisher_exact",
               layer_tag_to_block_ctor: Mapping[str, CurvatureBlockCtor]
               | None = None,
               index_to_block_ctor: Mapping[tuple[int, ...],
                                            CurvatureBlockCtor] | None = None,
               auto_register_tags: bool = True, **auto_register_kwargs):
    """Prepares the per-example tracing of `func`.

    Args:
      func: the model function, with at least one registered loss.
      params_index: which of `func`'s positional arguments are the
        parameters.
      batch_index: which of them is the batch, whose leading axis is split
        into examples.
      default_estimation_mode: one of `estimators.ESTIMATION_MODES`.
      layer_tag_to_block_ctor: the block of all parameters under the key
        "generic_tag" (default `ExplicitFull`).
      index_to_block_ctor: the same, keyed by all parameters' flat indices.
      auto_register_tags: whether the graph matcher tags the model's layers
        when it is traced (to check it; the estimate does not use them).
      **auto_register_kwargs: passed to the graph matcher.

    Raises:
      ValueError: for an unknown estimation mode.
    """
    super().__init__(func, params_index, default_estimation_mode,
                     layer_tag_to_block_ctor, index_to_block_ctor,
                     auto_register_tags, **auto_register_kwargs)
    self._batch_index = batch_index
    self._loss_vjp = tracer.loss_tags_vjp(func, params_index)

  @property
  def batch_index(self) -> int:
    """Which of `func`'s positional arguments is the batch."""
    return self._batch_index

  def layer_tag_to_block_ctor(self, layer_tag_eq: Any) -> CurvatureBlockCtor:
    """The block class of all parameters: the user's for "generic_tag", else
    `ExplicitFull`."""
    name = layer_tag_eq.primitive.name
    return (self._layer_tag_to_block_ctor.get(name)
            or curvature_blocks.ExplicitFull)

  def _finalize(self, func_args):
    func_args = tuple(func_args)
    if self._blocks is not None:
      _check_params_tree(self._params_tree, func_args[self.params_index],
                         "params argument")
      return
    if not 0 <= self._batch_index < len(func_args):
      raise ValueError(f"batch_index={self._batch_index} but the function "
                       f"takes {len(func_args)} arguments.")
    jaxpr = self._traced.processed(func_args)  # checks the registration
    leaves = jax.tree.leaves(func_args[self.params_index])
    # One generic tag over every parameter: the equation the block reads.
    tag_eqn = jax.make_jaxpr(lambda *p: tags.register_generic(*p))(
        *leaves).eqns[0]
    indices = tuple(range(len(leaves)))
    ctor = (self.index_to_block_ctor(indices)
            or self.layer_tag_to_block_ctor(tag_eqn))
    try:
      block = ctor(tag_eqn, "all parameters [generic_tag]")
    except (ValueError, TypeError, NotImplementedError) as e:
      raise ValueError(f"Cannot build a {getattr(ctor, '__name__', ctor)} "
                       f"block over all parameters: {e}") from e
    self._jaxpr = jaxpr
    self._set_structure((block,), jaxpr.params_tree,
                        [v.aval for v in jaxpr.params_vars_flat], [indices])

  def init(self, rng: jax.Array, func_args: FuncArgs,
           exact_powers_to_cache: ScalarOrSequence = None,
           approx_powers_to_cache: ScalarOrSequence = None,
           cache_eigenvalues: bool = False) -> _BlockDiagonalState:
    """As `BlockDiagonalCurvature.init`; an `ExplicitFull` block gets room
    for the rows of a batch like `func_args`' in the default mode."""
    state = super().init(rng, func_args, exact_powers_to_cache,
                         approx_powers_to_cache, cache_eigenvalues)
    block = self._blocks[0]
    if not isinstance(block, curvature_blocks.ExplicitFull):
      return state
    rows = jax.eval_shape(lambda: self._per_example_rows(
        jax.random.PRNGKey(0), tuple(func_args),
        self.default_estimation_mode)).shape[0]
    return self.State((block.with_factor_rows(state.blocks_states[0], rows),))

  def _per_example_rows(self, rng, func_args, mode):
    """Every example's gradient rows for `mode`, `(examples * samples, dim)`
    in `ravel_pytree` order."""
    batch = func_args[self._batch_index]
    num = default_batch_size_extractor(batch)

    def one_example(example, key):
      args = list(func_args)
      args[self._batch_index] = jax.tree.map(lambda x: x[None], example)
      losses, vjp = self._loss_vjp(tuple(args))
      tangents = estimation_modes.loss_tangents(losses, mode, key)
      grads = jax.vmap(vjp)(tangents)
      return jax.vmap(lambda g: jax.flatten_util.ravel_pytree(g)[0])(grads)

    rows = jax.vmap(one_example)(batch, jax.random.split(rng, num))
    return rows.reshape((-1, rows.shape[-1]))

  def update_curvature_matrix_estimate(
      self, state: _BlockDiagonalState, ema_old: Numeric, ema_new: Numeric,
      batch_size: Numeric, rng: jax.Array, func_args: FuncArgs,
      pmap_axis_name: str | None = None,
      estimation_mode: str | None = None,
      identity_weight: Numeric | None = None) -> _BlockDiagonalState:
    """As `CurvatureEstimator`'s: the block sees every example's rows as
    samples, averaged over `batch_size`."""
    del identity_weight  # the estimates do not depend on the damping
    func_args = tuple(func_args)
    self._finalize(func_args)
    rows = self._per_example_rows(rng, func_args, self._mode(estimation_mode))
    split = np.cumsum(self._param_sizes)[:-1]
    data = dict(params_tangent=tuple(
        part.reshape((rows.shape[0],) + shape) for part, shape in
        zip(jnp.split(rows, split, axis=1), self._param_shapes)))
    return self.State((update_block_estimate(
        self._blocks[0], state.blocks_states[0], data, ema_old, ema_new,
        batch_size, pmap_axis_name),))

  def eigenvalues(self, state: _BlockDiagonalState,
                  use_cached: bool = False) -> jax.Array:
    """The block's eigenvalues (ascending for `ExplicitFull`; see its Gram
    route, which needs a concrete state)."""
    return self.block_eigenvalues(state, use_cached=use_cached)[0]

  def to_dense_matrix(self, state: _BlockDiagonalState,
                      use_cached: bool = False,
                      identity_weight: Numeric | Sequence[Numeric] = 0.0,
                      exact_power: bool = True, power: float = 1) -> jax.Array:
    """As `BlockDiagonalCurvature.to_dense_matrix`; the estimate itself,
    without products, for an `ExplicitFull` block and the defaults."""
    block_state = state.blocks_states[0]
    if (isinstance(self._blocks[0], curvature_blocks.ExplicitFull)
        and not use_cached and power == 1
        and isinstance(identity_weight, (int, float)) and identity_weight == 0):
      return block_state.matrix.value
    return super().to_dense_matrix(state, use_cached, identity_weight,
                                   exact_power, power)


class ImplicitExactCurvature:
  """Exact curvature matrices used only through matrix-vector products.

  All products are with the curvature of the registered losses averaged over
  the batch: the Hessian `H`, the GGN `G = mean_i J_iᵀ H_i J_i` and the
  Fisher `F`. The factor `B` of `G` (or `F`) stacks `J_iᵀ B_i / sqrt(batch)`
  over the examples, `B_i` the loss's factor, so that `B Bᵀ = G`. The batch
  is the last of `func`'s arguments.
  """

  def __init__(self, func: Callable, params_index: int = 0,
               batch_size_extractor: Callable[[Any], int]
               = default_batch_size_extractor):
    """Prepares the loss tags' Jacobian and Hessian products of `func`.

    Args:
      func: the model function, with at least one registered loss.
      params_index: which of `func`'s positional arguments are the
        parameters.
      batch_size_extractor: maps the batch (`func`'s last argument) to its
        number of examples.
    """
    self.func = func
    self.params_index = params_index
    self._batch_size_extractor = batch_size_extractor
    self._vjp = tracer.loss_tags_vjp(func, params_index)
    self._jvp = tracer.loss_tags_jvp(func, params_index)
    self._hvp = tracer.loss_tags_hvp(func, params_index)

  def batch_size(self, func_args: FuncArgs) -> int:
    """The number of examples in `func_args`' batch (its last argument)."""
    return self._batch_size_extractor(func_args[-1])

  def multiply_hessian(self, func_args: FuncArgs,
                       parameter_structured_vector: Params) -> Params:
    """`H v`, `H` the Hessian of the batch-averaged loss w.r.t. the params.

    Args:
      func_args: the arguments of `func` to evaluate at.
      parameter_structured_vector: `v`, shaped like the parameters.

    Returns:
      The product, shaped like the parameters.
    """
    hvp, _ = self._hvp(func_args, parameter_structured_vector)
    return jax.tree.map(lambda x: x / self.batch_size(func_args), hvp)

  def multiply_jacobian_transpose(
      self, func_args: FuncArgs,
      loss_input_vectors: Sequence[Sequence[jax.Array]]) -> Params:
    """`Jᵀ u`, `J` the Jacobian of the losses' inputs w.r.t. the params.

    Args:
      func_args: the arguments of `func` to evaluate at.
      loss_input_vectors: `u`: for each registered loss, one array per
        parameter-dependent input, shaped like it.

    Returns:
      The product (not divided by the batch size), shaped like the params.
    """
    _, vjp = self._vjp(func_args)
    return vjp(loss_input_vectors)

  def _jacobian_products(self, func_args, vector):
    """The losses, `J v` and `u -> Jᵀ u`, from one forward pass.

    `J v` is the transpose of the VJP, so the two products share one set of
    activations (which matters where they are kept for many products).
    """
    losses, vjp = self._vjp(func_args)
    like = tuple(tuple(loss.parameter_dependants) for loss in losses)
    tangents, = jax.linear_transpose(vjp, like)(vector)
    return losses, tangents, vjp

  def _multiply(self, func_args, vector, kind):
    losses, tangents, vjp = self._jacobian_products(func_args, vector)
    products = tuple(
        loss.multiply_fisher(t) if kind == "fisher" else loss.multiply_ggn(t)
        for loss, t in zip(losses, tangents))
    return jax.tree.map(lambda x: x / self.batch_size(func_args),
                        vjp(products))

  def multiply_fisher(self, func_args: FuncArgs,
                      parameter_structured_vector: Params) -> Params:
    """`F v`, `F` the Fisher of the batch-averaged loss w.r.t. the params.

    Args:
      func_args: the arguments of `func` to evaluate at.
      parameter_structured_vector: `v`, shaped like the parameters.

    Returns:
      The product, shaped like the parameters.
    """
    return self._multiply(func_args, parameter_structured_vector, "fisher")

  def multiply_ggn(self, func_args: FuncArgs,
                   parameter_structured_vector: Params) -> Params:
    """`G v`, `G` the GGN of the batch-averaged loss w.r.t. the params.

    Args:
      func_args: the arguments of `func` to evaluate at.
      parameter_structured_vector: `v`, shaped like the parameters.

    Returns:
      The product, shaped like the parameters.
    """
    return self._multiply(func_args, parameter_structured_vector, "ggn")

  def multiply_empirical_fisher(self, func_args: FuncArgs,
                                parameter_structured_vector: Params
                                ) -> Params:
    """`E v`, `E` the empirical Fisher at the data targets.

    `E = mean_i d_i d_iᵀ`, where `d_i` is the parameter gradient of example
    i's loss (summed over the registered losses, weights included). With
    `g_li` the gradient of loss l w.r.t. its inputs for example i, one JVP
    gives `t_li = J_li v`, the per-example scalars `s_i = Σ_l g_liᵀ t_li`
    scale `g_li`, and one VJP maps them back: no per-example parameter
    gradient is formed. As `d_i` sums over the losses, the product holds
    the cross terms between them, not only each loss's own term.

    Args:
      func_args: the arguments of `func` to evaluate at; every registered
        loss must carry its targets.
      parameter_structured_vector: `v`, shaped like the parameters.

    Returns:
      The product, shaped like the parameters.

    Raises:
      ValueError: if a loss was registered without targets, or the losses'
        inputs do not share one leading (batch) axis.
    """
    losses, tangents, vjp = self._jacobian_products(
        func_args, parameter_structured_vector)
    grads = []
    for loss in losses:
      if loss.targets is None:
        raise ValueError(
            "The empirical Fisher needs the data targets, but a "
            f"{type(loss).__name__} was registered without them: pass "
            "targets= to its register_* call.")
      grads.append(loss.grad_of_evaluate(None, "regular"))
    leading = {x.shape[0] for gs in grads for x in gs}
    if len(leading) != 1:
      raise ValueError(
          "The empirical Fisher needs per-example gradients, but the "
          f"registered losses' inputs have leading axes {sorted(leading)}: "
          "give every loss input the batch as its leading axis.")
    # s_i: the directional derivative of example i's total loss along v.
    per_example = sum(
        jnp.sum(g * t, axis=tuple(range(1, g.ndim)))
        for gs, ts in zip(grads, tangents) for g, t in zip(gs, ts))
    products = tuple(
        tuple(g * per_example.reshape((-1,) + (1,) * (g.ndim - 1))
              for g in gs)
        for gs in grads)
    return jax.tree.map(lambda x: x / self.batch_size(func_args),
                        vjp(products))

  def _factor_transpose(self, func_args, vector, kind):
    losses, tangents = self._jvp(func_args, vector)
    scale = 1 / jnp.sqrt(self.batch_size(func_args))
    return tuple(
        scale * (loss.multiply_fisher_factor_transpose(t) if kind == "fisher"
                 else loss.multiply_ggn_factor_transpose(t))
        for loss, t in zip(losses, tangents))

  def multiply_fisher_factor_transpose(
      self, func_args: FuncArgs,
      parameter_structured_vector: Params) -> tuple[jax.Array, ...]:
    """`Bᵀ v` for the factor `B` with `B Bᵀ = F`.

    Args:
      func_args: the arguments of `func` to evaluate at.
      parameter_structured_vector: `v`, shaped like the parameters.

    Returns:
      One array per registered loss, of its `fisher_factor_inner_shape`.
    """
    return self._factor_transpose(func_args, parameter_structured_vector,
                                  "fisher")

  def multiply_ggn_factor_transpose(
      self, func_args: FuncArgs,
      parameter_structured_vector: Params) -> tuple[jax.Array, ...]:
    """`Bᵀ v` for the factor `B` with `B Bᵀ = G`.

    Args:
      func_args: the arguments of `func` to evaluate at.
      parameter_structured_vector: `v`, shaped like the parameters.

    Returns:
      One array per registered loss, of its `ggn_factor_inner_shape`.
    """
    return self._factor_transpose(func_args, parameter_structured_vector,
                                  "ggn")

  def _factor(self, func_args, loss_inner_vectors, kind):
    losses, vjp = self._vjp(func_args)
    if len(loss_inner_vectors) != len(losses):
      raise ValueError(f"Got {len(loss_inner_vectors)} inner vectors for "
                       f"{len(losses)} registered losses.")
    products = tuple(
        loss.multiply_fisher_factor(v) if kind == "fisher"
        else loss.multiply_ggn_factor(v)
        for loss, v in zip(losses, loss_inner_vectors))
    scale = 1 / jnp.sqrt(self.batch_size(func_args))
    return jax.tree.map(lambda x: scale * x, vjp(products))

  def multiply_fisher_factor(self, func_args: FuncArgs,
                             loss_inner_vectors: Sequence[jax.Array]
                             ) -> Params:
    """`B u` for the factor `B` with `B Bᵀ = F`.

    Args:
      func_args: the arguments of `func` to evaluate at.
      loss_inner_vectors: `u`: one array per registered loss, of its
        `fisher_factor_inner_shape`.

    Returns:
      The product, shaped like the parameters.

    Raises:
      ValueError: if there is not one vector per loss.
    """
    return self._factor(func_args, loss_inner_vectors, "fisher")

  def multiply_ggn_factor(self, func_args: FuncArgs,
                          loss_inner_vectors: Sequence[jax.Array]) -> Params:
    """`B u` for the factor `B` with `B Bᵀ = G`.

    Args:
      func_args: the arguments of `func` to evaluate at.
      loss_inner_vectors: `u`: one array per registered loss, of its
        `ggn_factor_inner_shape`.

    Returns:
      The product, shaped like the parameters.

    Raises:
      ValueError: if there is not one vector per loss.
    """
    return self._factor(func_args, loss_inner_vectors, "ggn")

  def get_loss_inner_vector_shapes_and_batch_size(
      self, func_args: FuncArgs,
      mode: str) -> tuple[tuple[tuple[int, ...], ...], int]:
    """The shapes the factor products take, and the batch size.

    Args:
      func_args: the arguments of `func`.
      mode: "fisher" or "ggn".

    Returns:
      Each registered loss's factor inner shape, and the batch size.

    Raises:
      ValueError: for another mode.
    """
    if mode not in ("fisher", "ggn"):
      raise ValueError(f"mode must be 'fisher' or 'ggn', got {mode!r}.")
    losses, _ = self._vjp(func_args)
    shapes = tuple(tuple(getattr(loss, f"{mode}_factor_inner_shape"))
                   for loss in losses)
    return shapes, self.batch_size(func_args)

  def get_loss_input_shapes_and_batch_size(
      self, func_args: FuncArgs
  ) -> tuple[tuple[tuple[tuple[int, ...], ...], ...], int]:
    """The shapes of the losses' inputs, and the batch size.

    Args:
      func_args: the arguments of `func`.

    Returns:
      For each registered loss the shapes of its parameter-dependent
      inputs, and the batch size.
    """
    losses, _ = self._vjp(func_args)
    shapes = tuple(tuple(tuple(x.shape) for x in loss.parameter_dependants)
                   for loss in losses)
    return shapes, self.batch_size(func_args)

  def to_dense_matrix(self, func_args: FuncArgs,
                      mat_type: str = "ggn") -> jax.Array:
    """An exact curvature matrix formed column by column, for small models.

    Args:
      func_args: the arguments of `func` to evaluate at.
      mat_type: "hessian", "fisher", "ggn" or "empirical_fisher".

    Returns:
      A `(dim, dim)` array in `ravel_pytree` order.

    Raises:
      ValueError: for another matrix type.
    """
    products = dict(hessian=self.multiply_hessian, fisher=self.multiply_fisher,
                    ggn=self.multiply_ggn,
                    empirical_fisher=self.multiply_empirical_fisher)
    if mat_type not in products:
      raise ValueError(f"mat_type must be one of {sorted(products)}, got "
                       f"{mat_type!r}.")
    params = func_args[self.params_index]
    flat, unravel = jax.flatten_util.ravel_pytree(params)

    def column(e):
      return jax.flatten_util.ravel_pytree(
          products[mat_type](func_args, unravel(e)))[0]

    return jax.vmap(column, out_axes=1)(jnp.eye(flat.size, dtype=flat.dtype))
