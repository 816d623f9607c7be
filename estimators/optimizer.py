"""The K-FAC optimizer.

One step: fold the batch into the curvature estimate (an EMA, every
`curvature_update_period` steps), refresh the cached matrix powers every
`inverse_update_period` steps, precondition the gradient with the damped
estimate to the power `precon_power`, choose the learning rate and momentum
(fixed, scheduled, or by minimising the quadratic model of
`estimators.quad_model`), apply the update (or reject it, with
`use_step_rejection`), and every `damping_adaptation_interval` steps adapt
the damping with the Levenberg–Marquardt rule from the reduction ratio rho.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from estimators import (
  curvature,
  estimation_modes,
  graph_matcher,
  optimizer_settings,
  optimizer_stats,
  quad_model,
  tracer,
  utils,
)
from estimators.curvature import BlockDiagonalCurvature
from estimators.quad_model import (
  HAIKU_BIASES,
  HAIKU_BIASES_AND_NORMS,
  QuadModelParams,
)
from estimators.utils import staging
from estimators.utils.types import (
  Array,
  Batch,
  FuncAux,
  FuncState,
  Numeric,
  Params,
  PRNGKey,
  Scalar,
)
from estimators.value_funcs import (
  FuncArgsVariants,
  FuncOutputs,
  ValueAndGradFunc,
  ValueFunc,
  convert_value_and_grad_to_clean_value_and_grad,
  convert_value_and_grad_to_value_func,
  extract_func_outputs,
  make_func_args,
)

__all__ = [
  "Array",
  "BlockDiagonalCurvature",
  "FuncArgsVariants",
  "FuncAux",
  "FuncOutputs",
  "HAIKU_BIASES",
  "HAIKU_BIASES_AND_NORMS",
  "Optimizer",
  "OptimizerState",
  "PRNGKey",
  "QuadModelParams",
  "ReturnEither",
  "Scalar",
  "Schedule",
  "ScheduleType",
  "ValueAndGradFunc",
  "ValueFunc",
  "convert_value_and_grad_to_clean_value_and_grad",
  "convert_value_and_grad_to_value_func",
  "extract_func_outputs",
  "make_func_args",
  "state_dtype",
]

# A function of the step number giving a hyperparameter's value.
Schedule = Callable[[int], Numeric]
ScheduleType = Schedule
# What `Optimizer.step` returns, without and with `value_func_has_state`.
ReturnEither = (
  tuple[Params, "OptimizerState", FuncState, dict[str, Numeric]]
  | tuple[Params, "OptimizerState", dict[str, Numeric]]
)
# The most step evaluations `use_initial_damping_calibration` runs.
MAX_CALIBRATION_ITERATIONS = 100

_log = logging.getLogger(__name__)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OptimizerState:
  """The optimizer's state between steps.

  Attributes:
    velocities: the last update `θ_t - θ_{t-1}`, shaped like the params.
    estimator_state: the curvature estimator's state.
    damping: the damping in use (adapted with `use_adaptive_damping`).
    data_seen: how many examples the steps have used, over all devices.
    step_counter: the number of steps taken (burn-in not counted).
  """

  velocities: Params
  estimator_state: Any
  damping: jax.Array
  data_seen: jax.Array
  step_counter: jax.Array


def state_dtype(tree: Params) -> jnp.dtype:
  """The floating dtype of a params-like tree (the optimizer computes in it)."""
  return jnp.result_type(*jax.tree.leaves(tree))


def _add(a, b):
  return jax.tree.map(jnp.add, a, b)


def _copy(tree):
  """`tree` in new containers: estimator states may be updated in place
  (as KFAC-JAX's are), and a step's inputs must stay as they came."""
  return jax.tree.map(lambda x: x, tree)


# A refresh step runs once every `inverse_update_period` steps; its compile
# time goes to the many small fusions around the factor inverses, which XLA's
# older loop emitters compile much sooner while running about as fast. The
# other steps keep the newer emitters, whose elementwise code runs better.
# (`staging.stage` drops the option where a jaxlib no longer has it.)
_REFRESH_CPU_OPTIONS = {"xla_cpu_use_fusion_emitters": False}


class Optimizer:
  """K-FAC with the constructor arguments and defaults of the reference.

  The update is `α · precon + μ · velocity`, `precon = (C + (λ_p + l2_reg)
  I)^p g` with `C` the block-diagonal curvature estimate, `λ_p` the
  preconditioner's damping, `p = precon_power` (-1 by default) and `g` the
  gradient. The learning rate `-α` and momentum `μ` are given, scheduled,
  or chosen to minimise the quadratic model of `estimators.quad_model`.
  """

  State = OptimizerState

  def __init__(
    self,
    value_and_grad_func: Callable,
    l2_reg: Numeric,
    regularized_parameters_path_exclusions: str | None = "",
    value_func_has_aux: bool = False,
    value_func_has_state: bool = False,
    value_func_has_rng: bool = False,
    value_func_for_estimator: Callable | None = None,
    use_adaptive_learning_rate: bool = False,
    learning_rate_schedule: Schedule | None = None,
    use_adaptive_momentum: bool = False,
    momentum_schedule: Schedule | None = None,
    use_adaptive_damping: bool = False,
    damping_schedule: Schedule | None = None,
    initial_damping: Numeric | None = None,
    use_initial_damping_calibration: bool = False,
    min_damping: Numeric = 1e-8,
    max_damping: Numeric = math.inf,
    include_damping_in_quad_change: bool = False,
    damping_adaptation_interval: int = 5,
    damping_adaptation_decay: Numeric = 0.9,
    damping_lower_threshold: Numeric = 0.25,
    damping_upper_threshold: Numeric = 0.75,
    always_use_exact_qmodel_for_damping_adjustment: bool = False,
    precon_damping_mult: Numeric = 1.0,
    precon_damping_schedule: Schedule | None = None,
    use_step_rejection: bool = False,
    reject_damping_increase_factor: float = 1.0,
    norm_constraint: Numeric | None = None,
    num_burnin_steps: int = 10,
    estimation_mode: str | None = None,
    custom_estimator_ctor: Callable[..., BlockDiagonalCurvature] | None = None,
    curvature_ema: Numeric = 0.95,
    curvature_update_period: int = 1,
    inverse_update_period: int = 5,
    use_exact_inverses: bool = False,
    batch_process_func: Callable[[Batch], Batch] | None = None,
    register_only_generic: bool = False,
    patterns_to_skip: Sequence[str] = (),
    use_automatic_registration: bool = True,
    auto_register_kwargs: dict[str, Any] | None = None,
    layer_tag_to_block_ctor: Mapping[str, curvature.CurvatureBlockCtor]
    | None = None,
    multi_device: bool = False,
    debug: bool = False,
    invalid_metric_value: Numeric = math.nan,
    batch_size_extractor: Callable[
      [Batch], int
    ] = curvature.default_batch_size_extractor,
    pmap_axis_name: str = "kfac_axis",
    forbid_setting_attributes_after_finalize: bool = True,
    modifiable_attribute_exceptions: Sequence[str] = (),
    include_norms_in_stats: bool = False,
    include_per_param_norms_in_stats: bool = False,
    include_registered_loss_in_stats: bool = False,
    distributed_precon_apply: bool = True,
    distributed_inverses: bool = True,
    num_estimator_samples: int = 1,
    should_vmap_estimator_samples: bool = False,
    norm_to_scale_identity_weight_per_block: str | None = None,
    precon_power: Scalar = -1.0,
    exact_quad_model_matrix_type: str | None = None,
    estimator_ctor: Callable[..., BlockDiagonalCurvature] | None = None,
  ):
    """Checks the settings and prepares the compiled step.

    Args:
      value_and_grad_func: called as `value_and_grad_func(params,
        [func_state,] [rng,] batch)`, it returns `(out, grads)` where `out`
        is the loss, or `(loss, func_state)`, `(loss, aux)` or
        `(loss, (func_state, aux))` per the two flags below. The loss must
        be registered, e.g. with `register_softmax_cross_entropy_loss`.
      l2_reg: the coefficient `c` of an L2 term `c/2 ||θ||²` that the loss
        already contains; it is added to the preconditioner's damping and
        to the quadratic model.
      regularized_parameters_path_exclusions: comma-separated parameter
        names (dict keys or attribute names on a parameter's tree path,
        e.g. `HAIKU_BIASES_AND_NORMS`) that the L2 term leaves out; the
        exact quadratic model then counts `l2_reg` on the other parameters
        only (the preconditioner and the approximate model, as in
        KFAC-JAX, add it to every parameter).
      value_func_has_aux: whether the loss function returns auxiliary data.
      value_func_has_state: whether it takes and returns a state.
      value_func_has_rng: whether it takes a PRNG key.
      value_func_for_estimator: if given, the curvature estimator traces
        this function (same arguments; its registered losses count)
        instead of the loss of `value_and_grad_func`, e.g. to leave costly
        regularisers out of the estimate.
      use_adaptive_learning_rate: choose the learning rate from the
        quadratic model (exact curvature); else pass it to `step` or give a
        schedule.
      learning_rate_schedule: the learning rate as a function of the step
        (and of `data_seen=`, the examples seen so far, where it takes that
        keyword; the same holds for every schedule).
      use_adaptive_momentum: choose the momentum from the quadratic model.
      momentum_schedule: the momentum as a function of the step.
      use_adaptive_damping: adapt the damping with the Levenberg–Marquardt
        rule on every `damping_adaptation_interval`-th step; else pass it
        to `step` or give a schedule.
      damping_schedule: the damping as a function of the step.
      initial_damping: the starting damping; needed for adaptive damping.
      use_initial_damping_calibration: with adaptive damping, the first
        step (after burn-in) first repeats its damping adaptation on its
        batch, without updating the parameters or the estimate, until the
        damping stops changing (at most `MAX_CALIBRATION_ITERATIONS`
        times). Needs `num_burnin_steps > 0`.
      min_damping: the adapted damping's lower bound.
      max_damping: the adapted damping's upper bound.
      include_damping_in_quad_change: whether the predicted loss change in
        the reduction ratio includes the damping term (the L2 term always
        counts).
      damping_adaptation_interval: the damping adapts on steps `k` with
        `(k + 1) % damping_adaptation_interval == 0`.
      damping_adaptation_decay: the damping is multiplied or divided by this
        to the power `damping_adaptation_interval`.
      damping_lower_threshold: below this reduction ratio the damping grows.
      damping_upper_threshold: above this reduction ratio it shrinks.
      always_use_exact_qmodel_for_damping_adjustment: whether the reduction
        ratio always uses the exact curvature (as adaptive learning rate or
        momentum do anyway), not the estimate.
      precon_damping_mult: without `precon_damping_schedule`, the
        preconditioner's damping is the damping times this.
      precon_damping_schedule: the preconditioner's damping as a function
        of the step (the quadratic model keeps the regular damping).
      use_step_rejection: reject a step whose new loss on its batch is
        higher than the old (or NaN): the parameters and velocities stay
        as they were and the damping is multiplied by
        `reject_damping_increase_factor`. Costs a loss evaluation a step.
      reject_damping_increase_factor: see `use_step_rejection`.
      norm_constraint: if given, the update is scaled down so that
        `lr² · gᵀ precon`, its squared norm under the estimate, is at most
        this; not with an adaptive learning rate.
      num_burnin_steps: curvature updates, without parameter updates, run by
        the first `step`.
      estimation_mode: one of `estimators.ESTIMATION_MODES`; None uses the
        estimator's default.
      custom_estimator_ctor: the curvature estimator's class (e.g. a
        subclass of `BlockDiagonalCurvature`), called with the keyword
        arguments of `BlockDiagonalCurvature`.
      curvature_ema: the factor on the old estimate in its moving average.
      curvature_update_period: the estimate is updated on steps divisible
        by this; at most `inverse_update_period`.
      inverse_update_period: steps between refreshes of the cached powers.
      use_exact_inverses: cache exact powers (eigendecompositions) rather
        than the factored-damping approximation.
      batch_process_func: applied to every batch before use.
      register_only_generic: tag every parameter with a generic tag instead
        of matching layers.
      patterns_to_skip: graph-matcher patterns not to use.
      use_automatic_registration: find layers with the graph matcher; False
        uses only the layers registered by hand.
      auto_register_kwargs: further options for the graph matcher.
      layer_tag_to_block_ctor: block constructors by tag name.
      multi_device: run the step under `jax.pmap` over the local devices;
        inputs then carry a leading device axis.
      debug: run without `jit`/`pmap` (and on one device).
      invalid_metric_value: the value of the stats not computed on a step
        ("rho", "new_loss", "quad_model_change").
      batch_size_extractor: maps a batch to its per-device size.
      pmap_axis_name: the axis name used with `multi_device`.
      forbid_setting_attributes_after_finalize: whether setting attributes
        after `init` raises.
      modifiable_attribute_exceptions: attributes that may still be set.
      include_norms_in_stats: add the norms of the parameters, gradient,
        preconditioned gradient and update to the stats.
      include_per_param_norms_in_stats: the same per parameter array.
      include_registered_loss_in_stats: add "loss_registered", the loss of
        the registered losses (plus the L2 term), and its relative
        difference from the loss, "loss_registered_reldiff", to the stats;
        the registrations need their targets.
      distributed_precon_apply: with `multi_device`, each device applies
        the cached inverses of its share of the blocks (balanced by
        estimated cost) and the results are summed across devices; False:
        every device applies every block.
      distributed_inverses: the same for the inverse refreshes.
      num_estimator_samples: samples per example that the sampled
        estimation modes average.
      should_vmap_estimator_samples: compute those samples with `jax.vmap`
        (else one after another).
      norm_to_scale_identity_weight_per_block: a norm name (see the
        estimators' `multiply_matpower`) scaling each block's damping by
        that norm of the block; not with adaptive learning rate, momentum
        or damping. None or "none": no scaling.
      precon_power: the power of the damped curvature that preconditions
        the gradient (-1: K-FAC; -0.5 with diagonal blocks: RMSProp-like).
      exact_quad_model_matrix_type: the curvature of the exact quadratic
        model, 'fisher' or 'ggn'; None: the one the estimation mode
        estimates.
      estimator_ctor: an older name of `custom_estimator_ctor`.

    Raises:
      ValueError: for conflicting or invalid settings (e.g. both an
        adaptive rule and a schedule for one hyperparameter).
    """
    settings = {k: v for k, v in locals().items() if k != "self"}
    optimizer_settings.check(settings)
    if norm_to_scale_identity_weight_per_block == "none":
      norm_to_scale_identity_weight_per_block = None
    self._value_and_grad_func = value_and_grad_func
    self._l2_reg = l2_reg
    self._exclusions = quad_model.parse_exclusions(
      regularized_parameters_path_exclusions
    )
    self._has_aux, self._has_state = value_func_has_aux, value_func_has_state
    self._has_rng = value_func_has_rng
    self._adaptive_lr = use_adaptive_learning_rate
    self._lr_schedule = learning_rate_schedule
    self._adaptive_momentum = use_adaptive_momentum
    self._momentum_schedule = momentum_schedule
    self._adaptive_damping = use_adaptive_damping
    self._damping_schedule = damping_schedule
    self._initial_damping = initial_damping
    self._calibrate_damping = use_initial_damping_calibration
    self._min_damping, self._max_damping = min_damping, max_damping
    self._include_damping_in_quad_change = include_damping_in_quad_change
    self._damping_interval = damping_adaptation_interval
    self._damping_decay = damping_adaptation_decay
    self._damping_lower, self._damping_upper = (
      damping_lower_threshold,
      damping_upper_threshold,
    )
    self._exact_qmodel_for_damping = (
      always_use_exact_qmodel_for_damping_adjustment
    )
    self._precon_damping_mult = precon_damping_mult
    self._precon_damping_schedule = precon_damping_schedule
    self._use_step_rejection = use_step_rejection
    self._reject_factor = reject_damping_increase_factor
    self._norm_constraint = norm_constraint
    self._num_burnin_steps = num_burnin_steps
    self._curvature_ema = curvature_ema
    self._curvature_update_period = curvature_update_period
    self._inverse_update_period = inverse_update_period
    self._use_exact_inverses = use_exact_inverses
    self._batch_process_func = batch_process_func or (lambda b: b)
    self._multi_device = multi_device and not debug
    self._debug = debug
    self._invalid_metric_value = invalid_metric_value
    self._batch_size_extractor = batch_size_extractor
    self._pmap_axis_name = pmap_axis_name if self._multi_device else None
    self._include_norms = include_norms_in_stats
    self._include_per_param_norms = include_per_param_norms_in_stats
    self._include_registered_loss = include_registered_loss_in_stats
    self._block_norm = norm_to_scale_identity_weight_per_block
    self._precon_power = float(precon_power)
    self._quad_matrix_type = exact_quad_model_matrix_type
    self._own_estimator_func = value_func_for_estimator is not None
    self.distributed_precon_apply = distributed_precon_apply
    self.distributed_inverses = distributed_inverses

    auto_kwargs = graph_matcher.matcher_options(
      auto_register_kwargs, register_only_generic, patterns_to_skip
    )
    self._value_func = self._make_value_func()
    ctor = custom_estimator_ctor or estimator_ctor or BlockDiagonalCurvature
    estimator_kwargs = dict(
      func=value_func_for_estimator or self._value_func,
      params_index=0,
      layer_tag_to_block_ctor=layer_tag_to_block_ctor,
      distributed_multiplies=distributed_precon_apply,
      distributed_cache_updates=distributed_inverses,
      auto_register_tags=use_automatic_registration,
      **auto_kwargs,
    )
    if estimation_mode is not None:
      estimator_kwargs["default_estimation_mode"] = estimation_mode
    # Options at their defaults are left out, so that any estimator class
    # with `BlockDiagonalCurvature`'s older arguments serves.
    if num_estimator_samples != 1 or should_vmap_estimator_samples:
      estimator_kwargs.update(
        num_samples=num_estimator_samples,
        should_vmap_samples=should_vmap_estimator_samples,
      )
    if value_func_has_state or value_func_has_rng:
      estimator_kwargs["batch_index"] = (
        1 + value_func_has_state + value_func_has_rng
      )
    self._estimator = ctor(**estimator_kwargs)
    self._estimation_mode = self._estimator.default_estimation_mode
    self._linearized = tracer.loss_tags_linearize(self._value_func)
    # Whether a step updates the estimate, refreshes the powers or adapts
    # the damping is known on the host, so each combination is its own
    # program: a `lax.cond` would copy the whole estimator state through
    # its untaken branch.
    self._compiled_step = self._stage(self._step, static_argnums=(9, 10, 11))
    self._compiled_refresh_step = self._stage(
      self._step, static_argnums=(9, 10, 11), cpu_options=_REFRESH_CPU_OPTIONS
    )
    self._compiled_init = self._stage(self._init, static_argnums=())
    self._compiled_burnin = self._stage(self._burnin_step, static_argnums=())
    # The counter array the last step returned and its value: a state passed
    # back in unchanged needs no device read to know its step.
    self._last_counter: list[Any] = [None, None]
    self._finalized = False
    self._modifiable = set(modifiable_attribute_exceptions)
    self._forbid_setting = forbid_setting_attributes_after_finalize

  def __setattr__(self, name, value):
    if (
      getattr(self, "_finalized", False)
      and getattr(self, "_forbid_setting", False)
      and name not in getattr(self, "_modifiable", ())
    ):
      raise AttributeError(
        f"Cannot set {name!r} after the optimizer has been "
        "initialised (its step is already compiled)."
      )
    super().__setattr__(name, value)

  # --- properties --------------------------------------------------------

  @property
  def num_burnin_steps(self) -> int:
    """Curvature-only updates the first `step` runs."""
    return self._num_burnin_steps

  @property
  def l2_reg(self) -> jax.Array:
    """The L2 coefficient, added to the damping of the curvature."""
    return jnp.asarray(self._l2_reg)

  @property
  def estimator(self) -> curvature.BlockDiagonalCurvature:
    """The curvature estimator (its blocks exist after `init`)."""
    return self._estimator

  @property
  def damping_decay_factor(self) -> Numeric:
    """The factor one adaptation multiplies or divides the damping by."""
    return self._damping_decay**self._damping_interval

  # --- plumbing ----------------------------------------------------------

  def _stage(self, fn, static_argnums, cpu_options=None):
    if self._debug:
      return fn
    return staging.stage(fn, static_argnums, self._pmap_axis_name, cpu_options)

  def _split_outputs(self, out):
    """(loss, func_state, aux) from the value function's first output."""
    return extract_func_outputs(out, self._has_aux, self._has_state)

  def _make_value_func(self):
    def value_func(*args):
      out, _ = self._value_and_grad_func(*args)
      return self._split_outputs(out)[0]

    return value_func

  def _func_args(self, params, func_state, rng, batch):
    return make_func_args(
      params, func_state, rng, batch, self._has_state, self._has_rng
    )

  def _mean(self, x):
    if self._pmap_axis_name is None:
      return x
    return jax.lax.pmean(x, self._pmap_axis_name)

  def _batch_size(self, batch):
    return self._batch_size_extractor(batch)

  # --- public API ----------------------------------------------------------

  def verify_args_and_get_step_counter(
    self,
    step_counter: jax.Array,
    learning_rate: Numeric | None = None,
    momentum: Numeric | None = None,
    damping: Numeric | None = None,
    global_step_int: int | None = None,
  ) -> int:
    """Checks the hyperparameters given to `step` against the settings.

    Each of learning rate, momentum and damping must be given exactly when
    the optimizer neither adapts nor schedules it.

    Args:
      step_counter: the state's step counter.
      learning_rate: the value given to `step`, or None.
      momentum: the value given to `step`, or None.
      damping: the value given to `step`, or None.
      global_step_int: the step as a Python int, if the caller knows it.

    Returns:
      The step number: `global_step_int`, else the counter's value (read
      from the device unless this optimizer returned that counter).

    Raises:
      ValueError: for a missing or superfluous hyperparameter.
    """
    optimizer_settings.check_step_hyperparameters(
      dict(
        learning_rate=(self._adaptive_lr, self._lr_schedule, learning_rate),
        momentum=(self._adaptive_momentum, self._momentum_schedule, momentum),
        damping=(self._adaptive_damping, self._damping_schedule, damping),
      )
    )
    if global_step_int is not None:
      return int(global_step_int)
    return self._read_step(step_counter)

  def _known_step(self, step_counter) -> int | None:
    array, value = self._last_counter
    return value if step_counter is array else None

  def _read_step(self, step_counter) -> int:
    known = self._known_step(step_counter)
    if known is not None:
      return known
    return int(np.asarray(jax.device_get(step_counter)).ravel()[0])

  def should_update_damping(self, state: OptimizerState) -> jax.Array:
    """Whether the step at this state adapts the damping.

    Args:
      state: the optimizer state.

    Returns:
      A boolean array (False without adaptive damping).
    """
    return self._is_damping_step(state.step_counter)

  def _is_damping_step(self, step):
    """Works on the host's step number and on the state's counter alike:
    the last step of every `damping_adaptation_interval` (as KFAC-JAX)."""
    return self._adaptive_damping & ((step + 1) % self._damping_interval == 0)

  def _is_refresh_step(self, step: int) -> bool:
    return step % self._inverse_update_period == 0

  def _is_curvature_step(self, step: int) -> bool:
    return step % self._curvature_update_period == 0

  def compute_loss_value(self, func_args: Sequence[Any]) -> jax.Array:
    """The loss at `func_args`, without aux or state.

    Args:
      func_args: `(params, [func_state,] [rng,] batch)`.

    Returns:
      The scalar loss (this device's, under `multi_device`).
    """
    out, _ = self._value_and_grad_func(*func_args)
    return self._split_outputs(out)[0]

  def compute_l2_quad_matrix(self, vectors: Sequence[Params]) -> jax.Array:
    """The L2 term of the exact quadratic model.

    Args:
      vectors: `n` params-shaped pytrees `v_i`.

    Returns:
      The `(n, n)` matrix `l2_reg * v_iᵀ L v_j`, `L` the 0/1 mask of the
      parameters not in `regularized_parameters_path_exclusions`.
    """
    return self.l2_reg * self._regularized_gram(vectors)

  def _regularized_gram(self, vectors: Sequence[Params]) -> jax.Array:
    """`v_iᵀ L v_j` (see `compute_l2_quad_matrix`)."""
    masked = [
      quad_model.mask_unregularized(v, self._exclusions) for v in vectors
    ]
    return utils.gram_matrix(masked)

  @property
  def exact_quad_model_matrix_type(self) -> str:
    """The curvature of the exact quadratic model: 'fisher' or 'ggn'."""
    if self._quad_matrix_type is not None:
      return self._quad_matrix_type
    kind = estimation_modes.matrix_type(self._estimation_mode)
    return "ggn" if kind == "ggn" else "fisher"

  def compute_exact_quad_model(
    self,
    vectors: Sequence[Params],
    grads: Params,
    func_args: Sequence[Any] | None = None,
  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The terms of the quadratic model with the exact curvature `C`.

    `C` is the matrix `exact_quad_model_matrix_type` names (by default the
    GGN for the ggn modes and the Fisher otherwise; equal for the
    registered losses), averaged over the batch; products go through the
    network's Jacobian once per vector (forward mode), never a dense matrix.

    Args:
      vectors: `n` params-shaped pytrees `v_i`.
      grads: the gradient `g`, shaped like the params.
      func_args: `(params, [func_state,] [rng,] batch)` to evaluate `C` at.

    Returns:
      `(vᵢᵀ C vⱼ, vᵢᵀ vⱼ, gᵀ vᵢ)`: two `(n, n)` matrices and an `(n,)` vector.

    Raises:
      ValueError: without `func_args`.
    """
    if func_args is None:
      raise ValueError("compute_exact_quad_model needs func_args.")
    losses, jvp = self._linearized(func_args)
    matrix = quad_model.curvature_gram(
      losses, jvp, vectors, self.exact_quad_model_matrix_type
    )
    batch_size = self._batch_size(func_args[-1])
    matrix = self._mean(matrix.astype(state_dtype(vectors)) / batch_size)
    return (matrix, *quad_model.gram_and_linear(vectors, grads))

  def compute_approx_quad_model(
    self, state: OptimizerState, vectors: Sequence[Params], grads: Params
  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The terms of `compute_exact_quad_model` with `C` the estimate.

    Args:
      state: the optimizer state; its current estimate is used, not the
        cache.
      vectors: `n` params-shaped pytrees `v_i`.
      grads: the gradient `g`, shaped like the params.

    Returns:
      `(vᵢᵀ C vⱼ, vᵢᵀ vⱼ, gᵀ vᵢ)`.
    """
    products = [
      self._estimator.multiply(
        state.estimator_state,
        v,
        0.0,
        exact_power=True,
        use_cached=False,
        pmap_axis_name=self._pmap_axis_name,
      )
      for v in vectors
    ]
    return (
      utils.gram_matrix(vectors, products),
      *quad_model.gram_and_linear(vectors, grads),
    )

  def init(
    self,
    params: Params,
    rng: jax.Array,
    batch: Batch,
    func_state: FuncState = None,
  ) -> OptimizerState:
    """The initial state; the model is traced and the blocks built here.

    Args:
      params: the model parameters (with a leading device axis under
        `multi_device`, as all inputs).
      rng: a PRNG key.
      batch: an example batch.
      func_state: the loss function's state, with `value_func_has_state`.

    Returns:
      Zero velocities and estimate, damping `initial_damping` (0 without
      adaptive damping) and counters at 0.
    """
    batch = self._batch_process_func(batch)
    if self._exclusions:
      self._log_exclusions(params)
    state = self._compiled_init(params, rng, batch, func_state)
    if not self._finalized:  # a second init is allowed; the flag is set once
      self._finalized = True
    return state

  def _log_exclusions(self, params):
    paths = jax.tree_util.tree_flatten_with_path(params)[0]
    for path, _ in paths:
      excluded = quad_model.is_excluded(path, self._exclusions)
      _log.info("%s %s", "No L2 term on" if excluded else "L2 term on", path)

  def _cached_powers(self):
    """(exact, approximate) powers to cache: `precon_power`, one kind."""
    power = self._precon_power
    return (power, None) if self._use_exact_inverses else (None, power)

  def _init(self, params, rng, batch, func_state):
    func_args = self._func_args(params, func_state, rng, batch)
    exact, approx = self._cached_powers()
    estimator_state = self._estimator.init(rng, func_args, exact, approx)
    damping = self._initial_damping if self._adaptive_damping else 0.0
    return OptimizerState(
      velocities=jax.tree.map(jnp.zeros_like, params),
      estimator_state=estimator_state,
      damping=jnp.asarray(damping, state_dtype(params)),
      data_seen=jnp.zeros((), jnp.int32),
      step_counter=jnp.zeros((), jnp.int32),
    )

  def _burnin_step(self, params, state, rng, batch, func_state):
    func_args = self._func_args(params, func_state, rng, batch)
    estimator_state = self._estimator.update_curvature_matrix_estimate(
      _copy(state.estimator_state),
      1.0,
      1.0,
      self._batch_size(batch),
      rng,
      func_args,
      self._pmap_axis_name,
    )
    if self._has_state:  # the function's own state moves on, as in a step
      out, _ = self._value_and_grad_func(*func_args)
      func_state = self._split_outputs(out)[1]
    return dataclasses.replace(
      state, estimator_state=estimator_state
    ), func_state

  def burnin(
    self,
    num_steps: int,
    params: Params,
    state: OptimizerState,
    rng: jax.Array,
    data_iterator: Iterator[Batch],
    func_state: FuncState = None,
  ) -> tuple[OptimizerState, FuncState]:
    """Accumulates curvature estimates without changing the parameters.

    Each batch is added to the estimate with equal weight; the step counter
    does not move.

    Args:
      num_steps: how many batches to take from `data_iterator`.
      params: the model parameters.
      state: the optimizer state.
      rng: a PRNG key (one per device under `multi_device`), split for
        every batch.
      data_iterator: yields the batches.
      func_state: the loss function's state; it advances with every batch,
        as in a step.

    Returns:
      The new state and `func_state`.
    """
    split = (
      jax.vmap(jax.random.split) if self._multi_device else (jax.random.split)
    )
    for _ in range(num_steps):
      keys = split(rng)
      rng, key = (keys[:, 0], keys[:, 1]) if self._multi_device else keys
      batch = self._batch_process_func(next(data_iterator))
      state, func_state = self._compiled_burnin(
        params, state, key, batch, func_state
      )
    return state, func_state

  def step(
    self,
    params: Params,
    state: OptimizerState,
    rng: jax.Array,
    data_iterator: Iterator[Batch] | None = None,
    batch: Batch | None = None,
    func_state: FuncState = None,
    learning_rate: Numeric | None = None,
    momentum: Numeric | None = None,
    damping: Numeric | None = None,
    global_step_int: int | None = None,
  ) -> tuple[Any, ...]:
    """One compiled optimizer step (preceded by burn-in on the first).

    The step folds the batch into the curvature estimate, refreshes the
    cached inverses every `inverse_update_period` steps, preconditions the
    gradient, picks the coefficients and, on adaptation steps, adapts the
    damping.

    Args:
      params: the model parameters.
      state: the optimizer state.
      rng: a PRNG key; use a different one for every step.
      data_iterator: yields batches (also for burn-in); give it or `batch`.
      batch: a single batch, also used for every burn-in step.
      func_state: the loss function's state, with `value_func_has_state`.
      learning_rate: needed unless adaptive or scheduled.
      momentum: needed unless adaptive or scheduled.
      damping: needed unless adaptive or scheduled.
      global_step_int: the step number as a Python int, which saves a read
        from the device; checked against the state where that is free.

    Returns:
      `(params, state, stats)`, or `(params, state, func_state, stats)` with
      `value_func_has_state`. `stats` holds "loss", "learning_rate",
      "momentum", "damping", "rho" (NaN unless the damping was adapted),
      "quad_model_change", "data_seen", "step", and "aux" and norms when
      configured.

    Raises:
      ValueError: for missing or superfluous hyperparameters, both or
        neither of `data_iterator` and `batch`, or a `global_step_int` that
        differs from the state's step.
    """
    if (data_iterator is None) == (batch is None):
      raise ValueError("Pass exactly one of data_iterator and batch to step().")
    step = self.verify_args_and_get_step_counter(
      state.step_counter, learning_rate, momentum, damping, global_step_int
    )
    counter = state.step_counter
    # Waiting for the device counter would stall the pipeline, so an unknown
    # one is compared only when it is already computed (always at step 0).
    verified = global_step_int is None or (
      self._known_step(counter) is not None
      or global_step_int == 0
      or self._debug
      # A device array has it; `jax.Array`'s stub does not declare it.
      or counter.is_ready()  # type: ignore[attr-defined]
    )
    if global_step_int is not None and verified:
      actual = self._read_step(counter)
      if actual != global_step_int:
        raise ValueError(
          f"global_step_int={global_step_int} but the "
          f"optimizer state is at step {actual}."
        )
    if step == 0 and self._num_burnin_steps > 0:
      burnin_data = (
        data_iterator
        if data_iterator is not None
        else iter([batch] * self._num_burnin_steps)
      )
      state, func_state = self.burnin(
        self._num_burnin_steps, params, state, rng, burnin_data, func_state
      )
    if data_iterator is not None:  # (exactly one of them was given)
      batch = next(data_iterator)
    batch = self._batch_process_func(batch)
    dtype = state.damping.dtype
    num_devices = state.damping.shape[0] if self._multi_device else 1
    # The examples seen so far, for schedules that take `data_seen`.
    data_seen = state.data_seen[0] if self._multi_device else state.data_seen
    hyper = [
      self._hyper(value, schedule, step, data_seen, dtype, num_devices)
      for value, schedule in (
        (learning_rate, self._lr_schedule),
        (momentum, self._momentum_schedule),
        (damping, self._damping_schedule),
        (None, self._precon_damping_schedule),
      )
    ]
    refresh = self._is_refresh_step(step)
    compiled = self._compiled_refresh_step if refresh else self._compiled_step
    if step == 0 and self._adaptive_damping and self._calibrate_damping:
      state = self._calibrated(params, state, rng, batch, func_state, hyper)
    # The flags are positional: they are the static arguments 9 to 11.
    params, state, func_state, stats = compiled(
      params,
      state,
      rng,
      batch,
      func_state,
      *hyper,
      self._is_curvature_step(step),
      refresh,
      self._is_damping_step(step),
    )
    self._last_counter[:] = [state.step_counter, step + 1 if verified else None]
    if self._has_state:
      return params, state, func_state, stats
    return params, state, stats

  def _calibrated(self, params, state, rng, batch, func_state, hyper):
    """`state` with its damping calibrated (`use_initial_damping_calibration`):
    the first step's damping adaptation is repeated on its batch, with the
    estimate as burn-in left it, until the damping no longer changes."""
    compiled = self._compiled_refresh_step
    for _ in range(MAX_CALIBRATION_ITERATIONS):
      old = np.asarray(jax.device_get(state.damping)).ravel()[0]
      trial = compiled(
        params, state, rng, batch, func_state, *hyper, False, True, True
      )[1]
      state = dataclasses.replace(state, damping=trial.damping)
      if np.asarray(jax.device_get(state.damping)).ravel()[0] == old:
        return state
    _log.warning(
      "The initial damping calibration stopped after %d evaluations "
      "without settling.",
      MAX_CALIBRATION_ITERATIONS,
    )
    return state

  def _hyper(self, value, schedule, step, data_seen, dtype, num_devices):
    if schedule is not None:
      value = utils.call_func_with_conditional_kwargs(
        schedule, step, data_seen=data_seen
      )
    if value is None:
      return None
    value = jnp.asarray(value, dtype)
    if self._multi_device:
      # One copy per device the state is on (not every local device).
      value = jnp.broadcast_to(value, (num_devices,))
    return value

  # --- the staged step ----------------------------------------------------

  def uncompiled_step(
    self,
    params: Params,
    state: OptimizerState,
    rng: jax.Array,
    batch: Batch,
    func_state: FuncState = None,
    learning_rate: Numeric | None = None,
    momentum: Numeric | None = None,
    damping: Numeric | None = None,
    precon_damping: Numeric | None = None,
    *,
    refresh_cache: bool,
    update_damping: bool,
    update_curvature: bool = True,
  ) -> tuple[Params, OptimizerState, FuncState, dict[str, Any]]:
    """The function `step` compiles, as a pure traceable function.

    Use it to inspect or cost a step (e.g. `jax.jit(...).lower(...)`) or to
    embed one in a larger program. Unlike `step` it runs no burn-in, applies
    no `batch_process_func` or schedules and checks no arguments; the caller
    makes the choices `step` makes from the step number. Under
    `multi_device` it must run inside `pmap` over `pmap_axis_name`.

    Args:
      params: the model parameters.
      state: the optimizer state.
      rng: a PRNG key.
      batch: the batch, already processed.
      func_state: the loss function's state, or None.
      learning_rate: the learning rate; None when it is adaptive.
      momentum: the momentum; None when it is adaptive.
      damping: the damping; ignored with adaptive damping.
      precon_damping: the preconditioner's damping; None: the damping
        times `precon_damping_mult`.
      refresh_cache: whether to refresh the cached powers first (as on
        steps divisible by `inverse_update_period`).
      update_damping: whether to adapt the damping afterwards (as on
        adaptation steps with adaptive damping).
      update_curvature: whether to fold the batch into the estimate (as
        on steps divisible by `curvature_update_period`).

    Returns:
      `(params, state, func_state, stats)`, as `step` computes them.
    """
    return self._step(
      params,
      state,
      rng,
      batch,
      func_state,
      learning_rate,
      momentum,
      damping,
      precon_damping,
      update_curvature,
      refresh_cache,
      update_damping,
    )

  def _step(
    self,
    params,
    state,
    rng,
    batch,
    func_state,
    learning_rate,
    momentum,
    damping,
    precon_damping,
    update_curvature,
    refresh,
    update_damping,
  ):
    func_args = self._func_args(params, func_state, rng, batch)
    batch_size = self._batch_size(batch)
    estimator_state = _copy(state.estimator_state)
    if update_curvature:
      estimator_state = self._estimator.update_curvature_matrix_estimate(
        estimator_state,
        self._curvature_ema,
        1.0,
        batch_size,
        rng,
        func_args,
        self._pmap_axis_name,
      )
    damping = state.damping if self._adaptive_damping else damping
    if precon_damping is None:
      precon_damping = damping * self._precon_damping_mult
    identity_weight = precon_damping + self._l2_reg
    if refresh:
      exact, approx = self._cached_powers()
      estimator_state = self._estimator.update_cache(
        estimator_state,
        identity_weight,
        exact_powers=exact,
        approx_powers=approx,
        eigenvalues=False,
        pmap_axis_name=self._pmap_axis_name,
        **self._block_norm_kwargs(),
      )
    state = dataclasses.replace(state, estimator_state=estimator_state)

    out, grads = self._value_and_grad_func(*func_args)
    loss, new_func_state, aux = self._split_outputs(out)
    loss, grads = self._mean((loss, grads))
    precon = self._precondition(state, grads, func_args, identity_weight)
    scaled_sq_norm = None
    if self._norm_constraint is not None:
      scaled_sq_norm = utils.inner_product(precon, grads) * learning_rate**2
      precon = utils.scalar_mul(
        precon,
        jnp.minimum(1.0, jnp.sqrt(self._norm_constraint / scaled_sq_norm)),
      )

    vectors = (precon, state.velocities)
    coefficients, q_change = self._coefficients_and_change(
      state,
      vectors,
      grads,
      func_args,
      learning_rate,
      momentum,
      damping,
      update_damping,
    )
    delta = utils.weighted_sum_of_objects(vectors, coefficients)
    new_params = _add(params, delta)
    invalid = jnp.asarray(self._invalid_metric_value, loss.dtype)
    new_loss = rho = invalid
    if update_damping or self._use_step_rejection:
      new_loss = self._mean(
        self.compute_loss_value((new_params, *func_args[1:]))
      )
    new_damping = state.damping
    if update_damping:
      rho = ((new_loss - loss) / q_change).astype(loss.dtype)
      new_damping = quad_model.adapt_damping(
        damping,
        rho,
        self.damping_decay_factor,
        self._damping_lower,
        self._damping_upper,
        self._min_damping,
        self._max_damping,
      ).astype(state.damping.dtype)
    velocities = delta
    rejected = None
    if self._use_step_rejection:
      rejected = jnp.isnan(new_loss) | (new_loss > loss)
      keep = lambda old, new: jax.tree.map(
        lambda o, n: jnp.where(rejected, o, n), old, new
      )
      new_params = keep(params, new_params)
      velocities = keep(state.velocities, delta)
      new_damping = jnp.where(
        rejected, new_damping * self._reject_factor, new_damping
      ).astype(new_damping.dtype)
    num_devices = (
      jax.lax.psum(1, self._pmap_axis_name) if self._pmap_axis_name else 1
    )
    new_state = OptimizerState(
      velocities=velocities,
      estimator_state=estimator_state,
      damping=new_damping,
      data_seen=state.data_seen + batch_size * num_devices,
      step_counter=state.step_counter + 1,
    )
    stats = dict(
      step=new_state.step_counter,
      batch_size=jnp.asarray(batch_size * num_devices, jnp.int32),
      data_seen=new_state.data_seen,
      loss=loss,
      new_loss=new_loss if update_damping else invalid,
      learning_rate=-coefficients[0],
      momentum=coefficients[1],
      damping=damping,
      precon_damping=precon_damping,
      rho=rho,
      quad_model_change=q_change,
      scaled_grad_norm_sq=scaled_sq_norm,
    )
    if rejected is not None:
      stats["step_rejected"] = rejected
    if aux is not None:
      stats["aux"] = self._mean(aux)
    if self._include_norms or self._include_per_param_norms:
      stats.update(
        optimizer_stats.norms(
          dict(param=new_params, grad=grads, precon_grad=precon, update=delta),
          whole=self._include_norms,
          per_param=self._include_per_param_norms,
        )
      )
    if self._include_registered_loss:
      losses, _ = self._linearized(func_args)
      registered = self._mean(
        optimizer_stats.registered_loss(
          losses, self._batch_size(batch), self._l2_reg, params
        )
      )
      stats["loss_registered"] = registered
      stats["loss_registered_reldiff"] = (registered - loss) / loss
    return new_params, new_state, new_func_state, stats

  def _block_norm_kwargs(self) -> dict[str, Any]:
    """The per-block damping scaling, passed only when one is chosen."""
    if self._block_norm is None:
      return {}
    return dict(norm_to_scale_identity_weight_per_block=self._block_norm)

  def _precondition(self, state, grads, func_args, identity_weight):
    """`(C + identity_weight I)^precon_power grads`, from the cache."""
    exact = self._use_exact_inverses
    plain = (
      self._precon_power != -1
      or self._block_norm is not None
      or self._own_estimator_func
    )
    if plain:
      # The gradient-rows route of `multiply_inverse_of_gradient` needs the
      # inverse, and `grads` to be the gradient of the estimator's function.
      return self._estimator.multiply_matpower(
        state.estimator_state,
        grads,
        identity_weight,
        self._precon_power,
        exact_power=exact,
        use_cached=True,
        pmap_axis_name=self._pmap_axis_name,
        **self._block_norm_kwargs(),
      )
    return self._estimator.multiply_inverse_of_gradient(
      state.estimator_state,
      grads,
      func_args,
      identity_weight,
      exact_power=exact,
      use_cached=True,
      pmap_axis_name=self._pmap_axis_name,
    )

  def _coefficients_and_change(
    self,
    state,
    vectors,
    grads,
    func_args,
    learning_rate,
    momentum,
    damping,
    update_damping,
  ):
    """The update's coefficients (α, μ) and the quadratic model's change
    (`invalid_metric_value` where neither needs the model)."""
    adaptive = self._adaptive_lr or self._adaptive_momentum
    first_step = state.step_counter == 0
    if not (adaptive or update_damping):
      neg_lr = jnp.asarray(-learning_rate, state.damping.dtype)
      mu = jnp.where(first_step, 0.0, momentum).astype(neg_lr.dtype)
      invalid = jnp.asarray(self._invalid_metric_value, neg_lr.dtype)
      return jnp.stack([neg_lr, mu]), invalid
    if adaptive or self._exact_qmodel_for_damping:
      curv, gram, linear = self.compute_exact_quad_model(
        vectors, grads, func_args
      )
      # With no parameter excluded from the L2 term, its Gram matrix is the
      # vectors' own, just computed.
      regularized = (
        self._regularized_gram(vectors) if self._exclusions else gram
      )
    else:
      curv, gram, linear = self.compute_approx_quad_model(state, vectors, grads)
      regularized = gram  # the estimate's model: L2 on every parameter
    return quad_model.coefficients_and_change(
      (curv, gram, regularized, linear),
      self._l2_reg,
      damping,
      None if self._adaptive_lr else -learning_rate,
      None if self._adaptive_momentum else momentum,
      first_step,
      self._include_damping_in_quad_change,
    )
