"""SOAP (Vyas et al., 2024): Shampoo's eigenbasis with the eigenvalues
refitted to the per-example second moments in it (George et al.'s
correction, as EKFAC does for K-FAC's basis)."""

import dataclasses

import estimators as kfac
from curvbench.approximations import CURVATURES, BlockDiagonal
from curvbench.approximations.shampoo import (
  max_full_vocab_setting,
  shampoo_family_blocks,
)
from curvbench.core import palette


@CURVATURES.register
@dataclasses.dataclass
class SOAP(BlockDiagonal):
  """SOAP blocks for dense (shared over positions too), conv and embedding
  layers (the basis at each inverse refresh, the scalings at each update);
  other tags keep the library's default block."""

  name: str = "soap"
  colour = palette.GREEN
  marker = "*"
  max_full_vocab: int = max_full_vocab_setting()

  @property
  def blocks(self):
    # A property, not the usual class constant: the embedding block takes
    # a setting.
    return shampoo_family_blocks(
      kfac.DenseSOAP,
      kfac.Conv2DSOAP,
      kfac.EmbeddingSOAP,
      self.max_full_vocab,
    )
