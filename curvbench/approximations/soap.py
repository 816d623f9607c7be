"""SOAP (Vyas et al., 2024): Shampoo's eigenbasis with the eigenvalues
refitted to the per-example second moments in it (George et al.'s
correction, as EKFAC does for K-FAC's basis)."""

import dataclasses
from typing import ClassVar

import estimators as kfac
from curvbench.approximations import CURVATURES, BlockDiagonal


@CURVATURES.register
@dataclasses.dataclass
class SOAP(BlockDiagonal):
  """SOAP blocks for dense (shared over positions too) and conv layers (the
  basis at each inverse refresh, the scalings at each update); other tags
  keep the library's default block."""

  name: str = "soap"
  colour = "magenta"
  blocks: ClassVar = {"dense_tag": kfac.DenseSOAP,
                      "repeated_dense_tag": kfac.DenseSOAP,
                      "conv2d_tag": kfac.Conv2DSOAP}
