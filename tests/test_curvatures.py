"""The curvature interface: every family agrees with its own dense export, and
the exact references agree with brute force."""

import jax
import jax.flatten_util
import numpy as np
import pytest

from curvbench import config, curvatures, measurements

FAMILY_CONFIGS = ("kfac", "diagonal", "full", "identity", "explicit_exact",
                  "implicit_exact", "implicit_hessian")


def make(tiny, name, *overrides):
  cfg = config.compose(f"curvature={name}", "curvature.cg_iters=500",
                       *overrides).curvature
  return curvatures.make(measurements.section(cfg), tiny[0].loss_fn)


def flat(tree):
  return np.asarray(jax.flatten_util.ravel_pytree(tree)[0])


@pytest.mark.parametrize("name", FAMILY_CONFIGS)
def test_every_family_agrees_with_its_dense_export(tiny, name):
  problem, params, batch = tiny
  cur = make(tiny, name)
  state = curvatures.estimate(cur, jax.random.PRNGKey(1), params, batch)
  dense = np.asarray(jax.jit(cur.to_dense)(state))
  assert dense.shape == (235, 235)
  np.testing.assert_allclose(dense, dense.T, atol=1e-12)
  unravel = jax.flatten_util.ravel_pytree(params)[1]
  v = np.random.default_rng(0).normal(size=235)
  np.testing.assert_allclose(flat(jax.jit(cur.multiply)(state, unravel(v))),
                             dense @ v, rtol=1e-9, atol=1e-12)
  np.testing.assert_allclose(np.sort(np.asarray(cur.eigenvalues(state))),
                             np.linalg.eigvalsh(dense), atol=1e-9)
  damping = 0.5
  solved = flat(jax.jit(cur.precondition)(cur.refresh(state, damping),
                                          unravel(v), damping))
  expected = np.linalg.solve(dense + damping * np.eye(235), v)
  # CG stops at jax's default relative residual, 1e-5.
  tol = 1e-4 if isinstance(cur, curvatures.ImplicitExact) else 1e-9
  if cur.block_type == "kfac":  # each Kronecker factor is damped instead
    assert np.all(np.isfinite(solved))
  else:
    assert np.linalg.norm(solved - expected) < tol * np.linalg.norm(expected)


def test_exact_references_equal_brute_force(tiny, tiny_ggn):
  problem, params, batch = tiny
  key = jax.random.PRNGKey(0)
  for matrix_free in (False, True):
    ggn = curvatures.exact("ggn", problem.loss_fn, matrix_free=matrix_free)
    state = curvatures.estimate(ggn, key, params, batch)
    np.testing.assert_allclose(ggn.to_dense(state), tiny_ggn, atol=1e-12)
  flat_params, unravel = jax.flatten_util.ravel_pytree(params)
  hessian = jax.hessian(lambda w: problem.loss_fn(unravel(w), batch))(
      flat_params)
  exact = curvatures.exact("hessian", problem.loss_fn, matrix_free=False)
  np.testing.assert_allclose(exact.to_dense(exact.init(key, params, batch)),
                             hessian, atol=1e-10)
  with pytest.raises(ValueError, match="empirical Fisher needs a dense"):
    curvatures.exact("empirical_fisher", problem.loss_fn, matrix_free=True)
  with pytest.raises(ValueError, match="Unknown exact matrix 'gnn'"):
    curvatures.exact("gnn", problem.loss_fn, matrix_free=False)


def test_bad_curvature_configs_are_refused_by_name(tiny):
  loss_fn = tiny[0].loss_fn
  base = measurements.section(config.compose().curvature)
  for key, value, message in [
      ("block_type", "lowrank", "Unknown curvature.block_type 'lowrank'"),
      ("mode", "fisher", "Unknown estimation mode 'fisher'"),
      ("estimator", "magic", "Unknown curvature.estimator 'magic'")]:
    with pytest.raises(ValueError, match=message):
      curvatures.make(dict(base, **{key: value}), loss_fn)
  implicit = measurements.section(
      config.compose("curvature=implicit_exact").curvature)
  with pytest.raises(ValueError, match="multiplies by one of"):
    curvatures.make(dict(implicit, matrix="ef"), loss_fn)


def test_dense_that_would_not_fit_says_size_and_alternative(tiny):
  problem, params, batch = tiny
  cur = make(tiny, "explicit_exact", "curvature.max_dense_gib=1e-9")
  with pytest.raises(MemoryError, match=r"235 x 235.*implicit_exact"):
    cur.init(jax.random.PRNGKey(0), params, batch)
  implicit = make(tiny, "implicit_exact", "curvature.max_dense_gib=1e-9")
  with pytest.raises(MemoryError, match="lanczos"):
    implicit.to_dense(implicit.init(jax.random.PRNGKey(0), params, batch))
