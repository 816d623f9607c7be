"""Spectra records on a tiny problem against brute force."""

import jax
import numpy as np
import pandas as pd
import pytest

from curvbench import config, curvatures, measurements, spectra


def spec(**overrides):
  cfg = measurements.section(config.compose().measure.spectra)
  cfg.update(references=["ggn"], top_k=3, lanczos_iters=40, slq_probes=2,
             frobenius_probes=4, cg_iters=300)
  return dict(cfg, **overrides)


def make(tiny, name):
  cfg = measurements.section(config.compose(f"curvature={name}").curvature)
  return curvatures.make(cfg, tiny[0].loss_fn)


def quality(rows):
  return {r["metric"]: r["value"] for r in rows}


def test_exact_spectrum_equals_numpy_and_exact_estimator_has_no_error(
    tiny, tiny_ggn):
  p, params, batch = tiny
  cur = make(tiny, "explicit_exact")
  rows, qual = spectra.measure(p.loss_fn, cur, params, batch, spec(),
                               jax.random.PRNGKey(1))
  df = pd.DataFrame(rows)
  assert {"source", "matrix", "reference", "index", "eigenvalue",
          "weight"} <= set(df.columns)
  exact = df[(df.source == "exact") & (df.matrix == "ggn")].eigenvalue
  np.testing.assert_allclose(exact, np.linalg.eigvalsh(tiny_ggn), atol=1e-10)
  approx = df[df.source == "approx"].eigenvalue
  np.testing.assert_allclose(approx, np.linalg.eigvalsh(tiny_ggn), atol=1e-10)
  q = quality(qual)
  assert q["relative_frobenius"] < 1e-10
  assert q["log_wasserstein"] < 1e-6
  assert q["natural_gradient_cosine"] == pytest.approx(1.0, abs=1e-8)
  assert q["top_k_overlap"] == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("block_type", ["kfac", "diagonal", "identity"])
def test_block_spectrum_and_metrics_against_dense_export(tiny, tiny_ggn,
                                                         block_type):
  p, params, batch = tiny
  cur = make(tiny, block_type)
  rows, qual = spectra.measure(p.loss_fn, cur, params, batch, spec(),
                               jax.random.PRNGKey(1))
  state = curvatures.estimate(cur, jax.random.PRNGKey(1), params, batch)
  dense = np.asarray(cur.to_dense(state))
  df = pd.DataFrame(rows)
  np.testing.assert_allclose(df[df.source == "approx"].eigenvalue,
                             np.linalg.eigvalsh(dense), atol=1e-10)
  q = quality(qual)
  assert q["relative_frobenius"] == pytest.approx(
      np.linalg.norm(dense - tiny_ggn) / np.linalg.norm(tiny_ggn), rel=1e-8)
  assert 0 < q["relative_frobenius"] and -1 <= q["natural_gradient_cosine"] <= 1
  if block_type == "diagonal":  # the exact diagonal keeps the trace
    assert q["trace_ratio"] == pytest.approx(1.0, rel=1e-8)


def test_lanczos_method_agrees_with_dense(tiny, tiny_ggn):
  p, params, batch = tiny
  cur = make(tiny, "implicit_exact")
  rows, qual = spectra.measure(p.loss_fn, cur, params, batch,
                               spec(method="lanczos"), jax.random.PRNGKey(1))
  df = pd.DataFrame(rows)
  top = df[df.source == "exact_top_k"].eigenvalue.to_numpy()
  exact = np.linalg.eigvalsh(tiny_ggn)[::-1][:3]
  np.testing.assert_allclose(top, exact, rtol=1e-6)
  slq = df[(df.source == "exact")]
  assert slq.weight.sum() == pytest.approx(1.0, rel=1e-6)
  q = quality(qual)
  assert q["relative_frobenius"] < 1e-8
  assert q["natural_gradient_cosine"] == pytest.approx(1.0, abs=1e-4)


def test_lanczos_block_metrics_estimate_the_dense_ones(tiny):
  """The matrix-free metrics of a K-FAC estimate against the dense method's,
  at full Krylov depth (past the rank of the GGN, where Lanczos breaks down)."""
  p, params, batch = tiny
  cur = make(tiny, "kfac")
  dense = quality(spectra.measure(p.loss_fn, cur, params, batch, spec(),
                                  jax.random.PRNGKey(1))[1])
  lanczos = quality(spectra.measure(
      p.loss_fn, cur, params, batch,
      spec(method="lanczos", frobenius_probes=400, lanczos_iters=235),
      jax.random.PRNGKey(1))[1])
  assert lanczos["relative_frobenius"] == pytest.approx(
      dense["relative_frobenius"], rel=0.1)
  assert lanczos["top_eigenvalue_ratio"] == pytest.approx(
      dense["top_eigenvalue_ratio"], rel=1e-6)
  assert lanczos["top_k_overlap"] == pytest.approx(dense["top_k_overlap"],
                                                   abs=1e-6)
  # The matrix-free exact direction is CG's, to a relative residual of 1e-5.
  assert lanczos["natural_gradient_cosine"] == pytest.approx(
      dense["natural_gradient_cosine"], abs=1e-5)


def test_dense_method_that_would_not_fit_says_the_alternative(tiny):
  p, params, batch = tiny
  with pytest.raises(MemoryError, match="lanczos"):
    spectra.measure(p.loss_fn, make(tiny, "kfac"), params, batch,
                    spec(max_dense_gib=1e-9), jax.random.PRNGKey(0))
