"""Per-phase costs: compile apart from run, one compile per function and
argument shapes, XLA's memory figure."""

import jax.numpy as jnp
import numpy as np

from curvbench.costs import Costs


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
