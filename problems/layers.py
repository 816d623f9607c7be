"""Haiku layers whose curvature blocks are registered by hand.

Each layer computes its output and passes it through one `tag_*` call. When
automatic registration lands in `estimators`, set `HAND_REGISTRATION = False`
(or delete the `tag_*` calls) and the models stay otherwise unchanged.
"""

import math
import numbers

import haiku as hk
import jax
import jax.numpy as jnp

import estimators as kfac

HAND_REGISTRATION = True


def tag_dense(y, x, w, b):
  """`y = x @ w + b`, registered as a dense layer while
  `HAND_REGISTRATION` is on."""
  return kfac.register_dense(y, x, w, b) if HAND_REGISTRATION else y


def tag_conv2d(y, x, w, b, **conv_kwargs):
  """`y`, the NHWC convolution of `x` with `w` plus `b`, registered as a
  2-D convolution while `HAND_REGISTRATION` is on; `conv_kwargs` are the
  convolution's settings (strides, padding)."""
  if not HAND_REGISTRATION:
    return y
  return kfac.register_conv2d(y, x, w, b, data_format="NHWC", **conv_kwargs)


def tag_scale_and_shift(y, x, scale, shift):
  """`y = x * scale + shift`, registered as a scale-and-shift layer while
  `HAND_REGISTRATION` is on."""
  if not HAND_REGISTRATION:
    return y
  return kfac.register_scale_and_shift(y, x, scale, shift)


class SparseInit:
  """Sparse initialization (Martens, 2010, "Deep learning via Hessian-free
  optimization", ICML; the K-FAC paper's autoencoders use it too).

  Each unit (a column of a `(d_in, d_out)` weight; for more axes, all but the
  last are its inputs) is connected to `connections` inputs picked uniformly
  at random without replacement, independently per unit, or to all of them
  where there are fewer; those weights are drawn from N(0, stddev^2) and the
  rest are zero. A unit's total input then does not shrink as the fan-in
  grows, and units share fewer inputs, so they start less correlated.
  """

  def __init__(self, connections: int = 15, stddev: float = 1.0):
    if isinstance(connections, bool) or not (
      isinstance(connections, numbers.Integral) and connections >= 1
    ):
      raise ValueError(
        f"SparseInit(connections={connections!r}): give a "
        "whole number of incoming weights per unit, >= 1."
      )
    self.connections: int = connections
    self.stddev: float = stddev

  def __call__(self, shape, dtype):
    if len(shape) < 2:
      raise ValueError(
        f"SparseInit needs a weight of shape (inputs..., "
        f"units), got shape {tuple(shape)}; initialise biases "
        "with zeros."
      )
    fan_in, units = math.prod(shape[:-1]), shape[-1]
    pick, draw = jax.random.split(hk.next_rng_key())
    # Rank uniform noise down each column; the `connections` lowest ranks
    # are a uniform draw without replacement, exactly that many per unit.
    noise = jax.random.uniform(pick, (fan_in, units))
    ranks = jnp.argsort(jnp.argsort(noise, axis=0), axis=0)
    mask = ranks < self.connections
    w = self.stddev * jax.random.normal(draw, (fan_in, units), dtype)
    return jnp.where(mask, w, jnp.zeros((), dtype)).reshape(shape)


class Dense(hk.Module):
  """`y = x @ w + b` with `x: (batch, d_in)`; weights from `w_init` (a Haiku
  initializer; default N(0, 1 / d_in)), biases zero."""

  def __init__(self, size: int, name=None, w_init=None):
    super().__init__(name=name)
    self.size = size
    self.w_init = w_init

  def __call__(self, x):
    d_in = x.shape[-1]
    init = self.w_init or hk.initializers.RandomNormal(d_in**-0.5)
    w = hk.get_parameter("w", (d_in, self.size), x.dtype, init)
    b = hk.get_parameter("b", (self.size,), x.dtype, jnp.zeros)
    return tag_dense(x @ w + b, x, w, b)


class Conv2D(hk.Module):
  """A 'SAME'-padded NHWC convolution with bias."""

  def __init__(
    self, channels: int, kernel: int = 3, stride: int = 1, name=None
  ):
    super().__init__(name=name)
    self.channels, self.kernel, self.stride = channels, kernel, stride

  def __call__(self, x):
    shape = (self.kernel, self.kernel, x.shape[-1], self.channels)
    init = hk.initializers.RandomNormal(
      (2.0 / (self.kernel**2 * x.shape[-1])) ** 0.5
    )
    w = hk.get_parameter("w", shape, x.dtype, init)
    b = hk.get_parameter("b", (self.channels,), x.dtype, jnp.zeros)
    strides = (self.stride, self.stride)
    y = (
      jax.lax.conv_general_dilated(
        x, w, strides, "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
      )
      + b
    )
    return tag_conv2d(y, x, w, b, window_strides=strides, padding="SAME")


class Normalize(hk.Module):
  """Per-example normalisation over (H, W, C) then a learned scale and shift.

  It is a layer norm: unlike batch norm it keeps examples independent, so
  per-example gradients (and hence the exact curvatures) stay well defined.
  """

  def __init__(self, eps: float = 1e-5, name=None):
    super().__init__(name=name)
    self.eps = eps

  def __call__(self, x):
    axes = tuple(range(1, x.ndim))
    mean = jnp.mean(x, axis=axes, keepdims=True)
    var = jnp.var(x, axis=axes, keepdims=True)
    z = (x - mean) * jax.lax.rsqrt(var + self.eps)
    scale = hk.get_parameter("scale", (x.shape[-1],), x.dtype, jnp.ones)
    shift = hk.get_parameter("shift", (x.shape[-1],), x.dtype, jnp.zeros)
    return tag_scale_and_shift(z * scale + shift, z, scale, shift)


ACTIVATIONS = {
  "relu": jax.nn.relu,
  "tanh": jnp.tanh,
  "sigmoid": jax.nn.sigmoid,
  "softplus": jax.nn.softplus,
  "gelu": jax.nn.gelu,
  "linear": lambda x: x,
}


def activation(name: str):
  """The elementwise function `ACTIVATIONS[name]`; an unknown name raises
  a ValueError listing the known ones."""
  if name not in ACTIVATIONS:
    raise ValueError(
      f"Unknown activation {name!r}; choose one of {', '.join(ACTIVATIONS)}."
    )
  return ACTIVATIONS[name]


def dense_to_logits(h, sizes, act, num_classes: int):
  """Dense layers `dense_0, dense_1, ...` of `sizes` units, each followed by
  `act`, then the linear layer `logits` of `num_classes` units."""
  for i, size in enumerate(sizes):
    h = act(Dense(size, name=f"dense_{i}")(h))
  return Dense(num_classes, name="logits")(h)
