"""EKFAC (George et al., NeurIPS 2018): K-FAC's Kronecker eigenbasis with the
eigenvalues refitted to the per-example second moments in that basis."""

import dataclasses
from typing import ClassVar

import estimators as kfac
from curvbench.approximations import CURVATURES, BlockDiagonal


@CURVATURES.register
@dataclasses.dataclass
class EKFAC(BlockDiagonal):
  """EKFAC blocks for dense, shared-dense and conv layers (the basis at each
  inverse refresh, the scalings at each update)."""

  name: str = "ekfac"
  blocks: ClassVar = {"dense_tag": kfac.DenseEKFAC,
                      "repeated_dense_tag": kfac.DenseEKFAC,
                      "conv2d_tag": kfac.Conv2DEKFAC}
