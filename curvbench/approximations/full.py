"""Full blocks: each layer's curvature as a dense matrix over its parameters
(the exact block diagonal in the exact modes)."""

import dataclasses
from typing import ClassVar

import estimators as kfac
from curvbench.approximations import CURVATURES, BlockDiagonal
from curvbench.core import palette


@CURVATURES.register
@dataclasses.dataclass
class Full(BlockDiagonal):
  """Full blocks for dense (shared over positions too), conv,
  scale-and-shift and embedding layers. An embedding's is `(vocab d)^2`
  numbers: `max_state_gib` refuses it where that is too large."""

  name: str = "full"
  colour = palette.CYAN
  marker = "d"
  blocks: ClassVar = {
    "dense_tag": kfac.DenseFull,
    "repeated_dense_tag": kfac.DenseFull,
    "conv2d_tag": kfac.Conv2DFull,
    "scale_and_shift_tag": kfac.ScaleAndShiftFull,
    "embedding_tag": kfac.EmbeddingFull,
  }
