"""Shampoo (Gupta et al., ICML 2018) as a curvature: `(L ⊗ R)^(1/2)` from
the per-example weight gradients' factors, scaled to the exact block's
trace."""

import dataclasses
from typing import ClassVar

import estimators as kfac
from curvbench.approximations import CURVATURES, BlockDiagonal


@CURVATURES.register
@dataclasses.dataclass
class Shampoo(BlockDiagonal):
  """Shampoo blocks for dense (shared over positions too) and conv layers;
  other tags keep the library's default block."""

  name: str = "shampoo"
  colour = "teal"
  blocks: ClassVar = {"dense_tag": kfac.DenseShampoo,
                      "repeated_dense_tag": kfac.DenseShampoo,
                      "conv2d_tag": kfac.Conv2DShampoo}
