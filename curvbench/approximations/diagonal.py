"""Diagonal blocks: each layer's curvature kept on its diagonal only."""

import dataclasses
from typing import ClassVar

import estimators as kfac
from curvbench.approximations import CURVATURES, BlockDiagonal
from curvbench.core import palette


@CURVATURES.register
@dataclasses.dataclass
class Diagonal(BlockDiagonal):
  """Diagonal blocks for dense (shared over positions too), conv,
  scale-and-shift and embedding layers (an embedding's, `(vocab, d)`, holds
  as many numbers as its table)."""

  name: str = "diagonal"
  colour = palette.SAND
  marker = "<"
  blocks: ClassVar = {
    "dense_tag": kfac.DenseDiagonal,
    "repeated_dense_tag": kfac.DenseDiagonal,
    "conv2d_tag": kfac.Conv2DDiagonal,
    "scale_and_shift_tag": kfac.ScaleAndShiftDiagonal,
    "embedding_tag": kfac.EmbeddingDiagonal,
  }
  smaller: ClassVar = "curvature=identity"
