"""Conv EKFAC's scalings: per example (George et al., NeurIPS 2018, the
default) against brute-force per-example gradients, and per location
(selectable) as before (float64)."""

import dataclasses
import functools

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest

from curvbench import config
from curvbench.approximations import CURVATURES
from estimators import utils
from estimators.blocks import kronecker
from estimators.blocks.eigenbasis import Conv2DEKFAC, DenseEKFAC
from tests import groundtruth as gt
from tests.estimators.blocks.test_blocks import (
  conv_layer,
  fitted,
  make_case,
  to_dense,
)
from tests.estimators.blocks.test_ekfac import (
  in_matrix_layout,
  matrix_order,
  per_row_curvature,
  rows,
  state_basis,
)
from tests.estimators.curvature.test_curvature import estimate
from tests.groundtruth import random_normal

jax.config.update("jax_enable_x64", True)

TOL = dict(rtol=1e-8, atol=1e-10)

# name: (format, stride, padding, bias, batch, samples); 4x4x2 inputs, 3x3
# kernels, 3 output channels. Every case has at least as many patches as
# patch entries, so the factors' eigenbases are unique up to sign.
CASES = {
  "nhwc_s1_same": ("NHWC", 1, "SAME", True, 3, 2),
  "nchw_s2_same_nobias": ("NCHW", 2, "SAME", False, 5, 1),
  "nhwc_s1_valid": ("NHWC", 1, "VALID", True, 5, 2),
}


def conv_case(name):
  """(layer, tag equation, estimation data, S x B per-example curvature)."""
  fmt, strides, padding, bias, batch, samples = CASES[name]
  layer, register = conv_layer(fmt, strides, padding)
  kshape = (3, 3, 2, 3) if fmt == "NHWC" else (3, 2, 3, 3)
  xshape = (batch, 4, 4, 2) if fmt == "NHWC" else (batch, 2, 4, 4)
  params = (random_normal(1, *kshape),) + (
    (random_normal(2, 3),) if bias else ()
  )
  eqn, data, c = make_case(
    layer, register, random_normal(3, *xshape), params, samples=samples
  )
  return layer, eqn, data, c


def per_example_gradients(layer, block, data):
  """`(S, B, P)` gradients of `<dy_sn, layer(x_n)>`, in the block's matrix
  layout (`vec` of the `(input_size, output_size)` matrix)."""
  (x,), (dy,), params = data["inputs"], data["outputs_tangent"], data["params"]

  def grad(xn, dyn):
    g = jax.grad(lambda p: jnp.vdot(dyn, layer(xn[None], p)[0]))(params)
    return utils.flatten_arrays(g)

  g = jax.vmap(jax.vmap(grad), (None, 0))(x, dy)
  return np.asarray(g)[..., matrix_order(block)]


def brute_force_basis(block, data):
  """`U_A ⊗ U_G` from eigh of K-FAC's factors built from explicit patches
  (the factors' scales do not change their eigenvectors)."""
  x, dy = rows(block, data)
  dy = dy.reshape(-1, dy.shape[-1])
  return np.kron(np.linalg.eigh(x.T @ x)[1], np.linalg.eigh(dy.T @ dy)[1])


def frobenius(a, b):
  return np.linalg.norm(a - b)


@pytest.mark.parametrize("name", list(CASES))
def test_per_example_scalings_equal_brute_force(name):
  layer, eqn, data, c = conv_case(name)
  block, state, _, _ = fitted(Conv2DEKFAC, (eqn, data, c))
  assert block.scalings == "per_example"
  got = in_matrix_layout(block, to_dense(block, state))
  g = per_example_gradients(layer, block, data)
  batch = g.shape[1]
  q = brute_force_basis(block, data)
  # Each example's gradient in the basis, squared, summed over samples,
  # averaged over examples.
  s = np.sum(np.square(g @ q), axis=(0, 1)) / batch
  want = q @ np.diag(s) @ q.T
  np.testing.assert_allclose(got, want, **TOL)
  # The stored scalings are in the state's basis, scaled by 1/L like
  # K-FAC's conv factors.
  q = state_basis(state)
  np.testing.assert_allclose(
    block.fixed_scale() * np.asarray(state.scalings.value).reshape(-1),
    np.sum(np.square(g @ q), axis=(0, 1)) / batch,
    **TOL,
  )


@pytest.mark.parametrize("name", list(CASES))
def test_per_example_scalings_are_frobenius_optimal(name):
  layer, eqn, data, c = conv_case(name)
  block, state, _, _ = fitted(Conv2DEKFAC, (eqn, data, c))
  g = per_example_gradients(layer, block, data).reshape(-1, block.dim)
  f = g.T @ g / data["inputs"][0].shape[0]  # mean per-example outer product
  np.testing.assert_allclose(f, in_matrix_layout(block, c), **TOL)
  q, scale = state_basis(state), block.fixed_scale()
  s = scale * np.asarray(state.scalings.value).reshape(-1)
  # ||F - Q diag(s) Qᵀ|| = ||QᵀFQ - diag(s)||: least at s = diag(QᵀFQ).
  np.testing.assert_allclose(s, np.diag(q.T @ f @ q), **TOL)
  ekfac = in_matrix_layout(block, to_dense(block, state))
  best = frobenius(f, ekfac)
  rng = np.random.default_rng(0)
  for eps in (1e-4, 1e-2, 1.0):
    for _ in range(10):
      d = rng.normal(size=s.shape)
      d *= eps * np.linalg.norm(s) / np.linalg.norm(d)
      assert frobenius(f, q @ np.diag(s + d) @ q.T) > best
  # K-FAC and per-location EKFAC are diagonal in the same basis, so no
  # nearer; per location differs here (several locations per example).
  for cls in (
    kronecker.Conv2DTwoKroneckerFactored,
    functools.partial(Conv2DEKFAC, scalings="per_location"),
  ):
    other, other_state, _, _ = fitted(cls, (eqn, data, c))
    other = in_matrix_layout(other, to_dense(other, other_state))
    assert best <= frobenius(f, other) * (1 + 1e-12)
    assert not np.allclose(other, ekfac, **TOL), cls


@pytest.mark.parametrize("name", list(CASES))
def test_per_location_scalings_fit_the_per_row_curvature(name):
  """The former default, unchanged: scalings from each location's row."""
  _, eqn, data, c = conv_case(name)
  block, state, _, _ = fitted(
    Conv2DEKFAC, (eqn, data, c), scalings="per_location"
  )
  assert block.scalings == "per_location"
  c_rows = per_row_curvature(block, data)
  q = state_basis(state)
  s = np.diag(q.T @ c_rows @ q)
  np.testing.assert_allclose(
    block.fixed_scale() * np.asarray(state.scalings.value).reshape(-1), s, **TOL
  )
  np.testing.assert_allclose(
    in_matrix_layout(block, to_dense(block, state)), q @ np.diag(s) @ q.T, **TOL
  )


def conv_block_in_matrix_layout(problem, mode, conv):
  """The conv block (kernel `k`, bias `kb`) of the estimator with `conv`
  blocks, the mode's exact curvature there, and the block's state."""
  est, state = estimate(
    problem, mode, {"conv2d_tag": conv, "dense_tag": DenseEKFAC}
  )
  j = next(
    j
    for j, b in enumerate(est.blocks)
    if isinstance(b, kronecker.Conv2DTwoKroneckerFactored)
  )
  marks = {
    n: jnp.full(jnp.shape(v), float(n in ("k", "kb")))
    for n, v in problem.params.items()
  }
  # Flat parameter order -> the block's matrix layout.
  layer = np.flatnonzero(jax.flatten_util.ravel_pytree(marks)[0])
  perm = layer[matrix_order(est.blocks[j])]
  # The block-diagonal estimator's empirical Fisher is the mean of
  # outer products over the batch size, as in KFAC-JAX.
  exact = (
    problem.empirical_fisher() / problem.batch[0].shape[0]
    if mode == "fisher_empirical"
    else problem.ggn()
  )
  pick = lambda m: np.asarray(m)[np.ix_(perm, perm)]
  return pick(est.to_dense_matrix(state)), pick(exact), state.blocks_states[j]


@pytest.mark.parametrize("mode", ["fisher_empirical", "ggn_exact"])
def test_estimator_conv_block_projects_the_mode_s_curvature(mode):
  """Through the estimator, the conv block is the matrix the mode gives
  exactly (empirical Fisher, exact GGN) on the layer, made diagonal in the
  block's basis; so it is at least as near to it as K-FAC is."""
  problem = gt.convnet(loss="softmax")
  got, f, block_state = conv_block_in_matrix_layout(problem, mode, Conv2DEKFAC)
  q = state_basis(block_state)
  np.testing.assert_allclose(
    got, q @ np.diag(np.diag(q.T @ f @ q)) @ q.T, **TOL
  )
  kfac, _, _ = conv_block_in_matrix_layout(
    problem, mode, kronecker.Conv2DTwoKroneckerFactored
  )
  assert frobenius(f, got) <= frobenius(f, kfac) * (1 + 1e-12)


def test_bad_scalings_are_refused_by_name():
  _, eqn, _, _ = conv_case("nhwc_s1_same")
  with pytest.raises(
    ValueError, match="scalings='per_batch'.*'per_example', 'per_location'"
  ):
    Conv2DEKFAC(eqn, "conv", scalings="per_batch")
  with pytest.raises(config.ConfigError, match="curvature.conv_scalings"):
    config.compose("curvature=ekfac", "curvature.conv_scalings=per_batch")


def test_harness_setting_picks_the_conv_scalings():
  _, eqn, _, _ = conv_case("nhwc_s1_same")
  for value in Conv2DEKFAC.SCALINGS:
    settings = dataclasses.replace(
      CURVATURES.defaults("ekfac"), conv_scalings=value
    )
    assert settings.blocks["conv2d_tag"](eqn, "conv").scalings == value
  assert CURVATURES.defaults("ekfac").conv_scalings == "per_example"
