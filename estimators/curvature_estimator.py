"""KFAC-JAX's module name `curvature_estimator`: the estimators of
`estimators.curvature`, their block-constructor settings and `StateType`."""

from estimators.curvature import (
  BlockDiagonalCurvature,
  CurvatureBlockCtor,
  CurvatureEstimator,
  ExplicitExactCurvature,
  ImplicitExactCurvature,
  get_default_tag_to_block_ctor,
  set_default_tag_to_block_ctor,
)
from estimators.estimation_modes import ESTIMATION_MODES
from estimators.utils.types import StateType

__all__ = [
  "BlockDiagonalCurvature",
  "CurvatureBlockCtor",
  "CurvatureEstimator",
  "ESTIMATION_MODES",
  "ExplicitExactCurvature",
  "ImplicitExactCurvature",
  "StateType",
  "get_default_tag_to_block_ctor",
  "set_default_tag_to_block_ctor",
]
