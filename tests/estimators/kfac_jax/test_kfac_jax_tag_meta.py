"""KFAC-JAX 0.0.8's tag metadata in `estimators.layers_and_loss_tags`.

Every tag equation carries a `LayerMetaData` or `LossMetaData`; 0.0.8's
class-agnostic `layer_tag` and `loss_tag` bind through our per-kind tags.
Models registered the 0.0.8 way are checked, in float64, against brute-force
GGNs and against the same models registered our way.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import estimators as kfac_jax
from estimators import layers_and_loss_tags as tags
from estimators import losses
from tests import groundtruth

RNG = jax.random.PRNGKey(0)


def _eqns(fn, *args):
  return jax.make_jaxpr(fn)(*args).eqns


def _dense_meta(num_params, variant="dense"):
  return tags.LayerMetaData(
    variant=variant,
    outputs_index=(0,),
    inputs_index=(1,),
    params_index=tuple(range(2, 2 + num_params)),
  )


PARAMS = {
  "w": jnp.arange(6.0).reshape(3, 2) / 7,
  "b": jnp.array([0.5, -0.25]),
}
X = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)


@pytest.mark.parametrize(
  "register, variant, roles",
  [
    (
      lambda p, x: tags.register_dense(x @ p["w"], x, p["w"]),
      "dense",
      (1, 1, 1),
    ),
    (
      lambda p, x: tags.register_dense(x @ p["w"] + p["b"], x, p["w"], p["b"]),
      "dense",
      (1, 1, 2),
    ),
    (
      lambda p, x: tags.register_repeated_dense(
        x[:, None] @ p["w"], x[:, None], p["w"]
      ),
      "repeated_dense",
      (1, 1, 1),
    ),
    (
      lambda p, x: tags.register_scale_and_shift(x * 2.0, x, p["b"][0]),
      "scale_and_shift",
      (1, 1, 1),
    ),
    (
      lambda p, x: tags.register_generic(p["w"], p["b"])[0],
      "generic",
      (2, 0, 2),
    ),
  ],
)
def test_every_registration_carries_its_layer_meta(register, variant, roles):
  [eqn] = [
    e for e in _eqns(register, PARAMS, X) if tags.LayerTag is type(e.primitive)
  ]
  meta = eqn.params["meta"]
  assert isinstance(meta, tags.LayerMetaData)
  assert meta.variant == variant == eqn.primitive.variant
  data = tags.layer_eqn_data(eqn)
  n_out, n_in, n_params = roles
  assert (len(data.outputs), len(data.inputs), len(data.params)) == roles
  outs, ins, params = eqn.primitive.split_operands(eqn.invars)
  assert data.inputs == ins and data.params == params
  # A tag without outputs (generic) returns its parameters.
  assert data.outputs == (outs if outs else params)
  assert n_out == len(data.outputs) and n_in == len(ins)
  hash(meta)  # a static jaxpr parameter must be hashable


def test_layer_data_is_a_pytree():
  data = tags.LayerData(inputs=(1.0,), outputs=(2.0,), params=(3.0, 4.0))
  leaves, tree = jax.tree.flatten(data)
  assert leaves == [1.0, 2.0, 3.0, 4.0]
  doubled = jax.tree.map(lambda v: 2 * v, data)
  assert doubled == tags.LayerData(
    inputs=(2.0,), outputs=(4.0,), params=(6.0, 8.0)
  )
  assert jax.tree.unflatten(tree, leaves) == data


def test_layer_tag_binds_through_the_variants_tag_in_any_operand_order():
  def ours(p, x):
    return tags.register_dense(x @ p["w"] + p["b"], x, p["w"], p["b"])

  def theirs(p, x):
    y = x @ p["w"] + p["b"]
    # Parameters first, then the output, then the input.
    return tags.layer_tag.bind(
      p["w"],
      p["b"],
      y,
      x,
      meta=tags.LayerMetaData(
        variant="dense",
        outputs_index=(2,),
        inputs_index=(3,),
        params_index=(0, 1),
      ),
    )

  a, b = _eqns(ours, PARAMS, X)[-1], _eqns(theirs, PARAMS, X)[-1]
  assert a.primitive is b.primitive is tags.dense
  assert a.params == b.params
  assert [v.aval for v in a.invars] == [v.aval for v in b.invars]
  np.testing.assert_array_equal(jax.jit(theirs)(PARAMS, X), ours(PARAMS, X))


def test_register_dense_variant_picks_the_tag():
  x3 = X[:, None, :].repeat(2, axis=1)
  y = tags.register_dense(
    x3 @ PARAMS["w"], x3, PARAMS["w"], variant="repeated_dense"
  )
  np.testing.assert_array_equal(y, x3 @ PARAMS["w"])
  eqns = _eqns(
    lambda p: tags.register_dense(
      x3 @ p["w"], x3, p["w"], variant="repeated_dense"
    ),
    PARAMS,
  )
  assert eqns[-1].primitive is tags.repeated_dense
  # The plain dense variant still refuses inputs with extra axes.
  with pytest.raises(ValueError, match="register_repeated_dense"):
    tags.register_dense(x3 @ PARAMS["w"], x3, PARAMS["w"])


def test_a_users_own_variant_gets_its_own_tag_and_block():
  mine = tags.LayerTag("my_dense_tag", num_inputs=1, num_outputs=1)
  assert tags.LayerTag.of_variant("my_dense") is mine
  problem = groundtruth.mlp(loss="squared", batch=5, bias=False)

  def model(variant):
    def tagged(p, batch):
      x, t = batch
      h = tags.register_dense(x @ p["w1"], x, p["w1"], variant=variant)
      a = jnp.tanh(h)
      z = tags.register_dense(a @ p["w2"], a, p["w2"])
      kfac_jax.register_squared_error_loss(z, t)
      return 0.0

    return tagged

  blocks = {"my_dense": kfac_jax.NaiveFull, "dense": kfac_jax.NaiveFull}
  matrices = {}
  for variant in ("my_dense", "dense"):
    est = kfac_jax.BlockDiagonalCurvature(
      model(variant), layer_tag_to_block_ctor={variant: blocks[variant]}
    )
    args = (problem.params, problem.batch)
    state = est.init(RNG, args)
    assert type(est.blocks[0]) is kfac_jax.NaiveFull
    assert est.blocks[0].layer_tag_primitive is tags.LayerTag.of_variant(
      variant
    )
    state = est.update_curvature_matrix_estimate(
      state, 0.0, 1.0, 5, RNG, args, estimation_mode="ggn_exact"
    )
    matrices[variant] = est.to_diagonal_block_dense_matrix(state)[0]
  # The user's tag is a dense layer to the block: the same estimate.
  np.testing.assert_allclose(
    matrices["my_dense"], matrices["dense"], rtol=1e-12
  )
  assert np.abs(matrices["dense"]).max() > 0


def test_unknown_variant_is_refused_with_the_known_ones():
  with pytest.raises(
    ValueError, match="No layer tag has the variant 'densse'.*dense"
  ):
    tags.register_dense(X @ PARAMS["w"], X, PARAMS["w"], variant="densse")
  with pytest.raises(ValueError, match="variant 'nope'"):
    tags.layer_tag.bind(
      X,
      meta=tags.LayerMetaData(
        variant="nope", outputs_index=(0,), inputs_index=(), params_index=(0,)
      ),
    )


def test_meta_errors_name_the_problem():
  with pytest.raises(ValueError, match="needs meta=LayerMetaData"):
    tags.layer_tag.bind(X, X, PARAMS["w"])
  with pytest.raises(ValueError, match="points past its 3 operands"):
    tags.layer_tag.bind(
      X @ PARAMS["w"],
      X,
      PARAMS["w"],
      meta=_dense_meta(2),
    )
  with pytest.raises(ValueError, match="takes 1 output"):
    tags.layer_tag.bind(
      X @ PARAMS["w"],
      X,
      PARAMS["w"],
      meta=tags.LayerMetaData(
        variant="dense",
        outputs_index=(0,),
        inputs_index=(),
        params_index=(1, 2),
      ),
    )
  # A per-kind tag takes outputs, inputs, parameters in that order.
  with pytest.raises(ValueError, match="outputs, inputs, parameters"):
    tags.dense.bind(
      X @ PARAMS["w"],
      X,
      PARAMS["w"],
      meta=tags.LayerMetaData(
        variant="dense",
        outputs_index=(1,),
        inputs_index=(0,),
        params_index=(2,),
      ),
    )
  with pytest.raises(ValueError, match="give both num_inputs and num_outputs"):
    tags.LayerTag("half_tag", num_inputs=1)
  with pytest.raises(ValueError, match="Not a layer tag"):
    tags.layer_eqn_data(_eqns(jnp.sin, X)[0])
  assert tags.layer_eqn_data(
    _eqns(jnp.sin, X)[0], raise_an_error=False
  ) == tags.LayerData(inputs=(), outputs=(), params=())


def test_blocks_name_their_equation():
  problem = groundtruth.mlp()
  est = kfac_jax.BlockDiagonalCurvature(problem.tagged)
  est.init(RNG, (problem.params, problem.batch))
  for block in est.blocks:
    assert tags.layer_eqn_name(block.layer_tag_eq) == block.name
    # A block built from the named equation alone keeps the name.
    again = type(block)(block.layer_tag_eq)
    assert again.name == block.name
  raw = _eqns(
    lambda p, x: tags.register_dense(x @ p["w"], x, p["w"]), PARAMS, X
  )[-1]
  with pytest.raises(ValueError, match="has no name yet"):
    tags.layer_eqn_name(raw)


# Losses.


class _TwiceCategorical(losses.CategoricalLogitsNegativeLogProbLoss):
  """A loss class the registry does not know, bound through `loss_tag`."""


def _bind_loss(logits, targets, names=("logits", "targets", "weight")):
  values = {"logits": logits, "targets": targets, "weight": jnp.asarray(1.0)}
  return tags.loss_tag.bind(
    *(values[n] for n in names),
    meta=tags.LossMetaData(
      loss_class=_TwiceCategorical,
      parameter_dependants=("logits",),
      parameter_independants=tuple(n for n in names if n != "logits"),
      argument_names=names,
    ),
  )


LOGITS = jnp.linspace(-2.0, 2.0, 12).reshape(4, 3)
TARGETS = jnp.array([0, 2, 1, 1])


@pytest.mark.parametrize(
  "names", [("logits", "targets", "weight"), ("targets", "weight", "logits")]
)
def test_loss_tag_returns_the_parameter_dependants_wherever_they_sit(names):
  [out] = _bind_loss(LOGITS, TARGETS, names)
  np.testing.assert_array_equal(out, LOGITS)
  [eqn] = _eqns(lambda z: _bind_loss(z, TARGETS, names), LOGITS)
  assert tags.loss_eqn_class_name(eqn) == "_TwiceCategorical"
  assert tags.loss_eqn_parameter_dependants(eqn) == [
    eqn.invars[names.index("logits")]
  ]
  values = {"logits": LOGITS, "targets": TARGETS, "weight": jnp.asarray(1.0)}
  loss = tags.loss_eqn_construct_loss(eqn, *(values[n] for n in names))
  assert type(loss) is _TwiceCategorical
  np.testing.assert_array_equal(loss.targets, TARGETS)
  # Identity under jvp, vmap and jit.
  _, tangent = jax.jvp(
    lambda z: _bind_loss(z, TARGETS, names)[0], (LOGITS,), (2 * LOGITS,)
  )
  np.testing.assert_array_equal(tangent, 2 * LOGITS)
  batched = jax.vmap(lambda z, t: _bind_loss(z, t, names)[0])(LOGITS, TARGETS)
  np.testing.assert_array_equal(batched, LOGITS)


def test_a_loss_bound_through_loss_tag_gives_the_exact_ggn():
  problem = groundtruth.mlp(loss="softmax")

  def tagged(p, batch):
    x, t = batch
    z = problem.tagged_forward(p, x)
    _bind_loss(z, t)
    return 0.0

  est = kfac_jax.ExplicitExactCurvature(tagged)
  args = (problem.params, problem.batch)
  state = est.init(RNG, args)
  state = est.update_curvature_matrix_estimate(
    state,
    0.0,
    1.0,
    problem.batch[0].shape[0],
    RNG,
    args,
    estimation_mode="ggn_exact",
  )
  flat, _ = problem.flat_params
  ours = est.to_dense_matrix(state)
  # Both orders are the flattened parameter dict's.
  np.testing.assert_allclose(ours, problem.ggn(), rtol=1e-9, atol=1e-12)
  assert ours.shape == (flat.size, flat.size)


def test_the_documented_args_names_binding_still_works():
  tag = losses.CategoricalLogitsNegativeLogProbLoss_tag
  [eqn] = _eqns(
    lambda z: tag.bind(z, TARGETS, args_names=("logits", "targets")), LOGITS
  )
  meta = eqn.params["meta"]
  assert meta == tags.LossMetaData(
    loss_class=losses.CategoricalLogitsNegativeLogProbLoss,
    parameter_dependants=("logits",),
    parameter_independants=("targets",),
    argument_names=("logits", "targets"),
  )
  loss = tag.loss(LOGITS, TARGETS, args_names=("logits", "targets"))
  assert isinstance(loss, losses.CategoricalLogitsNegativeLogProbLoss)
  with pytest.raises(ValueError, match="stands for no loss class"):
    tags.loss_tag.bind(LOGITS, args_names=("logits",))
  with pytest.raises(ValueError, match="got 1 operands but its meta names 2"):
    tags.loss_tag.bind(
      LOGITS,
      meta=dataclasses.replace(meta, argument_names=("logits", "targets")),
    )


# The tracer's per-layer data.


def test_layer_tags_vjp_gives_layer_vjp_data_against_the_chain_rule():
  problem = groundtruth.mlp(loss="squared", batch=4, bias=True)
  args = (problem.params, problem.batch)
  losses_, vjp = kfac_jax.layer_tags_vjp(problem.tagged)(args)
  x, _ = problem.batch
  p = problem.params
  cotangent = jnp.asarray(np.random.default_rng(3).standard_normal((4, 3)))
  first, second = jax.jit(vjp)(((cotangent,),))
  assert isinstance(first, kfac_jax.LayerVjpData)
  h = x @ p["w1"] + p["b1"]
  a = jnp.tanh(h)
  dh = (cotangent @ p["w2"].T) * (1 - a**2)
  np.testing.assert_allclose(second.tangents.outputs[0], cotangent, rtol=1e-12)
  np.testing.assert_allclose(first.tangents.outputs[0], dh, rtol=1e-12)
  np.testing.assert_allclose(
    second.tangents.params[0], a.T @ cotangent, rtol=1e-12
  )
  np.testing.assert_allclose(first.tangents.params[0], x.T @ dh, rtol=1e-12)
  np.testing.assert_allclose(first.tangents.params[1], dh.sum(0), rtol=1e-12)
  np.testing.assert_allclose(second.primals.inputs[0], a, rtol=1e-12)
  np.testing.assert_allclose(first.primals.outputs[0], h, rtol=1e-12)
  assert first.tangents.inputs == ()
  # The same data read as the blocks' mapping.
  assert set(first) == {
    "inputs",
    "outputs",
    "params",
    "outputs_tangent",
    "params_tangent",
  }
  assert first["outputs_tangent"] is first.tangents.outputs
  assert first["inputs"] is first.primals.inputs
  assert len(jax.tree.leaves(first)) == 1 + 1 + 2 + 1 + 2


def test_layer_tag_binds_a_generic_layer_as_0_0_8_registers_it():
  w, b = PARAMS["w"], PARAMS["b"]
  meta = tags.LayerMetaData(
    variant="generic", outputs_index=(0,), inputs_index=(), params_index=(0, 1)
  )
  np.testing.assert_array_equal(tags.layer_tag.bind(w, b, meta=meta), w)
  [eqn] = _eqns(lambda w, b: tags.layer_tag.bind(w, b, meta=meta), w, b)
  assert eqn.primitive is tags.generic
  assert tags.layer_eqn_data(eqn).params == tuple(eqn.invars)
