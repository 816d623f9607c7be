"""Curvature estimators: block-diagonal, explicit exact and implicit exact,
one module each, with the block defaults they share."""

from estimators.curvature.base import (
  CurvatureBlockCtor,
  CurvatureEstimator,
  get_default_tag_to_block_ctor,
  set_default_tag_to_block_ctor,
  set_multi_default_tag_to_block_ctor,
  update_block_estimate,
)
from estimators.curvature.block_diagonal import (
  BlockDiagonalCurvature,
  BlockDiagonalState,
)
from estimators.curvature.explicit_exact import ExplicitExactCurvature
from estimators.curvature.implicit_exact import ImplicitExactCurvature
from estimators.utils.tree_math import default_batch_size_extractor

__all__ = [
  "BlockDiagonalCurvature",
  "BlockDiagonalState",
  "CurvatureBlockCtor",
  "CurvatureEstimator",
  "ExplicitExactCurvature",
  "ImplicitExactCurvature",
  "default_batch_size_extractor",
  "get_default_tag_to_block_ctor",
  "set_default_tag_to_block_ctor",
  "set_multi_default_tag_to_block_ctor",
  "update_block_estimate",
]
