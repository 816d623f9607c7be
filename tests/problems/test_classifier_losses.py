"""Classifiers' losses: the one-hot squared loss of Cohen et al. (2021)
against its formula and its registered curvature against brute force, and
softmax cross-entropy still the default."""

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest

import problems
from curvbench.components import SettingsError
from curvbench.core import curvatures
from problems.base import one_hot_squared_error

TINY = dict(name="mlp", width=3, depth=1, batch_size=8)


def tiny(**settings):
  problem = problems.make(dict(TINY, **settings))
  params = problem.init_params(jax.random.PRNGKey(0), jnp.float64)
  return problem, params, problem.fixed_batch(dtype=np.float64)


def test_one_hot_squared_error_is_half_the_squared_distance_summed():
  rng = np.random.default_rng(0)
  outputs, labels = rng.normal(size=(7, 5)), rng.integers(0, 5, size=7)
  expected = np.mean(
    0.5 * np.sum((outputs - np.eye(5)[labels]) ** 2, axis=1)
  )  # summed over classes, averaged over examples
  np.testing.assert_allclose(
    one_hot_squared_error(jnp.asarray(outputs), jnp.asarray(labels)),
    expected,
    rtol=1e-14,
  )


@pytest.mark.parametrize("name", ["mlp", "convnet"])
def test_the_loss_setting_chooses_it_and_the_task_stays_classification(name):
  problem = problems.make(dict(name=name, loss="squared_error"))
  assert problem.loss_name == "one_hot_squared_error"
  assert problem.task == "classification"
  params = problem.init_params(jax.random.PRNGKey(1), jnp.float64)
  x, y = problem.evaluation_batch(50, np.float64, split="train")
  out = np.asarray(problem.outputs(params, x))
  np.testing.assert_allclose(
    problem.loss_fn(params, (x, y)),
    np.mean(0.5 * np.sum((out - np.eye(out.shape[1])[y]) ** 2, axis=1)),
    rtol=1e-12,
  )
  np.testing.assert_allclose(  # the misclassified share
    problem.error(params, (x, y)), np.mean(out.argmax(1) != y)
  )


@pytest.mark.parametrize("matrix_free", [False, True])
def test_its_registered_ggn_is_the_mean_of_jacobian_products(matrix_free):
  """The Hessian of the loss in the outputs is the identity, so the exact
  GGN is (1/N) sum_i J_i^T J_i."""
  problem, params, (x, y) = tiny(loss="squared_error")
  flat, unravel = jax.flatten_util.ravel_pytree(params)
  jac = jax.jacobian(lambda w: problem.net.apply(unravel(w), x))(flat)
  expected = np.einsum("ncp,ncq->pq", jac, jac) / len(x)
  ggn = curvatures.exact("ggn", problem.loss_fn, matrix_free=matrix_free)
  state = curvatures.estimate(ggn, jax.random.PRNGKey(0), params, (x, y))
  np.testing.assert_allclose(ggn.to_dense(state), expected, atol=1e-12)


@pytest.mark.parametrize("name", ["mlp", "convnet"])
def test_softmax_cross_entropy_stays_the_default_bit_for_bit(name):
  default = problems.make(dict(name=name))
  assert default.loss_name == "softmax_cross_entropy"
  params = default.init_params(jax.random.PRNGKey(2), jnp.float64)
  x, y = default.evaluation_batch(40, np.float64, split="train")
  log_p = jax.nn.log_softmax(default.net.apply(params, x))
  by_hand = -jnp.mean(jnp.take_along_axis(log_p, y[:, None], axis=1))
  assert np.asarray(default.loss_fn(params, (x, y))) == np.asarray(by_hand)
  explicit = problems.make(dict(name=name, loss="softmax_cross_entropy"))
  assert explicit.loss_fn(params, (x, y)) == default.loss_fn(params, (x, y))


def test_an_unknown_loss_is_refused_naming_the_choices():
  with pytest.raises(
    SettingsError,
    match="Unknown problem.loss 'mse'; choose one of "
    "softmax_cross_entropy, squared_error",
  ):
    problems.make(dict(name="mlp", loss="mse"))
