"""EKFAC (George et al., NeurIPS 2018): K-FAC's Kronecker eigenbasis with the
eigenvalues refitted to the per-example second moments in that basis."""

import dataclasses
import functools

import estimators as kfac
from curvbench.approximations import CURVATURES, BlockDiagonal
from curvbench.components import OneOf, setting
from curvbench.core import palette


@CURVATURES.register
@dataclasses.dataclass
class EKFAC(BlockDiagonal):
  """EKFAC blocks for dense, shared-dense, conv and embedding layers (the
  basis at each inverse refresh, the scalings at each update); other tags
  keep the library's default block."""

  name: str = "ekfac"
  colour = palette.INDIGO
  marker = "s"
  conv_scalings: str = setting(
    "per_example",
    OneOf(kfac.Conv2DEKFAC.SCALINGS),
    "conv layers' scalings: fitted to per-example gradients (George et "
    "al.) or to each output location's gradient",
  )

  @property
  def blocks(self):
    # A property, not the usual class constant: the conv block takes a
    # setting.
    return {
      "dense_tag": kfac.DenseEKFAC,
      "repeated_dense_tag": kfac.DenseEKFAC,
      "conv2d_tag": functools.partial(
        kfac.Conv2DEKFAC, scalings=self.conv_scalings
      ),
      "embedding_tag": kfac.EmbeddingEKFAC,
    }
