"""Per-phase costs: compile apart from run, one compile per function and
argument shapes, XLA's memory figure."""

import math

import jax.numpy as jnp
import numpy as np

from curvbench.costs import Costs, device_peak_bytes


def test_costs_compile_once_and_record_each_phase():
  lines = []
  costs = Costs(log=lines.append, step=3)
  square = lambda x: x @ x
  a = jnp.ones((64, 64))
  np.testing.assert_allclose(costs.call("first", square, a), a @ a)
  costs.call("again", square, 2 * a)
  costs.call("bigger", square, jnp.ones((128, 128)))
  first, again, bigger = costs.rows
  assert [r["phase"] for r in costs.rows] == ["first", "again", "bigger"]
  assert all(r["step"] == 3 and r["run_s"] > 0 for r in costs.rows)
  assert first["compile_s"] > 10 * again["compile_s"]  # reused, not rebuilt
  assert bigger["compile_s"] > 10 * again["compile_s"]  # new shapes compile
  # Arguments and output of a 128 x 128 float32 product at least.
  assert bigger["program_bytes"] >= 2 * 128 * 128 * 4
  assert len(lines) == 3 and "step=3: first:" in lines[0]


class _Device:
  def __init__(self, stats):
    self.stats = stats

  def memory_stats(self):
    return self.stats


def test_device_peak_is_the_highest_of_the_devices_used():
  assert device_peak_bytes(
      [_Device({"peak_bytes_in_use": 5}),
       _Device({"peak_bytes_in_use": 9})]) == 9.0
  # One device without statistics leaves the peak unknown, not too low.
  assert math.isnan(device_peak_bytes(
      [_Device({"peak_bytes_in_use": 5}), _Device(None)]))
  assert math.isnan(device_peak_bytes())  # the CPU keeps none
