"""Code written against KFAC-JAX's documented API runs on `estimators`.

Issue 20, gaps 4-7: module and type names, graph pattern names and options,
small signature differences, and the optax preconditioner.
"""

import dataclasses
import importlib
import typing

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import estimators as kfac_jax
from tests import groundtruth as gt

# --- gap 4: module and type names ----------------------------------------

ALIASES = {
  "curvature_blocks": (
    "DenseTwoKroneckerFactored",
    "CurvatureBlock",
    "ScaledIdentity",
    "set_max_parallel_elements",
  ),
  "curvature_estimator": (
    "BlockDiagonalCurvature",
    "CurvatureEstimator",
    "ExplicitExactCurvature",
    "ImplicitExactCurvature",
    "set_default_tag_to_block_ctor",
  ),
  "loss_functions": (
    "LossFunction",
    "NegativeLogProbLoss",
    "CategoricalLogitsNegativeLogProbLoss",
    "register_softmax_cross_entropy_loss",
  ),
  "layers_and_loss_tags": (
    "LayerTag",
    "LossTag",
    "register_dense",
    "register_scale_and_shift",
  ),
  "patches_second_moment": ("patches_moments", "patches_moments_explicit"),
  "tag_graph_matcher": (
    "auto_register_tags",
    "GraphPattern",
    "DEFAULT_GRAPH_PATTERNS",
  ),
}


@pytest.mark.parametrize("module", sorted(ALIASES))
def test_kfac_jax_module_names(module):
  imported = importlib.import_module(f"estimators.{module}")
  assert getattr(kfac_jax, module) is imported
  for name in ALIASES[module]:
    assert getattr(imported, name) is getattr(kfac_jax, name), name
  for name in getattr(imported, "__all__", ()):
    getattr(imported, name)  # every exported name resolves
  assert kfac_jax.layers_and_loss_tags.dense.name == "dense_tag"


def test_state_type_is_a_type_variable_for_generic_estimators():
  state_type = kfac_jax.curvature_estimator.StateType
  assert isinstance(state_type, typing.TypeVar)
  assert kfac_jax.utils.StateType is state_type

  class Holder(typing.Generic[state_type]):  # as a generic estimator is
    def __init__(self, state: state_type):
      self.state = state

  assert Holder[int](3).state == 3


def test_utils_types_and_helpers():
  u = kfac_jax.utils
  for name in (
    "Array",
    "Shape",
    "PyTree",
    "PRNGKey",
    "Params",
    "Batch",
    "FuncArgs",
    "Numeric",
    "Scalar",
    "PyTreeDef",
    "DType",
    "Func",
  ):
    assert name in u.__all__ and getattr(u, name) is not None, name
  assert u.PyTree[jax.Array] is not None  # annotations like PyTree[Var]
  assert u.default_batch_size_extractor is kfac_jax.default_batch_size_extractor
  assert u.default_batch_size_extractor(({"x": np.ones((5, 2))},)) == 5

  x, dy = np.ones((4, 3)), np.ones((4, 2))
  assert u.first_dim_is_size(4, x, dy)
  assert not u.first_dim_is_size(3, x, dy)
  assert not u.first_dim_is_size(4, x, np.ones(()))

  rng = np.random.default_rng(0)
  a = {"w": rng.normal(size=(3, 2)), "b": [rng.normal(size=(2,))]}
  b = jax.tree.map(lambda v: rng.normal(size=v.shape), a)
  flat = lambda t: jax.flatten_util.ravel_pytree(t)[0]
  np.testing.assert_allclose(u.inner_product(a, b), flat(a) @ flat(b))
  np.testing.assert_allclose(u.norm(a), np.linalg.norm(flat(a)))
  np.testing.assert_allclose(u.squared_norm(a), flat(a) @ flat(a))
  np.testing.assert_allclose(flat(u.scalar_mul(a, 3.0)), 3 * flat(a))
  np.testing.assert_allclose(flat(u.scalar_div(a, 2.0)), flat(a) / 2)
  np.testing.assert_allclose(
    flat(u.weighted_sum_of_objects([a, b], [2.0, -1.0])), 2 * flat(a) - flat(b)
  )
  assert jax.tree.structure(u.scalar_mul(a, 2.0)) == jax.tree.structure(a)


def test_reductions_act_only_inside_a_mapped_axis():
  u = kfac_jax.utils
  x = jnp.arange(2.0)
  assert not u.in_pmap("kfac_axis") and not u.in_pmap(None)
  assert u.pmean_if_pmap(x, "kfac_axis") is x
  assert u.psum_if_pmap(x, None) is x

  def per_device(v):
    inside = u.in_pmap("kfac_axis") and not u.in_pmap("other_axis")
    return (
      u.pmean_if_pmap(v, "kfac_axis"),
      u.psum_if_pmap(v, "kfac_axis"),
      u.pmean_if_pmap(v, "other_axis"),
      jnp.asarray(inside),
    )

  mean, total, untouched, inside = jax.pmap(per_device, axis_name="kfac_axis")(
    x
  )
  np.testing.assert_allclose(mean, [0.5, 0.5])
  np.testing.assert_allclose(total, [1.0, 1.0])
  np.testing.assert_allclose(untouched, x)
  assert bool(np.all(inside))


# --- gap 5: graph patterns -----------------------------------------------


def _dense_model(x, t):
  def loss_fn(p, batch):
    x, t = batch
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    z = kfac_jax.register_softmax_cross_entropy_loss(h @ p["w2"], t)
    return jnp.mean(jax.vmap(gt.softmax_cross_entropy)(z, t))

  rng = np.random.default_rng(1)
  params = {
    "b1": rng.normal(size=(4,)),
    "w1": rng.normal(size=(3, 4)),
    "w2": rng.normal(size=(4, 3)),
  }
  return loss_fn, params, (x, t)


def test_patterns_to_skip_and_graph_patterns_through_estimator_and_optimizer():
  x, t = np.random.default_rng(0).normal(size=(6, 3)), np.arange(6) % 3
  loss_fn, params, batch = _dense_model(x, t)
  rng = jax.random.PRNGKey(0)

  def block_tags(**kwargs):
    est = kfac_jax.BlockDiagonalCurvature(loss_fn, **kwargs)
    est.init(rng, (params, batch), None, None)
    return sorted(type(b).__name__ for b in est.blocks)

  assert block_tags() == ["DenseTwoKroneckerFactored"] * 2
  # Without the biased dense pattern, the bias becomes a scale-and-shift.
  assert block_tags(patterns_to_skip=("dense_with_bias",)) == [
    "DenseTwoKroneckerFactored",
    "DenseTwoKroneckerFactored",
    "ScaleAndShiftDiagonal",
  ]
  # graph_patterns is the whole list: only the bias-free dense pattern here.
  no_bias = [
    p for p in kfac_jax.DEFAULT_GRAPH_PATTERNS if p.name == "dense_no_bias"
  ]
  assert block_tags(graph_patterns=no_bias) == [
    "DenseTwoKroneckerFactored",
    "DenseTwoKroneckerFactored",
    "NaiveDiagonal",
  ]
  with pytest.raises(
    ValueError,
    match=r"unknown graph patterns \['dense'\]"
    r".*'dense_with_bias'.*'shift_only_broadcast_1'",
  ):
    block_tags(patterns_to_skip=("dense",))

  def optimizer(skip):
    return kfac_jax.Optimizer(
      jax.value_and_grad(loss_fn),
      l2_reg=0.0,
      patterns_to_skip=skip,
      learning_rate_schedule=lambda s: 0.1,
      momentum_schedule=lambda s: 0.0,
      damping_schedule=lambda s: 1.0,
      num_burnin_steps=0,
    )

  state = optimizer(("dense_with_bias",)).init(params, rng, batch)
  assert len(state.estimator_state.blocks_states) == 3
  with pytest.raises(ValueError, match=r"unknown graph patterns \['nope'\]"):
    optimizer(("nope",)).init(params, rng, batch)


def test_internals_guide_graph_pattern_in_the_optimizer():
  # The guide's custom dense pattern, placed before the defaults.
  def dense(x, params):
    w, *maybe_b = params
    y = jnp.matmul(x, w)
    return y + maybe_b[0] if maybe_b else y

  def dot_general_params(eqns):
    return next(
      dict(e.params) for e in eqns if e.primitive.name == "dot_general"
    )

  pattern = kfac_jax.GraphPattern(
    name="dense_with_bias",
    tag_primitive=kfac_jax.layers_and_loss_tags.dense,
    precedence=0,
    compute_func=dense,
    parameters_extractor_func=dot_general_params,
    example_args=[np.zeros([11, 13]), [np.zeros([13, 7]), np.zeros([7])]],
  )
  x, t = np.random.default_rng(0).normal(size=(6, 3)), np.arange(6) % 3
  loss_fn, params, batch = _dense_model(x, t)
  opt = kfac_jax.Optimizer(
    jax.value_and_grad(loss_fn),
    l2_reg=0.0,
    auto_register_kwargs=dict(
      graph_patterns=(
        (pattern,) + kfac_jax.tag_graph_matcher.DEFAULT_GRAPH_PATTERNS
      )
    ),
    learning_rate_schedule=lambda s: 0.1,
    momentum_schedule=lambda s: 0.0,
    damping_schedule=lambda s: 1.0,
    num_burnin_steps=0,
  )
  rng = jax.random.PRNGKey(0)
  state = opt.init(params, rng, batch)
  new_params, _, stats = opt.step(
    params, state, rng, batch=batch, global_step_int=0
  )
  assert np.isfinite(stats["loss"])
  assert not np.allclose(new_params["w1"], params["w1"])
  blocks = opt.estimator.blocks
  assert [type(b).__name__ for b in blocks] == ["DenseTwoKroneckerFactored"] * 2
  # The custom pattern (with its extractor) took the biased layer, the
  # default bias-free pattern the other.
  assert ["dimension_numbers" in b.layer_tag_extra_params for b in blocks] == [
    True,
    False,
  ]


# --- gap 6: signatures and orders -----------------------------------------


def test_register_scale_and_shift_takes_x_by_keyword():
  def tagged(p, x):
    y = x * p["s"] + p["t"]
    y = kfac_jax.register_scale_and_shift(y, x=x, scale=p["s"], shift=p["t"])
    return kfac_jax.register_scale_and_shift(y * p["s"], y, p["s"])

  p, x = {"s": jnp.ones(3), "t": jnp.zeros(3)}, jnp.ones((2, 3))
  eqns = [
    e
    for e in jax.make_jaxpr(tagged)(p, x).eqns
    if e.primitive is kfac_jax.layers_and_loss_tags.scale_and_shift
  ]
  assert [(e.params["has_scale"], e.params["has_shift"]) for e in eqns] == [
    (True, True),
    (True, False),
  ]
  assert [len(e.invars) for e in eqns] == [4, 3]


def test_parameters_canonical_order_follows_the_flattened_parameters():
  # Haiku-style names: "b" flattens before "w", while the tag is (w, b).
  x, t = np.random.default_rng(0).normal(size=(6, 3)), np.arange(6) % 3
  loss_fn, params, batch = _dense_model(x, t)
  proc = kfac_jax.ProcessedJaxpr.make_from_func(loss_fn, (params, batch))
  leaves = jax.tree.leaves(params)
  orders = []
  for eqn, indices in zip(proc.layer_tags, proc.layer_indices):
    block = kfac_jax.DenseTwoKroneckerFactored(eqn, "dense")
    assert block.parameters_canonical_order == tuple(range(len(indices)))
    block.set_parameter_positions(indices)  # what the estimator knows
    order = block.parameters_canonical_order
    operands = [leaves[i] for i in indices]  # a block vector
    assert [operands[k].shape for k in order] == [
      leaves[i].shape for i in sorted(indices)
    ]
    orders.append(order)
  assert orders == [(1, 0), (0,)]
  with pytest.raises(ValueError, match="2 distinct parameter positions"):
    block = kfac_jax.DenseTwoKroneckerFactored(proc.layer_tags[0], "dense")
    block.set_parameter_positions((0, 0))


# --- gap 7: the optax preconditioner --------------------------------------


def _softmax_regression(seed, batch=8, d_in=3, k=3):
  """A one-layer model: one dense block, so its GGN is the exact one."""
  rng = np.random.default_rng(seed)
  params = {
    "b": 0.3 * rng.normal(size=(k,)),
    "w": 0.5 * rng.normal(size=(d_in, k)),
  }

  def forward(p, x):
    return x @ p["w"] + p["b"]

  def loss_fn(p, batch):
    x, t = batch
    z = kfac_jax.register_softmax_cross_entropy_loss(forward(p, x), t)
    return jnp.mean(jax.vmap(gt.softmax_cross_entropy)(z, t))

  def batch_at(step):
    r = np.random.default_rng(100 + step)
    return r.normal(size=(batch, d_in)), r.integers(0, k, size=batch)

  return forward, loss_fn, params, batch_at


def _changed(before, after):
  return not all(
    np.array_equal(a, b)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after))
  )


def test_optax_preconditioner_direction_is_the_damped_inverse_ggn():
  forward, loss_fn, params, batch_at = _softmax_regression(seed=0)
  damping, l2_reg, ema, lr = 0.3, 0.05, 0.8, 0.5
  precon = kfac_jax.OptaxPreconditioner(
    loss_fn,
    l2_reg=l2_reg,
    damping=damping,
    estimation_mode="ggn_exact",
    curvature_ema=ema,
    curvature_update_period=2,
    inverse_update_period=3,
    layer_tag_to_block_ctor={"dense_tag": kfac_jax.DenseFull},
  )
  transform = precon.as_gradient_transform()
  tx = optax.chain(transform, optax.sgd(lr))
  rng = jax.random.PRNGKey(0)
  state = precon.init((params, batch_at(0)), rng)
  opt_state = tx.init(params)

  @jax.jit
  def step(params, state, opt_state, batch, rng):
    grads = jax.grad(loss_fn)(params, batch)
    state = precon.maybe_update(state, (params, batch), rng)
    direction, _ = transform.update(
      grads, optax.EmptyState(), params, precond_state=state
    )
    updates, opt_state = tx.update(
      grads, opt_state, params, precond_state=state
    )
    return (
      optax.apply_updates(params, updates),
      precon.increment_count(state),
      opt_state,
      grads,
      direction,
      state,
    )

  flat_of = lambda t: jax.flatten_util.ravel_pytree(t)[0]
  raw, weight, cached = 0.0, 0.0, None
  refreshes = {"curvature": 0, "inverse": 0}
  for n in range(7):
    batch = batch_at(n)
    ggn = gt.Problem(
      loss_fn, forward, gt.softmax_cross_entropy, params, batch
    ).ggn()
    before = state.estimator_state.blocks_states[0]
    new_params, state, opt_state, grads, direction, updated = step(
      params, state, opt_state, batch, jax.random.fold_in(rng, n)
    )
    after = updated.estimator_state.blocks_states[0]
    refreshes["curvature"] += _changed(
      dataclasses.replace(before, cache={}),
      dataclasses.replace(after, cache={}),
    )
    refreshes["inverse"] += _changed(before.cache, after.cache)
    # Brute force: the estimate averages the GGNs of the update steps with
    # weights ema^age; the inverse is taken on refresh steps.
    if n % 2 == 0:
      raw, weight = ema * raw + ggn, ema * weight + 1.0
    if n % 3 == 0:
      cached = raw / weight
    expected = np.linalg.solve(
      cached + (damping + l2_reg) * np.eye(len(cached)), flat_of(grads)
    )
    np.testing.assert_allclose(
      flat_of(direction), expected, rtol=1e-9, atol=1e-12
    )
    np.testing.assert_allclose(
      flat_of(new_params), flat_of(params) - lr * expected, rtol=1e-9
    )
    params = new_params
  assert refreshes == {"curvature": 4, "inverse": 3}  # steps 0,2,4,6 / 0,3,6
  assert int(state.count) == 7


def test_optax_preconditioner_under_pmap_uses_the_whole_batch():
  # Two devices with half a batch each; the statistics are averaged, so the
  # direction is that of the whole batch. Also covers use_sqrt_inv.
  forward, loss_fn, params, batch_at = _softmax_regression(seed=2)
  batch, damping = batch_at(0), 0.2
  precon = kfac_jax.OptaxPreconditioner(
    loss_fn,
    damping=damping,
    estimation_mode="ggn_exact",
    use_sqrt_inv=True,
    layer_tag_to_block_ctor={"dense_tag": kfac_jax.DenseFull},
  )
  rng = jax.random.PRNGKey(0)
  state = precon.init((params, batch), rng)

  def direction(state, params, batch, rng):
    state = precon.maybe_update(state, (params, batch), rng)
    grads = jax.lax.pmean(jax.grad(loss_fn)(params, batch), "kfac_axis")
    return precon.apply(grads, state)

  def twice(tree):
    return jax.tree.map(lambda a: jnp.stack([a, a]), tree)

  halves = jax.tree.map(lambda a: a.reshape((2, -1) + a.shape[1:]), batch)
  out = jax.pmap(direction, axis_name="kfac_axis")(
    twice(state), twice(params), halves, jnp.stack([rng, rng])
  )
  ggn = gt.Problem(
    loss_fn, forward, gt.softmax_cross_entropy, params, batch
  ).ggn()
  values, vectors = np.linalg.eigh(ggn + damping * np.eye(len(ggn)))
  flat_grads = jax.flatten_util.ravel_pytree(jax.grad(loss_fn)(params, batch))[
    0
  ]
  expected = vectors @ ((vectors.T @ flat_grads) / np.sqrt(values))
  for device in range(2):
    got = jax.flatten_util.ravel_pytree(
      jax.tree.map(lambda a, d=device: a[d], out)
    )[0]
    np.testing.assert_allclose(got, expected, rtol=1e-9)


def test_optax_preconditioner_chained_with_sgd_trains_an_mlp():
  problem = gt.mlp(batch=32, d_in=4, hidden=8, k=3, seed=1)
  precon = kfac_jax.OptaxPreconditioner(
    problem.tagged,
    damping=1e-2,
    inverse_update_period=2,
    estimation_mode="ggn_curvature_prop",
  )
  tx = optax.chain(precon.as_gradient_transform(), optax.sgd(0.3))
  rng = jax.random.PRNGKey(3)
  params, batch = problem.params, problem.batch
  state = precon.init((params, batch), rng)
  opt_state = tx.init(params)

  @jax.jit
  def step(params, state, opt_state, rng):
    loss, grads = jax.value_and_grad(problem.tagged)(params, batch)
    state = precon.maybe_update(state, (params, batch), rng)
    updates, opt_state = tx.update(
      grads, opt_state, params, precond_state=state
    )
    return (
      optax.apply_updates(params, updates),
      precon.increment_count(state),
      opt_state,
      loss,
    )

  losses = []
  for n in range(20):
    params, state, opt_state, loss = step(
      params, state, opt_state, jax.random.fold_in(rng, n)
    )
    losses.append(float(loss))
  assert np.all(np.diff(losses) < 0)  # plain SGD at this rate: 1.19 -> 0.87
  assert losses[-1] < 0.5 * losses[0]


def test_optax_preconditioner_norm_constraint_scales_the_direction():
  _, loss_fn, params, batch_at = _softmax_regression(seed=3)
  batch, rng = batch_at(0), jax.random.PRNGKey(0)
  grads = jax.grad(loss_fn)(params, batch)

  def direction(norm_constraint):
    precon = kfac_jax.OptaxPreconditioner(
      loss_fn,
      0.0,
      0.5,
      None,
      norm_constraint,  # KFAC-JAX's order
      estimation_mode="ggn_exact",
      layer_tag_to_block_ctor={"dense_tag": kfac_jax.DenseFull},
    )
    state = precon.maybe_update(
      precon.init((params, batch), rng), (params, batch), rng
    )
    return precon.apply(grads, state)

  free = direction(None)
  sq_norm = kfac_jax.utils.inner_product(free, grads)
  flat = lambda t: jax.flatten_util.ravel_pytree(t)[0]
  np.testing.assert_allclose(
    flat(direction(sq_norm / 4)), flat(free) / 2, rtol=1e-10
  )
  np.testing.assert_allclose(flat(direction(sq_norm * 4)), flat(free))


def test_optax_preconditioner_arguments_are_checked():
  _, loss_fn, params, batch_at = _softmax_regression(seed=0)
  with pytest.raises(ValueError, match="exactly one of damping"):
    kfac_jax.OptaxPreconditioner(loss_fn)
  with pytest.raises(ValueError, match="exactly one of damping"):
    kfac_jax.OptaxPreconditioner(
      loss_fn, damping=1.0, damping_schedule=lambda c: 1.0
    )
  with pytest.raises(ValueError, match="inverse_update_period"):
    kfac_jax.OptaxPreconditioner(loss_fn, damping=1.0, inverse_update_period=0)
  precon = kfac_jax.OptaxPreconditioner(
    loss_fn, damping_schedule=lambda count: 1.0 / (1.0 + count)
  )
  state = precon.init((params, batch_at(0)), jax.random.PRNGKey(0))
  assert isinstance(state, kfac_jax.OptaxPreconditionState)
  count, _ = state  # a named tuple, as KFAC-JAX's
  assert int(count) == 0
  later = precon.increment_count(precon.increment_count(state))
  np.testing.assert_allclose(precon.get_identity_weight(later), 1.0 / 3)
  with pytest.raises(ValueError, match="precond_state"):
    precon.as_gradient_transform().update(params, optax.EmptyState(), params)


# --- gap 2: state shapes stable across estimation modes ------------------

ESTIMATORS = {
  "block_diagonal": kfac_jax.BlockDiagonalCurvature,
  "block_tridiagonal": kfac_jax.BlockTridiagonalCurvature,
  "explicit_exact": kfac_jax.ExplicitExactCurvature,
}


def _exact_target(name, problem, mode):
  """What the mean of many `mode` updates converges to: the estimator's own
  estimate in the exact mode of the same matrix (for the explicit estimator,
  the brute-force matrix)."""
  if name == "explicit_exact":
    return (
      problem.empirical_fisher()
      if mode == "fisher_empirical"
      else problem.ggn()
    )
  exact = "fisher_empirical" if mode == "fisher_empirical" else "ggn_exact"
  est = ESTIMATORS[name](problem.tagged, default_estimation_mode=exact)
  args = (problem.params, problem.batch)
  state = est.init(jax.random.PRNGKey(0), args)
  state = est.update_curvature_matrix_estimate(
    state, 0.0, 1.0, 6, jax.random.PRNGKey(0), args
  )
  return est.to_dense_matrix(state)


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_a_thousand_sampled_updates_in_a_fori_loop_converge(name):
  """A jitted `fori_loop` carries the state through 1,000 updates in every
  estimation mode (the state's shapes do not depend on the mode), and the
  running mean converges to the exact matrix: its relative error is within
  a few standard errors of a mean of 1,000 draws."""
  problem = gt.mlp(loss="softmax", batch=6, d_in=3, hidden=4, k=3)
  args = (problem.params, problem.batch)
  # Initialised in one mode, updated in all: the carry must keep its shape.
  est = ESTIMATORS[name](problem.tagged, default_estimation_mode="ggn_exact")
  init = est.init(jax.random.PRNGKey(0), args)
  for mode in kfac_jax.ESTIMATION_MODES:

    def body(i, state, mode=mode):
      return est.update_curvature_matrix_estimate(
        state,
        1.0,
        1.0,
        6,
        jax.random.fold_in(jax.random.PRNGKey(1), i),
        args,
        estimation_mode=mode,
      )

    mean = jax.jit(lambda s: jax.lax.fori_loop(0, 1000, body, s))(init)
    assert jax.tree.structure(mean) == jax.tree.structure(init)
    assert [x.shape for x in jax.tree.leaves(mean)] == [
      x.shape for x in jax.tree.leaves(init)
    ]
    got = np.asarray(est.to_dense_matrix(mean))
    want = np.asarray(_exact_target(name, problem, mode))
    error = np.linalg.norm(got - want) / np.linalg.norm(want)
    # One draw's relative error is O(1); 1,000 draws bring it to ~0.03.
    tolerance = 1e-9 if mode.endswith(("exact", "empirical")) else 0.12
    assert error < tolerance, (mode, error)


# --- gap 3: the estimator class hierarchy ---------------------------------


def test_explicit_exact_is_a_block_diagonal_estimator_with_one_block():
  problem = gt.mlp(loss="softmax", batch=5, d_in=3, hidden=4, k=3)
  args = (problem.params, problem.batch)
  est = kfac_jax.ExplicitExactCurvature(
    problem.tagged, default_estimation_mode="fisher_exact"
  )
  assert isinstance(est, kfac_jax.BlockDiagonalCurvature)
  state = est.init(jax.random.PRNGKey(0), args)
  assert isinstance(state, kfac_jax.BlockDiagonalCurvature.State)
  dim = problem.flat_params[0].size
  assert est.num_blocks == 1 and est.block_dims == (dim,)
  assert type(est.blocks[0]) is kfac_jax.ExplicitFull
  assert list(est.indices_to_block_map) == [tuple(range(4))]
  assert jax.tree.leaves(est.params_block_index) == [0] * 4
  state = est.update_curvature_matrix_estimate(
    state, 0.0, 1.0, 5, jax.random.PRNGKey(0), args
  )
  np.testing.assert_allclose(
    est.block_eigenvalues(state)[0],
    np.linalg.eigvalsh(problem.ggn()),
    atol=1e-10,
  )
  # batch_size is used: the rows of 5 examples averaged over 10.
  half = est.update_curvature_matrix_estimate(
    state, 0.0, 1.0, 10, jax.random.PRNGKey(0), args
  )
  np.testing.assert_allclose(
    est.to_dense_matrix(half), problem.ggn() / 2, rtol=1e-9, atol=1e-12
  )


def test_explicit_exact_takes_another_block_for_all_parameters():
  """`layer_tag_to_block_ctor` picks the block of all parameters: the exact
  diagonal from per-example gradients; unknown graph patterns are refused."""
  problem = gt.mlp(loss="softmax", batch=5, d_in=3, hidden=4, k=3)
  args = (problem.params, problem.batch)
  est = kfac_jax.ExplicitExactCurvature(
    problem.tagged,
    default_estimation_mode="ggn_exact",
    layer_tag_to_block_ctor={"generic_tag": kfac_jax.NaiveDiagonal},
  )
  state = est.init(jax.random.PRNGKey(0), args)
  state = est.update_curvature_matrix_estimate(
    state, 0.0, 1.0, 5, jax.random.PRNGKey(0), args
  )
  assert type(est.blocks[0]) is kfac_jax.NaiveDiagonal
  np.testing.assert_allclose(
    np.diag(est.to_dense_matrix(state)),
    np.diag(problem.ggn()),
    rtol=1e-9,
    atol=1e-12,
  )
  with pytest.raises(ValueError, match="unknown graph patterns"):
    kfac_jax.ExplicitExactCurvature(problem.tagged, patterns_to_skip=("x",))


def test_an_estimator_written_to_the_documented_interface_instantiates():
  class Minimal(kfac_jax.CurvatureEstimator):
    dim = 1

    def init(
      self,
      rng,
      func_args,
      exact_powers_to_cache,
      approx_powers_to_cache,
      cache_eigenvalues=False,
    ):
      return 0

    def update_curvature_matrix_estimate(self, *args, **kwargs):
      return 0

    def update_cache(self, *args, **kwargs):
      return 0

    def multiply_matpower(self, *args, **kwargs):
      return 0

    def eigenvalues(self, state, use_cached=False):
      return jnp.zeros(1)

  est = Minimal(lambda p, b: 0.0)
  with pytest.raises(NotImplementedError, match="Minimal does not provide"):
    est.to_dense_matrix(0)


# --- gap 6: the estimator's side -------------------------------------------


def test_default_mat_type_names_the_matrix_kind():
  kinds = {
    mode: kfac_jax.BlockDiagonalCurvature(
      lambda p, b: 0.0, default_estimation_mode=mode
    ).default_mat_type
    for mode in kfac_jax.ESTIMATION_MODES
  }
  assert kinds == {m: m.split("_")[0] for m in kfac_jax.ESTIMATION_MODES}
  assert kinds["fisher_empirical"] == "fisher"


def test_estimator_blocks_know_their_canonical_order():
  x, t = np.random.default_rng(0).normal(size=(6, 3)), np.arange(6) % 3
  loss_fn, params, batch = _dense_model(x, t)
  est = kfac_jax.BlockDiagonalCurvature(loss_fn)
  est.init(jax.random.PRNGKey(0), (params, batch))
  assert [b.parameters_canonical_order for b in est.blocks] == [(1, 0), (0,)]


def test_optimizer_init_twice_and_burnin_advances_keys_and_state():
  """Under multi_device, each burn-in batch gets its own key on each device,
  and the function's state advances once per batch."""
  problem = gt.mlp(loss="softmax", batch=8, d_in=3, hidden=4, k=3)

  def value(params, func_state, rng, batch):
    count, keys = func_state
    keys = keys.at[count].set(jax.random.uniform(rng))
    return problem.tagged(params, batch), (count + 1, keys)

  opt = kfac_jax.Optimizer(
    jax.value_and_grad(value, has_aux=True),
    l2_reg=0.0,
    value_func_has_state=True,
    value_func_has_rng=True,
    learning_rate_schedule=lambda s: 0.1,
    momentum_schedule=lambda s: 0.0,
    damping_schedule=lambda s: 1.0,
    num_burnin_steps=3,
    multi_device=True,
  )
  twice = lambda t: jax.tree.map(lambda x: jnp.stack([x, x]), t)
  params = twice(problem.params)
  rngs = jnp.stack([jax.random.PRNGKey(0), jax.random.PRNGKey(1)])
  batch = jax.tree.map(lambda x: x.reshape((2, 4) + x.shape[1:]), problem.batch)
  func_state = twice((jnp.zeros((), jnp.int32), jnp.zeros(3)))
  opt.init(params, rngs, batch, func_state)
  state = opt.init(params, rngs, batch, func_state)  # a second init works
  _, func_state = opt.burnin(
    3, params, state, rngs, iter([batch] * 3), func_state
  )
  count, keys = func_state
  assert np.asarray(count).tolist() == [3, 3]
  keys = np.asarray(keys)
  assert len(np.unique(keys)) == 6  # distinct per step and per device


# --- gap 8: newer callers ---------------------------------------------------


def test_identity_weight_is_accepted_and_sync_averages_across_devices():
  problem = gt.mlp(loss="softmax", batch=8, d_in=3, hidden=4, k=3)
  est = kfac_jax.BlockDiagonalCurvature(
    problem.tagged, default_estimation_mode="ggn_exact"
  )
  args = (problem.params, problem.batch)
  state = est.init(jax.random.PRNGKey(0), args)
  full = est.update_curvature_matrix_estimate(
    state, 0.0, 1.0, 8, jax.random.PRNGKey(0), args, identity_weight=0.1
  )
  halves = jax.tree.map(
    lambda x: x.reshape((2, 4) + x.shape[1:]), problem.batch
  )

  def per_device(batch):  # no axis at the update: each device its own half
    local = est.update_curvature_matrix_estimate(
      state, 0.0, 1.0, 4, jax.random.PRNGKey(0), (problem.params, batch)
    )
    return local, est.sync(local, "i")

  local, synced = jax.pmap(per_device, axis_name="i")(halves)
  dense = lambda s, d: est.to_dense_matrix(jax.tree.map(lambda x: x[d], s))
  assert not np.allclose(dense(local, 0), dense(local, 1))
  for device in range(2):
    np.testing.assert_allclose(
      dense(synced, device), est.to_dense_matrix(full), rtol=1e-10
    )
  assert est.sync(state, None) is state
