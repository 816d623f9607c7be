"""Curvature blocks: one family per module, layer variants alongside."""

from estimators.blocks.base import (CurvatureBlock,
                                    get_default_eigen_decomposition_threshold,
                                    get_max_parallel_elements,
                                    set_default_eigen_decomposition_threshold,
                                    set_max_parallel_elements)
from estimators.blocks.diagonal import (Conv2DDiagonal, DenseDiagonal, Diagonal,
                                        NaiveDiagonal, ScaleAndShiftDiagonal)
from estimators.blocks.full import (Conv2DFull, DenseFull, Full, NaiveFull,
                                    ScaleAndShiftFull)
from estimators.blocks.identity import ScaledIdentity
from estimators.blocks.kronecker import (Conv2DTwoKroneckerFactored,
                                         DenseTwoKroneckerFactored,
                                         RepeatedDenseTwoKroneckerFactored,
                                         TwoKroneckerFactored)
from estimators.blocks.stacked import Stacked

__all__ = [
    "Conv2DDiagonal", "Conv2DFull", "Conv2DTwoKroneckerFactored",
    "CurvatureBlock", "DenseDiagonal", "DenseFull", "DenseTwoKroneckerFactored",
    "Diagonal", "Full", "NaiveDiagonal", "NaiveFull",
    "RepeatedDenseTwoKroneckerFactored", "ScaleAndShiftDiagonal",
    "ScaleAndShiftFull", "ScaledIdentity", "Stacked", "TwoKroneckerFactored",
    "get_default_eigen_decomposition_threshold", "get_max_parallel_elements",
    "set_default_eigen_decomposition_threshold", "set_max_parallel_elements",
]
