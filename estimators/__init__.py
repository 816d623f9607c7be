"""curvbench's curvature library; its public API follows KFAC-JAX's.

`import estimators as kfac_jax` gives the same names: loss registration,
layer tags, the tracer, curvature blocks, the curvature estimators, the
optimizer and the optax preconditioner, and KFAC-JAX's module names
(`kfac_jax.curvature_blocks`, `kfac_jax.utils`, ...).
"""

from estimators import blocks, curvature, estimation_modes, losses, patches
from estimators import tags, tracer, tridiagonal, utils
from estimators.blocks import (
    EKFAC, Conv2DEKFAC, Conv2DKFACExpand, Conv2DKFACReduce, Conv2DKLShampoo,
    Conv2DOptimalKronecker, Conv2DShampoo, Conv2DShampoo2, Conv2DSOAP,
    Conv2DTNT, DenseEKFAC, DenseKLShampoo, DenseOptimalKronecker,
    DenseShampoo, DenseShampoo2, DenseSOAP, DenseTNT, EmbeddingDiagonal,
    EmbeddingEKFAC, EmbeddingFull, EmbeddingKFAC, EmbeddingKLShampoo,
    EmbeddingOptimalKronecker, EmbeddingShampoo, EmbeddingShampoo2,
    EmbeddingSOAP, EmbeddingTNT, NaiveTNT, RepeatedDenseKFACExpand,
    RepeatedDenseKFACReduce, CurvatureBlock, Conv2DDiagonal, Conv2DFull,
    Conv2DTwoKroneckerFactored, DenseDiagonal, DenseFull,
    DenseTwoKroneckerFactored, Diagonal, ExplicitFull, Full, NaiveDiagonal,
    NaiveFull, RepeatedDenseTwoKroneckerFactored, ScaleAndShiftDiagonal,
    ScaleAndShiftFull, ScaledIdentity, Stacked, TwoKroneckerFactored,
    get_default_eigen_decomposition_threshold, get_max_parallel_elements,
    set_default_eigen_decomposition_threshold, set_max_parallel_elements)
from estimators.curvature import (
    BlockDiagonalCurvature, CurvatureEstimator, ExplicitExactCurvature,
    ImplicitExactCurvature, default_batch_size_extractor,
    get_default_tag_to_block_ctor, set_default_tag_to_block_ctor)
from estimators.tridiagonal import BlockTridiagonalCurvature
from estimators import graph_matcher
from estimators.estimation_modes import ESTIMATION_MODES
from estimators.graph_matcher import (
    DEFAULT_GRAPH_PATTERNS, GraphMatcherComparator, GraphPattern,
    TaggedFunction, auto_register_tags, registration_report)
from estimators.optimizer import Optimizer
from estimators.losses import (
    CategoricalLogitsNegativeLogProbLoss, DistributionNegativeLogProbLoss,
    LossFunction, MultiBernoulliNegativeLogProbLoss, NegativeLogProbLoss,
    NormalMeanNegativeLogProbLoss, NormalMeanVarianceNegativeLogProbLoss,
    OneHotCategoricalLogitsNegativeLogProbLoss,
    register_categorical_predictive_distribution,
    register_multi_bernoulli_predictive_distribution,
    register_normal_predictive_distribution,
    register_sigmoid_cross_entropy_loss, register_softmax_cross_entropy_loss,
    register_squared_error_loss)
from estimators.patches import patches_moments, patches_moments_explicit
from estimators.tags import (
    LayerTag, LossTag, register_conv2d, register_dense, register_generic,
    register_embedding, register_repeated_dense, register_scale_and_shift)
from estimators.tracer import (
    ProcessedJaxpr, StackedLayerTag, TracingError, layer_tags_vjp,
    loss_tags_hvp, loss_tags_jvp, loss_tags_linearize, loss_tags_vjp)
from estimators.optax_interface import (OptaxPreconditioner,
                                        OptaxPreconditionState)
# KFAC-JAX's module names, for `kfac_jax.curvature_blocks.X` and the like.
from estimators import (curvature_blocks, curvature_estimator,
                        layers_and_loss_tags, loss_functions, optax_interface,
                        patches_second_moment, tag_graph_matcher)

__all__ = [
    # modules, then KFAC-JAX's names for them
    "blocks", "curvature", "estimation_modes", "graph_matcher", "losses",
    "optax_interface", "optimizer", "patches", "tags", "tracer",
    "tridiagonal", "utils",
    "curvature_blocks", "curvature_estimator", "layers_and_loss_tags",
    "loss_functions", "patches_second_moment", "tag_graph_matcher",
    # curvature blocks and their settings
    "Conv2DEKFAC", "Conv2DKFACExpand", "Conv2DKFACReduce", "Conv2DKLShampoo",
    "Conv2DOptimalKronecker", "Conv2DShampoo", "Conv2DShampoo2", "Conv2DSOAP",
    "Conv2DTNT", "DenseEKFAC", "DenseKLShampoo", "DenseOptimalKronecker",
    "DenseShampoo",
    "DenseShampoo2", "DenseSOAP", "DenseTNT", "EKFAC", "EmbeddingDiagonal",
    "EmbeddingEKFAC", "EmbeddingFull", "EmbeddingKFAC", "EmbeddingKLShampoo",
    "EmbeddingOptimalKronecker", "EmbeddingShampoo", "EmbeddingShampoo2",
    "EmbeddingSOAP", "EmbeddingTNT", "NaiveTNT",
    "RepeatedDenseKFACExpand", "RepeatedDenseKFACReduce", "Conv2DDiagonal", "Conv2DFull",
    "Conv2DTwoKroneckerFactored", "CurvatureBlock", "DenseDiagonal",
    "DenseFull", "DenseTwoKroneckerFactored", "Diagonal", "ExplicitFull",
    "Full", "NaiveDiagonal", "NaiveFull", "RepeatedDenseTwoKroneckerFactored",
    "ScaleAndShiftDiagonal", "ScaleAndShiftFull", "ScaledIdentity", "Stacked",
    "TwoKroneckerFactored",
    "get_default_eigen_decomposition_threshold", "get_max_parallel_elements",
    "set_default_eigen_decomposition_threshold", "set_max_parallel_elements",
    # curvature estimators
    "BlockDiagonalCurvature", "BlockTridiagonalCurvature",
    "CurvatureEstimator", "ESTIMATION_MODES",
    "ExplicitExactCurvature", "ImplicitExactCurvature",
    "default_batch_size_extractor", "get_default_tag_to_block_ctor",
    "set_default_tag_to_block_ctor",
    # automatic layer registration
    "DEFAULT_GRAPH_PATTERNS", "GraphMatcherComparator", "GraphPattern",
    "TaggedFunction", "auto_register_tags", "registration_report",
    # optimizer and optax preconditioner
    "Optimizer", "OptaxPreconditionState", "OptaxPreconditioner",
    # losses
    "CategoricalLogitsNegativeLogProbLoss", "DistributionNegativeLogProbLoss",
    "LossFunction", "MultiBernoulliNegativeLogProbLoss", "NegativeLogProbLoss",
    "NormalMeanNegativeLogProbLoss", "NormalMeanVarianceNegativeLogProbLoss",
    "OneHotCategoricalLogitsNegativeLogProbLoss",
    "register_categorical_predictive_distribution",
    "register_multi_bernoulli_predictive_distribution",
    "register_normal_predictive_distribution",
    "register_sigmoid_cross_entropy_loss",
    "register_softmax_cross_entropy_loss", "register_squared_error_loss",
    # convolution patches
    "patches_moments", "patches_moments_explicit",
    # tags
    "LayerTag", "LossTag", "register_conv2d", "register_dense",
    "register_embedding", "register_generic", "register_repeated_dense",
    "register_scale_and_shift",
    # tracer
    "ProcessedJaxpr", "StackedLayerTag", "TracingError", "layer_tags_vjp",
    "loss_tags_hvp", "loss_tags_jvp", "loss_tags_linearize", "loss_tags_vjp",
]
