"""Shared utilities: moving averages, PSD linear algebra, pytree helpers."""

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
                                     scalar_mul, unflatten_vector)

__all__ = [
    "WeightedMovingAverage", "flatten_arrays", "gram_matrix", "inner_product",
    "inverse_root_multiply", "is_tracer", "kronecker_eigen_multiply",
    "kronecker_product_eigenvalues", "limit_lapack_threads",
    "psd_inverse", "psd_inverse_root",
    "pi_adjusted_kronecker_damping", "product", "psd_eigvalsh",
    "psd_matrix_power", "safe_psd_eigh", "scalar_mul", "symmetrize",
    "unflatten_vector",
]
