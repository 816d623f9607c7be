"""Haiku layers whose curvature blocks are registered by hand.

Each layer computes its output and passes it through one `tag_*` call. When
automatic registration lands in `estimators`, set `HAND_REGISTRATION = False`
(or delete the `tag_*` calls) and the models stay otherwise unchanged.
"""

import haiku as hk
import jax
import jax.numpy as jnp

import estimators as kfac

HAND_REGISTRATION = True


def tag_dense(y, x, w, b):
  return kfac.register_dense(y, x, w, b) if HAND_REGISTRATION else y


def tag_conv2d(y, x, w, b, **conv_kwargs):
  if not HAND_REGISTRATION:
    return y
  return kfac.register_conv2d(y, x, w, b, data_format="NHWC", **conv_kwargs)


def tag_scale_and_shift(y, x, scale, shift):
  if not HAND_REGISTRATION:
    return y
  return kfac.register_scale_and_shift(y, x, scale, shift)


class Dense(hk.Module):
  """`y = x @ w + b` with `x: (batch, d_in)`, weights N(0, 1 / d_in)."""

  def __init__(self, size: int, name=None):
    super().__init__(name=name)
    self.size = size

  def __call__(self, x):
    d_in = x.shape[-1]
    init = hk.initializers.RandomNormal(d_in ** -0.5)
    w = hk.get_parameter("w", (d_in, self.size), x.dtype, init)
    b = hk.get_parameter("b", (self.size,), x.dtype, jnp.zeros)
    return tag_dense(x @ w + b, x, w, b)


class Conv2D(hk.Module):
  """A 'SAME'-padded NHWC convolution with bias."""

  def __init__(self, channels: int, kernel: int = 3, stride: int = 1,
               name=None):
    super().__init__(name=name)
    self.channels, self.kernel, self.stride = channels, kernel, stride

  def __call__(self, x):
    shape = (self.kernel, self.kernel, x.shape[-1], self.channels)
    init = hk.initializers.RandomNormal((2.0 / (self.kernel ** 2 * x.shape[-1])) ** 0.5)
    w = hk.get_parameter("w", shape, x.dtype, init)
    b = hk.get_parameter("b", (self.channels,), x.dtype, jnp.zeros)
    strides = (self.stride, self.stride)
    y = jax.lax.conv_general_dilated(
        x, w, strides, "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")) + b
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
    "relu": jax.nn.relu, "tanh": jnp.tanh, "sigmoid": jax.nn.sigmoid,
    "softplus": jax.nn.softplus, "gelu": jax.nn.gelu, "linear": lambda x: x,
}


def activation(name: str):
  if name not in ACTIVATIONS:
    raise ValueError(f"Unknown activation {name!r}; choose one of "
                     f"{', '.join(ACTIVATIONS)}.")
  return ACTIVATIONS[name]
