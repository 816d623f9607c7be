"""Per-phase timing of a curvature estimator, compile time kept separate.

Each phase is a jitted function. Its compile time (trace + lower + compile)
is measured once; then the compiled function runs `warmup` times untimed and
`repeats` times timed, each call ended by `block_until_ready`. The unit is a
plain gradient step (`grad` + SGD update): ratios are to its median.
"""

from __future__ import annotations

import platform
import time

import jax
import numpy as np
from tqdm.auto import tqdm

PHASES = ("grad_step", "curvature_update", "cache_update", "precondition",
          "full_step")


def environment() -> dict:
  device = jax.devices()[0]
  return dict(device_kind=device.device_kind, platform=device.platform,
              num_devices=jax.device_count(), jax_version=jax.__version__,
              python=platform.python_version(), host=platform.node())


def time_function(fn, args, warmup: int = 2, repeats: int = 10) -> dict:
  """Compile time, first-call time and steady-state statistics of `fn(*args)`."""
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
  times = np.asarray(times)
  return dict(compile_s=compile_s, first_call_s=first_s,
              median_s=float(np.median(times)), min_s=float(times.min()),
              q25_s=float(np.quantile(times, 0.25)),
              q75_s=float(np.quantile(times, 0.75)), repeats=len(times))


def phase_functions(loss_fn, curvature, damping: float, learning_rate: float):
  """The jittable function of each phase, keyed by phase name."""

  def grad_step(params, batch):
    grads = jax.grad(loss_fn)(params, batch)
    return jax.tree.map(lambda p, g: p - learning_rate * g, params, grads)

  def full_step(state, params, batch, rng):
    grads = jax.grad(loss_fn)(params, batch)
    state = curvature.update(state, params, batch, rng, 0.95, 0.05)
    state = curvature.refresh(state, damping)
    direction = curvature.precondition(state, grads, damping)
    new = jax.tree.map(lambda p, d: p - learning_rate * d, params, direction)
    return new, state

  return dict(
      grad_step=grad_step,
      curvature_update=lambda s, p, b, r: curvature.update(s, p, b, r),
      cache_update=lambda s: curvature.refresh(s, damping),
      precondition=lambda s, g: curvature.precondition(s, g, damping),
      full_step=full_step)


def measure(loss_fn, curvature, params, batch, cfg, rng,
            progress: bool = False) -> list[dict]:
  """One row per phase; see the module docstring."""
  damping = float(cfg["damping"])
  fns = phase_functions(loss_fn, curvature, damping,
                        float(cfg["learning_rate"]))
  state = curvature.init(rng, params, batch)
  state = jax.jit(curvature.update)(state, params, batch, rng)
  grads = jax.grad(loss_fn)(params, batch)
  args = dict(grad_step=(params, batch),
              curvature_update=(state, params, batch, rng),
              cache_update=(state,), precondition=(
                  jax.jit(curvature.refresh)(state, damping), grads),
              full_step=(state, params, batch, rng))
  phases = list(cfg["phases"])
  unknown = set(phases) - set(PHASES)
  if unknown:
    raise ValueError(f"Unknown timing phases {sorted(unknown)}; choose from "
                     f"{', '.join(PHASES)}.")
  if "grad_step" not in phases:
    phases.insert(0, "grad_step")
  rows = []
  for phase in tqdm(phases, desc="timing", disable=not progress, leave=False):
    stats = time_function(fns[phase], args[phase], int(cfg["warmup"]),
                          int(cfg["repeats"]))
    rows.append(dict(phase=phase, **stats))
  unit = rows[phases.index("grad_step")]["median_s"]
  for row in rows:
    row["ratio_to_grad_step"] = row["median_s"] / unit
  return rows
