"""What a measurement costs: compile time, run time and memory, per phase.

`Costs.call(phase, fn, *args)` compiles `fn` ahead of time and runs it once,
so compile time is recorded apart from run time. Memory is XLA's own figure
for the compiled program (arguments + outputs + temporaries, which holds on
every backend), and the device's peak where the runtime reports one (GPU,
TPU; not the CPU). `memory_columns` gives these figures for any compiled
programs; the timing measurement records them too.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import jax

from curvbench.core import devices


def program_bytes(compiled: jax.stages.Compiled) -> float:
  """XLA's memory of a compiled program: arguments + outputs + temporaries
  (NaN where the backend gives no analysis)."""
  memory = compiled.memory_analysis()
  if memory is None:
    return float("nan")
  return float(
    memory.argument_size_in_bytes
    + memory.output_size_in_bytes
    + memory.temp_size_in_bytes
  )


def flops(compiled: jax.stages.Compiled) -> float:
  """XLA's count of the floating-point operations one call of a compiled
  program does (NaN where the backend gives no cost analysis): the
  arithmetic a timing can be held against, whatever the machine's speed.
  Library calls XLA does not compile itself (LAPACK's eigendecompositions
  and factorizations on the CPU) count as none, and a loop's body counts
  once whatever its trip count: meaningful for loop-free programs such as
  a training step on one batch."""
  try:
    analysis = compiled.cost_analysis()
  except Exception:  # noqa: BLE001 - backends without the analysis raise
    return float("nan")
  if isinstance(analysis, list):  # older jax: one dict per device program
    analysis = analysis[0] if analysis else None
  return float((analysis or {}).get("flops", float("nan")))


def device_peak_bytes(used: Sequence[jax.Device] | None = None) -> float:
  """The most bytes any of the `used` devices (default: those the run
  measures on, `devices.in_use()`) has held since the process started (NaN
  where the runtime keeps no statistics, as on the CPU)."""
  peaks = [
    (d.memory_stats() or {}).get("peak_bytes_in_use", math.nan)
    for d in (devices.in_use() if used is None else used)
  ]
  return math.nan if any(map(math.isnan, peaks)) else float(max(peaks))


def memory_source() -> str:
  """'device' where the runtime reports device memory statistics (then
  `device_peak_bytes` is measured), else 'xla_analysis' (only
  `program_bytes`, XLA's figure, is known)."""
  return _source(device_peak_bytes())


def _source(peak: float) -> str:
  return "xla_analysis" if math.isnan(peak) else "device"


def memory_columns(*compiled: jax.stages.Compiled) -> dict:
  """`program_bytes` (the largest of the programs), `device_peak_bytes`
  (now) and `memory_source`: the memory columns of a record row."""
  peak = device_peak_bytes()
  return dict(
    program_bytes=max(map(program_bytes, compiled)),
    device_peak_bytes=peak,
    memory_source=_source(peak),
  )


def without_passthrough(fn: Callable) -> Callable:
  """`fn` returning only its output leaves that are not its inputs.

  `jax.jit` copies an input returned unchanged into an output buffer;
  compiled this way, a program's memory figure leaves out copies that a
  caller which forwards those inputs itself (as `estimators` does for its
  optimizer step) never makes.
  """

  def computed(*args, **kwargs):
    inputs = {id(x) for x in jax.tree.leaves((args, kwargs))}
    return [
      x for x in jax.tree.leaves(fn(*args, **kwargs)) if id(x) not in inputs
    ]

  return computed


def _signature(args) -> tuple:
  leaves, tree = jax.tree.flatten(args)
  return tree, tuple(
    (jax.numpy.shape(x), jax.numpy.result_type(x)) for x in leaves
  )


class Costs:
  """Collects one row per phase: `phase`, `compile_s`, `run_s`, the
  `memory_columns`, plus the constant `columns`.

  A phase called again with arguments of the same shapes reuses its
  compiled program (`compile_s` 0): programs are kept by phase name, code
  and argument shapes in `programs`, which several `Costs` may share (a
  measurement's steps and samples), so a phase compiles once per run.
  A phase's name must therefore say what differs between its programs
  (the matrix, the block), as the names the measurements give do.

  `log` (e.g. `print`) gets a line for each phase slower than `SLOW_S`
  and, from `summary`, one for everything recorded.
  """

  SLOW_S = 5.0

  def __init__(
    self,
    log: Callable[[str], None] | None = None,
    programs: dict | None = None,
    **columns,
  ):
    self.columns = columns
    self.rows: list[dict] = []
    self.log = log
    self.programs = {} if programs is None else programs

  def _where(self) -> str:
    return ", ".join(f"{k}={v}" for k, v in self.columns.items())

  def record(self, phase: str, run_s: float) -> None:
    """A row for work done outside `call` (no program, no memory figure)."""
    self.rows.append(
      dict(
        self.columns,
        phase=phase,
        compile_s=0.0,
        run_s=run_s,
        program_bytes=math.nan,
        device_peak_bytes=math.nan,
        memory_source=memory_source(),
      )
    )

  def call(self, phase: str, fn: Callable, *args):
    """`jax.jit(fn)(*args)`, timed; `args` are arrays or pytrees of them."""
    key = (phase, getattr(fn, "__code__", fn), _signature(args))
    start = time.perf_counter()
    if key not in self.programs:
      self.programs[key] = jax.jit(fn).lower(*args).compile()
    compiled = self.programs[key]
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    out = jax.block_until_ready(compiled(*args))
    run_s = time.perf_counter() - start
    memory = memory_columns(compiled)
    self.rows.append(
      dict(
        self.columns, phase=phase, compile_s=compile_s, run_s=run_s, **memory
      )
    )
    if self.log and compile_s + run_s >= self.SLOW_S:
      self.log(
        f"[curvbench] {self._where()}: {phase}: {run_s:.1f} s "
        f"(compile {compile_s:.1f} s, "
        f"{memory['program_bytes'] / 2**30:.2f} GiB)"
      )
    return out

  def summary(self, rows: list[dict] | None = None) -> None:
    """Logs one line for `rows` (default: the phases recorded here)."""
    rows = self.rows if rows is None else rows
    if not self.log or not rows:
      return
    run = sum(r["run_s"] for r in rows)
    compile_ = sum(r["compile_s"] for r in rows)
    largest = max(
      (r["program_bytes"] for r in rows if not math.isnan(r["program_bytes"])),
      default=math.nan,
    )
    self.log(
      f"[curvbench] {self._where()}: {len(rows)} phases, "
      f"{run:.1f} s (compile {compile_:.1f} s), largest program "
      f"{largest / 2**30:.2f} GiB"
    )
