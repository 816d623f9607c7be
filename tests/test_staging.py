"""`utils.staging.stage`: jit without copying the inputs handed back."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from estimators.utils import staging


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
  state, x, scale = jax.tree.map(lambda v: jnp.stack([v] * n),
                                 (state, x, scale))
  staged = staging.stage(_step, static_argnums=(3,), pmap_axis_name="i")
  new_state, (x0, x2, _), _ = staged(state, x, scale, False)
  assert new_state["cache"] is state["cache"] and x0 is x
  np.testing.assert_array_equal(new_state["count"], np.ones(n))
  np.testing.assert_array_equal(x2, 2 * np.ones((n, 3)))
