"""Eigenvalue spectra of exact curvatures and their approximations.

`measure` compares one configured `Curvature` with the exact matrix it
estimates (its `matrix`: GGN, Fisher, empirical Fisher, or the Hessian) at
one point, over a `Data` (a batch, N batches or the training split), and
returns four tables:

- `spectra`: signed eigenvalues with weights (1/P for full spectra, Gauss
  weights for stochastic Lanczos quadrature), per matrix.
- `quality`: approximation-quality metrics for the whole network
  (`level='network'`, `block='all'`), for each layer block (`level=
  'layer'`, `block` its name: the exact diagonal block against the
  approximation's) and for each block type (`level='role'`, `block` the
  role, e.g. 'attention': the sub-matrices over every parameter of the
  role's layers, cross-layer entries included; see `role_indices`).
- `statistics`: trace, condition number, outliers, negative mass, ... of
  each exact matrix and of the approximation (`stderr` 0 where exact).
- `heatmaps`: the exact and approximate matrix and damped inverse over a
  few subsampled units of a few layers (as in Martens & Grosse 2015, Fig. 2).

Two methods:

- `dense` (small models): every matrix is formed; everything is exact.
- `lanczos` (large models): only matrix-vector products. Top-k by Lanczos,
  densities by SLQ, Frobenius errors, traces (Hutchinson, XTrace) and
  diagonals by random probes (`curvbench.matrix_free`), exact directions by
  CG.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np

from curvbench import curvatures, matrix_free, metrics
from curvbench.costs import Costs
from curvbench.data import Data
from curvbench.references import ReferenceStore, content_hash

TABLES = ("spectra", "quality", "statistics", "heatmaps")


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
  weights = (np.full(len(values), 1 / len(values)) if weights is None
             else np.asarray(weights, np.float64))
  return [dict(source=source, matrix=matrix, reference=reference or matrix,
               index=i, eigenvalue=float(v), weight=float(w))
          for i, (v, w) in enumerate(zip(values, weights))]


def _quality_rows(reference, level, block, values: dict):
  return [dict(reference=reference, level=level, block=block, metric=k,
               value=float(v)) for k, v in values.items()]


def role_indices(blocks, roles: dict[str, str]) -> dict[str, np.ndarray]:
  """`{role: sorted ravel_pytree indices}` of the layer `blocks` (`(name,
  indices)`, as `curvatures.layer_blocks`) of each role (`roles`, by block
  name: `curvatures.block_roles`). Empty where one role holds every block:
  its parameters are the whole network's, measured already."""
  out = {}
  for name, idx in blocks:
    out.setdefault(roles[name], []).append(idx)
  if len(out) < 2:
    return {}
  return {role: np.sort(np.concatenate(idx)) for role, idx in out.items()}


def _statistic_rows(source, matrix, values: dict, stderr: dict = None):
  stderr = stderr or {}
  return [dict(source=source, matrix=matrix, statistic=k, value=float(v),
               stderr=float(stderr.get(k, 0.0))) for k, v in values.items()]


def floor(cfg, values) -> float:
  """The magnitude below which an eigenvalue counts as zero: the configured
  `relative_floor`, or ten round-offs of the measurement's precision where
  that is larger, times the largest magnitude in `values`. (A float32
  Lanczos run puts the null space at +-1e-8 of the top eigenvalue, which
  would otherwise read as negative mass.)"""
  eps = float(np.finfo(np.dtype(cfg["precision"])).eps)
  relative = max(float(cfg["relative_floor"]), 10 * eps)
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
  damping = float(cfg["damping"])
  lowest = float(values.min())
  kept = np.abs(values)[np.abs(values) > zero]
  at_floor = kept.size and kept.min() < 10 * zero
  condition = ("condition_number_at_least" if at_floor
               else "condition_number")
  return {"max_eigenvalue": float(top[0]), "min_eigenvalue": lowest,
          condition: metrics.condition_number(values, zero),
          # What a damped preconditioner sees; undefined when indefinite.
          "damped_condition_number": (top[0] + damping) / (lowest + damping)
          if lowest + damping > 0 else np.nan,
          "num_outliers": metrics.num_outliers(top, int(cfg["top_k"])),
          "negative_mass": metrics.negative_mass(values, weights, zero),
          "negative_ratio": metrics.negative_ratio(values, top[0])}


# --- dense method ------------------------------------------------------------

def dense_exact(loss_fn, matrix, params, data, rng, costs,
                examples_interact):
  """The exact `matrix` over `data` as a dense array, a phase of `costs`.

  Per-example rows take each example alone, which a loss coupling its
  batch's examples (`examples_interact`: batch norm) does not allow: its
  matrices come from products through the whole batch.
  """
  exact = curvatures.exact(
      matrix, loss_fn, matrix_free=examples_interact
      or matrix in curvatures.DENSE_FROM_PRODUCTS)

  return costs.call(f"exact {matrix}", lambda p, d, k: _symmetric(
      exact.to_dense(exact.estimate(k, p, d))), params, data, rng)


def _exact_reference(loss_fn, matrix, params, data, rng, costs, store, key,
                     examples_interact):
  """`(dense matrix, (eigenvalues, eigenvectors))` of the exact `matrix`,
  from the `store` where another run computed it from the same content."""
  def compute():
    dense = dense_exact(loss_fn, matrix, params, data, rng, costs,
                         examples_interact)
    values, vectors = _eigh(costs, f"exact {matrix}", dense)
    return dict(matrix=np.asarray(dense, np.float64), eigenvalues=values,
                eigenvectors=vectors)

  start = time.perf_counter()
  found, shared = store.get(dict(key or {}, matrix=matrix), compute)
  if shared:
    costs.record(f"exact {matrix} (read from the reference store)",
                 time.perf_counter() - start)
  return found["matrix"], (found["eigenvalues"], found["eigenvectors"])


def _eigh(costs, what, matrix):
  """`(eigenvalues, eigenvectors)` of `matrix` as float64 numpy arrays,
  computed by XLA on the run's device and recorded as phase `eigh {what}`."""
  values, vectors = costs.call(f"eigh {what}", jnp.linalg.eigh, matrix)
  return np.asarray(values, np.float64), np.asarray(vectors, np.float64)


def dense_metrics(approx, exact, approx_dir, exact_dir, k, floor,
                  approx_eigh, exact_eigh) -> dict:
  """Quality of the dense `approx` against `exact`, given both damped
  natural-gradient directions and both eigendecompositions."""
  approx, exact = np.asarray(approx, np.float64), np.asarray(exact, np.float64)
  approx_eigs, approx_vecs = approx_eigh
  exact_eigs, exact_vecs = exact_eigh
  k = min(k, len(exact_eigs))
  return dict(
      relative_frobenius=metrics.relative_frobenius(approx, exact),
      spectral_distance=metrics.spectral_distance(approx_eigs, exact_eigs),
      log_wasserstein=metrics.log_wasserstein(approx_eigs, exact_eigs, floor),
      natural_gradient_cosine=metrics.cosine(approx_dir, exact_dir),
      top_k_overlap=metrics.subspace_overlap(approx_vecs[:, ::-1][:, :k],
                                             exact_vecs[:, ::-1][:, :k]),
      top_eigenvalue_ratio=approx_eigs[-1] / exact_eigs[-1],
      trace_ratio=np.trace(approx) / np.trace(exact),
      diagonal_relative_error=metrics.relative_frobenius(
          np.diag(approx), np.diag(exact)))


def _damped_solve(eigh, vector, damping):
  """`(M + damping I)^-1 vector` from M's eigendecomposition."""
  values, vectors = eigh
  return vectors @ ((vectors.T @ vector) / (values + damping))


def heatmap_units(blocks, num_blocks: int, units: int) -> list[tuple]:
  """`(block name, indices)` of `units` evenly spaced parameters in each of
  the `num_blocks` middle layer blocks."""
  if num_blocks < 1 or units < 1:
    return []
  start = max(0, (len(blocks) - num_blocks) // 2)
  chosen = blocks[start:start + num_blocks]
  return [(name, idx[np.unique(np.linspace(0, len(idx) - 1, units)
                               .round().astype(int))]) for name, idx in chosen]


def _heatmap_rows(source, kind, reference, sub, units):
  """Rows of `sub`, a matrix over the concatenated indices of `units`."""
  names = np.concatenate([[n] * len(i) for n, i in units])
  return [dict(source=source, kind=kind, reference=reference, row=r, col=c,
               row_block=names[r], col_block=names[c], value=float(sub[r, c]))
          for r in range(len(names)) for c in range(len(names))]


def measure_dense(loss_fn, curvature, params, data, cfg, rng, costs,
                  store=ReferenceStore(None), key=None, layer_roles=(),
                  examples_interact=False):
  """Every table, from dense matrices (small models); the exact references
  from `store` where a run with the same content (`key` plus the
  parameters and examples) computed them; block types from the problem's
  `layer_roles` (`curvatures.block_role`). Where the loss couples the
  examples of a batch (`examples_interact`: batch norm), every exact
  matrix comes from products through the whole batch."""
  curvatures.check_dense_fits(
      curvatures.num_params(params), 8, float(cfg["max_dense_gib"]),
      "The dense spectra method",
      "use measure.spectra.method=lanczos (matrix-free)")
  references = list(dict.fromkeys([*cfg["references"], curvature.matrix]))
  if store.keeps:  # hashing the examples costs a pass over them
    key = dict(key or {}, params=content_hash(params),
               data=content_hash(data.chunks, data.rest),
               precision=cfg["precision"])
  exact, exact_eighs = {}, {}
  for m in references:
    exact[m], exact_eighs[m] = _exact_reference(
        loss_fn, m, params, data, rng, costs, store, key, examples_interact)
  tables = {name: [] for name in TABLES}
  reference = exact[curvature.matrix]
  exact_eigh = exact_eighs[curvature.matrix]
  for m, matrix in exact.items():
    values = exact_eighs[m][0]
    tables["spectra"] += _spectrum_rows("exact", m, values)
    tables["statistics"] += _statistic_rows(
        "exact", m, dict(trace=np.trace(matrix),
                         **spectrum_statistics(values, cfg)))

  state = costs.call("approx estimate", lambda p, d, k: curvature.estimate(
      k, p, d, int(cfg["num_samples"])), params, data, rng)
  approx = costs.call("approx dense", lambda s: _symmetric(
      curvature.to_dense(s)), state)
  approx_eigh = _eigh(costs, "approx", approx)
  approx = np.asarray(approx, np.float64)
  approx_eigs = approx_eigh[0]
  tables["spectra"] += _spectrum_rows("approx", curvature.label, approx_eigs,
                                      reference=curvature.matrix)
  tables["statistics"] += _statistic_rows(
      "approx", curvature.label, dict(trace=np.trace(approx),
                                      **spectrum_statistics(approx_eigs, cfg)))

  damping, k = float(cfg["damping"]), int(cfg["top_k"])
  zero = floor(cfg, exact_eigh[0])
  grads = costs.call("mean gradient", functools.partial(_mean_gradient,
                                                       loss_fn), params, data)
  g = _flat(grads)
  refreshed = costs.call("approx refresh", lambda s: curvature.refresh(
      s, damping), state)
  approx_dir = _flat(costs.call("approx direction", lambda s, v: (
      curvature.precondition(s, v, damping)), refreshed, grads))
  exact_dir = _damped_solve(exact_eigh, g, damping)
  tables["quality"] += _quality_rows(
      curvature.matrix, "network", "all", dense_metrics(
          approx, reference, approx_dir, exact_dir, k, zero, approx_eigh,
          exact_eigh))

  def restricted(idx, what):
    """The quality of the sub-matrices over parameters `idx`, with the
    damped natural gradients of the sub-matrices."""
    a, e = approx[np.ix_(idx, idx)], reference[np.ix_(idx, idx)]
    a_eigh, e_eigh = (_eigh(costs, f"{source} {what}", m)
                      for source, m in (("approx", a), ("exact", e)))
    return dense_metrics(a, e, _damped_solve(a_eigh, g[idx], damping),
                         _damped_solve(e_eigh, g[idx], damping), k, zero,
                         a_eigh, e_eigh)

  blocks = curvatures.layer_blocks(loss_fn, params, data.first)
  for name, idx in blocks:
    tables["quality"] += _quality_rows(curvature.matrix, "layer", name,
                                       restricted(idx, f"block {name}"))
  if cfg["per_block_type"]:
    roles = curvatures.block_roles(loss_fn, params, data.first, layer_roles)
    for role, idx in role_indices(blocks, roles).items():
      tables["quality"] += _quality_rows(
          curvature.matrix, "role", role, restricted(idx, f"block type {role}"))

  units = heatmap_units(blocks, int(cfg["heatmap_blocks"]),
                        int(cfg["heatmap_units"]))
  if units:
    idx = np.concatenate([i for _, i in units])
    unravel = jax.flatten_util.ravel_pytree(grads)[1]
    # Columns idx of the approximation's own damped inverse (symmetric).
    columns = costs.call("approx inverse columns", lambda s: jax.vmap(
        lambda e: jax.flatten_util.ravel_pytree(curvature.precondition(
            s, unravel(e), damping))[0])(
                jnp.eye(len(g), dtype=jnp.result_type(g))[idx]), refreshed)
    vecs = exact_eigh[1][idx]
    exact_inverse = (vecs / (exact_eigh[0] + damping)) @ vecs.T
    for source, kind, sub in (
        ("exact", "matrix", reference[np.ix_(idx, idx)]),
        ("exact", "inverse", exact_inverse),
        ("approx", "matrix", approx[np.ix_(idx, idx)]),
        ("approx", "inverse", np.asarray(columns, np.float64)[:, idx])):
      tables["heatmaps"] += _heatmap_rows(source, kind, curvature.matrix, sub,
                                          units)
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
  return jax.tree.map(jnp.multiply, mask,
                      operator(jax.tree.map(jnp.multiply, mask, v)))


def _estimators(of, cfg) -> dict:
  """The matrix-free estimates of curvature `of`, each `fn(state, mask,
  key)`; the mask doubles as the shape template, so one compiled program
  serves the whole network and every block. Each builds `of.operator` once
  (for the exact curvatures, one forward pass for all its products)."""
  k, iters = int(cfg["top_k"]), int(cfg["lanczos_iters"])
  probes, traces = int(cfg["slq_probes"]), int(cfg["trace_probes"])
  diagonals = int(cfg["diagonal_probes"])
  return dict(
      density=lambda s, m, key: matrix_free.slq_density(
          _masked, m, iters, probes, key, of.operator(s), m),
      top=lambda s, m, key: matrix_free.top_k_eigenpairs(
          _masked, m, k, iters, key, of.operator(s), m),
      trace=lambda s, m, key: matrix_free.hutchinson_trace(
          _masked, m, traces, key, of.operator(s), m),
      xtrace=lambda s, m, key: matrix_free.xtrace(
          _masked, m, traces, key, of.operator(s), m),
      diagonal=lambda s, m, key: matrix_free.stochastic_diagonal(
          _masked, m, diagonals, key, of.operator(s), m))


def measure_lanczos(loss_fn, curvature, params, data, cfg, rng, costs,
                    layer_roles=()):
  """Every table but the heatmaps, from matrix-vector products only: the
  density, top-k and statistics of each reference matrix and of the
  approximation, and the approximation's quality against its matrix (block
  types as in `measure_dense`)."""
  keys = jax.random.split(rng, 6)
  ones = jax.tree.map(jnp.ones_like, params)
  tables = {name: [] for name in TABLES}
  operators, states = {}, {}
  for m in dict.fromkeys([*cfg["references"], curvature.matrix]):
    operators[m] = curvatures.exact(m, loss_fn, matrix_free=True,
                                    cg_iters=int(cfg["cg_iters"]))
    states[m] = operators[m].estimate(rng, params, data)
  label = curvature.label
  operators[label] = curvature
  states[label] = costs.call("approx estimate", lambda p, d, k:
                             curvature.estimate(k, p, d,
                                                int(cfg["num_samples"])),
                             params, data, rng)
  estimators = {name: _estimators(of, cfg) for name, of in operators.items()}

  def run(name, kind, key, mask=ones, block=""):
    source = "approx" if name == label else f"exact {name}"
    phase = " ".join(filter(None, (source, kind, block)))
    return costs.call(phase, estimators[name][kind], states[name], mask, key)

  spectra_of = {}
  for name in operators:
    source = "approx" if name == label else "exact"
    nodes, weights = run(name, "density", keys[0])
    top, vectors = run(name, "top", keys[1])
    spectra_of[name] = (nodes, weights, top, vectors)
    tables["spectra"] += _spectrum_rows(source, name, nodes, weights,
                                        reference=curvature.matrix
                                        if name == label else name)
    tables["spectra"] += [dict(source=f"{source}_top_k", matrix=name,
                               reference=curvature.matrix if name == label
                               else name, index=i, eigenvalue=float(v),
                               weight=np.nan)
                          for i, v in enumerate(np.asarray(top))]
    hutch, xtr = run(name, "trace", keys[4]), run(name, "xtrace", keys[5])
    tables["statistics"] += _statistic_rows(
        source, name, dict(trace=hutch[0], trace_xtrace=xtr[0],
                           **spectrum_statistics(nodes, cfg, weights, top)),
        dict(trace=hutch[1], trace_xtrace=xtr[1]))

  matrix = curvature.matrix
  exact, exact_state, state = operators[matrix], states[matrix], states[label]
  ex_nodes, ex_w, ex_top, ex_vecs = spectra_of[matrix]
  ap_nodes, ap_w, ap_top, ap_vecs = spectra_of[label]

  def frobenius(mask, block=""):
    def fn(a, e, m, key):
      return matrix_free.relative_frobenius(
          lambda v, a, e, m: _masked(v, a, m),
          lambda v, a, e, m: _masked(v, e, m), m,
          int(cfg["frobenius_probes"]), key, curvature.operator(a),
          exact.operator(e), m)
    return costs.call(" ".join(filter(None, ("frobenius", block))), fn,
                      state, exact_state, mask, keys[2])

  damping = float(cfg["damping"])
  grads = mean_gradient(loss_fn, params, data)
  exact_dir = costs.call(f"exact {matrix} direction",
                         lambda s, g: exact.precondition(s, g, damping),
                         exact_state, grads)
  refreshed = jax.jit(curvature.refresh)(state, damping)
  approx_dir = jax.jit(curvature.precondition)(refreshed, grads, damping)
  ex_diag = _flat(run(matrix, "diagonal", keys[3])[0])
  ap_diag = _flat(run(label, "diagonal", keys[3])[0])
  zero = floor(cfg, ex_top)
  tables["quality"] += _quality_rows(matrix, "network", "all", dict(
      relative_frobenius=frobenius(ones),
      spectral_distance=metrics.spectral_distance(ap_nodes, ex_nodes, ap_w,
                                                  ex_w),
      log_wasserstein=metrics.log_wasserstein(ap_nodes, ex_nodes, zero,
                                              ap_w, ex_w),
      natural_gradient_cosine=metrics.cosine(_flat(approx_dir),
                                             _flat(exact_dir)),
      top_k_overlap=metrics.subspace_overlap(_columns(ap_vecs),
                                             _columns(ex_vecs)),
      top_eigenvalue_ratio=ap_top[0] / ex_top[0],
      diagonal_relative_error=metrics.relative_frobenius(ap_diag, ex_diag)))

  def restricted(idx, what):
    """The quality of both matrices restricted to parameters `idx`."""
    mask = _block_mask(params, idx)
    ex_b, ex_bv = run(matrix, "top", keys[1], mask, what)
    ap_b, ap_bv = run(label, "top", keys[1], mask, what)
    return dict(
        relative_frobenius=frobenius(mask, what),
        top_k_overlap=metrics.subspace_overlap(_columns(ap_bv)[idx],
                                               _columns(ex_bv)[idx]),
        top_eigenvalue_ratio=ap_b[0] / ex_b[0],
        diagonal_relative_error=metrics.relative_frobenius(
            ap_diag[idx], ex_diag[idx]))

  if cfg["per_block"] or cfg["per_block_type"]:
    blocks = curvatures.layer_blocks(loss_fn, params, data.first)
  if cfg["per_block"]:
    for name, idx in blocks:
      tables["quality"] += _quality_rows(matrix, "layer", name,
                                         restricted(idx, name))
  if cfg["per_block_type"]:
    roles = curvatures.block_roles(loss_fn, params, data.first, layer_roles)
    for role, idx in role_indices(blocks, roles).items():
      tables["quality"] += _quality_rows(matrix, "role", role, restricted(
          idx, f"block type {role}"))
  return tables


METHODS = {"dense": measure_dense, "lanczos": measure_lanczos}


def measure(loss_fn, curvature, params, data, cfg, rng,
            costs: Costs | None = None, store: ReferenceStore | None = None,
            key: dict | None = None, layer_roles=(),
            examples_interact: bool = False) -> dict[str, list[dict]]:
  """The tables of `TABLES` by `cfg["method"]` (one of `METHODS`), over
  `data` (a batch or a `Data`); the dense method shares its exact
  references through `store` and forms them from products where the
  examples interact (see `measure_dense`); block types from the problem's
  `layer_roles` (`curvatures.block_role`)."""
  if cfg["method"] not in METHODS:
    raise ValueError(f"Unknown measure.spectra.method {cfg['method']!r}; "
                     f"choose one of {', '.join(METHODS)}.")
  data, costs = Data.of(data), costs or Costs()
  if cfg["method"] == "dense":
    return measure_dense(loss_fn, curvature, params, data, cfg, rng, costs,
                         store or ReferenceStore(None), key, layer_roles,
                         examples_interact)
  return measure_lanczos(loss_fn, curvature, params, data, cfg, rng, costs,
                         layer_roles)
