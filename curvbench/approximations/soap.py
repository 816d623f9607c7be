"""SOAP (Vyas et al., 2024): Shampoo's eigenbasis with the eigenvalues
refitted to the per-example second moments in it (George et al.'s
correction, as EKFAC does for K-FAC's basis)."""

import dataclasses
import functools

import estimators as kfac
from curvbench.approximations import CURVATURES, BlockDiagonal
from curvbench.approximations.shampoo import max_full_vocab_setting
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
    return {
      "dense_tag": kfac.DenseSOAP,
      "repeated_dense_tag": kfac.DenseSOAP,
      "conv2d_tag": kfac.Conv2DSOAP,
      "embedding_tag": functools.partial(
        kfac.EmbeddingSOAP, max_full_vocab=self.max_full_vocab
      ),
    }
