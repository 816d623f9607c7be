"""The K-FAC optimizer against hand-computed updates (float64)."""

import dataclasses
import functools

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest

import estimators as kfac
from tests import groundtruth as gt

FULL = {"dense_tag": kfac.DenseFull}
ravel = lambda t: jax.flatten_util.ravel_pytree(t)[0]


def make(problem, **kwargs):
  defaults = dict(
    l2_reg=0.01,
    estimation_mode="ggn_exact",
    layer_tag_to_block_ctor=FULL,
    num_burnin_steps=0,
    use_exact_inverses=True,
  )
  return kfac.Optimizer(
    jax.value_and_grad(problem.tagged), **(defaults | kwargs)
  )


def test_fixed_step_equals_hand_computed_update():
  problem = gt.mlp(loss="softmax")
  lr, mom, damping, l2 = 0.3, 0.8, 0.05, 0.01
  opt = make(problem)
  rng = jax.random.PRNGKey(0)
  state = opt.init(problem.params, rng, problem.batch)
  # The curvature is the block-diagonal exact GGN of the (fixed) batch.
  curvature = problem.ggn() * gt.block_mask(
    problem, [["w1", "b1"], ["w2", "b2"]]
  )
  inverse = jnp.linalg.inv(curvature + (damping + l2) * jnp.eye(len(curvature)))
  params, velocity = problem.params, jnp.zeros(len(curvature))
  _, unravel = problem.flat_params
  for step in range(3):
    grads = ravel(jax.grad(problem.tagged)(params, problem.batch))
    expected = -lr * inverse @ grads + (mom * velocity if step else 0)
    new_params, state, stats = opt.step(
      params,
      state,
      rng,
      batch=problem.batch,
      learning_rate=lr,
      momentum=mom,
      damping=damping,
      global_step_int=step,
    )
    np.testing.assert_allclose(
      ravel(new_params) - ravel(params), expected, rtol=1e-8, atol=1e-12
    )
    assert float(stats["learning_rate"]) == pytest.approx(lr)
    velocity, params = expected, new_params
  assert int(stats["step"]) == 3 and int(stats["data_seen"]) == 18


def test_adaptive_learning_rate_and_momentum_solve_the_quadratic_model():
  problem = gt.mlp(loss="sigmoid")
  opt = make(
    problem,
    use_adaptive_learning_rate=True,
    use_adaptive_momentum=True,
    use_adaptive_damping=True,
    initial_damping=0.1,
  )
  rng = jax.random.PRNGKey(0)
  state = opt.init(problem.params, rng, problem.batch)
  params = problem.params
  for step in range(3):
    grads = jax.grad(problem.tagged)(params, problem.batch)
    ggn = dataclasses.replace(problem, params=params).ggn()
    new_params, new_state, stats = opt.step(
      params, state, rng, batch=problem.batch, global_step_int=step
    )
    weight = float(stats["damping"]) + 0.01
    precon = ravel(
      opt.estimator.multiply_inverse(
        new_state.estimator_state,
        grads,
        weight,
        exact_power=True,
        use_cached=True,
      )
    )
    velocity = ravel(state.velocities)
    vectors = jnp.stack([precon, velocity])
    quad = vectors @ (ggn + weight * jnp.eye(len(ggn))) @ vectors.T
    linear = vectors @ ravel(grads)
    if step == 0:  # no velocity yet: a 1-D problem
      coefficients = jnp.array([-linear[0] / quad[0, 0], 0.0])
    else:
      coefficients = jnp.linalg.solve(quad, -linear)
    np.testing.assert_allclose(
      [-stats["learning_rate"], stats["momentum"]], coefficients, rtol=1e-7
    )
    np.testing.assert_allclose(
      ravel(new_params) - ravel(params),
      coefficients @ vectors,
      rtol=1e-7,
      atol=1e-12,
    )
    params, state = new_params, new_state
  assert float(stats["loss"]) < float(
    problem.tagged(problem.params, problem.batch)
  )


@pytest.mark.parametrize("lr,direction", [(30.0, "up"), (1e-3, "down")])
def test_damping_follows_the_reduction_ratio(lr, direction):
  problem = gt.mlp(loss="softmax")
  opt = make(
    problem,
    use_adaptive_damping=True,
    initial_damping=0.5,
    damping_adaptation_interval=1,
    damping_adaptation_decay=0.5,
  )
  _, state, stats = gt.one_step(
    opt, problem, learning_rate=lr, momentum=0.0, global_step_int=0
  )
  rho = float(stats["rho"])
  if direction == "up":
    assert rho < 0.25 and float(state.damping) == pytest.approx(1.0)
  else:
    assert rho > 0.75 and float(state.damping) == pytest.approx(0.25)


def test_burnin_leaves_params_unchanged_and_accumulates_curvature():
  problem = gt.mlp(loss="softmax")
  opt = make(problem, num_burnin_steps=3)
  rng = jax.random.PRNGKey(0)
  state = opt.init(problem.params, rng, problem.batch)
  burnt, _ = opt.burnin(
    3, problem.params, state, rng, iter([problem.batch] * 3)
  )
  assert int(burnt.step_counter) == 0
  assert float(ravel(burnt.velocities) @ ravel(burnt.velocities)) == 0
  before = opt.estimator.to_dense_matrix(state.estimator_state)
  after = opt.estimator.to_dense_matrix(burnt.estimator_state)
  assert float(jnp.abs(before).max()) == 0 and float(jnp.abs(after).max()) > 0
  # step() runs the burn-in itself on the first call.
  params, _, _ = opt.step(
    problem.params,
    state,
    rng,
    batch=problem.batch,
    learning_rate=0.1,
    momentum=0.0,
    damping=0.1,
  )
  assert not np.allclose(ravel(params), ravel(problem.params))


# Kronecker blocks with cached approximate inverses, as the optimizer's
# defaults: with few rows per device against wide layers, the gradient is
# preconditioned from the layers' rows (`multiply_inverse_of_gradient`).
KFAC = dict(layer_tag_to_block_ctor=None, use_exact_inverses=False)


@pytest.mark.parametrize("blocks", ["full", "kfac"])
def test_two_devices_equal_one_device(blocks):
  problem = gt.mlp(loss="softmax", batch=8, d_in=6, hidden=12)
  kwargs = dict(learning_rate=0.2, momentum=0.5, damping=0.1)
  options = KFAC if blocks == "kfac" else {}
  single = make(problem, **options)
  rng = jax.random.PRNGKey(0)
  state = single.init(problem.params, rng, problem.batch)
  p1, s1, _ = single.step(
    problem.params, state, rng, batch=problem.batch, global_step_int=0, **kwargs
  )
  p1, _, _ = single.step(
    p1, s1, rng, batch=problem.batch, global_step_int=1, **kwargs
  )

  multi = make(problem, multi_device=True, **options)
  replicate = lambda t: jax.tree.map(lambda x: jnp.stack([x, x]), t)
  shard = jax.tree.map(lambda x: x.reshape((2, 4) + x.shape[1:]), problem.batch)
  keys = replicate(rng)
  params = replicate(problem.params)
  state = multi.init(params, keys, shard)
  p2, s2, _ = multi.step(
    params, state, keys, batch=shard, global_step_int=0, **kwargs
  )
  p2, _, _ = multi.step(p2, s2, keys, batch=shard, global_step_int=1, **kwargs)
  np.testing.assert_allclose(
    ravel(jax.tree.map(lambda x: x[0], p2)), ravel(p1), rtol=1e-9, atol=1e-12
  )
  if blocks == "kfac":  # the first layer: 8 rows on one device, 4 on two
    assert multi.estimator.blocks[0].outer_sum_is_cheaper()
    assert not single.estimator.blocks[0].outer_sum_is_cheaper()


def test_kronecker_step_preconditions_the_gradient_with_the_cached_inverse():
  problem = gt.mlp(loss="softmax", batch=2, d_in=6, hidden=8)
  lr, damping, l2 = 0.3, 0.05, 0.01
  opt = make(problem, **KFAC)
  params, state, _ = gt.one_step(
    opt, problem, learning_rate=lr, momentum=0.5, damping=damping
  )
  assert all(b.outer_sum_is_cheaper() for b in opt.estimator.blocks)
  grads = jax.grad(problem.tagged)(problem.params, problem.batch)
  precon = opt.estimator.multiply_inverse(
    state.estimator_state,
    grads,
    damping + l2,
    exact_power=False,
    use_cached=True,
  )
  np.testing.assert_allclose(
    ravel(params) - ravel(problem.params),
    -lr * ravel(precon),
    rtol=1e-9,
    atol=1e-13,
  )


def test_uncompiled_step_computes_what_step_runs():
  problem = gt.mlp(loss="softmax")
  opt = make(problem)
  rng = jax.random.PRNGKey(0)
  state = opt.init(problem.params, rng, problem.batch)
  hyper = dict(learning_rate=0.3, momentum=0.5, damping=0.05)
  params, new_state, stats = opt.step(
    problem.params, state, rng, batch=problem.batch, global_step_int=0, **hyper
  )
  # Step 0 refreshes the cached inverses; the damping is not adaptive.
  body = jax.jit(
    functools.partial(
      opt.uncompiled_step, refresh_cache=True, update_damping=False
    )
  )
  params2, state2, _, stats2 = body(
    problem.params,
    state,
    rng,
    problem.batch,
    **{k: jnp.asarray(v, state.damping.dtype) for k, v in hyper.items()},
  )
  np.testing.assert_allclose(
    ravel(params2), ravel(params), rtol=1e-9, atol=1e-12
  )
  assert int(state2.step_counter) == int(new_state.step_counter) == 1
  assert float(stats2["loss"]) == pytest.approx(float(stats["loss"]))


def test_aux_state_and_rng_variants_pass_values_through():
  problem = gt.mlp(loss="softmax")

  def loss_fn(params, func_state, rng, batch):
    loss = problem.tagged(params, batch)
    noise = jax.random.uniform(rng)
    return loss, (func_state + 1, {"noise": noise})

  opt = kfac.Optimizer(
    jax.value_and_grad(loss_fn, has_aux=True),
    l2_reg=0.0,
    value_func_has_aux=True,
    value_func_has_state=True,
    value_func_has_rng=True,
    num_burnin_steps=0,
    estimation_mode="ggn_exact",
  )
  rng = jax.random.PRNGKey(3)
  func_state = jnp.array(5)
  state = opt.init(problem.params, rng, problem.batch, func_state)
  _, _, new_func_state, stats = opt.step(
    problem.params,
    state,
    rng,
    batch=problem.batch,
    func_state=func_state,
    learning_rate=0.1,
    momentum=0.0,
    damping=0.1,
  )
  assert int(new_func_state) == 6
  assert float(stats["aux"]["noise"]) == pytest.approx(
    float(jax.random.uniform(rng))
  )


def test_norms_in_stats():
  problem = gt.mlp(loss="softmax")
  opt = make(
    problem, include_norms_in_stats=True, include_per_param_norms_in_stats=True
  )
  _, _, stats = gt.one_step(
    opt, problem, learning_rate=0.1, momentum=0.0, damping=0.1
  )
  grads = jax.grad(problem.tagged)(problem.params, problem.batch)
  assert float(stats["grad_norm"]) == pytest.approx(
    float(jnp.linalg.norm(ravel(grads)))
  )
  assert set(stats["per_param_update_norm"]) == set(problem.params)


def test_errors():
  problem = gt.mlp(loss="softmax")
  vg = jax.value_and_grad(problem.tagged)
  with pytest.raises(ValueError, match="norm_constraint"):
    kfac.Optimizer(
      vg, 0.0, use_adaptive_learning_rate=True, norm_constraint=1.0
    )
  with pytest.raises(ValueError, match="initial_damping"):
    kfac.Optimizer(vg, 0.0, use_adaptive_damping=True)
  adaptive = make(problem, use_adaptive_learning_rate=True)
  fixed = make(problem)
  rng = jax.random.PRNGKey(0)
  state = fixed.init(problem.params, rng, problem.batch)
  kwargs = dict(momentum=0.0, damping=0.1)
  with pytest.raises(ValueError, match="adapts it"):
    adaptive.init(problem.params, rng, problem.batch)
    adaptive.step(
      problem.params,
      state,
      rng,
      batch=problem.batch,
      learning_rate=0.1,
      **kwargs,
    )
  with pytest.raises(ValueError, match="needs learning_rate"):
    fixed.step(problem.params, state, rng, batch=problem.batch, **kwargs)
  with pytest.raises(ValueError, match="exactly one of data_iterator"):
    fixed.step(
      problem.params,
      state,
      rng,
      batch=problem.batch,
      data_iterator=iter([problem.batch]),
      learning_rate=0.1,
      **kwargs,
    )
  with pytest.raises(ValueError, match="global_step_int=4"):
    fixed.step(
      problem.params,
      state,
      rng,
      batch=problem.batch,
      learning_rate=0.1,
      global_step_int=4,
      **kwargs,
    )
  with pytest.raises(ValueError, match="estimation mode"):
    kfac.Optimizer(vg, 0.0, estimation_mode="fisher_magic")


def test_global_step_int_is_checked_against_the_state_it_comes_with():
  problem = gt.mlp(loss="softmax")
  opt = make(problem)
  rng = jax.random.PRNGKey(0)
  kwargs = dict(
    batch=problem.batch, learning_rate=0.1, momentum=0.0, damping=0.1
  )
  first = opt.init(problem.params, rng, problem.batch)
  params, second, _ = opt.step(
    problem.params, first, rng, global_step_int=0, **kwargs
  )
  # The state the last step returned is known to be at step 1 ...
  with pytest.raises(
    ValueError, match="global_step_int=2 but the optimizer state is at step 1"
  ):
    opt.step(params, second, rng, global_step_int=2, **kwargs)
  # ... and an older state is read back from the device, not assumed.
  jax.block_until_ready(first)
  with pytest.raises(
    ValueError, match="global_step_int=1 but the optimizer state is at step 0"
  ):
    opt.step(params, first, rng, global_step_int=1, **kwargs)
  _, third, _ = opt.step(params, second, rng, global_step_int=1, **kwargs)
  _, _, stats = opt.step(params, third, rng, **kwargs)
  assert int(stats["step"]) == 3
