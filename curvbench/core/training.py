"""Loss curves against steps and wall time, for any optimizer's trainer
(`curvbench.optimizers`), and the trainer of optax transformations.

All optimizers see the same initial parameters and the same batches in the
same order. With a mesh of several devices (`devices=N`), every batch is
split across them: the optax steps run SPMD on the split batch, and K-FAC
runs `estimators.Optimizer`'s multi-device step (`jax.pmap`), converting at
the trainer's edges so that callers still see ordinary parameters.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import jax
import numpy as np
import optax
from jax.sharding import Mesh
from tqdm.auto import tqdm

from curvbench.core import devices, matrix_free


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
    """Builds the transformation on `batch` and `rng`, compiles its step
    (`step(params, opt_state, batch, rng) -> (params, opt_state,
    loss)`) and returns the initial optimizer state."""
    tx = optax.with_extra_args_support(self.make_transformation(batch, rng))

    def step(params, opt_state, batch, rng):
      loss, grads = jax.value_and_grad(self.loss_fn)(params, batch)
      updates, opt_state = tx.update(
        grads, opt_state, params, batch=batch, rng=rng
      )
      return optax.apply_updates(params, updates), opt_state, loss

    self.step = jax.jit(step)
    return tx.init(params)

  def compiled_programs(self, params, opt_state, batch, rng) -> list:
    """The step's program, compiled (after a step: the one it ran); its
    cycle is one step."""
    return [self.step.lower(params, opt_state, batch, rng).compile()]


def compile_steps(optimizer, params, opt_state, batch, rng) -> float:
  """Runs `optimizer.cycle + 1` steps whose results are thrown away, so every
  program the step uses is compiled; returns the seconds they took.

  The first step of a run may do extra work (K-FAC's burn-in), and the
  others repeat every `cycle` steps, so this compiles them all.
  """
  start = time.perf_counter()
  state = opt_state
  for step in range(optimizer.cycle + 1):
    params, state, loss = optimizer.step(
      params, state, batch, jax.random.fold_in(rng, step)
    )
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
      raise ValueError(
        f"steps={spec!r}: give a list of steps or 'log:N' "
        "(N >= 2 log-spaced steps from 0 to num_steps)."
      )
    spec = [
      0,
      *(int(s) for s in np.geomspace(1, num_steps, int(count) - 1).round()),
    ]
  if not isinstance(spec, (list, tuple)) or not all(
    isinstance(s, (int, np.integer)) and not isinstance(s, bool) for s in spec
  ):
    raise ValueError(
      f"steps={spec!r} must be a list of integers (whole "
      "numbers of training steps)."
    )
  steps = sorted({int(s) for s in spec})
  if not steps:
    return []
  if steps[0] < 0:
    raise ValueError(f"steps={spec!r} must be non-negative integers.")
  if steps[-1] > num_steps:
    raise ValueError(
      f"steps has step {steps[-1]}, beyond the training run's length "
      f"(measure.training.num_steps={num_steps}): raise num_steps or drop "
      "the step."
    )
  return steps


def evaluator(problem, cfg, dtype) -> Callable:
  """`evaluate(params, model_state) -> {train_loss, train_error, test_loss,
  test_error}` on fixed examples: the first `train_eval_size` of the
  training split and the first `eval_size` of the test split (None: all of
  a split); a model with state in evaluation mode (`Problem.outputs`)."""
  splits = {
    split: problem.evaluation_batch(getattr(cfg, key), dtype, split=split)
    for split, key in (("train", "train_eval_size"), ("test", "eval_size"))
  }
  for split, (x, _) in splits.items():
    if len(x) == 0:
      raise ValueError(
        f"Problem {problem.name!r} has no {split} examples to "
        "evaluate the training run on."
      )

  @jax.jit
  def losses(params, model_state, batch):
    return (
      problem.evaluation_loss(params, batch, model_state),
      problem.error(params, batch, model_state),
    )

  def evaluate(params, model_state):
    out = {}
    for split, batch in splits.items():
      loss, error = losses(params, model_state, batch)
      out[f"{split}_loss"], out[f"{split}_error"] = float(loss), float(error)
    return out

  return evaluate


def sharpness(problem, cfg, dtype) -> Callable:
  """`sharpness(params) -> float`: the largest eigenvalue of the Hessian
  of the training loss (`Problem.loss_fn`, training mode) on the examples
  `evaluator` scores the training split on, the sharpness of Cohen et al.
  (2021); from `cfg.sharpness_iterations` Lanczos steps on Hessian-vector
  products (`matrix_free.top_k_eigenpairs`), from a fixed start vector."""
  batch = problem.evaluation_batch(cfg.train_eval_size, dtype, split="train")

  def hvp(v, params, batch):
    grad = lambda p: jax.grad(problem.loss_fn)(p, batch)
    return jax.jvp(grad, (params,), (v,))[1]

  iters, key = cfg.sharpness_iterations, jax.random.PRNGKey(0)

  @jax.jit
  def top(params, batch):
    top_k = matrix_free.top_k_eigenpairs
    return top_k(hvp, params, 1, iters, key, params, batch)[0][0]

  return lambda params: float(top(params, batch))


def time_grid(cfg) -> list[float]:
  """The seconds of training at which a run with a time budget is
  evaluated besides its steps: `cfg.time_grid` points evenly spaced up to
  `cfg.budget_s` (none without a budget)."""
  if cfg.budget_s is None or not cfg.time_grid:
    return []
  return [cfg.budget_s * k / cfg.time_grid for k in range(1, cfg.time_grid + 1)]


def batch_schedule(
  first: int, total: int, growth_steps: int | None, ladder: float
) -> Callable[[int], int]:
  """The batch size of update k (from 1): `first` throughout without
  `growth_steps`; else Martens & Grosse's (2015, sec. 13) exponential
  growth m_k = min(first * e^((k - 1) / b), total), b such that update
  `growth_steps` takes all `total` examples, each size rounded down to a
  rung first * ladder^j (or `total`), so that a few programs are compiled.
  """
  if growth_steps is None or first >= total:
    return lambda k: first
  powers = [
    first * ladder**j
    for j in range(int(np.floor(np.log(total / first) / np.log(ladder))) + 1)
  ]
  rungs = sorted({int(r) for r in powers if r < total} | {total})
  rate = np.log(total / first) / max(growth_steps - 1, 1)

  def size(k: int) -> int:
    if k >= growth_steps:
      return total
    wanted = first * np.exp(rate * (k - 1)) * (1 + 1e-12)  # round-off
    return max(r for r in rungs if r <= wanted)

  return size


def run(
  problem,
  optimizer,
  params,
  cfg,
  rng,
  data_seed: int,
  progress: bool = True,
  at_steps=(),
  on_step: Callable | None = None,
  mesh: Mesh | None = None,
) -> list[dict]:
  """Trains for `cfg.num_steps` steps, or until `cfg.budget_s` seconds of
  training are spent (`cfg`: the training measurement's settings); one row
  per logged step, and one per point of the time grid.

  Row `step` s describes the parameters after s updates (0: the
  initialisation): `batch_loss` is the loss of the minibatch of update s
  (before it), and every `eval_every` steps (and at the first and last) the
  loss and error on fixed training and test examples (`evaluator`).
  `wall_s` is steady-state training time: every program of the step is
  compiled first (`compile_steps`, whose seconds are the `compile_s`
  column), and evaluations run with the clock stopped. With
  `cfg.sharpness_every` N, the rows of step 0, every N-th step (logged
  whatever `log_every`) and the last have a `sharpness` (`sharpness`), off
  the clock too.

  With a time budget, the run is also evaluated on a grid of seconds
  (`time_grid`): the row of grid point t (`time_point_s` t, NaN on other
  rows) evaluates the parameters the run held at t seconds, those of the
  last step finished by then, so every method is compared at the same
  seconds whatever its step time. Each step then waits for its result, so
  that the clock is read when the step is done.

  With `cfg.batch_growth_steps` the batch grows along `batch_schedule`
  (rows gain `batch_size`, the size of update s), every size's programs
  compiled before the clock starts. With `cfg.average_decay` ξ the run
  keeps, on the clock, the running average of its iterates (ξ times the
  average plus 1 - ξ times the new iterate) and evaluates both: columns
  `*_iterate` and `*_average`, and the usual columns hold the lower of the
  two, as Martens & Grosse (2015, sec. 13) report (a model's state is the
  iterate's).

  A non-finite loss ends the run; its last row has `diverged` true.
  `on_step(step, params, model_state)` is called, off the clock, after
  each of `at_steps` steps. With a `mesh` of several devices (the
  optimizer's), every batch is split over them.

  A model with state (batch norm) has it moved on after every step by
  `Problem.next_model_state` at the step's starting parameters and batch,
  on the clock: the running averages the step's forward pass would keep,
  from a forward pass of their own (the optimizers' steps know nothing of
  model state, so every method pays the same pass).

  Raises:
    FloatingPointError: when the run diverges before a step of `at_steps`.
  """
  num_steps, log_every, eval_every = (
    cfg.num_steps,
    cfg.log_every,
    cfg.eval_every,
  )
  budget = cfg.budget_s
  grid = time_grid(cfg)
  at_steps = set(at_steps)
  dtype = jax.tree.leaves(params)[0].dtype
  size_of = batch_schedule(
    problem.batch_size,
    len(problem.data.x_train),
    cfg.batch_growth_steps,
    cfg.batch_ladder,
  )
  batches = problem.batches(
    seed=data_seed, dtype=dtype, sizes=map(size_of, itertools.count(1))
  )
  evaluate = evaluator(problem, cfg, dtype)
  every = cfg.sharpness_every
  sharp = None if every is None else sharpness(problem, cfg, dtype)
  if mesh is None or mesh.size == 1:
    # One device: the arrays stay as JAX places them. Put on a one-device
    # mesh, the step's outputs would carry its sharding while the
    # optimizer's initial state does not, and every kind of step would
    # compile a second time, on the clock, once the state had been through
    # a step.
    place = lambda batch: batch
  else:
    place = lambda batch: devices.split(batch, mesh, "problem.batch_size")
    params = devices.replicate(params, mesh)
  first = place(next(batches))
  opt_state = optimizer.init(params, first, rng)
  # One batch of every size the schedule reaches, so that every program
  # is compiled before the clock starts.
  growth = min(num_steps, cfg.batch_growth_steps or 1)
  later = sorted({size_of(k) for k in range(1, growth + 1)} - {size_of(1)})
  warm = [first] + [
    place(next(problem.batches(batch_size=size, seed=data_seed, dtype=dtype)))
    for size in later
  ]
  compile_s = sum(
    compile_steps(optimizer, params, opt_state, batch, rng) for batch in warm
  )
  model_state = problem.init_model_state(dtype)
  start_compile = time.perf_counter()
  if problem.has_state:
    advance = jax.jit(problem.next_model_state)
    for batch in warm:
      jax.block_until_ready(advance(params, model_state, batch[0]))
  decay = cfg.average_decay
  if decay is not None:
    average = jax.jit(
      lambda mean, new: jax.tree.map(
        lambda m, p: decay * m + (1 - decay) * p, mean, new
      )
    )
    jax.block_until_ready(average(params, params))
  compile_s += time.perf_counter() - start_compile
  mean = params  # the iterates' running average (with average_decay)
  if on_step is not None and 0 in at_steps:
    on_step(0, params, model_state)

  def scores_of(params, mean, model_state):
    own = evaluate(params, model_state)
    if decay is None:
      return own
    averaged = evaluate(mean, model_state)
    # The lower of the two, as Martens & Grosse (2015, sec. 13) report.
    return {
      **{k: float(np.minimum(v, averaged[k])) for k, v in own.items()},
      **{f"{k}_iterate": v for k, v in own.items()},
      **{f"{k}_average": v for k, v in averaged.items()},
    }

  def row(step, wall_s, batch_loss, scores, time_point_s=np.nan, at=None):
    """A row; given its parameters `at`, their sharpness (if measured)."""
    checked = [
      v for v in (batch_loss, scores.get("train_loss")) if v is not None
    ]
    return dict(
      step=step,
      wall_s=wall_s,
      compile_s=compile_s,
      batch_loss=batch_loss,
      **scores,
      time_point_s=time_point_s,
      diverged=not np.all(np.isfinite(checked)),
      **(
        {}
        if sharp is None
        else dict(sharpness=np.nan if at is None else sharp(at))
      ),
      **(
        {}
        if cfg.batch_growth_steps is None
        else dict(batch_size=size_of(max(step, 1)))
      ),
    )

  start_scores = scores_of(params, mean, model_state)
  rows = [row(0, 0.0, None, start_scores, 0.0 if grid else np.nan, at=params)]
  # The last step done: (step, params, mean, model state, seconds, scores).
  held = (0, params, mean, model_state, 0.0, start_scores)
  elapsed, batch, next_point = 0.0, first, 0
  # The bar stays when it ends: its elapsed seconds and rate, and the
  # step a diverged run stopped at.
  for step in tqdm(
    range(1, num_steps + 1), desc="training", disable=not progress, leave=True
  ):
    start = time.perf_counter()
    key = jax.random.fold_in(rng, step)
    if problem.has_state:
      model_state = advance(params, model_state, batch[0])
    params, opt_state, loss = optimizer.step(params, opt_state, batch, key)
    if decay is not None:
      mean = average(mean, params)
    sharp_due = every is not None and step % every == 0
    logged = step % log_every == 0 or step == num_steps or sharp_due
    if logged or budget is not None:
      loss = float(jax.block_until_ready((mean, loss))[1])  # waits for both
    elapsed += time.perf_counter() - start
    # Grid points this step ran past: the parameters held there are the
    # previous step's.
    while next_point < len(grid) and elapsed >= grid[next_point]:
      done, kept, kept_mean, kept_state, wall, scores = held
      if scores is None:
        scores = scores_of(kept, kept_mean, kept_state)
        held = (done, kept, kept_mean, kept_state, wall, scores)
      rows.append(row(done, wall, None, scores, grid[next_point]))
      next_point += 1
    last = step == num_steps or (budget is not None and elapsed >= budget)
    if logged or last:
      evaluated = step % eval_every == 0 or last
      scores = scores_of(params, mean, model_state) if evaluated else {}
      at = params if sharp_due or last else None
      rows.append(row(step, elapsed, loss, scores, at=at))
      held = (
        step,
        params,
        mean,
        model_state,
        elapsed,
        scores if evaluated else None,
      )
      if last and step < num_steps:  # the time budget is spent
        missed = sorted(s for s in at_steps if s > step)
        if missed:
          raise ValueError(
            f"measure.training.budget_s={budget} ran out at step {step}, "
            f"before the steps {missed} to measure at: raise the budget."
          )
        break
      if rows[-1]["diverged"]:
        failure = getattr(optimizer, "failure", lambda state: None)(opt_state)
        if failure:
          raise FloatingPointError(failure)
        missed = sorted(s for s in at_steps if s >= step)
        if missed:
          raise FloatingPointError(
            f"The training loss is not finite at step {step}, so there are "
            f"no parameters to measure at steps {missed}: lower the "
            "learning rate or raise the damping."
          )
        break
    else:
      held = (step, params, mean, model_state, elapsed, None)
    if on_step is not None and step in at_steps:
      on_step(step, params, model_state)
    batch = place(next(batches))
  # A run that stopped before its budget holds its last parameters from
  # then on.
  rows += [dict(rows[-1], time_point_s=t) for t in grid[next_point:]]
  return rows
