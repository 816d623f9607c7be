"""The K-FAC optimizer.

One step: fold the batch into the curvature estimate (an EMA), refresh the
cached inverses every `inverse_update_period` steps, precondition the
gradient, choose the learning rate and momentum (fixed, scheduled, or by
minimising the 2-D quadratic model of the original K-FAC paper), apply the
update, and every `damping_adaptation_interval` steps adapt the damping with
the Levenberg–Marquardt rule from the reduction ratio rho.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from estimators import curvature, estimation_modes, graph_matcher, tracer, utils
from estimators.utils import staging
from estimators.utils.types import Batch, FuncState, Numeric, Params

# A function of the step number giving a hyperparameter's value.
Schedule = Callable[[int], Numeric]


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


# A refresh step runs once every `inverse_update_period` steps; its compile
# time goes to the many small fusions around the factor inverses, which XLA's
# older loop emitters compile much sooner while running about as fast. The
# other steps keep the newer emitters, whose elementwise code runs better.
# (`staging.stage` drops the option where a jaxlib no longer has it.)
_REFRESH_CPU_OPTIONS = {"xla_cpu_use_fusion_emitters": False}


def _solve_2x2(matrix, rhs):
  """Cramer's rule: a LAPACK solve would cost more than the whole 2x2 model."""
  (a, b), (c, d) = matrix
  return jnp.stack([d * rhs[0] - b * rhs[1], a * rhs[1] - c * rhs[0]]) / (
    a * d - b * c
  )


class Optimizer:
  """K-FAC with the constructor arguments and defaults of the reference.

  The update is `α · precon + μ · velocity`, `precon = (C + (λ + l2_reg) I)⁻¹
  g` with `C` the block-diagonal curvature estimate, `λ` the damping and `g`
  the gradient. The learning rate `-α` and momentum `μ` are given,
  scheduled, or chosen to minimise the quadratic model
  `½ cᵀ Q c + bᵀ c` of the loss along `(precon, velocity)`.
  """

  State = OptimizerState

  def __init__(
    self,
    value_and_grad_func: Callable,
    l2_reg: Numeric,
    value_func_has_aux: bool = False,
    value_func_has_state: bool = False,
    value_func_has_rng: bool = False,
    use_adaptive_learning_rate: bool = False,
    learning_rate_schedule: Schedule | None = None,
    use_adaptive_momentum: bool = False,
    momentum_schedule: Schedule | None = None,
    use_adaptive_damping: bool = False,
    damping_schedule: Schedule | None = None,
    initial_damping: Numeric | None = None,
    min_damping: Numeric = 1e-8,
    max_damping: Numeric = math.inf,
    include_damping_in_quad_change: bool = False,
    damping_adaptation_interval: int = 5,
    damping_adaptation_decay: Numeric = 0.9,
    damping_lower_threshold: Numeric = 0.25,
    damping_upper_threshold: Numeric = 0.75,
    always_use_exact_qmodel_for_damping_adjustment: bool = False,
    norm_constraint: Numeric | None = None,
    num_burnin_steps: int = 10,
    estimation_mode: str = "fisher_gradients",
    curvature_ema: Numeric = 0.95,
    inverse_update_period: int = 5,
    use_exact_inverses: bool = False,
    batch_process_func: Callable[[Batch], Batch] | None = None,
    register_only_generic: bool = False,
    patterns_to_skip: Sequence[str] = (),
    auto_register_kwargs: dict[str, Any] | None = None,
    layer_tag_to_block_ctor: Mapping[str, curvature.CurvatureBlockCtor]
    | None = None,
    multi_device: bool = False,
    debug: bool = False,
    batch_size_extractor: Callable[
      [Batch], int
    ] = curvature.default_batch_size_extractor,
    pmap_axis_name: str = "kfac_axis",
    forbid_setting_attributes_after_finalize: bool = True,
    modifiable_attribute_exceptions: Sequence[str] = (),
    include_norms_in_stats: bool = False,
    include_per_param_norms_in_stats: bool = False,
    distributed_precon_apply: bool = True,
    distributed_inverses: bool = True,
    estimator_ctor: Callable[
      ..., curvature.BlockDiagonalCurvature
    ] = curvature.BlockDiagonalCurvature,
  ):
    """Checks the settings and prepares the compiled step.

    Args:
      value_and_grad_func: called as `value_and_grad_func(params,
        [func_state,] [rng,] batch)`, it returns `(out, grads)` where `out`
        is the loss, or `(loss, func_state)`, `(loss, aux)` or
        `(loss, (func_state, aux))` per the two flags below. The loss must
        be registered, e.g. with `register_softmax_cross_entropy_loss`.
      l2_reg: the coefficient `c` of an L2 term `c/2 ||θ||²` that the loss
        already contains; it is added to the damping and to the quadratic
        model.
      value_func_has_aux: whether the loss function returns auxiliary data.
      value_func_has_state: whether it takes and returns a state.
      value_func_has_rng: whether it takes a PRNG key.
      use_adaptive_learning_rate: choose the learning rate from the
        quadratic model (exact curvature); else pass it to `step` or give a
        schedule.
      learning_rate_schedule: the learning rate as a function of the step.
      use_adaptive_momentum: choose the momentum from the quadratic model.
      momentum_schedule: the momentum as a function of the step.
      use_adaptive_damping: adapt the damping with the Levenberg–Marquardt
        rule every `damping_adaptation_interval` steps; else pass it to
        `step` or give a schedule.
      damping_schedule: the damping as a function of the step.
      initial_damping: the starting damping; needed for adaptive damping.
      min_damping: the adapted damping's lower bound.
      max_damping: the adapted damping's upper bound.
      include_damping_in_quad_change: whether the predicted loss change in
        the reduction ratio includes the damping term (the L2 term always
        counts).
      damping_adaptation_interval: steps between damping adaptations.
      damping_adaptation_decay: the damping is multiplied or divided by this
        to the power `damping_adaptation_interval`.
      damping_lower_threshold: below this reduction ratio the damping grows.
      damping_upper_threshold: above this reduction ratio it shrinks.
      always_use_exact_qmodel_for_damping_adjustment: whether the reduction
        ratio always uses the exact curvature (as adaptive learning rate or
        momentum do anyway), not the estimate.
      norm_constraint: if given, the update is scaled down so that
        `lr² · gᵀ precon`, its squared norm under the estimate, is at most
        this; not with an adaptive learning rate.
      num_burnin_steps: curvature updates, without parameter updates, run by
        the first `step`.
      estimation_mode: one of `estimators.ESTIMATION_MODES`.
      curvature_ema: the factor on the old estimate in its moving average.
      inverse_update_period: steps between refreshes of the cached
        inverses.
      use_exact_inverses: cache exact inverses (eigendecompositions) rather
        than the factored-damping approximation.
      batch_process_func: applied to every batch before use.
      register_only_generic: tag every parameter with a generic tag instead
        of matching layers.
      patterns_to_skip: graph-matcher patterns not to use.
      auto_register_kwargs: further options for the graph matcher.
      layer_tag_to_block_ctor: block constructors by tag name.
      multi_device: run the step under `jax.pmap` over the local devices;
        inputs then carry a leading device axis.
      debug: run without `jit`/`pmap` (and on one device).
      batch_size_extractor: maps a batch to its per-device size.
      pmap_axis_name: the axis name used with `multi_device`.
      forbid_setting_attributes_after_finalize: whether setting attributes
        after `init` raises.
      modifiable_attribute_exceptions: attributes that may still be set.
      include_norms_in_stats: add the norms of the gradient, preconditioned
        gradient and update to the stats.
      include_per_param_norms_in_stats: the same per parameter array.
      distributed_precon_apply: with `multi_device`, each device applies
        the cached inverses of its share of the blocks (balanced by
        estimated cost) and the results are summed across devices; False:
        every device applies every block.
      distributed_inverses: the same for the inverse refreshes.
      estimator_ctor: the curvature estimator's class, called with the
        arguments of `BlockDiagonalCurvature`;
        `estimators.BlockTridiagonalCurvature` couples consecutive dense
        layers (it needs `use_exact_inverses=False`).

    Raises:
      ValueError: for conflicting or invalid settings (e.g. both an
        adaptive rule and a schedule for one hyperparameter).
    """
    if use_adaptive_learning_rate and learning_rate_schedule is not None:
      raise ValueError(
        "Pass either use_adaptive_learning_rate=True or a "
        "learning_rate_schedule, not both."
      )
    if use_adaptive_momentum and momentum_schedule is not None:
      raise ValueError(
        "Pass either use_adaptive_momentum=True or a "
        "momentum_schedule, not both."
      )
    if use_adaptive_damping and damping_schedule is not None:
      raise ValueError(
        "Pass either use_adaptive_damping=True or a damping_schedule, not both."
      )
    if use_adaptive_damping and initial_damping is None:
      raise ValueError("use_adaptive_damping=True needs initial_damping.")
    if norm_constraint is not None and use_adaptive_learning_rate:
      raise ValueError(
        "norm_constraint cannot be combined with "
        "use_adaptive_learning_rate=True: the adaptive rule "
        "already sets the step length."
      )
    if not 0 < damping_lower_threshold < damping_upper_threshold:
      raise ValueError(
        "Need 0 < damping_lower_threshold < damping_upper_threshold."
      )
    estimation_modes.check_estimation_mode(estimation_mode)
    self._value_and_grad_func = value_and_grad_func
    self._l2_reg = l2_reg
    self._has_aux, self._has_state = value_func_has_aux, value_func_has_state
    self._has_rng = value_func_has_rng
    self._adaptive_lr = use_adaptive_learning_rate
    self._lr_schedule = learning_rate_schedule
    self._adaptive_momentum = use_adaptive_momentum
    self._momentum_schedule = momentum_schedule
    self._adaptive_damping = use_adaptive_damping
    self._damping_schedule = damping_schedule
    self._initial_damping = initial_damping
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
    self._norm_constraint = norm_constraint
    self._num_burnin_steps = num_burnin_steps
    self._estimation_mode = estimation_mode
    self._curvature_ema = curvature_ema
    self._inverse_update_period = inverse_update_period
    self._use_exact_inverses = use_exact_inverses
    self._batch_process_func = batch_process_func or (lambda b: b)
    self._multi_device = multi_device and not debug
    self._debug = debug
    self._batch_size_extractor = batch_size_extractor
    self._pmap_axis_name = pmap_axis_name if self._multi_device else None
    self._include_norms = include_norms_in_stats
    self._include_per_param_norms = include_per_param_norms_in_stats
    self.distributed_precon_apply = distributed_precon_apply
    self.distributed_inverses = distributed_inverses

    auto_kwargs = graph_matcher.matcher_options(
      auto_register_kwargs, register_only_generic, patterns_to_skip
    )
    self._value_func = self._make_value_func()
    self._estimator = estimator_ctor(
      self._value_func,
      params_index=0,
      default_estimation_mode=estimation_mode,
      layer_tag_to_block_ctor=layer_tag_to_block_ctor,
      distributed_multiplies=distributed_precon_apply,
      distributed_cache_updates=distributed_inverses,
      **auto_kwargs,
    )
    self._linearized = tracer.loss_tags_linearize(self._value_func)
    # Whether a step refreshes the inverses or adapts the damping is known on
    # the host, so each combination is its own program: a `lax.cond` would
    # copy the whole estimator state through its untaken branch.
    self._compiled_step = self._stage(self._step, static_argnums=(8, 9))
    self._compiled_refresh_step = self._stage(
      self._step, static_argnums=(8, 9), cpu_options=_REFRESH_CPU_OPTIONS
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
    if not (self._has_aux or self._has_state):
      return out, None, None
    loss, rest = out
    if self._has_aux and self._has_state:
      func_state, aux = rest
      return loss, func_state, aux
    return (loss, rest, None) if self._has_state else (loss, None, rest)

  def _make_value_func(self):
    def value_func(*args):
      out, _ = self._value_and_grad_func(*args)
      return self._split_outputs(out)[0]

    return value_func

  def _func_args(self, params, func_state, rng, batch):
    args = [params]
    if self._has_state:
      args.append(func_state)
    if self._has_rng:
      args.append(rng)
    args.append(batch)
    return tuple(args)

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
    for name, adaptive, schedule, value in (
      ("learning_rate", self._adaptive_lr, self._lr_schedule, learning_rate),
      ("momentum", self._adaptive_momentum, self._momentum_schedule, momentum),
      ("damping", self._adaptive_damping, self._damping_schedule, damping),
    ):
      if adaptive and value is not None:
        raise ValueError(
          f"{name} was passed to step() but the optimizer "
          f"adapts it (use_adaptive_{name}=True); drop it."
        )
      if schedule is not None and value is not None:
        raise ValueError(
          f"{name} was passed to step() but a {name}_schedule "
          "was given to the constructor; use one of them."
        )
      if not adaptive and schedule is None and value is None:
        raise ValueError(
          f"step() needs {name}=...: the optimizer was built "
          f"without use_adaptive_{name} or a {name}_schedule."
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
    """Works on the host's step number and on the state's counter alike."""
    return self._adaptive_damping & (step % self._damping_interval == 0)

  def _is_refresh_step(self, step: int) -> bool:
    return step % self._inverse_update_period == 0

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
    """The L2 term of the quadratic model.

    Args:
      vectors: `n` params-shaped pytrees `v_i`.

    Returns:
      The `(n, n)` matrix `l2_reg * v_iᵀ v_j`.
    """
    return self.l2_reg * utils.gram_matrix(vectors)

  @staticmethod
  def _gram_and_linear(vectors, grads):
    """(vᵢᵀ vⱼ, gᵀ vᵢ) from one Gram matrix of the vectors and the gradient."""
    n = len(vectors)
    gram = utils.gram_matrix([*vectors, grads])
    return gram[:n, :n], gram[:n, n]

  def compute_exact_quad_model(
    self,
    vectors: Sequence[Params],
    grads: Params,
    func_args: Sequence[Any] | None = None,
  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The terms of the quadratic model with the exact curvature `C`.

    `C` is the GGN for the ggn modes and the Fisher otherwise (equal for the
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
    kind = estimation_modes.matrix_type(self._estimation_mode)
    losses, jvp = self._linearized(func_args)
    # Pushing the vectors one at a time keeps them apart: stacking them for a
    # vmap would copy every parameter twice.
    tangents = [jvp(v) for v in vectors]
    multiplies = [
      loss.multiply_ggn if kind == "ggn" else loss.multiply_fisher
      for loss in losses
    ]
    products = [
      [multiply(tuple(t)) for multiply, t in zip(multiplies, ts)]
      for ts in tangents
    ]
    matrix = utils.gram_matrix(tangents, products)
    batch_size = self._batch_size(func_args[-1])
    matrix = self._mean(matrix.astype(state_dtype(vectors)) / batch_size)
    return (matrix, *self._gram_and_linear(vectors, grads))

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
      *self._gram_and_linear(vectors, grads),
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
    state = self._compiled_init(params, rng, batch, func_state)
    if not self._finalized:  # a second init is allowed; the flag is set once
      self._finalized = True
    return state

  def _init(self, params, rng, batch, func_state):
    func_args = self._func_args(params, func_state, rng, batch)
    exact = -1 if self._use_exact_inverses else None
    approx = None if self._use_exact_inverses else -1
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
      state.estimator_state,
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
    hyper = [
      self._hyper(value, schedule, step, dtype, num_devices)
      for value, schedule in (
        (learning_rate, self._lr_schedule),
        (momentum, self._momentum_schedule),
        (damping, self._damping_schedule),
      )
    ]
    refresh = self._is_refresh_step(step)
    compiled = self._compiled_refresh_step if refresh else self._compiled_step
    # The two flags are positional: they are the static arguments 8 and 9.
    params, state, func_state, stats = compiled(
      params,
      state,
      rng,
      batch,
      func_state,
      *hyper,
      refresh,
      self._is_damping_step(step),
    )
    self._last_counter[:] = [state.step_counter, step + 1 if verified else None]
    if self._has_state:
      return params, state, func_state, stats
    return params, state, stats

  def _hyper(self, value, schedule, step, dtype, num_devices):
    if schedule is not None:
      value = schedule(step)
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
    *,
    refresh_cache: bool,
    update_damping: bool,
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
      refresh_cache: whether to refresh the cached inverses first (as on
        steps divisible by `inverse_update_period`).
      update_damping: whether to adapt the damping afterwards (as on
        adaptation steps with adaptive damping).

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
      refresh=refresh_cache,
      update_damping=update_damping,
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
    refresh,
    update_damping,
  ):
    func_args = self._func_args(params, func_state, rng, batch)
    batch_size = self._batch_size(batch)
    estimator_state = self._estimator.update_curvature_matrix_estimate(
      state.estimator_state,
      self._curvature_ema,
      1.0,
      batch_size,
      rng,
      func_args,
      self._pmap_axis_name,
    )
    damping = state.damping if self._adaptive_damping else damping
    identity_weight = damping + self._l2_reg
    exact = self._use_exact_inverses
    if refresh:
      estimator_state = self._estimator.update_cache(
        estimator_state,
        identity_weight,
        exact_powers=-1 if exact else None,
        approx_powers=None if exact else -1,
        eigenvalues=False,
        pmap_axis_name=self._pmap_axis_name,
      )

    out, grads = self._value_and_grad_func(*func_args)
    loss, new_func_state, aux = self._split_outputs(out)
    loss, grads = self._mean((loss, grads))
    precon = self._estimator.multiply_inverse_of_gradient(
      estimator_state,
      grads,
      func_args,
      identity_weight,
      exact_power=exact,
      use_cached=True,
      pmap_axis_name=self._pmap_axis_name,
    )
    if self._norm_constraint is not None:
      sq_norm = utils.inner_product(precon, grads) * learning_rate**2
      precon = utils.scalar_mul(
        precon, jnp.minimum(1.0, jnp.sqrt(self._norm_constraint / sq_norm))
      )

    vectors = (precon, state.velocities)
    adaptive = self._adaptive_lr or self._adaptive_momentum
    use_exact_q = adaptive or self._exact_qmodel_for_damping
    if use_exact_q:
      curv, gram, linear = self.compute_exact_quad_model(
        vectors, grads, func_args
      )
    else:
      curv, gram, linear = self.compute_approx_quad_model(
        dataclasses.replace(state, estimator_state=estimator_state),
        vectors,
        grads,
      )
    quad = curv + self._l2_reg * gram
    coefficients = self._coefficients(
      quad + damping * gram,
      linear,
      learning_rate,
      momentum,
      first_step=state.step_counter == 0,
    )
    delta = utils.weighted_sum_of_objects(vectors, coefficients)
    new_params = _add(params, delta)

    quad_for_change = quad + (
      damping * gram if self._include_damping_in_quad_change else 0
    )
    q_change = 0.5 * coefficients @ quad_for_change @ coefficients + (
      coefficients @ linear
    )
    if update_damping:
      new_damping, rho = self._adapt_damping(
        damping, loss, q_change, new_params, func_state, rng, batch
      )
    else:
      new_damping, rho = damping, jnp.asarray(jnp.nan, loss.dtype)
    new_state = OptimizerState(
      velocities=delta,
      estimator_state=estimator_state,
      damping=new_damping if self._adaptive_damping else state.damping,
      data_seen=state.data_seen
      + batch_size
      * (jax.lax.psum(1, self._pmap_axis_name) if self._pmap_axis_name else 1),
      step_counter=state.step_counter + 1,
    )
    stats = dict(
      loss=loss,
      learning_rate=-coefficients[0],
      momentum=coefficients[1],
      damping=damping,
      rho=rho,
      quad_model_change=q_change,
      data_seen=new_state.data_seen,
      step=new_state.step_counter,
    )
    if aux is not None:
      stats["aux"] = self._mean(aux)
    if self._include_norms or self._include_per_param_norms:
      stats.update(self._norms(grads, precon, delta))
    return new_params, new_state, new_func_state, stats

  def _coefficients(self, quad, linear, learning_rate, momentum, first_step):
    """(α, μ) of the update α·precon + μ·velocity.

    Adaptive entries minimise ½ cᵀ Q c + bᵀ c with the others held fixed; the
    velocity is zero on the first step, so μ is then 0.
    """
    dtype = quad.dtype
    if self._adaptive_lr and self._adaptive_momentum:
      solved = _solve_2x2(quad, -linear)
      only_lr = -linear[0] / quad[0, 0]
      return jnp.where(first_step, jnp.array([only_lr, 0.0], dtype), solved)
    alpha = None if self._adaptive_lr else -learning_rate
    mu = None if self._adaptive_momentum else momentum
    mu = jnp.where(first_step, 0.0, mu) if mu is not None else None
    if alpha is None:  # momentum fixed, learning rate adaptive
      alpha = -(linear[0] + quad[0, 1] * mu) / quad[0, 0]
    if mu is None:  # learning rate fixed, momentum adaptive
      mu = jnp.where(
        first_step, 0.0, -(linear[1] + quad[1, 0] * alpha) / quad[1, 1]
      )
    return jnp.stack([jnp.asarray(alpha, dtype), jnp.asarray(mu, dtype)])

  def _adapt_damping(
    self, damping, loss, q_change, new_params, func_state, rng, batch
  ):
    """Levenberg–Marquardt: rho = actual / predicted loss change."""
    new_loss = self._mean(
      self.compute_loss_value(
        self._func_args(new_params, func_state, rng, batch)
      )
    )
    rho = ((new_loss - loss) / q_change).astype(loss.dtype)
    factor = self.damping_decay_factor
    new = jnp.where(
      rho < self._damping_lower,
      damping / factor,
      jnp.where(rho > self._damping_upper, damping * factor, damping),
    )
    new = jnp.clip(new, self._min_damping, self._max_damping)
    return new.astype(damping.dtype), rho

  def _norms(self, grads, precon, delta):
    stats = {}
    named = dict(grad=grads, precon_grad=precon, update=delta)
    if self._include_norms:
      for name, tree in named.items():
        stats[f"{name}_norm"] = jnp.sqrt(utils.inner_product(tree, tree))
    if self._include_per_param_norms:
      for name, tree in named.items():
        stats[f"per_param_{name}_norm"] = jax.tree.map(jnp.linalg.norm, tree)
    return stats
