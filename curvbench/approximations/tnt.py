"""Tensor Normal Training (Ren & Goldfarb, NeurIPS 2021): one factor per
parameter axis from contracted per-example gradients, trace-matched."""

import dataclasses
from typing import ClassVar

import estimators as kfac
from curvbench.approximations import CURVATURES, BlockDiagonal
from curvbench.core import palette


@CURVATURES.register
@dataclasses.dataclass
class TNT(BlockDiagonal):
  """TNT blocks for dense (shared over positions too), conv and embedding
  layers, and for generic parameters; scale-and-shift layers keep the
  library's default (diagonal) block."""

  name: str = "tnt"
  colour = palette.OLIVE
  marker = "D"
  blocks: ClassVar = {
    "dense_tag": kfac.DenseTNT,
    "repeated_dense_tag": kfac.DenseTNT,
    "conv2d_tag": kfac.Conv2DTNT,
    "embedding_tag": kfac.EmbeddingTNT,
    "generic_tag": kfac.NaiveTNT,
  }
