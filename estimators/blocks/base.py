"""`CurvatureBlock`: the public methods every block shares.

A block approximates the curvature of one layer tag. The base class owns the
public surface (argument checks, the block scale, the cache and its fixed key
set); a family implements a few private hooks:

  `_init(rng, exact_powers, approx_powers, cache_eigenvalues)`  initial state
  `_batch_statistics(estimation_data, batch_size)`  this batch's statistics
  `_fold_statistics(state, stats, ema_old, ema_new)`  moving-average update
  `_multiply_matpower_unscaled(state, vector, identity_weight, power,
                               exact_power, use_cached)`
  `_eigenvalues_unscaled(state)`
  `_update_cache(state, identity_weight, exact_powers, approx_powers,
                 eigenvalues, state_scale)`  new values of cache entries

The base passes the flags and the state scale by keyword, so overrides keep
these parameter names.

Scaling convention: the curvature is `scale * M` with `M` the unscaled
estimate and `scale = fixed_scale() * state_dependent_scale(state)`. Hooks work
on `M` with the identity weight divided by the scale, and the base multiplies
results by `scale ** power`. Cached entries already contain the state
dependent scale (they are values for `state_scale * M + identity_weight I`),
so cached products are only rescaled by the fixed scale.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from estimators import tags, utils
from estimators.blocks import norms

# Numeric: weights, scales, EMA factors. Scalar: a power. ScalarOrSequence:
# what `init` and `update_cache` accept for powers (None, one or several).
from estimators.utils.types import Array, Numeric, Scalar, ScalarOrSequence

# A vector of a block: one array per parameter, shaped like it.
BlockVector = tuple[jax.Array, ...]

_MAX_PARALLEL_ELEMENTS = 2**23
_DEFAULT_EIGEN_DECOMPOSITION_THRESHOLD = 5


def set_max_parallel_elements(value: int) -> None:
  """Sets the default element budget for work done in parallel.

  `Conv2DDiagonal` and `Conv2DFull` blocks built without
  `max_elements_for_vmap` vmap over this many examples at a time (and loop
  over the rest); `Conv2DTwoKroneckerFactored` forms its patches explicitly
  when they have at most this many elements. Larger values use more memory.

  Args:
    value: a positive int.
  """
  global _MAX_PARALLEL_ELEMENTS
  if not isinstance(value, numbers.Integral) or value < 1:
    raise ValueError(
      f"max parallel elements must be a positive int, got {value!r}."
    )
  _MAX_PARALLEL_ELEMENTS = int(value)


def get_max_parallel_elements() -> int:
  """The budget set by `set_max_parallel_elements` (default 2**23)."""
  return _MAX_PARALLEL_ELEMENTS


def set_default_eigen_decomposition_threshold(value: int) -> None:
  """Sets when `Full` blocks cache an eigendecomposition instead of powers.

  Args:
    value: a non-negative int. A `Full` block built without
      `eigen_decomposition_threshold` and asked at `init` to cache more powers
      than this caches one eigendecomposition, from which it forms every
      power.
  """
  global _DEFAULT_EIGEN_DECOMPOSITION_THRESHOLD
  if not isinstance(value, numbers.Integral) or value < 0:
    raise ValueError(
      "the eigen decomposition threshold must be a non-negative "
      f"int, got {value!r}."
    )
  _DEFAULT_EIGEN_DECOMPOSITION_THRESHOLD = int(value)


def get_default_eigen_decomposition_threshold() -> int:
  """The threshold set by `set_default_eigen_decomposition_threshold` (5)."""
  return _DEFAULT_EIGEN_DECOMPOSITION_THRESHOLD


def canonical_power(power: Scalar) -> int | float:
  """A static matrix power as an int when integral, else a float."""
  if utils.is_tracer(power):
    raise ValueError(
      "Matrix powers must be Python numbers known at trace time "
      "(they select cache entries and code paths); got a traced "
      "value."
    )
  try:
    value = float(power)
  except (TypeError, ValueError):
    raise ValueError(
      f"A matrix power must be a real number, got {power!r}."
    ) from None
  if isinstance(power, bool) or not math.isfinite(value):
    raise ValueError(
      f"A matrix power must be a finite real number, got {power!r}."
    )
  return int(value) if value.is_integer() else value


def canonical_powers(powers: ScalarOrSequence) -> tuple[int | float, ...]:
  """None, a number or a sequence of numbers -> a tuple of distinct powers."""
  if powers is None:
    return ()
  if isinstance(powers, (Sequence, np.ndarray)) and not isinstance(powers, str):
    items = list(powers)
  else:
    items = [powers]
  return tuple(dict.fromkeys(canonical_power(p) for p in items))


def to_real_set(number_or_sequence: ScalarOrSequence) -> set[Scalar]:
  """None, a real number or a sequence of them, as a set of numbers.

  Args:
    number_or_sequence: what `init` and `update_cache` take for powers.

  Returns:
    The set of the numbers (empty for None).

  Raises:
    ValueError: for anything else.
  """
  if number_or_sequence is None:
    return set()
  if isinstance(number_or_sequence, set):
    return number_or_sequence
  if isinstance(number_or_sequence, (int, float)):
    return {number_or_sequence}
  if isinstance(number_or_sequence, Sequence) and all(
    isinstance(x, (int, float)) for x in number_or_sequence
  ):
    return set(number_or_sequence)
  raise ValueError(
    "Expected a real number or a sequence of real numbers, got "
    f"{type(number_or_sequence).__name__}."
  )


def cache_key(power: float, exact: bool) -> str:
  """The cache key of a power, e.g. "exact_pow_-1" or "approx_pow_0.5"."""
  return f"{'exact' if exact else 'approx'}_pow_{canonical_power(power)}"


def power_cache_keys(
  exact_powers: Sequence[float], approx_powers: Sequence[float]
) -> list[tuple[str, Any]]:
  """(cache key, power) for each exact and approximate power."""
  return [(cache_key(p, exact=True), p) for p in exact_powers] + [
    (cache_key(p, exact=False), p) for p in approx_powers
  ]


def _concrete_float(value):
  """The value of a concrete scalar, or None for tracers and arrays."""
  if utils.is_tracer(value) or np.ndim(value) != 0:
    return None
  try:
    return float(value)
  except (TypeError, ValueError):
    return None


class CurvatureBlock(abc.ABC):
  """Approximates the curvature of one layer tag; see the module docstring.

  The block is a `(dim, dim)` matrix over the tag's parameters. Its vectors
  are tuples with one array per parameter, shaped as `parameters_shapes`.
  All methods are pure: they take a state and return a new one.
  """

  @jax.tree_util.register_dataclass
  @dataclasses.dataclass(frozen=True)
  class State:
    """Block state; families add their statistics as further fields.

    Attributes:
      cache: maps keys such as `"exact_pow_-1"` or `"eigenvalues"` to values that
        only `update_cache` refreshes, so they may be older than the
        statistics. The key set is fixed by `init`.
    """

    cache: dict[str, Any]

  # Estimation data keys a family reads (checked before `_batch_statistics`).
  _REQUIRED_DATA: tuple[str, ...] = ()
  # Tag primitives the block understands; None accepts any layer tag.
  _TAG_PRIMITIVES: tuple[tags.LayerTag, ...] | None = None
  # Whether an undamped estimate is commonly singular (blocks fitted to data).
  _MAY_BE_SINGULAR = True
  # Whether `update_curvature_matrix_estimate` takes every sample's tangents
  # at once, with a leading sample axis (the library's blocks, in one
  # vmapped pass), or one sample at a time, shaped `(batch, ...)` as in the
  # reference's guide to writing a block. A subclass overriding that method
  # is fed one sample at a time unless its own body sets this to True.
  estimation_data_has_sample_axis: bool = True
  # Whether the statistics are held in a basis that `update_cache`
  # recomputes (EKFAC's): an estimate meant as the mean over many batches
  # then takes a second pass over them, in the basis of the first.
  statistics_in_cached_basis: bool = False

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    if "update_curvature_matrix_estimate" in vars(
      cls
    ) and "estimation_data_has_sample_axis" not in vars(cls):
      cls.estimation_data_has_sample_axis = False

  def __init__(self, layer_tag_eq: Any, name: str | None = None):
    """Checks that the family can handle the tag equation.

    Args:
      layer_tag_eq: the jaxpr equation of a layer tag, as the tracer finds it.
      name: the block's name in messages, e.g. its parameters' path; None
        takes the name in the equation's `meta`, else names it after the tag
        and its parameters' shapes (as when KFAC-JAX code builds a block
        from the equation alone).

    Raises:
      TypeError: if `layer_tag_eq` is not a layer tag equation.
      ValueError: if the family does not handle this tag or layer.
    """
    if not tags.is_layer_tag_eqn(layer_tag_eq):
      primitive = getattr(layer_tag_eq, "primitive", None)
      raise TypeError(
        f"{type(self).__name__} needs a layer tag equation, got "
        f"one with primitive {primitive}."
      )
    if (
      self._TAG_PRIMITIVES is not None
      and layer_tag_eq.primitive not in self._TAG_PRIMITIVES
    ):
      wanted = ", ".join(p.name for p in self._TAG_PRIMITIVES)
      raise ValueError(
        f"{type(self).__name__} handles {wanted} equations, not "
        f"{layer_tag_eq.primitive.name} (block {name!r})."
      )
    meta = layer_tag_eq.params.get("meta")
    name = name or getattr(meta, "name", None)
    if name is None:
      shapes = [
        tuple(v.aval.shape) for v in tags.layer_eqn_parts(layer_tag_eq)[2]
      ]
      name = f"{layer_tag_eq.primitive.name} {shapes}"
    # The equation carries the block's name, as KFAC-JAX 0.0.8's does.
    self._layer_tag_eq = tags.named_layer_eqn(layer_tag_eq, name)
    self._name = name
    self._parameter_positions: tuple[int, ...] | None = None
    if not self.parameter_variables:
      raise ValueError(f"Block {name!r}: the tag has no parameters.")
    self._check_layer()

  def _check_layer(self) -> None:  # noqa: B027 - a hook; checks nothing here
    """Hook for layer-specific validation of the tag equation."""

  # --- properties of the tagged layer ------------------------------------

  @property
  def name(self) -> str:
    """The name given at construction."""
    return self._name

  @property
  def layer_tag_eq(self) -> Any:
    """The layer tag's jaxpr equation."""
    return self._layer_tag_eq

  @property
  def layer_tag_primitive(self) -> tags.LayerTag:
    """The tag primitive, e.g. `tags.dense`."""
    return self._layer_tag_eq.primitive

  @property
  def outputs_variables(self) -> tuple:
    """The jaxpr variables of the layer's outputs."""
    return tags.layer_eqn_parts(self._layer_tag_eq)[0]

  @property
  def inputs_variables(self) -> tuple:
    """The jaxpr variables of the layer's inputs."""
    return tags.layer_eqn_parts(self._layer_tag_eq)[1]

  @property
  def parameter_variables(self) -> tuple:
    """The jaxpr variables of the layer's parameters."""
    return tags.layer_eqn_parts(self._layer_tag_eq)[2]

  @property
  def outputs_shapes(self) -> tuple[tuple[int, ...], ...]:
    """Shapes of the layer's outputs (batch axis first)."""
    return tuple(tuple(v.aval.shape) for v in self.outputs_variables)

  @property
  def inputs_shapes(self) -> tuple[tuple[int, ...], ...]:
    """Shapes of the layer's inputs (batch axis first)."""
    return tuple(tuple(v.aval.shape) for v in self.inputs_variables)

  @property
  def parameters_shapes(self) -> tuple[tuple[int, ...], ...]:
    """Shapes of the parameters, which block vectors must have."""
    return tuple(tuple(v.aval.shape) for v in self.parameter_variables)

  @property
  def parameters_dtype(self) -> jnp.dtype:
    """The common dtype of the parameters; the block computes in it."""
    return jnp.result_type(*[v.aval.dtype for v in self.parameter_variables])

  @property
  def dtype(self) -> jnp.dtype:
    """The parameters' dtype (KFAC-JAX's name for `parameters_dtype`)."""
    return self.parameters_dtype

  @property
  def parameters_canonical_order(self) -> tuple[int, ...]:
    """The tag's parameters in the order of the model's parameter leaves.

    Entry `k` is the operand position (in `parameters_shapes` order) of the
    `k`-th of the block's parameters to come in the flattened parameters,
    e.g. `(1, 0)` for a dense tag `(w, b)` on Haiku's `{"b", "w"}`. Block
    vectors keep operand order; this maps them to the parameters' order.
    Until `set_parameter_positions` is called it is operand order.
    """
    if self._parameter_positions is None:
      return tuple(range(self.number_of_parameters))
    return tuple(
      int(i) for i in np.argsort(self._parameter_positions, kind="stable")
    )

  def set_parameter_positions(self, positions: Sequence[int]) -> None:
    """Records where the tag's parameters sit among the model's leaves.

    Args:
      positions: for each parameter operand, its index among the leaves of
        the flattened parameters (an estimator's `layer_indices` entry).

    Raises:
      ValueError: unless there is one distinct position per parameter.
    """
    positions = tuple(int(i) for i in positions)
    if len(positions) != self.number_of_parameters or len(
      set(positions)
    ) != len(positions):
      raise ValueError(
        f"Block {self._name!r}: expected {self.number_of_parameters} "
        f"distinct parameter positions, got {positions}."
      )
    self._parameter_positions = positions

  @property
  def layer_tag_extra_params(self) -> dict[str, Any]:
    """The tag's static parameters (e.g. a convolution's strides)."""
    return dict(self._layer_tag_eq.params)

  @property
  def number_of_parameters(self) -> int:
    """How many parameter arrays the tag has."""
    return len(self.parameter_variables)

  @property
  def dim(self) -> int:
    """The number of parameter elements, the side of the block matrix."""
    return sum(utils.product(s) for s in self.parameters_shapes)

  # --- scale --------------------------------------------------------------

  def fixed_scale(self) -> Numeric:
    """A constant factor in front of the unscaled estimate (1 here).

    Layers whose statistics average over more rows than examples (conv
    locations, repeated dense applications) use it to restore the sum.
    """
    return 1

  def state_dependent_scale(self, state: CurvatureBlock.State) -> Numeric:
    """A factor computed from the current estimate (1 for built-in blocks).

    Args:
      state: the block state.

    Returns:
      A scalar; cache entries are computed with it already applied.
    """
    del state
    return 1

  def scale(self, state: CurvatureBlock.State, use_cache: bool) -> Numeric:
    """The factor that multiplies unscaled or cached values.

    Args:
      state: the block state.
      use_cache: whether the values come from the cache, which already holds
        the state dependent part.

    Returns:
      `fixed_scale()`, times `state_dependent_scale(state)` unless
      `use_cache`.
    """
    if use_cache:
      return self.fixed_scale()
    return self.fixed_scale() * self.state_dependent_scale(state)

  # --- state --------------------------------------------------------------

  def init(
    self,
    rng: Array,
    exact_powers_to_cache: ScalarOrSequence,
    approx_powers_to_cache: ScalarOrSequence,
    cache_eigenvalues: bool,
  ) -> CurvatureBlock.State:
    """Zero statistics and a cache with one entry per requested power.

    The cache's keys are fixed here, so later states have the same pytree
    structure; `update_cache` and `use_cached=True` only accept these keys.
    Entries hold zeros until the first `update_cache`.

    Args:
      rng: a PRNG key, for families that need randomness.
      exact_powers_to_cache: None, a power or a sequence of powers that will
        be used with `exact_power=True, use_cached=True`.
      approx_powers_to_cache: the same for `exact_power=False`.
      cache_eigenvalues: whether to keep an "eigenvalues" cache entry.

    Returns:
      The initial state.

    Raises:
      ValueError: for a power that is not a finite real number.
    """
    exact = canonical_powers(exact_powers_to_cache)
    approx = canonical_powers(approx_powers_to_cache)
    for power in exact + approx:
      self._check_power(power, identity_weight=None)
    cache_eigenvalues = bool(cache_eigenvalues)
    state = self._init(rng, exact, approx, cache_eigenvalues=cache_eigenvalues)
    # The entries' shapes are those `_update_cache` produces.
    shapes = jax.eval_shape(
      lambda s: self._update_cache(
        s,
        identity_weight=1.0,
        exact_powers=exact,
        approx_powers=approx,
        eigenvalues=cache_eigenvalues,
        state_scale=1.0,
      ),
      state,
    )
    entries = jax.tree_util.tree_map(
      lambda s: jnp.zeros(s.shape, s.dtype), shapes
    )
    return dataclasses.replace(state, cache={**state.cache, **entries})

  def with_cache_room(
    self,
    state: CurvatureBlock.State,
    exact_powers: ScalarOrSequence,
    approx_powers: ScalarOrSequence,
    eigenvalues: bool,
  ) -> CurvatureBlock.State:
    """`state` with (zero) cache entries added for any of these powers and
    the eigenvalues that `init` did not make room for, so that
    `update_cache` takes them (as KFAC-JAX's estimators do). The state's
    pytree structure changes, which loops and `jax.lax.cond` carrying it do
    not allow: name the powers at `init` there.

    Args:
      state: the block state.
      exact_powers: as for `update_cache`.
      approx_powers: as for `update_cache`.
      eigenvalues: as for `update_cache`.

    Returns:
      The state, with its existing entries unchanged.
    """
    rng = jax.random.PRNGKey(0)  # unused by the families' zero caches
    fresh = self.init(rng, exact_powers, approx_powers, eigenvalues).cache
    missing = {k: v for k, v in fresh.items() if k not in state.cache}
    if not missing:
      return state
    return dataclasses.replace(state, cache={**state.cache, **missing})

  def update_curvature_matrix_estimate(
    self,
    state: CurvatureBlock.State,
    estimation_data: Mapping[str, Sequence[Array]],
    ema_old: Numeric,
    ema_new: Numeric,
    batch_size: Numeric,
    pmap_axis_name: str | None = None,
    identity_weight: Numeric | None = None,
  ) -> CurvatureBlock.State:
    """Folds this batch's statistics into the moving averages.

    Each average becomes `(ema_old * w * old + ema_new * new) / (ema_old * w
    + ema_new)`, `w` the weight it had; `ema_old=0, ema_new=1` replaces the
    estimate by this batch's. The cache is left as it is.

    Args:
      state: the block state.
      estimation_data: the layer's arrays from the tracer: "inputs",
        "outputs" and "params" (batch axis first where batched), and
        "outputs_tangent" and "params_tangent" with a leading sample axis.
        Each maps to a tuple with one array per operand.
      ema_old: the factor on the old estimate.
      ema_new: the weight of this batch's estimate.
      batch_size: the number of examples the statistics average over.
      pmap_axis_name: when not None, the statistics are averaged over this
        axis before they are folded in.
      identity_weight: the damping, taken for KFAC-JAX's signature (passed
        by keyword there); the library's blocks estimate without it.

    Returns:
      The state with the new estimate.

    Raises:
      ValueError: if the data lacks arrays the family needs or has shapes
        that do not fit the tag.
    """
    del identity_weight  # the statistics do not depend on the damping
    self._check_estimation_data(estimation_data, batch_size)
    stats = self._batch_statistics(estimation_data, batch_size)
    if pmap_axis_name is not None and jax.tree_util.tree_leaves(stats):
      stats = jax.lax.pmean(stats, pmap_axis_name)
    return self._fold_statistics(state, stats, ema_old, ema_new)

  def update_cache(
    self,
    state: CurvatureBlock.State,
    identity_weight: Numeric,
    exact_powers: ScalarOrSequence,
    approx_powers: ScalarOrSequence,
    eigenvalues: bool,
  ) -> CurvatureBlock.State:
    """Recomputes the named cache entries from the current estimate.

    Args:
      state: the block state.
      identity_weight: the weight `λ` of the identity added to the block:
        the entries become powers of `block + λ I`. Later cached products
        use this `λ`, whatever weight they are given.
      exact_powers: None, a power or powers among `init`'s
        `exact_powers_to_cache`.
      approx_powers: the same among `approx_powers_to_cache`.
      eigenvalues: whether to refresh the (undamped) eigenvalues; needs
        `cache_eigenvalues=True` at `init`.

    Returns:
      The state with the refreshed entries; the other entries are kept.

    Raises:
      ValueError: for an entry that `init` did not create, or a power the
        weight makes ill-defined (e.g. an inverse with `λ = 0`).
    """
    exact = canonical_powers(exact_powers)
    approx = canonical_powers(approx_powers)
    for power in exact:
      self._check_cached(state, power, exact=True)
      self._check_power(power, identity_weight)
    for power in approx:
      self._check_cached(state, power, exact=False)
      self._check_power(power, identity_weight)
    if eigenvalues and "eigenvalues" not in state.cache:
      raise ValueError(
        f"Block {self.name!r} does not cache eigenvalues; pass "
        "cache_eigenvalues=True to init to cache them."
      )
    if not (exact or approx or eigenvalues):
      return state
    updates = self._update_cache(
      state,
      identity_weight / self.fixed_scale(),
      exact,
      approx,
      eigenvalues=bool(eigenvalues),
      state_scale=self.state_dependent_scale(state),
    )
    return dataclasses.replace(state, cache={**state.cache, **updates})

  # --- products -------------------------------------------------------------

  def multiply_matpower(
    self,
    state: CurvatureBlock.State,
    vector: Sequence[Array],
    identity_weight: Numeric,
    power: float,
    exact_power: bool,
    use_cached: bool,
  ) -> BlockVector:
    """`(block + identity_weight I) ** power @ vector`.

    Args:
      state: the block state.
      vector: one array per parameter, shaped as `parameters_shapes`.
      identity_weight: the weight `λ` of the identity added to the block
        (the damping). Ignored with `use_cached=True`: the cached value was
        formed with the `λ` given to the last `update_cache`.
      power: a real power known at trace time; non-integer powers need
        `block + λ I` positive semi-definite.
      exact_power: False allows a family-specific approximation (the
        Kronecker blocks split the damping between their factors; the other
        blocks are exact anyway).
      use_cached: whether to use the cached value of the power (which may be
        older than the estimate) instead of the current estimate.

    Returns:
      The product, one array per parameter.

    Raises:
      TypeError, ValueError: for a vector of the wrong structure or shapes, a
        power that is not cached (with `use_cached=True`), or one that the
        weight makes ill-defined.
    """
    vector = self._check_vector(vector)
    power = canonical_power(power)
    if (
      use_cached
      and power == 1
      and cache_key(1, exact=exact_power) not in state.cache
    ):
      # Nothing to cache for the matrix itself (KFAC-JAX forms it anew).
      use_cached = False
    scale = self.scale(state, use_cache=use_cached)
    if use_cached:
      self._check_cached(state, power, exact=exact_power)
    else:
      self._check_power(power, identity_weight)
      identity_weight = identity_weight / scale
    result = self._multiply_matpower_unscaled(
      state,
      vector,
      identity_weight,
      power,
      exact_power=bool(exact_power),
      use_cached=bool(use_cached),
    )
    return utils.scalar_mul(result, self._scale_power(scale, power))

  def multiply(
    self,
    state: CurvatureBlock.State,
    vector: Sequence[Array],
    identity_weight: Numeric,
    exact_power: bool,
    use_cached: bool,
  ) -> BlockVector:
    """`(block + identity_weight I) @ vector`; see `multiply_matpower`."""
    return self.multiply_matpower(
      state,
      vector,
      identity_weight,
      1,
      exact_power=exact_power,
      use_cached=use_cached,
    )

  def multiply_inverse(
    self,
    state: CurvatureBlock.State,
    vector: Sequence[Array],
    identity_weight: Numeric,
    exact_power: bool,
    use_cached: bool,
  ) -> BlockVector:
    """`(block + identity_weight I) ** -1 @ vector`; see `multiply_matpower`."""
    return self.multiply_matpower(
      state,
      vector,
      identity_weight,
      -1,
      exact_power=exact_power,
      use_cached=use_cached,
    )

  def outer_sum_is_cheaper(self) -> bool:
    """Whether to precondition the layer's gradient from its rows.

    True when the block offers `multiply_inverse_outer_sum(state, inputs,
    outputs_cotangent)`, the cached approximate inverse applied to the
    gradient given as the sum over rows of `inputs ⊗ outputs_cotangent`,
    and that is cheaper than `multiply_inverse` on the assembled gradient.
    False here.
    """
    return False

  def eigenvalues(self, state: CurvatureBlock.State, use_cached: bool) -> Array:
    """Eigenvalues of the undamped, scaled block.

    Args:
      state: the block state.
      use_cached: whether to return the values cached by the last
        `update_cache(..., eigenvalues=True)` instead of computing them from
        the current estimate.

    Returns:
      A `(dim,)` array, in no particular order.

    Raises:
      ValueError: with `use_cached=True` if `init` did not cache them.
    """
    if use_cached:
      if "eigenvalues" not in state.cache:
        raise ValueError(
          f"Block {self.name!r} does not cache eigenvalues; pass "
          "cache_eigenvalues=True to init, or use_cached=False."
        )
      values = state.cache["eigenvalues"]
    else:
      values = self._eigenvalues_unscaled(state)
    return values * self.scale(state, use_cache=use_cached)

  def sync(
    self, state: CurvatureBlock.State, pmap_axis_name: str | None
  ) -> CurvatureBlock.State:
    """The state with its statistics averaged over the devices of
    `pmap_axis_name` (the cache is left as it is).

    Args:
      state: the block state.
      pmap_axis_name: the mapped axis; the state is returned unchanged when
        it is None or not bound here.

    Returns:
      The synchronised state.
    """
    if not utils.in_pmap(pmap_axis_name):
      return state
    cache = state.cache

    def mean(x):
      if jnp.issubdtype(jnp.result_type(x), jnp.inexact):
        return jax.lax.pmean(x, pmap_axis_name)
      return x

    synced = jax.tree_util.tree_map(mean, dataclasses.replace(state, cache={}))
    return dataclasses.replace(synced, cache=cache)

  def norm(self, state: CurvatureBlock.State, norm_type: str) -> Numeric:
    """A scalar size of the undamped, scaled block.

    Used to scale the damping per block (the estimators'
    `norm_to_scale_identity_weight_per_block`).

    Args:
      state: the block state.
      norm_type: a kind from `norms.NORM_TYPES`, e.g. "avg_diag" (the mean
        of the block's diagonal). Kronecker-factored blocks take the product
        of their factors' values and diagonal blocks the product over their
        parameters, as KFAC-JAX does; these are the block's own value for
        the kinds that are multiplicative over Kronecker products.

    Returns:
      A scalar.
    """
    unscaled = self._norm_unscaled(state, norm_type)
    return self.scale(state, use_cache=False) * unscaled

  def _norm_unscaled(self, state, norm_type):
    """`norm` without the block's scale; here from the dense block."""
    scale = self.scale(state, use_cache=False)
    return norms.psd_matrix_norm(
      self.to_dense_matrix(state) / scale, norm_type=norm_type
    )

  def undamped_diagonal(self, state: CurvatureBlock.State) -> BlockVector:
    """The diagonal of the undamped, scaled block, shaped like the params.

    Args:
      state: the block state (its current estimate, not the cache).

    Returns:
      One array per parameter.
    """
    return utils.scalar_mul(
      self._undamped_diagonal_unscaled(state),
      self.scale(state, use_cache=False),
    )

  def _undamped_diagonal_unscaled(self, state):
    """`undamped_diagonal` without the scale; here from the dense block."""
    diagonal = jnp.diagonal(self.to_dense_matrix(state)) / self.scale(
      state, use_cache=False
    )
    return utils.unflatten_vector(diagonal, self.parameters_shapes)

  def to_dense_matrix(self, state: CurvatureBlock.State) -> Array:
    """The undamped scaled block as a matrix, for small blocks.

    Args:
      state: the block state; its current estimate is used, not the cache.

    Returns:
      A `(dim, dim)` array whose rows and columns follow the parameters in
      operand order, each flattened row-major.
    """
    eye = jnp.eye(self.dim, dtype=self.parameters_dtype)

    def column(e):
      v = utils.unflatten_vector(e, self.parameters_shapes)
      return utils.flatten_arrays(
        self.multiply(state, v, 0.0, exact_power=True, use_cached=False)
      )

    return jax.vmap(column, out_axes=1)(eye)

  # --- checks ---------------------------------------------------------------

  def _scale_power(self, scale, power):
    if power == 1:
      return scale
    return jnp.power(jnp.asarray(scale, self.parameters_dtype), power)

  def _check_cached(self, state, power, exact):
    key = cache_key(power, exact=exact)
    if key not in state.cache:
      kind = "exact" if exact else "approx"
      raise ValueError(
        f"Block {self.name!r} has no cached {kind} power {power} (cache key "
        f"{key!r}); pass it in {kind}_powers_to_cache to init, or use "
        "use_cached=False."
      )

  def _check_power(self, power, identity_weight):
    """Rejects powers whose result would be NaN/inf for a reason known now."""
    weight = _concrete_float(identity_weight)
    if weight is None:
      return
    if power < 0 and weight == 0 and self._MAY_BE_SINGULAR:
      raise ValueError(
        f"Block {self.name!r}: power {power} of an undamped "
        f"{type(self).__name__} block; estimates from a batch are usually "
        "singular, so this would give inf/NaN. Pass a positive "
        "identity_weight (damping)."
      )
    if weight < 0 and not float(power).is_integer():
      raise ValueError(
        f"Block {self.name!r}: the non-integer power {power} needs a PSD "
        f"matrix, but identity_weight={weight} is negative."
      )

  def _check_vector(self, vector) -> tuple[jax.Array, ...]:
    if not isinstance(vector, (tuple, list)):
      raise TypeError(
        f"Block {self.name!r}: vectors are tuples of arrays shaped "
        f"like the parameters {self.parameters_shapes}, got "
        f"{type(vector).__name__}."
      )
    shapes = tuple(tuple(jnp.shape(v)) for v in vector)
    if shapes != self.parameters_shapes:
      raise ValueError(
        f"Block {self.name!r}: vector shapes {shapes} do not match "
        f"the parameter shapes {self.parameters_shapes}."
      )
    return tuple(jnp.asarray(v) for v in vector)

  def _check_estimation_data(self, data, batch_size) -> None:
    missing = [k for k in self._REQUIRED_DATA if not data.get(k)]
    if missing:
      raise ValueError(
        f"{type(self).__name__} block {self.name!r} needs {missing} in the "
        "estimation data; this block type cannot be used for tags (such as "
        "generic_tag) that do not provide them."
      )
    b = _concrete_float(batch_size)
    expected = {
      "inputs": self.inputs_shapes,
      "outputs": self.outputs_shapes,
      "outputs_tangent": self.outputs_shapes,
      "params": self.parameters_shapes,
      "params_tangent": self.parameters_shapes,
    }
    for key, shapes in expected.items():
      values = data.get(key) or ()
      if values and len(values) != len(shapes):
        raise ValueError(
          f"Block {self.name!r}: estimation_data[{key!r}] has "
          f"{len(values)} arrays, the tag has {len(shapes)}."
        )
      batched = int(key in ("inputs", "outputs", "outputs_tangent"))
      for value, shape in zip(values, shapes):
        # Tangents carry a leading sample axis; batched arrays may have any
        # batch size but must agree with `batch_size` when it is known.
        got = tuple(jnp.shape(value))[1 if key.endswith("_tangent") else 0 :]
        ok = len(got) == len(shape) and got[batched:] == tuple(shape)[batched:]
        if ok and batched and b is not None:
          ok = got[0] == b
        if not ok:
          lead = "(S, " if key.endswith("_tangent") else "("
          raise ValueError(
            f"Block {self.name!r}: estimation_data[{key!r}] has an array of "
            f"shape {jnp.shape(value)}; expected {lead}*{shape}) with batch "
            f"size {batch_size}."
          )

  # --- hooks ------------------------------------------------------------------

  @abc.abstractmethod
  def _init(self, rng, exact_powers, approx_powers, cache_eigenvalues):
    """The initial state; its cache holds only family-specific entries."""

  def _batch_statistics(self, estimation_data, batch_size):
    """A pytree of this batch's statistics (averaged over the batch).

    Not abstract: a block that overrides `update_curvature_matrix_estimate`
    (as the reference's guide does) never calls it.
    """
    raise NotImplementedError(
      f"{type(self).__name__} must implement _batch_statistics, or "
      "override update_curvature_matrix_estimate."
    )

  @abc.abstractmethod
  def _fold_statistics(self, state, stats, ema_old, ema_new):
    """The state with `stats` folded into its moving averages."""

  @abc.abstractmethod
  def _multiply_matpower_unscaled(
    self, state, vector, identity_weight, power, exact_power, use_cached
  ):
    """`(M + identity_weight I) ** power @ vector` or its cached version."""

  @abc.abstractmethod
  def _eigenvalues_unscaled(self, state):
    """Eigenvalues of `M`."""

  @abc.abstractmethod
  def _update_cache(
    self,
    state,
    identity_weight,
    exact_powers,
    approx_powers,
    eigenvalues,
    state_scale,
  ) -> dict[str, Any]:
    """New cache entries for `state_scale * M + identity_weight I`."""
