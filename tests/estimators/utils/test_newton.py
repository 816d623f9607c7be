"""Inverse p-th roots by the coupled Newton iteration (Guo & Higham 2006)
against eigendecompositions, and the `matrix_power_method='newton'` refresh
of the block-diagonal estimators against the default one."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import estimators as kfac
import problems
from curvbench import config
from curvbench.approximations import CURVATURES
from curvbench.core import training
from curvbench.measurements.training import Training
from curvbench.optimizers.kfac import KFAC
from estimators.utils import newton
from tests import groundtruth as gt

EPS64 = float(jnp.finfo(jnp.float64).eps)


def random_spd(rng, n, condition, dtype=np.float64):
  """A random SPD matrix with eigenvalues log-spaced over `condition`."""
  q, _ = np.linalg.qr(rng.normal(size=(n, n)))
  values = 2.5 * np.logspace(0, -np.log10(condition), n)
  return jnp.asarray((q * values) @ q.T, dtype)


def eigh_power(matrix, power):
  values, vectors = np.linalg.eigh(np.asarray(matrix, np.float64))
  return (vectors * values**power) @ vectors.T


def relative_error(a, b):
  return float(
    np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b)
  )


@pytest.mark.parametrize("p", [1, 2, 4])
def test_roots_of_random_spd_stacks_equal_eigh(p):
  rng = np.random.default_rng(p)
  conditions = (1.0, 1e2, 1e4, 1e6)
  for n in (1, 7, 40):
    stack = jnp.stack([random_spd(rng, n, c) for c in conditions])
    result = newton.inverse_root(stack, p)
    assert bool(result.converged.all())
    for matrix, root, c in zip(stack, result.roots, conditions):
      # Inversion loses about the condition number times eps.
      assert relative_error(root, eigh_power(matrix, -1 / p)) < 50 * c * EPS64


def test_float32_roots_are_as_accurate_as_float32_allows():
  rng = np.random.default_rng(0)
  matrix = random_spd(rng, 30, 1e3, np.float32)
  root = newton.psd_power(matrix, -1)
  assert root.dtype == jnp.float32
  assert relative_error(root, eigh_power(matrix, -1)) < 1e-3


def test_steps_grow_with_the_logarithm_of_the_condition_number():
  """Each small eigenvalue of `M` about doubles per step, then quadratic
  convergence takes a few more: steps ~ log2(condition) + const."""
  rng = np.random.default_rng(1)
  steps = {
    c: int(newton.inverse_root(random_spd(rng, 20, c)[None], 1).steps)
    for c in (1e1, 1e4, 1e8)
  }
  assert steps[1e1] < steps[1e4] < steps[1e8]
  for c, s in steps.items():
    assert s <= np.log2(c) + 10, steps


def test_one_loop_serves_stacks_of_different_sizes_and_roots():
  rng = np.random.default_rng(2)
  a, b = random_spd(rng, 5, 1e3), random_spd(rng, 9, 1e2)
  ra, rb = newton.inverse_roots([(a[None], 1), (b[None], 2)])
  np.testing.assert_allclose(ra.roots[0], eigh_power(a, -1), rtol=1e-9)
  np.testing.assert_allclose(rb.roots[0], eigh_power(b, -0.5), rtol=1e-9)
  jaxpr = jax.make_jaxpr(lambda x, y: newton.inverse_roots([(x, 1), (y, 2)]))(
    a[None], b[None]
  )
  assert str(jaxpr).count("while[") == 1


@pytest.mark.parametrize("power", [0.5, -0.3, -2.0, 2.0])
def test_powers_other_than_inverse_roots_are_refused(power):
  with pytest.raises(ValueError, match="-1/p"):
    newton.root_order(power)


@pytest.mark.parametrize(
  "eigenvalues",
  [
    [1.0, 0.5, 0.0],  # singular: no damping
    [1.0, 0.5, -1e-3],  # indefinite (round-off in a factor)
    [0.0, 0.0, 0.0],
  ],
)
def test_a_matrix_it_cannot_invert_is_refused_or_nan(eigenvalues):
  q, _ = np.linalg.qr(np.random.default_rng(3).normal(size=(3, 3)))
  matrix = jnp.asarray((q * np.asarray(eigenvalues)) @ q.T)
  # Rotated, a zero eigenvalue becomes round-off of either sign, ~1e-17: a
  # positive one would take about 56 doublings to converge, so stop at 40.
  with pytest.raises(ValueError, match="did not converge.*damping"):
    newton.psd_power(matrix, -1, max_iterations=40)
  result = jax.jit(lambda m: newton.inverse_root(m[None], 1, 40))(matrix)
  assert not bool(result.converged[0])
  assert bool(jnp.isnan(result.roots).all())


def test_by_products_refuses_a_function_that_asks_differently():
  calls = []

  def refresh():
    calls.append(None)
    n = 2 + len(calls)  # a different size on the second call
    return kfac.utils.psd_matrix_power(jnp.eye(n), -1)

  with pytest.raises(RuntimeError, match="deterministic"):
    newton.by_products(refresh)
  assert not newton.active()


def test_unknown_method_is_refused():
  with pytest.raises(ValueError, match="decomposition"):
    kfac.BlockDiagonalCurvature(lambda p, b: 0.0, matrix_power_method="qr")


# --- the estimators' refresh ------------------------------------------------


@pytest.fixture(scope="module")
def autoencoder():
  problem = problems.make(config.compose("problem=autoencoder").problem)
  params = problem.init_params(jax.random.PRNGKey(0), jnp.float64)
  return problem, params, problem.fixed_batch(dtype=np.float64)


def estimated(settings, problem, params, batch):
  """The estimator of `settings` with one batch's statistics (float64)."""
  estimator = settings.make(problem.loss_fn).estimator
  state = gt.one_batch_state(
    estimator,
    (params, batch),
    len(batch[1]),
    rngs=(1, 1),
    exact_powers_to_cache=None,
    approx_powers_to_cache=(-1,),
  )
  return estimator, state


@pytest.mark.parametrize(
  "family", ["kfac", "kfac_reduce", "full", "kfac_tridiagonal"]
)
def test_newton_refresh_equals_the_default_on_real_factors(
  autoencoder, tiny, family
):
  """Each family's cached damped inverse, applied to the gradient, equals
  the default refresh's: on the real K-FAC factors of the autoencoder, and
  on the tiny MLP for the other families (quicker). The Newton refresh runs
  one loop for all its factors."""
  problem, params, batch = autoencoder if family == "kfac" else tiny
  default = CURVATURES.defaults(family)
  grads = jax.grad(problem.loss_fn)(params, batch)
  preconditioned = {}
  for method in ("decomposition", "newton"):
    settings = dataclasses.replace(default, matrix_power_method=method)
    estimator, state = estimated(settings, problem, params, batch)
    refresh = lambda s, e=estimator: e.update_cache(s, 1e-3, None, (-1,))
    loops = str(jax.make_jaxpr(refresh)(state)).count("while[")
    assert loops == (method == "newton")
    state = jax.jit(refresh)(state)
    preconditioned[method] = jax.flatten_util.ravel_pytree(
      estimator.multiply_inverse(
        state, grads, 1e-3, exact_power=False, use_cached=True
      )
    )[0]
  reference = preconditioned["decomposition"]
  assert (
    float(
      jnp.linalg.norm(preconditioned["newton"] - reference)
      / jnp.linalg.norm(reference)
    )
    < 1e-9
  )


def test_unbatched_newton_refresh_equals_the_batched_one(tiny):
  """The path taken when devices share the blocks: one iteration per
  factor instead of one stacked loop."""
  problem, params, batch = tiny
  settings = dataclasses.replace(
    CURVATURES.defaults("kfac"), matrix_power_method="newton"
  )
  estimator, state = estimated(settings, problem, params, batch)
  fns = [
    lambda s, b=b: b.update_cache(s, 1e-3, None, (-1,), False)
    for b in estimator.blocks
  ]
  caches = {}
  for batched in (True, False):
    states = newton.by_products(
      lambda: [f(s) for f, s in zip(fns, state.blocks_states)], batched
    )
    caches[batched] = jax.flatten_util.ravel_pytree([s.cache for s in states])[
      0
    ]
  np.testing.assert_allclose(
    caches[False], caches[True], rtol=1e-12, atol=1e-12
  )


def test_the_optimizer_trains_the_autoencoder_the_same_with_newton(autoencoder):
  """estimators.Optimizer with adaptive damping, learning rate and momentum:
  the Newton refresh follows the default refresh's trajectory."""
  problem, params, _ = autoencoder
  batches = problem.batches(seed=0, dtype=np.float64)
  losses = {}
  for method in ("decomposition", "newton"):
    opt = kfac.Optimizer(
      jax.value_and_grad(problem.loss_fn),
      l2_reg=0.0,
      use_adaptive_learning_rate=True,
      use_adaptive_momentum=True,
      use_adaptive_damping=True,
      initial_damping=1.0,
      inverse_update_period=2,
      estimation_mode="ggn_exact",
      estimator_ctor=lambda *a, m=method, **k: kfac.BlockDiagonalCurvature(
        *a, matrix_power_method=m, **k
      ),
    )
    rng = jax.random.PRNGKey(0)
    data = iter(problem.batches(seed=0, dtype=np.float64))
    p, state = params, opt.init(params, rng, next(iter(batches)))
    losses[method] = []
    for step in range(6):
      p, state, stats = opt.step(
        p,
        state,
        jax.random.fold_in(rng, step),
        batch=next(data),
        global_step_int=step,
      )
      losses[method].append(float(stats["loss"]))
    if method == "newton":
      assert opt.estimator.newton_failures(state.estimator_state) == []
  np.testing.assert_allclose(
    losses["newton"], losses["decomposition"], rtol=1e-8
  )
  assert losses["newton"][-1] < 0.95 * losses["newton"][0]


def test_a_run_whose_factors_newton_cannot_invert_stops_with_the_fix(tiny):
  """Too few Newton steps leave NaN inverses: the run stops with an error
  naming the blocks and the remedies, not as a diverged optimizer."""
  problem, params, _ = tiny
  curvature = dataclasses.replace(
    CURVATURES.defaults("kfac"),
    matrix_power_method="newton",
    newton_max_iterations=1,
  ).make(problem.loss_fn)
  trainer = KFAC(use_adaptive_damping=False).make(problem.loss_fn, curvature)
  with pytest.raises(
    FloatingPointError,
    match=(
      "did not converge in 1 steps for the damped factors of .*"
      "matrix_power_method=decomposition"
    ),
  ):
    training.run(
      problem,
      trainer,
      params,
      Training(num_steps=3, log_every=1, eval_every=3),
      jax.random.PRNGKey(0),
      data_seed=0,
      progress=False,
    )
