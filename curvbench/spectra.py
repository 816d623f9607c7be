"""Eigenvalue spectra of exact curvatures and their approximations.

Two methods, both comparing one configured `Curvature` with the exact matrix
it estimates (its `matrix`: GGN, Fisher or empirical Fisher; or the Hessian):

- `dense` (small models): every matrix is formed densely; all eigenvalues,
  the Frobenius error, the damped natural-gradient cosine and the top-k
  eigenspace overlap are exact.
- `lanczos` (large models): only matrix-vector products. Top-k eigenpairs by
  Lanczos, densities by stochastic Lanczos quadrature (SLQ) and the Frobenius
  error by Hutchinson probes (all from matfree, see `curvbench.matrix_free`),
  and the exact direction by CG.
"""

from __future__ import annotations

import jax
import jax.flatten_util
import numpy as np

from curvbench import curvatures, matrix_free, metrics



def exact_dense(loss_fn, params, batch, matrix: str, rng) -> np.ndarray:
  """The exact `matrix` (one of `curvatures.EXACT_MATRICES`) as a dense
  float64 numpy array."""
  exact = curvatures.exact(matrix, loss_fn, matrix_free=False)
  state = curvatures.estimate(exact, rng, params, batch)
  return np.asarray(jax.jit(exact.to_dense)(state), np.float64)


def _approx_direction(curvature, state, grads, damping):
  state = jax.jit(curvature.refresh)(state, damping)
  direction = jax.jit(curvature.precondition)(state, grads, damping)
  return np.asarray(jax.flatten_util.ravel_pytree(direction)[0], np.float64)


def _spectrum_rows(source, matrix, values, weights=None, reference=None):
  values = np.asarray(values, np.float64)
  weights = (np.full(len(values), 1 / len(values)) if weights is None
             else np.asarray(weights, np.float64))
  return [dict(source=source, matrix=matrix, reference=reference or matrix,
               index=i, eigenvalue=float(v), weight=float(w))
          for i, (v, w) in enumerate(zip(values, weights))]


def _quality_rows(reference, values: dict):
  return [dict(reference=reference, metric=k, value=float(v))
          for k, v in values.items()]


def measure_dense(loss_fn, curvature, params, batch, cfg, rng):
  """Spectrum and quality rows for a model small enough for dense matrices."""
  curvatures.check_dense_fits(
      curvatures.num_params(params), 8, float(cfg["max_dense_gib"]),
      "The dense spectra method",
      "use measure.spectra.method=lanczos (matrix-free)")
  references = list(cfg["references"])
  if curvature.matrix not in references:
    references.append(curvature.matrix)
  exact = {m: exact_dense(loss_fn, params, batch, m, rng) for m in references}
  reference = exact[curvature.matrix]
  exact_eigs, exact_vecs = np.linalg.eigh(reference)
  spectra = []
  for m, matrix in exact.items():
    values = exact_eigs if m == curvature.matrix else np.linalg.eigvalsh(matrix)
    spectra += _spectrum_rows("exact", m, values)

  state = curvatures.estimate(curvature, rng, params, batch,
                              int(cfg["num_samples"]))
  approx = np.asarray(jax.jit(curvature.to_dense)(state), np.float64)
  approx = 0.5 * (approx + approx.T)
  approx_eigs = np.sort(np.asarray(jax.jit(curvature.eigenvalues)(state),
                                   np.float64))
  spectra += _spectrum_rows("approx", curvature.label, approx_eigs,
                            reference=curvature.matrix)

  damping, k = float(cfg["damping"]), int(cfg["top_k"])
  floor = float(cfg["relative_floor"]) * np.max(np.abs(exact_eigs))
  grads = jax.grad(loss_fn)(params, batch)
  g = np.asarray(jax.flatten_util.ravel_pytree(grads)[0], np.float64)
  exact_dir = exact_vecs @ ((exact_vecs.T @ g) / (exact_eigs + damping))
  quality = _quality_rows(curvature.matrix, dict(
      relative_frobenius=metrics.relative_frobenius(approx, reference),
      log_wasserstein=metrics.log_wasserstein(approx_eigs, exact_eigs, floor),
      natural_gradient_cosine=metrics.cosine(
          _approx_direction(curvature, state, grads, damping), exact_dir),
      top_k_overlap=metrics.subspace_overlap(
          metrics.top_eigenvectors(approx, k), exact_vecs[:, ::-1][:, :k]),
      top_eigenvalue_ratio=approx_eigs[-1] / exact_eigs[-1],
      trace_ratio=np.trace(approx) / np.trace(reference)))
  return spectra, quality


# --- matrix-free method ------------------------------------------------------

def _columns(vectors) -> np.ndarray:
  """A pytree of k stacked vectors as a (dim, k) float64 matrix."""
  flat = jax.vmap(lambda v: jax.flatten_util.ravel_pytree(v)[0])(vectors)
  return np.asarray(flat, np.float64).T


def measure_lanczos(loss_fn, curvature, params, batch, cfg, rng):
  """Spectrum and quality rows from matrix-vector products only (matfree's
  Lanczos, SLQ and Monte-Carlo estimators, see `curvbench.matrix_free`)."""
  exact = curvatures.exact(curvature.matrix, loss_fn, matrix_free=True,
                           cg_iters=int(cfg["cg_iters"]))
  exact_state = exact.init(rng, params, batch)
  state = curvatures.estimate(curvature, rng, params, batch,
                              int(cfg["num_samples"]))
  exact_mv = lambda v, s: exact.multiply(s, v)
  approx_mv = lambda v, s: curvature.multiply(s, v)

  k, iters = int(cfg["top_k"]), int(cfg["lanczos_iters"])
  probes = int(cfg["slq_probes"])
  keys = jax.random.split(rng, 4)
  ex_nodes, ex_w = matrix_free.slq_density(exact_mv, params, iters, probes,
                                           keys[0], exact_state)
  ap_nodes, ap_w = matrix_free.slq_density(approx_mv, params, iters, probes,
                                           keys[0], state)
  spectra = (_spectrum_rows("exact", curvature.matrix, ex_nodes, ex_w)
             + _spectrum_rows("approx", curvature.label, ap_nodes, ap_w,
                              reference=curvature.matrix))
  ex_top, ex_vecs = matrix_free.top_k_eigenpairs(exact_mv, params, k, iters,
                                                 keys[1], exact_state)
  ap_top, ap_vecs = matrix_free.top_k_eigenpairs(approx_mv, params, k, iters,
                                                 keys[1], state)
  frobenius = matrix_free.relative_frobenius(
      lambda v, a, e: curvature.multiply(a, v),
      lambda v, a, e: exact.multiply(e, v), params,
      int(cfg["frobenius_probes"]), keys[2], state, exact_state)

  damping = float(cfg["damping"])
  grads = jax.grad(loss_fn)(params, batch)
  exact_dir = jax.flatten_util.ravel_pytree(jax.jit(exact.precondition)(
      exact_state, grads, damping))[0]
  floor = float(cfg["relative_floor"]) * float(np.max(np.abs(ex_top)))
  quality = _quality_rows(curvature.matrix, dict(
      relative_frobenius=frobenius,
      log_wasserstein=metrics.log_wasserstein(ap_nodes, ex_nodes, floor,
                                              ap_w, ex_w),
      natural_gradient_cosine=metrics.cosine(
          _approx_direction(curvature, state, grads, damping), exact_dir),
      top_k_overlap=metrics.subspace_overlap(_columns(ap_vecs),
                                             _columns(ex_vecs)),
      top_eigenvalue_ratio=ap_top[0] / ex_top[0]))
  for i, v in enumerate(ex_top):
    spectra.append(dict(source="exact_top_k", matrix=curvature.matrix,
                        reference=curvature.matrix, index=i,
                        eigenvalue=float(v), weight=np.nan))
  return spectra, quality


METHODS = {"dense": measure_dense, "lanczos": measure_lanczos}


def measure(loss_fn, curvature, params, batch, cfg, rng):
  """Spectrum and quality rows by `cfg["method"]` (one of `METHODS`)."""
  if cfg["method"] not in METHODS:
    raise ValueError(f"Unknown measure.spectra.method {cfg['method']!r}; "
                     f"choose one of {', '.join(METHODS)}.")
  return METHODS[cfg["method"]](loss_fn, curvature, params, batch, cfg, rng)
