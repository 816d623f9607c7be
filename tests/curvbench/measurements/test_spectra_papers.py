"""The spectra measurements three papers' findings read: the cosine
similarity of an approximation to the exact matrix (Morwani et al. 2025),
the gradient's alignment with the curvature (Gur-Ari et al. 2018) and
Papyan's class-mean test of the GGN's outliers (2019, 2020), against hand
computations and brute force in float64."""

import types

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pandas as pd
import pytest

from curvbench import approximations, config, runs
from curvbench.core import metrics, records
from curvbench.core.data import Data
from curvbench.measurements.spectra import class_means
from curvbench.measurements.spectra import compute as spectra
from tests.cases import spectra_settings, tiny_curvature
from tests.conftest import TINY

# --- cosine similarity ---------------------------------------------------------


def test_cosine_similarity_by_hand_and_its_best_rescaling():
  a = np.array([[1.0, 2.0], [2.0, 3.0]])
  e = np.array([[2.0, 0.0], [0.0, 1.0]])
  # <A, E> = 2 + 3; ||A||^2 = 1 + 4 + 4 + 9; ||E||^2 = 4 + 1.
  cos = 5 / np.sqrt(18 * 5)
  assert metrics.cosine_similarity(a, e) == pytest.approx(cos, rel=1e-14)
  assert metrics.cosine_similarity(7 * a, e) == pytest.approx(cos, rel=1e-14)
  best = np.sum(a * e) / np.sum(a * a)  # the c minimising ||E - c A||_F
  assert metrics.relative_frobenius(best * a, e) == pytest.approx(
    np.sqrt(1 - cos**2), rel=1e-12
  )
  assert metrics.relative_frobenius(a, e) > np.sqrt(1 - cos**2)


def test_cosine_similarity_is_recorded_wherever_the_relative_frobenius_is(
  tiny, tiny_ggn
):
  p, params, batch = tiny
  for name, exact in (("explicit_exact", True), ("kfac", False)):
    tables = spectra.measure(
      p.loss_fn,
      tiny_curvature(tiny, name),
      params,
      batch,
      spectra_settings(),
      jax.random.key(1),
    )
    q = pd.DataFrame(tables["quality"]).set_index(["level", "block", "metric"])
    where = lambda m, q=q: set(q.xs(m, level="metric").index)
    assert where("cosine_similarity") == where("relative_frobenius")
    assert len(where("cosine_similarity")) > 2  # network and blocks
    for level, block in where("cosine_similarity"):
      cos = q.value[level, block, "cosine_similarity"]
      frob = q.value[level, block, "relative_frobenius"]
      if exact:
        assert cos == pytest.approx(1.0, abs=1e-12)
      else:  # the best rescaling does at least as well as none
        assert 0 < cos < 1 and np.sqrt(1 - cos**2) <= frob + 1e-12
  cur = tiny_curvature(tiny, "kfac")
  state = cur.estimate(jax.random.key(1), params, Data.of(batch), 1)
  approx = np.asarray(cur.to_dense(state), np.float64)
  assert q.value["network", "all", "cosine_similarity"] == pytest.approx(
    metrics.cosine_similarity(approx, tiny_ggn), rel=1e-9
  )


# --- gradient-curvature alignment ---------------------------------------------


def test_gradient_curvature_alignment_by_hand():
  m = np.diag([3.0, 1.0])
  g = np.array([1.0, 1.0])
  # gᵀ M g = 4, ||g|| = sqrt 2, ||M g|| = sqrt 10.
  assert metrics.gradient_curvature_alignment(g, m @ g) == pytest.approx(
    4 / np.sqrt(20), rel=1e-14
  )
  assert metrics.gradient_curvature_alignment(
    np.array([1.0, 0.0]), m @ np.array([1.0, 0.0])
  ) == pytest.approx(1.0)


# --- Papyan's class means -------------------------------------------------------


@pytest.fixture(scope="module")
def deltas(tiny):
  """`δ_{i,c'}` of the tiny batch by brute force, `(N, C, P)`."""
  p, params, (x, _) = tiny
  flat, unravel = jax.flatten_util.ravel_pytree(params)
  logits = lambda w: p.outputs(unravel(w), x)
  jac = jax.jacobian(logits)(flat)  # (N, C, P)
  rows = class_means.cotangents(logits(flat))  # (N, C', C)
  return np.asarray(jnp.einsum("ndc,ncp->ndp", rows, jac), np.float64)


def brute_class_means(deltas, labels):
  """`(δ_c, π_c)` of the classes present among `labels`, from the
  per-example `deltas`: `δ_c = mean_{i in c} Σ_{c'≠c} δ_{i,c'} / (C-1)`."""
  num = deltas.shape[1]
  present = np.unique(labels)
  means = np.stack(
    [
      deltas[labels == c][:, np.arange(num) != c].sum(1).mean(0) / (num - 1)
      for c in present
    ]
  )
  return means, np.array([np.mean(labels == c) for c in present])


def test_the_per_example_class_terms_sum_to_the_ggn(deltas, tiny_ggn):
  ggn = np.einsum("ndp,ndq->pq", deltas, deltas) / len(deltas)
  np.testing.assert_allclose(ggn, tiny_ggn, rtol=0, atol=1e-14)


def test_class_means_by_vector_jacobian_products_match_brute_force(
  tiny, deltas
):
  p, params, batch = tiny
  expected, expected_shares = brute_class_means(deltas, np.asarray(batch[1]))
  # Chunks of 3 and a rest of 2, as data=train chunks the split.
  x, y = batch
  chunks = (x[:6].reshape(2, 3, *x.shape[1:]), y[:6].reshape(2, 3))
  data = Data(chunks, (x[6:], y[6:]))
  for examples in (Data.of(batch), data):
    found = jax.jit(lambda w, d: class_means.sums(p.outputs, w, d))(
      params, examples
    )
    means, shares, classes = class_means.class_means(found)
    assert classes == deltas.shape[1]
    np.testing.assert_allclose(means, expected, rtol=0, atol=1e-14)
    np.testing.assert_allclose(shares, expected_shares, rtol=1e-14)


def test_the_class_by_class_route_gives_the_dense_class_mean_spectrum(
  tiny, deltas
):
  means, shares = brute_class_means(deltas, np.asarray(tiny[2][1]))
  k, num = len(shares), deltas.shape[1]
  g1 = (num - 1) * sum(s * np.outer(d, d) for s, d in zip(shares, means))
  np.testing.assert_allclose(class_means.dense(means, shares, num), g1)
  dense = np.linalg.eigvalsh(g1)[::-1]
  found = class_means.eigenvalues(means, shares, num)
  np.testing.assert_allclose(found, dense[:k], rtol=1e-10)
  assert np.abs(dense[k:]).max() < 1e-12 * dense[0]
  # The class means' own span overlaps them fully; a random one barely
  # (k/P on average).
  basis = np.linalg.qr(means.T)[0]
  assert class_means.overlap(basis, means) == pytest.approx(1.0, abs=1e-12)
  top = np.linalg.eigh(g1)[1][:, ::-1][:, :k]
  assert class_means.overlap(top, means) == pytest.approx(1.0, abs=1e-10)
  rng = np.random.default_rng(0)
  random = np.linalg.qr(rng.normal(size=(len(g1), k)))[0]
  assert class_means.overlap(random, means) < 0.2


def test_a_problem_the_class_means_do_not_apply_to_is_refused():
  problem = types.SimpleNamespace(
    name="autoencoder",
    task="reconstruction",
    loss_name="sigmoid_cross_entropy",
    has_state=False,
  )
  with pytest.raises(ValueError, match="softmax cross-entropy"):
    class_means.check_applies(problem)
  normed = types.SimpleNamespace(
    name="resnet",
    task="classification",
    loss_name="softmax_cross_entropy",
    has_state=True,
  )
  with pytest.raises(ValueError, match="batch norm"):
    class_means.check_applies(normed)


def test_class_means_need_the_ggn_and_the_outputs(tiny):
  p, params, batch = tiny
  overrides = ("curvature=diagonal", "curvature.mode=fisher_empirical")
  empirical = approximations.make(
    config.plain(config.compose(*overrides).curvature), p.loss_fn
  )
  cfg = spectra_settings(class_means=True, references=["hessian"])
  with pytest.raises(ValueError, match="add ggn to"):
    spectra.measure(
      p.loss_fn,
      empirical,
      params,
      batch,
      cfg,
      jax.random.key(1),
      outputs=p.outputs,
    )
  with pytest.raises(ValueError, match="outputs=problem.outputs"):
    spectra.measure(
      p.loss_fn,
      tiny_curvature(tiny, "kfac"),
      params,
      batch,
      spectra_settings(class_means=True),
      jax.random.key(1),
    )


@pytest.mark.parametrize(
  "method", ["dense", pytest.param("lanczos", marks=pytest.mark.slow)]
)
def test_gradient_alignment_and_class_mean_rows_against_brute_force(
  tiny, tiny_ggn, deltas, method
):
  """One measurement per method: the gradient-curvature alignment of the
  exact GGN, and the class-mean rows, each against brute force."""
  p, params, batch = tiny
  tables = spectra.measure(
    p.loss_fn,
    tiny_curvature(tiny, "kfac"),
    params,
    batch,
    spectra_settings(
      method=method,
      class_means=True,
      per_block=False,
      per_block_type=False,
      lanczos_iters=100,
    ),
    jax.random.key(1),
    outputs=p.outputs,
  )
  flat, unravel = jax.flatten_util.ravel_pytree(params)
  g = np.asarray(jax.grad(lambda w: p.loss_fn(unravel(w), batch))(flat))
  mg = tiny_ggn @ g
  expected = g @ mg / (np.linalg.norm(g) * np.linalg.norm(mg))
  assert 0 < expected < 1
  found = [
    r
    for r in tables["statistics"]
    if r["statistic"] == spectra.GRADIENT_ALIGNMENT
  ]
  assert [(r["source"], r["matrix"]) for r in found] == [("exact", "ggn")]
  assert found[0]["value"] == pytest.approx(expected, rel=1e-9)

  means, shares = brute_class_means(deltas, np.asarray(batch[1]))
  present = len(shares)
  g1 = (deltas.shape[1] - 1) * sum(
    s * np.outer(d, d) for s, d in zip(shares, means)
  )
  rows = [r for r in tables["spectra"] if r["source"] == "class_means"]
  assert {r["matrix"] for r in rows} == {"ggn"}
  np.testing.assert_allclose(
    [r["eigenvalue"] for r in rows],
    np.linalg.eigvalsh(g1)[::-1][:present],
    rtol=1e-9,
  )
  values, vectors = np.linalg.eigh(tiny_ggn)
  top = vectors[:, ::-1][:, :present]
  basis = np.linalg.qr(means.T)[0]
  expected = np.linalg.norm(top.T @ basis) ** 2 / present
  (overlap,) = [
    r["value"]
    for r in tables["statistics"]
    if r["statistic"] == class_means.OVERLAP and r["matrix"] == "ggn"
  ]
  tolerance = 1e-9 if method == "dense" else 1e-4
  assert overlap == pytest.approx(expected, abs=tolerance)
  assert present / len(tiny_ggn) < overlap <= 1 + 1e-12
  # G₁ is below the GGN (Loewner order), so each of its eigenvalues is
  # below the GGN's of the same rank (Weyl), as Papyan reports.
  ranked = np.sort(values)[::-1][:present]
  assert np.all(np.linalg.eigvalsh(g1)[::-1][:present] <= ranked + 1e-12)


@pytest.mark.slow
def test_a_spectra_run_with_class_means_writes_their_rows(tmp_path):
  cfg = config.compose(
    *TINY,
    "measure=spectra",
    "curvature=kfac",
    "measure.spectra.data=train",
    "measure.spectra.class_means=true",
  )
  assert runs.run(cfg, tmp_path / "run") == "complete"
  tables = records.RunDir(tmp_path / "run").tables()
  rows = tables["spectra"][tables["spectra"].source == "class_means"]
  assert set(rows.matrix) == {"ggn"} and set(rows.data) == {"train"}
  assert len(rows) == 10  # every digit is in the training split
  exact = tables["spectra"].query("source == 'exact' and matrix == 'ggn'")
  top = np.sort(exact.eigenvalue)[::-1][:10]
  found = rows.sort_values("index").eigenvalue.to_numpy()
  assert np.all(found > 0) and np.all(found <= top * (1 + 1e-9))
  stats = tables["statistics"].set_index(["matrix", "statistic"]).value
  assert 0 < stats["ggn", class_means.OVERLAP] <= 1
  assert -1 <= stats["ggn", spectra.GRADIENT_ALIGNMENT] <= 1
  assert "cosine_similarity" in set(tables["quality"].metric)
