"""Loss curves against steps and wall time, for K-FAC and first-order baselines.

The optimizers, by their config name (`OPTIMIZERS`):

- `kfac`: `estimators.Optimizer`, the full K-FAC algorithm, on a
  block-diagonal curvature (the curvature group picks block type and mode).
- `preconditioned_sgd`: SGD with heavy-ball momentum on `(C + damping I)^-1 g`
  for any configured curvature C (the exact matrix with
  `curvature=explicit_exact` or `implicit_exact`): the optax transformation
  `precondition_by_curvature` chained with `optax.sgd`.
- `sgd`, `adam`: optax's.

Every config key but `name` is an argument of the optimizer's constructor
(`step` of kfac: of `Optimizer.step`). All optimizers see the same initial
parameters and the same batches in the same order.

With a mesh of several devices (`devices=N`), every batch is split across
them: the optax steps run SPMD on the split batch, and K-FAC runs
`estimators.Optimizer`'s multi-device step (`jax.pmap`), converting at the
trainer's edges so that callers still see ordinary parameters.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from tqdm.auto import tqdm

import estimators as kfac
from estimators.utils import staging
from curvbench import costs, devices
from curvbench.curvatures import Curvature


class PreconditionState(NamedTuple):
  count: jax.Array  # steps taken
  curvature: Any  # the curvature's state


def precondition_by_curvature(
    curvature: Curvature, batch, rng, *, damping: float, curvature_ema: float,
    curvature_update_period: int, inverse_update_period: int,
) -> optax.GradientTransformationExtraArgs:
  """Maps a gradient g to `(C + damping I)^-1 g`, C an EMA of `curvature`.

  Every `curvature_update_period` steps C is re-estimated on the step's batch
  (`update(..., batch=, rng=)`) and averaged in with weight
  `1 - curvature_ema` (the first estimate replaces the empty one); every
  `inverse_update_period` steps its damped inverse is recomputed.

  Args:
    curvature: the curvature to precondition with.
    batch: an example batch: the estimator is traced on it by `init`.
    rng: the key of the initial (empty) estimate.
    damping: added to the curvature before inverting.
    curvature_ema: the weight of the old estimate in the average.
    curvature_update_period: steps between curvature estimates.
    inverse_update_period: steps between inverse refreshes.

  Returns:
    An optax transformation whose `update` needs `batch=` and `rng=`.
  """

  def init(params):
    return PreconditionState(jnp.zeros([], jnp.int32),
                             curvature.init(rng, params, batch))

  def update(grads, state, params=None, *, batch, rng, **extra):
    del extra
    ema_old = jnp.where(state.count == 0, 0.0, curvature_ema)

    def estimate(curv):
      return curvature.update(curv, params, batch, rng, ema_old, 1 - ema_old)

    curv = jax.lax.cond(state.count % curvature_update_period == 0, estimate,
                        lambda c: c, state.curvature)
    curv = jax.lax.cond(state.count % inverse_update_period == 0,
                        lambda c: curvature.refresh(c, damping), lambda c: c,
                        curv)
    direction = curvature.precondition(curv, grads, damping)
    return direction, PreconditionState(state.count + 1, curv)

  return optax.GradientTransformationExtraArgs(init, update)


class OptaxTrainer:
  """Trains with an optax transformation built on the first batch.

  Its step is one jitted program; `cycle` is 1 (the conditional curvature
  work of `precondition_by_curvature` is inside that program). Given a
  batch split over devices (`devices.split`), the program runs on all of
  them, XLA summing their parts of the gradient and curvature.
  """

  cycle = 1

  def __init__(self, loss_fn: Callable, make_transformation: Callable):
    self.loss_fn = loss_fn
    self.make_transformation = make_transformation

  def init(self, params, batch, rng):
    tx = optax.with_extra_args_support(self.make_transformation(batch, rng))

    def step(params, opt_state, batch, rng):
      loss, grads = jax.value_and_grad(self.loss_fn)(params, batch)
      updates, opt_state = tx.update(grads, opt_state, params, batch=batch,
                                     rng=rng)
      return optax.apply_updates(params, updates), opt_state, loss

    self.step = jax.jit(step)
    return tx.init(params)

  def compiled_programs(self, params, opt_state, batch, rng) -> list:
    """The step's program, compiled (after a step: the one it ran)."""
    return [self.step.lower(params, opt_state, batch, rng).compile()]


_QUICK_CPU_COMPILE = {"xla_backend_optimization_level": 1,
                      "xla_cpu_use_fusion_emitters": False}


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

  def __init__(self, loss_fn: Callable, curvature: Curvature, cfg: Mapping,
               mesh: Mesh | None = None):
    if not curvature.is_block_diagonal:
      raise ValueError(
          f"optimizer=kfac runs estimators.Optimizer, which needs a "
          f"block-diagonal curvature, not {curvature.name!r}; use "
          "optimizer=preconditioned_sgd to train with that curvature.")
    kwargs = {k: v for k, v in cfg.items() if k not in ("name", "step")}
    refresh = cfg["inverse_update_period"]
    adapt = (cfg["damping_adaptation_interval"] if cfg["use_adaptive_damping"]
             else None)
    self.cycle = math.lcm(refresh, adapt or 1)
    # (refreshes the inverses, adapts the damping) of each kind of step.
    self.kinds = sorted({(s % refresh == 0,
                          adapt is not None and s % adapt == 0)
                         for s in range(self.cycle)})
    self.curvature = curvature
    # Optimizer.step takes a value for each of these that is not adaptive.
    self.step_kwargs = {k: v for k, v in cfg["step"].items()
                        if not cfg[f"use_adaptive_{k}"]}
    self.mesh = mesh if mesh is not None and mesh.size > 1 else None
    if self.mesh is not None:
      kwargs.update(multi_device=True, pmap_axis_name=devices.AXIS)
    # Per input, the last (value given, its per-device layout): a step's own
    # parameters, or timing's fixed batch, are not converted again.
    self._last = {}
    self.opt = kfac.Optimizer(
        jax.value_and_grad(loss_fn), estimation_mode=curvature.mode,
        layer_tag_to_block_ctor=curvature.block_ctors or None,
        estimator_ctor=type(curvature.estimator), **kwargs)

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
    return (self._per_device("params", params, devices.stack),
            self._per_device("batch", batch, devices.stack_split),
            devices.device_keys(rng, self.mesh))

  def init(self, params, batch, rng):
    # The curvature's state is the bulk of the optimizer's: refuse one that
    # would not fit before the optimizer allocates it.
    self.curvature.check_state_fits(rng, params, batch)
    params, batch, rng = self._inputs(params, batch, rng)
    return self.opt.init(params, rng, batch), 0

  def compiled_programs(self, params, opt_state, batch, rng) -> list:
    """A program per kind of step (`kinds`), compiled for its memory figure.

    The step's own programs are internal to `estimators.Optimizer`, so these
    are compiled again from `Optimizer.uncompiled_step` (under `jax.pmap`
    on a mesh, as the step runs: the figures are per device), with its
    inputs returned unchanged left out of the outputs as the step does.
    """
    state, _ = opt_state
    params, batch, rng = self._inputs(params, batch, rng)
    shape = () if self.mesh is None else (self.mesh.size,)
    hyper = {k: jnp.full(shape, v, state.damping.dtype)
             for k, v in self.step_kwargs.items()}
    # Only the memory figure is wanted: the CPU's quicker code generation
    # halves the compile time and leaves the buffers as they are.
    options = (_QUICK_CPU_COMPILE if staging.target_platform() == "cpu"
               else None)

    def compiled(refresh, adapt):
      step = costs.without_passthrough(functools.partial(
          self.opt.uncompiled_step, refresh_cache=refresh,
          update_damping=adapt))
      program = lambda p, s, r, b, h: step(p, s, r, b, **h)
      if self.mesh is None:
        program = jax.jit(program)
      else:
        program = jax.pmap(program, axis_name=devices.AXIS,
                           devices=list(self.mesh.devices.flat))
      return program.lower(params, state, rng, batch, hyper).compile(options)

    return [compiled(refresh, adapt) for refresh, adapt in self.kinds]

  def step(self, params, opt_state, batch, rng):
    state, count = opt_state
    params, batch, rng = self._inputs(params, batch, rng)
    params, state, stats = self.opt.step(
        params, state, rng, batch=batch, global_step_int=count,
        **self.step_kwargs)
    loss = stats["loss"]
    if self.mesh is not None:
      # Every device holds the same parameters and (averaged) loss.
      stacked = params
      params, loss = devices.unstack((stacked, loss), self.mesh)
      self._last["params"] = (params, stacked)
    return params, (state, count + 1), loss


def _preconditioned_sgd(loss_fn, curvature, cfg, mesh):
  del mesh  # the optax step runs SPMD on the split batch
  def make(batch, rng):
    return optax.chain(
        precondition_by_curvature(
            curvature, batch, rng, damping=cfg["damping"],
            curvature_ema=cfg["curvature_ema"],
            curvature_update_period=cfg["curvature_update_period"],
            inverse_update_period=cfg["inverse_update_period"]),
        optax.sgd(cfg["learning_rate"], momentum=cfg["momentum"]))
  return OptaxTrainer(loss_fn, make)


def _optax(transformation):
  def build(loss_fn, curvature, cfg, mesh):
    del curvature, mesh
    kwargs = {k: v for k, v in cfg.items() if k != "name"}
    return OptaxTrainer(loss_fn, lambda batch, rng: transformation(**kwargs))
  return build


@dataclasses.dataclass(frozen=True)
class OptimizerKind:
  build: Callable  # (loss_fn, curvature, cfg, mesh) -> trainer
  uses_curvature: bool
  needs_block_diagonal: bool = False

  def accepts(self, family: type[Curvature]) -> bool:
    """Whether it can train with curvatures of `family`."""
    return family.is_block_diagonal or not self.needs_block_diagonal


OPTIMIZERS = {
    "kfac": OptimizerKind(KFACTrainer, uses_curvature=True,
                          needs_block_diagonal=True),
    "preconditioned_sgd": OptimizerKind(_preconditioned_sgd,
                                        uses_curvature=True),
    "sgd": OptimizerKind(_optax(optax.sgd), uses_curvature=False),
    "adam": OptimizerKind(_optax(optax.adam), uses_curvature=False),
}


def optimizer_kind(name: str) -> OptimizerKind:
  if name not in OPTIMIZERS:
    raise ValueError(f"Unknown optimizer.name {name!r}; choose one of "
                     f"{', '.join(OPTIMIZERS)}.")
  return OPTIMIZERS[name]


def method_label(name: str, curvature: Curvature | None) -> str:
  """A training run's method: the optimizer, and the curvature it uses."""
  if optimizer_kind(name).uses_curvature and curvature is not None:
    return f"{name}[{curvature.label}]"
  return name


def make_optimizer(loss_fn: Callable, cfg: Mapping,
                   curvature: Curvature | None = None,
                   mesh: Mesh | None = None):
  """A trainer (`init(params, batch, rng)`, `step(params, state, batch, rng)`
  -> `(params, state, loss)`, `cycle`, and `compiled_programs(params, state,
  batch, rng)`: the programs its steps run, for their memory) from the
  `optimizer` config group; with a `mesh` (`devices.mesh`), for batches
  split over its devices (`devices.split`)."""
  kind = optimizer_kind(cfg["name"])
  if kind.uses_curvature and curvature is None:
    raise ValueError(f"optimizer={cfg['name']} needs a curvature.")
  return kind.build(loss_fn, curvature, cfg, mesh)


def compile_steps(optimizer, params, opt_state, batch, rng) -> float:
  """Runs `optimizer.cycle + 1` steps whose results are thrown away, so every
  program the step uses is compiled; returns the seconds they took.

  The first step of a run may do extra work (K-FAC's burn-in), and the
  others repeat every `cycle` steps, so this compiles them all.
  """
  start = time.perf_counter()
  state = opt_state
  for step in range(optimizer.cycle + 1):
    params, state, loss = optimizer.step(params, state, batch,
                                         jax.random.fold_in(rng, step))
  jax.block_until_ready((params, loss))
  return time.perf_counter() - start


def measurement_steps(spec, num_steps: int) -> list[int]:
  """The training steps a measurement is taken at, sorted.

  Args:
    spec: a list of steps (0 is the initialisation), or `'log:N'`: step 0
      and `N - 1` log-spaced steps up to `num_steps`.
    num_steps: the training run's length; no step may exceed it.

  Returns:
    The distinct steps, ascending.
  """
  if isinstance(spec, str):
    kind, _, count = spec.partition(":")
    if kind != "log" or not count.isdigit() or int(count) < 2:
      raise ValueError(f"steps={spec!r}: give a list of steps or 'log:N' "
                       "(N >= 2 log-spaced steps from 0 to num_steps).")
    spec = [0, *np.geomspace(1, num_steps, int(count) - 1).round()]
  try:
    steps = sorted({int(s) for s in spec})
  except (TypeError, ValueError) as e:
    raise ValueError(f"steps={spec!r} must be a list of integers.") from e
  if not steps:
    return []
  if steps[0] < 0:
    raise ValueError(f"steps={spec!r} must be non-negative integers.")
  if steps[-1] > num_steps:
    raise ValueError(
        f"steps has step {steps[-1]}, beyond the training run's length "
        f"(measure.training.num_steps={num_steps}): raise num_steps or drop "
        "the step.")
  return steps


def evaluator(problem, cfg: Mapping, dtype) -> Callable:
  """`evaluate(params) -> {train_loss, train_error, test_loss, test_error}`
  on fixed examples: the first `train_eval_size` of the training split and
  the first `eval_size` of the test split (None: all of a split)."""
  splits = {split: problem.evaluation_batch(cfg[key], dtype, split=split)
            for split, key in (("train", "train_eval_size"),
                               ("test", "eval_size"))}
  for split, (x, _) in splits.items():
    if len(x) == 0:
      raise ValueError(f"Problem {problem.name!r} has no {split} examples to "
                       "evaluate the training run on.")

  @jax.jit
  def losses(params, batch):
    return problem.loss_fn(params, batch), problem.error(params, batch)

  def evaluate(params):
    out = {}
    for split, batch in splits.items():
      loss, error = losses(params, batch)
      out[f"{split}_loss"], out[f"{split}_error"] = float(loss), float(error)
    return out

  return evaluate


def run(problem, optimizer, params, cfg: Mapping, rng, data_seed: int,
        progress: bool = True, at_steps=(), on_step: Callable | None = None,
        mesh: Mesh | None = None) -> list[dict]:
  """Trains for `cfg["num_steps"]` steps; one row per logged step.

  Row `step` s describes the parameters after s updates (0: the
  initialisation): `batch_loss` is the loss of the minibatch of update s
  (before it), and every `eval_every` steps (and at the first and last) the
  loss and error on fixed training and test examples (`evaluator`).
  `wall_s` is steady-state training time: every program of the step is
  compiled first (`compile_steps`, whose seconds are the `compile_s`
  column), and evaluations run with the clock stopped. A non-finite loss
  ends the run; its last row has `diverged` true. `on_step(step, params)`
  is called, off the clock, after each of `at_steps` steps. With a `mesh`
  (the optimizer's), every batch is split over its devices.

  Raises:
    FloatingPointError: when the run diverges before a step of `at_steps`.
  """
  num_steps, log_every = int(cfg["num_steps"]), int(cfg["log_every"])
  eval_every = int(cfg["eval_every"])
  at_steps = set(at_steps)
  dtype = jax.tree.leaves(params)[0].dtype
  batches = problem.batches(seed=data_seed, dtype=dtype)
  evaluate = evaluator(problem, cfg, dtype)
  if mesh is None:
    place = lambda batch: batch
  else:
    place = lambda batch: devices.split(batch, mesh, "problem.batch_size")
    params = devices.replicate(params, mesh)
  first = place(next(batches))
  opt_state = optimizer.init(params, first, rng)
  compile_s = compile_steps(optimizer, params, opt_state, first, rng)
  if 0 in at_steps:
    on_step(0, params)

  def row(step, params, wall_s, batch_loss, evaluated):
    scores = evaluate(params) if evaluated else {}
    checked = [v for v in (batch_loss, scores.get("train_loss"))
               if v is not None]
    return dict(step=step, wall_s=wall_s, compile_s=compile_s,
                batch_loss=batch_loss, **scores,
                diverged=not np.all(np.isfinite(checked)))

  rows = [row(0, params, 0.0, None, True)]
  elapsed, batch = 0.0, first
  for step in tqdm(range(1, num_steps + 1), desc="training",
                   disable=not progress, leave=False):
    start = time.perf_counter()
    key = jax.random.fold_in(rng, step)
    params, opt_state, loss = optimizer.step(params, opt_state, batch, key)
    if step % log_every == 0 or step == num_steps:
      loss = float(loss)  # waits for the step
      elapsed += time.perf_counter() - start
      rows.append(row(step, params, elapsed, loss,
                      step % eval_every == 0 or step == num_steps))
      if rows[-1]["diverged"]:
        missed = sorted(s for s in at_steps if s >= step)
        if missed:
          raise FloatingPointError(
              f"The training loss is not finite at step {step}, so there are "
              f"no parameters to measure at steps {missed}: lower the "
              "learning rate or raise the damping.")
        break
    else:
      elapsed += time.perf_counter() - start
    if step in at_steps:
      on_step(step, params)
    batch = place(next(batches))
  return rows
