"""Per-phase costs: compile apart from run, one compile per function and
argument shapes, XLA's memory figure."""

import math

import jax
import jax.numpy as jnp
import numpy as np

from curvbench.core.costs import Costs, device_peak_bytes, flops


def test_costs_compile_once_per_phase_and_record_each_call():
  """A phase called again with arguments of the same shapes, from this
  `Costs` or another sharing its programs (the next step or sample of a
  measurement), reuses its program; new shapes compile."""
  lines = []
  programs = {}
  costs = Costs(log=lines.append, programs=programs, step=3)
  make = lambda: lambda x: x @ x  # a new function of the same code each time
  square = make()
  a = jnp.ones((64, 64))
  np.testing.assert_allclose(costs.call("square", square, a), a @ a)
  costs.call("square", make(), 2 * a)
  costs.call("square", square, jnp.ones((128, 128)))
  first, again, bigger = costs.rows
  assert all(
    r["phase"] == "square" and r["step"] == 3 and r["run_s"] > 0
    for r in costs.rows
  )
  assert first["compile_s"] > 10 * again["compile_s"]  # reused, not rebuilt
  assert bigger["compile_s"] > 10 * again["compile_s"]  # new shapes compile
  # Arguments and output of a 128 x 128 float32 product at least.
  assert bigger["program_bytes"] >= 2 * 128 * 128 * 4
  later = Costs(log=lines.append, programs=programs, step=4)
  later.call("square", square, a)
  assert later.rows[0]["compile_s"] < first["compile_s"] / 10
  # A phase of another name is another program.
  later.call("cube", lambda x: x @ x @ x, a)
  assert later.rows[1]["compile_s"] > 10 * later.rows[0]["compile_s"]
  # Quick phases are summed in one line; a slow one gets its own.
  assert lines == []
  costs.summary()
  assert len(lines) == 1 and lines[0].startswith(
    "[curvbench] step=3: 3 phases, "
  )
  Costs.SLOW_S, slow = 0.0, Costs.SLOW_S
  try:
    Costs(log=lines.append, step=5).call("slow", square, a)
  finally:
    Costs.SLOW_S = slow
  assert "step=5: slow:" in lines[-1]


class _Device:
  def __init__(self, stats):
    self.stats = stats

  def memory_stats(self):
    return self.stats


def test_device_peak_is_the_highest_of_the_devices_used():
  assert (
    device_peak_bytes(
      [_Device({"peak_bytes_in_use": 5}), _Device({"peak_bytes_in_use": 9})]
    )
    == 9.0
  )
  # One device without statistics leaves the peak unknown, not too low.
  assert math.isnan(
    device_peak_bytes([_Device({"peak_bytes_in_use": 5}), _Device(None)])
  )
  assert math.isnan(device_peak_bytes())  # the CPU keeps none


def test_flops_are_xlas_count_of_the_program():
  a, b = jnp.ones((8, 16)), jnp.ones((16, 4))
  matmul = jax.jit(lambda x, y: x @ y).lower(a, b).compile()
  assert flops(matmul) == 2 * 8 * 16 * 4
