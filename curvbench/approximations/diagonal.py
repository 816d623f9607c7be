"""Diagonal blocks: each layer's curvature kept on its diagonal only."""

import dataclasses
from typing import ClassVar

import estimators as kfac
from curvbench.approximations import CURVATURES, BlockDiagonal


@CURVATURES.register
@dataclasses.dataclass
class Diagonal(BlockDiagonal):
  """Diagonal blocks for dense (shared over positions too), conv and
  scale-and-shift layers."""

  name: str = "diagonal"
  blocks: ClassVar = {"dense_tag": kfac.DenseDiagonal,
                      "repeated_dense_tag": kfac.DenseDiagonal,
                      "conv2d_tag": kfac.Conv2DDiagonal,
                      "scale_and_shift_tag": kfac.ScaleAndShiftDiagonal}
  smaller: ClassVar = "curvature=identity"
