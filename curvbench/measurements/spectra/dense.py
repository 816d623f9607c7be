"""The dense spectra method (small models): every matrix is formed, every
metric exact.

The exact references, their eigendecompositions (of the whole and of each
layer block and block type) and the mean gradient come from the
`Subject`'s reference store where another run computed them from the same
content; block types are as in `rows.role_indices`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
from typing import Any

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import threadpoolctl

from curvbench.core import curvatures, metrics
from curvbench.core.references import content_hash
from curvbench.measurements.spectra import class_means, rows
from curvbench.measurements.spectra.plan import SAME, Plan, Subject

# From this size on, a dense eigendecomposition runs LAPACK on every core.
MANY_CORES = 512


def _symmetric(matrix):
  return 0.5 * (matrix + matrix.T)


@dataclasses.dataclass(frozen=True)
class Layout:
  """The layer `blocks` (`(name, indices)`), each one's role (`roles`),
  the indices of each block type (`types`, see `rows.role_indices`) and
  the diagonal sub-matrices decomposed apart (`parts`: `(name, indices)`
  of every block and block type)."""

  blocks: list
  roles: dict
  types: dict
  parts: list


@dataclasses.dataclass(frozen=True)
class Exact:
  """An exact reference: its dense `matrix` (float64), its `eigh`
  (`(eigenvalues, eigenvectors)`) and that of each of its `parts`."""

  matrix: np.ndarray
  eigh: tuple
  parts: dict


@dataclasses.dataclass(frozen=True)
class Approximation:
  """The approximation's `state`, its dense `matrix` (float64), its `eigh`
  and that of each layer block (`block_eighs`, by block name)."""

  state: Any
  matrix: np.ndarray
  eigh: tuple
  block_eighs: dict


def measure(subject: Subject, plan: Plan) -> dict[str, list[dict]]:
  """Every table of `rows.TABLES` from dense matrices. Where the loss
  couples the examples of a batch (`subject.examples_interact`: batch
  norm), every exact matrix comes from products through the whole batch."""
  key = _content_key(subject, plan)
  layout = _layout(subject, plan)
  exact = {
    m: _exact_reference(subject, m, key, layout.parts) for m in plan.references
  }
  tables = rows.empty()
  for m, ref in exact.items():
    values = ref.eigh[0]
    tables["spectra"] += rows.spectrum("exact", m, values)
    tables["statistics"] += rows.statistics(
      "exact",
      m,
      dict(
        trace=np.trace(ref.matrix), **rows.spectrum_statistics(values, plan)
      ),
    )
  compared = _distinct(
    plan.references,
    {m: ref.matrix for m, ref in exact.items()},
    tables["references"],
  )
  approx = _approximation(subject, plan, layout.blocks)
  _approximation_rows(tables, subject.curvature, approx, plan)
  grads = _shared_mean_gradient(subject, key)
  g = rows.flat(grads)
  for m, ref in exact.items():
    values, vectors = ref.eigh
    top = vectors[:, np.argsort(values)[::-1][: plan.top_k]]
    tables["statistics"] += rows.gradient_statistics(m, top, g, ref.matrix @ g)
  if plan.class_means:
    _class_mean_rows(tables, subject, key, exact["ggn"].eigh)
  _network_quality(tables, subject, plan, exact, compared, approx, grads)
  _parts_quality(tables, subject, plan, exact, compared, approx, layout, g)
  tables["heatmaps"] += _heatmaps(
    subject, plan, exact[subject.curvature.matrix], approx, layout, grads
  )
  return tables


def _content_key(subject: Subject, plan: Plan) -> dict | None:
  """The store key of what this measurement computes: the subject's `key`
  plus the content of the parameters and examples, where the store keeps
  anything (hashing the examples costs a pass over them)."""
  if not subject.store.keeps:
    return subject.key
  data = subject.data
  return dict(
    subject.key or {},
    params=content_hash(subject.params),
    data=content_hash(data.chunks, data.rest),
    precision=plan.precision,
  )


def _layout(subject: Subject, plan: Plan) -> Layout:
  first = subject.data.first
  blocks = curvatures.layer_blocks(subject.loss_fn, subject.params, first)
  roles = curvatures.block_roles(
    subject.loss_fn, subject.params, first, subject.layer_roles
  )
  types = rows.role_indices(blocks, roles) if plan.per_block_type else {}
  parts = [(f"block {name}", idx) for name, idx in blocks] + [
    (f"block type {role}", idx) for role, idx in types.items()
  ]
  return Layout(blocks, roles, types, parts)


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


def _exact_reference(subject: Subject, matrix: str, key, parts) -> Exact:
  """The exact `matrix` and the eigendecompositions of it and of its
  diagonal sub-matrices over `parts` (`(name, indices)`: layer blocks,
  block types), from the store where another run computed them from the
  same content: they are the same whatever approximation a run compares
  with them."""
  s, costs = subject, subject.costs

  def compute():
    dense = dense_exact(
      s.loss_fn, matrix, s.params, s.data, s.rng, costs, s.examples_interact
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
    s.store,
    dict(
      key or {},
      matrix=matrix,
      parts=[(name, content_hash(idx)) for name, idx in parts],
    ),
    compute,
    costs,
    f"exact {matrix}",
  )
  return Exact(
    found["matrix"],
    (found["eigenvalues"], found["eigenvectors"]),
    {
      name: (found[f"values{i}"], found[f"vectors{i}"])
      for i, (name, _) in enumerate(parts)
    },
  )


def _shared_mean_gradient(subject: Subject, key):
  """The mean gradient over the data, a pytree like the parameters, from
  the store where another run at the same point computed it."""
  s = subject

  def compute():
    grads = s.costs.call(
      "mean gradient",
      functools.partial(rows.traced_mean_gradient, s.loss_fn),
      s.params,
      s.data,
    )
    return dict(gradient=np.asarray(jax.flatten_util.ravel_pytree(grads)[0]))

  found = _stored(
    s.store,
    dict(key or {}, quantity="mean gradient"),
    compute,
    s.costs,
    "mean gradient",
  )
  return jax.flatten_util.ravel_pytree(s.params)[1](
    jnp.asarray(found["gradient"])
  )


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


def _approximation(subject: Subject, plan: Plan, blocks) -> Approximation:
  """The approximation estimated, formed, and decomposed block by block
  (in the run's precision) and whole (from its blocks where it is
  block-diagonal over them)."""
  s, costs = subject, subject.costs
  curvature = s.curvature
  state = costs.call(
    "approx estimate",
    lambda p, d, k: curvature.estimate(k, p, d, plan.num_samples),
    s.params,
    s.data,
    s.rng,
  )
  approx = costs.call(
    "approx dense", lambda s: _symmetric(curvature.to_dense(s)), state
  )
  block_eighs = {
    name: _eigh(costs, f"approx block {name}", approx[np.ix_(idx, idx)])
    for name, idx in blocks
  }
  approx = np.asarray(approx, np.float64)
  eigh = _blockwise_eigh(costs, "approx", approx, blocks, block_eighs)
  return Approximation(state, approx, eigh, block_eighs)


def _approximation_rows(tables, curvature, approx: Approximation, plan):
  values = approx.eigh[0]
  tables["spectra"] += rows.spectrum(
    "approx", curvature.label, values, reference=curvature.matrix
  )
  tables["statistics"] += rows.statistics(
    "approx",
    curvature.label,
    dict(
      trace=np.trace(approx.matrix), **rows.spectrum_statistics(values, plan)
    ),
  )


def _distinct(references, exact: dict, table: list) -> list[str]:
  """The references that equal no earlier one, recording in `table` the
  relative Frobenius distance of each pair (`references` table)."""
  kept: list[str] = []
  for i, m in enumerate(references):
    distances = {
      o: metrics.relative_frobenius(exact[m], exact[o]) for o in references[:i]
    }
    table += [
      dict(matrix=m, reference=o, relative_frobenius=d)
      for o, d in distances.items()
    ]
    if all(distances[o] > SAME for o in kept):
      kept.append(m)
  return kept


def _class_mean_rows(tables, subject: Subject, key, ggn_eigh) -> None:
  """The class-mean test's rows against the exact GGN's eigenvectors
  (`ggn_eigh`), the class sums from the store where another run at the
  same point computed them."""
  s = subject
  found = _stored(
    s.store,
    dict(key or {}, quantity="class means"),
    lambda: dict(
      zip(
        ("sums", "shares"),
        rows.class_sums(s.outputs, s.params, s.data, s.costs),
      )
    ),
    s.costs,
    "class means",
  )
  deltas, shares, num_classes = class_means.class_means(
    (found["sums"], found["shares"])
  )
  values, vectors = ggn_eigh
  top = vectors[:, np.argsort(values)[::-1][: len(shares)]]
  spectra_rows, statistic_rows = class_means.rows(
    deltas, shares, num_classes, top
  )
  tables["spectra"] += spectra_rows
  tables["statistics"] += statistic_rows


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
  """`{rho: (M + rho * scale(M) I)^-1 vector}` (`rows.scale`)."""
  top = rows.scale(eigh[0])
  return {rho: _damped_solve(eigh, vector, rho * top) for rho in dampings}


def _network_quality(tables, subject, plan, exact, compared, approx, grads):
  """The whole network's quality rows against each distinct reference; the
  approximation's own damped inverse as its optimizer applies it."""
  curvature, g = subject.curvature, rows.flat(grads)
  approx_scale = rows.scale(approx.eigh[0])
  approx_dirs = {
    rho: rows.flat(
      subject.costs.call(
        "approx direction",
        lambda s, v, d: curvature.precondition(curvature.refresh(s, d), v, d),
        approx.state,
        grads,
        rho * approx_scale,
      )
    )
    for rho in plan.relative_dampings
  }
  for m in compared:
    ref = exact[m]
    tables["quality"] += rows.quality(
      m,
      "network",
      "all",
      dense_metrics(
        approx.matrix,
        ref.matrix,
        approx_dirs,
        _relative_solves(ref.eigh, g, plan.relative_dampings),
        plan.top_k,
        rows.floor(plan, ref.eigh[0]),
        approx.eigh,
        ref.eigh,
      ),
    )


def _parts_quality(tables, subject, plan, exact, compared, approx, layout, g):
  """The quality rows of each layer block and block type against each
  distinct reference, with the damped natural gradients of the
  sub-matrices."""
  rhos = plan.relative_dampings

  def quality_of(level, name, idx, what, a_eigh):
    a = approx.matrix[np.ix_(idx, idx)]
    a_dirs = _relative_solves(a_eigh, g[idx], rhos)
    for m in compared:
      e_eigh = exact[m].parts[what]
      values = dense_metrics(
        a,
        exact[m].matrix[np.ix_(idx, idx)],
        a_dirs,
        _relative_solves(e_eigh, g[idx], rhos),
        plan.top_k,
        rows.floor(plan, exact[m].eigh[0]),
        a_eigh,
        e_eigh,
      )
      tables["quality"] += rows.quality(m, level, name, values)

  for name, idx in layout.blocks:
    quality_of("layer", name, idx, f"block {name}", approx.block_eighs[name])
  for role, idx in layout.types.items():
    a_eigh = _blockwise_eigh(
      subject.costs,
      f"approx block type {role}",
      approx.matrix[np.ix_(idx, idx)],
      [
        (name, np.searchsorted(idx, i))
        for name, i in layout.blocks
        if layout.roles[name] == role
      ],
      approx.block_eighs,
    )
    quality_of("role", role, idx, f"block type {role}", a_eigh)


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


def _heatmaps(subject, plan, reference: Exact, approx, layout, grads):
  """The `heatmaps` rows: the exact matrix the approximation estimates
  (`reference`) and the approximation, and both damped inverses, over a
  few parameters of the middle layer blocks (none where the plan draws
  none)."""
  units = heatmap_units(layout.blocks, plan.heatmap_blocks, plan.heatmap_units)
  if not units:
    return []
  curvature, costs, damping = subject.curvature, subject.costs, plan.damping
  g = rows.flat(grads)
  idx = np.concatenate([i for _, i in units])
  unravel = jax.flatten_util.ravel_pytree(grads)[1]
  refreshed = costs.call(
    "approx refresh", lambda s: curvature.refresh(s, damping), approx.state
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
  values, vectors = reference.eigh
  vecs = vectors[idx]
  exact_inverse = (vecs / (values + damping)) @ vecs.T
  found = []
  for source, kind, sub in (
    ("exact", "matrix", reference.matrix[np.ix_(idx, idx)]),
    ("exact", "inverse", exact_inverse),
    ("approx", "matrix", approx.matrix[np.ix_(idx, idx)]),
    ("approx", "inverse", np.asarray(columns, np.float64)[:, idx]),
  ):
    found += _heatmap_rows(source, kind, subject.curvature.matrix, sub, units)
  return found
