"""Estimators against brute-force ground truth (float64)."""

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest

import estimators as kfac
from tests import groundtruth as gt

FULL = {
  "dense_tag": kfac.DenseFull,
  "conv2d_tag": kfac.Conv2DFull,
  "scale_and_shift_tag": kfac.ScaleAndShiftFull,
  "generic_tag": kfac.NaiveFull,
}
DIAG = {
  "dense_tag": kfac.DenseDiagonal,
  "conv2d_tag": kfac.Conv2DDiagonal,
  "scale_and_shift_tag": kfac.ScaleAndShiftDiagonal,
}
GROUPS = {
  "mlp": [["w1", "b1"], ["w2", "b2"]],
  "convnet": [["k", "kb"], ["w", "b"]],
  "convnet_nchw": [["k", "kb"], ["w", "b"]],
  "scale_shift": [["w1", "b1"], ["scale", "shift"], ["w2"]],
}


def estimate(problem, mode, ctor_map=None, rng=0, estimator=None, args=None):
  est = estimator or kfac.BlockDiagonalCurvature(
    problem.tagged, layer_tag_to_block_ctor=ctor_map
  )
  args = args or (problem.params, problem.batch)
  state = est.init(jax.random.PRNGKey(1), args)
  batch_size = problem.batch[0].shape[0]
  state = est.update_curvature_matrix_estimate(
    state,
    0.0,
    1.0,
    batch_size,
    jax.random.PRNGKey(rng),
    args,
    estimation_mode=mode,
  )
  return est, state


@pytest.mark.parametrize("name", list(gt.MODELS))
@pytest.mark.parametrize(
  "loss", ["softmax", "sigmoid", "squared", "normal", "categorical"]
)
@pytest.mark.parametrize("mode", ["ggn_exact", "fisher_exact"])
def test_exact_full_blocks_equal_block_diagonal_of_ggn(name, loss, mode):
  if name != "mlp" and loss in ("categorical", "normal"):
    pytest.skip("loss families are covered on the MLP")
  problem = gt.MODELS[name](loss=loss)
  est, state = estimate(problem, mode, FULL)
  ggn = problem.ggn()
  expected = ggn * gt.block_mask(problem, GROUPS[name])
  np.testing.assert_allclose(
    est.to_dense_matrix(state), expected, rtol=1e-9, atol=1e-11
  )
  est_diag, diag_state = estimate(problem, mode, DIAG)
  np.testing.assert_allclose(
    est_diag.to_dense_matrix(diag_state),
    jnp.diag(jnp.diag(ggn)),
    rtol=1e-9,
    atol=1e-11,
  )


@pytest.mark.parametrize("name", ["mlp", "convnet", "scale_shift"])
def test_fisher_empirical_is_the_mean_outer_product_over_the_batch_size(name):
  """KFAC-JAX's block-diagonal convention (tests/estimators/curvature/test_fisher_empirical.py
  has both conventions and every family)."""
  problem = gt.MODELS[name](
    loss="softmax" if name != "scale_shift" else "squared"
  )
  est, state = estimate(problem, "fisher_empirical", FULL)
  expected = (
    problem.empirical_fisher()
    / problem.batch[0].shape[0]
    * gt.block_mask(problem, GROUPS[name])
  )
  np.testing.assert_allclose(
    est.to_dense_matrix(state), expected, rtol=1e-9, atol=1e-11
  )


@pytest.mark.parametrize(
  "mode", ["ggn_exact", "fisher_empirical", "fisher_exact"]
)
def test_explicit_exact_equals_brute_force(mode):
  problem = gt.mlp(loss="softmax")
  est = kfac.ExplicitExactCurvature(problem.tagged)
  _, state = estimate(problem, mode, estimator=est)
  expected = (
    problem.empirical_fisher() if mode == "fisher_empirical" else problem.ggn()
  )
  np.testing.assert_allclose(
    est.to_dense_matrix(state), expected, rtol=1e-9, atol=1e-11
  )
  np.testing.assert_allclose(
    est.eigenvalues(state), np.linalg.eigvalsh(expected), atol=1e-10
  )


def test_explicit_eigenvalues_fall_back_to_dense_after_averaging():
  problem = gt.mlp(loss="sigmoid", batch=2)
  est = kfac.ExplicitExactCurvature(
    problem.tagged, default_estimation_mode="ggn_exact"
  )
  _, state = estimate(problem, "ggn_exact", estimator=est)
  state = est.update_curvature_matrix_estimate(
    state, 0.5, 0.5, 2, jax.random.PRNGKey(0), (problem.params, problem.batch)
  )
  assert not bool(state.blocks_states[0].factor_is_exact)
  np.testing.assert_allclose(
    est.eigenvalues(state), np.linalg.eigvalsh(problem.ggn()), atol=1e-10
  )


def test_kronecker_factors_equal_closed_forms():
  problem = gt.mlp(loss="squared", batch=5)
  est, state = estimate(problem, "ggn_exact")
  x, t = problem.batch
  p = problem.params
  # Input factors: mean of [x, 1][x, 1]ᵀ.
  h = x @ p["w1"] + p["b1"]
  for block_state, inputs in zip(state.blocks_states, (x, jnp.tanh(h))):
    xt = jnp.concatenate([inputs, jnp.ones((inputs.shape[0], 1))], 1)
    np.testing.assert_allclose(
      block_state.inputs_factor.value, xt.T @ xt / xt.shape[0], rtol=1e-10
    )
  # Output factors: mean_i J_yᵀ H_i J_y, J_y the Jacobian of the outputs z
  # w.r.t. the layer's outputs y; H = 2 * 0.7 I for this squared error.
  hess = 2 * 0.7 * jnp.eye(3)
  j1 = jax.vmap(jax.jacobian(lambda y: jnp.tanh(y) @ p["w2"]))(h)
  g1 = jnp.mean(jnp.einsum("bki,kl,blj->bij", j1, hess, j1), 0)
  np.testing.assert_allclose(
    state.blocks_states[0].outputs_factor.value, g1, rtol=1e-10
  )
  np.testing.assert_allclose(
    state.blocks_states[1].outputs_factor.value, hess, rtol=1e-10
  )


def test_kronecker_equals_full_on_deep_linear_network():
  problem = gt.deep_linear()
  est_k, state_k = estimate(problem, "ggn_exact")
  est_f, state_f = estimate(problem, "ggn_exact", FULL)
  np.testing.assert_allclose(
    est_k.to_dense_matrix(state_k),
    est_f.to_dense_matrix(state_f),
    rtol=1e-9,
    atol=1e-11,
  )
  expected = problem.ggn() * gt.block_mask(problem, [["w1"], ["w2"], ["w3"]])
  np.testing.assert_allclose(
    est_k.to_dense_matrix(state_k), expected, rtol=1e-9, atol=1e-11
  )


def _average_estimate(problem, mode, ctor_map, n):
  est, state0 = estimate(problem, "ggn_exact", ctor_map)
  args = (problem.params, problem.batch)
  batch_size = problem.batch[0].shape[0]

  def one(key):
    s = est.update_curvature_matrix_estimate(
      state0, 0.0, 1.0, batch_size, key, args, estimation_mode=mode
    )
    return est.to_dense_matrix(s)

  keys = jax.random.split(jax.random.PRNGKey(42), n)
  return jnp.mean(jax.lax.map(one, keys, batch_size=500), axis=0)


@pytest.mark.slow
@pytest.mark.parametrize(
  "mode", ["fisher_gradients", "fisher_curvature_prop", "ggn_curvature_prop"]
)
def test_sampled_modes_converge_to_exact(mode):
  """Statistical: the average of n estimates approaches the exact matrix.

  The relative Frobenius error of an average of n i.i.d. unbiased estimates
  shrinks like 1/sqrt(n); with n = 8000 it is below 5 % here (about 2 % is
  typical), and it must shrink by well over half from n = 500.
  """
  problem = gt.mlp(loss="softmax", batch=4)
  exact = problem.ggn() * gt.block_mask(problem, GROUPS["mlp"])
  err = lambda m: float(jnp.linalg.norm(m - exact) / jnp.linalg.norm(exact))
  coarse = err(_average_estimate(problem, mode, FULL, 500))
  fine = err(_average_estimate(problem, mode, FULL, 8000))
  assert fine < 0.05, (coarse, fine)
  assert fine < 0.6 * coarse, (coarse, fine)


def _two_losses():
  """Two MLPs sharing parameters and inputs, one softmax and one squared
  loss on the same outputs; a loss function registering both; the batch."""
  a, b = gt.mlp(loss="softmax", seed=1), gt.mlp(loss="squared", seed=1)

  def tagged(p, batch):
    x, t_a, t_b = batch
    z = a.tagged_forward(p, x)
    kfac.register_softmax_cross_entropy_loss(z, t_a)
    kfac.register_squared_error_loss(z, t_b, weight=0.7)
    return 0.0

  return a, b, tagged, (a.batch[0], a.batch[1], b.batch[1])


def test_several_losses_add_their_curvatures():
  a, b, tagged, batch = _two_losses()
  expected = a.ggn() + b.ggn()
  for mode in ("ggn_exact", "fisher_exact"):
    est = kfac.ExplicitExactCurvature(tagged)
    _, state = estimate(a, mode, estimator=est, args=(a.params, batch))
    np.testing.assert_allclose(
      est.to_dense_matrix(state), expected, rtol=1e-9, atol=1e-11
    )
    est, state = estimate(
      a,
      mode,
      FULL,
      args=(a.params, batch),
      estimator=kfac.BlockDiagonalCurvature(
        tagged, layer_tag_to_block_ctor=FULL
      ),
    )
    np.testing.assert_allclose(
      est.to_dense_matrix(state),
      expected * gt.block_mask(a, GROUPS["mlp"]),
      rtol=1e-9,
      atol=1e-11,
    )


@pytest.mark.parametrize("name", ["mlp", "convnet", "scale_shift"])
def test_implicit_products_equal_dense_products(name):
  problem = gt.MODELS[name](
    loss="sigmoid"
    if name == "mlp"
    else ("softmax" if name == "convnet" else "squared")
  )
  est = kfac.ImplicitExactCurvature(problem.tagged)
  args = (problem.params, problem.batch)
  flat, unravel = problem.flat_params
  v = jax.random.normal(jax.random.PRNGKey(3), flat.shape)
  ravel = lambda t: jax.flatten_util.ravel_pytree(t)[0]
  ggn, hess = problem.ggn(), problem.hessian()
  np.testing.assert_allclose(
    ravel(est.multiply_ggn(args, unravel(v))), ggn @ v, rtol=1e-9, atol=1e-11
  )
  np.testing.assert_allclose(
    ravel(est.multiply_fisher(args, unravel(v))), ggn @ v, rtol=1e-9, atol=1e-11
  )
  np.testing.assert_allclose(
    ravel(est.multiply_hessian(args, unravel(v))),
    hess @ v,
    rtol=1e-9,
    atol=1e-11,
  )
  np.testing.assert_allclose(
    est.to_dense_matrix(args, "hessian"), hess, rtol=1e-9, atol=1e-11
  )
  # The factor products compose to the matrix: B (Bᵀ v) = G v.
  for kind in ("ggn", "fisher"):
    bt_v = getattr(est, f"multiply_{kind}_factor_transpose")(args, unravel(v))
    bbt_v = getattr(est, f"multiply_{kind}_factor")(args, bt_v)
    np.testing.assert_allclose(ravel(bbt_v), ggn @ v, rtol=1e-9, atol=1e-11)
  shapes, batch_size = est.get_loss_input_shapes_and_batch_size(args)
  assert batch_size == problem.batch[0].shape[0]
  assert shapes[0][0][0] == batch_size


@pytest.mark.parametrize("ctor_map", [None, FULL, DIAG])
def test_inverse_of_multiply_is_identity_and_eigenvalues_match(ctor_map):
  problem = gt.mlp(loss="softmax")
  est, state = estimate(problem, "ggn_exact", ctor_map)
  v = jax.tree.map(
    lambda x: jax.random.normal(jax.random.PRNGKey(0), x.shape), problem.params
  )
  for exact in (True, False):
    back = est.multiply_inverse(
      state, est.multiply(state, v, 0.1, exact, False), 0.1, exact, False
    )
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(v)):
      np.testing.assert_allclose(a, b, rtol=1e-7, atol=1e-9)
  dense = est.to_dense_matrix(state)
  np.testing.assert_allclose(
    jnp.sort(est.eigenvalues(state)), np.linalg.eigvalsh(dense), atol=1e-10
  )


def test_cached_inverse_matches_uncached():
  problem = gt.convnet(loss="softmax")
  est = kfac.BlockDiagonalCurvature(problem.tagged)
  args = (problem.params, problem.batch)
  state = est.init(
    jax.random.PRNGKey(0),
    args,
    exact_powers_to_cache=-1,
    approx_powers_to_cache=-1,
    cache_eigenvalues=True,
  )
  state = est.update_curvature_matrix_estimate(
    state, 0.0, 1.0, 3, jax.random.PRNGKey(0), args, estimation_mode="ggn_exact"
  )
  state = est.update_cache(state, 0.01, -1, -1, True)
  v = jax.tree.map(jnp.ones_like, problem.params)
  for exact in (True, False):
    cached = est.multiply_inverse(state, v, 0.01, exact, True)
    fresh = est.multiply_inverse(state, v, 0.01, exact, False)
    for a, b in zip(jax.tree.leaves(cached), jax.tree.leaves(fresh)):
      np.testing.assert_allclose(a, b, rtol=1e-8)
  np.testing.assert_allclose(
    jnp.sort(est.eigenvalues(state, True)),
    jnp.sort(est.eigenvalues(state, False)),
    rtol=1e-8,
  )


def _outer_sum_loss(problem, variant):
  """The MLP's loss, with w1 also used outside its layer for some variants."""
  if variant == "l2":
    return lambda p, b: problem.tagged(p, b) + 0.1 * jnp.sum(p["w1"] ** 2)
  if variant != "untagged_use":
    return problem.tagged

  def loss(p, batch):  # the first layer's untagged output reaches the loss
    x, t = batch
    h = x @ p["w1"] + p["b1"]
    a = jnp.tanh(kfac.register_dense(h, x, p["w1"], p["b1"]))
    z = kfac.register_dense(a @ p["w2"] + p["b2"], a, p["w2"], p["b2"])
    z = kfac.register_softmax_cross_entropy_loss(z + h[:, :3], t)
    return jnp.mean(jax.vmap(problem.per_example_loss)(z, t))

  return loss


@pytest.mark.parametrize(
  "variant, d_in, only_through_layer",
  [
    ("plain", 6, (True, True)),
    ("inverse_root", 1100, (True, True)),  # A⁻¹ kept as a Cholesky root
    ("l2", 6, (False, True)),
    ("untagged_use", 6, (False, True)),
  ],
)
def test_gradient_preconditioned_from_layer_rows_equals_multiply_inverse(
  variant, d_in, only_through_layer
):
  problem = gt.mlp(loss="softmax", batch=2, d_in=d_in, hidden=8)
  loss = _outer_sum_loss(problem, variant)
  args = (problem.params, problem.batch)
  proc = kfac.tracer.ProcessedJaxpr.make_from_func(
    loss, args, compute_only_loss_tags=False
  )
  assert (
    tuple(proc.params_reach_outputs_only_through_layer(j) for j in range(2))
    == only_through_layer
  )
  est = kfac.BlockDiagonalCurvature(loss)
  state = est.init(jax.random.PRNGKey(0), args, approx_powers_to_cache=-1)
  state = est.update_curvature_matrix_estimate(
    state, 0.0, 1.0, 2, jax.random.PRNGKey(1), args, estimation_mode="ggn_exact"
  )
  state = est.update_cache(state, 0.1, None, -1)
  # Two rows against 8-wide layers: both blocks offer the outer-sum product.
  assert all(b.outer_sum_is_cheaper() for b in est.blocks)
  grads = jax.grad(loss)(*args)
  expected = est.multiply_inverse(state, grads, 0.1, False, True)
  actual = est.multiply_inverse_of_gradient(
    state, grads, args, 0.1, False, True
  )
  for name in expected:
    np.testing.assert_allclose(
      actual[name], expected[name], rtol=1e-10, atol=1e-14, err_msg=name
    )


def test_estimator_structure_helpers():
  problem = gt.scale_shift_net()
  est, state = estimate(problem, "ggn_exact")
  assert est.num_blocks == 3
  assert est.dim == sum(np.size(x) for x in jax.tree.leaves(problem.params))
  assert sum(est.block_dims) == est.dim
  # Blocks are ordered by their parameters' positions in the params tree.
  assert est.params_block_index == {
    "scale": 0,
    "shift": 0,
    "w1": 1,
    "b1": 1,
    "w2": 2,
  }
  assert set(est.indices_to_block_map) == set(est.jaxpr.layer_indices)
  vectors = est.params_vector_to_blocks_vectors(problem.params)
  back = est.blocks_vectors_to_params_vector(vectors)
  assert jax.tree.all(jax.tree.map(jnp.array_equal, back, problem.params))
  assert isinstance(est.blocks[0], kfac.ScaleAndShiftDiagonal)
  assert kfac.get_default_tag_to_block_ctor("dense_tag") is (
    kfac.DenseTwoKroneckerFactored
  )


def test_untagged_parameters_get_a_generic_block():
  problem = gt.mlp(loss="softmax")

  def tagged(p, batch):
    temperature = p["temperature"]
    x, t = batch
    z = kfac.register_softmax_cross_entropy_loss(
      problem.forward(p, x) * temperature, t
    )
    return jnp.mean(jax.vmap(gt.softmax_cross_entropy)(z, t))

  params = dict(problem.params, temperature=jnp.array(1.5))
  est = kfac.BlockDiagonalCurvature(tagged)
  state = est.init(jax.random.PRNGKey(0), (params, problem.batch))
  # The dense layers are found automatically; the temperature gets a generic
  # (diagonal) block.
  assert [type(b).__name__ for b in est.blocks] == [
    "NaiveDiagonal",
    "DenseTwoKroneckerFactored",
    "DenseTwoKroneckerFactored",
  ]
  assert est.params_block_index["temperature"] == 0
  state = est.update_curvature_matrix_estimate(
    state, 0.0, 1.0, 6, jax.random.PRNGKey(0), (params, problem.batch)
  )
  assert est.to_dense_matrix(state).shape == (est.dim, est.dim)
  with pytest.raises(ValueError, match="not in any layer tag"):
    kfac.BlockDiagonalCurvature(tagged, auto_register_tags=False).init(
      jax.random.PRNGKey(0), (params, problem.batch)
    )
  generic = kfac.BlockDiagonalCurvature(tagged, register_only_generic=True)
  generic.init(jax.random.PRNGKey(0), (params, problem.batch))
  assert all(isinstance(b, kfac.NaiveDiagonal) for b in generic.blocks)
  assert generic.num_blocks == 5


# --- several devices ---------------------------------------------------------


def _update_on_two_devices(est, state0, params, split, **kwargs):
  """`est`'s update of `state0` with the batch `split` in two halves, one a
  device, its statistics summed over the devices; the first device's
  state."""

  def update(batch):
    return est.update_curvature_matrix_estimate(
      state0,
      0.0,
      1.0,
      4,
      jax.random.PRNGKey(0),
      (params, batch),
      pmap_axis_name="i",
      **kwargs,
    )

  return jax.tree.map(lambda x: x[0], jax.pmap(update, axis_name="i")(split))


@pytest.mark.parametrize("ctor_map", [None, FULL])
def test_two_devices_equal_one_device(ctor_map):
  assert jax.local_device_count() >= 2
  problem = gt.mlp(loss="softmax", batch=8)
  est, state1 = estimate(problem, "ggn_exact", ctor_map)
  args = (problem.params, problem.batch)
  state0 = est.init(jax.random.PRNGKey(1), args)
  split = jax.tree.map(lambda x: x.reshape((2, 4) + x.shape[1:]), problem.batch)
  state2 = _update_on_two_devices(
    est, state0, problem.params, split, estimation_mode="ggn_exact"
  )
  np.testing.assert_allclose(
    est.to_dense_matrix(state2),
    est.to_dense_matrix(state1),
    rtol=1e-9,
    atol=1e-12,
  )


def test_two_devices_explicit_exact():
  problem = gt.mlp(loss="sigmoid", batch=8)
  est = kfac.ExplicitExactCurvature(
    problem.tagged, default_estimation_mode="ggn_exact"
  )
  split = jax.tree.map(lambda x: x.reshape((2, 4) + x.shape[1:]), problem.batch)
  state0 = est.init(
    jax.random.PRNGKey(1), (problem.params, jax.tree.map(lambda x: x[0], split))
  )
  state = _update_on_two_devices(est, state0, problem.params, split)
  np.testing.assert_allclose(
    est.to_dense_matrix(state), problem.ggn(), rtol=1e-9, atol=1e-12
  )


# --- clear errors ------------------------------------------------------------


def test_error_no_loss_registered():
  problem = gt.mlp()
  est = kfac.BlockDiagonalCurvature(
    lambda p, b: jnp.sum(problem.forward(p, b[0]))
  )
  with pytest.raises(
    ValueError, match="registers? no loss|No loss was registered"
  ):
    est.init(jax.random.PRNGKey(0), (problem.params, problem.batch))


def test_error_params_tree_mismatch():
  problem = gt.mlp()
  est, state = estimate(problem, "ggn_exact")
  with pytest.raises(ValueError, match="structure of the model's params"):
    est.multiply(state, {"w1": problem.params["w1"]}, 0.1, True, False)


def test_error_unknown_mode_and_block():
  problem = gt.mlp()
  with pytest.raises(ValueError, match="Unknown estimation mode"):
    kfac.BlockDiagonalCurvature(
      problem.tagged, default_estimation_mode="fisher_magic"
    )
  with pytest.raises(ValueError, match="Unknown estimation mode"):
    estimate(problem, "gnn_exact")
  est = kfac.BlockDiagonalCurvature(
    problem.tagged, layer_tag_to_block_ctor={"dense_tag": None}
  )
  del est  # None means "use the default" and must not fail


def test_error_fisher_empirical_without_targets():
  problem = gt.mlp()

  def tagged(p, batch):
    kfac.register_softmax_cross_entropy_loss(problem.forward(p, batch[0]))
    return 0.0

  with pytest.raises(ValueError, match="needs the data targets"):
    estimate(
      problem, "fisher_empirical", estimator=kfac.BlockDiagonalCurvature(tagged)
    )


def test_error_kronecker_block_for_generic_tag():
  problem = gt.mlp()

  def tagged(p, batch):
    x, t = batch
    w = kfac.register_generic(p["w1"])
    z = kfac.register_softmax_cross_entropy_loss((x @ w)[:, :3], t)
    return jnp.mean(jax.vmap(gt.softmax_cross_entropy)(z, t))

  est = kfac.BlockDiagonalCurvature(
    tagged,
    layer_tag_to_block_ctor={"generic_tag": kfac.DenseTwoKroneckerFactored},
  )
  with pytest.raises(ValueError, match="Cannot build a DenseTwoKronecker"):
    est.init(
      jax.random.PRNGKey(0), ({"w1": problem.params["w1"]}, problem.batch)
    )


# --- implicit empirical Fisher -----------------------------------------------


def _brute_force_empirical_fisher_product(per_example_grads, v):
  """(1/B) Σ_i d_i (d_iᵀ v) from the rows d_i of per-example gradients."""
  return per_example_grads.T @ (per_example_grads @ v) / len(per_example_grads)


@pytest.mark.parametrize(
  "name,loss", [("mlp", "softmax"), ("mlp", "squared"), ("convnet", "softmax")]
)
def test_implicit_empirical_fisher_equals_per_example_gradients(name, loss):
  problem = gt.MODELS[name](loss=loss)
  est = kfac.ImplicitExactCurvature(problem.tagged)
  args = (problem.params, problem.batch)
  flat, unravel = problem.flat_params
  v = jax.random.normal(jax.random.PRNGKey(4), flat.shape)
  expected = _brute_force_empirical_fisher_product(
    problem.per_example_grads(), v
  )
  product = jax.jit(est.multiply_empirical_fisher)(args, unravel(v))
  np.testing.assert_allclose(
    jax.flatten_util.ravel_pytree(product)[0], expected, rtol=1e-10, atol=1e-12
  )
  dense = est.to_dense_matrix(args, "empirical_fisher")
  explicit = kfac.ExplicitExactCurvature(problem.tagged)
  _, state = estimate(problem, "fisher_empirical", estimator=explicit)
  np.testing.assert_allclose(
    dense, explicit.to_dense_matrix(state), rtol=1e-10, atol=1e-12
  )
  np.testing.assert_allclose(
    dense, problem.empirical_fisher(), rtol=1e-10, atol=1e-12
  )


def test_implicit_empirical_fisher_of_two_losses_has_cross_terms():
  a, b, tagged, batch = _two_losses()
  x, t_a, t_b = batch
  flat, unravel = a.flat_params

  def total_loss(p, xi, ta, tb):
    z = a.forward(unravel(p), xi[None])[0]
    return a.per_example_loss(z, ta) + b.per_example_loss(z, tb)

  grads = jax.vmap(jax.grad(total_loss), in_axes=(None, 0, 0, 0))(
    flat, x, t_a, t_b
  )
  v = jax.random.normal(jax.random.PRNGKey(5), flat.shape)
  expected = _brute_force_empirical_fisher_product(grads, v)
  args = (a.params, batch)
  est = kfac.ImplicitExactCurvature(tagged)
  product = est.multiply_empirical_fisher(args, unravel(v))
  np.testing.assert_allclose(
    jax.flatten_util.ravel_pytree(product)[0], expected, rtol=1e-10, atol=1e-12
  )
  # Without the cross terms the answer would be the sum of the two losses'
  # own empirical Fishers, which is measurably different here.
  no_cross = (a.empirical_fisher() + b.empirical_fisher()) @ v
  assert jnp.linalg.norm(no_cross - expected) > 1e-3 * jnp.linalg.norm(expected)
  explicit = kfac.ExplicitExactCurvature(tagged)
  _, state = estimate(a, "fisher_empirical", estimator=explicit, args=args)
  np.testing.assert_allclose(
    est.to_dense_matrix(args, "empirical_fisher"),
    explicit.to_dense_matrix(state),
    rtol=1e-10,
    atol=1e-12,
  )


def test_error_implicit_empirical_fisher_without_targets():
  problem = gt.mlp()

  def tagged(p, batch):
    z = problem.tagged_forward(p, batch[0])
    kfac.register_softmax_cross_entropy_loss(z)
    return 0.0

  est = kfac.ImplicitExactCurvature(tagged)
  with pytest.raises(ValueError, match="needs the data targets"):
    est.multiply_empirical_fisher(
      (problem.params, problem.batch), problem.params
    )
  with pytest.raises(ValueError, match="mat_type must be one of"):
    est.to_dense_matrix((problem.params, problem.batch), "empirical")
