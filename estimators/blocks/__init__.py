"""Curvature blocks: one family per module, layer variants alongside."""

from estimators.blocks.base import (
  CurvatureBlock,
  get_default_eigen_decomposition_threshold,
  get_max_parallel_elements,
  set_default_eigen_decomposition_threshold,
  set_max_parallel_elements,
  to_real_set,
)
from estimators.blocks.diagonal import (
  Conv2DDiagonal,
  DenseDiagonal,
  Diagonal,
  NaiveDiagonal,
  ScaleAndShiftDiagonal,
)
from estimators.blocks.eigenbasis import EKFAC, Conv2DEKFAC, DenseEKFAC
from estimators.blocks.embedding import (
  EmbeddingDiagonal,
  EmbeddingEKFAC,
  EmbeddingFull,
  EmbeddingKFAC,
  EmbeddingTNT,
)
from estimators.blocks.example_gradients import MAX_FULL_VOCAB, EmbeddingFactors
from estimators.blocks.full import (
  Conv2DFull,
  DenseFull,
  ExplicitFull,
  Full,
  NaiveFull,
  ScaleAndShiftFull,
)
from estimators.blocks.identity import ScaledIdentity
from estimators.blocks.kl_shampoo import (
  Conv2DKLShampoo,
  DenseKLShampoo,
  EmbeddingKLShampoo,
)
from estimators.blocks.kronecker import (
  Conv2DTwoKroneckerFactored,
  DenseTwoKroneckerFactored,
  KroneckerFactored,
  RepeatedDenseKroneckerFactored,
  RepeatedDenseTwoKroneckerFactored,
  TwoKroneckerFactored,
)
from estimators.blocks.norms import NORM_TYPES, psd_matrix_norm
from estimators.blocks.optimal_kronecker import (
  Conv2DOptimalKronecker,
  DenseOptimalKronecker,
  EmbeddingOptimalKronecker,
)
from estimators.blocks.shampoo import (
  Conv2DShampoo,
  Conv2DShampoo2,
  Conv2DSOAP,
  DenseShampoo,
  DenseShampoo2,
  DenseSOAP,
  EmbeddingShampoo,
  EmbeddingShampoo2,
  EmbeddingSOAP,
)
from estimators.blocks.stacked import Stacked
from estimators.blocks.tnt import Conv2DTNT, DenseTNT, NaiveTNT
from estimators.blocks.weight_sharing import (
  Conv2DKFACExpand,
  Conv2DKFACReduce,
  RepeatedDenseKFACExpand,
  RepeatedDenseKFACReduce,
)

__all__ = [
  "Conv2DDiagonal",
  "Conv2DEKFAC",
  "Conv2DFull",
  "Conv2DKFACExpand",
  "Conv2DKFACReduce",
  "Conv2DKLShampoo",
  "Conv2DOptimalKronecker",
  "Conv2DSOAP",
  "Conv2DShampoo",
  "Conv2DShampoo2",
  "Conv2DTNT",
  "Conv2DTwoKroneckerFactored",
  "CurvatureBlock",
  "DenseDiagonal",
  "DenseEKFAC",
  "DenseFull",
  "DenseKLShampoo",
  "DenseOptimalKronecker",
  "DenseSOAP",
  "DenseShampoo",
  "DenseShampoo2",
  "DenseTNT",
  "DenseTwoKroneckerFactored",
  "Diagonal",
  "EKFAC",
  "EmbeddingDiagonal",
  "EmbeddingEKFAC",
  "EmbeddingFactors",
  "EmbeddingFull",
  "EmbeddingKFAC",
  "EmbeddingKLShampoo",
  "EmbeddingOptimalKronecker",
  "EmbeddingSOAP",
  "EmbeddingShampoo",
  "EmbeddingShampoo2",
  "EmbeddingTNT",
  "ExplicitFull",
  "Full",
  "KroneckerFactored",
  "MAX_FULL_VOCAB",
  "NORM_TYPES",
  "NaiveDiagonal",
  "NaiveFull",
  "NaiveTNT",
  "RepeatedDenseKFACExpand",
  "RepeatedDenseKFACReduce",
  "RepeatedDenseKroneckerFactored",
  "RepeatedDenseTwoKroneckerFactored",
  "ScaleAndShiftDiagonal",
  "ScaleAndShiftFull",
  "ScaledIdentity",
  "Stacked",
  "TwoKroneckerFactored",
  "get_default_eigen_decomposition_threshold",
  "get_max_parallel_elements",
  "psd_matrix_norm",
  "set_default_eigen_decomposition_threshold",
  "set_max_parallel_elements",
  "to_real_set",
]
