"""K-FAC-reduce (Eschenhagen et al., NeurIPS 2023) for layers with weight
sharing (shared dense layers, conv2d): inputs averaged and output
derivatives summed over the shared positions. Plain K-FAC (`kfac`) is
K-FAC-expand there; elsewhere the two are the same."""

import dataclasses
from typing import ClassVar

import estimators as kfac
from curvbench.approximations import CURVATURES, BlockDiagonal
from curvbench.core import palette


@CURVATURES.register
@dataclasses.dataclass
class KFACReduce(BlockDiagonal):
  """K-FAC-reduce blocks where weights are shared, K-FAC elsewhere.

  Embeddings keep `EmbeddingKFAC` (K-FAC-expand): averaging one-hot inputs
  over positions would make their input factor a dense vocab x vocab
  matrix."""

  name: str = "kfac_reduce"
  colour = palette.ORANGE
  marker = "^"
  blocks: ClassVar = {
    "repeated_dense_tag": kfac.RepeatedDenseKFACReduce,
    "conv2d_tag": kfac.Conv2DKFACReduce,
    "embedding_tag": kfac.EmbeddingKFAC,
  }
