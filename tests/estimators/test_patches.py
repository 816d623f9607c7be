"""Patch moments: loop-based, explicit-patch and numpy brute force agree."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from estimators import patches, patches_second_moment


def np_moments(x_nhwc, kernel, strides, pads, weights=None, depthwise=False):
  """Brute force: every patch of the zero-padded input, one at a time."""
  (kh, kw), (sh, sw) = kernel, strides
  x = np.pad(x_nhwc, ((0, 0), pads[0], pads[1], (0, 0)))
  n, c = x.shape[0], x.shape[3]
  out = ((x.shape[1] - kh) // sh + 1, (x.shape[2] - kw) // sw + 1)
  if weights is None:
    weights = np.ones((n,) + out)
  second = np.zeros((kh * kw * c,) * 2)
  first = np.zeros(kh * kw * c)
  for b in range(n):
    for i in range(out[0]):
      for j in range(out[1]):
        p = x[b, i * sh : i * sh + kh, j * sw : j * sw + kw].reshape(-1)
        second += weights[b, i, j] * np.outer(p, p)
        first += weights[b, i, j] * p
  second = second.reshape(kh, kw, c, kh, kw, c)
  if depthwise:
    second = second * np.eye(c)[None, None, :, None, None, :]
  count = n * out[0] * out[1]
  return second / count, first.reshape(kh, kw, c) / count


CONFIGS = {
  "nhwc_valid": dict(kernel=(3, 3), strides=1, padding="VALID"),
  "nhwc_same_s2": dict(kernel=(3, 3), strides=2, padding="SAME"),
  "nchw_same_s2": dict(
    kernel=(3, 2), strides=2, padding="SAME", data_format="NCHW"
  ),
  "nchw_valid_s21": dict(
    kernel=(2, 3), strides=(2, 1), padding="VALID", data_format="NCHW"
  ),
  "explicit_pads": dict(
    kernel=(3, 3), strides=(1, 2), padding=((2, 0), (1, 1))
  ),
  "depthwise": dict(
    kernel=(3, 3), strides=2, padding="SAME", feature_group_count=3
  ),
  "weighted": dict(kernel=(2, 2), strides=1, padding="SAME", weights=True),
  "example_weights": dict(
    kernel=(2, 2), strides=2, padding="VALID", weights="batch"
  ),
  "dim_numbers": dict(
    kernel=(3, 3),
    strides=1,
    padding="SAME",
    dim_numbers=("NCHW", "OIHW", "NCHW"),
  ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_moments_match_brute_force(name):
  cfg = dict(CONFIGS[name])
  kernel, strides, padding = (
    cfg.pop("kernel"),
    cfg.pop("strides"),
    cfg.pop("padding"),
  )
  fmt = cfg.get("data_format", "NHWC")
  if "dim_numbers" in cfg:
    fmt = cfg["dim_numbers"][0]
  rng = np.random.RandomState(0)
  x_nhwc = rng.standard_normal((2, 5, 6, 3))
  x = x_nhwc if fmt == "NHWC" else x_nhwc.transpose(0, 3, 1, 2)
  s = (strides,) * 2 if isinstance(strides, int) else strides
  pads = (
    lax.padtype_to_pads((5, 6), kernel, s, padding)
    if isinstance(padding, str)
    else padding
  )
  out = [
    (d + lo + hi - k) // st + 1
    for d, (lo, hi), k, st in zip((5, 6), pads, kernel, s)
  ]
  weights = cfg.pop("weights", None)
  full_weights = None
  if weights is True:
    full_weights = rng.uniform(size=(2,) + tuple(out))
    cfg["weighting_array"] = full_weights
  elif weights == "batch":
    cfg["weighting_array"] = np.array([0.5, 2.0])
    full_weights = np.broadcast_to(
      np.array([0.5, 2.0])[:, None, None], (2,) + tuple(out)
    )
  expected = np_moments(
    x_nhwc,
    kernel,
    s,
    pads,
    full_weights,
    depthwise=cfg.get("feature_group_count", 1) == 3,
  )
  kwargs = dict(
    kernel_spatial_shape=kernel, strides=strides, padding=padding, **cfg
  )
  variants = [
    (patches.patches_moments, False),
    (patches.patches_moments_explicit, False),
  ]
  if name in ("nhwc_same_s2", "depthwise", "weighted"):
    variants.append((patches.patches_moments, True))
  weighting = kwargs.pop("weighting_array", None)
  for fn, unroll in variants:
    call = jax.jit(functools.partial(fn, unroll_loop=unroll, **kwargs))
    second, first = call(x, weighting_array=weighting)
    assert second.shape == tuple(kernel) + (3,) + tuple(kernel) + (3,)
    np.testing.assert_allclose(second, expected[0], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(first, expected[1], rtol=1e-10, atol=1e-12)


def test_conv_dimension_numbers_object():
  x = np.random.RandomState(1).standard_normal((2, 3, 4, 4))
  dn = lax.conv_dimension_numbers(
    x.shape, (5, 3, 2, 2), ("NCHW", "OIHW", "NCHW")
  )
  got = jax.jit(
    lambda x: patches.patches_moments(x, 2, dim_numbers=dn, data_format=None)
  )(x)
  want = jax.jit(
    lambda x: patches.patches_moments_explicit(x, (2, 2), data_format="NCHW")
  )(x)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
  "kwargs,match",
  [
    (dict(inputs_dilation=2), "inputs_dilation"),
    (dict(kernel_dilation=(1, 2)), "kernel_dilation"),
    (dict(batch_group_count=2), "batch_group_count"),
    (dict(feature_group_count=2), "feature_group_count"),
    (dict(data_format="CHWN"), "data_format"),
    (dict(weighting_array=np.ones((4, 4))), "weighting_array"),
    (dict(kernel_spatial_shape=(9, 9)), "does not fit"),
  ],
)
def test_clear_errors(kwargs, match):
  x = np.zeros((2, 4, 4, 3))
  kwargs = dict(dict(kernel_spatial_shape=(2, 2)), **kwargs)
  for fn in (patches.patches_moments, patches.patches_moments_explicit):
    with pytest.raises(ValueError, match=match):
      fn(x, **kwargs)


def test_dilation_of_one_is_accepted():
  x = np.random.RandomState(2).standard_normal((1, 3, 3, 2))
  a = jax.jit(
    lambda x: patches.patches_moments(
      x, 2, inputs_dilation=1, kernel_dilation=(1, 1), unroll_loop=True
    )
  )(x)
  b = jax.jit(lambda x: patches.patches_moments_explicit(x, 2))(x)
  np.testing.assert_allclose(a[0], b[0], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
  "spatial,kernel,strides,padding",
  [
    ((8, 8), (3, 3), (1, 1), "SAME"),
    ((9, 7), (2, 3), (2, 3), "valid"),
    ((9, 9), (2, 2), (2, 2), ((0, 0), (2, 3))),
    ((8, 8), 3, 2, 1),
    ((10,), (4,), (3,), "SAME"),
    ((5, 6, 7), (2, 3, 2), (1, 2, 3), "SAME"),
  ],
)
def test_num_conv_locations_counts_the_patches(
  spatial, kernel, strides, padding
):
  rank = len(spatial)
  per_axis = lambda v: (v,) * rank if isinstance(v, int) else tuple(v)
  pads = padding
  if isinstance(padding, int):
    pads = [(padding, padding)] * rank
  elif isinstance(padding, str):
    pads = padding.upper()
  patches = jax.lax.conv_general_dilated_patches(
    jnp.zeros((1, 1, *spatial)),
    filter_shape=per_axis(kernel),
    window_strides=per_axis(strides),
    padding=pads,
  )
  expected = patches[0, 0].size
  assert (
    patches_second_moment.num_conv_locations(spatial, kernel, strides, padding)
    == expected
  )


def test_num_conv_locations_refuses_mismatched_axes():
  with pytest.raises(ValueError, match="spatial_strides has 3 entries"):
    patches_second_moment.num_conv_locations((8, 8), 3, (1, 1, 1), "SAME")
  with pytest.raises(ValueError, match="does not fit"):
    patches_second_moment.num_conv_locations((2, 2), 3, 1, "VALID")
