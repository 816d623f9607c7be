"""Eigenvalue spectra of exact curvatures and their approximations.

`measure` compares one configured `Curvature` with the exact matrices
(GGN, Fisher, empirical Fisher, Hessian: the references asked for, and the
one it estimates, its `matrix`) at one point, over a `Data` (a batch, N
batches or the training split), and returns five tables:

- `spectra`: signed eigenvalues with weights (1/P for full spectra, Gauss
  weights for stochastic Lanczos quadrature), per matrix.
- `quality`: approximation-quality metrics against each reference
  (`reference`) for the whole network (`level='network'`, `block='all'`),
  for each layer block (`level='layer'`, `block` its name: the exact
  diagonal block against the approximation's) and for each block type
  (`level='role'`, `block` the role, e.g. 'attention': the sub-matrices
  over every parameter of the role's layers, cross-layer entries
  included; see `role_indices`). The natural-gradient cosine depends on
  the damping, so it is taken at each `relative_dampings` value rho
  (column `relative_damping`): each matrix damped by rho times its own
  largest eigenvalue (`scale`), so that matrices of different scale
  (K-FAC-reduce's trace is half the GGN's on some layers) are compared at
  the same effective damping. A reference that equals an earlier one (the
  Fisher and the GGN of the registered losses) gets no quality rows of
  its own: the `references` table says why. A metric the matrix-free
  method estimates from random probes (relative Frobenius and diagonal
  errors, the SLQ spectral distances) carries its standard error
  (`stderr`) and the probes that would bring that error to
  `target_precision` of its value (`probes_needed`); other metrics have
  NaN there (the dense method's are exact, Lanczos' and CG's no probe
  estimates).
- `statistics`: trace, condition number, outliers, negative mass, ... of
  each exact matrix and of the approximation (`stderr` 0 where exact);
  for each exact matrix M, how the mean gradient g lines up with it
  (`GRADIENT_SHARE`, `GRADIENT_ALIGNMENT`).
- `heatmaps`: the exact and approximate matrix and damped inverse over a
  few subsampled units of a few layers (as in Martens & Grosse 2015, Fig. 2).
- `references`: the relative Frobenius distance between each pair of
  exact matrices measured (`matrix` against `reference`; its standard
  error `relative_frobenius_stderr` where it is a probe estimate).

Two methods:

- `dense` (small models): every matrix is formed; everything is exact.
- `lanczos` (large models): only matrix-vector products. Top-k by Lanczos,
  densities by SLQ, Frobenius errors, traces (Hutchinson, XTrace) and
  diagonals by random probes (`curvbench.core.matrix_free`), exact directions by
  CG.

With `class_means` (a softmax cross-entropy classifier; `class_means.py`),
both add Papyan's class-mean test of the GGN's outliers: `spectra` rows of
source `class_means` (matrix `ggn`), the eigenvalues of the class-mean
matrix `G₁`, to set beside the exact GGN's top ones, and the `statistics`
row `class_mean_overlap` of the exact `ggn`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from typing import Any

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import threadpoolctl

from curvbench.core import curvatures, matrix_free, metrics
from curvbench.core.costs import Costs
from curvbench.core.data import Data
from curvbench.core.references import ReferenceStore, content_hash
from curvbench.measurements.spectra import class_means

TABLES = ("spectra", "quality", "statistics", "heatmaps", "references")
# Below this relative Frobenius distance two exact references are the
# same matrix (round-off of float64 products; matrix-free estimates
# of equal operators give exactly 0).
SAME = 1e-9
# The statistic of each exact matrix: the share of the mean gradient's
# squared norm in the span of its top_k eigenvectors.
GRADIENT_SHARE = "gradient_in_top_k"
# And `gᵀ M g / (||g|| ||M g||)` (Gur-Ari, Roberts & Dyer 2018, eq. 2).
GRADIENT_ALIGNMENT = "gradient_curvature_alignment"


def _flat(tree) -> np.ndarray:
  return np.asarray(jax.flatten_util.ravel_pytree(tree)[0], np.float64)


def _mean_gradient(loss_fn, params, data: Data):
  return data.mean(lambda b: jax.grad(loss_fn)(params, b))


def mean_gradient(loss_fn, params, data: Data):
  """The gradient of the loss averaged over every example of `data`."""
  return jax.jit(functools.partial(_mean_gradient, loss_fn))(params, data)


def _symmetric(matrix):
  return 0.5 * (matrix + matrix.T)


def _spectrum_rows(source, matrix, values, weights=None, reference=None):
  values = np.asarray(values, np.float64)
  weights = (
    np.full(len(values), 1 / len(values))
    if weights is None
    else np.asarray(weights, np.float64)
  )
  return [
    dict(
      source=source,
      matrix=matrix,
      reference=reference or matrix,
      index=i,
      eigenvalue=float(v),
      weight=float(w),
    )
    for i, (v, w) in enumerate(zip(values, weights))
  ]


def _quality_rows(
  reference,
  level,
  block,
  values: dict,
  errors: dict | None = None,
  precision: float = np.nan,
):
  """Rows of `values`, `{metric: value}` or `{(metric, rho): value}` for
  metrics taken at a relative damping; `errors`, `{metric: (standard
  error, probes)}` of the probe estimates among them, fills their
  `stderr` and `probes_needed` (for a relative standard error of
  `precision`: `matrix_free.probes_needed`), NaN for the others."""
  rows, errors = [], errors or {}
  for key, v in values.items():
    metric, rho = key if isinstance(key, tuple) else (key, np.nan)
    stderr, probes = errors.get(key, (np.nan, None))
    needed = (
      np.nan
      if probes is None
      else matrix_free.probes_needed(v, stderr, probes, precision)
    )
    rows.append(
      dict(
        reference=reference,
        level=level,
        block=block,
        metric=metric,
        relative_damping=rho,
        value=float(v),
        stderr=float(stderr),
        probes_needed=needed,
      )
    )
  return rows


def scale(eigenvalues) -> float:
  """The largest eigenvalue: the scale a relative damping multiplies (the
  same from a dense eigendecomposition and from Lanczos, which finds the
  top of a spectrum first)."""
  return float(np.max(np.asarray(eigenvalues, np.float64)))


def role_indices(blocks, roles: dict[str, str]) -> dict[str, np.ndarray]:
  """`{role: sorted ravel_pytree indices}` of the layer `blocks` (`(name,
  indices)`, as `curvatures.layer_blocks`) of each role (`roles`, by block
  name: `curvatures.block_roles`). Empty where one role holds every block:
  its parameters are the whole network's, measured already."""
  out: dict[str, list[np.ndarray]] = {}
  for name, idx in blocks:
    out.setdefault(roles[name], []).append(idx)
  if len(out) < 2:
    return {}
  return {role: np.sort(np.concatenate(idx)) for role, idx in out.items()}


def _statistic_rows(source, matrix, values: dict, stderr: dict | None = None):
  stderr = stderr or {}
  return [
    dict(
      source=source,
      matrix=matrix,
      statistic=k,
      value=float(v),
      stderr=float(stderr.get(k, 0.0)),
    )
    for k, v in values.items()
  ]


def floor(cfg, values) -> float:
  """The magnitude below which an eigenvalue counts as zero: the configured
  `relative_floor`, or ten round-offs of the measurement's precision where
  that is larger, times the largest magnitude in `values`. (A float32
  Lanczos run puts the null space at +-1e-8 of the top eigenvalue, which
  would otherwise read as negative mass.)"""
  eps = float(np.finfo(np.dtype(cfg.precision)).eps)
  relative = max(cfg.relative_floor, 10 * eps)
  return relative * float(np.nanmax(np.abs(values)))


def spectrum_statistics(values, cfg, weights=None, top=None) -> dict:
  """Statistics of a signed spectrum (weighted samples for SLQ); `top`: the
  largest eigenvalues where they are known better than from `values`.

  `condition_number` is over the eigenvalues above the relative floor (the
  rest count as the null space). Where the smallest of those lies within a
  decade of the floor, the spectrum runs on into the floor and the number
  measures the floor as much as the matrix: it is recorded as
  `condition_number_at_least` instead. `damped_condition_number` is that
  of the matrix plus `damping`, as a damped preconditioner sees it.
  """
  values = np.asarray(values, np.float64)
  top = np.sort(values)[::-1] if top is None else np.asarray(top)
  top = top[np.isfinite(top)]
  zero = floor(cfg, values)
  damping = cfg.damping
  lowest = float(values.min())
  kept = np.abs(values)[np.abs(values) > zero]
  at_floor = kept.size and kept.min() < 10 * zero
  condition = "condition_number_at_least" if at_floor else "condition_number"
  return {
    "max_eigenvalue": float(top[0]),
    "min_eigenvalue": lowest,
    condition: metrics.condition_number(values, zero),
    # What a damped preconditioner sees; undefined when indefinite.
    "damped_condition_number": (top[0] + damping) / (lowest + damping)
    if lowest + damping > 0
    else np.nan,
    "num_outliers": metrics.num_outliers(top, cfg.top_k),
    "negative_mass": metrics.negative_mass(values, weights, zero),
    "negative_ratio": metrics.negative_ratio(values, top[0]),
  }


# --- dense method ------------------------------------------------------------


def dense_exact(loss_fn, matrix, params, data, rng, costs, examples_interact):
  """The exact `matrix` over `data` as a dense array, a phase of `costs`.

  Per-example rows take each example alone, which a loss coupling its
  batch's examples (`examples_interact`: batch norm) does not allow: its
  matrices come from products through the whole batch.
  """
  exact = curvatures.exact(
    matrix,
    loss_fn,
    matrix_free=examples_interact or matrix in curvatures.DENSE_FROM_PRODUCTS,
  )

  return costs.call(
    f"exact {matrix}",
    lambda p, d, k: _symmetric(exact.to_dense(exact.estimate(k, p, d))),
    params,
    data,
    rng,
  )


def _stored(store, key, compute, costs, what):
  """`store.get(key, compute)`'s arrays; reading them is recorded in
  `costs` as phase `<what> (read from the reference store)`."""
  start = time.perf_counter()
  found, shared = store.get(key, compute)
  if shared:
    costs.record(
      f"{what} (read from the reference store)", time.perf_counter() - start
    )
  return found


def _exact_reference(
  loss_fn,
  matrix,
  params,
  data,
  rng,
  costs,
  store,
  key,
  examples_interact,
  parts=(),
):
  """`(dense matrix, (eigenvalues, eigenvectors), {part: its eigh})` of the
  exact `matrix` and of its diagonal sub-matrices over `parts` (`(name,
  indices)`: layer blocks, block types), from the `store` where another
  run computed them from the same content: they are the same whatever
  approximation a run compares with them."""

  def compute():
    dense = dense_exact(
      loss_fn, matrix, params, data, rng, costs, examples_interact
    )
    values, vectors = _eigh(costs, f"exact {matrix}", dense)
    found = dict(
      matrix=np.asarray(dense, np.float64),
      eigenvalues=values,
      eigenvectors=vectors,
    )
    for i, (name, idx) in enumerate(parts):
      found[f"values{i}"], found[f"vectors{i}"] = _eigh(
        costs, f"exact {matrix} {name}", dense[np.ix_(idx, idx)]
      )
    return found

  found = _stored(
    store,
    dict(
      key or {},
      matrix=matrix,
      parts=[(name, content_hash(idx)) for name, idx in parts],
    ),
    compute,
    costs,
    f"exact {matrix}",
  )
  return (
    found["matrix"],
    (found["eigenvalues"], found["eigenvectors"]),
    {
      name: (found[f"values{i}"], found[f"vectors{i}"])
      for i, (name, _) in enumerate(parts)
    },
  )


def _shared_mean_gradient(loss_fn, params, data, costs, store, key):
  """The mean gradient over `data`, a pytree like `params`, from the
  `store` where another run at the same point computed it."""

  def compute():
    grads = costs.call(
      "mean gradient", functools.partial(_mean_gradient, loss_fn), params, data
    )
    return dict(gradient=np.asarray(jax.flatten_util.ravel_pytree(grads)[0]))

  found = _stored(
    store,
    dict(key or {}, quantity="mean gradient"),
    compute,
    costs,
    "mean gradient",
  )
  return jax.flatten_util.ravel_pytree(params)[1](
    jnp.asarray(found["gradient"])
  )


# From this size on, a dense eigendecomposition runs LAPACK on every core.
MANY_CORES = 512


@contextlib.contextmanager
def _lapack_on(size: int):
  """LAPACK on every core this process may use for a big matrix. The
  library keeps it single-threaded for the small factorisations of its
  steps, which would otherwise wait on OpenBLAS's threads; one big
  eigendecomposition, run alone, gains from them (a 2,484-parameter GGN
  on 2 cores: 2.2 s alone, 1.4 s on both). OPENBLAS_NUM_THREADS, where
  set, is kept."""
  if size < MANY_CORES or "OPENBLAS_NUM_THREADS" in os.environ:
    yield
    return
  with threadpoolctl.threadpool_limits(
    len(os.sched_getaffinity(0)), user_api="blas"
  ):
    yield


def _eigh(costs, what, matrix):
  """`(eigenvalues, eigenvectors)` of `matrix` as float64 numpy arrays,
  computed by XLA on the run's device and recorded as phase `eigh {what}`
  (the call waits for its result, so LAPACK's threads are done within)."""
  with _lapack_on(matrix.shape[0]):
    values, vectors = costs.call(f"eigh {what}", jnp.linalg.eigh, matrix)
  return np.asarray(values, np.float64), np.asarray(vectors, np.float64)


def joined_eigh(approx, blocks, eighs):
  """The eigendecomposition of `approx` from those of its diagonal blocks
  (`eighs`, by block name), where it is block-diagonal over `blocks` (a
  block-diagonal estimator's): the same matrix decomposed, at a fraction
  of the cost. None where it is not."""
  size = len(approx)
  if sum(len(idx) for _, idx in blocks) != size:
    return None
  outside = np.ones(approx.shape, bool)
  for _, idx in blocks:
    outside[np.ix_(idx, idx)] = False
  if np.any(approx[outside]):
    return None
  values = np.concatenate([eighs[name][0] for name, _ in blocks])
  vectors = np.zeros(approx.shape)
  start = 0
  for name, idx in blocks:
    vectors[idx, start : start + len(idx)] = eighs[name][1]
    start += len(idx)
  order = np.argsort(values, kind="stable")
  return values[order], vectors[:, order]


def _blockwise_eigh(costs, what, matrix, blocks, eighs):
  """`matrix`'s eigendecomposition, joined from its diagonal `blocks`'
  (`joined_eigh`) where it is block-diagonal over them (phase `eigh <what>
  (from its blocks)`), else computed (phase `eigh <what>`)."""
  start = time.perf_counter()
  found = joined_eigh(matrix, blocks, eighs)
  if found is None:
    return _eigh(costs, what, matrix)
  costs.record(f"eigh {what} (from its blocks)", time.perf_counter() - start)
  return found


def dense_metrics(
  approx, exact, approx_dirs, exact_dirs, k, floor, approx_eigh, exact_eigh
) -> dict:
  """Quality of the dense `approx` against `exact`, given both damped
  natural-gradient directions at each relative damping (`{rho: vector}`)
  and both eigendecompositions; `{metric or (metric, rho): value}`."""
  approx, exact = np.asarray(approx, np.float64), np.asarray(exact, np.float64)
  approx_eigs, approx_vecs = approx_eigh
  exact_eigs, exact_vecs = exact_eigh
  k = min(k, len(exact_eigs))
  out: dict[Any, Any] = dict(
    relative_frobenius=metrics.relative_frobenius(approx, exact),
    cosine_similarity=metrics.cosine_similarity(approx, exact),
    spectral_distance=metrics.spectral_distance(approx_eigs, exact_eigs),
    log_wasserstein=metrics.log_wasserstein(approx_eigs, exact_eigs, floor),
    top_k_overlap=metrics.subspace_overlap(
      approx_vecs[:, ::-1][:, :k], exact_vecs[:, ::-1][:, :k]
    ),
    top_eigenvalue_ratio=approx_eigs[-1] / exact_eigs[-1],
    trace_ratio=np.trace(approx) / np.trace(exact),
    diagonal_relative_error=metrics.relative_frobenius(
      np.diag(approx), np.diag(exact)
    ),
  )
  for rho, direction in exact_dirs.items():
    out["natural_gradient_cosine", rho] = metrics.cosine(
      approx_dirs[rho], direction
    )
  return out


def _damped_solve(eigh, vector, damping):
  """`(M + damping I)^-1 vector` from M's eigendecomposition."""
  values, vectors = eigh
  return vectors @ ((vectors.T @ vector) / (values + damping))


def _relative_solves(eigh, vector, dampings) -> dict:
  """`{rho: (M + rho * scale(M) I)^-1 vector}` (`scale`)."""
  top = scale(eigh[0])
  return {rho: _damped_solve(eigh, vector, rho * top) for rho in dampings}


def heatmap_units(blocks, num_blocks: int, units: int) -> list[tuple]:
  """`(block name, indices)` of `units` evenly spaced parameters in each of
  the `num_blocks` middle layer blocks."""
  if num_blocks < 1 or units < 1:
    return []
  start = max(0, (len(blocks) - num_blocks) // 2)
  chosen = blocks[start : start + num_blocks]
  return [
    (
      name,
      idx[np.unique(np.linspace(0, len(idx) - 1, units).round().astype(int))],
    )
    for name, idx in chosen
  ]


def _heatmap_rows(source, kind, reference, sub, units):
  """Rows of `sub`, a matrix over the concatenated indices of `units`."""
  names = np.concatenate([[n] * len(i) for n, i in units])
  return [
    dict(
      source=source,
      kind=kind,
      reference=reference,
      row=r,
      col=c,
      row_block=names[r],
      col_block=names[c],
      value=float(sub[r, c]),
    )
    for r in range(len(names))
    for c in range(len(names))
  ]


def _distinct(references, exact: dict, rows: list) -> list[str]:
  """The references that equal no earlier one, recording in `rows` the
  relative Frobenius distance of each pair (`references` table)."""
  kept: list[str] = []
  for i, m in enumerate(references):
    distances = {
      o: metrics.relative_frobenius(exact[m], exact[o]) for o in references[:i]
    }
    rows += [
      dict(matrix=m, reference=o, relative_frobenius=d)
      for o, d in distances.items()
    ]
    if all(distances[o] > SAME for o in kept):
      kept.append(m)
  return kept


def _check_class_means(cfg, references, outputs) -> None:
  """Refuses `class_means` without what it needs: the GGN among the
  references, and the network's `outputs(params, inputs)`."""
  if not cfg.class_means:
    return
  if "ggn" not in references:
    raise ValueError(
      "measure.spectra.class_means=true compares the class means with the "
      f"exact GGN, which is not measured (references {references}): add "
      "ggn to measure.spectra.references."
    )
  if outputs is None:
    raise ValueError(
      "measure.spectra.class_means=true needs the network's outputs: pass "
      "outputs=problem.outputs to compute.measure."
    )


def _class_sums(outputs, params, data, costs):
  """`class_means.sums` over `data` as float64 numpy arrays, a phase of
  `costs`."""
  found = costs.call(
    "class means", lambda p, d: class_means.sums(outputs, p, d), params, data
  )
  return tuple(np.asarray(x, np.float64) for x in found)


def measure_dense(
  loss_fn,
  curvature,
  params,
  data,
  cfg,
  rng,
  costs,
  store=ReferenceStore(None),
  key=None,
  layer_roles=(),
  examples_interact=False,
  outputs=None,
):
  """Every table, from dense matrices (small models); the exact references
  from `store` where a run with the same content (`key` plus the
  parameters and examples) computed them; block types from the problem's
  `layer_roles` (`curvatures.block_role`). Where the loss couples the
  examples of a batch (`examples_interact`: batch norm), every exact
  matrix comes from products through the whole batch."""
  curvatures.check_dense_fits(
    curvatures.num_params(params),
    8,
    cfg.max_dense_gib,
    "The dense spectra method",
    "use measure.spectra.method=lanczos (matrix-free)",
  )
  references = list(dict.fromkeys([curvature.matrix, *cfg.references]))
  _check_class_means(cfg, references, outputs)
  if store.keeps:  # hashing the examples costs a pass over them
    key = dict(
      key or {},
      params=content_hash(params),
      data=content_hash(data.chunks, data.rest),
      precision=cfg.precision,
    )
  blocks = curvatures.layer_blocks(loss_fn, params, data.first)
  roles = curvatures.block_roles(loss_fn, params, data.first, layer_roles)
  types = role_indices(blocks, roles) if cfg.per_block_type else {}
  parts = [(f"block {name}", idx) for name, idx in blocks] + [
    (f"block type {role}", idx) for role, idx in types.items()
  ]
  exact, exact_eighs, part_eighs = {}, {}, {}
  for m in references:
    exact[m], exact_eighs[m], part_eighs[m] = _exact_reference(
      loss_fn, m, params, data, rng, costs, store, key, examples_interact, parts
    )
  tables: dict[str, list[dict]] = {name: [] for name in TABLES}
  for m, matrix in exact.items():
    values = exact_eighs[m][0]
    tables["spectra"] += _spectrum_rows("exact", m, values)
    tables["statistics"] += _statistic_rows(
      "exact",
      m,
      dict(trace=np.trace(matrix), **spectrum_statistics(values, cfg)),
    )
  compared = _distinct(references, exact, tables["references"])

  state = costs.call(
    "approx estimate",
    lambda p, d, k: curvature.estimate(k, p, d, cfg.num_samples),
    params,
    data,
    rng,
  )
  approx = costs.call(
    "approx dense", lambda s: _symmetric(curvature.to_dense(s)), state
  )
  block_eighs = {
    name: _eigh(costs, f"approx block {name}", approx[np.ix_(idx, idx)])
    for name, idx in blocks
  }
  approx = np.asarray(approx, np.float64)
  approx_eigh = _blockwise_eigh(costs, "approx", approx, blocks, block_eighs)
  approx_eigs = approx_eigh[0]
  tables["spectra"] += _spectrum_rows(
    "approx", curvature.label, approx_eigs, reference=curvature.matrix
  )
  tables["statistics"] += _statistic_rows(
    "approx",
    curvature.label,
    dict(trace=np.trace(approx), **spectrum_statistics(approx_eigs, cfg)),
  )

  damping, k, rhos = cfg.damping, cfg.top_k, cfg.relative_dampings
  grads = _shared_mean_gradient(loss_fn, params, data, costs, store, key)
  g = _flat(grads)
  for m, (values, vectors) in exact_eighs.items():
    top = vectors[:, np.argsort(values)[::-1][:k]]
    tables["statistics"] += _statistic_rows(
      "exact",
      m,
      {
        GRADIENT_SHARE: metrics.share_in_span(top, g),
        GRADIENT_ALIGNMENT: metrics.gradient_curvature_alignment(
          g, exact[m] @ g
        ),
      },
    )
  if cfg.class_means:
    found = _stored(
      store,
      dict(key or {}, quantity="class means"),
      lambda: dict(
        zip(("sums", "shares"), _class_sums(outputs, params, data, costs))
      ),
      costs,
      "class means",
    )
    deltas, shares, num_classes = class_means.class_means(
      (found["sums"], found["shares"])
    )
    values, vectors = exact_eighs["ggn"]
    top = vectors[:, np.argsort(values)[::-1][: len(shares)]]
    spectra_rows, statistic_rows = class_means.rows(
      deltas, shares, num_classes, top
    )
    tables["spectra"] += spectra_rows
    tables["statistics"] += statistic_rows
  # The approximation's own damped inverse, as its optimizer applies it.
  approx_scale = scale(approx_eigs)
  approx_dirs = {
    rho: _flat(
      costs.call(
        "approx direction",
        lambda s, v, d: curvature.precondition(curvature.refresh(s, d), v, d),
        state,
        grads,
        rho * approx_scale,
      )
    )
    for rho in rhos
  }
  for m in compared:
    tables["quality"] += _quality_rows(
      m,
      "network",
      "all",
      dense_metrics(
        approx,
        exact[m],
        approx_dirs,
        _relative_solves(exact_eighs[m], g, rhos),
        k,
        floor(cfg, exact_eighs[m][0]),
        approx_eigh,
        exact_eighs[m],
      ),
    )

  def quality_of(level, name, idx, what, a_eigh):
    """Quality rows of the sub-matrices over parameters `idx` against each
    reference, with the damped natural gradients of the sub-matrices
    (`a_eigh`: the approximation's sub-matrix decomposed)."""
    a = approx[np.ix_(idx, idx)]
    a_dirs = _relative_solves(a_eigh, g[idx], rhos)
    for m in compared:
      e_eigh = part_eighs[m][what]
      values = dense_metrics(
        a,
        exact[m][np.ix_(idx, idx)],
        a_dirs,
        _relative_solves(e_eigh, g[idx], rhos),
        k,
        floor(cfg, exact_eighs[m][0]),
        a_eigh,
        e_eigh,
      )
      tables["quality"] += _quality_rows(m, level, name, values)

  for name, idx in blocks:
    quality_of("layer", name, idx, f"block {name}", block_eighs[name])
  for role, idx in types.items():
    a_eigh = _blockwise_eigh(
      costs,
      f"approx block type {role}",
      approx[np.ix_(idx, idx)],
      [
        (name, np.searchsorted(idx, i))
        for name, i in blocks
        if roles[name] == role
      ],
      block_eighs,
    )
    quality_of("role", role, idx, f"block type {role}", a_eigh)

  reference, exact_eigh = exact[curvature.matrix], exact_eighs[curvature.matrix]
  units = heatmap_units(blocks, cfg.heatmap_blocks, cfg.heatmap_units)
  if units:
    idx = np.concatenate([i for _, i in units])
    unravel = jax.flatten_util.ravel_pytree(grads)[1]
    refreshed = costs.call(
      "approx refresh", lambda s: curvature.refresh(s, damping), state
    )
    # Columns idx of the approximation's own damped inverse (symmetric).
    columns = costs.call(
      "approx inverse columns",
      lambda s: jax.vmap(
        lambda e: jax.flatten_util.ravel_pytree(
          curvature.precondition(s, unravel(e), damping)
        )[0]
      )(jnp.eye(len(g), dtype=jnp.result_type(g))[idx]),
      refreshed,
    )
    vecs = exact_eigh[1][idx]
    exact_inverse = (vecs / (exact_eigh[0] + damping)) @ vecs.T
    for source, kind, sub in (
      ("exact", "matrix", reference[np.ix_(idx, idx)]),
      ("exact", "inverse", exact_inverse),
      ("approx", "matrix", approx[np.ix_(idx, idx)]),
      ("approx", "inverse", np.asarray(columns, np.float64)[:, idx]),
    ):
      tables["heatmaps"] += _heatmap_rows(
        source, kind, curvature.matrix, sub, units
      )
  return tables


# --- matrix-free method ------------------------------------------------------


def _columns(vectors) -> np.ndarray:
  """A pytree of k stacked vectors as a (dim, k) float64 matrix."""
  flat = jax.vmap(lambda v: jax.flatten_util.ravel_pytree(v)[0])(vectors)
  return np.asarray(flat, np.float64).T


def _block_mask(params, idx):
  flat, unravel = jax.flatten_util.ravel_pytree(params)
  return unravel(jnp.zeros_like(flat).at[idx].set(1))


def _masked(v, operator, mask):
  """`mask * (C (mask * v))`: an operator (`Curvature.operator`) restricted
  to a block (the whole network for a mask of ones)."""
  return jax.tree.map(
    jnp.multiply, mask, operator(jax.tree.map(jnp.multiply, mask, v))
  )


def _estimators(of, cfg) -> dict:
  """The matrix-free estimates of curvature `of`, each `fn(state, mask,
  key)`; the mask doubles as the shape template, so one compiled program
  serves the whole network and every block. Each builds `of.operator` once
  (for the exact curvatures, one forward pass for all its products)."""
  k, iters = cfg.top_k, cfg.lanczos_iters
  probes, traces = cfg.slq_probes, cfg.trace_probes
  return dict(
    density=lambda s, m, key: matrix_free.slq_density(
      _masked,
      m,
      iters,
      probes,
      key,
      of.operator(s),
      m,
      batch_size=cfg.probe_batch,
    ),
    top=lambda s, m, key: matrix_free.top_k_eigenpairs(
      _masked, m, k, iters, key, of.operator(s), m
    ),
    trace=lambda s, m, key: matrix_free.hutchinson_trace(
      _masked, m, traces, key, of.operator(s), m
    ),
    xtrace=lambda s, m, key: matrix_free.xtrace(
      _masked, m, traces, key, of.operator(s), m
    ),
  )


def _cells(params, blocks, groups: dict) -> tuple[np.ndarray, np.ndarray]:
  """`(cells, membership)` for `matrix_free.relative_diagonal_error`: each
  parameter's cell (its layer block's position in `blocks`, the layers
  being disjoint; one cell more for parameters in none) and a row per
  group of `groups` (`{key: layer block names}`, None: every parameter)
  marking its cells."""
  size = curvatures.num_params(params)
  cells = np.full(size, len(blocks), np.int32)
  for c, (_, idx) in enumerate(blocks):
    cells[idx] = c
  position = {name: c for c, (name, _) in enumerate(blocks)}
  membership = np.zeros((len(groups), len(blocks) + 1))
  for g, names in enumerate(groups.values()):
    if names is None:
      membership[g] = 1
    else:
      membership[g, [position[n] for n in names]] = 1
  return cells, membership


def _slq_distances(approx, exact, floor_, num_probes: int) -> tuple:
  """`({metric: value}, {metric: (jackknife standard error, probes)})` of
  the spectral distances between two SLQ densities (`(nodes, weights)`,
  probe by probe as `matrix_free.slq_density` gives them) drawn with the
  same probes: the error of leaving out each probe from both."""
  per_probe = [
    np.asarray(x, np.float64).reshape(num_probes, -1) for x in (*approx, *exact)
  ]
  metrics_of = dict(
    spectral_distance=lambda an, aw, en, ew: metrics.spectral_distance(
      an, en, aw, ew
    ),
    log_wasserstein=lambda an, aw, en, ew: metrics.log_wasserstein(
      an, en, floor_, aw, ew
    ),
  )
  values, errors = {}, {}
  for name, fn in metrics_of.items():
    of = lambda keep, fn=fn: fn(*(x[keep].ravel() for x in per_probe))
    values[name] = of(np.ones(num_probes, bool))
    errors[name] = (metrics.jackknife_stderr(of, num_probes), num_probes)
  return values, errors


def measure_lanczos(
  loss_fn,
  curvature,
  params,
  data,
  cfg,
  rng,
  costs,
  layer_roles=(),
  outputs=None,
):
  """Every table but the heatmaps, from matrix-vector products only: the
  density, top-k and statistics of each reference matrix and of the
  approximation, and the approximation's quality against each distinct
  reference (block types as in `measure_dense`).

  It has no `cosine_similarity`: the probes of the Frobenius estimate
  give `||A - E||_F / ||E||_F` and not the inner product `<A, E>_F` that
  the cosine needs; combining two separate probe estimates would leave it
  without a standard error. The class-mean overlap takes the GGN's top
  eigenvectors from a Lanczos run of its own, as many as the classes.
  """
  keys = jax.random.split(rng, 6)
  ones = jax.tree.map(jnp.ones_like, params)
  tables: dict[str, list[dict]] = {name: [] for name in TABLES}
  operators, states = {}, {}
  references = list(dict.fromkeys([curvature.matrix, *cfg.references]))
  _check_class_means(cfg, references, outputs)
  for m in references:
    operators[m] = curvatures.exact(
      m, loss_fn, matrix_free=True, cg_iters=cfg.cg_iters
    )
    states[m] = operators[m].estimate(rng, params, data)
  label = curvature.label
  operators[label] = curvature
  states[label] = costs.call(
    "approx estimate",
    lambda p, d, k: curvature.estimate(k, p, d, cfg.num_samples),
    params,
    data,
    rng,
  )
  estimators = {name: _estimators(of, cfg) for name, of in operators.items()}

  def run(name, kind, key, mask=ones, block=""):
    source = "approx" if name == label else f"exact {name}"
    phase = " ".join(filter(None, (source, kind, block)))
    return costs.call(phase, estimators[name][kind], states[name], mask, key)

  def frobenius(of, against, mask, block=""):
    """The relative Frobenius distance of `of` to `against` over `mask`
    and its standard error."""
    first, second = operators[of], operators[against]

    def fn(a, e, m, key):
      return matrix_free.relative_frobenius(
        lambda v, a, e, m: _masked(v, a, m),
        lambda v, a, e, m: _masked(v, e, m),
        m,
        cfg.frobenius_probes,
        key,
        first.operator(a),
        second.operator(e),
        m,
        batch_size=cfg.probe_batch,
      )

    what = "frobenius" if of == label else f"frobenius {of}"
    value, stderr = costs.call(
      " ".join(filter(None, (what, against, block))),
      fn,
      states[of],
      states[against],
      mask,
      keys[2],
    )
    return float(value), float(stderr)

  # A reference equal to an earlier one (the Fisher of a softmax cross-
  # entropy is its GGN) is measured once: its rows repeat its twin's.
  same = max(SAME, 100 * float(np.finfo(np.dtype(cfg.precision)).eps))
  compared: list[str] = []
  twin = {}
  for i, m in enumerate(references):
    distances = {o: frobenius(m, o, ones) for o in references[:i]}
    tables["references"] += [
      dict(
        matrix=m,
        reference=o,
        relative_frobenius=d,
        relative_frobenius_stderr=se,
      )
      for o, (d, se) in distances.items()
    ]
    equal = [o for o in compared if distances[o][0] <= same]
    if equal:
      twin[m] = equal[0]
    else:
      compared.append(m)

  spectra_of: dict[str, Any] = {}
  top_of: dict[str, Any] = {}
  traces_of: dict[str, Any] = {}
  for name in operators:
    if name in twin:
      spectra_of[name] = spectra_of[twin[name]]
      traces_of[name] = traces_of[twin[name]]
    else:
      spectra_of[name] = (
        *run(name, "density", keys[0]),
        *run(name, "top", keys[1]),
      )
      traces_of[name] = (
        run(name, "trace", keys[4]),
        run(name, "xtrace", keys[5]),
      )
    nodes, weights, top, _ = spectra_of[name]
    (hutch, xtr), top_of[name] = traces_of[name], scale(top)
    source = "approx" if name == label else "exact"
    reference = curvature.matrix if name == label else name
    tables["spectra"] += _spectrum_rows(
      source, name, nodes, weights, reference=reference
    )
    tables["spectra"] += [
      dict(
        source=f"{source}_top_k",
        matrix=name,
        reference=reference,
        index=i,
        eigenvalue=float(v),
        weight=np.nan,
      )
      for i, v in enumerate(np.asarray(top))
    ]
    tables["statistics"] += _statistic_rows(
      source,
      name,
      dict(
        trace=hutch[0],
        trace_xtrace=xtr[0],
        **spectrum_statistics(nodes, cfg, weights, top),
      ),
      dict(trace=hutch[1], trace_xtrace=xtr[1]),
    )

  grads = mean_gradient(loss_fn, params, data)
  g = _flat(grads)
  products: dict[str, Any] = {}
  for name in references:
    _, _, top, vectors = spectra_of[name]
    of = twin.get(name, name)  # a twin's product is its twin's
    if of not in products:
      products[of] = costs.call(
        f"exact {of} gradient product",
        operators[of].multiply,
        states[of],
        grads,
      )
    product = products[of]
    tables["statistics"] += _statistic_rows(
      "exact",
      name,
      {
        GRADIENT_SHARE: metrics.share_in_span(
          _columns(vectors)[:, np.isfinite(top)], g
        ),
        GRADIENT_ALIGNMENT: metrics.gradient_curvature_alignment(
          g, _flat(product)
        ),
      },
    )
  if cfg.class_means:
    deltas, shares, num_classes = class_means.class_means(
      _class_sums(outputs, params, data, costs)
    )
    ggn = operators["ggn"]
    _, top_vectors = costs.call(
      "exact ggn top classes",
      lambda s, key: matrix_free.top_k_eigenpairs(
        _masked,
        ones,
        len(shares),
        cfg.lanczos_iters,
        key,
        ggn.operator(s),
        ones,
      ),
      states["ggn"],
      keys[1],
    )
    spectra_rows, statistic_rows = class_means.rows(
      deltas, shares, num_classes, _columns(top_vectors)
    )
    tables["spectra"] += spectra_rows
    tables["statistics"] += statistic_rows
  rhos = cfg.relative_dampings
  approx_dirs = {
    rho: _flat(
      jax.jit(
        lambda s, g, d: curvature.precondition(curvature.refresh(s, d), g, d)
      )(states[label], grads, rho * top_of[label])
    )
    for rho in rhos
  }
  blocks, types = [], {}
  if cfg.per_block or cfg.per_block_type:
    blocks = curvatures.layer_blocks(loss_fn, params, data.first)
  if cfg.per_block_type:
    roles = curvatures.block_roles(loss_fn, params, data.first, layer_roles)
    types = role_indices(blocks, roles)
  # The diagonal errors of every level from one set of probes per
  # reference, over the layer blocks as cells.
  groups: dict[tuple[str, str], list[str] | None] = {("network", "all"): None}
  groups.update(
    {("layer", name): [name] for name, _ in blocks} if cfg.per_block else {}
  )
  groups.update(
    {
      ("role", role): [n for n, _ in blocks if roles[n] == role]
      for role in types
    }
  )
  cells, membership = _cells(params, blocks, groups)

  def diagonal_errors(m):
    """`{group: (value, standard error)}` of the approximation's diagonal
    against reference `m`'s."""

    def fn(a, e, c, g, key):
      return matrix_free.relative_diagonal_error(
        lambda v, a, e: a(v),
        lambda v, a, e: e(v),
        ones,
        cfg.diagonal_probes,
        key,
        curvature.operator(a),
        operators[m].operator(e),
        cells=c,
        groups=g,
        batch_size=cfg.probe_batch,
      )

    found = costs.call(
      f"diagonal error {m}",
      fn,
      states[label],
      states[m],
      cells,
      membership,
      keys[3],
    )
    return {
      key: (float(v), float(se))
      for key, v, se in zip(groups, *(np.asarray(x, np.float64) for x in found))
    }

  target = cfg.target_precision
  ap_nodes, ap_w, ap_top, ap_vecs = spectra_of[label]
  diagonal = {}
  for m in compared:
    ex_nodes, ex_w, ex_top, ex_vecs = spectra_of[m]
    diagonal[m] = diagonal_errors(m)
    frob, diag = frobenius(label, m, ones), diagonal[m]["network", "all"]
    distances, errors = _slq_distances(
      (ap_nodes, ap_w), (ex_nodes, ex_w), floor(cfg, ex_top), cfg.slq_probes
    )
    values = dict(
      relative_frobenius=frob[0],
      **distances,
      top_k_overlap=metrics.subspace_overlap(
        _columns(ap_vecs), _columns(ex_vecs)
      ),
      top_eigenvalue_ratio=ap_top[0] / ex_top[0],
      diagonal_relative_error=diag[0],
    )
    errors.update(
      relative_frobenius=(frob[1], cfg.frobenius_probes),
      diagonal_relative_error=(diag[1], cfg.diagonal_probes),
    )
    for rho in rhos:
      direction = costs.call(
        f"exact {m} direction",
        lambda s, g, d, of=operators[m]: of.precondition(s, g, d),
        states[m],
        grads,
        rho * top_of[m],
      )
      values["natural_gradient_cosine", rho] = metrics.cosine(
        approx_dirs[rho], _flat(direction)
      )
    tables["quality"] += _quality_rows(
      m, "network", "all", values, errors, target
    )

  def restricted(level, name, idx, what):
    """The quality of both matrices restricted to parameters `idx`, against
    each reference."""
    mask = _block_mask(params, idx)
    ap_b, ap_bv = run(label, "top", keys[1], mask, what)
    for m in compared:
      ex_b, ex_bv = run(m, "top", keys[1], mask, what)
      frob, diag = frobenius(label, m, mask, what), diagonal[m][level, name]
      values = dict(
        relative_frobenius=frob[0],
        top_k_overlap=metrics.subspace_overlap(
          _columns(ap_bv)[idx], _columns(ex_bv)[idx]
        ),
        top_eigenvalue_ratio=ap_b[0] / ex_b[0],
        diagonal_relative_error=diag[0],
      )
      errors = dict(
        relative_frobenius=(frob[1], cfg.frobenius_probes),
        diagonal_relative_error=(diag[1], cfg.diagonal_probes),
      )
      tables["quality"] += _quality_rows(m, level, name, values, errors, target)

  if cfg.per_block:
    for name, idx in blocks:
      restricted("layer", name, idx, name)
  for role, idx in types.items():
    restricted("role", role, idx, f"block type {role}")
  return tables


METHODS = {"dense": measure_dense, "lanczos": measure_lanczos}


def measure(
  loss_fn,
  curvature,
  params,
  data,
  cfg,
  rng,
  costs: Costs | None = None,
  store: ReferenceStore | None = None,
  key: dict | None = None,
  layer_roles=(),
  examples_interact: bool = False,
  outputs=None,
) -> dict[str, list[dict]]:
  """The tables of `TABLES` by `cfg.method` (one of `METHODS`; `cfg` the
  spectra settings), over `data` (a batch or a `Data`); the dense method
  shares its exact references through `store` and forms them from
  products where the examples interact (see `measure_dense`); block types
  from the problem's `layer_roles` (`curvatures.block_role`); the class-
  mean test (`cfg.class_means`) from the network's `outputs(params,
  inputs)`, the problem's `outputs`."""
  if cfg.method not in METHODS:
    raise ValueError(
      f"Unknown measure.spectra.method {cfg.method!r}; "
      f"choose one of {', '.join(METHODS)}."
    )
  data, costs = Data.of(data), costs or Costs()
  if cfg.method == "dense":
    return measure_dense(
      loss_fn,
      curvature,
      params,
      data,
      cfg,
      rng,
      costs,
      store or ReferenceStore(None),
      key,
      layer_roles,
      examples_interact,
      outputs,
    )
  return measure_lanczos(
    loss_fn, curvature, params, data, cfg, rng, costs, layer_roles, outputs
  )
