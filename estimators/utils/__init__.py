"""Shared utilities: moving averages, PSD linear algebra, pytree helpers,
cross-device reductions and the type names KFAC-JAX code annotates with."""

from estimators.utils import newton
from estimators.utils.collectives import in_pmap, pmean_if_pmap, psum_if_pmap
from estimators.utils.linalg import (inverse_root_multiply,
                                     kronecker_eigen_multiply,
                                     kronecker_product_eigenvalues,
                                     limit_lapack_threads,
                                     pi_adjusted_kronecker_damping,
                                     psd_inverse, psd_inverse_root,
                                     psd_eigvalsh, psd_matrix_power,
                                     safe_psd_eigh, symmetrize)
from estimators.utils.moving_average import WeightedMovingAverage
from estimators.utils.pytree import (flatten_arrays, gram_matrix,
                                     inner_product, is_tracer, product,
                                     unflatten_vector)
from estimators.utils.tree_math import (default_batch_size_extractor,
                                        first_dim_is_size, norm, scalar_div,
                                        scalar_mul, squared_norm,
                                        weighted_sum_of_objects)
from estimators.utils.types import (Array, Batch, DType, Func, FuncArgs,
                                    FuncAux, FuncOuts, FuncState, Numeric,
                                    Params, PRNGKey, PyTree, PyTreeDef, Scalar,
                                    ScalarOrSequence, Shape, StateType,
                                    ValueAndGradFunc, ValueFunc)

__all__ = [
    # types
    "Array", "Batch", "DType", "Func", "FuncArgs", "FuncAux", "FuncOuts",
    "FuncState", "Numeric", "Params", "PRNGKey", "PyTree", "PyTreeDef",
    "Scalar", "ScalarOrSequence", "Shape", "StateType", "ValueAndGradFunc",
    "ValueFunc",
    # batches and devices
    "default_batch_size_extractor", "first_dim_is_size", "in_pmap",
    "pmean_if_pmap", "psum_if_pmap",
    # pytree math
    "flatten_arrays", "gram_matrix", "inner_product", "is_tracer", "norm",
    "product", "scalar_div", "scalar_mul", "squared_norm",
    "unflatten_vector", "weighted_sum_of_objects",
    # linear algebra and moving averages
    "WeightedMovingAverage", "inverse_root_multiply",
    "kronecker_eigen_multiply", "kronecker_product_eigenvalues",
    "limit_lapack_threads", "psd_inverse", "psd_inverse_root",
    "pi_adjusted_kronecker_damping", "psd_eigvalsh", "psd_matrix_power",
    "safe_psd_eigh", "symmetrize", "newton",
]

