"""What every curvature estimator provides, and the block defaults they share.

Parameter vectors are pytrees shaped like the model's params. Dense exports
(`to_dense_matrix`) and `dim` use the order of `jax.flatten_util.ravel_pytree`
(the params' leaves in tree order, each raveled).
"""

from __future__ import annotations

import abc
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, cast

import jax
import jax.numpy as jnp
import numpy as np

from estimators import blocks as curvature_blocks
from estimators import estimation_modes, tracer, utils
from estimators.blocks.base import Numeric, ScalarOrSequence
from estimators.utils.types import FuncArgs, Params, StateType

CurvatureBlockCtor = Callable[..., curvature_blocks.CurvatureBlock]

_DEFAULT_TAG_TO_BLOCK_CTOR: dict[str, CurvatureBlockCtor] = {
  "dense_tag": curvature_blocks.DenseTwoKroneckerFactored,
  "repeated_dense_tag": curvature_blocks.RepeatedDenseTwoKroneckerFactored,
  "conv2d_tag": curvature_blocks.Conv2DTwoKroneckerFactored,
  "generic_tag": curvature_blocks.NaiveDiagonal,
  "scale_and_shift_tag": curvature_blocks.ScaleAndShiftDiagonal,
  "embedding_tag": curvature_blocks.EmbeddingKFAC,
}


def canonical_tag_name(tag_name: str) -> str:
  """A tag's primitive name: "dense" (KFAC-JAX's layer variant name) and
  "dense_tag" both give "dense_tag"."""
  return tag_name if tag_name.endswith("_tag") else f"{tag_name}_tag"


def set_default_tag_to_block_ctor(
  tag_name: str, block_ctor: CurvatureBlockCtor
) -> None:
  """Sets the block class used by default for layers with this tag name.

  Args:
    tag_name: a layer tag primitive's name, e.g. "dense_tag", or KFAC-JAX's
      variant name, e.g. "dense".
    block_ctor: called as `block_ctor(layer_tag_eq, name)` (or with the
      equation alone when it takes one argument) to build a block.
  """
  _DEFAULT_TAG_TO_BLOCK_CTOR[canonical_tag_name(tag_name)] = block_ctor


def set_multi_default_tag_to_block_ctor(
  tags_to_block_ctor: Mapping[str, CurvatureBlockCtor],
) -> None:
  """`set_default_tag_to_block_ctor` for each entry of a mapping.

  Args:
    tags_to_block_ctor: block constructors by tag name.
  """
  for tag_name, block_ctor in tags_to_block_ctor.items():
    set_default_tag_to_block_ctor(tag_name, block_ctor)


def get_default_tag_to_block_ctor(tag_name: str) -> CurvatureBlockCtor | None:
  """The block class used by default for a tag name.

  Args:
    tag_name: a layer tag primitive's name, e.g. "dense_tag", or KFAC-JAX's
      variant name, e.g. "dense".

  Returns:
    The block constructor, or None for an unknown tag.
  """
  return _DEFAULT_TAG_TO_BLOCK_CTOR.get(canonical_tag_name(tag_name))


def build_block(
  ctor: CurvatureBlockCtor, layer_tag_eq: Any, name: str
) -> curvature_blocks.CurvatureBlock:
  """`ctor(layer_tag_eq, name)`, or `ctor(layer_tag_eq)` for a constructor
  written for KFAC-JAX, which passes the equation alone."""
  try:
    signature = inspect.signature(ctor)
  except (TypeError, ValueError):
    return ctor(layer_tag_eq, name)
  try:
    signature.bind(layer_tag_eq, name)
  except TypeError:
    return ctor(layer_tag_eq)
  return ctor(layer_tag_eq, name)


def powers_tuple(powers) -> tuple:
  """Matrix powers as a tuple: None is none, a number is one."""
  if powers is None:
    return ()
  if isinstance(powers, (int, float)):
    return (powers,)
  return tuple(powers)


def _map_averages(fn, state):
  """`state` with `fn` applied to each of its moving averages."""
  is_average = lambda x: isinstance(x, utils.WeightedMovingAverage)
  return jax.tree.map(
    lambda x: fn(x) if is_average(x) else x, state, is_leaf=is_average
  )


def _copied_averages(state):
  """`state` with a private copy of each moving average: blocks written to
  the reference's guide `update` them in place, which must not change the
  caller's state."""
  return _map_averages(lambda x: type(x).from_raw(x.weight, x.raw_value), state)


def update_block_estimate(
  block: curvature_blocks.CurvatureBlock,
  state: Any,
  estimation_data: Mapping[str, tuple],
  ema_old: Numeric,
  ema_new: Numeric,
  batch_size: Numeric,
  pmap_axis_name: str | None = None,
  identity_weight: Numeric | None = None,
) -> Any:
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
    identity_weight: the damping, for blocks whose update takes it (by
      keyword, as KFAC-JAX passes it).

  Returns:
    The block's new state.
  """
  if block.estimation_data_has_sample_axis:
    return block.update_curvature_matrix_estimate(
      state,
      estimation_data,
      ema_old,
      ema_new,
      batch_size,
      pmap_axis_name,
      identity_weight=identity_weight,
    )
  # A block written to a guide: pass what its signature names.
  accepted = inspect.signature(block.update_curvature_matrix_estimate)
  takes_all = any(
    p.kind is inspect.Parameter.VAR_KEYWORD
    for p in accepted.parameters.values()
  )
  extra: dict[str, Any] = {}
  if takes_all or "identity_weight" in accepted.parameters:
    extra["identity_weight"] = identity_weight
  if takes_all or "pmap_axis_name" in accepted.parameters:
    extra["pmap_axis_name"] = pmap_axis_name
  tangents = ("outputs_tangent", "params_tangent")
  num = jax.tree.leaves([estimation_data[k] for k in tangents])[0].shape[0]

  def one_sample(state, sample, ema_old):
    data = dict(estimation_data)
    for key in tangents:
      data[key] = tuple(
        t[sample] * np.sqrt(num).astype(t.dtype) for t in estimation_data[key]
      )
    return block.update_curvature_matrix_estimate(
      _copied_averages(state),
      data,
      ema_old=ema_old,
      ema_new=ema_new / num,
      batch_size=batch_size,
      **extra,
    )

  state = one_sample(state, 0, ema_old)
  return jax.lax.fori_loop(1, num, lambda s, st: one_sample(st, s, 1.0), state)


def check_params_tree(expected, vector, what):
  """Refuses a `vector` whose tree structure is not `expected`."""
  got = jax.tree.structure(vector)
  if got != expected:
    raise ValueError(
      f"The {what} does not have the structure of the model's "
      f"params: expected {expected}, got {got}."
    )


class CurvatureEstimator(abc.ABC, Generic[StateType]):
  """What every estimator provides: estimate updates, products, eigenvalues.

  The state holds the estimate `C` of the curvature of `func`'s registered
  losses (averaged over the batch) w.r.t. `func_args[params_index]`, plus a
  cache of values derived from it (matrix powers, eigenvalues). The cache is
  refreshed only by `update_cache`, so with `use_cached=True` results may be
  older than the estimate. Methods take a state and return a new one.

  Attributes:
    func: the model function, with at least one registered loss.
    func_and_grad: the function returning `(value, gradient)`, when the
      estimator was built from one (else None).
    params_index: which of `func`'s positional arguments are the parameters.
    batch_index: which of them is the batch.
    default_estimation_mode: the mode `update_curvature_matrix_estimate`
      uses when given none.
  """

  def __init__(
    self,
    func: Callable | None = None,
    func_and_grad: Callable | None = None,
    params_index: int = 0,
    batch_index: int = 1,
    default_estimation_mode: str | None = "ggn_curvature_prop",
  ):
    """Stores the model function and checks the estimation mode.

    Args:
      func: the model function, with at least one registered loss,
        returning only the loss value. Give it or `func_and_grad`.
      params_index: which of `func`'s positional arguments are the
        parameters.
      default_estimation_mode: one of `valid_estimation_modes`; None means
        "ggn_curvature_prop", as in KFAC-JAX.
      func_and_grad: instead of `func`, a function returning the loss value
        and its gradient w.r.t. the parameters, as `(value, grad)`; its
        value is the model function, and its gradient is what the
        `fisher_empirical_direct*` modes use.
      batch_index: which of the function's positional arguments is the
        batch.

    Raises:
      ValueError: unless exactly one of `func` and `func_and_grad` is
        given, or for an estimation mode this estimator does not support.
    """
    if (func is None) == (func_and_grad is None):
      raise ValueError(
        "Give exactly one of func (the loss function) and func_and_grad (a "
        "function returning the loss and its gradient)."
      )
    if func is None:
      value_and_grad = cast(Callable, func_and_grad)

      def func(*args, **kwargs):
        return value_and_grad(*args, **kwargs)[0]

    self.func = func
    self.func_and_grad = func_and_grad
    self.params_index = params_index
    self.batch_index = batch_index
    # KFAC-JAX's estimators read None as "ggn_curvature_prop".
    self.default_estimation_mode = self._mode(
      default_estimation_mode or "ggn_curvature_prop"
    )

  @property
  def valid_estimation_modes(self) -> tuple[str, ...]:
    """The estimation modes this estimator supports."""
    return estimation_modes.ESTIMATION_MODES

  def compute_func_from_registered(
    self, func_args: FuncArgs, batch_size: Numeric
  ) -> jax.Array:
    """The sum of the registered losses' per-example values (with their
    weights) divided by `batch_size`: the function value the registration
    describes.

    Args:
      func_args: the arguments of `func`.
      batch_size: the number of examples to divide by.

    Returns:
      A scalar.
    """
    losses, _ = tracer.loss_tags_vjp(self.func, self.params_index)(
      tuple(func_args)
    )
    total = jnp.sum(
      jnp.stack(
        [
          jnp.sum(loss.evaluate(None, coefficient_mode="regular"))
          for loss in losses
        ]
      )
    )
    return total / batch_size

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
  def init(
    self,
    rng: jax.Array,
    func_args: FuncArgs,
    exact_powers_to_cache: ScalarOrSequence,
    approx_powers_to_cache: ScalarOrSequence,
    cache_eigenvalues: bool = False,
  ) -> Any:
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
    self,
    state: Any,
    ema_old: Numeric,
    ema_new: Numeric,
    batch_size: Numeric,
    rng: jax.Array,
    func_args: FuncArgs,
    pmap_axis_name: str | None = None,
    estimation_mode: str | None = None,
    identity_weight: Numeric | None = None,
  ) -> Any:
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
  def update_cache(
    self,
    state: Any,
    identity_weight: Numeric,
    exact_powers: ScalarOrSequence,
    approx_powers: ScalarOrSequence,
    eigenvalues: bool,
    pmap_axis_name: str | None = None,
    norm_to_scale_identity_weight_per_block: str | None = None,
  ) -> Any:
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
      norm_to_scale_identity_weight_per_block: None (or "none"), or a kind
        from `blocks.norms.NORM_TYPES`: each block's identity weight is then
        multiplied by that norm of the block (`CurvatureBlock.norm`).

    Returns:
      The state with the refreshed cache entries.
    """

  @abc.abstractmethod
  def multiply_matpower(
    self,
    state: Any,
    parameter_structured_vector: Params,
    identity_weight: Numeric | Sequence[Numeric],
    power: float,
    exact_power: bool,
    use_cached: bool,
    pmap_axis_name: str | None = None,
    norm_to_scale_identity_weight_per_block: str | None = None,
  ) -> Params:
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
      norm_to_scale_identity_weight_per_block: as for `update_cache`; with
        `use_cached=True` the weight of the last `update_cache` applies.

    Returns:
      The product, shaped like the parameters.
    """

  def _multiply_power(
    self,
    state,
    parameter_structured_vector,
    identity_weight,
    power,
    exact_power,
    use_cached,
    pmap_axis_name,
    norm_to_scale_identity_weight_per_block,
  ) -> Params:
    """`multiply_matpower`, passing the per-block norm only when it is set:
    estimators written before the option existed do not take it."""
    extra = {}
    if norm_to_scale_identity_weight_per_block is not None:
      extra["norm_to_scale_identity_weight_per_block"] = (
        norm_to_scale_identity_weight_per_block
      )
    return self.multiply_matpower(
      state,
      parameter_structured_vector,
      identity_weight,
      power,
      exact_power=exact_power,
      use_cached=use_cached,
      pmap_axis_name=pmap_axis_name,
      **extra,
    )

  def multiply(
    self,
    state: Any,
    parameter_structured_vector: Params,
    identity_weight: Numeric | Sequence[Numeric] = 0.0,
    exact_power: bool = True,
    use_cached: bool = False,
    pmap_axis_name: str | None = None,
    norm_to_scale_identity_weight_per_block: str | None = None,
  ) -> Params:
    """`(C + identity_weight I) @ v`; see `multiply_matpower`."""
    return self._multiply_power(
      state,
      parameter_structured_vector,
      identity_weight,
      1,
      exact_power,
      use_cached,
      pmap_axis_name,
      norm_to_scale_identity_weight_per_block,
    )

  def multiply_inverse(
    self,
    state: Any,
    parameter_structured_vector: Params,
    identity_weight: Numeric | Sequence[Numeric] = 0.0,
    exact_power: bool = True,
    use_cached: bool = False,
    pmap_axis_name: str | None = None,
    norm_to_scale_identity_weight_per_block: str | None = None,
  ) -> Params:
    """`(C + identity_weight I) ** -1 @ v`; see `multiply_matpower`."""
    return self._multiply_power(
      state,
      parameter_structured_vector,
      identity_weight,
      -1,
      exact_power,
      use_cached,
      pmap_axis_name,
      norm_to_scale_identity_weight_per_block,
    )

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
      f"{type(self).__name__} does not provide to_dense_matrix."
    )

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
    if not utils.in_pmap(pmap_axis_name):
      return state
    return _map_averages(lambda x: jax.lax.pmean(x, pmap_axis_name), state)

  def _mode(self, estimation_mode):
    return estimation_modes.check_estimation_mode(
      estimation_mode or self.default_estimation_mode,
      self.valid_estimation_modes,
    )
