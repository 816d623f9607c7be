"""Measurements on a tiny problem: record schemas and values vs brute force."""

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pandas as pd
import pytest

import problems
from curvbench import curvatures, metrics, records, spectra, timing, training

SPEC = dict(method="dense", references=["ggn"], damping=1e-3, top_k=3,
            relative_floor=1e-8, lanczos_iters=40, slq_probes=2,
            frobenius_probes=4, cg_iters=300)


@pytest.fixture(scope="module")
def tiny():
  p = problems.make(dict(name="mlp", batch_size=8, width=3, depth=1,
                         data=dict(name="digits")))
  params = p.init_params(jax.random.PRNGKey(0), jnp.float64)
  return p, params, p.fixed_batch(dtype=np.float64)


def brute_force_ggn(problem, params, batch):
  """mean_i J_iᵀ (diag(p_i) - p_i p_iᵀ) J_i from jax.jacobian, in float64."""
  flat, unravel = jax.flatten_util.ravel_pytree(params)
  x, _ = batch
  logits_fn = lambda w: problem.net.apply(unravel(w), x)
  jac = jax.jacobian(logits_fn)(flat)  # (n, C, P)
  prob = jax.nn.softmax(logits_fn(flat))
  hess = jax.vmap(lambda q: jnp.diag(q) - jnp.outer(q, q))(prob)
  return np.asarray(jnp.einsum("ncp,ncd,ndq->pq", jac, hess, jac) / len(x))


def _quality(rows):
  return {r["metric"]: r["value"] for r in rows}


def test_exact_spectrum_equals_numpy_and_exact_estimator_has_no_error(tiny):
  p, params, batch = tiny
  cur = curvatures.make(dict(name="explicit_exact", estimator="explicit_exact",
                             mode="ggn_exact"), p.loss_fn)
  rows, quality = spectra.measure(p.loss_fn, cur, params, batch, SPEC,
                                  jax.random.PRNGKey(1))
  df = pd.DataFrame(rows)
  assert {"source", "matrix", "reference", "index", "eigenvalue",
          "weight"} <= set(df.columns)
  ggn = brute_force_ggn(p, params, batch)
  exact = df[(df.source == "exact") & (df.matrix == "ggn")].eigenvalue
  np.testing.assert_allclose(exact, np.linalg.eigvalsh(ggn), atol=1e-10)
  approx = df[df.source == "approx"].eigenvalue
  np.testing.assert_allclose(approx, np.linalg.eigvalsh(ggn), atol=1e-10)
  q = _quality(quality)
  assert q["relative_frobenius"] < 1e-10
  assert q["log_wasserstein"] < 1e-6
  assert q["natural_gradient_cosine"] == pytest.approx(1.0, abs=1e-8)
  assert q["top_k_overlap"] == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("block_type", ["kfac", "diagonal", "identity"])
def test_block_spectrum_and_metrics_against_dense_export(tiny, block_type):
  p, params, batch = tiny
  cur = curvatures.make(dict(name=block_type, block_type=block_type,
                             mode="ggn_exact"), p.loss_fn)
  rows, quality = spectra.measure(p.loss_fn, cur, params, batch, SPEC,
                                  jax.random.PRNGKey(1))
  state = spectra.estimate(cur, params, batch, jax.random.PRNGKey(1))
  dense = np.asarray(cur.to_dense(state))
  df = pd.DataFrame(rows)
  np.testing.assert_allclose(df[df.source == "approx"].eigenvalue,
                             np.linalg.eigvalsh(dense), atol=1e-10)
  ggn = brute_force_ggn(p, params, batch)
  q = _quality(quality)
  assert q["relative_frobenius"] == pytest.approx(
      np.linalg.norm(dense - ggn) / np.linalg.norm(ggn), rel=1e-8)
  assert 0 < q["relative_frobenius"] and -1 <= q["natural_gradient_cosine"] <= 1
  if block_type == "diagonal":  # the exact diagonal keeps the trace
    assert q["trace_ratio"] == pytest.approx(1.0, rel=1e-8)


def test_lanczos_method_agrees_with_dense(tiny):
  p, params, batch = tiny
  cur = curvatures.make(dict(name="implicit_exact", estimator="implicit_exact",
                             matrix="ggn"), p.loss_fn)
  rows, quality = spectra.measure(p.loss_fn, cur, params, batch,
                                  dict(SPEC, method="lanczos"),
                                  jax.random.PRNGKey(1))
  df = pd.DataFrame(rows)
  top = df[df.source == "exact_top_k"].eigenvalue.to_numpy()
  exact = np.linalg.eigvalsh(brute_force_ggn(p, params, batch))[::-1][:3]
  np.testing.assert_allclose(top, exact, rtol=1e-6)
  slq = df[(df.source == "exact")]
  assert slq.weight.sum() == pytest.approx(1.0, rel=1e-6)
  q = _quality(quality)
  assert q["relative_frobenius"] < 1e-8
  assert q["natural_gradient_cosine"] == pytest.approx(1.0, abs=1e-4)


def test_dense_that_would_not_fit_says_size_and_alternative(tiny):
  p, params, batch = tiny
  cur = curvatures.make(dict(name="explicit_exact", estimator="explicit_exact",
                             mode="ggn_exact", max_dense_gib=1e-9), p.loss_fn)
  with pytest.raises(MemoryError, match=r"235 x 235.*implicit_exact"):
    cur.init(jax.random.PRNGKey(0), params, batch)
  with pytest.raises(MemoryError, match="lanczos"):
    spectra.measure(p.loss_fn, cur, params, batch,
                    dict(SPEC, max_dense_gib=1e-9), jax.random.PRNGKey(0))


def test_curvature_config_errors(tiny):
  p = tiny[0]
  with pytest.raises(ValueError, match="Unknown block type 'lowrank'"):
    curvatures.make(dict(name="x", block_type="lowrank"), p.loss_fn)
  with pytest.raises(ValueError, match="Unknown estimation mode 'fisher'"):
    curvatures.make(dict(name="x", mode="fisher"), p.loss_fn)
  with pytest.raises(ValueError, match="Unknown estimator"):
    curvatures.make(dict(name="x", estimator="magic"), p.loss_fn)
  with pytest.raises(ValueError, match="implicit_exact multiplies"):
    curvatures.make(dict(name="x", estimator="implicit_exact", matrix="ef"),
                    p.loss_fn)


def test_timing_record_schema(tiny):
  p, params, batch = tiny
  cur = curvatures.make(dict(name="kfac", mode="fisher_gradients"), p.loss_fn)
  rows = timing.measure(p.loss_fn, cur, params, batch,
                        dict(warmup=1, repeats=3), jax.random.PRNGKey(0))
  df = pd.DataFrame(rows)
  assert list(df.phase) == list(timing.PHASES)
  assert (df[["compile_s", "first_call_s", "median_s", "min_s"]] > 0).all().all()
  assert (df.repeats == 3).all()
  assert df.set_index("phase").ratio_to_grad_step["grad_step"] == 1.0
  env = timing.environment()
  assert env["jax_version"] == jax.__version__ and env["device_kind"]


def test_training_same_order_and_loss_decreases(tiny):
  p, params, _ = tiny
  cfg = dict(num_steps=12, log_every=1, eval_every=5, eval_size=50)
  runs = {}
  for name in ("sgd", "adam", "kfac"):
    cur = curvatures.make(dict(name="kfac", mode="ggn_exact"), p.loss_fn)
    opt = training.make_optimizer(
        p.loss_fn, dict(name=name, learning_rate=0.05 if name != "adam"
                        else 0.01, damping=0.1), cur)
    runs[name] = pd.DataFrame(training.run(p, opt, params, cfg,
                                           jax.random.PRNGKey(0), False))
  for name, df in runs.items():
    assert list(df.step) == list(range(12))
    assert df.wall_s.is_monotonic_increasing
    assert df.test_loss.notna().sum() == 4  # steps 0, 5, 10 and the last
    assert df.train_loss.iloc[-4:].mean() < df.train_loss.iloc[0], name
  # Same initial parameters and first batch: the first losses agree.
  first = {n: df.train_loss.iloc[0] for n, df in runs.items()}
  assert len(set(np.round(list(first.values()), 10))) == 1
  with pytest.raises(ValueError, match="Unknown optimizer 'lbfgs'"):
    training.make_optimizer(p.loss_fn, dict(name="lbfgs"))


def test_metrics_basics():
  rng = np.random.default_rng(0)
  a = rng.normal(size=(6, 6))
  a = a @ a.T
  assert metrics.relative_frobenius(a, a) == 0
  u = metrics.top_eigenvectors(a, 2)
  assert metrics.subspace_overlap(u, u) == pytest.approx(1.0)
  assert metrics.subspace_overlap(u, metrics.top_eigenvectors(-a, 2)) < 0.5
  eigs = np.linalg.eigvalsh(a)
  assert metrics.log_wasserstein(eigs, eigs, 1e-8) == 0
  assert metrics.log_wasserstein(10 * eigs, eigs, 1e-8) == pytest.approx(1.0)


def test_records_atomic_tables_and_marker(tmp_path):
  run = records.RunDir(tmp_path / "run")
  df = records.tidy([dict(a=1.0), dict(a=2.0)], problem="mlp", seed=0)
  assert list(df.columns) == ["problem", "seed", "a"]
  run.write_table("t", df)
  assert not run.done and records.find_runs(tmp_path) == []
  run.mark_done()
  assert run.done and run.marker()["status"] == "complete"
  pd.testing.assert_frame_equal(run.tables()["t"], df)
  assert [r.path for r in records.find_runs(tmp_path)] == [run.path]
  assert not list(run.path.glob("*.tmp"))
