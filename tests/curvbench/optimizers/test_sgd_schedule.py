"""SGD's momentum schedule (Sutskever et al. 2013) against its formula and a
hand-computed Nesterov run (float64: conftest enables x64)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from curvbench import config
from curvbench.components import SettingsError
from curvbench.core import training
from curvbench.optimizers.sgd import SGD, sutskever_momentum

A = np.diag([1.0, 0.3, 0.05])  # a quadratic's curvature, and its minimum
B = np.array([1.0, -2.0, 0.5])


def loss(params, batch):
  del batch
  w = params["w"]
  return 0.5 * w @ A @ w - B @ w


def train(sgd, steps):
  """`steps` updates from zero by `sgd` (SGD settings, or a transformation
  factory for `training.OptaxTrainer`): the parameters and the state."""
  trainer = (
    sgd.make(loss) if isinstance(sgd, SGD) else training.OptaxTrainer(loss, sgd)
  )
  params = {"w": jnp.zeros(3)}
  rng = jax.random.PRNGKey(0)
  state = trainer.init(params, None, rng)
  for _ in range(steps):
    params, state, _ = trainer.step(params, state, None, rng)
  return params, state


@pytest.mark.parametrize(
  "t,mu",
  [
    (0, 1 / 2),
    (249, 1 / 2),
    (250, 3 / 4),
    (749, 5 / 6),
    (750, 7 / 8),
    (1749, 13 / 14),
    (1750, 15 / 16),
    (10**6, 0.99),
  ],
)
def test_schedule_follows_the_formula(t, mu):
  schedule = sutskever_momentum(0.99)
  formula = min(1 - 2 ** (-1 - np.log2(t // 250 + 1)), 0.99)
  assert float(schedule(jnp.asarray(t, jnp.int32))) == pytest.approx(mu)
  assert formula == pytest.approx(mu)


def test_schedule_stops_at_its_cap():
  schedule = sutskever_momentum(0.8)
  assert [float(schedule(t)) for t in (0, 250, 499, 500, 5000)] == (
    pytest.approx([0.5, 0.75, 0.75, 0.8, 0.8])
  )


def test_nesterov_steps_equal_the_hand_computed_ones():
  """optax.trace with nesterov: v = g + mu v, step -lr (g + mu v), mu the
  schedule at the update's count; 760 updates pass 0.5, 0.75 and the cap."""
  lr, cap, steps = 0.1, 0.8, 760
  params, state = train(
    SGD(
      learning_rate=lr,
      momentum=cap,
      nesterov=True,
      momentum_schedule="sutskever2013",
    ),
    steps,
  )
  w, v = np.zeros(3), np.zeros(3)
  for t in range(steps):
    mu = min(1 - 0.5 / (t // 250 + 1), cap)
    g = A @ w - B
    v = g + mu * v
    w = w - lr * (g + mu * v)
  assert params["w"].dtype == jnp.float64
  np.testing.assert_allclose(params["w"], w, rtol=1e-12, atol=1e-14)
  assert int(state.count) == steps


def test_schedule_keeps_the_accumulator_dtype():
  _, state = train(
    SGD(
      momentum=0.9,
      nesterov=True,
      accumulator_dtype="bfloat16",
      momentum_schedule="sutskever2013",
    ),
    3,
  )
  trace = state.inner_state[0].trace["w"]
  assert trace.dtype == jnp.bfloat16 and np.all(np.isfinite(trace))


@pytest.mark.parametrize("nesterov", [False, True])
def test_constant_schedule_is_plain_optax_sgd(nesterov):
  sgd = SGD(learning_rate=0.1, momentum=0.9, nesterov=nesterov)
  plain = lambda batch, rng: optax.sgd(0.1, momentum=0.9, nesterov=nesterov)
  params, state = train(sgd, 20)
  expected, expected_state = train(plain, 20)
  np.testing.assert_array_equal(params["w"], expected["w"])
  assert jax.tree.structure(state) == jax.tree.structure(expected_state)


def test_schedule_without_momentum_is_refused_by_name():
  values = {
    "name": "sgd",
    "momentum": None,
    "momentum_schedule": "sutskever2013",
  }
  with pytest.raises(SettingsError, match="momentum_schedule"):
    SGD.from_values(values)
  with pytest.raises(ValueError, match="optimizer.momentum_schedule"):
    config.compose(
      "optimizer=sgd",
      "optimizer.momentum=null",
      "optimizer.momentum_schedule=sutskever2013",
    )
  with pytest.raises(ValueError, match="momentum_schedule"):
    SGD(momentum=None, momentum_schedule="sutskever2013").transformation()


def test_weight_decay_adds_lambda_theta_to_the_gradient_before_momentum():
  """By hand: v <- 0.9 v + (g + λθ), θ <- θ - η v, on the quadratic."""
  params, _ = train(SGD(learning_rate=0.1, momentum=0.9, weight_decay=0.05), 5)
  theta, velocity = np.zeros(3), np.zeros(3)
  for _ in range(5):
    velocity = 0.9 * velocity + (A @ theta - B) + 0.05 * theta
    theta = theta - 0.1 * velocity
  np.testing.assert_allclose(params["w"], theta, rtol=1e-12)
