"""Per-phase timing: a curvature's phases, the optimizer's real step and a
baseline optimizer's step, timed in turn so that load hits them alike.

Phases (one row each):

- `grad_step`: a gradient and an SGD update.
- `curvature_update`, `cache_update`, `precondition`: the curvature's
  statistics update, inverse refresh and preconditioning; timed only when
  the optimizer uses a curvature.
- `optimizer_step`: the configured optimizer's own step (its trainer,
  `curvbench.optimizers`) with all it does; for K-FAC the adaptive
  learning rate, momentum and damping and the periodic inverse refresh.
- `baseline_step`: the step of the baseline optimizer
  (`measure.timing.baseline`, Adam by default) on the same parameters and
  batch; always timed, the unit of every ratio.
- `model_state_update`: for a model with state (batch norm), the forward
  pass that moves its running averages on (`Problem.next_model_state`),
  which training adds to every optimizer's step.

The single-call phases are jitted programs: each is compiled and called
once first (`compile_s`, `first_call_s`). A step comes in kinds that recur
every `cycle` steps of the configured optimizer (e.g. K-FAC's inverse
refresh every `inverse_update_period` steps), so steps are timed by whole
cycles: `compile_s` is the time of `training.compile_steps` (throwaway
steps that compile every kind, their run time included), the first step
(K-FAC's burn-in) runs off the clock, and one sample is the time of `cycle`
consecutive steps (parameters and state carried, a key per step) divided by
`cycle`; the baseline uses the same `cycle`. There is no first call apart
from compilation (`first_call_s` NaN).

Then `warmup` untimed rounds and `repeats` timed ones: each round times one
call of every single-call phase and one sample of each step, in turn, each
ended by `block_until_ready`. A phase's ratio to the baseline is taken
round by round (its sample over the baseline's of the same round), so
load that slows a round slows both; `ratio_to_baseline` is the median of
those paired ratios and `ratio_q25`, `ratio_q75` their quartiles (the
same samples). The samples themselves are the `timing_samples` table. The
machine's load over the timed rounds (`load.Monitor`) is in every row.

Every row records XLA's count of the phase's floating-point operations
(`flops`, per call or per step averaged over a cycle; `costs.flops`) and
its ratio to the baseline's (`flop_ratio_to_baseline`): a time ratio well
above the flop ratio points at overhead to find, one at or below it at the
algorithm's own cost.

Every row also records memory (`costs.memory_columns`): `program_bytes`,
XLA's figure (arguments + outputs + temporaries) for the phase's compiled
program, for a step the largest of the programs its kinds of step run;
`device_peak_bytes`, the highest peak of the devices used since the
process started, read after the phase (NaN on the CPU); and
`memory_source`, 'device' where that peak is measured, else
'xla_analysis'.

With a mesh of several devices (`devices=N`) the batch is split across
them. `grad_step`, the first-order steps and the phases of
`implicit_exact` run SPMD (XLA sums the devices' parts); the curvature
phases of the estimator families run on each device under
`jax.shard_map`, averaging the statistics over the devices and sharing the
refresh and preconditioning out among them (`curvature.distributed`); the
optimizer's step is its multi-device step. Figures are per device.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import cast

import jax
import numpy as np
from jax.sharding import Mesh
from tqdm.auto import tqdm

from curvbench.core import costs, devices, stats, training
from curvbench.measurements.timing import load

PHASES = (
  "grad_step",
  "curvature_update",
  "cache_update",
  "precondition",
  "optimizer_step",
)  # the choices of measure.timing.phases
CURVATURE_PHASES = ("curvature_update", "cache_update", "precondition")
BASELINE_PHASE = "baseline_step"  # always timed: the unit of every ratio


def statistics(times) -> dict:
  """Median, minimum, quartiles and count of the timed samples."""
  median, q25, q75 = stats.quartiles(times)
  return dict(
    median_s=median,
    min_s=float(np.min(times)),
    q25_s=q25,
    q75_s=q75,
    repeats=len(times),
  )


class Call:
  """A single-call phase, compiled and called once off the clock; `sample`
  times one call."""

  def __init__(self, fn, args):
    self.args = args
    start = time.perf_counter()
    self.compiled = jax.jit(fn).lower(*args).compile()
    self.compile_s = time.perf_counter() - start
    start = time.perf_counter()
    jax.block_until_ready(self.compiled(*args))
    self.first_call_s = time.perf_counter() - start
    self.steps = 1
    self.programs = [self.compiled]
    self.flops = costs.flops(self.compiled)

  def sample(self) -> float:
    """The seconds one call takes, waiting for its result."""
    start = time.perf_counter()
    jax.block_until_ready(self.compiled(*self.args))
    return time.perf_counter() - start


class Stepper:
  """Runs a trainer's steps in timed samples of `steps` steps each.

  Building it compiles every kind of step (`compile_s`) and runs the first
  step (K-FAC's burn-in) off the clock; params and state then carry on
  from sample to sample, each step with its own key. `programs` are the
  compiled programs of a cycle's steps, for their memory, and `flops` XLA's
  count per step, averaged over the cycle.
  """

  first_call_s = float("nan")

  def __init__(self, trainer, params, batch, rng, steps: int):
    self.trainer, self.batch, self.rng, self.steps = trainer, batch, rng, steps
    state = trainer.init(params, batch, rng)
    self.compile_s = training.compile_steps(trainer, params, state, batch, rng)
    params, state, loss = trainer.step(params, state, batch, rng)
    jax.block_until_ready((params, state, loss))
    self.params, self.state, self.count = params, state, 1
    self.programs = trainer.compiled_programs(params, state, batch, rng)
    self.flops = float(np.mean([costs.flops(p) for p in self.programs]))

  def sample(self) -> float:
    """Seconds per step, averaged over one sample of `steps` steps."""
    keys = [
      jax.random.fold_in(self.rng, self.count + i) for i in range(self.steps)
    ]
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


def phase_functions(
  loss_fn,
  curvature,
  damping: float,
  learning_rate: float,
  mesh: Mesh | None = None,
):
  """The jittable function of each single-call phase, keyed by name.

  With a `mesh` of several devices and a curvature that takes an axis name,
  the curvature phases run on each device (`devices.per_device`), the
  batch of `curvature_update` split across them and each device's key
  folded with its index (so that sampled modes draw differently on each).
  """

  def grad_step(params, batch):
    grads = jax.grad(loss_fn)(params, batch)
    return jax.tree.map(lambda p, g: p - learning_rate * g, params, grads)

  fns: dict[str, Callable] = dict(grad_step=grad_step)
  if curvature is None:
    return fns
  if mesh is None or mesh.size == 1 or not curvature.takes_axis_name:
    fns.update(
      curvature_update=lambda s, p, b, r: curvature.update(s, p, b, r),
      cache_update=lambda s: curvature.refresh(s, damping),
      precondition=lambda s, g: curvature.precondition(s, g, damping),
    )
    return fns
  axis = devices.AXIS

  def update(state, params, batch, rng):
    rng = jax.random.fold_in(rng, jax.lax.axis_index(axis))
    return curvature.update(state, params, batch, rng, axis_name=axis)

  fns.update(
    curvature_update=devices.per_device(update, mesh, split_args=(2,)),
    cache_update=devices.per_device(
      lambda s: curvature.refresh(s, damping, axis_name=axis), mesh
    ),
    precondition=devices.per_device(
      lambda s, g: curvature.precondition(s, g, damping, axis_name=axis), mesh
    ),
  )
  return fns


def phase_calls(
  loss_fn,
  curvature,
  params,
  batch,
  damping: float,
  learning_rate: float,
  rng,
  mesh: Mesh | None = None,
) -> dict[str, tuple]:
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
  fns = phase_functions(loss_fn, curvature, damping, learning_rate, mesh)
  args: dict[str, tuple] = dict(grad_step=(params, batch))
  if curvature is not None:
    state = curvature.init(rng, params, batch)
    state = jax.jit(curvature.update)(state, params, batch, rng)
    grads = jax.grad(loss_fn)(params, batch)
    refreshed = jax.jit(curvature.refresh)(state, damping)
    if mesh is not None and curvature.takes_axis_name:
      # What each device gets whole under shard_map. (An implicit_exact
      # state holds the batch, which stays split.)
      state, grads, refreshed = devices.replicate(
        (state, grads, refreshed), mesh
      )
    args.update(
      curvature_update=(state, params, batch, rng),
      cache_update=(state,),
      precondition=(refreshed, grads),
    )
  return {phase: (fns[phase], args[phase]) for phase in fns}


def rounds(
  timed: dict, warmup: int, repeats: int, progress: bool = False
) -> tuple[dict[str, list[float]], load.Load]:
  """`warmup` untimed rounds, then `repeats` timed ones, each taking one
  sample of every entry of `timed` in turn; the timed samples per entry
  and the machine's load over the timed rounds."""
  samples: dict[str, list[float]] = {name: [] for name in timed}
  for _ in range(warmup):
    for timer in timed.values():
      timer.sample()
  with load.Monitor() as monitor:
    for _ in tqdm(
      range(repeats), desc="timing", disable=not progress, leave=False
    ):
      for name, timer in timed.items():
        samples[name].append(timer.sample())
  return samples, cast(load.Load, monitor.load)  # set on leaving the block


def selected_phases(phases, uses_curvature: bool) -> list[str]:
  """The single-call and optimizer phases to time, `grad_step` first;
  curvature phases only when the optimizer uses a curvature."""
  phases = list(phases)
  if not uses_curvature:
    phases = [p for p in phases if p not in CURVATURE_PHASES]
  return ["grad_step", *(p for p in phases if p != "grad_step")]


def measure(
  loss_fn,
  curvature,
  params,
  batch,
  settings,
  optimizer,
  rng,
  progress: bool = False,
  mesh: Mesh | None = None,
  model_state_update=None,
  log=None,
) -> dict[str, list[dict]]:
  """The `timing` and `timing_samples` tables; see the module docstring.

  Args:
    loss_fn: `loss_fn(params, batch)`, the averaged loss.
    curvature: the curvature of the curvature phases and the optimizer.
    params: the parameters every phase starts from.
    batch: the batch every phase uses.
    settings: the `measure.timing` settings (`Timing`): phases, repeats,
      damping, the baseline optimizer and what to do on a busy machine.
    optimizer: the optimizer of `optimizer_step` (its settings, a
      `curvbench.optimizers.OptimizerSettings`).
    rng: the key of curvature sampling and optimizer steps.
    progress: show a progress bar.
    mesh: the devices the batch is split across (None: one device, as
      JAX places it).
    model_state_update: for a model with state, `(fn, model_state)` with
      `fn(params, model_state, inputs)` its next state (timed as the phase
      `model_state_update`).
    log: prints a progress line (waiting for a quiet machine).

  Returns:
    `timing`: a row per phase with `phase`, `compile_s`, `first_call_s`,
    `steps_per_sample`, `median_s`, `min_s`, `q25_s`, `q75_s`, `repeats`,
    the memory columns, `baseline` (its label), `ratio_to_baseline`,
    `ratio_q25`, `ratio_q75`, `ratio_to_grad_step`, `flops`,
    `flop_ratio_to_baseline` and the load columns
    (`load.Load.columns`); `timing_samples`: a row per phase and timed
    round with `repeat`, `seconds` and `ratio_to_baseline`.

  Raises:
    load.MachineBusy: where the machine is busy and the settings refuse
      to time on it.
  """
  uses_curvature = optimizer.uses_curvature
  phases = selected_phases(settings.phases, uses_curvature)
  calls = phase_calls(
    loss_fn,
    curvature if uses_curvature else None,
    params,
    batch,
    settings.damping,
    settings.learning_rate,
    rng,
    mesh,
  )
  params, batch = calls["grad_step"][1]  # placed on the mesh
  if model_state_update is not None:
    fn, model_state = model_state_update
    calls["model_state_update"] = (fn, (params, model_state, batch[0]))

  timed: dict[str, Call | Stepper] = {
    phase: Call(*calls[phase])
    for phase in tqdm(
      calls, desc="compiling", disable=not progress, leave=False
    )
    if phase in phases or phase == "model_state_update"
  }
  trainer = optimizer.make(loss_fn, curvature, mesh)
  steps = int(trainer.cycle)
  if "optimizer_step" in phases:
    timed["optimizer_step"] = Stepper(
      trainer, params, batch, jax.random.fold_in(rng, 1), steps
    )
  timed[BASELINE_PHASE] = Stepper(
    settings.baseline.make(loss_fn, mesh=mesh),
    params,
    batch,
    jax.random.fold_in(rng, 2),
    steps,
  )

  load.settle(
    settings.when_busy, settings.busy_share, settings.busy_wait_s, log
  )
  samples, measured = rounds(timed, settings.warmup, settings.repeats, progress)
  base = np.asarray(samples[BASELINE_PHASE])
  base_flops = timed[BASELINE_PHASE].flops
  grad = np.asarray(samples["grad_step"])
  loaded = measured.columns(settings.busy_share)
  rows, sample_rows = [], []
  for phase, timer in timed.items():
    seconds = np.asarray(samples[phase])
    ratios = seconds / base
    median, q25, q75 = stats.quartiles(ratios)
    rows.append(
      dict(
        phase=phase,
        compile_s=timer.compile_s,
        first_call_s=timer.first_call_s,
        steps_per_sample=timer.steps,
        **statistics(seconds),
        **costs.memory_columns(*timer.programs),
        baseline=settings.baseline.label(None),
        ratio_to_baseline=median,
        ratio_q25=q25,
        ratio_q75=q75,
        ratio_to_grad_step=stats.quartiles(seconds / grad)[0],
        flops=timer.flops,
        flop_ratio_to_baseline=timer.flops / base_flops,
        **loaded,
      )
    )
    sample_rows += [
      dict(phase=phase, repeat=i, seconds=float(s), ratio_to_baseline=float(r))
      for i, (s, r) in enumerate(zip(seconds, ratios))
    ]
  return dict(timing=rows, timing_samples=sample_rows)
