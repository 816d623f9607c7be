"""Shampoo² (Morwani et al., ICLR 2025): `L ⊗ R / tr L` from Shampoo's
factors `L = E[G Gᵀ]`, `R = E[Gᵀ G]` of the per-example weight gradients;
for a weight matrix it is the same matrix as two-factor TNT."""

import dataclasses
from typing import ClassVar

import estimators as kfac
from curvbench.approximations import CURVATURES, BlockDiagonal


@CURVATURES.register
@dataclasses.dataclass
class Shampoo2(BlockDiagonal):
  """Shampoo² blocks for dense (shared over positions too) and conv layers;
  other tags keep the library's default block."""

  name: str = "shampoo2"
  colour = "slateblue"
  blocks: ClassVar = {"dense_tag": kfac.DenseShampoo2,
                      "repeated_dense_tag": kfac.DenseShampoo2,
                      "conv2d_tag": kfac.Conv2DShampoo2}
