"""The machine's load while something is timed: how much of the CPUs other
processes used, how much this process used, and the load average.

A timing taken while other processes compete for the cores reads slower,
and a ratio of two timings taken under changing load is not the ratio of
their costs; so every timing record carries the load measured over its
own window (`Monitor`), and a timing can wait for a quiet machine or
refuse a busy one (`settle`).

Figures come from the kernel's CPU accounting (psutil): the busy time of
all CPUs (user, nice, system, interrupts and time stolen by a hypervisor)
less this process's own CPU time is what others used. In a container the
kernel counts the whole host's CPUs, so other tenants of the host count as
others: they compete for the same cores.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import cast

import psutil

# Busy fields of the system's CPU times (guest time is inside user and nice).
BUSY = ("user", "nice", "system", "irq", "softirq", "steal")


class MachineBusy(ValueError):
  """Other processes used more of the CPUs than a timing allows."""


@dataclasses.dataclass(frozen=True)
class Load:
  """The load over a window of `seconds`: `others_share`, the fraction of
  the machine's CPU time (`cpu_count` cores) that other processes used;
  `process_cores`, the cores this process kept busy on average; and the
  one-minute `load_average` at the window's end (NaN where the system
  keeps none)."""

  seconds: float
  cpu_count: int
  others_share: float
  process_cores: float
  load_average: float

  def columns(self, threshold: float) -> dict:
    """The load as a timing record's columns; `contended` where others
    used more than `threshold` of the CPUs."""
    return dict(
      load_window_s=self.seconds,
      cpu_count=self.cpu_count,
      others_cpu_share=self.others_share,
      process_cores=self.process_cores,
      load_average=self.load_average,
      contended=bool(self.others_share > threshold),
    )

  def describe(self) -> str:
    """The load in words: the other processes' share of the CPUs over
    the window, and the load average."""
    return (
      f"other processes used {100 * self.others_share:.0f} % of the "
      f"{self.cpu_count} CPUs over {self.seconds:.1f} s (load average "
      f"{self.load_average:.2f})"
    )


def _busy(times) -> float:
  return sum(getattr(times, field, 0.0) for field in BUSY)


def _own(process: psutil.Process) -> float:
  times = process.cpu_times()
  return times.user + times.system


def _load_average() -> float:
  try:
    return float(os.getloadavg()[0])
  except (AttributeError, OSError):
    return math.nan


class Monitor:
  """Measures the load over the block it wraps: `with Monitor() as m:
  ...`, then `m.load`.

  The kernel counts CPU time in ticks of 10 ms, so a block of a few
  milliseconds (the timed rounds of a tiny model) would read as an idle
  machine whatever ran beside it. A block shorter than `min_seconds` is
  measured over a window stretched to `min_seconds` after it, this process
  idle for the rest; the window's length is in the result.
  """

  def __init__(self, min_seconds: float = 1.0):
    self.min_seconds = min_seconds

  def __enter__(self) -> Monitor:
    self._process = psutil.Process()
    self._start = (
      time.perf_counter(),
      _busy(psutil.cpu_times()),
      _own(self._process),
    )
    self.load: Load | None = None  # until the block is left
    return self

  def __exit__(self, *exc) -> None:
    wall, busy, own = self._start
    time.sleep(max(self.min_seconds - (time.perf_counter() - wall), 0.0))
    wall = time.perf_counter() - wall
    busy = _busy(psutil.cpu_times()) - busy
    own = _own(self._process) - own
    cpus = psutil.cpu_count() or 1
    # The kernel's counters tick every 10 ms: clip what round-off leaves.
    others = min(max(busy - own, 0.0) / max(wall * cpus, 1e-9), 1.0)
    self.load = Load(
      seconds=wall,
      cpu_count=cpus,
      others_share=others,
      process_cores=own / max(wall, 1e-9),
      load_average=_load_average(),
    )


def sample(seconds: float = 1.0) -> Load:
  """The load over the next `seconds`, this process idle."""
  with Monitor(min_seconds=seconds) as monitor:
    pass
  return cast(Load, monitor.load)  # set on leaving the block


def settle(
  when_busy: str, threshold: float, wait_s: float, log=None
) -> Load | None:
  """The load before a timing, as `when_busy` asks of a busy machine (one
  whose other processes use more than `threshold` of the CPUs):
  'measure' goes on without looking (the timing's own `Monitor` records
  the load it ran under); 'wait' looks every second until the machine is
  quiet or `wait_s` seconds have passed (then goes on, the timing
  flagged); 'refuse' looks once and raises `MachineBusy` where it is busy.

  Raises:
    MachineBusy: naming the load, with `when_busy='refuse'`.
  """
  if when_busy == "measure":
    return None
  load = sample()
  deadline = time.monotonic() + wait_s
  while (
    when_busy == "wait"
    and load.others_share > threshold
    and time.monotonic() < deadline
  ):
    if log is not None:
      log(f"[curvbench] waiting for a quiet machine: {load.describe()}")
    load = sample()
  if when_busy == "refuse" and load.others_share > threshold:
    raise MachineBusy(
      f"the machine is busy: {load.describe()}, more than "
      f"measure.timing.busy_share={threshold:g} allows. Timing now would "
      "measure the other processes as much as this one: stop them, or "
      "set measure.timing.when_busy=wait (waits up to "
      "measure.timing.busy_wait_s) or =measure (times anyway, every "
      "figure flagged)."
    )
  return load


__all__ = ["Load", "MachineBusy", "Monitor", "sample", "settle"]
