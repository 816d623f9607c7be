"""KFAC-JAX 0.0.8's optimizer options and module names, each against a hand
computation on a tiny float64 MLP (issue 47)."""

import dataclasses
import inspect
import math

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest

import estimators as kfac_jax
from tests import groundtruth as gt
from tests.groundtruth import one_step

FULL = {"dense_tag": kfac_jax.DenseFull}
GROUPS = [["w1", "b1"], ["w2", "b2"]]
L2 = 0.01
ravel = lambda t: jax.flatten_util.ravel_pytree(t)[0]


def make(problem, value_and_grad=None, **kwargs):
  """Full blocks, exact inverses, the exact GGN: the preconditioner is the
  damped block-diagonal GGN of the batch, known in closed form."""
  defaults = dict(
    l2_reg=L2,
    estimation_mode="ggn_exact",
    layer_tag_to_block_ctor=FULL,
    num_burnin_steps=0,
    use_exact_inverses=True,
    debug=True,
  )
  return kfac_jax.Optimizer(
    value_and_grad or jax.value_and_grad(problem.tagged),
    **(defaults | kwargs),
  )


def block_ggn(problem, params=None):
  if params is not None:
    problem = dataclasses.replace(problem, params=params)
  return problem.ggn() * gt.block_mask(problem, GROUPS)


def grads_of(problem, params=None):
  params = problem.params if params is None else params
  return ravel(jax.grad(problem.tagged)(params, problem.batch))


def assert_preconditioned_step(problem, new_params, curvature, damping, lr):
  """From the problem's params, `new_params` is the step `-lr` times the
  gradient preconditioned by `curvature` with `damping` plus the L2 term."""
  inverse = np.linalg.inv(curvature + (damping + L2) * np.eye(len(curvature)))
  np.testing.assert_allclose(
    ravel(new_params) - ravel(problem.params),
    -lr * inverse @ grads_of(problem),
    rtol=1e-8,
    atol=1e-12,
  )


# --- module-level names ----------------------------------------------------


def test_module_names_of_the_optimizer_module():
  opt_module = kfac_jax.optimizer
  for name in (
    "Array",
    "BlockDiagonalCurvature",
    "FuncArgsVariants",
    "FuncAux",
    "FuncOutputs",
    "PRNGKey",
    "QuadModelParams",
    "ReturnEither",
    "Scalar",
    "ScheduleType",
    "ValueAndGradFunc",
    "ValueFunc",
  ):
    assert hasattr(opt_module, name), name
  assert opt_module.HAIKU_BIASES == "b,bias"
  assert opt_module.HAIKU_BIASES_AND_NORMS == "b,bias,scale,offset"
  assert opt_module.BlockDiagonalCurvature is kfac_jax.BlockDiagonalCurvature


def test_make_func_args_and_extract_func_outputs():
  make_args = kfac_jax.optimizer.make_func_args
  p, s, r, b = "params", "state", "rng", "batch"
  assert make_args(p, None, None, b, False, False) == (p, b)
  assert make_args(p, s, None, b, True, False) == (p, s, b)
  assert make_args(p, None, r, b, False, True) == (p, r, b)
  assert make_args(p, s, r, b, True, True) == (p, s, r, b)
  with pytest.raises(ValueError, match="func_state"):
    make_args(p, None, r, b, True, True)
  with pytest.raises(ValueError, match="rng"):
    make_args(p, s, None, b, True, True)
  extract = kfac_jax.optimizer.extract_func_outputs
  loss = jnp.asarray(1.5)
  assert extract(loss, False, False) == (loss, None, None)
  assert extract((loss, "aux"), True, False) == (loss, None, "aux")
  assert extract((loss, "st"), False, True) == (loss, "st", None)
  assert extract((loss, ("st", "aux")), True, True) == (loss, "st", "aux")
  with pytest.raises(TypeError, match="has_aux"):
    extract((loss, "aux"), False, False)


def test_value_and_grad_conversions():
  f = lambda w, x: (jnp.sum((w * x) ** 2), {"n": x.size})
  w, x = jnp.array([1.0, 2.0]), jnp.array([3.0, -1.0])
  vg = jax.value_and_grad(f, has_aux=True)
  value = kfac_jax.optimizer.convert_value_and_grad_to_value_func(vg, True)
  assert float(value(w, x)) == pytest.approx(9.0 + 4.0)
  clean = kfac_jax.optimizer.convert_value_and_grad_to_clean_value_and_grad(
    vg, has_aux=True
  )
  loss, grads = clean(w, x)
  assert float(loss) == pytest.approx(13.0)
  np.testing.assert_allclose(grads, 2 * w * x**2)
  plain = jax.value_and_grad(lambda w: jnp.sum(w**3))
  assert float(
    kfac_jax.optimizer.convert_value_and_grad_to_value_func(plain)(w)
  ) == pytest.approx(9.0)


# KFAC-JAX 0.0.8's constructor arguments that the optimizer lacked, with
# their defaults there.
NEW_ARGUMENTS = dict(
  regularized_parameters_path_exclusions="",
  value_func_for_estimator=None,
  use_initial_damping_calibration=False,
  precon_damping_mult=1.0,
  precon_damping_schedule=None,
  use_step_rejection=False,
  reject_damping_increase_factor=1.0,
  custom_estimator_ctor=None,
  curvature_update_period=1,
  use_automatic_registration=True,
  invalid_metric_value=math.nan,
  include_registered_loss_in_stats=False,
  num_estimator_samples=1,
  should_vmap_estimator_samples=False,
  norm_to_scale_identity_weight_per_block=None,
  precon_power=-1.0,
  exact_quad_model_matrix_type=None,
  estimation_mode=None,
)


def test_constructor_takes_the_arguments_with_their_defaults():
  params = inspect.signature(kfac_jax.Optimizer).parameters
  for name, default in NEW_ARGUMENTS.items():
    got = params[name].default
    if isinstance(default, float) and math.isnan(default):
      assert math.isnan(got), name
    else:
      assert got == default, name


# --- the preconditioner -----------------------------------------------------


def test_precon_power_minus_half_applies_the_inverse_square_root():
  problem = gt.mlp(loss="softmax")
  lr, damping = 0.3, 0.05
  opt = make(problem, precon_power=-0.5)
  new_params, _, _ = one_step(
    opt, problem, learning_rate=lr, momentum=0.0, damping=damping
  )
  curvature = block_ggn(problem)
  root = gt.numpy_psd_power(
    np.asarray(curvature) + (damping + L2) * np.eye(len(curvature)), -0.5
  )
  np.testing.assert_allclose(
    ravel(new_params) - ravel(problem.params),
    -lr * root @ grads_of(problem),
    rtol=1e-8,
    atol=1e-12,
  )


@pytest.mark.parametrize("kind", ["mult", "schedule"])
def test_preconditioner_damping_differs_from_the_damping(kind):
  problem = gt.mlp(loss="softmax")
  lr, damping, precon = 0.3, 0.05, 0.2
  options = (
    dict(precon_damping_mult=precon / damping)
    if kind == "mult"
    else dict(precon_damping_schedule=lambda step: precon)
  )
  opt = make(problem, **options)
  new_params, _, stats = one_step(
    opt, problem, learning_rate=lr, momentum=0.0, damping=damping
  )
  assert_preconditioned_step(
    problem, new_params, block_ggn(problem), precon, lr
  )
  assert float(stats["precon_damping"]) == pytest.approx(precon)
  assert float(stats["damping"]) == pytest.approx(damping)


def test_schedules_that_take_data_seen_get_the_examples_seen():
  """0.0.8 passes `data_seen=` to a schedule that names it."""
  problem = gt.mlp(loss="softmax")
  batch = problem.batch[0].shape[0]
  calls = []

  def learning_rate(step, data_seen):
    calls.append((int(step), int(data_seen)))
    return 0.3 / (1 + data_seen)

  opt = make(problem, learning_rate_schedule=learning_rate)
  params, state, rng = problem.params, None, jax.random.PRNGKey(0)
  state = opt.init(params, rng, problem.batch)
  for _ in range(3):
    new_params, state, stats = opt.step(
      params, state, rng, batch=problem.batch, momentum=0.0, damping=0.05
    )
    seen = calls[-1][1]
    assert float(stats["learning_rate"]) == pytest.approx(0.3 / (1 + seen))
    params = new_params
  assert calls == [(0, 0), (1, batch), (2, 2 * batch)]


def test_value_func_for_estimator_sets_the_curvature():
  """The estimator sees a loss registered with weight 2: twice the GGN
  preconditions the gradient of the training loss."""
  problem = gt.mlp(loss="softmax")

  def doubled(params, batch):
    x, t = batch
    z = kfac_jax.register_softmax_cross_entropy_loss(
      problem.tagged_forward(params, x), t, weight=2.0
    )
    return 2.0 * jnp.mean(jax.vmap(gt.softmax_cross_entropy)(z, t))

  lr, damping = 0.3, 0.05
  opt = make(problem, value_func_for_estimator=doubled)
  new_params, _, _ = one_step(
    opt, problem, learning_rate=lr, momentum=0.0, damping=damping
  )
  curvature = 2.0 * block_ggn(problem)
  assert_preconditioned_step(problem, new_params, curvature, damping, lr)


def test_norm_to_scale_identity_weight_per_block():
  """With 'avg_diag', block b is damped by (λ + l2) · trace(C_b) / dim_b."""
  problem = gt.mlp(loss="softmax")
  lr, damping = 0.3, 0.05
  opt = make(problem, norm_to_scale_identity_weight_per_block="avg_diag")
  new_params, _, _ = one_step(
    opt, problem, learning_rate=lr, momentum=0.0, damping=damping
  )
  curvature = np.asarray(block_ggn(problem))
  mask = gt.block_mask(problem, GROUPS)
  weights = np.zeros(len(curvature))
  for group in np.unique(mask, axis=0):
    idx = np.flatnonzero(group)
    block = curvature[np.ix_(idx, idx)]
    weights[idx] = (damping + L2) * np.trace(block) / len(idx)
  expected = -lr * np.linalg.solve(
    curvature + np.diag(weights), grads_of(problem)
  )
  np.testing.assert_allclose(
    ravel(new_params) - ravel(problem.params), expected, rtol=1e-8, atol=1e-12
  )
  with pytest.raises(ValueError, match="norm_to_scale_identity_weight"):
    make(
      problem,
      norm_to_scale_identity_weight_per_block="avg_diag",
      use_adaptive_damping=True,
      initial_damping=1.0,
    )


# --- the curvature estimate ---------------------------------------------------


def test_curvature_update_period_updates_every_kth_step():
  """Period 2: steps 0 and 2 fold their GGN into the moving average, step 1
  leaves it; after step 2 it is (ema · G_0 + G_2) / (ema + 1)."""
  problem = gt.mlp(loss="softmax")
  ema = 0.5
  opt = make(
    problem,
    curvature_update_period=2,
    inverse_update_period=2,
    curvature_ema=ema,
  )
  rng = jax.random.PRNGKey(0)
  params = problem.params
  state = opt.init(params, rng, problem.batch)
  mask = gt.block_mask(problem, GROUPS)
  seen, estimates = [], []
  for _step in range(3):
    seen.append(block_ggn(problem, params))
    params, state, _ = opt.step(
      params,
      state,
      rng,
      batch=problem.batch,
      learning_rate=0.5,
      momentum=0.0,
      damping=0.1,
    )
    estimates.append(opt.estimator.to_dense_matrix(state.estimator_state))
  estimates = [np.asarray(e) * mask for e in estimates]
  np.testing.assert_allclose(estimates[0], seen[0], rtol=1e-8, atol=1e-12)
  np.testing.assert_allclose(estimates[1], seen[0], rtol=1e-8, atol=1e-12)
  np.testing.assert_allclose(
    estimates[2], (ema * seen[0] + seen[2]) / (ema + 1), rtol=1e-8, atol=1e-12
  )
  assert not np.allclose(seen[0], seen[2])
  with pytest.raises(ValueError, match="inverse_update_period"):
    make(problem, curvature_update_period=3, inverse_update_period=2)


def test_num_estimator_samples_reach_the_estimator():
  problem = gt.mlp(loss="softmax")
  opt = make(
    problem,
    estimation_mode="fisher_gradients",
    num_estimator_samples=3,
    should_vmap_estimator_samples=True,
  )
  assert opt.estimator.num_samples == 3
  assert opt.estimator.should_vmap_samples
  # The first estimate is the estimator's own mean of three samples.
  rng = jax.random.PRNGKey(0)
  _, new_state, _ = one_step(
    opt, problem, learning_rate=0.1, momentum=0.0, damping=0.1
  )
  own = kfac_jax.BlockDiagonalCurvature(
    problem.tagged,
    default_estimation_mode="fisher_gradients",
    layer_tag_to_block_ctor=FULL,
    num_samples=3,
  )
  args = (problem.params, problem.batch)
  expected = own.update_curvature_matrix_estimate(
    own.init(rng, args), 0.95, 1.0, 6, rng, args
  )
  np.testing.assert_allclose(
    opt.estimator.to_dense_matrix(new_state.estimator_state),
    own.to_dense_matrix(expected),
    rtol=1e-10,
  )
  with pytest.raises(ValueError, match="num_estimator_samples"):
    make(problem, num_estimator_samples=-1)


def test_use_automatic_registration_false_keeps_only_hand_registrations():
  """The untagged network: the graph matcher finds its two dense layers;
  without it nothing tags them, which is refused by name. The hand-tagged
  network needs no matcher."""
  problem = gt.mlp(loss="softmax")

  def untagged(params, batch):
    x, t = batch
    z = kfac_jax.register_softmax_cross_entropy_loss(
      problem.forward(params, x), t
    )
    return jnp.mean(jax.vmap(gt.softmax_cross_entropy)(z, t))

  rng = jax.random.PRNGKey(0)

  def blocks(func, automatic):
    opt = make(
      problem,
      jax.value_and_grad(func),
      use_automatic_registration=automatic,
      layer_tag_to_block_ctor=None,
    )
    opt.init(problem.params, rng, problem.batch)
    return [type(b).__name__ for b in opt.estimator.blocks]

  kronecker = ["DenseTwoKroneckerFactored"] * 2
  assert blocks(untagged, True) == kronecker
  assert blocks(problem.tagged, False) == kronecker
  with pytest.raises(Exception, match="not in any layer tag"):
    blocks(untagged, False)


def test_custom_estimator_ctor():
  calls = []

  class Recording(kfac_jax.BlockDiagonalCurvature):
    def __init__(self, *args, **kwargs):
      calls.append(kwargs)
      super().__init__(*args, **kwargs)

  problem = gt.mlp(loss="softmax")
  opt = make(problem, custom_estimator_ctor=Recording)
  assert isinstance(opt.estimator, Recording)
  assert calls[0]["default_estimation_mode"] == "ggn_exact"
  with pytest.raises(ValueError, match="custom_estimator_ctor"):
    make(problem, custom_estimator_ctor=Recording, estimator_ctor=Recording)


# --- damping -------------------------------------------------------------------


def test_rejected_step_keeps_params_and_raises_the_damping():
  problem = gt.mlp(loss="softmax")
  opt = make(
    problem,
    use_step_rejection=True,
    reject_damping_increase_factor=3.0,
    use_adaptive_damping=True,
    initial_damping=0.5,
    damping_adaptation_interval=100,
    debug=False,
  )
  # A huge step overshoots: the loss goes up and the step is rejected.
  params, rejected, stats = one_step(
    opt, problem, learning_rate=50.0, momentum=0.0
  )
  assert bool(stats["step_rejected"])
  np.testing.assert_array_equal(ravel(params), ravel(problem.params))
  np.testing.assert_array_equal(ravel(rejected.velocities), 0.0)
  assert float(rejected.damping) == pytest.approx(1.5)
  assert int(rejected.step_counter) == 1
  # A small one lowers the loss and is taken; the damping stays.
  params, taken, stats = one_step(
    opt, problem, state=rejected, learning_rate=0.01, momentum=0.0
  )
  assert not bool(stats["step_rejected"])
  assert float(taken.damping) == pytest.approx(1.5)
  delta = ravel(params) - ravel(problem.params)
  np.testing.assert_allclose(ravel(taken.velocities), delta)
  assert float(problem.tagged(params, problem.batch)) < float(stats["loss"])


def test_damping_adapts_on_the_last_step_of_each_interval():
  problem = gt.mlp(loss="softmax")
  opt = make(
    problem,
    use_adaptive_damping=True,
    initial_damping=0.5,
    damping_adaptation_interval=3,
    invalid_metric_value=-7.0,
  )
  rng = jax.random.PRNGKey(0)
  params, state = problem.params, opt.init(problem.params, rng, problem.batch)
  dampings, rhos = [], []
  for _ in range(3):
    params, state, stats = opt.step(
      params,
      state,
      rng,
      batch=problem.batch,
      learning_rate=30.0,
      momentum=0.0,
    )
    dampings.append(float(state.damping))
    rhos.append(float(stats["rho"]))
  assert rhos[:2] == [-7.0, -7.0] and rhos[2] != -7.0
  assert float(stats["new_loss"]) == pytest.approx(
    float(problem.tagged(params, problem.batch))
  )
  # The overshooting steps make rho small: the damping grows by 0.9**-3.
  assert dampings == pytest.approx([0.5, 0.5, 0.5 / 0.9**3])


def test_initial_damping_calibration_settles_the_first_damping():
  """After calibration the first step's adaptation leaves the damping as it
  found it: its rho lies between the thresholds."""
  problem = gt.mlp(loss="softmax")
  kwargs = dict(
    use_adaptive_damping=True,
    initial_damping=100.0,
    damping_adaptation_interval=1,
    damping_adaptation_decay=0.5,
    num_burnin_steps=1,
  )
  hyper = dict(learning_rate=1.0, momentum=0.0)
  _, plain, _ = one_step(make(problem, **kwargs), problem, **hyper)
  assert float(plain.damping) != 100.0  # without: the first step moves it
  opt = make(problem, use_initial_damping_calibration=True, **kwargs)
  _, state, stats = one_step(opt, problem, **hyper)
  assert float(stats["damping"]) not in (100.0,)
  assert float(state.damping) == pytest.approx(float(stats["damping"]))
  assert 0.25 <= float(stats["rho"]) <= 0.75
  with pytest.raises(ValueError, match="num_burnin_steps"):
    make(problem, use_initial_damping_calibration=True, initial_damping=1.0)


# --- the quadratic model ------------------------------------------------------


def test_excluded_parameters_leave_the_l2_term_of_the_exact_model():
  """The adaptive learning rate minimises the exact model, whose L2 term
  counts only the weights when the biases are excluded."""
  problem = gt.mlp(loss="softmax")
  opt = make(
    problem,
    regularized_parameters_path_exclusions="b1,b2",
    use_adaptive_learning_rate=True,
    use_adaptive_damping=True,
    initial_damping=0.1,
  )
  new_params, new_state, stats = one_step(opt, problem, momentum=0.0)
  grads = grads_of(problem)
  precon = ravel(
    opt.estimator.multiply_inverse(
      new_state.estimator_state,
      jax.grad(problem.tagged)(problem.params, problem.batch),
      0.1 + L2,
      exact_power=True,
      use_cached=True,
    )
  )
  weights = ravel(
    {k: jnp.full_like(v, k[0] == "w") for k, v in problem.params.items()}
  )
  quad = (
    precon @ problem.ggn() @ precon
    + L2 * (precon * weights) @ precon
    + 0.1 * precon @ precon
  )
  lr = (grads @ precon) / quad
  assert float(stats["learning_rate"]) == pytest.approx(float(lr), rel=1e-8)
  np.testing.assert_allclose(
    ravel(new_params) - ravel(problem.params), -lr * precon, rtol=1e-8
  )
  vectors = [problem.params, jax.tree.map(jnp.ones_like, problem.params)]
  l2_matrix = opt.compute_l2_quad_matrix(vectors)
  flat = [ravel(v) * weights for v in vectors]
  np.testing.assert_allclose(
    l2_matrix, L2 * np.array([[a @ b for b in flat] for a in flat])
  )


def test_haiku_exclusions_mask_biases_and_norms():
  params = {
    "mlp/linear": {"w": jnp.ones(2), "b": jnp.ones(3)},
    "layer_norm": {"scale": jnp.ones(4), "offset": jnp.ones(5)},
  }
  names = kfac_jax.quad_model.parse_exclusions(
    kfac_jax.optimizer.HAIKU_BIASES_AND_NORMS
  )
  masked = kfac_jax.quad_model.mask_unregularized(params, names)
  assert float(ravel(masked).sum()) == 2.0
  biases = kfac_jax.quad_model.parse_exclusions(kfac_jax.optimizer.HAIKU_BIASES)
  masked = kfac_jax.quad_model.mask_unregularized(params, biases)
  assert float(ravel(masked).sum()) == 2.0 + 4.0 + 5.0
  assert kfac_jax.quad_model.parse_exclusions("") == ()


def test_exact_quad_model_matrix_type():
  problem = gt.mlp(loss="softmax")
  assert make(problem).exact_quad_model_matrix_type == "ggn"
  fisher_mode = make(problem, estimation_mode="fisher_gradients")
  assert fisher_mode.exact_quad_model_matrix_type == "fisher"
  chosen = make(
    problem,
    estimation_mode="fisher_gradients",
    exact_quad_model_matrix_type="ggn",
  )
  assert chosen.exact_quad_model_matrix_type == "ggn"
  vectors = [problem.params, jax.tree.map(jnp.ones_like, problem.params)]
  curv, _, _ = chosen.compute_exact_quad_model(
    vectors, problem.params, (problem.params, problem.batch)
  )
  flat = np.stack([ravel(v) for v in vectors])
  np.testing.assert_allclose(
    curv, flat @ problem.ggn() @ flat.T, rtol=1e-8, atol=1e-12
  )
  with pytest.raises(ValueError, match="exact_quad_model_matrix_type"):
    make(problem, exact_quad_model_matrix_type="hessian")


# --- statistics -----------------------------------------------------------------


def test_registered_loss_and_new_stats():
  problem = gt.mlp(loss="softmax")

  def with_l2(params, batch):
    return problem.tagged(params, batch) + L2 / 2 * jnp.sum(ravel(params) ** 2)

  lr, damping = 0.3, 0.05
  opt = make(
    problem,
    jax.value_and_grad(with_l2),
    include_registered_loss_in_stats=True,
    include_norms_in_stats=True,
    include_per_param_norms_in_stats=True,
    norm_constraint=1e6,
  )
  new_params, _, stats = one_step(
    opt, problem, learning_rate=lr, momentum=0.0, damping=damping
  )
  expected = float(with_l2(problem.params, problem.batch))
  assert float(stats["loss_registered"]) == pytest.approx(expected, rel=1e-10)
  assert abs(float(stats["loss_registered_reldiff"])) < 1e-10
  assert int(stats["batch_size"]) == 6
  assert math.isnan(float(stats["new_loss"]))
  assert math.isnan(float(stats["quad_model_change"]))
  curvature = block_ggn(problem)
  grads = ravel(jax.grad(with_l2)(problem.params, problem.batch))
  precon = np.linalg.solve(
    curvature + (damping + L2) * np.eye(len(curvature)), grads
  )
  assert float(stats["scaled_grad_norm_sq"]) == pytest.approx(
    float(lr**2 * grads @ precon), rel=1e-8
  )
  assert float(stats["param_norm"]) == pytest.approx(
    float(jnp.linalg.norm(ravel(new_params)))
  )
  assert float(stats["grad_norm(w1)"]) == pytest.approx(
    float(
      jnp.linalg.norm(jax.grad(with_l2)(problem.params, problem.batch)["w1"])
    )
  )


# --- the optax preconditioner ---------------------------------------------------


def test_optax_preconditioner_samples_sync_and_block_norms():
  problem = gt.mlp(loss="softmax")
  args = (problem.params, problem.batch)
  rng = jax.random.PRNGKey(0)
  precon = kfac_jax.OptaxPreconditioner(
    problem.tagged,
    damping=0.05,
    l2_reg=L2,
    estimation_mode="ggn_exact",
    layer_tag_to_block_ctor=FULL,
    use_exact_inverses=True,
    inverse_update_period=1,
    num_samples=2,
    should_vmap_samples=True,
    norm_to_scale_identity_weight_per_block="avg_diag",
  )
  assert precon.estimator.num_samples == 2
  state = precon.init(args, rng)
  # Without decay the second batch adds to the first: the same matrix.
  state = precon.maybe_update_estimator_curvature(state, args, rng, sync=True)
  state = precon.maybe_update_estimator_curvature(
    state, args, rng, decay_old_ema=jnp.asarray(False), sync=False
  )
  state = precon.maybe_update_inverse_cache(state)
  state = precon.sync_estimator_state(state)  # outside pmap: unchanged
  curvature = np.asarray(block_ggn(problem))
  np.testing.assert_allclose(
    precon.estimator.to_dense_matrix(state.estimator_state)
    * gt.block_mask(problem, GROUPS),
    curvature,
    rtol=1e-8,
    atol=1e-12,
  )
  weights = np.zeros(len(curvature))
  for group in np.unique(gt.block_mask(problem, GROUPS), axis=0):
    idx = np.flatnonzero(group)
    weights[idx] = (
      (0.05 + L2) * np.trace(curvature[np.ix_(idx, idx)]) / len(idx)
    )
  grads = jax.grad(problem.tagged)(*args)
  np.testing.assert_allclose(
    ravel(precon.apply(grads, state)),
    np.linalg.solve(curvature + np.diag(weights), ravel(grads)),
    rtol=1e-8,
  )
  assert precon.should_sync_estimate_curvature(state) is True
