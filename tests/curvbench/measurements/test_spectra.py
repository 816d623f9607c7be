"""Spectra records on a tiny problem against brute force."""

import dataclasses
import functools

import jax
import numpy as np
import pandas as pd
import pytest

from curvbench.approximations import CURVATURES, Nearer
from curvbench.core import curvatures, metrics
from curvbench.core.costs import Costs
from curvbench.measurements.spectra import compute as spectra
from curvbench.measurements.spectra import summary
from tests.cases import RHO, spectra_settings, tiny_curvature

# The shared small settings, with conjugate gradients run long enough for
# the tight comparisons here.
spec = functools.partial(spectra_settings, cg_iters=300)


def quality(tables, block="all", reference="ggn", rho=RHO):
  """`{metric: value}` of one block against one reference; the
  natural-gradient cosine at relative damping `rho`."""
  return {
    r["metric"]: r["value"]
    for r in tables["quality"]
    if r["block"] == block
    and r["reference"] == reference
    and (np.isnan(r["relative_damping"]) or r["relative_damping"] == rho)
  }


def test_exact_spectrum_equals_numpy_and_exact_estimator_has_no_error(
  tiny, tiny_ggn
):
  p, params, batch = tiny
  cur = tiny_curvature(tiny, "explicit_exact")
  tables = spectra.measure(
    p.loss_fn, cur, params, batch, spec(), jax.random.PRNGKey(1)
  )
  df = pd.DataFrame(tables["spectra"])
  assert {
    "source",
    "matrix",
    "reference",
    "index",
    "eigenvalue",
    "weight",
  } <= set(df.columns)
  exact = df[(df.source == "exact") & (df.matrix == "ggn")].eigenvalue
  np.testing.assert_allclose(exact, np.linalg.eigvalsh(tiny_ggn), atol=1e-10)
  approx = df[df.source == "approx"].eigenvalue
  np.testing.assert_allclose(approx, np.linalg.eigvalsh(tiny_ggn), atol=1e-10)
  q = quality(tables)
  assert q["relative_frobenius"] < 1e-10
  assert q["log_wasserstein"] < 1e-6
  assert q["natural_gradient_cosine"] == pytest.approx(1.0, abs=1e-8)
  assert q["top_k_overlap"] == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("block_type", ["kfac", "diagonal", "identity"])
def test_block_spectrum_and_metrics_against_dense_export(
  tiny, tiny_ggn, block_type
):
  p, params, batch = tiny
  cur = tiny_curvature(tiny, block_type)
  tables = spectra.measure(
    p.loss_fn, cur, params, batch, spec(), jax.random.PRNGKey(1)
  )
  state = curvatures.estimate(cur, jax.random.PRNGKey(1), params, batch)
  dense = np.asarray(cur.to_dense(state))
  df = pd.DataFrame(tables["spectra"])
  np.testing.assert_allclose(
    df[df.source == "approx"].eigenvalue, np.linalg.eigvalsh(dense), atol=1e-10
  )
  q = quality(tables)
  assert q["relative_frobenius"] == pytest.approx(
    np.linalg.norm(dense - tiny_ggn) / np.linalg.norm(tiny_ggn), rel=1e-8
  )
  assert 0 < q["relative_frobenius"] and -1 <= q["natural_gradient_cosine"] <= 1
  if block_type == "diagonal":  # the exact diagonal keeps the trace
    assert q["trace_ratio"] == pytest.approx(1.0, rel=1e-8)


def test_lanczos_method_agrees_with_dense(tiny, tiny_ggn):
  p, params, batch = tiny
  cur = tiny_curvature(tiny, "implicit_exact")
  tables = spectra.measure(
    p.loss_fn, cur, params, batch, spec(method="lanczos"), jax.random.PRNGKey(1)
  )
  df = pd.DataFrame(tables["spectra"])
  top = df[df.source == "exact_top_k"].eigenvalue.to_numpy()
  exact = np.linalg.eigvalsh(tiny_ggn)[::-1][:3]
  np.testing.assert_allclose(top, exact, rtol=1e-6)
  slq = df[(df.source == "exact")]
  assert slq.weight.sum() == pytest.approx(1.0, rel=1e-6)
  q = quality(tables)
  assert q["relative_frobenius"] < 1e-8
  assert q["natural_gradient_cosine"] == pytest.approx(1.0, abs=1e-4)


@pytest.mark.slow
def test_lanczos_block_metrics_estimate_the_dense_ones(tiny):
  """The matrix-free metrics of a K-FAC estimate against the dense method's,
  at full Krylov depth (past the rank of the GGN, where Lanczos breaks down),
  for the whole network and for each block type (here the hidden layer's
  type, named by the problem, and the output layer's, by its tag)."""
  p, params, batch = tiny
  cur = tiny_curvature(tiny, "kfac")
  roles = (("dense_0", "hidden"),)
  dense_tables = spectra.measure(
    p.loss_fn,
    cur,
    params,
    batch,
    spec(),
    jax.random.PRNGKey(1),
    layer_roles=roles,
  )
  lanczos_tables = spectra.measure(
    p.loss_fn,
    cur,
    params,
    batch,
    spec(method="lanczos", frobenius_probes=400, lanczos_iters=235),
    jax.random.PRNGKey(1),
    layer_roles=roles,
  )
  for block in ("all", "hidden", "dense"):
    dense, lanczos = (quality(t, block) for t in (dense_tables, lanczos_tables))
    assert lanczos["relative_frobenius"] == pytest.approx(
      dense["relative_frobenius"], rel=0.1
    ), block
    assert lanczos["top_eigenvalue_ratio"] == pytest.approx(
      dense["top_eigenvalue_ratio"], rel=1e-6
    ), block
    assert lanczos["top_k_overlap"] == pytest.approx(
      dense["top_k_overlap"], abs=1e-6
    ), block
  dense, lanczos = quality(dense_tables), quality(lanczos_tables)
  # The matrix-free exact direction is CG's, to a relative residual of 1e-5.
  assert lanczos["natural_gradient_cosine"] == pytest.approx(
    dense["natural_gradient_cosine"], abs=1e-5
  )


def test_dense_method_that_would_not_fit_says_the_alternative(tiny):
  p, params, batch = tiny
  with pytest.raises(MemoryError, match="lanczos"):
    spectra.measure(
      p.loss_fn,
      tiny_curvature(tiny, "kfac"),
      params,
      batch,
      spec(max_dense_gib=1e-9),
      jax.random.PRNGKey(0),
    )


def test_per_block_quality_is_the_metric_of_each_exact_block(tiny, tiny_ggn):
  p, params, batch = tiny
  cur = tiny_curvature(tiny, "kfac")
  tables = spectra.measure(
    p.loss_fn, cur, params, batch, spec(), jax.random.PRNGKey(1)
  )
  approx = np.asarray(
    cur.to_dense(curvatures.estimate(cur, jax.random.PRNGKey(1), params, batch))
  )
  blocks = curvatures.layer_blocks(p.loss_fn, params, batch)
  assert {r["block"] for r in tables["quality"]} == {
    "all",
    *(name for name, _ in blocks),
  }
  assert {r["reference"] for r in tables["quality"]} == {"ggn"}
  for name, idx in blocks:
    a, e = approx[np.ix_(idx, idx)], tiny_ggn[np.ix_(idx, idx)]
    q = quality(tables, name)
    assert q["relative_frobenius"] == pytest.approx(
      np.linalg.norm(a - e) / np.linalg.norm(e), rel=1e-8
    )
    assert q["top_eigenvalue_ratio"] == pytest.approx(
      np.linalg.eigvalsh(a)[-1] / np.linalg.eigvalsh(e)[-1], rel=1e-8
    )
    assert q["trace_ratio"] == pytest.approx(
      np.trace(a) / np.trace(e), rel=1e-8
    )


def _wasserstein_fraction(rows, exact):
  df = pd.DataFrame(rows)
  slq = df[df.source == "exact"]
  return metrics.spectral_distance(slq.eigenvalue, exact, slq.weight)


@pytest.mark.slow
def test_signed_hessian_density_and_top_k_match_the_exact_spectrum(tiny):
  """SLQ (40 Lanczos steps, 8 probes) of the indefinite Hessian lies within
  1% of the spectrum's width of its exact eigenvalues (1-Wasserstein), puts
  the right mass below zero, and Lanczos top-k equals the top eigenvalues."""
  p, params, batch = tiny
  flat_params, unravel = jax.flatten_util.ravel_pytree(params)
  hessian = jax.hessian(lambda w: p.loss_fn(unravel(w), batch))(flat_params)
  exact = np.linalg.eigvalsh(hessian)
  assert exact.min() < -1e-3  # signed: there is negative mass to get right
  cur = tiny_curvature(tiny, "implicit_hessian")
  tables = spectra.measure(
    p.loss_fn,
    cur,
    params,
    batch,
    spec(
      method="lanczos", slq_probes=8, per_block=False, references=["hessian"]
    ),
    jax.random.PRNGKey(1),
  )
  assert _wasserstein_fraction(tables["spectra"], exact) < 0.01
  df = pd.DataFrame(tables["spectra"])
  np.testing.assert_allclose(
    df[df.source == "exact_top_k"].eigenvalue, exact[::-1][:3], rtol=1e-6
  )
  stats = {(r["source"], r["statistic"]): r for r in tables["statistics"]}
  trace = stats[("exact", "trace")]
  assert abs(trace["value"] - exact.sum()) < 4 * trace["stderr"]
  assert stats[("exact", "min_eigenvalue")]["value"] == pytest.approx(
    exact.min(), rel=1e-3
  )
  zero = spectra.floor(spec(), exact)
  assert stats[("exact", "negative_mass")]["value"] == pytest.approx(
    np.mean(exact < -zero), abs=0.03
  )


def test_zero_is_at_least_ten_round_offs_of_the_precision():
  """A PSD matrix measured in float32 has a null space at +-1e-8 of its top
  eigenvalue; that is zero, not negative mass."""
  cfg = spec(relative_floor=1e-8, precision="float32", damping=1e-3, top_k=2)
  values = np.array([-1.5e-8, 0.0, 1e-8, 0.5, 1.0]) * 1287.0
  assert spectra.floor(cfg, values) == pytest.approx(
    10 * np.finfo(np.float32).eps * 1287.0
  )
  assert spectra.spectrum_statistics(values, cfg)["negative_mass"] == 0.0
  as64 = dataclasses.replace(cfg, precision="float64")
  assert spectra.floor(as64, values) == pytest.approx(1e-8 * 1287.0)
  assert spectra.spectrum_statistics(values, as64)["negative_mass"] == 0.2


def test_dense_statistics_and_heatmaps_are_exact(tiny, tiny_ggn):
  p, params, batch = tiny
  cur = tiny_curvature(tiny, "kfac")
  cfg = spec(heatmap_blocks=2, heatmap_units=4, damping=0.1)
  tables = spectra.measure(
    p.loss_fn, cur, params, batch, cfg, jax.random.PRNGKey(1)
  )
  stats = {
    (r["source"], r["matrix"], r["statistic"]): r["value"]
    for r in tables["statistics"]
  }
  eigs = np.linalg.eigvalsh(tiny_ggn)
  assert stats[("exact", "ggn", "trace")] == pytest.approx(
    eigs.sum(), rel=1e-10
  )
  assert stats[("exact", "ggn", "max_eigenvalue")] == pytest.approx(
    eigs[-1], rel=1e-10
  )
  blocks = curvatures.layer_blocks(p.loss_fn, params, batch)
  units = spectra.heatmap_units(blocks, 2, 4)
  idx = np.concatenate([i for _, i in units])
  heat = pd.DataFrame(tables["heatmaps"])
  assert len(heat) == 4 * len(idx) ** 2

  def matrix(source, kind):
    part = heat[(heat.source == source) & (heat.kind == kind)]
    return part.pivot(index="row", columns="col", values="value").to_numpy()

  np.testing.assert_allclose(
    matrix("exact", "matrix"), tiny_ggn[np.ix_(idx, idx)], atol=1e-12
  )
  inverse = np.linalg.inv(tiny_ggn + 0.1 * np.eye(235))
  np.testing.assert_allclose(
    matrix("exact", "inverse"), inverse[np.ix_(idx, idx)], rtol=1e-8, atol=1e-12
  )
  # K-FAC's own damped inverse, column by column.
  state = cur.refresh(
    curvatures.estimate(cur, jax.random.PRNGKey(1), params, batch), 0.1
  )
  unravel = jax.flatten_util.ravel_pytree(params)[1]
  column = jax.flatten_util.ravel_pytree(
    cur.precondition(state, unravel(np.eye(235)[idx[0]]), 0.1)
  )[0]
  np.testing.assert_allclose(
    matrix("approx", "inverse")[:, 0], np.asarray(column)[idx], rtol=1e-8
  )


def test_natural_gradient_cosine_compares_matrices_at_damping_relative_to_each(
  tiny, tiny_ggn
):
  """At each relative damping rho, the exact GGN is damped by rho times its
  largest eigenvalue and K-FAC by rho times its own (through its own
  preconditioner, as its optimizer applies it): brute force in float64."""
  p, params, batch = tiny
  cur = tiny_curvature(tiny, "kfac")
  rhos = [1e-4, 1e-2]
  tables = spectra.measure(
    p.loss_fn,
    cur,
    params,
    batch,
    spec(relative_dampings=rhos),
    jax.random.PRNGKey(1),
  )
  state = curvatures.estimate(cur, jax.random.PRNGKey(1), params, batch)
  approx = np.asarray(cur.to_dense(state))
  flat, unravel = jax.flatten_util.ravel_pytree(params)
  g = np.asarray(
    jax.flatten_util.ravel_pytree(jax.grad(p.loss_fn)(params, batch))[0]
  )
  for rho in rhos:
    exact_dir = np.linalg.solve(
      tiny_ggn + rho * np.linalg.eigvalsh(tiny_ggn)[-1] * np.eye(len(g)), g
    )
    damping = rho * np.linalg.eigvalsh(approx)[-1]
    approx_dir = np.asarray(
      jax.flatten_util.ravel_pytree(
        cur.precondition(cur.refresh(state, damping), unravel(g), damping)
      )[0]
    )
    assert quality(tables, rho=rho)["natural_gradient_cosine"] == (
      pytest.approx(metrics.cosine(approx_dir, exact_dir), abs=1e-10)
    )
  cosines = [
    r
    for r in tables["quality"]
    if r["block"] == "all" and r["metric"] == "natural_gradient_cosine"
  ]
  assert sorted(r["relative_damping"] for r in cosines) == rhos


def test_quality_against_every_reference_and_identical_ones_said_once(tiny):
  """Against the GGN and the Hessian each, at every level; the Fisher of
  softmax cross-entropy is the GGN, which the references table shows, and
  gets no quality rows of its own."""
  p, params, batch = tiny
  flat, unravel = jax.flatten_util.ravel_pytree(params)
  hessian = np.asarray(
    jax.hessian(lambda w: p.loss_fn(unravel(w), batch))(flat)
  )
  cur = tiny_curvature(tiny, "kfac")
  tables = spectra.measure(
    p.loss_fn,
    cur,
    params,
    batch,
    spec(references=["ggn", "fisher", "hessian"]),
    jax.random.PRNGKey(1),
  )
  q = pd.DataFrame(tables["quality"])
  assert set(q.reference) == {"ggn", "hessian"}
  assert (q.groupby("reference").size() == len(q) // 2).all()
  approx = np.asarray(
    cur.to_dense(curvatures.estimate(cur, jax.random.PRNGKey(1), params, batch))
  )
  assert quality(tables, reference="hessian")["relative_frobenius"] == (
    pytest.approx(
      np.linalg.norm(approx - hessian) / np.linalg.norm(hessian), rel=1e-8
    )
  )
  pairs = {
    (r["matrix"], r["reference"]): r["relative_frobenius"]
    for r in tables["references"]
  }
  assert pairs[("fisher", "ggn")] < 1e-12
  assert pairs[("hessian", "ggn")] > 1e-3


@pytest.mark.slow
def test_matrix_free_measures_a_reference_equal_to_an_earlier_one_once(tiny):
  """Matrix-free, the Fisher of softmax cross-entropy (the GGN) gets no
  products of its own: its spectrum and statistics rows repeat the GGN's,
  and the Hessian, a different matrix, is measured."""
  p, params, batch = tiny
  costs = Costs()
  tables = spectra.measure(
    p.loss_fn,
    tiny_curvature(tiny, "kfac"),
    params,
    batch,
    spec(
      method="lanczos",
      references=["fisher", "hessian"],
      per_block=False,
      per_block_type=False,
    ),
    jax.random.PRNGKey(1),
    costs,
  )
  phases = {r["phase"] for r in costs.rows}
  assert {"exact ggn density", "exact hessian density"} <= phases
  assert not any(ph.startswith("exact fisher") for ph in phases)
  rows = pd.DataFrame(tables["spectra"] + tables["statistics"])
  exact = rows[rows.source.str.startswith("exact")]
  ggn, fisher = (
    exact[exact.matrix == m].drop(
      columns=["matrix", "reference"], errors="ignore"
    )
    for m in ("ggn", "fisher")
  )
  assert len(fisher) > 0
  pd.testing.assert_frame_equal(
    ggn.reset_index(drop=True), fisher.reset_index(drop=True)
  )
  assert set(pd.DataFrame(tables["quality"]).reference) == {"ggn", "hessian"}


@pytest.mark.slow
def test_gradient_share_in_the_top_eigenvectors_against_brute_force(tiny):
  """Dense and matrix-free alike: the share of the mean gradient's squared
  norm in the span of each exact matrix's top k eigenvectors."""
  p, params, batch = tiny
  flat, unravel = jax.flatten_util.ravel_pytree(params)
  loss = lambda w: p.loss_fn(unravel(w), batch)
  hessian = np.asarray(jax.hessian(loss)(flat), np.float64)
  g = np.asarray(jax.grad(loss)(flat), np.float64)
  values, vectors = np.linalg.eigh(hessian)
  top = vectors[:, np.argsort(values)[::-1][:3]]
  expected = np.sum((top.T @ g) ** 2) / (g @ g)
  assert 0 < expected < 1
  for method, tolerance in (("dense", 1e-9), ("lanczos", 1e-6)):
    tables = spectra.measure(
      p.loss_fn,
      tiny_curvature(tiny, "kfac"),
      params,
      batch,
      spec(
        method=method,
        references=["hessian"],
        per_block=False,
        per_block_type=False,
      ),
      jax.random.PRNGKey(1),
    )
    share = {
      r["matrix"]: r["value"]
      for r in tables["statistics"]
      if r["statistic"] == spectra.GRADIENT_SHARE
    }
    assert share["hessian"] == pytest.approx(expected, rel=tolerance), method
    assert 0 < share["ggn"] <= 1


def test_a_block_diagonal_approximation_is_decomposed_by_its_blocks(tiny):
  """Block-diagonal K-FAC's eigendecomposition is assembled from its
  layer blocks' (the same spectrum, eigenvectors of the same matrix);
  block-tridiagonal K-FAC couples layers, so it is decomposed whole."""
  p, params, batch = tiny
  blocks = curvatures.layer_blocks(p.loss_fn, params, batch)

  def dense(name):
    cur = tiny_curvature(tiny, name)
    return cur, np.asarray(
      cur.to_dense(
        curvatures.estimate(cur, jax.random.PRNGKey(1), params, batch)
      )
    )

  cur, kfac = dense("kfac")
  values, vectors = spectra.joined_eigh(
    kfac, blocks, {n: np.linalg.eigh(kfac[np.ix_(i, i)]) for n, i in blocks}
  )
  np.testing.assert_allclose(values, np.linalg.eigvalsh(kfac), atol=1e-12)
  np.testing.assert_allclose(kfac @ vectors, vectors * values, atol=1e-12)
  np.testing.assert_allclose(
    vectors.T @ vectors, np.eye(len(values)), atol=1e-12
  )
  _, coupled = dense("kfac_tridiagonal")
  assert spectra.joined_eigh(coupled, blocks, {}) is None
  costs = Costs()
  tables = spectra.measure(
    p.loss_fn,
    cur,
    params,
    batch,
    spec(per_block_type=False, heatmap_blocks=0),
    jax.random.PRNGKey(1),
    costs,
  )
  phases = {r["phase"] for r in costs.rows}
  assert "eigh approx (from its blocks)" in phases
  assert "eigh approx" not in phases
  df = pd.DataFrame(tables["spectra"])
  np.testing.assert_allclose(
    df[df.source == "approx"].eigenvalue, np.linalg.eigvalsh(kfac), atol=1e-10
  )


def test_the_closest_method_is_named_by_the_statistic_it_quotes():
  """One sample far off moves a method's mean but not its median: the
  finding ranks, quotes and compares the same statistic (medians), so
  the method it names first never has the higher figure."""
  spiky, steady = [0.1, 0.1, 0.1, 0.1, 0.1, 2.0], [0.3] * 6
  rows = [
    dict(
      problem="p",
      data="d",
      step=0,
      reference="ggn",
      level="network",
      block="all",
      label=label,
      metric="relative_frobenius",
      relative_damping=np.nan,
      run_id=f"r{label}{i}",
      seed=i,
      sample=0,
      value=value,
    )
    for label, values in (("spiky", spiky), ("steady", steady))
    for i, value in enumerate(values)
  ]
  [finding] = summary.findings(pd.DataFrame(rows))
  assert finding.startswith(
    "p vs exact ggn: spiky comes closest, relative "
    "Frobenius error 0.1 (median [quartiles], n=6)"
  )
  assert "not told apart from steady's 0.3 (" in finding
  assert "(difference -0.2 [95 % interval -0.2, 1.7]" in finding
  few = pd.DataFrame(rows)
  [finding] = summary.findings(few[few.seed < 5])
  assert "too few samples to tell it from steady's" in finding


def test_a_declared_claim_gets_a_verdict_per_cell_and_a_gap_over_its_floor(
  monkeypatch,
):
  """kfac made to claim it is nearer than diagonal: where its errors sit
  below diagonal's in every paired sample it holds, where above it does
  not, where the samples straddle it is not settled, and where both score
  alike (the same block) the cell is left out; gaps are paired over the
  floor."""
  monkeypatch.setattr(
    CURVATURES.get("kfac"),
    "claims",
    (
      Nearer(
        than="diagonal", source="A. Author (2025)", floor="explicit_exact"
      ),
    ),
  )
  errors = {  # block: (kfac, diagonal, floor) per seed
    "dense": (
      [0.2, 0.21, 0.19, 0.2, 0.22, 0.2],
      [0.5, 0.52, 0.49, 0.5, 0.51, 0.5],
      [0.1] * 6,
    ),
    "conv": (
      [0.6, 0.62, 0.61, 0.6, 0.6, 0.61],
      [0.3, 0.31, 0.3, 0.29, 0.3, 0.3],
      [0.1] * 6,
    ),
    "attention": ([0.3, 0.5] * 3, [0.4] * 6, [0.1] * 6),
    "norm": ([0.4] * 6, [0.4] * 6, [0.1] * 6),
  }
  rows = [
    dict(
      problem="p",
      data="batch",
      step=0,
      mode="ggn_exact",
      reference="ggn",
      level="role",
      block=block,
      curvature=name,
      label=f"{name}/ggn_exact",
      metric=metric,
      relative_damping=np.nan,
      run_id=f"{name}{seed}",
      seed=seed,
      sample=0,
      value=value * (metric == "relative_frobenius"),
    )
    for block, per_method in errors.items()
    for name, values in zip(("kfac", "diagonal", "explicit_exact"), per_method)
    for seed, value in enumerate(values)
    for metric in ("relative_frobenius", "trace_ratio")
  ]
  [line], table = summary.claims(pd.DataFrame(rows))
  assert line.startswith(
    "Claim (A. Author (2025)): kfac is nearer the exact matrix than diagonal"
  )
  assert (
    "holds in 1, does not hold in 1, not settled in 1, too few samples to "
    "tell in 0 of 3" in line
  )
  verdicts = table.data.set_index("block").verdict.to_dict()
  assert verdicts == {
    "dense": "holds",
    "conv": "does not hold",
    "attention": "not settled",
  }
  dense = table.data.set_index("block").loc["dense"]
  kfac, diagonal, floor = map(np.array, errors["dense"])
  assert dense.diff_median == pytest.approx(np.median(kfac - diagonal))
  assert dense.gap_median == pytest.approx(np.median(kfac - floor))
  assert dense.than_gap_median == pytest.approx(np.median(diagonal - floor))
  assert dense.n == 6
  # From three seeds, no cell gets a verdict.
  few = pd.DataFrame(rows)
  _, table = summary.claims(few[few.seed < 3])
  assert set(table.data.verdict) == {"too few samples to tell"}
  # Against a matrix the mode does not estimate, the cells do not count.
  crossed = [
    dict(r, reference="empirical_fisher", value=1 - r["value"]) for r in rows
  ]
  [again], _ = summary.claims(pd.DataFrame(rows + crossed))
  assert again == line
  # Without the other approximation measured, no claim is checked.
  alone = pd.DataFrame([r for r in rows if r["curvature"] != "diagonal"])
  assert summary.claims(alone) == ([], None)
