"""K-FAC as an optax preconditioner: `OptaxPreconditioner`.

The preconditioner keeps a `BlockDiagonalCurvature` estimate of the loss's
curvature `C` in an `OptaxPreconditionState`, refreshes the estimate every
`curvature_update_period` steps and its cached inverse every
`inverse_update_period` steps (`maybe_update`), and turns gradients into
`(C + (damping + l2_reg) I)^-1 g` (`apply`). `as_gradient_transform()` makes
that an optax transformation to chain with others; its state is empty, the
preconditioner's own state travels as the `precond_state` extra argument:

    precon = OptaxPreconditioner(loss_fn, damping=1e-3)
    tx = optax.chain(precon.as_gradient_transform(), optax.sgd(0.1))
    precond_state = precon.init((params, batch), rng)
    opt_state = tx.init(params)
    # each step:
    precond_state = precon.maybe_update(precond_state, (params, batch), rng)
    updates, opt_state = tx.update(grads, opt_state, params,
                                   precond_state=precond_state)
    precond_state = precon.increment_count(precond_state)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import optax

from estimators import graph_matcher, utils
from estimators.curvature import (
  BlockDiagonalCurvature,
  CurvatureBlockCtor,
  default_batch_size_extractor,
)

Schedule = Callable[[jax.Array], utils.Numeric]


class OptaxPreconditionState(NamedTuple):
  """What an `OptaxPreconditioner` carries from step to step.

  Attributes:
    count: the step number, advanced by `increment_count`; the update
      periods and the damping schedule read it.
    estimator_state: the `BlockDiagonalCurvature` state (estimate and
      cached inverse).
  """

  # Shadows `tuple.count`, under KFAC-JAX's name for the field.
  count: jax.Array  # type: ignore[assignment]
  estimator_state: Any


class OptaxPreconditioner:
  """A K-FAC preconditioner for optax; see the module docstring."""

  def __init__(
    self,
    value_func: Callable[..., Any],
    l2_reg: utils.Numeric = 0.0,
    damping: utils.Numeric | None = None,
    damping_schedule: Schedule | None = None,
    norm_constraint: utils.Numeric | None = None,
    estimation_mode: str = "fisher_gradients",
    curvature_ema: utils.Numeric = 0.95,
    curvature_update_period: int = 1,
    inverse_update_period: int = 5,
    use_exact_inverses: bool = False,
    use_sqrt_inv: bool = False,
    register_only_generic: bool = False,
    patterns_to_skip: Sequence[str] = (),
    auto_register_kwargs: Mapping[str, Any] | None = None,
    layer_tag_to_block_ctor: Mapping[str, CurvatureBlockCtor] | None = None,
    pmap_axis_name: str = "kfac_axis",
    batch_size_extractor: Callable[[Any], int] = (default_batch_size_extractor),
    distributed_inverses: bool = True,
    distributed_precon_apply: bool = True,
    num_samples: int = 1,
    should_vmap_samples: bool = False,
    norm_to_scale_identity_weight_per_block: str | None = None,
  ):
    """Builds the curvature estimator of `value_func`.

    Args:
      value_func: the loss function, `value_func(params, ...)`, with its
        loss registered (e.g. `register_softmax_cross_entropy_loss`); it may
        return extra outputs, only its registered losses are used.
      l2_reg: the coefficient `c` of an L2 term `c/2 ||θ||²` in the loss; it
        is added to the damping.
      damping: a fixed damping `λ`; give it or `damping_schedule`.
      damping_schedule: `count -> λ`, read when the inverse is refreshed.
      norm_constraint: if given, `apply` scales its result `v` down so that
        `v · g` (g the incoming updates, i.e. `vᵀ (C + λI) v` for the
        inverse) is at most this value.
      estimation_mode: one of `estimators.ESTIMATION_MODES`.
      curvature_ema: the factor on the old estimate in its moving average.
      curvature_update_period: steps between curvature estimate updates.
      inverse_update_period: steps between refreshes of the cached inverse.
      use_exact_inverses: invert `C + λI` exactly instead of with factored
        (pi-adjusted) damping where a block offers the latter.
      use_sqrt_inv: precondition with `(C + λI)^-1/2` instead.
      register_only_generic: give every parameter not tagged by hand a
        generic tag instead of matching layers.
      patterns_to_skip: graph patterns not to look for.
      auto_register_kwargs: further options of `auto_register_tags`.
      layer_tag_to_block_ctor: block constructors by tag name.
      pmap_axis_name: under `pmap`/`shard_map` over this axis, statistics
        are averaged and block work shared across devices; elsewhere the
        name is unused.
      batch_size_extractor: maps the last of the function's arguments (the
        batch) to its size.
      distributed_inverses: share the cache refreshes among devices.
      distributed_precon_apply: share the products among devices.
      num_samples: samples per example that the sampled estimation modes
        average.
      should_vmap_samples: draw those samples in one `jax.vmap` pass
        instead of a loop.
      norm_to_scale_identity_weight_per_block: None (one damping for every
        block), or a norm name (see `BlockDiagonalCurvature.update_cache`)
        scaling each block's damping by that norm of the block.

    Raises:
      ValueError: for a missing or doubled damping, periods below 1, an
        EMA factor outside [0, 1] or an option this library lacks.
    """
    if (damping is None) == (damping_schedule is None):
      raise ValueError(
        "OptaxPreconditioner needs exactly one of damping or damping_schedule."
      )
    for name, period in (
      ("curvature_update_period", curvature_update_period),
      ("inverse_update_period", inverse_update_period),
    ):
      if not isinstance(period, int) or period < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {period!r}.")
    if not 0.0 <= curvature_ema <= 1.0:
      raise ValueError(
        f"curvature_ema must lie in [0, 1], got {curvature_ema}."
      )
    if norm_to_scale_identity_weight_per_block == "none":
      norm_to_scale_identity_weight_per_block = None
    self._block_norm = norm_to_scale_identity_weight_per_block
    self._l2_reg = l2_reg
    self._norm_constraint = norm_constraint
    self._damping = damping
    self._damping_schedule = damping_schedule
    self._curvature_ema = curvature_ema
    self._curvature_update_period = curvature_update_period
    self._inverse_update_period = inverse_update_period
    self._use_exact_inverses = use_exact_inverses
    self._power = -0.5 if use_sqrt_inv else -1
    self._pmap_axis_name = pmap_axis_name
    self._batch_size_extractor = batch_size_extractor

    auto_kwargs = graph_matcher.matcher_options(
      auto_register_kwargs, register_only_generic, patterns_to_skip
    )
    self._estimator = BlockDiagonalCurvature(
      value_func,
      params_index=0,
      default_estimation_mode=estimation_mode,
      layer_tag_to_block_ctor=layer_tag_to_block_ctor,
      distributed_multiplies=distributed_precon_apply,
      distributed_cache_updates=distributed_inverses,
      num_samples=num_samples,
      should_vmap_samples=should_vmap_samples,
      **auto_kwargs,
    )

  @property
  def estimator(self) -> BlockDiagonalCurvature:
    """The curvature estimator."""
    return self._estimator

  @property
  def pmap_axis_name(self) -> str:
    """The device axis name used when the step runs mapped over it."""
    return self._pmap_axis_name

  @property
  def damping(self) -> utils.Numeric | None:
    """The fixed damping, or None with a damping schedule."""
    return self._damping

  def get_identity_weight(self, state: OptaxPreconditionState) -> utils.Numeric:
    """The weight `λ + l2_reg` of the identity added to the curvature.

    Args:
      state: the preconditioner state (its count feeds the schedule).

    Returns:
      A scalar.
    """
    damping = (
      cast(utils.Numeric, self._damping)  # given, without a schedule
      if self._damping_schedule is None
      else self._damping_schedule(state.count)
    )
    return damping + self._l2_reg

  def should_update_estimator_curvature(
    self, state: OptaxPreconditionState
  ) -> jax.Array | bool:
    """Whether this step folds its batch into the estimate.

    Args:
      state: the preconditioner state.

    Returns:
      True (or a traced boolean) on steps divisible by the period.
    """
    return _is_due(state.count, self._curvature_update_period)

  def should_update_inverse_cache(
    self, state: OptaxPreconditionState
  ) -> jax.Array | bool:
    """Whether this step refreshes the cached inverse.

    Args:
      state: the preconditioner state.

    Returns:
      True (or a traced boolean) on steps divisible by the period.
    """
    return _is_due(state.count, self._inverse_update_period)

  def _powers(self) -> tuple[Any, Any]:
    """(exact, approximate) powers to cache."""
    return (
      (self._power, None) if self._use_exact_inverses else (None, self._power)
    )

  def _block_norm_kwargs(self) -> dict[str, Any]:
    if self._block_norm is None:
      return {}
    return dict(norm_to_scale_identity_weight_per_block=self._block_norm)

  def _axis(self) -> str | None:
    return self._pmap_axis_name if utils.in_pmap(self._pmap_axis_name) else None

  def init(
    self, func_args: utils.FuncArgs, rng: jax.Array
  ) -> OptaxPreconditionState:
    """The initial state: an empty estimate, count 0.

    Args:
      func_args: example arguments of `value_func`, `(params, ..., batch)`;
        the model is traced on them.
      rng: a PRNG key.

    Returns:
      The preconditioner state.
    """
    exact, approx = self._powers()
    estimator_state = self._estimator.init(
      rng,
      func_args,
      exact_powers_to_cache=exact,
      approx_powers_to_cache=approx,
      cache_eigenvalues=False,
    )
    return OptaxPreconditionState(
      count=jnp.zeros([], jnp.int32), estimator_state=estimator_state
    )

  def maybe_update(
    self,
    state: OptaxPreconditionState,
    func_args: utils.FuncArgs,
    rng: jax.Array,
  ) -> OptaxPreconditionState:
    """Updates the estimate and then the cached inverse, when due.

    Args:
      state: the preconditioner state.
      func_args: this step's arguments of `value_func`.
      rng: a PRNG key for the sampled estimation modes.

    Returns:
      The new state (its count unchanged).
    """
    state = self.maybe_update_estimator_curvature(
      state, func_args, rng, sync=self.should_sync_estimate_curvature(state)
    )
    return self.maybe_update_inverse_cache(state)

  def maybe_update_estimator_curvature(
    self,
    state: OptaxPreconditionState,
    func_args: utils.FuncArgs,
    rng: jax.Array,
    decay_old_ema: jax.Array | bool = True,
    sync: jax.Array | bool = True,
  ) -> OptaxPreconditionState:
    """Folds this batch into the estimate on steps divisible by the period.

    Args:
      state: the preconditioner state.
      func_args: this step's arguments of `value_func`.
      rng: a PRNG key for the sampled estimation modes.
      decay_old_ema: decay the old estimate by `curvature_ema` (False adds
        the batch without decaying it); may be a traced boolean.
      sync: average the estimate over the devices of `pmap_axis_name`
        afterwards (see `sync_estimator_state`); may be traced.

    Returns:
      The new state.
    """
    if isinstance(decay_old_ema, bool):
      ema_old: Any = self._curvature_ema if decay_old_ema else 1.0
    else:
      ema_old = jnp.where(decay_old_ema, self._curvature_ema, 1.0)
    batch_size = self._batch_size_extractor(func_args[-1])

    def update(estimator_state):
      estimator_state = self._estimator.update_curvature_matrix_estimate(
        estimator_state, ema_old, 1.0, batch_size, rng, func_args, self._axis()
      )
      return _maybe(sync, self._sync, estimator_state)

    return OptaxPreconditionState(
      state.count,
      _maybe(
        self.should_update_estimator_curvature(state),
        update,
        state.estimator_state,
      ),
    )

  def _sync(self, estimator_state: Any) -> Any:
    return self._estimator.sync(estimator_state, self._axis())

  def sync_estimator_state(
    self, state: OptaxPreconditionState
  ) -> OptaxPreconditionState:
    """The state with its estimate averaged over the devices of
    `pmap_axis_name` (unchanged outside such a mapped axis).

    Args:
      state: the preconditioner state.

    Returns:
      The synchronised state.
    """
    return OptaxPreconditionState(
      state.count, self._sync(state.estimator_state)
    )

  def should_sync_estimate_curvature(
    self, state: OptaxPreconditionState
  ) -> jax.Array | bool:
    """Whether `maybe_update` syncs the estimate: when the cached inverse
    is refreshed from it next.

    Args:
      state: the preconditioner state.

    Returns:
      True (or a traced boolean).
    """
    return self.should_update_inverse_cache(state)

  def maybe_update_inverse_cache(
    self, state: OptaxPreconditionState
  ) -> OptaxPreconditionState:
    """Refreshes the cached inverse on steps divisible by the period.

    Args:
      state: the preconditioner state.

    Returns:
      The new state.
    """
    exact, approx = self._powers()
    weight = self.get_identity_weight(state)

    def refresh(estimator_state):
      return self._estimator.update_cache(
        estimator_state,
        weight,
        exact_powers=exact,
        approx_powers=approx,
        eigenvalues=False,
        pmap_axis_name=self._axis(),
        **self._block_norm_kwargs(),
      )

    return OptaxPreconditionState(
      state.count,
      _maybe(
        self.should_update_inverse_cache(state), refresh, state.estimator_state
      ),
    )

  def increment_count(
    self, state: OptaxPreconditionState
  ) -> OptaxPreconditionState:
    """Advances the step count; call it once per step, after the update.

    Args:
      state: the preconditioner state.

    Returns:
      The state with `count + 1`.
    """
    return OptaxPreconditionState(
      optax.safe_int32_increment(state.count), state.estimator_state
    )

  def apply(
    self, updates: utils.Params, state: OptaxPreconditionState
  ) -> utils.Params:
    """Preconditions with the cached inverse: `(C + λI)^-1 updates`.

    With `use_sqrt_inv` the power is -1/2. The `λ` is the one of the last
    refresh. With a `norm_constraint` the result is scaled down as the
    constructor says.

    Args:
      updates: a params-shaped pytree, e.g. the gradient.
      state: the preconditioner state.

    Returns:
      The preconditioned pytree.
    """
    result = self._estimator.multiply_matpower(
      state.estimator_state,
      updates,
      self.get_identity_weight(state),
      self._power,
      exact_power=self._use_exact_inverses,
      use_cached=True,
      pmap_axis_name=self._axis(),
      **self._block_norm_kwargs(),
    )
    if self._norm_constraint is None:
      return result
    sq_norm = utils.inner_product(result, updates)
    return utils.scalar_mul(
      result, jnp.minimum(1.0, jnp.sqrt(self._norm_constraint / sq_norm))
    )

  def multiply_curvature(
    self, updates: utils.Params, state: OptaxPreconditionState
  ) -> utils.Params:
    """`(C + λI) updates`, with the current (not cached) estimate.

    Args:
      updates: a params-shaped pytree.
      state: the preconditioner state.

    Returns:
      The product, shaped like the parameters.
    """
    return self._estimator.multiply(
      state.estimator_state,
      updates,
      self.get_identity_weight(state),
      exact_power=True,
      use_cached=False,
      pmap_axis_name=self._axis(),
      **self._block_norm_kwargs(),
    )

  def as_gradient_transform(
    self, use_inverse: bool = True
  ) -> optax.GradientTransformationExtraArgs:
    """This preconditioner as an optax transformation.

    Its own state is empty; `update` takes the preconditioner state as the
    keyword `precond_state` (optax's `chain` passes extra keywords on).

    Args:
      use_inverse: apply `apply` (True) or `multiply_curvature` (False).

    Returns:
      The transformation.
    """

    def init_fn(params):
      del params
      return optax.EmptyState()

    def update_fn(
      updates, state, params=None, *, precond_state=None, **extra_args
    ):
      del params, extra_args
      if not isinstance(precond_state, OptaxPreconditionState):
        raise ValueError(
          "The K-FAC transformation needs the preconditioner state: call "
          "update(grads, opt_state, params, precond_state=state) with the "
          "state from OptaxPreconditioner.init/maybe_update."
        )
      if use_inverse:
        return self.apply(updates, precond_state), state
      return self.multiply_curvature(updates, precond_state), state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _is_due(count: jax.Array, period: int) -> jax.Array | bool:
  """Whether step `count` is one of every `period`; a plain True for period
  1, so that `_maybe` adds no conditional to the program."""
  return True if period == 1 else count % period == 0


def _maybe(
  condition: jax.Array | bool, fn: Callable[[Any], Any], value: Any
) -> Any:
  """`fn(value)` where `condition` holds, else `value`."""
  if condition is True:  # every step: no conditional in the program
    # New containers: estimator states may be updated in place (as
    # KFAC-JAX's are), and the caller's state must stay as it came.
    return fn(jax.tree.map(lambda x: x, value))
  return jax.lax.cond(condition, fn, lambda v: v, value)
