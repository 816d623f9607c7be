"""The curvature interface: every family agrees with its own dense export, and
the exact references agree with brute force."""

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest

import estimators
import problems
from curvbench import approximations, config, optimizers
from curvbench.core import curvatures, data
from tests.conftest import TINY_PROBLEM

# Every registered approximation, found by the registry.
FAMILY_CONFIGS = tuple(approximations.CURVATURES)


def make(tiny, name, *overrides):
  cfg = config.compose(
    f"curvature={name}", "curvature.cg_iters=500", *overrides
  ).curvature
  return approximations.make(config.plain(cfg), tiny[0].loss_fn)


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
  np.testing.assert_allclose(
    flat(jax.jit(cur.multiply)(state, unravel(v))),
    dense @ v,
    rtol=1e-9,
    atol=1e-12,
  )
  # The operator is a pytree: it crosses a jit boundary.
  operator = jax.jit(cur.operator)(state)
  np.testing.assert_allclose(
    flat(jax.jit(lambda op, x: op(x))(operator, unravel(v))),
    dense @ v,
    rtol=1e-9,
    atol=1e-12,
  )
  np.testing.assert_allclose(
    np.sort(np.asarray(cur.eigenvalues(state))),
    np.linalg.eigvalsh(dense),
    atol=1e-9,
  )
  damping = 0.5
  solved = flat(
    jax.jit(cur.precondition)(cur.refresh(state, damping), unravel(v), damping)
  )
  expected = np.linalg.solve(dense + damping * np.eye(235), v)
  # CG stops at jax's default relative residual, 1e-5.
  tol = 1e-4 if isinstance(cur, curvatures.ImplicitExact) else 1e-9
  if cur.damped_inverse_is_exact:
    assert np.linalg.norm(solved - expected) < tol * np.linalg.norm(expected)
  else:  # e.g. each Kronecker factor damped instead of the product
    assert np.all(np.isfinite(solved))


def test_exact_references_equal_brute_force(tiny, tiny_ggn):
  problem, params, batch = tiny
  key = jax.random.PRNGKey(0)
  for matrix_free in (False, True):
    ggn = curvatures.exact("ggn", problem.loss_fn, matrix_free=matrix_free)
    state = curvatures.estimate(ggn, key, params, batch)
    np.testing.assert_allclose(ggn.to_dense(state), tiny_ggn, atol=1e-12)
  flat_params, unravel = jax.flatten_util.ravel_pytree(params)
  hessian = jax.hessian(lambda w: problem.loss_fn(unravel(w), batch))(
    flat_params
  )
  exact = curvatures.exact("hessian", problem.loss_fn, matrix_free=False)
  np.testing.assert_allclose(
    exact.to_dense(exact.init(key, params, batch)), hessian, atol=1e-10
  )
  with pytest.raises(ValueError, match="Unknown exact matrix 'gnn'"):
    curvatures.exact("gnn", problem.loss_fn, matrix_free=False)


def test_bad_curvature_configs_are_refused_by_name(tiny):
  loss_fn = tiny[0].loss_fn
  base = config.plain(config.compose().curvature)
  for key, value, message in [
    ("block_type", "lowrank", "curvature kfac has no setting 'block_type'"),
    ("mode", "fisher", "Unknown curvature.mode 'fisher'"),
    ("name", "magic", "Unknown curvature.name 'magic'"),
  ]:
    with pytest.raises(ValueError, match=message):
      approximations.make(dict(base, **{key: value}), loss_fn)
  implicit = config.plain(config.compose("curvature=implicit_exact").curvature)
  with pytest.raises(ValueError, match="Unknown curvature.matrix 'ef'"):
    approximations.make(dict(implicit, matrix="ef"), loss_fn)


def test_dense_that_would_not_fit_says_size_and_alternative(tiny):
  problem, params, batch = tiny
  cur = make(tiny, "explicit_exact", "curvature.max_dense_gib=1e-9")
  with pytest.raises(MemoryError, match=r"235 x 235.*implicit_exact"):
    cur.init(jax.random.PRNGKey(0), params, batch)
  implicit = make(tiny, "implicit_exact", "curvature.max_dense_gib=1e-9")
  with pytest.raises(MemoryError, match="lanczos"):
    implicit.to_dense(implicit.init(jax.random.PRNGKey(0), params, batch))


def abstract_only(monkeypatch, curvature):
  """Makes `curvature`'s estimator refuse to build a state from concrete
  arrays (an allocation); returns, per call of its `init`, whether it was
  traced abstractly."""
  calls, init = [], curvature.estimator.init

  def traced_only(rng, func_args, *args, **kwargs):
    calls.append(isinstance(jax.tree.leaves(func_args)[0], jax.core.Tracer))
    if not calls[-1]:
      raise AssertionError("the estimator state was allocated")
    return init(rng, func_args, *args, **kwargs)

  monkeypatch.setattr(curvature.estimator, "init", traced_only)
  return calls


@pytest.mark.parametrize("name", ["kfac", "kfac_tridiagonal"])
def test_block_state_that_would_not_fit_is_refused_before_allocating(
  tiny, name, monkeypatch
):
  problem, params, batch = tiny
  key = jax.random.PRNGKey(0)
  total = sum(
    x.nbytes for x in jax.tree.leaves(make(tiny, name).init(key, params, batch))
  )
  # The limit is on the whole state, sized exactly from its shapes.
  fits = make(tiny, name, f"curvature.max_state_gib={total / 2**30!r}")
  assert fits.init(key, params, batch) is not None
  over = make(tiny, name, f"curvature.max_state_gib={(total - 1) / 2**30!r}")
  calls = abstract_only(monkeypatch, over)
  with pytest.raises(
    MemoryError,
    match=(
      r"over curvature.max_state_gib=.*largest part is block 'dense_0' "
      r"\(DenseTwoKroneckerFactored, input factor 65 x 65, output factor "
      r"3 x 3\).*curvature=diagonal"
    ),
  ):
    over.init(key, params, batch)
  assert calls == [True]  # traced for its shapes, never built
  # K-FAC's optimizer checks the curvature's state before building its own.
  cfg = config.plain(config.compose("optimizer=kfac").optimizer)
  trainer = optimizers.make(cfg, problem.loss_fn, over)
  monkeypatch.setattr(trainer.opt, "init", None)  # reached: a TypeError
  with pytest.raises(MemoryError, match="max_state_gib"):
    trainer.init(params, batch, key)


def test_kfac_factor_of_50k_inputs_is_refused_at_the_default_limit(monkeypatch):
  """The issue's case: a layer with 50,176 inputs has a 9.4 GiB K-FAC input
  factor (float32) and as much again in its cache, over the default 4 GiB;
  none of it is allocated."""
  inputs = 50_176

  def loss_fn(params, batch):
    x, labels = batch
    logits = x @ params["dense_0"]["w"] + params["dense_0"]["b"]
    estimators.register_softmax_cross_entropy_loss(logits, labels)
    return -jnp.mean(
      jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1)
    )

  params = {
    "dense_0": {
      "w": jnp.zeros((inputs, 2), jnp.float32),
      "b": jnp.zeros(2, jnp.float32),
    }
  }
  batch = (jnp.zeros((2, inputs), jnp.float32), jnp.zeros(2, jnp.int32))
  cfg = config.compose("curvature=kfac").curvature
  assert cfg.max_state_gib == 4.0
  cur = approximations.make(config.plain(cfg), loss_fn)
  calls = abstract_only(monkeypatch, cur)
  with pytest.raises(
    MemoryError,
    match=(
      r"'dense_0' \(DenseTwoKroneckerFactored, input factor 50177 x 50177, "
      r"output factor 2 x 2\): 18\.8 GiB"
    ),
  ):
    cur.init(jax.random.PRNGKey(0), params, batch)
  assert calls == [True]


# --- over the whole training split -------------------------------------------


def _brute_force(problem, params, batch):
  """GGN, Fisher, empirical Fisher and Hessian of the loss averaged over
  `batch`, from jax.jacobian, per-example jax.grad and jax.hessian."""
  flat_params, unravel = jax.flatten_util.ravel_pytree(params)
  x, y = batch
  logits = lambda w: problem.net.apply(unravel(w), x)
  jac = jax.jacobian(logits)(flat_params)  # (n, C, P)
  prob = jax.nn.softmax(logits(flat_params))
  hess = jax.vmap(lambda q: jnp.diag(q) - jnp.outer(q, q))(prob)
  ggn = np.einsum("ncp,ncd,ndq->pq", jac, hess, jac) / len(x)
  one = lambda w, xi, yi: problem.loss_fn(unravel(w), (xi[None], yi[None]))
  grads = jax.vmap(jax.grad(one), (None, 0, 0))(flat_params, x, y)
  return dict(
    ggn=ggn,
    fisher=ggn,
    empirical_fisher=grads.T @ grads / len(x),
    hessian=jax.hessian(lambda w: problem.loss_fn(unravel(w), batch))(
      flat_params
    ),
  )


@pytest.fixture(scope="module")
def whole_split(tiny):
  """The training split of the tiny problem's model on 100 digits, as
  chunks of 8 (a remainder of 4), and the brute-force matrices over all of
  it, concatenated."""
  _, params, _ = tiny
  problem = problems.make(
    config.compose(*TINY_PROBLEM, "problem.data.num_train=100").problem
  )
  examples = data.select(problem, "train", dtype=np.float64)
  assert examples.rest_size == 4 and examples.num_examples == 100
  return examples, _brute_force(problem, params, examples.concatenated())


@pytest.mark.parametrize("matrix", curvatures.EXACT_MATRICES)
@pytest.mark.parametrize("matrix_free", [False, True])
def test_whole_split_curvature_equals_brute_force(
  tiny, whole_split, matrix, matrix_free
):
  problem, params, _ = tiny
  examples, truth = whole_split
  exact = curvatures.exact(matrix, problem.loss_fn, matrix_free=matrix_free)
  state = curvatures.estimate(exact, jax.random.PRNGKey(0), params, examples)
  dense = np.asarray(jax.jit(exact.to_dense)(state))
  np.testing.assert_allclose(dense, truth[matrix], atol=1e-11, rtol=1e-9)
  v = np.random.default_rng(1).normal(size=len(dense))
  unravel = jax.flatten_util.ravel_pytree(params)[1]
  np.testing.assert_allclose(
    flat(jax.jit(exact.multiply)(state, unravel(v))),
    truth[matrix] @ v,
    atol=1e-11,
    rtol=1e-9,
  )


@pytest.mark.parametrize("matrix", curvatures.EXACT_MATRICES)
def test_whole_split_operator_equals_multiply(tiny, whole_split, matrix):
  """The linearized operator (one forward pass for all products) gives
  `multiply`'s products, remainder chunk included, and keeps no copy of
  the parameters per chunk."""
  problem, params, _ = tiny
  examples, _ = whole_split
  exact = curvatures.exact(matrix, problem.loss_fn, matrix_free=True)
  state = curvatures.estimate(exact, jax.random.PRNGKey(0), params, examples)
  operator = jax.jit(exact.operator)(state)
  apply = jax.jit(lambda op, v: op(v))
  multiply = jax.jit(exact.multiply)
  unravel = jax.flatten_util.ravel_pytree(params)[1]
  for seed in range(3):
    v = unravel(np.random.default_rng(seed).normal(size=235))
    expected = flat(multiply(state, v))
    np.testing.assert_allclose(
      flat(apply(operator, v)),
      expected,
      rtol=0,
      atol=1e-12 * np.abs(expected).max(),
    )
  # Per chunk, only per-example arrays (and per-chunk scalars) are kept.
  stacked = [
    x
    for x in jax.tree.leaves(operator)
    if x.shape[:1] == (examples.num_chunks,)
  ]
  assert stacked and all(
    x.ndim == 1 or x.shape[1] == examples.chunk_size for x in stacked
  )


@pytest.mark.parametrize("name", ["kfac", "diagonal", "full"])
def test_whole_split_statistics_equal_one_concatenated_batch(
  tiny, whole_split, name
):
  """Block statistics (Kronecker factors, diagonals, full blocks) accumulated
  chunk by chunk equal those of the whole split as one batch."""
  problem, params, _ = tiny
  examples, _ = whole_split
  cur = make(tiny, name)
  key = jax.random.PRNGKey(0)
  chunked = cur.to_dense(curvatures.estimate(cur, key, params, examples))
  whole = cur.to_dense(
    curvatures.estimate(cur, key, params, examples.concatenated())
  )
  np.testing.assert_allclose(chunked, whole, atol=1e-12, rtol=1e-10)
  one_batch = cur.to_dense(
    curvatures.estimate(cur, key, params, examples.first)
  )
  assert np.abs(one_batch - whole).max() > 1e-3  # the test can tell them apart


def test_layer_blocks_partition_the_parameters(tiny):
  problem, params, batch = tiny
  blocks = curvatures.layer_blocks(problem.loss_fn, params, batch)
  assert len(blocks) == 2
  indices = np.concatenate([idx for _, idx in blocks])
  np.testing.assert_array_equal(np.sort(indices), np.arange(235))
  assert len({name for name, _ in blocks}) == 2
