"""The tracer (estimators.tracer): tag transforms and jaxpr processing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import estimators as kfac
from tests import groundtruth as gt


def test_loss_tags_linearize_equals_jvp_of_the_network_outputs():
  problem = gt.mlp()
  x = problem.batch[0]
  tangents = [
    jax.tree.map(lambda p, s=s: jnp.full_like(p, s) * p, problem.params)
    for s in (1.0, -0.5)
  ]
  losses, jvp = kfac.loss_tags_linearize(problem.tagged)(
    (problem.params, problem.batch)
  )
  outputs = problem.forward(problem.params, x)
  np.testing.assert_allclose(
    losses[0].parameter_dependants[0], outputs, rtol=1e-12
  )
  for v in tangents:
    _, expected = jax.jvp(
      lambda p: problem.forward(p, x), (problem.params,), (v,)
    )
    np.testing.assert_allclose(jvp(v)[0][0], expected, rtol=1e-10, atol=1e-12)


def test_a_transformation_unpacks_into_itself_and_the_jaxpr_extractor():
  """KFAC-JAX 0.0.8 returns `(transformed, extractor)`: both forms work."""
  problem = gt.mlp()
  args = (problem.params, problem.batch)
  v = jax.tree.map(jnp.ones_like, problem.params)
  u = [(jnp.ones_like(problem.forward(problem.params, problem.batch[0])),)]
  calls = {
    kfac.loss_tags_vjp: lambda f: f(args)[1](u),
    kfac.loss_tags_jvp: lambda f: f(args, v)[1],
    kfac.loss_tags_hvp: lambda f: f(args, v)[0],
  }
  for make, call in calls.items():
    unpacked, extractor = make(problem.tagged)
    direct = call(make(problem.tagged))
    for a, b in zip(jax.tree.leaves(direct), jax.tree.leaves(call(unpacked))):
      np.testing.assert_array_equal(a, b)
    processed = extractor(args)
    assert isinstance(processed, kfac.ProcessedJaxpr)
    assert len(processed.loss_tags) == 1


def test_layer_in_a_scan_with_unstacked_parameters_is_an_error():
  params = gt.layer_stack_params()

  def shared_weight(p, batch):
    def layer(h, _):
      return kfac.register_dense(h @ p["ws"][0], h, p["ws"][0]), None

    h, _ = lax.scan(layer, batch[0] @ p["w0"], None, length=2)
    return jnp.sum(kfac.register_softmax_cross_entropy_loss(h, batch[1]))

  with pytest.raises(kfac.TracingError, match="not a slice of a stacked leaf"):
    kfac.ProcessedJaxpr.make_from_func(
      shared_weight, (params, (np.ones((5, 4)), np.arange(5) % 3))
    )
