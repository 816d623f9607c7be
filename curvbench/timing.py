"""Per-phase timing: a curvature's phases and the optimizer's real step.

Phases (one row each):

- `grad_step`: a gradient and an SGD update.
- `curvature_update`, `cache_update`, `precondition`: the curvature's
  statistics update, inverse refresh and preconditioning; timed only when
  the optimizer uses a curvature.
- `optimizer_step`: the configured optimizer's own step (its trainer,
  `curvbench.optimizers`) with all it does; for K-FAC the adaptive
  learning rate, momentum and damping and the periodic inverse refresh.
- `adam_step`: an Adam step (settings `measure.timing.baseline`) on the
  same parameters and batch; always timed.
- `model_state_update`: for a model with state (batch norm), the forward
  pass that moves its running averages on (`Problem.next_model_state`),
  which training adds to every optimizer's step.

The first four are single jitted calls (`time_function`): compile time is
taken once, then `warmup` untimed and `repeats` timed calls, each ended by
`block_until_ready`. A step comes in kinds that recur every `cycle` steps
of the configured optimizer (e.g. K-FAC's inverse refresh every
`inverse_update_period` steps), so the two steps are timed by whole cycles:
`compile_s` is the time of `training.compile_steps` (throwaway steps that
compile every kind, their run time included), the first step (K-FAC's
burn-in) runs off the clock, and one sample is the time of `cycle`
consecutive steps (parameters and state carried, a key per step) divided by
`cycle`; Adam uses the same `cycle`. Their samples alternate, `warmup`
untimed repeats then `repeats` timed ones, each one optimizer sample then
one Adam sample, so that load on the machine hits both alike. They have no
first call apart from compilation: `first_call_s` is NaN.
`steps_per_sample` is 1 for single calls and `cycle` for the steps.

Every row also records memory (`costs.memory_columns`): `program_bytes`,
XLA's figure (arguments + outputs + temporaries) for the phase's compiled
program, for a step the largest of the programs its kinds of step run
(K-FAC's recompiled from `Optimizer.uncompiled_step`, burn-in aside);
`device_peak_bytes`, the highest peak of the devices used since the
process started, read after the phase (NaN on the CPU); and
`memory_source`, 'device' where that peak is measured, else 'xla_analysis'.

`ratio_to_grad_step` and `ratio_to_adam_step` are a row's median over the
median of `grad_step` and of `adam_step`: the latter is the cost of the
optimizer's step in Adam steps.

With a mesh of several devices (`devices=N`) the batch is split across
them. `grad_step`, Adam and the phases of `implicit_exact` run SPMD (XLA
sums the devices' parts); the curvature phases of the estimator families
run on each device under `jax.shard_map`, averaging the statistics over
the devices and sharing the refresh and preconditioning out among them
(`curvature.distributed`); the optimizer's step is its multi-device step.
Figures are per device.
"""

from __future__ import annotations

import time

import jax
import numpy as np
from jax.sharding import Mesh
from tqdm.auto import tqdm

from curvbench import costs, devices, training

PHASES = ("grad_step", "curvature_update", "cache_update", "precondition",
          "optimizer_step")  # the choices of measure.timing.phases
CURVATURE_PHASES = ("curvature_update", "cache_update", "precondition")
BASELINE_PHASE = "adam_step"  # always timed: the unit of ratio_to_adam_step


def statistics(times) -> dict:
  """Median, minimum, quartiles and count of the timed samples."""
  times = np.asarray(times)
  return dict(median_s=float(np.median(times)), min_s=float(times.min()),
              q25_s=float(np.quantile(times, 0.25)),
              q75_s=float(np.quantile(times, 0.75)), repeats=len(times))


def time_function(fn, args, warmup: int = 2, repeats: int = 10) -> dict:
  """Compile time, first-call time, steady-state statistics and the memory
  columns of one call of `fn(*args)`."""
  start = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  compile_s = time.perf_counter() - start
  start = time.perf_counter()
  jax.block_until_ready(compiled(*args))
  first_s = time.perf_counter() - start
  for _ in range(warmup):
    jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - start)
  return dict(compile_s=compile_s, first_call_s=first_s, steps_per_sample=1,
              **statistics(times), **costs.memory_columns(compiled))


def phase_functions(loss_fn, curvature, damping: float, learning_rate: float,
                    mesh: Mesh | None = None):
  """The jittable function of each single-call phase, keyed by name.

  With a `mesh` of several devices and a curvature that takes an axis name,
  the curvature phases run on each device (`devices.per_device`), the
  batch of `curvature_update` split across them and each device's key
  folded with its index (so that sampled modes draw differently on each).
  """

  def grad_step(params, batch):
    grads = jax.grad(loss_fn)(params, batch)
    return jax.tree.map(lambda p, g: p - learning_rate * g, params, grads)

  fns = dict(grad_step=grad_step)
  if curvature is None:
    return fns
  if mesh is None or mesh.size == 1 or not curvature.takes_axis_name:
    fns.update(
        curvature_update=lambda s, p, b, r: curvature.update(s, p, b, r),
        cache_update=lambda s: curvature.refresh(s, damping),
        precondition=lambda s, g: curvature.precondition(s, g, damping))
    return fns
  axis = devices.AXIS

  def update(state, params, batch, rng):
    rng = jax.random.fold_in(rng, jax.lax.axis_index(axis))
    return curvature.update(state, params, batch, rng, axis_name=axis)

  fns.update(
      curvature_update=devices.per_device(update, mesh, split_args=(2,)),
      cache_update=devices.per_device(
          lambda s: curvature.refresh(s, damping, axis_name=axis), mesh),
      precondition=devices.per_device(
          lambda s, g: curvature.precondition(s, g, damping, axis_name=axis),
          mesh))
  return fns


def phase_calls(loss_fn, curvature, params, batch, cfg, rng,
                mesh: Mesh | None = None) -> dict[str, tuple]:
  """`{phase: (fn, args)}` of the single-call phases: the phase functions
  (`phase_functions`; the curvature's only when `curvature` is given) and
  the arguments they are timed on. With a `mesh`, `batch` is split over its
  devices (`devices.split`) and the rest replicated.

  Raises:
    ValueError: when the batch does not split evenly over the mesh.
  """
  if mesh is not None:
    batch = devices.split(batch, mesh, "measure.batch_size")
    params = devices.replicate(params, mesh)
  fns = phase_functions(loss_fn, curvature, float(cfg["damping"]),
                        float(cfg["learning_rate"]), mesh)
  args = dict(grad_step=(params, batch))
  if curvature is not None:
    state = curvature.init(rng, params, batch)
    state = jax.jit(curvature.update)(state, params, batch, rng)
    grads = jax.grad(loss_fn)(params, batch)
    refreshed = jax.jit(curvature.refresh)(state, float(cfg["damping"]))
    if mesh is not None and curvature.takes_axis_name:
      # What each device gets whole under shard_map. (An implicit_exact
      # state holds the batch, which stays split.)
      state, grads, refreshed = devices.replicate((state, grads, refreshed),
                                                  mesh)
    args.update(curvature_update=(state, params, batch, rng),
                cache_update=(state,), precondition=(refreshed, grads))
  return {phase: (fns[phase], args[phase]) for phase in fns}


class Stepper:
  """Runs a trainer's steps in timed samples of `steps` steps each.

  Building it compiles every kind of step (`compile_s`) and runs the first
  step (K-FAC's burn-in) off the clock; params and state then carry on
  from sample to sample, each step with its own key. `programs` are the
  step's compiled programs, for their memory.
  """

  def __init__(self, trainer, params, batch, rng, steps: int):
    self.trainer, self.batch, self.rng, self.steps = trainer, batch, rng, steps
    state = trainer.init(params, batch, rng)
    self.compile_s = training.compile_steps(trainer, params, state, batch,
                                            rng)
    params, state, loss = trainer.step(params, state, batch, rng)
    jax.block_until_ready((params, state, loss))
    self.params, self.state, self.count = params, state, 1
    self.programs = trainer.compiled_programs(params, state, batch, rng)

  def sample(self) -> float:
    """Seconds per step, averaged over one sample of `steps` steps."""
    keys = [jax.random.fold_in(self.rng, self.count + i)
            for i in range(self.steps)]
    jax.block_until_ready(keys)
    params, state, step = self.params, self.state, self.trainer.step
    start = time.perf_counter()
    for key in keys:
      params, state, loss = step(params, state, self.batch, key)
    jax.block_until_ready((params, state, loss))
    elapsed = time.perf_counter() - start
    self.params, self.state = params, state
    self.count += self.steps
    return elapsed / self.steps


def time_steps(steppers: dict, warmup: int, repeats: int,
               progress: bool = False) -> dict:
  """A row per stepper, their samples interleaved: repeat by repeat, one
  sample of each in turn. `first_call_s` is NaN: the first call of a step
  compiles, so there is no first call apart from compilation. Where the
  baseline (Adam) is among them, every other row has the quartiles of the
  ratio of its samples to the baseline's of the same repeat
  (`ratio_to_adam_q25`, `ratio_to_adam_q75`): load that hits a repeat hits
  both of its samples, so this spread is the measurement's own."""
  times = {name: [] for name in steppers}
  for repeat in tqdm(range(warmup + repeats), desc="timing steps",
                     disable=not progress, leave=False):
    for name, stepper in steppers.items():
      seconds = stepper.sample()
      if repeat >= warmup:
        times[name].append(seconds)
  rows = {name: dict(compile_s=stepper.compile_s, first_call_s=float("nan"),
                     steps_per_sample=stepper.steps,
                     **statistics(times[name]),
                     **costs.memory_columns(*stepper.programs))
          for name, stepper in steppers.items()}
  if BASELINE_PHASE in times:
    for name in rows:
      if name != BASELINE_PHASE:
        ratios = np.divide(times[name], times[BASELINE_PHASE])
        rows[name].update(zip(("ratio_to_adam_q25", "ratio_to_adam_q75"),
                              map(float, np.quantile(ratios, [0.25, 0.75]))))
  return rows


def selected_phases(cfg, uses_curvature: bool) -> list[str]:
  """The single-call and optimizer phases to time, `grad_step` first;
  curvature phases only when the optimizer uses a curvature."""
  phases = list(cfg["phases"])
  if not uses_curvature:
    phases = [p for p in phases if p not in CURVATURE_PHASES]
  return ["grad_step", *(p for p in phases if p != "grad_step")]


def measure(loss_fn, curvature, params, batch, cfg, optimizer, baseline,
            rng, progress: bool = False, mesh: Mesh | None = None,
            model_state_update=None) -> list[dict]:
  """One row per phase; see the module docstring.

  Args:
    loss_fn: `loss_fn(params, batch)`, the averaged loss.
    curvature: the curvature of the curvature phases and the optimizer.
    params: the parameters every phase starts from.
    batch: the batch every phase uses.
    cfg: the `measure.timing` section (a mapping).
    optimizer: the optimizer of `optimizer_step` (its settings, a
      `curvbench.optimizers.OptimizerSettings`).
    baseline: the Adam of `adam_step` (`measure.timing.baseline`).
    rng: the key of curvature sampling and optimizer steps.
    progress: show a progress bar.
    mesh: the devices the batch is split across (None: one device, as
      JAX places it).
    model_state_update: for a model with state, `(fn, model_state)` with
      `fn(params, model_state, inputs)` its next state (timed as the phase
      `model_state_update`).

  Returns:
    Rows with `phase`, `compile_s`, `first_call_s`, `steps_per_sample`,
    `median_s`, `min_s`, `q25_s`, `q75_s`, `repeats`, `program_bytes`,
    `device_peak_bytes`, `memory_source`, `ratio_to_grad_step` and
    `ratio_to_adam_step`.
  """
  uses_curvature = optimizer.uses_curvature
  phases = selected_phases(cfg, uses_curvature)
  warmup, repeats = int(cfg["warmup"]), int(cfg["repeats"])
  calls = phase_calls(loss_fn, curvature if uses_curvature else None, params,
                      batch, cfg, rng, mesh)
  params, batch = calls["grad_step"][1]  # placed on the mesh

  stats = {}
  timed = [p for p in phases if p != "optimizer_step"]
  extra = []
  if model_state_update is not None:
    fn, model_state = model_state_update
    calls["model_state_update"] = (jax.jit(fn), (params, model_state,
                                                 batch[0]))
    extra.append("model_state_update")
  for phase in tqdm(timed + extra, desc="timing", disable=not progress,
                    leave=False):
    stats[phase] = time_function(*calls[phase], warmup, repeats)

  trainer = optimizer.make(loss_fn, curvature, mesh)
  steps = int(trainer.cycle)
  steppers = {}
  if "optimizer_step" in phases:
    steppers["optimizer_step"] = Stepper(trainer, params, batch,
                                         jax.random.fold_in(rng, 1), steps)
  steppers[BASELINE_PHASE] = Stepper(
      baseline.make(loss_fn, mesh=mesh), params, batch,
      jax.random.fold_in(rng, 2), steps)
  stats.update(time_steps(steppers, warmup, repeats, progress))

  grad_s = stats["grad_step"]["median_s"]
  adam_s = stats[BASELINE_PHASE]["median_s"]
  return [dict(phase=phase, **stats[phase],
               ratio_to_grad_step=stats[phase]["median_s"] / grad_s,
               ratio_to_adam_step=stats[phase]["median_s"] / adam_s)
          for phase in (*phases, *extra, BASELINE_PHASE)]
