"""Eigenvalue spectra of exact curvatures and their approximations.

Two methods, both comparing one configured `Curvature` with the exact matrix
it estimates (its `matrix`: GGN, Fisher or empirical Fisher; or the Hessian):

- `dense` (small models): every matrix is formed densely; all eigenvalues,
  the Frobenius error, the damped natural-gradient cosine and the top-k
  eigenspace overlap are exact.
- `lanczos` (large models): only matrix-vector products. Top-k eigenpairs by
  Lanczos, densities by stochastic Lanczos quadrature (SLQ, via `matfree`),
  the Frobenius error by Hutchinson probes and the exact direction by CG.
"""

from __future__ import annotations

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
from matfree import decomp

import estimators as kfac
from curvbench import metrics
from curvbench.curvatures import check_dense_fits

EXACT_MATRICES = ("ggn", "fisher", "empirical_fisher", "hessian")
_MODE_OF = {"ggn": "ggn_exact", "fisher": "fisher_exact",
            "empirical_fisher": "fisher_empirical"}


def exact_dense(loss_fn, params, batch, matrix: str, rng) -> np.ndarray:
  """The exact `matrix` (one of `EXACT_MATRICES`) as a dense numpy array."""
  if matrix not in EXACT_MATRICES:
    raise ValueError(f"Unknown exact matrix {matrix!r}; choose from "
                     f"{', '.join(EXACT_MATRICES)}.")
  if matrix == "hessian":
    implicit = kfac.ImplicitExactCurvature(loss_fn)
    dense = jax.jit(lambda p, b: implicit.to_dense_matrix((p, b), "hessian"))(
        params, batch)
    return np.asarray(dense, np.float64)
  est = kfac.ExplicitExactCurvature(loss_fn,
                                    default_estimation_mode=_MODE_OF[matrix])
  state = est.init(rng, (params, batch))
  state = jax.jit(lambda s: est.update_curvature_matrix_estimate(
      s, 0.0, 1.0, len(batch[0]), rng, (params, batch),
      estimation_mode=_MODE_OF[matrix]))(state)
  return np.asarray(est.to_dense_matrix(state), np.float64)


def estimate(curvature, params, batch, rng, num_samples: int = 1):
  """The curvature's state averaged over `num_samples` draws on one batch."""
  state = curvature.init(rng, params, batch)
  update = jax.jit(curvature.update)
  for i, key in enumerate(jax.random.split(rng, num_samples)):
    state = update(state, params, batch, key, i / (i + 1), 1 / (i + 1))
  return state


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
  num = int(sum(np.size(x) for x in jax.tree.leaves(params)))
  check_dense_fits(num, 8, float(cfg.get("max_dense_gib", 2.0)),
                   "The dense spectra method",
                   "use measure.spectra.method=lanczos (matrix-free)")
  references = list(cfg.get("references", EXACT_MATRICES))
  if curvature.matrix not in references:
    references.append(curvature.matrix)
  exact = {m: exact_dense(loss_fn, params, batch, m, rng) for m in references}
  reference = exact[curvature.matrix]
  exact_eigs, exact_vecs = np.linalg.eigh(reference)
  spectra = []
  for m, matrix in exact.items():
    values = exact_eigs if m == curvature.matrix else np.linalg.eigvalsh(matrix)
    spectra += _spectrum_rows("exact", m, values)

  state = estimate(curvature, params, batch, rng,
                   int(cfg.get("num_samples", 1)))
  approx = np.asarray(jax.jit(curvature.to_dense)(state), np.float64)
  approx = 0.5 * (approx + approx.T)
  approx_eigs = np.sort(np.asarray(jax.jit(curvature.eigenvalues)(state),
                                   np.float64))
  spectra += _spectrum_rows("approx", curvature.label, approx_eigs,
                            reference=curvature.matrix)

  damping, k = float(cfg.get("damping", 1e-3)), int(cfg.get("top_k", 10))
  floor = float(cfg.get("relative_floor", 1e-8)) * np.max(np.abs(exact_eigs))
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

def _flat_matvec(product, params):
  unravel = jax.flatten_util.ravel_pytree(params)[1]
  return jax.jit(lambda v: jax.flatten_util.ravel_pytree(
      product(unravel(v)))[0])


def lanczos_top_k(matvec, dim: int, k: int, iters: int, rng, dtype):
  """Largest `k` Ritz values and vectors (columns) of a symmetric operator."""
  iters = min(max(iters, k), dim)
  v0 = jax.random.normal(rng, (dim,), dtype)
  q, t, *_ = decomp.tridiag_sym(iters)(matvec, v0)
  vals, vecs = jnp.linalg.eigh(t)
  ritz = np.asarray(vecs.T @ q).T  # (dim, iters)
  return np.asarray(vals)[::-1][:k], ritz[:, ::-1][:, :k]


def slq(matvec, dim: int, iters: int, probes: int, rng, dtype):
  """SLQ nodes and weights: a spectral density as weighted Ritz values."""
  iters = min(iters, dim)
  tridiag = decomp.tridiag_sym(iters)
  nodes, weights = [], []
  for key in jax.random.split(rng, probes):
    v = jax.random.rademacher(key, (dim,), dtype)
    _, t, *_ = tridiag(matvec, v)
    vals, vecs = jnp.linalg.eigh(t)
    nodes.append(np.asarray(vals))
    weights.append(np.asarray(vecs[0] ** 2) / probes)
  return np.concatenate(nodes), np.concatenate(weights)


def measure_lanczos(loss_fn, curvature, params, batch, cfg, rng):
  """Spectrum and quality rows from matrix-vector products only."""
  if curvature.matrix == "empirical_fisher":
    raise ValueError("The lanczos spectra method has no matrix-free exact "
                     "empirical Fisher; use measure.spectra.method=dense.")
  flat = jax.flatten_util.ravel_pytree(params)[0]
  dim, dtype = flat.size, flat.dtype
  implicit = kfac.ImplicitExactCurvature(loss_fn)
  exact_product = getattr(implicit, f"multiply_{curvature.matrix}")
  exact_mv = _flat_matvec(lambda v: exact_product((params, batch), v), params)
  state = estimate(curvature, params, batch, rng,
                   int(cfg.get("num_samples", 1)))
  approx_mv = _flat_matvec(lambda v: curvature.multiply(state, v), params)

  k, iters = int(cfg.get("top_k", 10)), int(cfg.get("lanczos_iters", 60))
  probes = int(cfg.get("slq_probes", 4))
  keys = jax.random.split(rng, 4)
  spectra = []
  ex_nodes, ex_w = slq(exact_mv, dim, iters, probes, keys[0], dtype)
  ap_nodes, ap_w = slq(approx_mv, dim, iters, probes, keys[0], dtype)
  spectra += _spectrum_rows("exact", curvature.matrix, ex_nodes, ex_w)
  spectra += _spectrum_rows("approx", curvature.label, ap_nodes, ap_w,
                            reference=curvature.matrix)
  ex_top, ex_vecs = lanczos_top_k(exact_mv, dim, k, iters, keys[1], dtype)
  ap_top, ap_vecs = lanczos_top_k(approx_mv, dim, k, iters, keys[1], dtype)

  # Hutchinson: E||(A - E)v||^2 / E||E v||^2 with Rademacher probes.
  num, den = 0.0, 0.0
  for key in jax.random.split(keys[2], int(cfg.get("frobenius_probes", 8))):
    v = jax.random.rademacher(key, (dim,), dtype)
    ev = np.asarray(exact_mv(v), np.float64)
    num += np.sum((np.asarray(approx_mv(v), np.float64) - ev) ** 2)
    den += np.sum(ev ** 2)

  damping = float(cfg.get("damping", 1e-3))
  grads = jax.grad(loss_fn)(params, batch)
  g = jax.flatten_util.ravel_pytree(grads)[0]
  exact_dir, _ = jax.scipy.sparse.linalg.cg(
      lambda x: exact_mv(x) + damping * x, g,
      maxiter=int(cfg.get("cg_iters", 100)))
  floor = float(cfg.get("relative_floor", 1e-8)) * float(np.max(np.abs(ex_top)))
  quality = _quality_rows(curvature.matrix, dict(
      relative_frobenius=np.sqrt(num / den),
      log_wasserstein=metrics.log_wasserstein(ap_nodes, ex_nodes, floor,
                                              ap_w, ex_w),
      natural_gradient_cosine=metrics.cosine(
          _approx_direction(curvature, state, grads, damping), exact_dir),
      top_k_overlap=metrics.subspace_overlap(ap_vecs, ex_vecs),
      top_eigenvalue_ratio=ap_top[0] / ex_top[0]))
  for i, v in enumerate(ex_top):
    spectra.append(dict(source="exact_top_k", matrix=curvature.matrix,
                        reference=curvature.matrix, index=i,
                        eigenvalue=float(v), weight=np.nan))
  return spectra, quality


def measure(loss_fn, curvature, params, batch, cfg, rng):
  """Dispatches on `cfg["method"]` ('dense' or 'lanczos')."""
  method = cfg.get("method", "dense")
  if method == "dense":
    return measure_dense(loss_fn, curvature, params, batch, cfg, rng)
  if method == "lanczos":
    return measure_lanczos(loss_fn, curvature, params, batch, cfg, rng)
  raise ValueError(f"Unknown spectra method {method!r}; use 'dense' or "
                   "'lanczos'.")
