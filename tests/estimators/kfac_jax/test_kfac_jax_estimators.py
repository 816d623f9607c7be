"""KFAC-JAX 0.0.8's estimator and block options, against brute force.

Float64 (see conftest). Models are the tiny ones of `tests.groundtruth`.
"""

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest

import estimators as kfac_jax
from tests import groundtruth

RNG = jax.random.PRNGKey(3)


def _estimate(est, problem, mode, rng=RNG, **update):
  args = (problem.params, problem.batch)
  state = est.init(rng, args)
  batch = problem.batch[0].shape[0]
  return state, est.update_curvature_matrix_estimate(
    state, 0.0, 1.0, batch, rng, args, estimation_mode=mode, **update
  )


def _naive_full(problem, **kwargs):
  func = None if "func_and_grad" in kwargs else problem.tagged
  return kfac_jax.BlockDiagonalCurvature(
    func,
    layer_tag_to_block_ctor={"dense": kfac_jax.NaiveFull},
    **kwargs,
  )


@pytest.mark.parametrize("synced", [False, True])
@pytest.mark.parametrize("from_grad", [False, True])
def test_direct_modes_give_the_outer_product_of_the_mean_gradient(
  synced, from_grad
):
  problem = groundtruth.mlp(batch=5)
  func_and_grad = jax.value_and_grad(problem.tagged)
  est = (
    _naive_full(problem, func_and_grad=func_and_grad)
    if from_grad
    else _naive_full(problem)
  )
  mode = "fisher_empirical_direct" + ("_synced" if synced else "")
  _, state = _estimate(est, problem, mode)
  g = problem.per_example_grads().mean(axis=0)
  expected = np.outer(g, g)
  mask = groundtruth.block_mask(problem, [["w1", "b1"], ["w2", "b2"]])
  np.testing.assert_allclose(
    est.to_dense_matrix(state), expected * mask, rtol=1e-10, atol=1e-12
  )


def test_direct_modes_need_blocks_of_parameter_gradients():
  problem = groundtruth.mlp()
  est = kfac_jax.BlockDiagonalCurvature(problem.tagged)
  with pytest.raises(ValueError, match="only the gradient of the parameters"):
    _estimate(est, problem, "fisher_empirical_direct")
  exact = kfac_jax.ExplicitExactCurvature(problem.tagged)
  assert "fisher_empirical_direct" not in exact.valid_estimation_modes
  assert "fisher_empirical_direct" in est.valid_estimation_modes


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fisher_gradients", "ggn_curvature_prop"])
def test_num_samples_averages_that_many_estimates_vmapped_or_looped(mode):
  problem = groundtruth.mlp(batch=4)
  n = 3
  vmapped = kfac_jax.BlockDiagonalCurvature(
    problem.tagged, num_samples=n, should_vmap_samples=True
  )
  looped = kfac_jax.BlockDiagonalCurvature(problem.tagged, num_samples=n)
  single = kfac_jax.BlockDiagonalCurvature(problem.tagged)
  dense = {}
  for name, est in [("vmapped", vmapped), ("looped", looped)]:
    _, state = _estimate(est, problem, mode)
    dense[name] = est.to_dense_matrix(state)
  np.testing.assert_allclose(dense["vmapped"], dense["looped"], rtol=1e-10)
  # Kronecker factors are not linear in the samples: compare full blocks.
  full = {"dense": kfac_jax.DenseFull}
  means = []
  for num in (n, None):
    est = kfac_jax.BlockDiagonalCurvature(
      problem.tagged,
      layer_tag_to_block_ctor=full,
      num_samples=num or 1,
      should_vmap_samples=True,
    )
    if num:
      _, state = _estimate(est, problem, mode)
      means.append(est.to_dense_matrix(state))
    else:
      singles = [
        est.to_dense_matrix(_estimate(est, problem, mode, rng=k)[1])
        for k in jax.random.split(RNG, n)
      ]
      means.append(np.mean(singles, axis=0))
  np.testing.assert_allclose(means[0], means[1], rtol=1e-9, atol=1e-12)
  del single


def test_num_samples_zero_leaves_the_estimate():
  problem = groundtruth.mlp()
  est = kfac_jax.BlockDiagonalCurvature(problem.tagged, num_samples=0)
  before, after = _estimate(est, problem, "fisher_gradients")
  np.testing.assert_array_equal(
    est.to_dense_matrix(before), est.to_dense_matrix(after)
  )
  with pytest.raises(ValueError, match="num_samples"):
    kfac_jax.BlockDiagonalCurvature(problem.tagged, num_samples=-1)


@pytest.mark.parametrize("norm", ["avg_diag", "trace", "fro", "2_norm"])
def test_norm_scaled_damping_on_every_product(norm):
  problem = groundtruth.mlp()
  est = kfac_jax.BlockDiagonalCurvature(problem.tagged)
  _, state = _estimate(est, problem, "ggn_exact")
  blocks = est.to_diagonal_block_dense_matrix(state)
  # Each Kronecker block's norm is its dense matrix's for these kinds.
  by_hand = []
  for block, block_state, dense in zip(est.blocks, state.blocks_states, blocks):
    expected = kfac_jax.curvature_blocks.psd_matrix_norm(dense, norm)
    np.testing.assert_allclose(block.norm(block_state, norm), expected)
    by_hand.append(0.1 * expected)
  v = jax.tree.map(jnp.ones_like, problem.params)
  kw = dict(norm_to_scale_identity_weight_per_block=norm)
  for method in ("multiply", "multiply_inverse"):
    got = getattr(est, method)(state, v, 0.1, True, False, None, **kw)
    want = getattr(est, method)(state, v, by_hand, True, False, None)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(a, b, rtol=1e-10)
  cached = est.update_cache(state, 0.1, -1, None, False, None, **kw)
  got = est.multiply_inverse(cached, v, 0.1, True, True, None)
  want = est.multiply_matpower(state, v, by_hand, -1, True, False, None)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-9)


def test_psd_matrix_norm_by_hand():
  m = np.array([[4.0, 1.0], [1.0, 2.0]])
  norm = kfac_jax.curvature_blocks.psd_matrix_norm
  assert norm(m, "avg_diag") == pytest.approx(3.0)
  assert norm(m, "trace") == pytest.approx(6.0)
  assert norm(m, "one_over_dim") == pytest.approx(0.5)
  assert norm(m, "1_norm") == pytest.approx(5.0)
  assert norm(m, "fro") == pytest.approx(np.sqrt(22.0))
  assert norm(m, "2_norm") == pytest.approx(3 + np.sqrt(2))
  assert norm(np.array([1.0, 3.0]), "avg_diag") == pytest.approx(2.0)
  with pytest.raises(ValueError, match="Unknown norm_type"):
    norm(m, "nuclear")


@pytest.mark.slow
def test_diagonal_and_dense_exports_and_param_order():
  problem = groundtruth.mlp()
  est = kfac_jax.BlockDiagonalCurvature(
    problem.tagged, layer_tag_to_block_ctor={"dense": kfac_jax.DenseFull}
  )
  _, state = _estimate(est, problem, "ggn_exact")
  dense = est.to_dense_matrix(state)
  diag = jax.flatten_util.ravel_pytree(est.undamped_diagonal(state))[0]
  np.testing.assert_allclose(diag, np.diag(dense), rtol=1e-12)
  # The blocks in `param_order`, one after the other, are the diagonal
  # blocks of the exact GGN with its rows in that order.
  explicit = kfac_jax.ExplicitExactCurvature(
    problem.tagged, param_order=est.param_order
  )
  _, exact_state = _estimate(explicit, problem, "ggn_exact")
  full = explicit.to_dense_matrix(exact_state)
  start = 0
  for block in est.to_diagonal_block_dense_matrix(state):
    end = start + block.shape[0]
    np.testing.assert_allclose(block, full[start:end, start:end], rtol=1e-9)
    start = end
  # And `full` is the exact GGN, permuted.
  sizes = [p.size for p in jax.tree.leaves(problem.params)]
  offsets = np.concatenate([[0], np.cumsum(sizes)])
  perm = np.concatenate(
    [np.arange(offsets[i], offsets[i + 1]) for i in est.param_order]
  )
  ggn = problem.ggn()
  np.testing.assert_allclose(full, ggn[np.ix_(perm, perm)], rtol=1e-9)


def test_block_undamped_diagonal_matches_its_dense_matrix():
  problem = groundtruth.mlp()
  for ctor in (
    kfac_jax.DenseTwoKroneckerFactored,
    kfac_jax.DenseDiagonal,
    kfac_jax.ScaledIdentity,
  ):
    est = kfac_jax.BlockDiagonalCurvature(
      problem.tagged, layer_tag_to_block_ctor={"dense_tag": ctor}
    )
    _, state = _estimate(est, problem, "ggn_exact")
    for block, s in zip(est.blocks, state.blocks_states):
      got = np.concatenate([d.ravel() for d in block.undamped_diagonal(s)])
      np.testing.assert_allclose(got, np.diag(block.to_dense_matrix(s)))
      assert block.dtype == jnp.float64


def test_implicit_jacobian_and_loss_products_against_brute_force():
  problem = groundtruth.mlp(loss="softmax", batch=3)
  implicit = kfac_jax.ImplicitExactCurvature(problem.tagged)
  args = (problem.params, problem.batch)
  flat, unravel = jax.flatten_util.ravel_pytree(problem.params)
  x, t = problem.batch
  v = jax.random.normal(jax.random.PRNGKey(1), flat.shape)
  (jv,), losses = implicit.multiply_jacobian(
    args, unravel(v), return_loss_objects=True
  )
  jac = jax.jacobian(lambda p: problem.forward(unravel(p), x))(flat)
  np.testing.assert_allclose(jv[0], jac @ v, rtol=1e-10)
  # The loss's GGN is the Hessian of the summed loss w.r.t. the logits; for
  # softmax cross-entropy the Fisher equals it.
  z = problem.forward(problem.params, x)
  u = jax.random.normal(jax.random.PRNGKey(2), z.shape)
  hess = jax.vmap(jax.hessian(problem.per_example_loss))(z, t)
  want = jnp.einsum("bij,bj->bi", hess, u)
  for method in ("multiply_loss_ggn", "multiply_loss_fisher"):
    (got,) = getattr(implicit, method)(losses, [(u,)])
    np.testing.assert_allclose(got[0], want, rtol=1e-10, atol=1e-12)
  for kind in ("ggn", "fisher"):
    (bt_u,) = getattr(implicit, f"multiply_loss_{kind}_factor_transpose")(
      losses, [(u,)]
    )
    (b_bt_u,) = getattr(implicit, f"multiply_loss_{kind}_factor")(
      losses, [bt_u]
    )
    np.testing.assert_allclose(b_bt_u[0], want, rtol=1e-10, atol=1e-12)
  (jt_u, _) = implicit.multiply_jacobian_transpose(
    args, [(u,)], return_loss_objects=True
  )
  np.testing.assert_allclose(
    jax.flatten_util.ravel_pytree(jt_u)[0],
    jac.reshape(-1, flat.size).T @ u.ravel(),
    rtol=1e-10,
  )
  with pytest.raises(ValueError, match="one per loss"):
    implicit.multiply_loss_ggn(losses, [(u,), (u,)])


def test_estimator_base_options():
  problem = groundtruth.mlp()
  args = (problem.params, problem.batch)
  est = kfac_jax.BlockDiagonalCurvature(problem.tagged)
  value = est.compute_func_from_registered(args, problem.batch[0].shape[0])
  np.testing.assert_allclose(value, problem.tagged(*args), rtol=1e-12)
  assert est.batch_index == 1
  with pytest.raises(ValueError, match="exactly one of func"):
    kfac_jax.BlockDiagonalCurvature()
  with pytest.raises(ValueError, match="exactly one of func"):
    kfac_jax.BlockDiagonalCurvature(
      problem.tagged, func_and_grad=jax.value_and_grad(problem.tagged)
    )
  state = est.init(RNG, args)
  assert bool(state.synced)
  _, updated = _estimate(est, problem, "ggn_exact")
  assert not bool(updated.synced)
  # Outside a mapped axis, sync changes nothing.
  assert est.sync(updated, "i") is updated


def test_kfac_jax_tag_names_and_block_constructors():
  problem = groundtruth.mlp()
  est = kfac_jax.BlockDiagonalCurvature(
    problem.tagged,
    layer_tag_to_block_ctor={"dense": lambda eqn: kfac_jax.DenseDiagonal(eqn)},
  )
  est.init(RNG, (problem.params, problem.batch))
  assert all(isinstance(b, kfac_jax.DenseDiagonal) for b in est.blocks)
  assert kfac_jax.KroneckerFactored is kfac_jax.TwoKroneckerFactored
  assert kfac_jax.get_default_tag_to_block_ctor("dense") is (
    kfac_jax.get_default_tag_to_block_ctor("dense_tag")
  )
  assert kfac_jax.curvature_blocks.to_real_set([1, -1, 1]) == {1, -1}
  assert kfac_jax.curvature_blocks.to_real_set(None) == set()
  with pytest.raises(ValueError, match="real number"):
    kfac_jax.curvature_blocks.to_real_set("x")


def test_update_cache_adds_powers_not_named_at_init():
  problem = groundtruth.mlp()
  est = kfac_jax.BlockDiagonalCurvature(problem.tagged)
  _, state = _estimate(est, problem, "ggn_exact")
  cached = est.update_cache(state, 0.1, -1, None, True, None)
  v = jax.tree.map(jnp.ones_like, problem.params)
  got = est.multiply_inverse(cached, v, 0.1, True, True, None)
  want = est.multiply_inverse(state, v, 0.1, True, False, None)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-9)
  # The matrix itself needs no cache.
  got = est.multiply(state, v, 0.1, True, True, None)
  want = est.multiply(state, v, 0.1, True, False, None)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-12)


def test_a_default_mode_of_none_is_kfac_jax_ggn_curvature_prop():
  problem = groundtruth.mlp()
  est = kfac_jax.BlockDiagonalCurvature(
    problem.tagged, default_estimation_mode=None
  )
  assert est.default_estimation_mode == "ggn_curvature_prop"


def test_conv2d_block_shape_properties():
  problem = groundtruth.convnet(data_format="NCHW")
  est = kfac_jax.BlockDiagonalCurvature(problem.tagged)
  est.init(RNG, (problem.params, problem.batch))
  (conv,) = [
    b for b in est.blocks if isinstance(b, kfac_jax.Conv2DTwoKroneckerFactored)
  ][:1]
  x_shape = conv.inputs_shapes[0]
  assert conv.inputs_spatial_shape == tuple(x_shape[2:])  # NCHW
  kernel = conv.parameters_shapes[0]
  assert kernel[conv.kernel_output_axis] == conv.num_outputs_channels
