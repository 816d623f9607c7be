"""K-FAC-expand and K-FAC-reduce are exact in their own settings (float64).

Eschenhagen et al., "Kronecker-Factored Approximate Curvature for Modern
Neural Network Architectures" (NeurIPS 2023), show that on a deep linear
network whose dense layers are shared over the positions of each example,
with a squared-error (Gaussian) loss, the GGN's diagonal block of a shared
layer is

- K-FAC-expand's, when the loss has a term for every position (the
  *expand* setting: positions act as extra examples), and
- K-FAC-reduce's, when the positions are aggregated (averaged or summed)
  after the last shared layer, before the loss (the *reduce* setting),

because the derivative of the network's output w.r.t. a layer's output is
then one matrix for every example and position. Neither is exact in the
other's setting.

Here a transformer-shaped network without attention or nonlinearities,
inputs `(B, T, D)`, is registered automatically (no hand tags, as in
`problems/models/transformer.py`) and measured through the harness's
`curvature=kfac` (K-FAC-expand on shared layers) and `curvature=kfac_reduce`
in mode `ggn_exact`; each layer's block is compared with the brute-force
block `mean_b J_bᵀ H_b J_b`, `J_b` the Jacobian (`jax.jacobian`) of example
b's network outputs w.r.t. that layer's parameters and `H_b` the Hessian of
its loss w.r.t. those outputs.

Normalisation: the loss is the mean over the batch of a per-example loss,
`WEIGHT * sum ||target - output||²` summed over every position and feature
in the expand setting. K-FAC-expand averages its factors over the `B * T`
(example, position) pairs and scales the block by `T`; K-FAC-reduce averages
over the `B` examples only (inputs averaged, output tangents summed over
positions) and is unscaled. With these scales both are exact at `B = 1` and
`B > 1`; a missing factor `T` would show as a block off by `T`.
"""

import functools

import haiku as hk
import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest

import estimators
from curvbench import approximations
from curvbench.core import curvatures

T, D = 4, 3  # positions and input features
WEIGHT = 0.7  # the loss Hessian is 2 * WEIGHT * I, not the identity
# setting -> (the harness curvature exact there, the one that is not)
SETTINGS = {
  "expand": ("kfac", "kfac_reduce"),
  "reduce_mean": ("kfac_reduce", "kfac"),
  "reduce_sum": ("kfac_reduce", "kfac"),
}
SHARED = ("shared_0", "shared_1")


def network(setting):
  """Two dense layers shared over the positions of `x: (B, T, D)`; in the
  expand setting they give per-position outputs `(B, T, 2)`, in a reduce
  setting the positions are averaged or summed and a plain dense layer
  ("head") gives `(B, 2)`."""

  def forward(x):
    h = hk.Linear(5, name="shared_0")(x)
    if setting == "expand":
      return hk.Linear(2, name="shared_1")(h)
    h = hk.Linear(4, name="shared_1")(h)
    h = jnp.mean(h, axis=1) if setting == "reduce_mean" else jnp.sum(h, 1)
    return hk.Linear(2, name="head")(h)

  return hk.without_apply_rng(hk.transform(forward))


def per_example_loss(z, t):
  return WEIGHT * jnp.sum((t - z) ** 2)


def make_problem(setting, batch_size):
  """The network's float64 parameters, a batch `(x, targets)` and the loss
  function `loss_fn(params, batch)` with the squared error registered."""
  net = network(setting)
  keys = jax.random.split(jax.random.PRNGKey(batch_size), 4)
  x = jax.random.normal(keys[0], (batch_size, T, D), jnp.float64)
  flat, unravel = jax.flatten_util.ravel_pytree(net.init(keys[1], x))
  # Haiku starts biases at zero; perturbed, they enter the factors.
  params = unravel(flat + 0.3 * jax.random.normal(keys[2], flat.shape))
  t = jax.random.normal(keys[3], net.apply(params, x).shape, jnp.float64)

  def loss_fn(params, batch):
    x, t = batch
    z = estimators.register_squared_error_loss(
      net.apply(params, x), t, weight=WEIGHT
    )
    return jnp.mean(jax.vmap(per_example_loss)(z, t))

  return params, (x, t), loss_fn


@functools.partial(jax.jit, static_argnums=2)
def brute_force_blocks(params, batch, setting):
  """Per layer, `mean_b J_bᵀ H_b J_b` over that layer's flattened
  parameters (in `ravel_pytree` order)."""
  net = network(setting)
  x, t = batch
  blocks = {}
  for layer in params:
    flat, unravel = jax.flatten_util.ravel_pytree(params[layer])

    def outputs(w, xb, layer=layer, unravel=unravel):
      return net.apply({**params, layer: unravel(w)}, xb[None])[0]

    def one(xb, tb, flat=flat, outputs=outputs):
      jac = jax.jacobian(outputs)(flat, xb).reshape(-1, flat.size)
      z = outputs(flat, xb)
      hess = jax.hessian(per_example_loss)(z, tb).reshape(z.size, z.size)
      return jac.T @ hess @ jac

    blocks[layer] = jnp.mean(jax.vmap(one)(x, t), axis=0)
  return blocks


def estimate(name, params, batch, loss_fn):
  """The harness curvature `name` in mode ggn_exact estimated on one
  batch, and its dense matrix."""
  curvature = approximations.make({"name": name, "mode": "ggn_exact"}, loss_fn)
  assert curvature.mode == "ggn_exact"
  rng = jax.random.PRNGKey(0)
  state = curvature.init(rng, params, batch)

  @jax.jit  # one program: eager dispatch would compile every operation
  def dense(state, params, batch):
    state = curvature.update(state, params, batch, rng)
    return curvature.to_dense(state)

  return curvature, np.asarray(dense(state, params, batch))


def leaf_layers(params):
  """The layer (module name) of each parameter leaf, in flattening order."""
  paths = jax.tree_util.tree_flatten_with_path(params)[0]
  return [path[0].key for path, _ in paths]


def block_of_layer(estimator, params):
  """The estimator's block of each layer (after tracing), by layer name."""
  which = jax.tree.leaves(estimator.params_block_index)
  return {
    layer: estimator.blocks[i] for layer, i in zip(leaf_layers(params), which)
  }


def relative_error(got, want):
  return np.linalg.norm(got - want) / np.linalg.norm(want)


@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_matching_variant_is_exact_and_the_other_is_not(setting, batch_size):
  params, batch, loss_fn = make_problem(setting, batch_size)
  exact = {
    k: np.asarray(v)
    for k, v in brute_force_blocks(params, batch, setting).items()
  }
  # Each layer's indices in the ravel_pytree order of the dense matrices.
  indices = dict(curvatures.layer_blocks(loss_fn, params, batch))
  assert sorted(indices) == sorted(params), (
    f"automatic registration found {sorted(indices)}"
  )
  right, wrong = SETTINGS[setting]
  for name, is_exact in ((right, True), (wrong, False)):
    curvature, dense = estimate(name, params, batch, loss_fn)
    blocks = block_of_layer(curvature.estimator, params)
    for layer, block in blocks.items():
      shared = layer in SHARED
      # K-FAC-expand is the library's default for shared dense layers.
      want_cls = (
        estimators.DenseTwoKroneckerFactored
        if not shared
        else estimators.RepeatedDenseKFACReduce
        if name == "kfac_reduce"
        else estimators.RepeatedDenseKFACExpand
      )
      assert type(block) is want_cls, (layer, name, type(block))
      if shared:
        assert block.num_repeats == T
        assert block.fixed_scale() == (1 if name == "kfac_reduce" else T)
    for layer, rows in indices.items():
      got, want = dense[np.ix_(rows, rows)], exact[layer]
      off = np.delete(dense[rows], rows, axis=1)
      np.testing.assert_array_equal(off, 0.0)  # block-diagonal
      if is_exact or layer not in SHARED:  # the head is plain K-FAC: exact
        np.testing.assert_allclose(
          got, want, rtol=1e-10, atol=1e-10 * np.abs(want).max()
        )
      else:
        assert relative_error(got, want) > 0.05, (setting, name, layer)
