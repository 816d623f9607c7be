"""Linear algebra on symmetric positive semi-definite (PSD) matrices."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from estimators.utils import newton
from estimators.utils.array_math import symmetric_gram

# The inverse Cholesky root of `psd_inverse_root`: a lower-triangular array,
# or `(top, below, bottom)` blocks for a big matrix.
InverseRoot = jax.Array | tuple


def symmetrize(matrix: jax.Array) -> jax.Array:
  """The symmetric part of a matrix (or of a stack of matrices).

  Args:
    matrix: an array whose last two axes are square.

  Returns:
    `(matrix + matrixᵀ) / 2`, transposing the last two axes.
  """
  return (matrix + jnp.swapaxes(matrix, -1, -2)) / 2


def _host_eigh(matrix: jax.Array) -> tuple[jax.Array, jax.Array]:
  # NumPy's LAPACK on the host, called back from the compiled program.
  shapes = (
    jax.ShapeDtypeStruct(matrix.shape[:-1], matrix.dtype),
    jax.ShapeDtypeStruct(matrix.shape, matrix.dtype),
  )
  return jax.pure_callback(
    lambda m: tuple(np.asarray(a, m.dtype) for a in np.linalg.eigh(m)),
    shapes,
    matrix,
  )


def safe_psd_eigh(
  x: jax.Array, force_on_host: bool = False
) -> tuple[jax.Array, jax.Array]:
  """Eigendecomposition of a matrix that should be PSD up to round-off.

  The input is symmetrised first (round-off makes estimates slightly
  asymmetric) and the eigenvalues are clipped at zero, since negative ones can
  only come from round-off and would make fractional powers NaN.

  Args:
    x: a square matrix.
    force_on_host: compute the decomposition with NumPy on the host CPU
      (a callback from the compiled program) instead of on the device.

  Returns:
    `(eigenvalues, eigenvectors)`: ascending eigenvalues, clipped at zero,
    and the eigenvectors as columns.
  """
  matrix = symmetrize(x)
  if force_on_host:
    values, vectors = _host_eigh(matrix)
  else:
    values, vectors = jnp.linalg.eigh(matrix)
  return jnp.maximum(values, 0), vectors


def psd_eigvalsh(matrix: jax.Array) -> jax.Array:
  """The eigenvalues of a matrix that should be PSD up to round-off.

  Args:
    matrix: a square matrix; it is symmetrised first.

  Returns:
    Its eigenvalues in ascending order, clipped at zero.
  """
  return jnp.maximum(jnp.linalg.eigvalsh(symmetrize(matrix)), 0)


def psd_matrix_power(matrix: jax.Array, power: float) -> jax.Array:
  """A power of a PSD matrix.

  Power 1 returns the matrix, power -1 uses a Cholesky solve (exact for a
  positive definite input), any other power goes through `safe_psd_eigh`.
  Inside `newton.by_products` every other power is an inverse p-th root
  from the Newton iteration instead (matrix products only).

  Args:
    matrix: a PSD matrix (positive definite for negative powers).
    power: a Python scalar, known at trace time.

  Returns:
    `matrix ** power` in the matrix sense.
  """
  power = float(power)
  n = matrix.shape[-1]
  if power == 1:
    return matrix
  if power == 0:
    return jnp.eye(n, dtype=matrix.dtype)
  if newton.active():
    return newton.requested_power(matrix, newton.root_order(power))
  if power == -1:
    return psd_inverse(matrix)
  values, vectors = safe_psd_eigh(matrix)
  return (vectors * values**power) @ vectors.T


# Largest matrix inverted through one LAPACK Cholesky factor; bigger ones are
# split (see `psd_inverse`).
_LAPACK_MAX_SIZE = 512


def psd_inverse(matrix: jax.Array) -> jax.Array:
  """Inverse of a positive definite matrix through its Cholesky factor `L`.

  The inverse is assembled from the blocks of the inverse Cholesky root
  (`psd_inverse_root`): a leaf root gives `L⁻ᵀ L⁻¹`, and a split one, with
  `K = A21 A11⁻¹ = L21 L11⁻¹`, gives `[[A11⁻¹ + Kᵀ S⁻¹ K, -(S⁻¹ K)ᵀ],
  [-S⁻¹ K, S⁻¹]]` for the Schur complement `S = A22 - L21 L21ᵀ`. Almost all
  the work is matrix products, which XLA runs on all cores, and the few
  LAPACK calls keep the compiled program small. (Forming the Schur
  complement as `A22 - K A12` saves a product but lost positive definiteness
  in float32 once the damping got small.)

  Args:
    matrix: a positive definite matrix.

  Returns:
    Its inverse, symmetric by construction.
  """
  return _inverse_from_root(_inverse_root_blocks(symmetrize(matrix)))


def psd_inverse_root(matrix: jax.Array) -> InverseRoot:
  """`L⁻¹` for the lower Cholesky factor `L` of a positive definite matrix.

  `matrix⁻¹ = L⁻ᵀ L⁻¹`; apply it with `inverse_root_multiply`. Up to
  `_LAPACK_MAX_SIZE` rows the root is a lower-triangular array. A bigger
  matrix gives `(top, below, bottom)`: the root of its leading block, the
  block `L21` of `L` and the root of the Schur complement `A22 - L21 L21ᵀ`,
  as `L⁻¹ = [[top, 0], [-bottom L21 top, bottom]]` needs nothing else. In
  these blocks the refresh is a blocked Cholesky factorisation (about n³/4
  multiply-adds against 2n³/3 for the assembled root) and applying the root
  reads only its nonzero half. Only the upper triangle of `matrix` is read:
  averaging away an estimate's round-off asymmetry would cost a transposing
  pass over a big matrix.

  Inside `newton.by_products` the root is the symmetric `matrix^(-1/2)`
  from the Newton iteration instead, which serves the same purpose
  (`Rᵀ R = matrix⁻¹`).

  Args:
    matrix: a positive definite matrix.

  Returns:
    `L⁻¹`, as a lower-triangular array or as `(top, below, bottom)` blocks.
  """
  if newton.active():
    return newton.requested_power(matrix, 2)
  return _inverse_root_blocks(matrix)


def _inverse_root_blocks(matrix):
  n = matrix.shape[-1]
  if n <= _LAPACK_MAX_SIZE:
    return _leaf_root(matrix)
  h = n // 2
  top = _inverse_root_blocks(matrix[:h, :h])
  below = inverse_root_multiply(top, matrix[:h, h:]).T  # L21 = A12ᵀ L11⁻ᵀ
  return top, below, _inverse_root_blocks(matrix[h:, h:] - below @ below.T)


def inverse_root_multiply(
  root: InverseRoot, matrix: jax.Array, transpose: bool = False
) -> jax.Array:
  """Multiplies by an inverse Cholesky root, or by its transpose.

  Args:
    root: `L⁻¹` as returned by `psd_inverse_root`.
    matrix: the matrix (or vector) to multiply, rows matching `L`.
    transpose: multiply by `L⁻ᵀ` instead of `L⁻¹`.

  Returns:
    `L⁻¹ matrix`, or `L⁻ᵀ matrix` when `transpose`.
  """
  if not isinstance(root, tuple):
    return (root.T if transpose else root) @ matrix
  top, below, bottom = root
  h = below.shape[1]
  if transpose:
    last = inverse_root_multiply(bottom, matrix[h:], transpose=True)
    first = inverse_root_multiply(
      top, matrix[:h] - below.T @ last, transpose=True
    )
    return jnp.concatenate([first, last])
  first = inverse_root_multiply(top, matrix[:h])
  last = inverse_root_multiply(bottom, matrix[h:] - below @ first)
  return jnp.concatenate([first, last])


def _leaf_root(matrix):
  # LAPACK reads column-major arrays and, told to use the lower triangle,
  # reads the upper one of the transpose (the same symmetric matrix). Without
  # the transpose XLA lays out the whole unsplit matrix column-major: a slow
  # transposing copy of a big factor.
  lower = jax.lax.linalg.cholesky(matrix.T, symmetrize_input=False)
  return jax.lax.linalg.triangular_solve(
    lower,
    jnp.eye(matrix.shape[-1], dtype=matrix.dtype),
    left_side=True,
    lower=True,
  )


def _inverse_from_root(root):
  """`L⁻ᵀ L⁻¹` from the blocks of `psd_inverse_root`."""
  if not isinstance(root, tuple):
    # As LAPACK's potri: one triangular solve gave `L⁻¹`, then a product,
    # which is cheaper than the two solves of `cho_solve` (a big one by
    # blocks above the diagonal only, `symmetric_gram`).
    return symmetric_gram(root)
  top_root, below, bottom_root = root
  top, bottom = _inverse_from_root(top_root), _inverse_from_root(bottom_root)
  gain = inverse_root_multiply(top_root, below.T, transpose=True).T  # K
  off = -bottom @ gain  # the (2, 1) block of the inverse
  return jnp.block([[top - gain.T @ off, off.T], [off, bottom]])


_lapack_threads_limited = False


# Process-wide on purpose: a jitted call returns before its LAPACK work runs
# (asynchronous dispatch), so no `with` block around the call could cover it.
def limit_lapack_threads() -> None:
  """Makes scipy's OpenBLAS, which jax's CPU LAPACK calls use, single-threaded.

  jax runs those LAPACK calls (eigh, Cholesky, triangular and LU solves,
  ...) inside XLA's own thread pool; OpenBLAS's extra worker threads then
  compete with it for cores, and on a busy machine a small factorisation
  waits for them far longer than it computes (on 2 cores, one of them
  busy: an EKFAC update of a small MLP, 190 ms at 2 threads, 11 ms at 1).
  Big matrices get their parallelism from the matrix products of
  `psd_inverse` instead.
  Importing `estimators` calls this, so the limit holds for every LAPACK
  call the library makes, and for the caller's own jax LAPACK calls too.
  It runs once per process, touches only scipy's copy of OpenBLAS, and does
  nothing when `OPENBLAS_NUM_THREADS` is set (set it to keep your own
  thread count) or threadpoolctl is missing.
  """
  global _lapack_threads_limited
  if _lapack_threads_limited:
    return
  _lapack_threads_limited = True
  if "OPENBLAS_NUM_THREADS" in os.environ:
    return
  try:  # optional to the library: without them the limit is skipped
    import scipy.linalg.cython_lapack  # noqa: F401, PLC0415 - loads OpenBLAS
    import threadpoolctl  # noqa: PLC0415 - see above
  except ImportError:
    return
  for lib in threadpoolctl.ThreadpoolController().lib_controllers:
    if lib.internal_api == "openblas" and "scipy" in os.path.basename(
      os.path.dirname(lib.filepath)
    ):
      lib.set_num_threads(1)


# Once, here, rather than where each LAPACK call is traced: then no call
# site (the library's or one added later) can run before the limit.
limit_lapack_threads()


def _trace(matrix):
  # A strided slice of the diagonal: `jnp.trace` masks the whole matrix.
  return jnp.sum(matrix.reshape(-1)[:: matrix.shape[0] + 1])


def pi_adjusted_kronecker_damping(
  a: jax.Array, g: jax.Array, damping: float | jax.Array
) -> tuple[jax.Array, jax.Array]:
  """Splits `damping` between the factors of `a ⊗ g` (Martens & Grosse, 2015).

  With `pi = sqrt((tr a / dim a) / (tr g / dim g))` the Kronecker product of
  the two damped factors approximates `a ⊗ g + damping I`. When either
  normalised trace is zero the ratio is meaningless and `pi = 1` is used.

  Args:
    a: the first (input-side) factor, square.
    g: the second (output-side) factor, square.
    damping: the damping to add to the Kronecker product.

  Returns:
    `(a + pi * sqrt(damping) I, g + sqrt(damping) / pi I)`.
  """
  a_norm = _trace(a) / a.shape[0]
  g_norm = _trace(g) / g.shape[0]
  ok = (a_norm > 0) & (g_norm > 0)
  pi = jnp.sqrt(jnp.where(ok, a_norm, 1) / jnp.where(ok, g_norm, 1))
  root = jnp.sqrt(jnp.asarray(damping, a.dtype))
  return (
    a + pi * root * jnp.eye(a.shape[0], dtype=a.dtype),
    g + root / pi * jnp.eye(g.shape[0], dtype=g.dtype),
  )


def kronecker_product_eigenvalues(
  a_eigenvalues: jax.Array, g_eigenvalues: jax.Array
) -> jax.Array:
  """The eigenvalues of a Kronecker product from those of its factors.

  Args:
    a_eigenvalues: eigenvalues of the first factor `a`.
    g_eigenvalues: eigenvalues of the second factor `g`.

  Returns:
    The eigenvalues of `a ⊗ g`: every pairwise product, flattened with the
    index into `a_eigenvalues` varying slowest.
  """
  return jnp.outer(a_eigenvalues, g_eigenvalues).reshape(-1)


def kronecker_eigen_multiply(
  u_a: jax.Array, u_g: jax.Array, diagonal: jax.Array, matrix: jax.Array
) -> jax.Array:
  """Applies a spectral function of a Kronecker product to a matrix.

  With row-major `vec` and `(a ⊗ g) vec(V) = vec(a V g)`, this computes
  `(U_a ⊗ U_g) diag(vec diagonal) (U_a ⊗ U_g)ᵀ vec(matrix)`.

  Args:
    u_a: eigenvectors (columns) of the first factor `a`.
    u_g: eigenvectors (columns) of the second factor `g`.
    diagonal: the function's values at the eigenvalues of `a ⊗ g`, laid out
      as `(dim a, dim g)`.
    matrix: the `(dim a, dim g)` matrix to multiply.

  Returns:
    The product, shaped like `matrix`.
  """
  return u_a @ ((u_a.T @ matrix @ u_g) * diagonal) @ u_g.T
