"""K-FAC-expand and K-FAC-reduce against brute force (float64).

The exactness results of Eschenhagen et al. (NeurIPS 2023): on deep linear
networks with weight sharing and a squared-error loss, K-FAC-expand equals
the exact GGN blocks when the loss has one term per shared position and
K-FAC-reduce equals them when the positions are averaged before the loss;
each is off in the other setting.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import estimators as kfac
from estimators import utils
from estimators.blocks import kronecker
from estimators.blocks import weight_sharing as ws
from tests import groundtruth as gt
from tests.estimators.blocks.test_blocks import (
  TOL,
  conv_layer,
  dense_layer,
  fitted,
  flat,
  make_case,
  np_patches,
  random_vector,
  to_dense,
)

B, R = 3, 4
WEIGHT = 0.5  # squared-error weight 0.5: the loss Hessian is the identity


def _squared(z, t):
  return WEIGHT * jnp.sum((t - z) ** 2)


def _problem(layers, params, x, out_shape, reduce, groups):
  """A gt.Problem for `layers(p, x, tag)`; the loss on its outputs, or on
  their average over the positions (axes 1 .. -2) when `reduce`."""

  def forward(p, x, tag=False):
    z = layers(p, x, tag)
    return jnp.mean(z, axis=tuple(range(1, z.ndim - 1))) if reduce else z

  t_shape = (x.shape[0], out_shape[-1]) if reduce else (x.shape[0],) + out_shape
  t = gt.random_normal(9, *t_shape)

  def tagged(p, batch):
    x, t = batch
    z = kfac.register_squared_error_loss(forward(p, x, True), t, weight=WEIGHT)
    return jnp.mean(jax.vmap(_squared)(z, t))

  problem = gt.Problem(tagged, forward, _squared, params, (x, t))
  return problem, groups


def linear_net(reduce):
  """Two shared dense layers with biases on inputs (B, R, 3)."""
  params = {
    "w1": gt.random_normal(1, 3, 5),
    "b1": gt.random_normal(2, 5),
    "w2": gt.random_normal(3, 5, 2),
    "b2": gt.random_normal(4, 2),
  }

  def layers(p, x, tag):
    h = x @ p["w1"] + p["b1"]
    if tag:
      h = kfac.register_repeated_dense(h, x, p["w1"], p["b1"])
    z = h @ p["w2"] + p["b2"]
    if tag:
      z = kfac.register_repeated_dense(z, h, p["w2"], p["b2"])
    return z

  return _problem(
    layers,
    params,
    gt.random_normal(5, B, R, 3),
    (R, 2),
    reduce,
    [["w1", "b1"], ["w2", "b2"]],
  )


def linear_conv(reduce):
  """One NHWC convolution with bias, stride 2 and SAME padding."""
  params = {"k": gt.random_normal(1, 3, 3, 2, 3), "kb": gt.random_normal(2, 3)}

  def layers(p, x, tag):
    y = lax.conv_general_dilated(
      x, p["k"], (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    y = y + p["kb"]
    if tag:
      y = kfac.register_conv2d(
        y, x, p["k"], p["kb"], window_strides=2, padding="SAME"
      )
    return y

  return _problem(
    layers,
    params,
    gt.random_normal(5, B, 5, 5, 2),
    (3, 3, 3),
    reduce,
    [["k", "kb"]],
  )


def _kfac_dense(problem, tag, ctor):
  est = kfac.BlockDiagonalCurvature(
    problem.tagged, layer_tag_to_block_ctor={tag: ctor}
  )
  dense = _estimate(est, problem)
  assert all(type(b) is ctor for b in est.blocks)
  return dense


def _estimate(est, problem):
  """`est`'s dense matrix for the problem's batch in mode ggn_exact."""
  # One program: eager dispatch would compile every operation.
  run = jax.jit(lambda args: gt.one_batch_dense(est, args, B))
  return np.asarray(run((problem.params, problem.batch)))


def _exact_ggn(problem):
  """The brute-force GGN, mean_b J_bᵀ H J_b from jax.jacobian."""
  return np.asarray(jax.jit(problem.ggn)())


def _blocks(problem, groups, matrix):
  """The diagonal blocks of `matrix` for the parameter groups."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(problem.params)
  owner = np.concatenate(
    [
      np.full(np.size(v), jax.tree_util.keystr(path)[2:-2])
      for path, v in leaves
    ]
  )
  return [matrix[np.ix_(np.isin(owner, g), np.isin(owner, g))] for g in groups]


SETTINGS = {
  "dense": (
    linear_net,
    "repeated_dense_tag",
    ws.RepeatedDenseKFACExpand,
    ws.RepeatedDenseKFACReduce,
  ),
  "conv": (linear_conv, "conv2d_tag", ws.Conv2DKFACExpand, ws.Conv2DKFACReduce),
}


@pytest.mark.parametrize("reduce", [False, True], ids=["expand", "reduce"])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_matching_variant_is_exact_on_linear_networks(name, reduce):
  make, tag, expand_cls, reduce_cls = SETTINGS[name]
  problem, groups = make(reduce)
  exact = _blocks(problem, groups, _exact_ggn(problem))
  right, wrong = (
    (reduce_cls, expand_cls) if reduce else (expand_cls, reduce_cls)
  )
  for got, want in zip(
    _blocks(problem, groups, _kfac_dense(problem, tag, right)), exact
  ):
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-10)
  for got, want in zip(
    _blocks(problem, groups, _kfac_dense(problem, tag, wrong)), exact
  ):
    assert np.linalg.norm(got - want) > 0.05 * np.linalg.norm(want)


def test_expand_aliases_and_scales():
  expand = kronecker.RepeatedDenseTwoKroneckerFactored
  assert ws.RepeatedDenseKFACExpand is expand
  assert ws.Conv2DKFACExpand is kronecker.Conv2DTwoKroneckerFactored
  eqn = make_case(
    dense_layer,
    kfac.register_repeated_dense,
    gt.random_normal(3, B, 2, 3, 4),
    (gt.random_normal(1, 4, 2),),
  )[0]
  block = ws.RepeatedDenseKFACReduce(eqn, "d")
  assert block.num_repeats == 6 and block.fixed_scale() == 1
  assert (block.input_size(), block.output_size()) == (4, 2)


# --- factor statistics on random data, S > 1 samples --------------------------


def _reduced_factors(x_mean, dy_sum, batch):
  """A and G of K-FAC-reduce from per-example means and per-(sample,
  example) sums; x_mean already carries the bias column."""
  g = dy_sum.reshape(-1, dy_sum.shape[-1])
  return x_mean.T @ x_mean / batch, g.T @ g / batch


@pytest.mark.parametrize("bias", [True, False])
def test_repeated_dense_reduce_factors(bias):
  x = gt.random_normal(3, B, 2, 3, 4)
  params = (gt.random_normal(1, 4, 2),) + (
    (gt.random_normal(2, 2),) if bias else ()
  )
  case = make_case(
    dense_layer, kfac.register_repeated_dense, x, params, samples=3
  )
  block, state, data, _ = fitted(ws.RepeatedDenseKFACReduce, case)
  xn, dy = np.asarray(x), np.asarray(data["outputs_tangent"][0])
  assert dy.shape == (3, B, 2, 3, 2)
  x_mean = xn.reshape(B, 6, 4).mean(axis=1)
  if bias:
    x_mean = np.concatenate([x_mean, np.ones((B, 1))], axis=1)
  a, g = _reduced_factors(x_mean, dy.reshape(3, B, 6, 2).sum(axis=2), B)
  np.testing.assert_allclose(state.inputs_factor.value, a, **TOL)
  np.testing.assert_allclose(state.outputs_factor.value, g, **TOL)
  np.testing.assert_allclose(to_dense(block, state), np.kron(a, g), **TOL)


CONV_CASES = {  # (format, strides, padding)
  "nhwc_s2_same": ("NHWC", 2, "SAME"),
  "nchw_s2_same": ("NCHW", 2, "SAME"),
  "nchw_s1_valid": ("NCHW", 1, "VALID"),
}


@pytest.mark.parametrize("name", list(CONV_CASES))
def test_conv_reduce_factors(name):
  fmt, strides, padding = CONV_CASES[name]
  layer, register = conv_layer(fmt, strides, padding)
  kshape = (3, 3, 2, 3) if fmt == "NHWC" else (3, 2, 3, 3)
  xshape = (B, 5, 6, 2) if fmt == "NHWC" else (B, 2, 5, 6)
  x = gt.random_normal(3, *xshape)
  case = make_case(
    layer,
    register,
    x,
    (gt.random_normal(1, *kshape), gt.random_normal(2, 3)),
    samples=3,
  )
  block, state, data, _ = fitted(ws.Conv2DKFACReduce, case)
  assert block.fixed_scale() == 1
  xn, dy = np.asarray(x), np.asarray(data["outputs_tangent"][0])
  if fmt == "NCHW":
    xn, dy = xn.transpose(0, 2, 3, 1), dy.transpose(0, 1, 3, 4, 2)
  pads = lax.padtype_to_pads((5, 6), (3, 3), (strides,) * 2, padding)
  patches = np_patches(xn, 3, strides, pads).reshape(B, -1, 18)
  assert patches.shape[1] == block.num_locations
  v = random_vector(block)
  mean, out = jax.jit(
    lambda x, v: (
      block.mean_patches(x),
      block.multiply(state, v, 0.0, True, False),
    )
  )(x, v)
  np.testing.assert_allclose(mean, patches.mean(axis=1), **TOL)
  x_mean = np.concatenate([patches.mean(axis=1), np.ones((B, 1))], axis=1)
  a, g = _reduced_factors(x_mean, dy.sum(axis=(2, 3)), B)
  np.testing.assert_allclose(state.inputs_factor.value, a, **TOL)
  np.testing.assert_allclose(state.outputs_factor.value, g, **TOL)
  # multiply applies A V G with V the (kh*kw*C_in + 1, C_out) matrix.
  kernel = np.asarray(v[0])
  if fmt == "NCHW":
    kernel = kernel.transpose(2, 3, 1, 0)
  vm = np.concatenate([kernel.reshape(-1, 3), np.asarray(v[1])[None]])
  got = np.asarray(out[0])
  if fmt == "NCHW":
    got = got.transpose(2, 3, 1, 0)
  expected = a @ vm @ g
  np.testing.assert_allclose(got.reshape(-1, 3), expected[:-1], **TOL)
  np.testing.assert_allclose(out[1], expected[-1], **TOL)


def test_reduce_equals_kfac_without_sharing():
  """With one position per example both variants are ordinary K-FAC."""
  x = gt.random_normal(3, B, 1, 4)
  case = make_case(
    dense_layer,
    kfac.register_repeated_dense,
    x,
    (gt.random_normal(1, 4, 2), gt.random_normal(2, 2)),
  )
  reduce_block, reduce_state, _, _ = fitted(ws.RepeatedDenseKFACReduce, case)
  expand_block, expand_state, _, _ = fitted(ws.RepeatedDenseKFACExpand, case)
  np.testing.assert_allclose(
    to_dense(reduce_block, reduce_state),
    to_dense(expand_block, expand_state),
    **TOL,
  )


# --- products -----------------------------------------------------------------

DAMPING = 0.3
REDUCE_CASES = {
  "dense": (
    ws.RepeatedDenseKFACReduce,
    lambda: make_case(
      dense_layer,
      kfac.register_repeated_dense,
      gt.random_normal(3, B, R, 4),
      (gt.random_normal(1, 4, 2), gt.random_normal(2, 2)),
    ),
  ),
  "conv": (
    ws.Conv2DKFACReduce,
    lambda: make_case(
      *conv_layer("NHWC", 1, "SAME"),
      gt.random_normal(3, B, 4, 4, 2),
      (gt.random_normal(1, 3, 3, 2, 3), gt.random_normal(2, 3)),
    ),
  ),
}


@pytest.mark.parametrize("name", list(REDUCE_CASES))
def test_inverse_of_multiply_is_identity(name):
  cls, case = REDUCE_CASES[name]
  block, state, _, _ = fitted(cls, case(), exact=[-1], approx=[1, -1])
  v = random_vector(block)

  @jax.jit
  def run(state, v):
    cached = block.update_cache(state, DAMPING, -1, [1, -1], False)
    out = {}
    for exact in (True, False):
      product = block.multiply(cached, v, DAMPING, exact, False)
      for use_cached in (True, False):
        back = block.multiply_inverse(
          cached, product, DAMPING, exact, use_cached
        )
        out[f"{exact} {use_cached}"] = utils.flatten_arrays(back)
    out["dense"] = block.to_dense_matrix(state)
    out["product"] = utils.flatten_arrays(
      block.multiply(state, v, DAMPING, True, False)
    )
    return out

  out = run(state, v)
  for exact in (True, False):
    for use_cached in (True, False):
      np.testing.assert_allclose(
        out[f"{exact} {use_cached}"], flat(v), rtol=1e-8, atol=1e-10
      )
  m = np.asarray(out["dense"])
  np.testing.assert_allclose(
    out["product"],
    (m + DAMPING * np.eye(len(m))) @ flat(v),
    rtol=1e-9,
    atol=1e-10,
  )
