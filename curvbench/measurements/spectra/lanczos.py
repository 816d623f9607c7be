"""The matrix-free spectra method (large models): matrix-vector products
only. Top-k by Lanczos, densities by SLQ, Frobenius errors, traces
(Hutchinson, XTrace) and diagonals by random probes
(`curvbench.core.matrix_free`), exact directions by CG.

It has no `cosine_similarity`: the probes of the Frobenius estimate give
`||A - E||_F / ||E||_F` and not the inner product `<A, E>_F` that the
cosine needs; combining two separate probe estimates would leave it
without a standard error. It draws no heatmaps. The class-mean overlap
takes the GGN's top eigenvectors from a Lanczos run of its own, as many as
the classes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np

from curvbench.core import curvatures, matrix_free, metrics
from curvbench.core.costs import Costs
from curvbench.measurements.spectra import class_means, rows
from curvbench.measurements.spectra.plan import Plan, Probes, Subject

# What each of the measurement's random keys draws: the same probes for
# every matrix, so that their estimates are compared on equal terms.
KEYS = ("density", "top", "frobenius", "diagonal", "trace", "xtrace")


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


def _estimators(of, plan: Plan) -> dict:
  """The matrix-free estimates of curvature `of`, each `fn(state, mask,
  key)`; the mask doubles as the shape template, so one compiled program
  serves the whole network and every block. Each builds `of.operator` once
  (for the exact curvatures, one forward pass for all its products)."""
  k, probes = plan.top_k, plan.probes
  iters = probes.lanczos_iters
  return dict(
    density=lambda s, m, key: matrix_free.slq_density(
      _masked,
      m,
      iters,
      probes.slq,
      key,
      of.operator(s),
      m,
      batch_size=probes.batch,
    ),
    top=lambda s, m, key: matrix_free.top_k_eigenpairs(
      _masked, m, k, iters, key, of.operator(s), m
    ),
    trace=lambda s, m, key: matrix_free.hutchinson_trace(
      _masked, m, probes.trace, key, of.operator(s), m
    ),
    xtrace=lambda s, m, key: matrix_free.xtrace(
      _masked, m, probes.trace, key, of.operator(s), m
    ),
  )


@dataclasses.dataclass(frozen=True)
class Operators:
  """The curvatures measured, by name (`of`: the exact references and the
  approximation, under its `label`), with their estimated `states`, and
  the estimates of each (`estimators`), timed as phases of `costs` with
  the measurement's `keys` (by `KEYS`) and `probes`; `ones`, a mask over
  every parameter."""

  label: str
  of: dict
  states: dict
  estimators: dict
  costs: Costs
  keys: dict
  ones: Any
  probes: Probes

  def source(self, name: str) -> str:
    """The `source` column of curvature `name`'s rows: "approx" for the
    approximation, "exact <name>" for a reference."""
    return "approx" if name == self.label else f"exact {name}"

  def run(self, name, kind, mask=None, block=""):
    """Estimate `kind` (of `_estimators`) of curvature `name` over `mask`
    (None: every parameter), a phase named for `block`."""
    phase = " ".join(filter(None, (self.source(name), kind, block)))
    mask = self.ones if mask is None else mask
    return self.costs.call(
      phase,
      self.estimators[name][kind],
      self.states[name],
      mask,
      self.keys[kind],
    )

  def frobenius(self, of, against, mask=None, block=""):
    """The relative Frobenius distance of `of` to `against` over `mask`
    (None: every parameter) and its standard error."""
    first, second = self.of[of], self.of[against]
    probes = self.probes

    def fn(a, e, m, key):
      return matrix_free.relative_frobenius(
        lambda v, a, e, m: _masked(v, a, m),
        lambda v, a, e, m: _masked(v, e, m),
        m,
        probes.frobenius,
        key,
        first.operator(a),
        second.operator(e),
        m,
        batch_size=probes.batch,
      )

    what = "frobenius" if of == self.label else f"frobenius {of}"
    value, stderr = self.costs.call(
      " ".join(filter(None, (what, against, block))),
      fn,
      self.states[of],
      self.states[against],
      self.ones if mask is None else mask,
      self.keys["frobenius"],
    )
    return float(value), float(stderr)


def measure(subject: Subject, plan: Plan) -> dict[str, list[dict]]:
  """Every table but the heatmaps, from matrix-vector products only: the
  density, top-k and statistics of each reference matrix and of the
  approximation, and the approximation's quality against each distinct
  reference (block types as in the dense method)."""
  ops = _operators(subject, plan)
  tables = rows.empty()
  compared, twin = _distinct(ops, plan, tables["references"])
  spectra_of = _spectra(tables, ops, plan, subject.curvature.matrix, twin)
  grads = rows.mean_gradient(subject.loss_fn, subject.params, subject.data)
  _gradient_rows(tables, ops, plan.references, spectra_of, twin, grads)
  if plan.class_means:
    _class_mean_rows(tables, subject, ops, plan)
  curvature, label = subject.curvature, ops.label
  approx_scale = rows.scale(spectra_of[label][2])
  approx_dirs = {
    rho: rows.flat(
      jax.jit(
        lambda s, g, d: curvature.precondition(curvature.refresh(s, d), g, d)
      )(ops.states[label], grads, rho * approx_scale)
    )
    for rho in plan.relative_dampings
  }
  layout = _layout(subject, plan)
  diagonal = {}
  for m in compared:
    diagonal[m] = _diagonal_errors(ops, m, layout)
    tables["quality"] += _network_quality(
      ops, m, plan, spectra_of, diagonal[m], approx_dirs, grads
    )
  if plan.per_block:
    for name, idx in layout.blocks:
      tables["quality"] += _restricted_quality(
        ops, compared, diagonal, plan, subject.params, ("layer", name, idx)
      )
  for role, idx in layout.types.items():
    tables["quality"] += _restricted_quality(
      ops, compared, diagonal, plan, subject.params, ("role", role, idx)
    )
  return tables


def _operators(subject: Subject, plan: Plan) -> Operators:
  """The references' exact operators (by CG for their directions) and the
  approximation, each estimated at the subject's point."""
  s = subject
  curvature = s.curvature
  keys = dict(zip(KEYS, jax.random.split(s.rng, len(KEYS))))
  operators, states = {}, {}
  for m in plan.references:
    operators[m] = curvatures.exact(
      m, s.loss_fn, matrix_free=True, cg_iters=plan.probes.cg_iters
    )
    states[m] = operators[m].estimate(s.rng, s.params, s.data)
  label = curvature.label
  operators[label] = curvature
  states[label] = s.costs.call(
    "approx estimate",
    lambda p, d, k: curvature.estimate(k, p, d, plan.num_samples),
    s.params,
    s.data,
    s.rng,
  )
  return Operators(
    label=label,
    of=operators,
    states=states,
    estimators={name: _estimators(of, plan) for name, of in operators.items()},
    costs=s.costs,
    keys=keys,
    ones=jax.tree.map(jnp.ones_like, s.params),
    probes=plan.probes,
  )


def _distinct(ops: Operators, plan: Plan, table: list) -> tuple[list, dict]:
  """`(compared, twin)`: the references that equal no earlier one, and the
  earlier one each of the others equals (the Fisher of a softmax cross-
  entropy is its GGN), whose rows it repeats rather than being measured
  again; records in `table` the estimated relative Frobenius distance of
  each pair (`references` table)."""
  references = plan.references
  compared: list[str] = []
  twin = {}
  for i, m in enumerate(references):
    distances = {o: ops.frobenius(m, o) for o in references[:i]}
    table += [
      dict(
        matrix=m,
        reference=o,
        relative_frobenius=d,
        relative_frobenius_stderr=se,
      )
      for o, (d, se) in distances.items()
    ]
    equal = [o for o in compared if distances[o][0] <= plan.same]
    if equal:
      twin[m] = equal[0]
    else:
      compared.append(m)
  return compared, twin


def _spectra(tables, ops: Operators, plan: Plan, estimated, twin) -> dict:
  """`{name: (nodes, weights, top eigenvalues, top eigenvectors)}` of each
  curvature (a twin's its twin's), with its `spectra` rows (the SLQ
  density and the top k) and `statistics` rows (traces, spectrum
  statistics); `estimated`: the matrix the approximation estimates."""
  spectra_of: dict[str, Any] = {}
  traces_of: dict[str, Any] = {}
  for name in ops.of:
    if name in twin:
      spectra_of[name] = spectra_of[twin[name]]
      traces_of[name] = traces_of[twin[name]]
    else:
      spectra_of[name] = (*ops.run(name, "density"), *ops.run(name, "top"))
      traces_of[name] = (ops.run(name, "trace"), ops.run(name, "xtrace"))
    nodes, weights, top, _ = spectra_of[name]
    hutch, xtr = traces_of[name]
    source = "approx" if name == ops.label else "exact"
    reference = estimated if name == ops.label else name
    tables["spectra"] += rows.spectrum(
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
    tables["statistics"] += rows.statistics(
      source,
      name,
      dict(
        trace=hutch[0],
        trace_xtrace=xtr[0],
        **rows.spectrum_statistics(nodes, plan, weights, top),
      ),
      dict(trace=hutch[1], trace_xtrace=xtr[1]),
    )
  return spectra_of


def _gradient_rows(tables, ops: Operators, references, spectra_of, twin, grads):
  """How the mean gradient lines up with each reference (a twin's product
  is its twin's, computed once)."""
  g = rows.flat(grads)
  products: dict[str, Any] = {}
  for name in references:
    _, _, top, vectors = spectra_of[name]
    of = twin.get(name, name)
    if of not in products:
      products[of] = ops.costs.call(
        f"exact {of} gradient product",
        ops.of[of].multiply,
        ops.states[of],
        grads,
      )
    tables["statistics"] += rows.gradient_statistics(
      name,
      _columns(vectors)[:, np.isfinite(top)],
      g,
      rows.flat(products[of]),
    )


def _class_mean_rows(tables, subject: Subject, ops: Operators, plan) -> None:
  """The class-mean test's rows, against as many of the GGN's top
  eigenvectors as the classes, from a Lanczos run of their own."""
  s = subject
  deltas, shares, num_classes = class_means.class_means(
    rows.class_sums(s.outputs, s.params, s.data, s.costs)
  )
  ggn, ones = ops.of["ggn"], ops.ones
  _, top_vectors = s.costs.call(
    "exact ggn top classes",
    lambda state, key: matrix_free.top_k_eigenpairs(
      _masked,
      ones,
      len(shares),
      plan.probes.lanczos_iters,
      key,
      ggn.operator(state),
      ones,
    ),
    ops.states["ggn"],
    ops.keys["top"],
  )
  spectra_rows, statistic_rows = class_means.rows(
    deltas, shares, num_classes, _columns(top_vectors)
  )
  tables["spectra"] += spectra_rows
  tables["statistics"] += statistic_rows


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


@dataclasses.dataclass(frozen=True)
class Layout:
  """The layer `blocks` measured apart (`(name, indices)`), the block
  `types` (`{role: indices}`), and the `groups` the diagonal errors are
  taken over (`{(level, block): layer block names}`, None: every
  parameter) with their `cells` and `membership` (`_cells`)."""

  blocks: list
  types: dict
  groups: dict
  cells: np.ndarray
  membership: np.ndarray


def _layout(subject: Subject, plan: Plan) -> Layout:
  s = subject
  blocks, types = [], {}
  if plan.per_block or plan.per_block_type:
    blocks = curvatures.layer_blocks(s.loss_fn, s.params, s.data.first)
  roles: dict[str, str] = {}
  if plan.per_block_type:
    roles = curvatures.block_roles(
      s.loss_fn, s.params, s.data.first, s.layer_roles
    )
    types = rows.role_indices(blocks, roles)
  # The diagonal errors of every level from one set of probes per
  # reference, over the layer blocks as cells.
  groups: dict[tuple[str, str], list[str] | None] = {("network", "all"): None}
  groups.update(
    {("layer", name): [name] for name, _ in blocks} if plan.per_block else {}
  )
  groups.update(
    {
      ("role", role): [n for n, _ in blocks if roles[n] == role]
      for role in types
    }
  )
  return Layout(blocks, types, groups, *_cells(s.params, blocks, groups))


def _diagonal_errors(ops: Operators, m: str, layout: Layout) -> dict:
  """`{group: (value, standard error)}` of the approximation's diagonal
  against reference `m`'s, for every group of the `layout`."""
  approx, exact = ops.of[ops.label], ops.of[m]
  ones, probes = ops.ones, ops.probes

  def fn(a, e, c, g, key):
    return matrix_free.relative_diagonal_error(
      lambda v, a, e: a(v),
      lambda v, a, e: e(v),
      ones,
      probes.diagonal,
      key,
      approx.operator(a),
      exact.operator(e),
      cells=c,
      groups=g,
      batch_size=probes.batch,
    )

  found = ops.costs.call(
    f"diagonal error {m}",
    fn,
    ops.states[ops.label],
    ops.states[m],
    layout.cells,
    layout.membership,
    ops.keys["diagonal"],
  )
  return {
    key: (float(v), float(se))
    for key, v, se in zip(
      layout.groups, *(np.asarray(x, np.float64) for x in found)
    )
  }


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


def _network_quality(ops, m, plan, spectra_of, diagonal, approx_dirs, grads):
  """The whole network's quality rows against reference `m`, given the
  approximation's damped directions (`approx_dirs`, by relative damping)
  and its diagonal errors against `m` (`diagonal`, by group)."""
  probes = plan.probes
  ap_nodes, ap_w, ap_top, ap_vecs = spectra_of[ops.label]
  ex_nodes, ex_w, ex_top, ex_vecs = spectra_of[m]
  frob, diag = ops.frobenius(ops.label, m), diagonal["network", "all"]
  distances, errors = _slq_distances(
    (ap_nodes, ap_w), (ex_nodes, ex_w), rows.floor(plan, ex_top), probes.slq
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
    relative_frobenius=(frob[1], probes.frobenius),
    diagonal_relative_error=(diag[1], probes.diagonal),
  )
  exact_scale = rows.scale(ex_top)
  for rho in plan.relative_dampings:
    direction = ops.costs.call(
      f"exact {m} direction",
      lambda s, g, d, of=ops.of[m]: of.precondition(s, g, d),
      ops.states[m],
      grads,
      rho * exact_scale,
    )
    values["natural_gradient_cosine", rho] = metrics.cosine(
      approx_dirs[rho], rows.flat(direction)
    )
  return rows.quality(
    m, "network", "all", values, errors, probes.target_precision
  )


def _restricted_quality(ops, compared, diagonal, plan, params, part):
  """The quality rows of both matrices restricted to the parameters of
  `part`, `(level, name, indices)` (a layer block or a block type),
  against each distinct reference (`compared`), with the diagonal errors
  taken over the whole network (`diagonal`, by reference and group)."""
  level, name, idx = part
  what = name if level == "layer" else f"block type {name}"
  mask = _block_mask(params, idx)
  probes, found = plan.probes, []
  ap_b, ap_bv = ops.run(ops.label, "top", mask, what)
  for m in compared:
    ex_b, ex_bv = ops.run(m, "top", mask, what)
    frob, diag = ops.frobenius(ops.label, m, mask, what), diagonal[m][part[:2]]
    values = dict(
      relative_frobenius=frob[0],
      top_k_overlap=metrics.subspace_overlap(
        _columns(ap_bv)[idx], _columns(ex_bv)[idx]
      ),
      top_eigenvalue_ratio=ap_b[0] / ex_b[0],
      diagonal_relative_error=diag[0],
    )
    errors = dict(
      relative_frobenius=(frob[1], probes.frobenius),
      diagonal_relative_error=(diag[1], probes.diagonal),
    )
    found += rows.quality(
      m, level, name, values, errors, probes.target_precision
    )
  return found
