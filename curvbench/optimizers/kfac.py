"""K-FAC (Martens & Grosse, ICML 2015): `estimators.Optimizer` on the run's
block-diagonal curvature, the full algorithm (adaptive learning rate,
momentum and damping, periodic inverse refreshes). Its settings are the
optimizer's constructor arguments that a config can give, and `step` the
values `Optimizer.step` takes where a rule is not adaptive.

The damping's defaults come from a sweep (issue 61) in
ggn_curvature_prop, 5 seeds each: 300 steps on mlp, autoencoder, convnet,
convnet_norm and the examples' haiku, nnx and equinox MLPs, 100 on resnet,
resnet_small_groupnorm, transformer, transformer_small and gpt.
Diverged runs, of 60, and the median final training loss on resnet (100
steps) and mlp (300), for each (start, floor, ceiling, decay):

- (0.1, 1e-8, inf, 0.9), the former defaults: 1 (convnet); 0.023, 0.043.
- (150, 1e-5, 1000, 0.95), KFAC-JAX's MNIST examples': none, but the
  damping is still near 1 after 100 steps and short runs stall: 0.35, 0.020
  (resnet_small_groupnorm 1.16 against 0.13, transformer 1.54 against 0.73).
- (0.1, 1e-5, 1000, 0.95), the examples' bounds: 1 (convnet_norm, its
  damping at the floor).
- (1, 1e-4, 1000, 0.95), KFAC-JAX's README start and a user's floor from
  its issues: none; 0.032, 0.028.
- (0.1, 1e-3, 1000, 0.95), these defaults: none; 0.022, 0.0049; the
  lowest final loss of the five on 6 of the 12 problems, within 30 % of
  the lowest on the others.

Longer runs still diverge at these defaults: in 2000 steps, with the
training loss near 1e-6, convnet and convnet_norm each diverged on 1 of 5
seeds (the adaptive momentum ran from about 0.5 to -3.6e7 within three
steps, the damping at its floor; mlp and autoencoder on none). A fixed
momentum of 0.9 diverged on all 10 of those runs.

(The examples' bounds ran 3 seeds on the five larger problems. gpt's loss
stays at log 256 for 100 steps under every candidate.)

The floor is the one a diverged run's own advice named (100x the lowest
damping it reached); the sweep's folders are reproducible with
`curvbench -m problem=... optimizer=kfac measure=training seed=0,1,2,3,4
measure.training.num_steps=300 optimizer.min_damping=...`."""

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import estimators as kfac
from curvbench.components import (
  Flag,
  ListOf,
  Number,
  OneOf,
  Settings,
  Text,
  Whole,
  setting,
)
from curvbench.core import costs, devices
from curvbench.core.curvatures import BlockDiagonal, Curvature
from curvbench.optimizers import OPTIMIZERS, OptimizerSettings
from estimators import graph_matcher
from estimators.utils import staging

POSITIVE = Number(0, low_in=False)
FRACTION = Number(0, 1)
# The `kfac` options of KFAC-JAX 0.0.8's MNIST examples
# (examples/{classifier,autoencoder}_mnist/pipeline.py), with their l2_reg:
# what the side-by-side benchmark and the example-code test run.
MNIST_EXAMPLES = dict(
  l2_reg=1e-5,
  inverse_update_period=5,
  damping_adaptation_interval=5,
  num_burnin_steps=5,
  curvature_ema=0.95,
  use_adaptive_damping=True,
  use_adaptive_learning_rate=True,
  use_adaptive_momentum=True,
  damping_adaptation_decay=0.95,
  initial_damping=150.0,
  min_damping=1e-5,
  max_damping=1000.0,
)
# Keys of estimators.Optimizer that the run decides, and what decides them.
_SET_BY_THE_RUN = {
  "value_and_grad_func": "the problem's loss gives it",
  "value_func_has_aux": "the problem's loss gives it",
  "value_func_has_state": "the problem's loss gives it",
  "value_func_has_rng": "the problem's loss gives it",
  "estimation_mode": "curvature.mode sets the estimation mode",
  "layer_tag_to_block_ctor": "the curvature group (e.g. curvature=ekfac) "
  "sets the blocks",
  "estimator_ctor": "the curvature group (e.g. curvature=kfac_tridiagonal) "
  "sets the estimator",
  "multi_device": "devices=N sets it",
  "pmap_axis_name": "devices=N sets it",
  "batch_size_extractor": "the harness's batches set it",
  "batch_process_func": "a function: the problem's batches are used as "
  "they come",
  "auto_register_kwargs": "register_only_generic and patterns_to_skip are "
  "the graph matcher's options a config can set",
  "value_func_for_estimator": "a function: the estimator traces the "
  "problem's loss",
  "custom_estimator_ctor": "the curvature group (e.g. "
  "curvature=kfac_tridiagonal) sets the estimator",
  "precon_damping_schedule": "schedules are functions a config cannot "
  "give; use precon_damping_mult",
  "invalid_metric_value": "a metric a step does not compute stays NaN, "
  "which the records read as missing",
  "curvature_update_period": "the trainer pairs each step with its "
  "compiled program assuming an estimate every step: not a setting yet",
  "use_initial_damping_calibration": "the trainer times the first step as "
  "it comes; calibrating repeats it: not a setting yet",
  "forbid_setting_attributes_after_finalize": "it guards the Python "
  "object, not the algorithm",
  "modifiable_attribute_exceptions": "it guards the Python object, not "
  "the algorithm",
  "learning_rate_schedule": "schedules are functions a config cannot "
  "give; use use_adaptive_learning_rate or "
  "step.learning_rate",
  "momentum_schedule": "schedules are functions a config cannot give; "
  "use use_adaptive_momentum or step.momentum",
  "damping_schedule": "schedules are functions a config cannot give; use "
  "use_adaptive_damping or step.damping",
  "learning_rate": "K-FAC takes it as step.learning_rate, where "
  "use_adaptive_learning_rate=false",
  "momentum": "K-FAC takes it as step.momentum, where "
  "use_adaptive_momentum=false",
  "damping": "K-FAC takes it as step.damping, where "
  "use_adaptive_damping=false (initial_damping starts the "
  "adaptive rule)",
}


@dataclasses.dataclass
class KFACStep(Settings):
  """Values `Optimizer.step` takes for the rules that are not adaptive."""

  learning_rate: float = setting(
    0.05, POSITIVE, "with use_adaptive_learning_rate=false"
  )
  momentum: float = setting(0.9, FRACTION, "with use_adaptive_momentum=false")
  damping: float = setting(0.1, POSITIVE, "with use_adaptive_damping=false")

  @classmethod
  def what(cls) -> str:
    return "K-FAC's step"


def _pattern_names() -> tuple[str, ...]:
  return tuple(sorted({p.name for p in graph_matcher.DEFAULT_GRAPH_PATTERNS}))


@OPTIMIZERS.register
@dataclasses.dataclass
class KFAC(OptimizerSettings):
  """`estimators.Optimizer`; defaults as in the paper's experiments
  (adaptive learning rate, momentum and damping), not the constructor's;
  the damping's ceiling and decay as KFAC-JAX's MNIST examples', its start
  and floor chosen by a sweep (the module docstring)."""

  name: str = "kfac"
  l2_reg: float = setting(
    0.0,
    Number(0),
    "coefficient of an L2 term the loss already holds (added to the damping)",
  )
  use_adaptive_learning_rate: bool = setting(
    True, Flag(), "choose the learning rate from the quadratic model"
  )
  use_adaptive_momentum: bool = setting(
    True, Flag(), "choose the momentum from the quadratic model"
  )
  use_adaptive_damping: bool = setting(
    True, Flag(), "adapt the damping by the Levenberg-Marquardt rule"
  )
  initial_damping: float = setting(
    0.1,
    POSITIVE,
    "the adaptive damping's start (KFAC-JAX's MNIST examples: 150, "
    "which stalls short runs; see the module docstring)",
  )
  min_damping: float = setting(
    1e-3,
    Number(0),
    "the adaptive damping's lower bound (KFAC-JAX's MNIST examples: 1e-5, "
    "which let a run diverge; see the module docstring)",
  )
  max_damping: float = setting(
    1000.0,
    Number(0, finite=False),
    "the adaptive damping's upper bound (as KFAC-JAX's MNIST examples)",
  )
  include_damping_in_quad_change: bool = setting(
    False,
    Flag(),
    "the reduction ratio's predicted change includes the damping term",
  )
  damping_adaptation_interval: int = setting(
    5, Whole(1), "steps between damping adaptations (KFAC-JAX's examples: 5)"
  )
  damping_adaptation_decay: float = setting(
    0.95,
    Number(0, 1, low_in=False),
    "the damping is multiplied or "
    "divided by this to the power damping_adaptation_interval "
    "(as KFAC-JAX's MNIST examples)",
  )
  damping_lower_threshold: float = setting(
    0.25, POSITIVE, "below this reduction ratio the damping grows"
  )
  damping_upper_threshold: float = setting(
    0.75, POSITIVE, "above this reduction ratio the damping shrinks"
  )
  always_use_exact_qmodel_for_damping_adjustment: bool = setting(
    False, Flag(), "the reduction ratio always uses the exact curvature"
  )
  norm_constraint: float | None = setting(
    None,
    Number(0, low_in=False, null=True),
    "bound on the update's squared norm under the estimate (null: none)",
  )
  num_burnin_steps: int = setting(
    5,
    Whole(0),
    "curvature updates without parameter updates at the first step "
    "(KFAC-JAX's examples: 5)",
  )
  curvature_ema: float = setting(
    0.95,
    FRACTION,
    "the old estimate's weight in the average (KFAC-JAX's MNIST "
    "examples: 0.95)",
  )
  inverse_update_period: int = setting(
    5,
    Whole(1),
    "steps between inverse refreshes (KFAC-JAX's MNIST examples: 5)",
  )
  use_exact_inverses: bool = setting(
    False,
    Flag(),
    "exact inverses (eigendecompositions) rather than the "
    "factored-damping approximation",
  )
  register_only_generic: bool = setting(
    False, Flag(), "tag every parameter generically instead of matching layers"
  )
  patterns_to_skip: list[str] = setting(
    [], ListOf(OneOf(_pattern_names)), "graph-matcher patterns not to use"
  )
  include_norms_in_stats: bool = setting(
    False,
    Flag(),
    "add gradient, preconditioned-gradient and update norms "
    "to the step's stats",
  )
  include_per_param_norms_in_stats: bool = setting(
    False, Flag(), "the same per parameter array"
  )
  distributed_precon_apply: bool = setting(
    True,
    Flag(),
    "with devices > 1, each device applies the inverses of "
    "its share of the blocks",
  )
  distributed_inverses: bool = setting(
    True,
    Flag(),
    "with devices > 1, each device refreshes its share of the inverses",
  )
  num_estimator_samples: int = setting(
    1, Whole(0), "sampled estimates averaged in each curvature update"
  )
  should_vmap_estimator_samples: bool = setting(
    False, Flag(), "draw those samples in one vectorised pass, not a loop"
  )
  precon_power: float = setting(
    -1.0, Number(), "the power of the damped curvature the update applies"
  )
  precon_damping_mult: float = setting(
    1.0, POSITIVE, "the preconditioner's damping over the damping"
  )
  use_step_rejection: bool = setting(
    False,
    Flag(),
    "a step that raises the loss is undone and the damping raised",
  )
  reject_damping_increase_factor: float = setting(
    1.0, Number(1), "what a rejected step multiplies the damping by"
  )
  regularized_parameters_path_exclusions: str | None = setting(
    None,
    Text(null=True),
    "comma-separated parameter names (e.g. b,bias) left out of l2_reg in "
    "the exact quadratic model (null: none)",
  )
  include_registered_loss_in_stats: bool = setting(
    False, Flag(), "add the registered losses' value to the step's stats"
  )
  norm_to_scale_identity_weight_per_block: str | None = setting(
    None,
    OneOf(kfac.blocks.NORM_TYPES, null=True),
    "scale each block's damping by this norm of the block (null: no)",
  )
  exact_quad_model_matrix_type: str | None = setting(
    None,
    OneOf(("fisher", "ggn"), null=True),
    "the exact quadratic model's curvature (null: the estimation mode's)",
  )
  use_automatic_registration: bool = setting(
    True, Flag(), "tag layers with the graph matcher (false: by hand only)"
  )
  debug: bool = setting(False, Flag(), "run the step without jit (slow)")
  step: KFACStep = dataclasses.field(default_factory=KFACStep)

  uses_curvature = True
  needs_block_diagonal = True
  set_elsewhere = _SET_BY_THE_RUN

  def ignored(self):
    out = {
      f"step.{rule}": f"use_adaptive_{rule}=true chooses the {what} "
      f"(use_adaptive_{rule}=false takes this value)"
      for rule, what in (
        ("learning_rate", "learning rate"),
        ("momentum", "momentum"),
        ("damping", "damping"),
      )
      if getattr(self, f"use_adaptive_{rule}")
    }
    if not self.use_adaptive_damping:
      out.update(
        {
          key: "use_adaptive_damping=false: the damping is step.damping"
          for key in (
            "initial_damping",
            "min_damping",
            "max_damping",
            "damping_adaptation_interval",
            "damping_adaptation_decay",
            "damping_lower_threshold",
            "damping_upper_threshold",
          )
        }
      )
    return out

  def disagreements(self, prefix):
    yield from super().disagreements(prefix)
    key = f"{prefix}." if prefix else ""
    if self.norm_constraint is not None and self.use_adaptive_learning_rate:
      yield (
        f"{key}norm_constraint={self.norm_constraint} cannot be used "
        f"with {key}use_adaptive_learning_rate=true: the adaptive rule "
        "sets the step length itself."
      )
    if not self.damping_lower_threshold < self.damping_upper_threshold:
      yield (
        f"{key}damping_lower_threshold={self.damping_lower_threshold} "
        f"must be below {key}damping_upper_threshold="
        f"{self.damping_upper_threshold}."
      )

  def divergence_knobs(self) -> dict:
    """The settings a diverged run's reason may name, by role: each a
    (name, value), or None where this configuration does not use it."""
    adaptive_damping = self.use_adaptive_damping
    fixed_rate = not self.use_adaptive_learning_rate
    return dict(
      damping_floor=("optimizer.min_damping", self.min_damping)
      if adaptive_damping
      else None,
      damping=("optimizer.initial_damping", self.initial_damping)
      if adaptive_damping
      else ("optimizer.step.damping", self.step.damping),
      learning_rate=("optimizer.step.learning_rate", self.step.learning_rate)
      if fixed_rate
      else None,
      # The adaptive learning rate refuses a norm constraint.
      norm_constraint="optimizer.norm_constraint" if fixed_rate else None,
    )

  def optimizer_kwargs(self) -> dict:
    """The keyword arguments of `estimators.Optimizer` these settings give."""
    return {
      f.name: getattr(self, f.name)
      for f in dataclasses.fields(self)
      if f.name not in ("name", "step")
    }

  def step_kwargs(self) -> dict:
    """The values `Optimizer.step` takes: one per rule that is not
    adaptive."""
    return {
      rule: getattr(self.step, rule)
      for rule in ("learning_rate", "momentum", "damping")
      if not getattr(self, f"use_adaptive_{rule}")
    }

  def make(self, loss_fn, curvature=None, mesh=None):
    return KFACTrainer(loss_fn, curvature, self, mesh)


# The step's stats each update keeps for its run's records (`trace`);
# the update's norm where include_norms_in_stats has the step compute it.
TRACED = ("damping", "learning_rate", "momentum", "rho", "update_norm")

QUICK_CPU_COMPILE = {
  "xla_backend_optimization_level": 1,
  "xla_cpu_use_fusion_emitters": False,
}


class KFACTrainer:
  """Trains with `estimators.Optimizer` (adaptive settings from the config).

  Its step compiles one program per kind of step (refresh, damping
  adaptation, burn-in); they recur every `cycle` steps.

  Given a `mesh` of several devices, the optimizer runs its multi-device
  step (`jax.pmap` over `devices.AXIS`) on batches split over the mesh
  (`devices.split`): each device gets its part of the batch, a copy of the
  parameters and state and its own key. Parameters and loss come back as
  ordinary arrays (replicated over the mesh); the state stays in the
  optimizer's layout, a leading device axis.
  """

  def __init__(
    self,
    loss_fn: Callable,
    curvature: Curvature,
    settings: "KFAC",
    mesh: Mesh | None = None,
  ):
    if not curvature.is_block_diagonal:
      raise ValueError(
        f"optimizer=kfac runs estimators.Optimizer, which needs a "
        f"block-diagonal curvature, not {curvature.name!r}; use "
        "optimizer=preconditioned_sgd to train with that curvature."
      )
    # (The curvatures that are block-diagonal are `BlockDiagonal`s.)
    curvature = cast(BlockDiagonal, curvature)
    kwargs = settings.optimizer_kwargs()
    refresh = settings.inverse_update_period
    adapt = (
      settings.damping_adaptation_interval
      if settings.use_adaptive_damping
      else None
    )
    self.cycle = math.lcm(refresh, adapt or 1)
    # (refreshes the inverses, adapts the damping) of each kind of step: the
    # damping adapts on the last step of each interval, as in the optimizer.
    self._kind = lambda s: (
      s % refresh == 0,
      adapt is not None and (s + 1) % adapt == 0,
    )
    self.kinds = sorted({self._kind(s) for s in range(self.cycle)})
    self.curvature = curvature
    self.step_kwargs = settings.step_kwargs()
    self.mesh = mesh if mesh is not None and mesh.size > 1 else None
    if self.mesh is not None:
      kwargs.update(multi_device=True, pmap_axis_name=devices.AXIS)
    # Per input, the last (value given, its per-device layout): a step's own
    # parameters, or timing's fixed batch, are not converted again.
    self._last: dict[str, Any] = {}
    self._trace: dict[int, Any] | None = None  # until `start_trace`
    self.opt = kfac.Optimizer(
      jax.value_and_grad(loss_fn),
      estimation_mode=curvature.mode,
      layer_tag_to_block_ctor=curvature.block_ctors or None,
      estimator_ctor=functools.partial(
        type(curvature.estimator), **curvature.estimator_options
      ),
      **kwargs,
    )

  def _per_device(self, name, tree, convert):
    last = self._last.get(name)
    if last is not None and last[0] is tree:
      return last[1]
    self._last[name] = (tree, convert(tree, self.mesh))
    return self._last[name][1]

  def _inputs(self, params, batch, rng):
    """The optimizer's inputs: with a mesh, with a leading device axis."""
    if self.mesh is None:
      return params, batch, rng
    return (
      self._per_device("params", params, devices.stack),
      self._per_device("batch", batch, devices.stack_split),
      devices.device_keys(rng, self.mesh),
    )

  def init(self, params, batch, rng):
    """The optimizer's initial state and a step count of 0, after
    refusing a curvature whose state would not fit."""
    # The curvature's state is the bulk of the optimizer's: refuse one that
    # would not fit before the optimizer allocates it.
    self.curvature.check_state_fits(rng, params, batch)
    params, batch, rng = self._inputs(params, batch, rng)
    return self.opt.init(params, rng, batch), 0

  def compiled_programs(self, params, opt_state, batch, rng) -> list:
    """The program of each step of a cycle, in order (each kind of step,
    `kinds`, compiled once), for their memory and flop figures.

    The step's own programs are internal to `estimators.Optimizer`, so these
    are compiled again from `Optimizer.uncompiled_step` (under `jax.pmap`
    on a mesh, as the step runs: the figures are per device), with its
    inputs returned unchanged left out of the outputs as the step does.
    """
    state, _ = opt_state
    params, batch, rng = self._inputs(params, batch, rng)
    shape = () if self.mesh is None else (self.mesh.size,)
    hyper = {
      k: jnp.full(shape, v, state.damping.dtype)
      for k, v in self.step_kwargs.items()
    }
    # Only the memory figure is wanted: the CPU's quicker code generation
    # halves the compile time and leaves the buffers as they are.
    options = (
      staging.supported_cpu_options(QUICK_CPU_COMPILE)
      if staging.target_platform() == "cpu"
      else None
    )

    def compiled(refresh, adapt):
      step = costs.without_passthrough(
        functools.partial(
          self.opt.uncompiled_step, refresh_cache=refresh, update_damping=adapt
        )
      )
      program = lambda p, s, r, b, h: step(p, s, r, b, **h)
      if self.mesh is None:
        program = jax.jit(program)
      else:
        program = jax.pmap(
          program, axis_name=devices.AXIS, devices=list(self.mesh.devices.flat)
        )
      return program.lower(params, state, rng, batch, hyper).compile(options)

    programs = {kind: compiled(*kind) for kind in self.kinds}
    return [programs[self._kind(s)] for s in range(self.cycle)]

  def step(self, params, opt_state, batch, rng):
    """One optimizer step on `batch`: the new parameters, the state with
    its count advanced, and the loss; the step's statistics are kept
    where `start_trace` asked for them."""
    state, count = opt_state
    params, batch, rng = self._inputs(params, batch, rng)
    params, state, stats = self.opt.step(
      params, state, rng, batch=batch, global_step_int=count, **self.step_kwargs
    )
    loss = stats["loss"]
    if self.mesh is not None:
      # Every device holds the same parameters and (averaged) loss.
      stacked = params
      params, loss = devices.unstack((stacked, loss), self.mesh)
      self._last["params"] = (params, stacked)
    if self._trace is not None:
      if count == 0:  # a run starts (compile_steps' throwaway ones too)
        self._trace.clear()
      # Device values the step returns anyway, read once the run is over
      # (`trace`): no host sync and no extra work here.
      self._trace[count + 1] = {k: stats[k] for k in TRACED if k in stats}
    return params, (state, count + 1), loss

  def start_trace(self) -> None:
    """Keeps each step's statistics from now on, for `trace` (training
    asks for them; timing leaves its steps without)."""
    self._trace = {}

  def trace(self) -> dict[int, dict[str, float]]:
    """Per update s (from 1) of the last run: the damping, learning rate,
    momentum and reduction ratio it used, and its update's norm where the
    step computed it (include_norms_in_stats)."""
    host = jax.device_get(self._trace or {})
    first = lambda v: float(np.asarray(v, np.float64).reshape(-1)[0])
    return {
      s: {k: first(v) for k, v in stats.items()} for s, stats in host.items()
    }

  def failure(self, opt_state) -> str | None:
    """Why the loss stopped being finite, where the state tells: blocks
    whose Newton iteration could not invert their damped factors."""
    estimator = self.opt.estimator
    bad = estimator.newton_failures(opt_state[0].estimator_state)
    if not bad:
      return None
    return (
      f"The Newton iteration (curvature.matrix_power_method=newton) did "
      f"not converge in {estimator.newton_max_iterations} steps for "
      f"the damped factors of {', '.join(bad)}: they are too badly "
      "conditioned for it. Raise the damping (optimizer.min_damping, "
      "optimizer.initial_damping), raise "
      "curvature.newton_max_iterations, or use "
      "curvature.matrix_power_method=decomposition."
    )
