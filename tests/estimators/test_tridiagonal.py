"""Block-tridiagonal K-FAC against a dense brute-force construction (float64).

The reference builds K-FAC's `F̃` from per-example layer inputs and output
Jacobians (`jax.jacobian`), then the paper's Gaussian-chain approximation
with dense matrix algebra.
"""

import functools

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest

import estimators as kfac
import problems
from curvbench import config
from tests.groundtruth import random_normal

SIZES = (3, 4, 3, 2)  # three dense layers; each factor full rank at B = 16
B = 16
TOL = dict(rtol=1e-8, atol=1e-10)


def init_params():
  return [
    (random_normal(10 + k, m, n) / np.sqrt(m), random_normal(20 + k, n))
    for k, (m, n) in enumerate(zip(SIZES[:-1], SIZES[1:]))
  ]


def forward(params, x):
  """Each layer's input and the output; tanh between layers."""
  inputs = []
  for k, (w, b) in enumerate(params):
    inputs.append(x)
    x = x @ w + b
    if k < len(params) - 1:
      x = jnp.tanh(x)
  return inputs, x


def model(params, batch):
  x, t = batch
  y = forward(params, x)[1]
  kfac.register_squared_error_loss(y, t, weight=0.5)  # loss Hessian = I
  return 0.5 * jnp.mean(jnp.sum((y - t) ** 2, axis=1))


def batch(size=B):
  return random_normal(1, size, SIZES[0]), random_normal(2, size, SIZES[-1])


def kfac_blocks(params, x):
  """`F̃`'s factors: Ā_ij (inputs with a 1 appended) and G_ij, brute force."""
  inputs, b = forward(params, x)[0], len(x)
  # The bias gradient of an output is that output's derivative at the
  # layer's outputs: (B, outputs, layer outputs) per layer.
  jac = jax.vmap(
    jax.jacobian(lambda p, xi: forward(p, xi[None])[1][0]), (None, 0)
  )(params, x)
  a = [np.concatenate([np.asarray(i), np.ones((b, 1))], 1) for i in inputs]
  g = [np.asarray(j[1]) for j in jac]
  n = len(params)
  a_cross = [[a[i].T @ a[j] / b for j in range(n)] for i in range(n)]
  g_cross = [
    [np.einsum("bsi,bsj->ij", g[i], g[j]) / b for j in range(n)]
    for i in range(n)
  ]
  return a_cross, g_cross


def pi_damped(a, g, damping):
  pi = np.sqrt((np.trace(a) / len(a)) / (np.trace(g) / len(g)))
  root = np.sqrt(damping)
  return a + pi * root * np.eye(len(a)), g + root / pi * np.eye(len(g))


def chain_inverse(a_cross, g_cross, damping):
  """The paper's `F̂⁻¹ = Ξᵀ Λ Ξ` from dense blocks of (damped) `F̃`."""
  n = len(a_cross)
  diag = [
    np.kron(*pi_damped(a_cross[i][i], g_cross[i][i], damping)) for i in range(n)
  ]
  sizes = [len(d) for d in diag]
  starts = np.concatenate([[0], np.cumsum(sizes)])
  total = starts[-1]
  xi, lam = np.eye(total), np.zeros((total, total))
  for i in range(n):
    here = slice(starts[i], starts[i + 1])
    if i + 1 < n:
      nxt = slice(starts[i + 1], starts[i + 2])
      psi = np.kron(a_cross[i][i + 1], g_cross[i][i + 1]) @ np.linalg.inv(
        diag[i + 1]
      )
      xi[here, nxt] = -psi
      sigma = diag[i] - psi @ diag[i + 1] @ psi.T
    else:
      sigma = diag[i]
    lam[here, here] = np.linalg.inv(sigma)
  return xi.T @ lam @ xi, starts


def dense(estimator, state, **kwargs):
  """`estimator.to_dense_matrix(state, **kwargs)`, compiled (much faster)."""
  return np.asarray(
    jax.jit(functools.partial(estimator.to_dense_matrix, **kwargs))(state)
  )


@pytest.fixture(scope="module")
def fitted():
  params, data = init_params(), batch()
  estimator = kfac.BlockTridiagonalCurvature(
    model, default_estimation_mode="ggn_exact"
  )
  rng = jax.random.PRNGKey(0)
  state = estimator.init(rng, (params, data), approx_powers_to_cache=-1)
  state = jax.jit(
    estimator.update_curvature_matrix_estimate, static_argnums=(3,)
  )(state, 0.0, 1.0, B, rng, (params, data))
  return estimator, state, params, kfac_blocks(params, data[0])


def test_chain_covers_the_dense_layers_in_order(fitted):
  estimator = fitted[0]
  assert estimator.chains == ((0, 1, 2),)
  assert estimator.links == ((0, 1), (1, 2))


def test_agrees_with_kfac_on_the_tridiagonal_and_inverse_is_tridiagonal(fitted):
  estimator, state, _, (a_cross, g_cross) = fitted
  matrix = dense(estimator, state)
  _, starts = chain_inverse(a_cross, g_cross, 0.0)
  n = len(a_cross)
  block = lambda m, i, j: m[
    starts[i] : starts[i + 1], starts[j] : starts[j + 1]
  ]
  for i in range(n):
    for j in (i, i + 1):
      if j < n:
        want = np.kron(a_cross[i][j], g_cross[i][j])
        np.testing.assert_allclose(block(matrix, i, j), want, **TOL)
        np.testing.assert_allclose(block(matrix, j, i), want.T, **TOL)
  # Two layers apart, F̃ and F̂ differ; F̂⁻¹ vanishes there.
  assert not np.allclose(
    block(matrix, 0, 2), np.kron(a_cross[0][2], g_cross[0][2]), atol=1e-6
  )
  inverse = np.linalg.inv(matrix)
  scale = np.abs(inverse).max()  # round-off of a dense inverse grows with it
  np.testing.assert_allclose(block(inverse, 0, 2), 0, atol=1e-10 * scale)
  # The structured inverse (paper damping with λ = 0) is the dense inverse.
  # λ = 0 passed traced: the blocks refuse a concrete undamped inverse,
  # which is usually singular (here the factors are full rank).
  structured = np.asarray(
    jax.jit(
      lambda s, w: estimator.to_dense_matrix(
        s, identity_weight=w, exact_power=False, power=-1
      )
    )(state, 0.0)
  )
  np.testing.assert_allclose(structured, inverse, rtol=1e-7, atol=1e-10 * scale)


@pytest.mark.parametrize("use_cached", [False, True])
def test_damped_inverse_matches_dense_paper_formula(fitted, use_cached):
  estimator, state, _, (a_cross, g_cross) = fitted
  damping = 0.3
  want, _ = chain_inverse(a_cross, g_cross, damping)
  if use_cached:
    state = jax.jit(estimator.update_cache, static_argnums=(2, 3, 4))(
      state, damping, None, -1, False
    )
  got = dense(
    estimator,
    state,
    use_cached=use_cached,
    identity_weight=damping,
    exact_power=False,
    power=-1,
  )
  np.testing.assert_allclose(got, want, **TOL)
  forward_damped = dense(
    estimator, state, identity_weight=damping, exact_power=False, power=1
  )
  np.testing.assert_allclose(forward_damped @ got, np.eye(len(got)), atol=1e-8)


def test_exact_power_multiply_adds_the_damping(fitted):
  estimator, state, params, _ = fitted
  v = jax.tree.map(lambda p: jnp.ones_like(p), params)
  plain = estimator.multiply(state, v, 0.0, exact_power=True, use_cached=False)
  damped = estimator.multiply(state, v, 0.5, exact_power=True, use_cached=False)
  for x, y, z in zip(
    jax.tree.leaves(plain), jax.tree.leaves(damped), jax.tree.leaves(v)
  ):
    np.testing.assert_allclose(y, x + 0.5 * z, **TOL)


def test_eigenvalues_are_those_of_the_dense_matrix(fitted):
  estimator, state, _, _ = fitted
  matrix = dense(estimator, state)
  np.testing.assert_allclose(
    np.sort(estimator.eigenvalues(state)),
    np.linalg.eigvalsh(matrix),
    rtol=1e-8,
    atol=1e-10,
  )


def test_refuses_what_it_cannot_compute(fitted):
  estimator, state, params, _ = fitted
  with pytest.raises(ValueError, match="exact_power=False"):
    estimator.multiply_inverse(
      state, params, 0.1, exact_power=True, use_cached=False
    )
  with pytest.raises(ValueError, match="power 0.5"):
    estimator.multiply_matpower(
      state, params, 0.1, 0.5, exact_power=False, use_cached=False
    )
  with pytest.raises(ValueError, match="approx_powers_to_cache=-1"):
    estimator.init(
      jax.random.PRNGKey(0), (params, batch()), exact_powers_to_cache=-1
    )


def test_layers_outside_chains_keep_their_blocks():
  """A convolution between dense layers ends the chain; a lone dense layer
  is then block-diagonal K-FAC."""

  def conv_model(params, batch):
    x, t = batch
    h = jnp.tanh(x @ params[0][0] + params[0][1])
    h = jax.lax.conv_general_dilated(
      h.reshape(B, 2, 2, 1),
      params[1],
      (1, 1),
      "SAME",
      dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )
    y = h.reshape(B, 4) @ params[2][0]
    kfac.register_squared_error_loss(y, t, weight=0.5)
    return jnp.mean((y - t) ** 2)

  params = [
    (random_normal(1, 3, 4), random_normal(2, 4)),
    random_normal(3, 2, 2, 1, 1),
    (random_normal(4, 4, 2),),
  ]
  estimator = kfac.BlockTridiagonalCurvature(
    conv_model, default_estimation_mode="ggn_exact"
  )
  data = (random_normal(5, B, 3), random_normal(6, B, 2))
  state = estimator.init(
    jax.random.PRNGKey(0), (params, data), approx_powers_to_cache=-1
  )
  assert estimator.chains == () and estimator.links == ()
  reference = kfac.BlockDiagonalCurvature(
    conv_model, default_estimation_mode="ggn_exact"
  )
  ref_state = reference.init(jax.random.PRNGKey(0), (params, data))
  state = estimator.update_curvature_matrix_estimate(
    state, 0.0, 1.0, B, jax.random.PRNGKey(1), (params, data)
  )
  ref_state = reference.update_curvature_matrix_estimate(
    ref_state, 0.0, 1.0, B, jax.random.PRNGKey(1), (params, data)
  )
  np.testing.assert_allclose(
    dense(estimator, state), dense(reference, ref_state), **TOL
  )


def test_singular_factors_keep_the_diagonal_blocks_and_stay_psd():
  """Three examples: every input factor is singular, so `Ψ` needs a
  pseudo-inverse; `F̂` must still agree with `F̃` on the diagonal blocks and
  have no negative eigenvalues beyond round-off."""
  params, data = init_params(), batch(3)
  estimator = kfac.BlockTridiagonalCurvature(
    model, default_estimation_mode="ggn_exact"
  )
  rng = jax.random.PRNGKey(0)
  state = estimator.init(rng, (params, data), approx_powers_to_cache=-1)
  state = estimator.update_curvature_matrix_estimate(
    state, 0.0, 1.0, 3, rng, (params, data)
  )
  a_cross, g_cross = kfac_blocks(params, data[0])
  assert np.linalg.matrix_rank(a_cross[0][0]) < len(a_cross[0][0])
  matrix = dense(estimator, state)
  _, starts = chain_inverse(a_cross, g_cross, 1.0)
  for i in range(len(a_cross)):
    here = slice(starts[i], starts[i + 1])
    np.testing.assert_allclose(
      matrix[here, here],
      np.kron(a_cross[i][i], g_cross[i][i]),
      rtol=1e-7,
      atol=1e-9,
    )
  values = np.linalg.eigvalsh(matrix)
  assert values.min() > -1e-9 * values.max()


def test_ill_conditioned_factors_on_an_autoencoder():
  """A sigmoid autoencoder's factors have eigenvalues down to round-off;
  kept in `Ψ`'s pseudo-inverse they spoiled `F̂` (diagonal blocks off by
  3e-5, an eigenvalue of -6e-5 at a top eigenvalue of 0.4)."""
  cfg = config.compose(
    "problem=autoencoder",
    "problem.batch_size=16",
    "problem.encoder=[8]",
    "problem.code=4",
  ).problem
  problem = problems.make(cfg)
  params = problem.init_params(jax.random.PRNGKey(0), jnp.float64)
  data = problem.fixed_batch(dtype=np.float64)
  rng = jax.random.PRNGKey(0)
  matrices = []
  for ctor in (kfac.BlockTridiagonalCurvature, kfac.BlockDiagonalCurvature):
    estimator = ctor(problem.loss_fn, default_estimation_mode="ggn_exact")
    state = estimator.init(rng, (params, data), approx_powers_to_cache=-1)
    state = estimator.update_curvature_matrix_estimate(
      state, 0.0, 1.0, 16, rng, (params, data)
    )
    matrices.append(dense(estimator, state))
  coupled, block_diagonal = matrices
  inside = block_diagonal != 0
  scale = np.abs(block_diagonal).max()
  np.testing.assert_allclose(
    coupled[inside], block_diagonal[inside], atol=1e-9 * scale
  )
  assert np.linalg.eigvalsh(coupled).min() > -1e-9 * scale


def test_optimizer_with_exact_inverses_is_refused_by_name():
  params, data = init_params(), batch()
  opt = kfac.Optimizer(
    jax.value_and_grad(model),
    l2_reg=0.0,
    use_exact_inverses=True,
    num_burnin_steps=0,
    estimator_ctor=kfac.BlockTridiagonalCurvature,
  )
  with pytest.raises(ValueError, match="approx_powers_to_cache=-1"):
    opt.init(params, jax.random.PRNGKey(0), data)
