"""What a measurement costs: compile time, run time and memory, per phase.

`Costs.call(phase, fn, *args)` compiles `fn` ahead of time and runs it once,
so compile time is recorded apart from run time. Memory is XLA's own figure
for the compiled program (arguments + outputs + temporaries, which holds on
every backend), and the device's peak where the runtime reports one (GPU,
TPU; not the CPU).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax


def _device_peak_bytes() -> float:
  stats = jax.local_devices()[0].memory_stats() or {}
  return float(stats.get("peak_bytes_in_use", float("nan")))


def _signature(args) -> tuple:
  leaves, tree = jax.tree.flatten(args)
  return tree, tuple((jax.numpy.shape(x), jax.numpy.result_type(x))
                     for x in leaves)


class Costs:
  """Collects one row per phase: `phase`, `compile_s`, `run_s`,
  `program_bytes` and `device_peak_bytes`, plus the constant `columns`.

  A function called again with arguments of the same shapes reuses its
  compiled program (`compile_s` 0): keep the function object to benefit.
  """

  def __init__(self, log: Callable[[str], None] | None = None, **columns):
    self.columns = columns
    self.rows: list[dict] = []
    self.log = log  # called with a line per phase, e.g. `print`
    self._compiled = {}

  def call(self, phase: str, fn: Callable, *args):
    """`jax.jit(fn)(*args)`, timed; `args` are arrays or pytrees of them."""
    key = (fn, _signature(args))
    start = time.perf_counter()
    if key not in self._compiled:
      self._compiled[key] = jax.jit(fn).lower(*args).compile()
    compiled = self._compiled[key]
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    out = jax.block_until_ready(compiled(*args))
    run_s = time.perf_counter() - start
    memory = compiled.memory_analysis()
    program = (float(memory.argument_size_in_bytes
                     + memory.output_size_in_bytes
                     + memory.temp_size_in_bytes)
               if memory is not None else float("nan"))
    self.rows.append(dict(self.columns, phase=phase, compile_s=compile_s,
                          run_s=run_s, program_bytes=program,
                          device_peak_bytes=_device_peak_bytes()))
    if self.log:
      where = ", ".join(f"{k}={v}" for k, v in self.columns.items())
      self.log(f"[curvbench] {where}: {phase}: {run_s:.1f} s (compile "
               f"{compile_s:.1f} s, {program / 2 ** 30:.2f} GiB)")
    return out
