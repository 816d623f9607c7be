"""KFAC-JAX's module name `curvature_estimator`: the estimators of
`estimators.curvature`, their block-constructor settings, the optax
preconditioner and the type names KFAC-JAX's module defines."""

from collections.abc import Sequence

from estimators import optax_interface
from estimators.curvature import (
  BlockDiagonalCurvature,
  CurvatureBlockCtor,
  CurvatureEstimator,
  ExplicitExactCurvature,
  ImplicitExactCurvature,
  block_diagonal,
  explicit_exact,
  get_default_tag_to_block_ctor,
  implicit_exact,
  set_default_tag_to_block_ctor,
  set_multi_default_tag_to_block_ctor,
)
from estimators.curvature import base as curvature_estimator
from estimators.estimation_modes import ESTIMATION_MODES
from estimators.losses import LossFunction
from estimators.optax_interface import (
  OptaxPreconditioner,
  OptaxPreconditionState,
)
from estimators.utils.types import Array, StateType

# Type names of KFAC-JAX's module, for annotations: a loss's inputs are a
# tuple of arrays.
LossFunctionInputs = tuple[Array, ...]
LossFunctionsTuple = tuple[LossFunction, ...]
LossFunctionsSequence = Sequence[LossFunction]
LossFunctionInputsSequence = Sequence[LossFunctionInputs]
LossFunctionInputsTuple = tuple[LossFunctionInputs, ...]

__all__ = [
  "BlockDiagonalCurvature",
  "CurvatureBlockCtor",
  "CurvatureEstimator",
  "ESTIMATION_MODES",
  "ExplicitExactCurvature",
  "ImplicitExactCurvature",
  "LossFunction",
  "LossFunctionInputs",
  "LossFunctionInputsSequence",
  "LossFunctionInputsTuple",
  "LossFunctionsSequence",
  "LossFunctionsTuple",
  "OptaxPreconditionState",
  "OptaxPreconditioner",
  "StateType",
  "block_diagonal",
  "curvature_estimator",
  "explicit_exact",
  "implicit_exact",
  "optax_interface",
  "get_default_tag_to_block_ctor",
  "set_default_tag_to_block_ctor",
  "set_multi_default_tag_to_block_ctor",
]
