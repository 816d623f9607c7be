"""`utils.staging.stage`: jit without copying the inputs handed back."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from curvbench import approximations, config, optimizers
from curvbench.optimizers import kfac as kfac_trainer
from estimators.utils import staging
from tests.conftest import TINY


def _step(state, x, scale, refresh):
  # `state["cache"]` passes through unless refreshing; `state["count"]`
  # always changes; `x` comes back twice.
  cache = state["cache"] * scale if refresh else state["cache"]
  return {"cache": cache, "count": state["count"] + 1}, (x, x * 2, x), None


def _args():
  state = {"cache": jnp.arange(6.0).reshape(2, 3), "count": jnp.array(0)}
  return state, jnp.ones(3), jnp.array(3.0)


@pytest.mark.parametrize("refresh", [False, True])
def test_stage_equals_jit_and_hands_back_inputs_untouched(refresh):
  state, x, scale = _args()
  staged = staging.stage(_step, static_argnums=(3,))
  got = staged(state, x, scale, refresh)
  expected = jax.jit(_step, static_argnums=(3,))(state, x, scale, refresh)
  assert jax.tree.structure(got) == jax.tree.structure(expected)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    np.testing.assert_array_equal(a, b)
  new_state, (x0, x2, x1), none = got
  assert none is None
  assert x0 is x and x1 is x and x2 is not x
  assert (new_state["cache"] is state["cache"]) == (not refresh)


def test_stage_returns_arrays_for_python_and_numpy_inputs():
  staged = staging.stage(lambda a, b: (a, b))
  a, b = staged(2.5, np.ones(2))
  assert isinstance(a, jax.Array) and isinstance(b, jax.Array)
  assert float(a) == 2.5 and b.shape == (2,)


def test_stage_over_devices_with_pmap():
  n = jax.local_device_count()
  state, x, scale = _args()
  state, x, scale = jax.tree.map(
    lambda v: jnp.stack([v] * n), (state, x, scale)
  )
  staged = staging.stage(_step, static_argnums=(3,), pmap_axis_name="i")
  new_state, (x0, x2, _), _ = staged(state, x, scale, False)
  assert new_state["cache"] is state["cache"] and x0 is x
  np.testing.assert_array_equal(new_state["count"], np.ones(n))
  np.testing.assert_array_equal(x2, 2 * np.ones((n, 3)))


def test_target_platform_follows_the_default_device():
  # Without this, `jax.pmap` inside `jax.default_device(cpu)` would run on
  # a GPU when the machine has one.
  assert staging.target_platform() == jax.default_backend()
  with jax.default_device(jax.devices("cpu")[0]):
    assert staging.target_platform() == "cpu"
  with jax.default_device("cpu"):
    assert staging.target_platform() == "cpu"


def test_pmap_stage_runs_on_the_default_devices_platform():
  staged = staging.stage(lambda x: jax.lax.psum(x, "i") * 2, pmap_axis_name="i")
  with jax.default_device(jax.devices("cpu")[0]):
    out = staged(jnp.ones((2, 3)))
  np.testing.assert_array_equal(out, np.full((2, 3), 4.0))
  assert {d.platform for d in out.devices()} == {"cpu"}


UNKNOWN = "xla_option_no_jaxlib_has"


def test_cpu_options_this_jaxlib_lacks_are_left_out():
  # The bad option and value really fail a compilation here.
  for bad in ({UNKNOWN: False}, {"xla_backend_optimization_level": "high"}):
    with pytest.raises(jax.errors.JaxRuntimeError, match="INVALID_ARGUMENT"):
      jax.jit(lambda x: x * 2, compiler_options=bad)(jnp.ones(2))
  options = {"xla_backend_optimization_level": 1, UNKNOWN: False}
  assert staging.supported_cpu_options(options) == {
    "xla_backend_optimization_level": 1
  }
  assert (
    staging.supported_cpu_options({"xla_backend_optimization_level": "high"})
    == {}
  )
  assert staging.supported_cpu_options({}) == {}


def test_stage_compiles_without_the_cpu_options_this_jaxlib_lacks():
  state, x, scale = _args()
  staged = staging.stage(
    _step, static_argnums=(3,), cpu_options={UNKNOWN: True}
  )
  got = staged(state, x, scale, True)
  expected = _step(state, x, scale, True)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    np.testing.assert_array_equal(a, b)


def test_kfac_memory_programs_compile_without_unknown_cpu_options(
  tiny, monkeypatch
):
  problem, params, batch = tiny
  monkeypatch.setattr(
    kfac_trainer,
    "QUICK_CPU_COMPILE",
    {**kfac_trainer.QUICK_CPU_COMPILE, UNKNOWN: True},
  )
  cfg = config.compose(
    *TINY, "optimizer=kfac", "optimizer.inverse_update_period=1"
  )
  curvature = approximations.make(config.plain(cfg.curvature), problem.loss_fn)
  trainer = optimizers.make(
    config.plain(cfg.optimizer), problem.loss_fn, curvature
  )
  rng = jax.random.PRNGKey(0)
  state = trainer.init(params, batch, rng)
  programs = trainer.compiled_programs(params, state, batch, rng)
  assert len(programs) == trainer.cycle
  assert len({id(x) for x in programs}) == len(trainer.kinds)
