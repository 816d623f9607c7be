"""Loss curves against steps and wall time, for K-FAC and first-order baselines.

`optimizer=kfac` with a block-diagonal curvature (kfac, diagonal, full or
identity blocks, any estimation mode) trains with `estimators.Optimizer`, the
full K-FAC algorithm (adaptive learning rate, momentum and damping unless the
config fixes them). With an exact curvature (explicit_exact / implicit_exact)
it falls back to SGD with momentum on `(C + damping I)^-1 g`, C the exact
matrix re-estimated every `curvature_update_every` steps. The baselines are
optax SGD-momentum and Adam. All optimizers see the same initial parameters
and the same batches in the same order.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

import estimators as kfac
from curvbench import curvatures

OPTIMIZERS = ("kfac", "sgd", "adam")


def _optax(cfg):
  lr = float(cfg.get("learning_rate", 1e-2))
  if cfg["name"] == "sgd":
    return optax.sgd(lr, momentum=float(cfg.get("momentum", 0.9)) or None)
  return optax.adam(lr, b1=float(cfg.get("b1", 0.9)),
                    b2=float(cfg.get("b2", 0.999)), eps=float(cfg.get("eps", 1e-8)))


class _Baseline:
  """An optax optimizer behind the interface the training loop uses."""

  def __init__(self, loss_fn, cfg):
    self.tx = _optax(cfg)

    def apply(params, opt_state, batch):
      loss, grads = jax.value_and_grad(loss_fn)(params, batch)
      updates, opt_state = self.tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    self.apply = jax.jit(apply)

  def init(self, params, batch, rng):
    del batch, rng
    return self.tx.init(params)

  def maintain(self, step, opt_state, params, batch, rng):
    del step, params, batch, rng
    return opt_state


class _KFAC:
  """`estimators.Optimizer` behind the interface the training loop uses."""

  def __init__(self, loss_fn, curvature, cfg):
    adaptive = bool(cfg.get("adaptive", True))
    self.fixed = {} if adaptive else dict(
        learning_rate=float(cfg.get("learning_rate", 1e-2)),
        momentum=float(cfg.get("momentum", 0.9)),
        damping=float(cfg.get("damping", 1e-3)))
    self.opt = kfac.Optimizer(
        jax.value_and_grad(loss_fn), l2_reg=float(cfg.get("l2_reg", 0.0)),
        use_adaptive_learning_rate=adaptive, use_adaptive_momentum=adaptive,
        use_adaptive_damping=adaptive,
        initial_damping=float(cfg.get("damping", 1e-3)) if adaptive else None,
        num_burnin_steps=int(cfg.get("num_burnin_steps", 5)),
        estimation_mode=curvature.mode,
        curvature_ema=float(cfg.get("ema_decay", 0.95)),
        inverse_update_period=int(cfg.get("inverse_update_every", 5)),
        layer_tag_to_block_ctor=curvatures.BLOCK_TYPES[curvature.block_type]
        or None)

  def init(self, params, batch, rng):
    return self.opt.init(params, rng, batch), rng, 0

  def maintain(self, step, opt_state, params, batch, rng):
    del step, params, batch, rng  # the optimizer keeps its own schedule
    return opt_state

  def apply(self, params, opt_state, batch):
    state, rng, step = opt_state
    params, state, stats = self.opt.step(
        params, state, jax.random.fold_in(rng, step), batch=batch,
        global_step_int=step, **self.fixed)
    return params, (state, rng, step + 1), stats["loss"]


class _PreconditionedSGD:
  """SGD-momentum preconditioned by an exact curvature (module docstring)."""

  def __init__(self, loss_fn, curvature, cfg):
    self.curvature = curvature
    self.lr = float(cfg.get("learning_rate", 1e-2))
    self.momentum = float(cfg.get("momentum", 0.9))
    self.damping = float(cfg.get("damping", 1e-3))
    self.decay = float(cfg.get("ema_decay", 0.95))
    self.every_curv = int(cfg.get("curvature_update_every", 1))
    self.every_inv = int(cfg.get("inverse_update_every", 5))
    self._update = jax.jit(curvature.update)
    self._refresh = jax.jit(lambda s: curvature.refresh(s, self.damping))

    def apply(params, opt_state, batch):
      curv_state, velocity = opt_state
      loss, grads = jax.value_and_grad(loss_fn)(params, batch)
      direction = curvature.precondition(curv_state, grads, self.damping)
      velocity = jax.tree.map(lambda v, d: self.momentum * v + d, velocity,
                              direction)
      params = jax.tree.map(lambda p, v: p - self.lr * v, params, velocity)
      return params, (curv_state, velocity), loss

    self.apply = jax.jit(apply)

  def init(self, params, batch, rng):
    state = self.curvature.init(rng, params, batch)
    state = self._refresh(self._update(state, params, batch, rng))
    return state, jax.tree.map(jnp.zeros_like, params)

  def maintain(self, step, opt_state, params, batch, rng):
    state, velocity = opt_state
    if step % self.every_curv == 0:
      state = self._update(state, params, batch, rng, self.decay,
                           1 - self.decay)
    if step % self.every_inv == 0:
      state = self._refresh(state)
    return state, velocity


def make_optimizer(loss_fn, cfg, curvature=None):
  name = cfg.get("name")
  if name not in OPTIMIZERS:
    raise ValueError(f"Unknown optimizer {name!r}; choose one of "
                     f"{', '.join(OPTIMIZERS)}.")
  if name == "kfac":
    if curvature is None:
      raise ValueError("The kfac optimizer needs a curvature config.")
    if curvature.estimator == "block_diagonal":
      return _KFAC(loss_fn, curvature, cfg)
    return _PreconditionedSGD(loss_fn, curvature, cfg)
  return _Baseline(loss_fn, cfg)


def run(problem, optimizer, params, cfg, rng, progress: bool = True):
  """Trains for `cfg.num_steps`; one row per logged step.

  Functions are compiled on a throw-away step before the clock starts, so
  `wall_s` is steady-state time (including the host syncs at logged steps).
  """
  num_steps = int(cfg.get("num_steps", 100))
  log_every, eval_every = int(cfg.get("log_every", 1)), int(
      cfg.get("eval_every", 10))
  dtype = jax.tree.leaves(params)[0].dtype
  seed = cfg.get("data_seed")
  batches = problem.batches(seed=problem.seed if seed is None else int(seed),
                            dtype=dtype)
  test_batch = problem.evaluation_batch(cfg.get("eval_size"), dtype=dtype)
  evaluate = jax.jit(problem.loss_fn)
  first = next(batches)
  opt_state = optimizer.init(params, first, rng)
  warm = optimizer.maintain(0, opt_state, params, first, rng)  # compiles
  jax.block_until_ready(optimizer.apply(params, warm, first))
  jax.block_until_ready(evaluate(params, test_batch))

  rows, elapsed, batch = [], 0.0, first
  for step in tqdm(range(num_steps), desc="training", disable=not progress,
                   leave=False):
    start = time.perf_counter()
    key = jax.random.fold_in(rng, step)
    opt_state = optimizer.maintain(step, opt_state, params, batch, key)
    params, opt_state, loss = optimizer.apply(params, opt_state, batch)
    last = step == num_steps - 1
    if step % log_every == 0 or last:
      loss = float(loss)
      elapsed += time.perf_counter() - start
      test = (float(evaluate(params, test_batch))
              if step % eval_every == 0 or last else np.nan)
      rows.append(dict(step=step, wall_s=elapsed, train_loss=loss,
                       test_loss=test))
      if not np.isfinite(loss):
        break
    else:
      elapsed += time.perf_counter() - start
    batch = next(batches)
  return rows
