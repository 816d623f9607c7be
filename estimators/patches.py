"""First and second moments of 2-D convolution patches (the K-FAC factor `A`).

A patch is the `(kernel_h, kernel_w, channels)` window of the (zero padded)
input that one output location of the convolution sees. Both functions return
`(second, first)`: the averages over examples and output locations of
`w * p ⊗ p` (shape `kernel_spatial_shape + (C,) + kernel_spatial_shape + (C,)`)
and of `w * p` (shape `kernel_spatial_shape + (C,)`), where `w` is the
optional `weighting_array` (1 by default).

`weighting_array` must broadcast to `(batch, out_h, out_w)` (spatial axes in
the order of the input's spatial axes); a 1-D array of length `batch` weights
whole examples.

Depthwise convolutions (`feature_group_count == C`): a kernel only mixes
positions within one channel, so only same-channel moments are meaningful.
The second moment keeps its full shape, with the entries pairing two
different channels set to zero; the first moment is unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def _pair(value, name) -> tuple[int, int]:
  if isinstance(value, (int, np.integer)):
    return (int(value),) * 2
  value = tuple(int(v) for v in value)
  if len(value) != 2:
    raise ValueError(
      f"patches_moments: {name} must be an int or a pair, got {value}."
    )
  return value


def _check_no_dilation(value, name):
  if value is None:
    return
  if _pair(value, name) != (1, 1):
    raise ValueError(
      f"patches_moments: {name}={value} is not supported; only "
      "undilated convolutions (None, 1 or (1, 1)) are."
    )


def _prepare(
  inputs,
  kernel_spatial_shape,
  strides,
  padding,
  data_format,
  dim_numbers,
  inputs_dilation,
  kernel_dilation,
  feature_group_count,
  batch_group_count,
  weighting_array,
) -> tuple[
  jax.Array, tuple[int, int], tuple[int, int], tuple[int, ...], jax.Array, bool
]:
  """Validates arguments; returns the padded NHWC input and the geometry."""
  inputs = jnp.asarray(inputs)
  if inputs.ndim != 4:
    raise ValueError(
      "patches_moments supports 2-D convolutions only: inputs "
      f"must be 4-D, got shape {inputs.shape}."
    )
  kernel = _pair(kernel_spatial_shape, "kernel_spatial_shape")
  strides = _pair(strides, "strides")
  _check_no_dilation(inputs_dilation, "inputs_dilation")
  _check_no_dilation(kernel_dilation, "kernel_dilation")
  if batch_group_count != 1:
    raise ValueError(
      "patches_moments supports only batch_group_count=1, got "
      f"{batch_group_count}."
    )
  if dim_numbers is None:
    if data_format not in ("NHWC", "NCHW"):
      raise ValueError(
        f"patches_moments: unknown data_format {data_format!r}; "
        "use 'NHWC' or 'NCHW', or pass dim_numbers."
      )
    dim_numbers = (data_format, "HWIO", data_format)
  if not isinstance(dim_numbers, lax.ConvDimensionNumbers):
    dim_numbers = lax.conv_dimension_numbers(
      inputs.shape, (1, 1, 1, 1), dim_numbers
    )
  lhs = dim_numbers.lhs_spec
  x = jnp.transpose(inputs, (lhs[0], lhs[2], lhs[3], lhs[1]))  # -> NHWC
  n, h, w, c = x.shape
  if feature_group_count not in (1, c):
    raise ValueError(
      "patches_moments supports feature_group_count 1 or the "
      f"number of channels ({c}), got {feature_group_count}."
    )
  pads: Sequence[tuple[int, int]]
  if isinstance(padding, str):
    pads = lax.padtype_to_pads((h, w), kernel, strides, padding)
  else:
    pads = tuple(_pair(p, "padding") for p in padding)
  x = jnp.pad(x, ((0, 0), tuple(pads[0]), tuple(pads[1]), (0, 0)))
  out = tuple((x.shape[1 + i] - kernel[i]) // strides[i] + 1 for i in range(2))
  if min(out) < 1:
    raise ValueError(
      f"patches_moments: a {kernel} kernel does not fit the "
      f"padded input of spatial shape {x.shape[1:3]}."
    )
  if weighting_array is None:
    weights = jnp.ones((n,) + out, x.dtype)
  else:
    weights = jnp.asarray(weighting_array, x.dtype)
    if weights.ndim == 1:
      weights = weights.reshape(-1, 1, 1)
    try:
      weights = jnp.broadcast_to(weights, (n,) + out)
    except ValueError:
      raise ValueError(
        f"patches_moments: weighting_array of shape "
        f"{jnp.shape(weighting_array)} does not broadcast to "
        f"(batch, out_h, out_w) = {(n,) + out}."
      ) from None
  depthwise = feature_group_count == c and c > 1
  return x, kernel, strides, out, weights, depthwise


def _finish(second, first, kernel, c, norm, depthwise):
  """(K, K, C, C) and (K, C) sums -> the documented shapes, averaged."""
  kh, kw = kernel
  if depthwise:
    second = second * jnp.eye(c, dtype=second.dtype)
  second = jnp.transpose(second, (0, 2, 1, 3)).reshape(kh, kw, c, kh, kw, c)
  return second / norm, first.reshape(kh, kw, c) / norm


def num_conv_locations(
  inputs_spatial_shape: Sequence[int],
  kernel_spatial_shape: int | Sequence[int],
  spatial_strides: int | Sequence[int],
  spatial_padding: str | int | Sequence[tuple[int, int]],
) -> int:
  """How many output locations a convolution has (the product over spatial
  axes of `(padded size - kernel) // stride + 1`), for any number of
  spatial axes.

  Args:
    inputs_spatial_shape: the input's spatial sizes.
    kernel_spatial_shape: the kernel's, an int for every axis alike.
    spatial_strides: the strides, an int or one per axis.
    spatial_padding: "SAME", "VALID" (any case), an int for the same
      padding on both sides of every axis, or `(low, high)` per axis.

  Raises:
    ValueError: for sizes or paddings whose number differs from the
      input's spatial axes, or a kernel larger than the padded input.
  """
  shape = tuple(int(d) for d in inputs_spatial_shape)
  rank = len(shape)

  def per_axis(value, name):
    if isinstance(value, (int, np.integer)):
      return (int(value),) * rank
    value = tuple(int(v) for v in value)
    if len(value) != rank:
      raise ValueError(
        f"num_conv_locations: {name} has {len(value)} entries for "
        f"{rank} spatial axes."
      )
    return value

  kernel = per_axis(kernel_spatial_shape, "kernel_spatial_shape")
  strides = per_axis(spatial_strides, "spatial_strides")
  if isinstance(spatial_padding, str):
    pads = lax.padtype_to_pads(shape, kernel, strides, spatial_padding.upper())
  elif isinstance(spatial_padding, (int, np.integer)):
    pads = [(int(spatial_padding), int(spatial_padding))] * rank
  else:
    pads = [(int(low), int(high)) for low, high in spatial_padding]
    if len(pads) != rank:
      raise ValueError(
        f"num_conv_locations: spatial_padding has {len(pads)} pairs for "
        f"{rank} spatial axes."
      )
  out = [
    (d + lo + hi - k) // s + 1
    for d, (lo, hi), k, s in zip(shape, pads, kernel, strides)
  ]
  if min(out) < 1:
    raise ValueError(
      f"num_conv_locations: a {kernel} kernel does not fit the padded "
      f"input {shape} (padding {pads})."
    )
  return int(np.prod(out))


def patches_moments(
  inputs: jax.Array,
  kernel_spatial_shape: int | Sequence[int],
  strides: int | Sequence[int] = 1,
  padding: str | Sequence[tuple[int, int]] = "VALID",
  data_format: str | None = "NHWC",
  dim_numbers: Any = None,
  inputs_dilation: int | Sequence[int] | None = None,
  kernel_dilation: int | Sequence[int] | None = None,
  feature_group_count: int = 1,
  batch_group_count: int = 1,
  unroll_loop: bool = False,
  precision: Any = None,
  weighting_array: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Patch moments without materialising the patches (see module docstring).

  Each pair of kernel offsets contributes one `(C, C)` block, computed from
  two strided views of the input, so memory stays at the input's size.

  Args:
    inputs: the convolution's 4-D input.
    kernel_spatial_shape: the kernel's spatial size, an int or a pair.
    strides: the convolution's strides, an int or a pair.
    padding: "SAME", "VALID" or explicit `(low, high)` pairs.
    data_format: "NHWC" or "NCHW", used when `dim_numbers` is None.
    dim_numbers: as `dimension_numbers` of `lax.conv_general_dilated`.
    inputs_dilation: must be None or 1 (no dilation).
    kernel_dilation: must be None or 1 (no dilation).
    feature_group_count: 1, or the number of channels (depthwise).
    batch_group_count: must be 1.
    unroll_loop: write the loop over offset pairs in Python (using the
      symmetry, half the pairs) instead of a `lax.map` loop.
    precision: the precision of the products, as for `jnp.einsum`.
    weighting_array: per-location weights (see module docstring), or None.

  Returns:
    `(second moment, first moment)`, shaped as the module docstring says.

  Raises:
    ValueError: for unsupported or inconsistent arguments.
  """
  x, kernel, strides, out, weights, depthwise = _prepare(
    inputs,
    kernel_spatial_shape,
    strides,
    padding,
    data_format,
    dim_numbers,
    inputs_dilation,
    kernel_dilation,
    feature_group_count,
    batch_group_count,
    weighting_array,
  )
  n, c = x.shape[0], x.shape[3]
  kh, kw = kernel
  extent = (n, (out[0] - 1) * strides[0] + 1, (out[1] - 1) * strides[1] + 1, c)

  def view(index):
    """The input values at kernel offset `index` for every output location."""
    a, b = index // kw, index % kw
    window = lax.dynamic_slice(x, (0, a, b, 0), extent)
    return window[:, :: strides[0], :: strides[1], :]

  def block(xi, xj):
    if depthwise:  # only the same-channel products are kept
      return jnp.diag(
        jnp.einsum("nhwc,nhw,nhwc->c", xi, weights, xj, precision=precision)
      )
    return jnp.einsum("nhwc,nhw,nhwd->cd", xi, weights, xj, precision=precision)

  k = kh * kw
  if unroll_loop:
    views = [view(i) for i in range(k)]
    rows: list[list[Any]] = [[None] * k for _ in range(k)]
    for i in range(k):
      for j in range(i, k):
        rows[i][j] = block(views[i], views[j])
        rows[j][i] = rows[i][j].T
    second = jnp.stack([jnp.stack(r) for r in rows])
    first = jnp.stack(
      [
        jnp.einsum("nhwc,nhw->c", v, weights, precision=precision)
        for v in views
      ]
    )
  else:
    indices = jnp.arange(k)

    def row(i):
      xi = view(i)
      return (
        lax.map(lambda j: block(xi, view(j)), indices),
        jnp.einsum("nhwc,nhw->c", xi, weights, precision=precision),
      )

    second, first = lax.map(row, indices)
  return _finish(
    second, first, kernel, c, n * out[0] * out[1], depthwise=depthwise
  )


def patches_moments_explicit(
  inputs: jax.Array,
  kernel_spatial_shape: int | Sequence[int],
  strides: int | Sequence[int] = 1,
  padding: str | Sequence[tuple[int, int]] = "VALID",
  data_format: str | None = "NHWC",
  dim_numbers: Any = None,
  inputs_dilation: int | Sequence[int] | None = None,
  kernel_dilation: int | Sequence[int] | None = None,
  feature_group_count: int = 1,
  batch_group_count: int = 1,
  unroll_loop: bool = False,
  precision: Any = None,
  weighting_array: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Same as `patches_moments`, extracting all patches first (more memory).

  The patches are strided views of the input stacked side by side (a copy,
  no arithmetic), so both moments come from one matrix product; this is the
  fast choice whenever the `(locations, kernel size)` patch matrix fits in
  memory.

  Args:
    inputs: as for `patches_moments`.
    kernel_spatial_shape: as for `patches_moments`.
    strides: as for `patches_moments`.
    padding: as for `patches_moments`.
    data_format: as for `patches_moments`.
    dim_numbers: as for `patches_moments`.
    inputs_dilation: as for `patches_moments`.
    kernel_dilation: as for `patches_moments`.
    feature_group_count: as for `patches_moments`.
    batch_group_count: as for `patches_moments`.
    unroll_loop: ignored.
    precision: as for `patches_moments`.
    weighting_array: as for `patches_moments`.

  Returns:
    `(second moment, first moment)`, as `patches_moments` returns them.

  Raises:
    ValueError: for unsupported or inconsistent arguments.
  """
  del unroll_loop
  x, kernel, strides, out, weights, depthwise = _prepare(
    inputs,
    kernel_spatial_shape,
    strides,
    padding,
    data_format,
    dim_numbers,
    inputs_dilation,
    kernel_dilation,
    feature_group_count,
    batch_group_count,
    weighting_array,
  )
  n, c = x.shape[0], x.shape[3]
  kh, kw = kernel
  stop = tuple((out[i] - 1) * strides[i] + 1 for i in range(2))
  views = [
    x[:, a : a + stop[0] : strides[0], b : b + stop[1] : strides[1], :]
    for a in range(kh)
    for b in range(kw)
  ]
  # Features in (kh, kw, C) order, the layout of the documented shapes.
  patches = jnp.stack(views, axis=3).reshape(-1, kh * kw * c)
  weighted = (
    patches if weighting_array is None else weights.reshape(-1, 1) * patches
  )
  second = jnp.matmul(weighted.T, patches, precision=precision)
  first = jnp.sum(weighted, axis=0)
  second = jnp.transpose(second.reshape(kh * kw, c, kh * kw, c), (0, 2, 1, 3))
  return _finish(
    second, first, kernel, c, n * out[0] * out[1], depthwise=depthwise
  )
