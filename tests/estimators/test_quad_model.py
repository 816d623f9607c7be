"""The learning rate and momentum minimise the quadratic model over the
span of the two update directions (Martens & Grosse 2015, sec. 7),
checked by brute force, including where the two directions are parallel
and a 2x2 solve returns rounding noise."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from estimators import quad_model


def _model(curvature, gradient, directions, damping):
  """(Q, b) of q(w) = ½ wᵀ Q w + bᵀ w over the span of `directions`."""
  v = jnp.stack(directions, axis=1)
  quad = v.T @ curvature @ v + damping * v.T @ v
  return quad, v.T @ gradient


def _value(quad, linear, w):
  return float(0.5 * w @ quad @ w + linear @ w)


def _problem(dtype, n=20, seed=0):
  rng = np.random.default_rng(seed)
  root = rng.standard_normal((n, n))
  curvature = jnp.asarray(root @ root.T / n, dtype)
  return curvature, jnp.asarray(rng.standard_normal(n), dtype), rng


def test_the_coefficients_solve_the_model_where_the_directions_differ():
  with jax.enable_x64():
    curvature, gradient, rng = _problem(jnp.float64)
    directions = [jnp.asarray(rng.standard_normal(20)) for _ in range(2)]
    quad, linear = _model(curvature, gradient, directions, 1e-3)
    w = quad_model.solve_coefficients(quad, linear, None, None, False)
    np.testing.assert_allclose(w, np.linalg.solve(quad, -linear), rtol=1e-10)
    # On the first step the velocity is zero: the learning rate alone.
    first = quad_model.solve_coefficients(quad, linear, None, None, True)
    np.testing.assert_allclose(first, [-linear[0] / quad[0, 0], 0.0])


@pytest.mark.parametrize("angle", [0.0, 1e-6, 1e-4, 0.3])
def test_nearly_parallel_directions_do_no_worse_than_the_learning_rate(angle):
  """The velocity (nearly) along the new direction, as when training has
  settled: in float32 the 2x2 system is then singular to rounding. The
  coefficients stay finite and the model, in float64, falls at least as
  far as along the new direction alone; where the directions are
  distinguishable (angle 0.3) it reaches the minimum over their span."""
  curvature, gradient, rng = _problem(jnp.float32)
  u = rng.standard_normal(20)
  other = rng.standard_normal(20)
  other -= other @ u / (u @ u) * u
  other *= np.linalg.norm(u) / np.linalg.norm(other)
  velocity = -3.0 * (np.cos(angle) * u + np.sin(angle) * other)
  directions = [jnp.asarray(d, jnp.float32) for d in (u, velocity)]
  quad, linear = _model(curvature, gradient, directions, 1e-3)
  w = np.asarray(quad_model.solve_coefficients(quad, linear, None, None, False))
  assert np.isfinite(w).all() and np.abs(w).max() < 1e3, w
  with jax.enable_x64():
    exact_quad, exact_linear = _model(
      jnp.asarray(curvature, jnp.float64),
      jnp.asarray(gradient, jnp.float64),
      [jnp.asarray(d, jnp.float64) for d in (u, velocity)],
      1e-3,
    )
    reached = _value(exact_quad, exact_linear, jnp.asarray(w, jnp.float64))
    alone = -0.5 * float(exact_linear[0] ** 2 / exact_quad[0, 0])
    span = _value(
      exact_quad, exact_linear, np.linalg.solve(exact_quad, -exact_linear)
    )
  assert reached <= alone + 1e-4 * abs(alone), (reached, alone)
  if angle > 0.1:
    assert span < alone  # the momentum's direction helps
    assert reached <= span + 1e-4 * abs(span), (reached, span)
