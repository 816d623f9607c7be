"""Matrix-free spectral estimates against NumPy's eigh, exact traces and the
harness's earlier hand-written Lanczos, SLQ and Hutchinson code; trace and
diagonal estimators against exact values and their known variances
(float64)."""

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest
from matfree import decomp

from curvbench.core import matrix_free as mf

N, K, PROBES = 12, 4, 5  # shared so that the tests share compilations
LIKE_SHAPES = {"w": (3, 2), "b": (6,)}  # a params-shaped pytree with N entries


@pytest.fixture(autouse=True)
def x64():
  previous = jax.config.read("jax_enable_x64")
  jax.config.update("jax_enable_x64", True)
  yield
  jax.config.update("jax_enable_x64", previous)


def _spd(n, seed, low=0.1, high=10.0):
  """A random SPD matrix with well-separated eigenvalues in [low, high]."""
  q, _ = np.linalg.qr(np.random.default_rng(seed).normal(size=(n, n)))
  return (q * np.geomspace(low, high, n)) @ q.T


def _like():
  return {k: jnp.zeros(s, jnp.float64) for k, s in LIKE_SHAPES.items()}


def _tree_matvec(v, matrix):
  """`matrix @ v` for pytrees like `_like()`: the operator as params do it."""
  flat, unravel = jax.flatten_util.ravel_pytree(v)
  return unravel(matrix @ flat)


def _flat_matvec(v, matrix):
  return matrix @ v


def _first_of_pair(v, a, e):
  return _tree_matvec(v, a)


def _second_of_pair(v, a, e):
  return _tree_matvec(v, e)


def _rows(tree):
  """A pytree with a leading axis -> a (leading, dim) array."""
  return np.asarray(
    jax.vmap(lambda t: jax.flatten_util.ravel_pytree(t)[0])(tree)
  )


def _symmetric(n, seed):
  """A random symmetric matrix, indefinite, with every entry nonzero."""
  b = np.random.default_rng(seed).normal(size=(n, n))
  return (b + b.T) / 2


def _with_spectrum(eigenvalues, seed):
  """A symmetric matrix with the given eigenvalues and random eigenvectors."""
  n = len(eigenvalues)
  q, _ = np.linalg.qr(np.random.default_rng(seed).normal(size=(n, n)))
  return (q * np.asarray(eigenvalues)) @ q.T


def _hutchinson_sigma(matrix, num):
  """Std of the mean of `num` Rademacher quadratic forms `vᵀ M v`."""
  var = 2 * (np.sum(matrix**2) - np.sum(np.diag(matrix) ** 2))
  return np.sqrt(var / num)


# --- references: the harness's hand-written code before matrix_free ---------
# (copied from curvbench/spectra.py; tridiag_sym is jitted to keep this fast)


def ref_lanczos_top_k(matvec, dim, k, iters, rng, dtype):
  iters = min(max(iters, k), dim)
  v0 = jax.random.normal(rng, (dim,), dtype)
  q, t, *_ = jax.jit(decomp.tridiag_sym(iters), static_argnums=0)(matvec, v0)
  vals, vecs = jnp.linalg.eigh(t)
  ritz = np.asarray(vecs.T @ q).T
  return np.asarray(vals)[::-1][:k], ritz[:, ::-1][:, :k]


def ref_slq(matvec, dim, iters, probes, rng, dtype):
  iters = min(iters, dim)
  tridiag = jax.jit(decomp.tridiag_sym(iters), static_argnums=0)
  nodes, weights = [], []
  for key in jax.random.split(rng, probes):
    v = jax.random.rademacher(key, (dim,), dtype)
    _, t, *_ = tridiag(matvec, v)
    vals, vecs = jnp.linalg.eigh(t)
    nodes.append(np.asarray(vals))
    weights.append(np.asarray(vecs[0] ** 2) / probes)
  return np.concatenate(nodes), np.concatenate(weights)


def ref_relative_frobenius(approx_mv, exact_mv, dim, probes, rng, dtype):
  num, den = 0.0, 0.0
  for key in jax.random.split(rng, probes):
    v = jax.random.rademacher(key, (dim,), dtype)
    ev = np.asarray(exact_mv(v), np.float64)
    num += np.sum((np.asarray(approx_mv(v), np.float64) - ev) ** 2)
    den += np.sum(ev**2)
  return np.sqrt(num / den)


# --- tests -------------------------------------------------------------------


def test_sampler_draws_one_rademacher_probe_per_split_key():
  key = jax.random.PRNGKey(4)
  probes = _rows(mf.rademacher_sampler(_like(), 5)(key))
  expected = [
    jax.random.rademacher(k, (N,), jnp.float64)
    for k in jax.random.split(key, 5)
  ]
  np.testing.assert_array_equal(probes, np.stack(expected))
  assert set(np.unique(probes)) == {-1.0, 1.0}


def test_top_k_at_full_depth_are_the_top_eigenpairs():
  a, k = _spd(N, seed=0), K
  values, vectors = mf.top_k_eigenpairs(
    _tree_matvec, _like(), k, N, jax.random.PRNGKey(1), jnp.asarray(a)
  )
  exact_values, exact_vectors = np.linalg.eigh(a)
  np.testing.assert_allclose(values, exact_values[::-1][:k], rtol=1e-10)
  ritz = _rows(vectors).T  # (N, k) columns
  np.testing.assert_allclose(ritz.T @ ritz, np.eye(k), atol=1e-10)
  np.testing.assert_allclose(a @ ritz, ritz * np.asarray(values), atol=1e-9)
  top = exact_vectors[:, ::-1][:, :k]
  overlap = np.linalg.norm(top.T @ ritz) ** 2 / k
  assert overlap == pytest.approx(1.0, abs=1e-10)
  # The k+1-th eigenvector is orthogonal to the span: overlap is not trivial.
  assert np.linalg.norm(exact_vectors[:, -k - 1] @ ritz) < 1e-8


def test_lanczos_past_the_rank_keeps_only_true_ritz_pairs():
  """A rank-4 operator at full depth: its Krylov space has 5 dimensions (the
  null-space part of the start vector adds eigenvalue 0), Lanczos breaks down
  after 5 steps, and the round-off basis after that must give no eigenvalue
  and no weight."""
  q, _ = np.linalg.qr(np.random.default_rng(3).normal(size=(N, N)))
  eigenvalues = np.zeros(N)
  eigenvalues[-4:] = [0.5, 1.0, 2.0, 4.0]
  a = jnp.asarray((q * eigenvalues) @ q.T)
  values, vectors = mf.top_k_eigenpairs(
    _tree_matvec, _like(), 7, N, jax.random.PRNGKey(1), a
  )
  np.testing.assert_allclose(
    values[:5], [4.0, 2.0, 1.0, 0.5, 0.0], rtol=1e-9, atol=1e-9
  )
  assert np.isnan(values[5:]).all()  # not found
  ritz = _rows(vectors)[:5].T
  np.testing.assert_allclose(ritz.T @ ritz, np.eye(5), atol=1e-9)
  np.testing.assert_allclose(np.asarray(a) @ ritz, ritz * values[:5], atol=1e-9)
  nodes, weights = mf.slq_density(
    _tree_matvec, _like(), N, PROBES, jax.random.PRNGKey(2), a
  )
  assert np.sum(weights) == pytest.approx(1.0, abs=1e-12)
  weighted = np.asarray(nodes)[np.asarray(weights) > 1e-12]
  assert weighted.min() > -1e-9 and weighted.max() < 4.0 + 1e-9


def test_slq_at_full_depth_is_eigenvalues_with_probe_weights():
  a, probes, key = _spd(N, seed=1), PROBES, jax.random.PRNGKey(2)
  nodes, weights = mf.slq_density(
    _tree_matvec, _like(), N, probes, key, jnp.asarray(a)
  )
  exact_values, exact_vectors = np.linalg.eigh(a)
  np.testing.assert_allclose(
    np.reshape(nodes, (probes, N)),
    np.tile(exact_values, (probes, 1)),
    rtol=1e-9,
  )
  v = _rows(mf.rademacher_sampler(_like(), probes)(key))
  expected = (v @ exact_vectors) ** 2 / N / probes  # (U^T v)^2 / |v|^2 / P
  np.testing.assert_allclose(
    np.reshape(weights, (probes, N)), expected, atol=1e-12
  )
  assert np.sum(weights) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("iters", [5, N])
def test_slq_moments_are_the_hutchinson_trace_estimates(iters):
  # Gauss quadrature with `iters` nodes is exact for degrees < 2 * iters.
  a, probes = _spd(N, seed=2, low=0.5, high=2.0), PROBES
  key = jax.random.PRNGKey(3)
  nodes, weights = map(
    np.asarray,
    mf.slq_density(_tree_matvec, _like(), iters, probes, key, jnp.asarray(a)),
  )
  v = _rows(mf.rademacher_sampler(_like(), probes)(key))
  for p in range(2 * iters):
    hutchinson = np.mean(
      np.einsum("pi,ij,pj->p", v, np.linalg.matrix_power(a, p), v)
    )
    assert N * np.sum(weights * nodes**p) == pytest.approx(
      hutchinson, rel=1e-9
    ), p


def test_slq_moments_converge_to_the_exact_trace_moments():
  a, probes = _spd(N, seed=3, low=0.5, high=2.0), 2000
  nodes, weights = map(
    np.asarray,
    mf.slq_density(
      _flat_matvec,
      jnp.zeros(N),
      N,
      probes,
      jax.random.PRNGKey(5),
      jnp.asarray(a),
    ),
  )
  for p in (1, 2, 3):
    power = np.linalg.matrix_power(a, p)
    tol = 5 * _hutchinson_sigma(power, probes)
    assert tol < 0.05 * np.trace(power)  # the check is not vacuous
    assert N * np.sum(weights * nodes**p) == pytest.approx(
      np.trace(power), abs=tol
    )


def test_relative_frobenius_is_zero_for_identical_operators():
  a = jnp.asarray(_spd(N, seed=4))
  value, stderr = mf.relative_frobenius(
    _first_of_pair,
    _second_of_pair,
    _like(),
    PROBES,
    jax.random.PRNGKey(0),
    a,
    a,
  )
  assert float(value) == 0.0 and float(stderr) == 0.0


def test_relative_frobenius_converges_to_the_exact_ratio():
  exact, approx, probes = _spd(N, seed=5), _spd(N, seed=6), 10000
  estimate, _ = mf.relative_frobenius(
    _first_of_pair,
    _second_of_pair,
    _like(),
    probes,
    jax.random.PRNGKey(6),
    jnp.asarray(approx),
    jnp.asarray(exact),
  )
  diff = approx - exact
  num, den = np.sum(diff**2), np.sum(exact**2)
  # sqrt(num / den) moves by about half the relative errors of num and den.
  rel = 0.5 * (
    _hutchinson_sigma(diff.T @ diff, probes) / num
    + _hutchinson_sigma(exact.T @ exact, probes) / den
  )
  truth = np.sqrt(num / den)
  assert 5 * rel < 0.05  # the check is not vacuous
  assert float(estimate) == pytest.approx(truth, rel=5 * rel)


@pytest.mark.parametrize("iters", [5, N])
def test_equals_the_hand_written_reference(iters):
  exact, approx = _spd(N, seed=7), _spd(N, seed=8)
  key, k, probes = jax.random.PRNGKey(11), K, PROBES
  flat = lambda m: (lambda v: jnp.asarray(m) @ v)

  values, vectors = mf.top_k_eigenpairs(
    _tree_matvec, _like(), k, iters, key, jnp.asarray(exact)
  )
  ref_values, ref_vectors = ref_lanczos_top_k(
    flat(exact), N, k, iters, key, jnp.float64
  )
  np.testing.assert_allclose(values, ref_values, rtol=1e-12)
  ritz = _rows(vectors).T
  signs = np.sign(np.sum(ritz * ref_vectors, axis=0))
  np.testing.assert_allclose(ritz * signs, ref_vectors, atol=1e-12)

  nodes, weights = mf.slq_density(
    _tree_matvec, _like(), iters, probes, key, jnp.asarray(exact)
  )
  ref_nodes, ref_weights = ref_slq(
    flat(exact), N, iters, probes, key, jnp.float64
  )
  np.testing.assert_allclose(nodes, ref_nodes, rtol=1e-12, atol=1e-12)
  np.testing.assert_allclose(weights, ref_weights, atol=1e-12)

  value, _ = _frobenius(approx, exact, probes)(key)
  ref = ref_relative_frobenius(
    flat(approx), flat(exact), N, probes, key, jnp.float64
  )
  assert float(value) == pytest.approx(ref, rel=1e-12)


def test_hutchinson_trace_is_the_probe_mean_with_its_standard_error():
  a, probes, key = _symmetric(N, seed=9), PROBES, jax.random.PRNGKey(7)
  estimate, sem = mf.hutchinson_trace(
    _flat_matvec, jnp.zeros(N), probes, key, jnp.asarray(a)
  )
  v = _rows(mf.rademacher_sampler(jnp.zeros(N), probes)(key))
  forms = np.einsum("pi,ij,pj->p", v, a, v)
  assert float(estimate) == pytest.approx(np.mean(forms), rel=1e-12)
  assert float(sem) == pytest.approx(
    np.std(forms, ddof=1) / np.sqrt(probes), rel=1e-12
  )


def test_hutchinson_trace_and_standard_error_match_theory():
  a, probes = _symmetric(N, seed=10), 4000
  assert np.linalg.eigvalsh(a).min() < 0 < np.linalg.eigvalsh(a).max()
  estimate, sem = mf.hutchinson_trace(
    _flat_matvec, jnp.zeros(N), probes, jax.random.PRNGKey(8), jnp.asarray(a)
  )
  sigma = _hutchinson_sigma(a, probes)
  assert float(sem) == pytest.approx(sigma, rel=0.15)
  assert abs(float(estimate) - np.trace(a)) < 4 * float(sem)
  assert 4 * sigma < 0.2 * np.linalg.norm(a)  # the check is not vacuous


XN, XPROBES = 40, 8  # XTrace estimates (not traces exactly) for 2 * 8 < 40


def test_xtrace_is_exact_below_the_probe_count():
  a = _with_spectrum([-3.0, -1.0, 2.0, 5.0] + [0.0] * (XN - 4), seed=11)
  estimate, sem = mf.xtrace(
    _flat_matvec, jnp.zeros(XN), XPROBES, jax.random.PRNGKey(9), jnp.asarray(a)
  )
  assert float(estimate) == pytest.approx(np.trace(a), abs=1e-8)
  assert float(sem) < 1e-8
  # Hutchinson with as many matvecs is far off on the same operator.
  hutch, _ = mf.hutchinson_trace(
    _flat_matvec,
    jnp.zeros(XN),
    2 * XPROBES,
    jax.random.PRNGKey(9),
    jnp.asarray(a),
  )
  assert abs(float(hutch) - np.trace(a)) > 1e-3


def test_xtrace_error_is_within_its_standard_errors_at_full_rank():
  a = jnp.asarray(_symmetric(XN, seed=12))
  errors, sems = [], []
  for seed in range(10):
    estimate, sem = mf.xtrace(
      _flat_matvec, jnp.zeros(XN), XPROBES, jax.random.PRNGKey(seed), a
    )
    errors.append(float(estimate) - np.trace(a))
    sems.append(float(sem))
  errors, sems = np.asarray(errors), np.asarray(sems)
  assert np.all(sems > 0)
  # A leave-one-out error estimate from 8 probes is itself noisy: most, not
  # all, errors fall within 4 of them.
  assert np.mean(np.abs(errors) < 4 * sems) >= 0.8
  # On average it has the size of the actual error.
  rms = np.sqrt(np.mean(errors**2))
  assert 0.5 < rms / np.sqrt(np.mean(sems**2)) < 2


def test_xtrace_beats_hutchinson_on_a_decaying_spectrum():
  signs = np.random.default_rng(13).choice([-1.0, 1.0], XN)
  a = jnp.asarray(_with_spectrum(signs / np.arange(1, XN + 1) ** 2, seed=14))
  x_errors, h_errors = [], []
  for seed in range(5):
    key = jax.random.PRNGKey(seed)
    x, _ = mf.xtrace(_flat_matvec, jnp.zeros(XN), XPROBES, key, a)
    # As many matvecs: XTrace spends two per probe.
    h, _ = mf.hutchinson_trace(_flat_matvec, jnp.zeros(XN), 2 * XPROBES, key, a)
    x_errors.append(abs(float(x) - np.trace(a)))
    h_errors.append(abs(float(h) - np.trace(a)))
  assert np.mean(x_errors) < 0.25 * np.mean(h_errors)


def test_stochastic_diagonal_is_exact_for_a_diagonal_operator():
  d = np.random.default_rng(15).normal(size=N)
  diagonal, sem = mf.stochastic_diagonal(
    _flat_matvec,
    jnp.zeros(N),
    PROBES,
    jax.random.PRNGKey(0),
    jnp.asarray(np.diag(d)),
  )
  np.testing.assert_allclose(diagonal, d, rtol=1e-12)
  np.testing.assert_allclose(sem, np.zeros(N), atol=1e-12)


def test_stochastic_diagonal_is_within_its_standard_errors():
  a, probes = _symmetric(N, seed=16), 2000
  diagonal, sem = mf.stochastic_diagonal(
    _flat_matvec, jnp.zeros(N), probes, jax.random.PRNGKey(1), jnp.asarray(a)
  )
  diagonal, sem = np.asarray(diagonal), np.asarray(sem)
  # Entry i of v * (A v) is A_ii + sum_{j != i} A_ij v_i v_j.
  sigma = np.sqrt((np.sum(a**2, axis=1) - np.diag(a) ** 2) / probes)
  np.testing.assert_allclose(sem, sigma, rtol=0.15)
  inside = np.abs(diagonal - np.diag(a)) < 4 * sem
  assert np.mean(inside) >= 0.9
  assert np.max(4 * sem) < 0.5 * np.max(np.abs(np.diag(a)))  # not vacuous


def test_pytree_operators_give_the_flat_results():
  a = _symmetric(N, seed=17)
  key = jax.random.PRNGKey(3)
  for estimator in (mf.hutchinson_trace, mf.xtrace):
    tree = estimator(_tree_matvec, _like(), PROBES, key, jnp.asarray(a))
    flat = estimator(_flat_matvec, jnp.zeros(N), PROBES, key, jnp.asarray(a))
    np.testing.assert_allclose(tree, flat, rtol=1e-12)
  tree = mf.stochastic_diagonal(
    _tree_matvec, _like(), PROBES, key, jnp.asarray(a)
  )
  flat = mf.stochastic_diagonal(
    _flat_matvec, jnp.zeros(N), PROBES, key, jnp.asarray(a)
  )
  for tree_part, flat_part in zip(tree, flat):
    assert set(tree_part) == set(LIKE_SHAPES)
    assert all(tree_part[k].shape == s for k, s in LIKE_SHAPES.items())
    np.testing.assert_allclose(
      _rows(jax.tree.map(lambda x: x[None], tree_part))[0],
      flat_part,
      rtol=1e-12,
    )


def test_xtrace_names_too_many_probes():
  with pytest.raises(ValueError, match="num_probes <= the operator's dim"):
    mf.xtrace(_flat_matvec, jnp.zeros(3), 4, jax.random.PRNGKey(0), jnp.eye(3))


@pytest.mark.parametrize(
  "call, name",
  [
    (
      lambda: mf.top_k_eigenpairs(
        _flat_matvec, jnp.zeros(3), 0, 3, jax.random.PRNGKey(0), jnp.eye(3)
      ),
      "k",
    ),
    (
      lambda: mf.slq_density(
        _flat_matvec, jnp.zeros(3), 3, 0, jax.random.PRNGKey(0), jnp.eye(3)
      ),
      "num_probes",
    ),
    (
      lambda: mf.relative_frobenius(
        _flat_matvec,
        _flat_matvec,
        jnp.zeros(3),
        0,
        jax.random.PRNGKey(0),
        jnp.eye(3),
      ),
      "num_probes",
    ),
  ]
  + [
    (
      lambda f=f: f(
        _flat_matvec, jnp.zeros(3), 0, jax.random.PRNGKey(0), jnp.eye(3)
      ),
      "num_probes",
    )
    for f in (mf.hutchinson_trace, mf.xtrace, mf.stochastic_diagonal)
  ],
)
def test_bad_counts_are_named(call, name):
  with pytest.raises(ValueError, match=f"{name} must be a positive integer"):
    call()


# --- standard errors of the relative errors, and the probes a precision needs

REPEATS = 200  # independent estimates behind each calibration check


def _pair(n, seed, off_diagonal=0.3):
  """`(approx, exact)`: a random symmetric `exact` and `approx` off it by a
  random symmetric error (`off_diagonal` of it off the diagonal)."""
  rng = np.random.default_rng(seed)
  exact = np.diag(rng.uniform(1, 3, n)) + 0.1 * _symmetric(n, seed + 1)
  error = np.diag(rng.normal(0, 0.5, n)) + off_diagonal * 0.1 * _symmetric(
    n, seed + 2
  )
  return exact + error, exact


def _repeated(fn, num):
  """`fn(key)` over `num` independent keys, stacked (one compilation)."""
  return jax.vmap(fn)(jax.random.split(jax.random.PRNGKey(2024), num))


def _frobenius(approx, exact, probes, **kwargs):
  return lambda key: mf.relative_frobenius(
    _first_of_pair,
    _second_of_pair,
    _like(),
    probes,
    key,
    jnp.asarray(approx),
    jnp.asarray(exact),
    **kwargs,
  )


def _check_calibrated(estimates, stderrs, truth, tol=0.25):
  """The reported standard errors match the estimates' spread, and the
  truth lies within 3 of them in at least 95 % of the repeats."""
  estimates, stderrs = np.asarray(estimates), np.asarray(stderrs)
  spread = np.std(estimates, ddof=1)
  assert np.mean(stderrs) == pytest.approx(spread, rel=tol)
  assert np.mean(np.abs(estimates - truth) <= 3 * stderrs) >= 0.95
  # The bias is small beside the error (and the check not vacuous).
  assert abs(np.mean(estimates) - truth) < 0.25 * np.mean(stderrs)
  assert np.mean(stderrs) < 0.2 * truth


def test_relative_frobenius_error_is_the_delta_method_of_the_ratio():
  """The standard error is the delta method's for sqrt(mean n / mean d),
  covariance of the paired n and d included, with sample (co)variances."""
  approx, exact = _pair(N, seed=20)
  probes, key = 20, jax.random.PRNGKey(3)
  estimate, stderr = _frobenius(approx, exact, probes)(key)
  v = _rows(mf.rademacher_sampler(_like(), probes)(key))
  n = np.sum((v @ (approx - exact)) ** 2, axis=1)  # symmetric: (A - E) v
  d = np.sum((v @ exact) ** 2, axis=1)
  big_n, big_d = n.mean(), d.mean()
  ratio = np.sqrt(big_n / big_d)
  cov = np.cov(n, d, ddof=1)
  expected = (
    ratio
    / 2
    * np.sqrt(
      cov[0, 0] / (probes * big_n**2)
      + cov[1, 1] / (probes * big_d**2)
      - 2 * cov[0, 1] / (probes * big_n * big_d)
    )
  )
  assert float(estimate) == pytest.approx(ratio, rel=1e-12)
  assert float(stderr) == pytest.approx(expected, rel=1e-10)
  assert float(stderr) > 0.01 * ratio
  # A multiple of the exact operator has n = 0.09 d probe by probe: the
  # covariance cancels the variances, and the error vanishes.
  estimate, stderr = _frobenius(1.3 * exact, exact, probes)(key)
  assert float(estimate) == pytest.approx(0.3, rel=1e-12)
  assert abs(float(stderr)) < 1e-12
  _, one = _frobenius(approx, exact, 1)(key)
  assert np.isnan(one)


def test_relative_frobenius_error_matches_the_spread_over_keys():
  approx, exact = _pair(N, seed=21)
  truth = np.linalg.norm(approx - exact) / np.linalg.norm(exact)
  estimates, stderrs = _repeated(_frobenius(approx, exact, 20), REPEATS)
  _check_calibrated(estimates, stderrs, truth)


def _first_of_flat_pair(v, a, e):
  return a @ v


def _second_of_flat_pair(v, a, e):
  return e @ v


def _diagonal_error(approx, exact, probes, **kwargs):
  return lambda key: mf.relative_diagonal_error(
    _first_of_flat_pair,
    _second_of_flat_pair,
    jnp.zeros(len(exact)),
    probes,
    key,
    jnp.asarray(approx),
    jnp.asarray(exact),
    **kwargs,
  )


def test_relative_diagonal_error_matches_the_spread_over_keys():
  """Unbiased squared norms: the estimate centres on the exact diagonal
  error, where the norm of the mean diagonal reads higher by about its
  standard error (off-diagonal mass is noise in every entry)."""
  approx, exact = _pair(30, seed=22, off_diagonal=6.0)
  truth = np.linalg.norm(np.diag(approx - exact)) / np.linalg.norm(
    np.diag(exact)
  )
  estimates, stderrs = _repeated(_diagonal_error(approx, exact, 50), REPEATS)
  _check_calibrated(estimates, stderrs, truth)
  diagonal = lambda m: _repeated(
    lambda key: mf.stochastic_diagonal(
      _flat_matvec, jnp.zeros(30), 50, key, jnp.asarray(m)
    )[0],
    REPEATS,
  )
  naive = np.linalg.norm(diagonal(approx - exact), axis=1) / np.linalg.norm(
    diagonal(exact), axis=1
  )
  assert np.mean(naive) - truth > 0.5 * np.mean(stderrs)


def test_relative_diagonal_error_over_groups_of_cells():
  """Each group (a union of cells) gets the estimate of its entries alone,
  from the same probes: the documented formula, by hand."""
  approx, exact = _pair(9, seed=23, off_diagonal=3.0)
  probes, key = 12, jax.random.PRNGKey(5)
  cells = np.array([0, 0, 1, 1, 1, 2, 2, 2, 2])
  groups = np.array([[1, 1, 1], [1, 0, 0], [0, 1, 1], [0, 0, 1]])
  estimates, stderrs = _diagonal_error(
    approx, exact, probes, cells=cells, groups=groups
  )(key)
  v = _rows(mf.rademacher_sampler(jnp.zeros(9), probes)(key))
  x, y = v * (v @ (approx - exact)), v * (v @ exact)
  for g, row in enumerate(groups):
    s = row[cells] == 1
    xs, ys = x[:, s], y[:, s]
    xb, yb = xs.mean(0), ys.mean(0)
    num = xb @ xb - np.sum(np.var(xs, axis=0, ddof=1)) / probes
    den = yb @ yb - np.sum(np.var(ys, axis=0, ddof=1)) / probes
    z = 2 / den * (xs @ xb - num / den * (ys @ yb))
    se2 = np.std(z, ddof=1) / np.sqrt(probes)
    ratio = np.sqrt(max(num / den, 0))
    assert float(estimates[g]) == pytest.approx(ratio, rel=1e-10)
    assert float(stderrs[g]) == pytest.approx(
      np.sqrt(ratio**2 + se2) - ratio, rel=1e-8
    )
  same, _ = _diagonal_error(approx, approx, probes, cells=cells, groups=groups)(
    key
  )
  np.testing.assert_array_equal(same, 0.0)


def test_probes_needed_reaches_the_stated_precision():
  """20 probes report an error; the probes_needed for 2 % bring the
  spread of the estimate over keys to about 2 % of it."""
  approx, exact = _pair(N, seed=24, off_diagonal=3.0)
  truth = np.linalg.norm(approx - exact) / np.linalg.norm(exact)
  estimate, stderr = _frobenius(approx, exact, 20)(jax.random.PRNGKey(8))
  assert stderr > 0.02 * estimate  # 20 probes are not enough
  needed = int(mf.probes_needed(estimate, stderr, 20, 0.02))
  assert 40 < needed < 2000
  estimates, stderrs = _repeated(_frobenius(approx, exact, needed), REPEATS)
  assert np.std(estimates, ddof=1) / truth == pytest.approx(0.02, rel=0.25)
  assert np.mean(stderrs / estimates) == pytest.approx(0.02, rel=0.25)


def test_probes_needed_at_the_edges():
  assert mf.probes_needed(0.5, 0.05, 20, 0.05) == 80  # 20 * (0.05 / 0.025)^2
  assert mf.probes_needed(0.5, 0.01, 20, 0.05) == 4
  assert mf.probes_needed(-2.0, 0.1, 10, 0.05) == 10  # by magnitude
  assert mf.probes_needed(0.3, 0.0, 20, 0.05) == 1  # exact
  assert mf.probes_needed(0.0, 0.1, 20, 0.05) == float("inf")
  assert np.isnan(mf.probes_needed(0.3, float("nan"), 1, 0.05))


def test_batched_probes_give_the_same_estimates():
  approx, exact = _pair(N, seed=25)
  key = jax.random.PRNGKey(9)
  for fn in (_frobenius, lambda a, e, p, **kw: _diagonal_error(a, e, p, **kw)):
    whole = fn(approx, exact, 7)(key)
    batched = fn(approx, exact, 7, batch_size=3)(key)
    np.testing.assert_allclose(batched, whole, rtol=1e-12)
  nodes, weights = mf.slq_density(
    _tree_matvec, _like(), 6, 5, key, jnp.asarray(exact)
  )
  batched = mf.slq_density(
    _tree_matvec, _like(), 6, 5, key, jnp.asarray(exact), batch_size=2
  )
  np.testing.assert_allclose(batched[0], nodes, rtol=1e-12)
  np.testing.assert_allclose(batched[1], weights, rtol=1e-12, atol=1e-15)
