"""The empirical Fisher's scale in each estimator, as KFAC-JAX sets it.

With per-example loss gradients `d_i` on a batch of B examples, the exact
estimators (`ExplicitExactCurvature`, `ImplicitExactCurvature`) give
`E = mean_i d_i d_iᵀ`; the block-diagonal ones divide their second moments
by B once more (`fisher_empirical_normalization='batch_squared'`, the
default), so every block family holds B times less than with `'batch'`.
Batch sizes 1, 3 and 16: at B=1 the two conventions coincide, so only the
larger ones can tell them apart. All in float64 on the tiny MLP (235
parameters, one hidden layer), checked against per-example gradients from
`jax.grad`.
"""

import dataclasses

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest

import estimators as kfac
import problems
from curvbench import config
from curvbench.approximations import CURVATURES
from tests import groundtruth as gt
from tests.conftest import TINY_PROBLEM

BATCH_SIZES = (1, 3, 16)
# Every block-diagonal family (the tridiagonal coupling too), found by the
# registry.
FAMILIES = tuple(
  n for n in CURVATURES.names() if CURVATURES.defaults(n).is_block_diagonal
)


@pytest.fixture(scope="module")
def setting():
  """The tiny MLP, its float64 parameters and 16 examples."""
  problem = problems.make(config.compose(*TINY_PROBLEM).problem)
  params = problem.init_params(jax.random.PRNGKey(0), jnp.float64)
  return problem, params, problem.fixed_batch(size=16, dtype=np.float64)


def first(batch, size):
  return jax.tree.map(lambda x: x[:size], batch)


def per_example_gradients(problem, params, batch):
  """`(B, P)`: each example's loss gradient (its own loss, not the mean's)."""
  one = lambda x, y: jax.flatten_util.ravel_pytree(
    jax.grad(problem.loss_fn)(params, (x[None], y[None]))
  )[0]
  return jax.vmap(one)(*batch)


def mean_outer_products(problem, params, batch):
  d = per_example_gradients(problem, params, batch)
  return d.T @ d / d.shape[0]


def block_mask(estimator, params):
  """`(P, P)` booleans: the entries inside the estimator's blocks."""
  index = jax.flatten_util.ravel_pytree(
    jax.tree.map(
      lambda p, i: jnp.full(p.shape, i, jnp.float64),
      params,
      estimator.params_block_index,
    )
  )[0]
  return np.asarray(index[:, None] == index[None, :])


def estimate(family, problem, params, batch, normalization=None):
  """The family's estimator and dense `fisher_empirical` estimate on
  `batch`, and whether its blocks keep statistics (a scaled identity
  learns nothing from data)."""
  settings = CURVATURES.defaults(family)
  # The harness's settings choose 'batch'; the library's default otherwise.
  chosen = (
    {}
    if normalization is None
    else dict(fisher_empirical_normalization=normalization)
  )
  estimator = type(settings.make(problem.loss_fn).estimator)(
    problem.loss_fn,
    layer_tag_to_block_ctor=dict(settings.blocks) or None,
    **chosen,
  )
  coupled = isinstance(estimator, kfac.BlockTridiagonalCurvature)
  state = gt.one_batch_state(
    estimator,
    (params, batch),
    len(batch[1]),
    "fisher_empirical",
    rngs=(1, 1),
    exact_powers_to_cache=None,
    approx_powers_to_cache=-1 if coupled else None,
  )
  learns = bool(
    jax.tree.leaves(
      [dataclasses.replace(s, cache={}) for s in state.blocks_states]
    )
  )
  return estimator, np.asarray(estimator.to_dense_matrix(state)), learns


@pytest.mark.parametrize("size", BATCH_SIZES)
def test_exact_estimators_give_the_mean_of_outer_products(setting, size):
  problem, params, batch = setting
  batch = first(batch, size)
  truth = mean_outer_products(problem, params, batch)
  explicit = kfac.ExplicitExactCurvature(problem.loss_fn)
  args, rng = (params, batch), jax.random.PRNGKey(2)
  state = explicit.update_curvature_matrix_estimate(
    explicit.init(rng, args),
    0.0,
    1.0,
    size,
    rng,
    args,
    estimation_mode="fisher_empirical",
  )
  np.testing.assert_allclose(
    explicit.to_dense_matrix(state), truth, rtol=1e-12, atol=1e-14
  )
  implicit = kfac.ImplicitExactCurvature(problem.loss_fn)
  flat, unravel = jax.flatten_util.ravel_pytree(params)
  v = jax.random.normal(jax.random.PRNGKey(3), flat.shape, jnp.float64)
  product = jax.flatten_util.ravel_pytree(
    implicit.multiply_empirical_fisher(args, unravel(v))
  )[0]
  np.testing.assert_allclose(product, truth @ v, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("size", BATCH_SIZES)
@pytest.mark.parametrize("family", FAMILIES)
def test_block_diagonal_default_is_the_batch_convention_over_b(
  setting, family, size
):
  """Every block family, the tridiagonal coupling included, scales with the
  output-side second moments (the Shampoo family's blocks and its
  nearest Kronecker products are homogeneous of degree one in the
  per-example curvature): KFAC-JAX's extra 1/B scales it exactly."""
  problem, params, batch = setting
  batch = first(batch, size)
  _, default, learns = estimate(family, problem, params, batch)
  _, mean, _ = estimate(family, problem, params, batch, "batch")
  assert np.abs(mean).max() > 0
  if not learns:  # no statistics, nothing to scale
    np.testing.assert_array_equal(default, mean)
    return
  np.testing.assert_allclose(
    default * size, mean, rtol=1e-11, atol=1e-14 * np.abs(mean).max()
  )


@pytest.mark.parametrize("size", BATCH_SIZES)
def test_exact_families_equal_brute_force_under_each_convention(setting, size):
  """Full blocks hold the block diagonal of the estimate, the diagonal
  family its diagonal: against the brute-force matrix and against the
  explicit estimator on the same batch, `explicit = B * block-diagonal`."""
  problem, params, batch = setting
  batch = first(batch, size)
  truth = mean_outer_products(problem, params, batch)
  estimator, full, _ = estimate("full", problem, params, batch)
  inside = block_mask(estimator, params)
  np.testing.assert_allclose(
    full * size, np.where(inside, truth, 0), rtol=1e-11, atol=1e-15
  )
  _, diagonal, _ = estimate("diagonal", problem, params, batch)
  np.testing.assert_allclose(
    np.diag(diagonal) * size, np.diag(truth), rtol=1e-11, atol=1e-15
  )
  if size == 1:  # one example's dense-layer gradient is an outer product
    estimator, kfac_one, _ = estimate("kfac", problem, params, batch)
    np.testing.assert_allclose(
      kfac_one, np.where(inside, truth, 0), rtol=1e-10, atol=1e-15
    )


def test_unknown_or_unsupported_normalization_is_refused(setting):
  problem, _, _ = setting
  with pytest.raises(ValueError, match="batch_squared"):
    kfac.BlockDiagonalCurvature(
      problem.loss_fn, fisher_empirical_normalization="mean"
    )
  with pytest.raises(ValueError, match="always the mean"):
    kfac.ExplicitExactCurvature(
      problem.loss_fn, fisher_empirical_normalization="batch_squared"
    )


@pytest.mark.parametrize("normalization", ["batch_squared", "batch"])
def test_optimizer_step_equals_a_hand_computation(setting, normalization):
  """One step of `estimators.Optimizer` with full blocks, fixed learning
  rate and damping, no momentum: `-lr (C + λI)⁻¹ g` with `C` the block
  diagonal of `mean_i d_i d_iᵀ`, divided by B under 'batch_squared'."""
  problem, params, batch = setting
  size, lr, damping = 16, 0.1, 1e-2
  settings = CURVATURES.defaults("full")
  opt = kfac.Optimizer(
    jax.value_and_grad(problem.loss_fn),
    l2_reg=0.0,
    estimation_mode="fisher_empirical",
    inverse_update_period=1,
    layer_tag_to_block_ctor=dict(settings.blocks),
    estimator_ctor=lambda *a, **k: kfac.BlockDiagonalCurvature(
      *a, fisher_empirical_normalization=normalization, **k
    ),
  )
  rng = jax.random.PRNGKey(0)
  state = opt.init(params, rng, batch)
  new, _, _ = opt.step(
    params,
    state,
    rng,
    batch=batch,
    learning_rate=lr,
    momentum=0.0,
    damping=damping,
    global_step_int=0,
  )
  truth = mean_outer_products(problem, params, batch)
  scale = size if normalization == "batch_squared" else 1
  curvature = np.where(block_mask(opt.estimator, params), truth, 0) / scale
  flat, _ = jax.flatten_util.ravel_pytree(params)
  grad = jax.flatten_util.ravel_pytree(
    jax.grad(problem.loss_fn)(params, batch)
  )[0]
  expected = flat - lr * np.linalg.solve(
    curvature + damping * np.eye(len(flat)), grad
  )
  np.testing.assert_allclose(
    jax.flatten_util.ravel_pytree(new)[0], expected, rtol=1e-9, atol=1e-12
  )
