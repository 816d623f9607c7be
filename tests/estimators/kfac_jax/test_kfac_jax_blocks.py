"""KFAC-JAX 0.0.8's conv statistics helpers on our Conv2D blocks, checked in
float64 against brute force: per-example gradients from `jax.grad` and input
patches from `lax.conv_general_dilated_patches`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from estimators import blocks
from tests.groundtruth import conv2d_layer, random_normal

B = 3
TOL = dict(rtol=1e-9, atol=1e-11)

# (layout, strides, padding): both channel layouts, strides 1 and 2, and
# "SAME", "VALID" and explicit (uneven) padding.
CASES = [
  ("NHWC", 1, "SAME"),
  ("NHWC", 2, "VALID"),
  ("NHWC", 2, ((1, 0), (0, 2))),
  ("NCHW", 1, "VALID"),
  ("NCHW", 2, "SAME"),
]


def _case(fmt, strides, padding, bias=True):
  """(tag equation, x, params, dy, layer) for a 3x2 kernel, 2 -> 3 channels."""
  eqn, x, params, layer = conv2d_layer(fmt, strides, padding, bias, batch=B)
  dy = random_normal(4, *jax.eval_shape(layer, x, params).shape)
  return eqn, x, params, dy, layer


def _example_grads(layer, x, params, dy):
  """Per-example parameter gradients: `(B, *shape)` per parameter."""

  def one(xi, dyi):
    return jax.grad(lambda p: jnp.vdot(dyi, layer(xi[None], p)[0]))(params)

  return jax.vmap(one)(x, dy)


def _patches(fmt, x, kernel_hw, strides, padding):
  """`(B * locations, kh * kw * C)` patches, in the `(kh, kw, C)` order."""
  rhs = "HWIO" if fmt == "NHWC" else "OIHW"
  p = lax.conv_general_dilated_patches(
    x, kernel_hw, (strides,) * 2, padding, dimension_numbers=(fmt, rhs, "NHWC")
  )
  c = x.shape[-1] if fmt == "NHWC" else x.shape[1]
  p = p.reshape(p.shape[:3] + (c,) + tuple(kernel_hw))  # features: (C, kh, kw)
  p = jnp.moveaxis(p, 3, -1)
  return p.reshape(-1, kernel_hw[0] * kernel_hw[1] * c)


def _channels_last(fmt, a):
  return a if fmt == "NHWC" else jnp.moveaxis(a, 1, -1)


@pytest.mark.parametrize("fmt,strides,padding", CASES)
def test_conv2d_tangent_squared(fmt, strides, padding):
  eqn, x, params, dy, layer = _case(fmt, strides, padding)
  block = blocks.Conv2DDiagonal(eqn, "conv")
  grads = _example_grads(layer, x, params, dy)
  for i in range(B):
    got = block.conv2d_tangent_squared(x[i], dy[i])
    np.testing.assert_allclose(got, grads[0][i] ** 2, **TOL)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("fmt,strides,padding", CASES)
def test_conv2d_tangent_outer_product(fmt, strides, padding, bias):
  eqn, x, params, dy, layer = _case(fmt, strides, padding, bias)
  block = blocks.Conv2DFull(eqn, "conv")
  grads = _example_grads(layer, x, params, dy)
  for i in range(B):
    g = jnp.concatenate([a[i].reshape(-1) for a in grads])
    got = block.conv2d_tangent_outer_product(x[i], dy[i])
    np.testing.assert_allclose(got, jnp.outer(g, g), **TOL)


@pytest.mark.parametrize("fmt,strides,padding", CASES)
def test_x_squared_spatial_norms(fmt, strides, padding):
  eqn, x, _, dy, _ = _case(fmt, strides, padding)
  block = blocks.Conv2DTNT(eqn, "conv")
  p = _patches(fmt, x, block.weights_spatial_shape, strides, padding)
  want = jnp.sum(p * p, axis=1).reshape(_channels_last(fmt, dy).shape[:3])
  got = block.x_squared_spatial_norms(x)
  assert got.shape[block.outputs_channel_index] == 1
  np.testing.assert_allclose(_channels_last(fmt, got)[..., 0], want, **TOL)


@pytest.mark.parametrize("explicit", [True, False])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("fmt,strides,padding", CASES)
def test_compute_inputs_stats(fmt, strides, padding, bias, weighted, explicit):
  eqn, x, _, dy, _ = _case(fmt, strides, padding, bias)
  block = blocks.Conv2DTwoKroneckerFactored(eqn, "conv")
  rows = _patches(fmt, x, block.weights_spatial_shape, strides, padding)
  if bias:
    rows = jnp.concatenate([rows, jnp.ones((rows.shape[0], 1))], axis=1)
  locations = _channels_last(fmt, dy).shape[:3]  # (B, out_h, out_w)
  w = jnp.abs(random_normal(5, *locations)) if weighted else None
  weights = jnp.ones(rows.shape[0]) if w is None else w.reshape(-1)
  want = (rows * weights[:, None]).T @ rows / rows.shape[0]
  # Both ways of forming the moments: explicit patches and the offset loop.
  old = blocks.get_max_parallel_elements()
  blocks.set_max_parallel_elements(10**9 if explicit else 1)
  try:
    got = block.compute_inputs_stats(x, weighting_array=w)
  finally:
    blocks.set_max_parallel_elements(old)
  assert got.shape == (block.input_size(),) * 2
  np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize("fmt,strides,padding", CASES)
def test_compute_outputs_stats(fmt, strides, padding):
  eqn, _, _, dy, _ = _case(fmt, strides, padding)
  block = blocks.Conv2DTwoKroneckerFactored(eqn, "conv")
  rows = _channels_last(fmt, dy).reshape(
    -1, dy.shape[block.outputs_channel_index]
  )
  np.testing.assert_allclose(
    block.compute_outputs_stats(dy), rows.T @ rows / rows.shape[0], **TOL
  )


@pytest.mark.parametrize("fmt,strides,padding", CASES)
def test_block_statistics_use_the_helpers(fmt, strides, padding):
  """The K-FAC factors of one sample are the helpers' statistics."""
  eqn, x, params, dy, _ = _case(fmt, strides, padding)
  block = blocks.Conv2DTwoKroneckerFactored(eqn, "conv")
  data = dict(inputs=(x,), outputs_tangent=(dy[None],), params=params)
  a, g = block._batch_statistics(data, B)
  np.testing.assert_allclose(a, block.compute_inputs_stats(x), **TOL)
  np.testing.assert_allclose(g, block.compute_outputs_stats(dy), **TOL)
