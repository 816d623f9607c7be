"""K-FAC (Martens & Grosse, ICML 2015): two-Kronecker-factored blocks where a
layer allows them (conv layers per location, Grosse & Martens, ICML 2016;
layers shared over positions, K-FAC-expand); the library's defaults."""

import dataclasses

from curvbench.approximations import CURVATURES, BlockDiagonal
from curvbench.core import palette


@CURVATURES.register
@dataclasses.dataclass
class KFAC(BlockDiagonal):
  """The library's default block for every tag."""

  name: str = "kfac"
  colour = palette.ROSE
  marker = "o"
