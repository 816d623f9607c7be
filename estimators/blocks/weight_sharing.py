"""K-FAC-expand and K-FAC-reduce for layers that share weights.

A layer shares its weights when it is applied at several positions of one
example: a dense layer over the R tokens of a sequence, a convolution over
its output locations. Eschenhagen et al. (NeurIPS 2023) show that K-FAC has
two natural forms for such layers, each exact for deep linear networks in
one setting:

- *expand*: the loss has one term per position (e.g. per-token
  predictions). Each position is treated as an example of its own; the
  factors average over examples and positions and the block is scaled by
  the number of positions. `RepeatedDenseKFACExpand` and `Conv2DKFACExpand`
  are the existing `RepeatedDenseTwoKroneckerFactored` and
  `Conv2DTwoKroneckerFactored`.
- *reduce*: the positions are pooled before the loss (e.g. a sequence or
  image classified once). `A` is formed from each example's input averaged
  over positions and `G` from its output tangents summed over positions,
  so both factors average over examples only and the block is unscaled:
  `RepeatedDenseKFACReduce` and `Conv2DKFACReduce`.

Neither is chosen automatically: the user picks one per layer, by tag name
with `layer_tag_to_block_ctor` (e.g. `{"repeated_dense_tag":
RepeatedDenseKFACReduce}` or `{"conv2d_tag": Conv2DKFACReduce}`) or per
layer with `index_to_block_ctor` of `BlockDiagonalCurvature`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from estimators import utils
from estimators.blocks import kronecker

RepeatedDenseKFACExpand = kronecker.RepeatedDenseTwoKroneckerFactored
Conv2DKFACExpand = kronecker.Conv2DTwoKroneckerFactored


class RepeatedDenseKFACReduce(kronecker.DenseTwoKroneckerFactored):
  """K-FAC-reduce for a dense layer applied at R positions per example.

  With inputs `x: (B, r1, ..., d_in)` (`R = r1 * ...`), `A = (1/B) sum_b
  x̄_b x̄_bᵀ`, `x̄_b` the mean over the example's positions of its inputs
  (with a 1 appended for the bias), and `G = (1/B) sum_sb ḡ_sb ḡ_sbᵀ`, `ḡ`
  the sum over positions of the output tangents; `fixed_scale() = 1`. This
  is exact for deep linear networks whose outputs are pooled over the
  positions before the loss (Eschenhagen et al., "Kronecker-Factored
  Approximate Curvature for Modern Neural Network Architectures",
  NeurIPS 2023). On a plain dense tag (no positions) it is ordinary K-FAC.
  """

  @property
  def num_repeats(self) -> int:
    """`R`, the number of positions the layer is applied at per example."""
    (x_shape,) = self.inputs_shapes
    return utils.product(x_shape[1:-1])

  def _batch_statistics(self, estimation_data, batch_size):
    (x,), (dy,) = estimation_data["inputs"], estimation_data["outputs_tangent"]
    x_mean = jnp.mean(x, axis=tuple(range(1, x.ndim - 1)))  # (B, d_in)
    if self.has_bias:
      x_mean = jnp.concatenate([x_mean, jnp.ones_like(x_mean[:, :1])], axis=1)
    # (S, B, r1, ..., d_out) -> one summed tangent per (sample, example).
    dy_sum = jnp.sum(dy, axis=tuple(range(2, dy.ndim - 1)))
    dy_sum = dy_sum.reshape(-1, dy_sum.shape[-1])
    return (x_mean.T @ x_mean / batch_size, dy_sum.T @ dy_sum / batch_size)


class Conv2DKFACReduce(kronecker.Conv2DTwoKroneckerFactored):
  """K-FAC-reduce for 2-D convolutions (weights shared over locations).

  `A = (1/B) sum_b p̄_b p̄_bᵀ`, `p̄_b` the mean over the output locations of
  example b's input patches (layout `(kernel_h, kernel_w, in_channels)`,
  bias as an appended 1), and `G = (1/B) sum_sb ḡ_sb ḡ_sbᵀ`, `ḡ` the output
  tangents summed over locations; `fixed_scale() = 1`. Exact for deep linear
  networks whose outputs are pooled over locations before the loss
  (Eschenhagen et al., "Kronecker-Factored Approximate Curvature for Modern
  Neural Network Architectures", NeurIPS 2023). Only ungrouped, undilated
  convolutions are supported.
  """

  def fixed_scale(self):
    return 1

  def mean_patches(self, x: jax.Array) -> jax.Array:
    """Each example's input patches averaged over the output locations.

    Args:
      x: the layer's input, batch axis first, in the tag's layout.

    Returns:
      A `(B, kernel_h * kernel_w * in_channels)` array in the patch layout
      (without the bias entry).
    """
    lhs = self.dimension_numbers.lhs_spec
    x = jnp.transpose(x, (lhs[0], lhs[2], lhs[3], lhs[1]))  # -> NHWC
    p = self.layer_tag_extra_params
    pads = [(0, 0, 0)] + [(lo, hi, 0) for lo, hi in p["padding"]] + [(0, 0, 0)]
    x = lax.pad(x, jnp.zeros((), x.dtype), pads)
    (kh, kw), (sh, sw) = self.weights_spatial_shape, p["window_strides"]
    oh, ow = self.outputs_spatial_shape
    # The sum over locations of the patch entry at kernel offset (i, j) is the
    # sum of one strided view of the padded input; each view is reduced as
    # it is read, so the patches are never stored.
    sums = [
      x[:, i : i + (oh - 1) * sh + 1 : sh, j : j + (ow - 1) * sw + 1 : sw].sum(
        axis=(1, 2)
      )
      for i in range(kh)
      for j in range(kw)
    ]
    return jnp.stack(sums, axis=1).reshape(x.shape[0], -1) / (oh * ow)

  def _batch_statistics(self, estimation_data, batch_size):
    (x,), (dy,) = estimation_data["inputs"], estimation_data["outputs_tangent"]
    mean = self.mean_patches(x)
    if self.has_bias:
      mean = jnp.concatenate([mean, jnp.ones_like(mean[:, :1])], axis=1)
    # (S, B, ...) with the batch first: summing the spatial axes leaves
    # (S, B, C_out).
    spatial = tuple(1 + i for i in self.dimension_numbers.out_spec[2:])
    dy_sum = jnp.sum(dy, axis=spatial).reshape(-1, self.num_outputs_channels)
    return mean.T @ mean / batch_size, dy_sum.T @ dy_sum / batch_size
