"""Scaled-identity blocks: every layer's curvature taken as the identity,
whatever the data; the baseline that uses no curvature at all."""

import dataclasses
from typing import ClassVar

import estimators as kfac
from curvbench.approximations import CURVATURES, BlockDiagonal
from curvbench.core import palette


@CURVATURES.register
@dataclasses.dataclass
class Identity(BlockDiagonal):
  """An identity block (`estimators.ScaledIdentity`) for every layer tag."""

  name: str = "identity"
  colour = palette.YELLOW
  marker = ">"
  blocks: ClassVar = {
    tag: kfac.ScaledIdentity
    for tag in (
      "dense_tag",
      "conv2d_tag",
      "scale_and_shift_tag",
      "repeated_dense_tag",
      "embedding_tag",
      "generic_tag",
    )
  }
  smaller: ClassVar = "curvature=identity"
