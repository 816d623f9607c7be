"""Automatic registration on models written in Haiku, Flax (linen and NNX),
Equinox and plain JAX: which tag each layer gets, and that the blocks built
on those tags are right whatever layout the framework stores weights in
(float64, brute-force ground truth)."""

import functools

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

import estimators as kfac
from tests import groundtruth as gt

B, S, VOCAB, D, HEADS, K = 3, 3, 6, 4, 2, 3  # batch, sequence, widths
KEY = jax.random.PRNGKey(0)
FRAMEWORKS = ("haiku", "linen", "nnx", "equinox", "jax")
# What every layer kind should get; attention is its dense projections,
# applied at every position.
EXPECTED = {
  "dense": "dense_tag",
  "conv": "conv2d_tag",
  "norm": "scale_and_shift_tag",
  "embed": "embedding_tag",
  "attn": "repeated_dense_tag",
}
LAYERS = {"dense": 1, "conv": 1, "norm": 1, "embed": 1, "attn": 4}
FULL = {
  "dense_tag": kfac.DenseFull,
  "repeated_dense_tag": kfac.DenseFull,
  "conv2d_tag": kfac.Conv2DFull,
  "embedding_tag": kfac.EmbeddingFull,
  "scale_and_shift_tag": kfac.ScaleAndShiftFull,
}
ravel = lambda tree: jax.flatten_util.ravel_pytree(tree)[0]
f64 = lambda tree: jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), tree)


# --- one model per framework: embedding, attention, layer norm, conv, dense --
# Every model maps (ids (B, S), images (B, 5, 5, 2)) to (B, K) outputs.


def _haiku():
  def forward(batch):
    ids, img = batch
    h = hk.Embed(VOCAB, D, name="embed")(ids)
    h = hk.MultiHeadAttention(
      HEADS,
      D // HEADS,
      w_init=hk.initializers.VarianceScaling(1.0),
      name="attn",
    )(h, h, h)
    h = hk.LayerNorm(-1, True, True, name="norm")(h).mean(axis=1)
    c = jnp.tanh(hk.Conv2D(2, 3, padding="VALID", name="conv")(img))
    return hk.Linear(K, name="dense")(
      jnp.concatenate([h, c.reshape(len(img), -1)], -1)
    )

  model = hk.without_apply_rng(hk.transform(forward))
  return model.apply, jax.jit(model.init)(KEY, _inputs())


class _Linen(nn.Module):
  @nn.compact
  def __call__(self, batch):
    ids, img = batch
    h = nn.Embed(VOCAB, D, name="embed")(ids)
    h = nn.MultiHeadDotProductAttention(HEADS, name="attn")(h)
    h = nn.LayerNorm(name="norm")(h).mean(axis=1)
    c = jnp.tanh(nn.Conv(2, (3, 3), padding="VALID", name="conv")(img))
    return nn.Dense(K, name="dense")(
      jnp.concatenate([h, c.reshape(len(img), -1)], -1)
    )


def _linen():
  model = _Linen()
  return model.apply, jax.jit(model.init)(KEY, _inputs())


def _nnx_attention(q, k, v, **unused):
  """NNX's attention with its softmax in float64 (the fused default computes
  it in float32)."""
  weights = jax.nn.softmax(
    jnp.einsum("...qhd,...khd->...hqk", q, k) / np.sqrt(q.shape[-1])
  )
  return jnp.einsum("...hqk,...khd->...qhd", weights, v)


class _Nnx(nnx.Module):
  def __init__(self, rngs):
    f64 = dict(dtype=jnp.float64, param_dtype=jnp.float64, rngs=rngs)
    self.embed = nnx.Embed(VOCAB, D, **f64)
    self.attn = nnx.MultiHeadAttention(
      HEADS, D, decode=False, attention_fn=_nnx_attention, **f64
    )
    self.norm = nnx.LayerNorm(D, **f64)
    self.conv = nnx.Conv(2, 2, (3, 3), padding="VALID", **f64)
    self.dense = nnx.Linear(D + 18, K, **f64)

  def __call__(self, batch):
    ids, img = batch
    h = self.embed(ids)
    h = self.norm(self.attn(h)).mean(axis=1)
    c = jnp.tanh(self.conv(img))
    return self.dense(jnp.concatenate([h, c.reshape(len(img), -1)], -1))


def _nnx():
  graph, state = nnx.split(_Nnx(nnx.Rngs(0)))
  return (lambda p, batch: nnx.merge(graph, p)(batch)), state


class _Equinox(eqx.Module):
  """One example at a time (images CHW), mapped over the batch by vmap."""

  embed: eqx.nn.Embedding
  attn: eqx.nn.MultiheadAttention
  norm: eqx.nn.LayerNorm
  conv: eqx.nn.Conv2d
  dense: eqx.nn.Linear

  def __init__(self, key):
    k = jax.random.split(key, 4)
    self.embed = eqx.nn.Embedding(VOCAB, D, key=k[0])
    self.attn = eqx.nn.MultiheadAttention(
      HEADS,
      D,
      use_query_bias=True,
      use_key_bias=True,
      use_value_bias=True,
      use_output_bias=True,
      key=k[1],
    )
    self.norm = eqx.nn.LayerNorm(D)
    self.conv = eqx.nn.Conv2d(2, 2, 3, key=k[2])
    self.dense = eqx.nn.Linear(D + 18, K, key=k[3])

  def __call__(self, ids, img):
    h = jax.vmap(self.embed)(ids)
    h = jax.vmap(self.norm)(self.attn(h, h, h)).mean(axis=0)
    c = jnp.tanh(self.conv(img)).reshape(-1)
    return self.dense(jnp.concatenate([h, c]))


def _equinox():
  params, static = eqx.partition(_Equinox(KEY), eqx.is_array)

  def apply(p, batch):
    ids, img = batch
    return jax.vmap(eqx.combine(p, static))(ids, jnp.moveaxis(img, -1, 1))

  return apply, params


def _plain_jax():
  shapes = {
    "embed": (VOCAB, D),
    **{f"attn_{n}": (D, D) for n in "qkvo"},
    **{f"attn_b{n}": (D,) for n in "qkvo"},
    "norm_scale": (D,),
    "norm_shift": (D,),
    "conv_k": (3, 3, 2, 2),
    "conv_b": (2,),
    "dense_w": (D + 18, K),
    "dense_b": (K,),
  }
  keys = jax.random.split(KEY, len(shapes))
  params = {
    n: 0.5 * jax.random.normal(k, s) for k, (n, s) in zip(keys, shapes.items())
  }

  def apply(p, batch):
    ids, img = batch
    h = p["embed"][ids]
    q, k, v = (h @ p[f"attn_{n}"] + p[f"attn_b{n}"] for n in "qkv")
    mix = jax.nn.softmax(q @ jnp.swapaxes(k, 1, 2) / np.sqrt(D)) @ v
    h = mix @ p["attn_o"] + p["attn_bo"]
    h = h - h.mean(-1, keepdims=True)
    h = h * lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-5)
    h = (h * p["norm_scale"] + p["norm_shift"]).mean(axis=1)
    c = lax.conv_general_dilated(
      img,
      p["conv_k"],
      (1, 1),
      "VALID",
      dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )
    c = jnp.tanh(c + p["conv_b"]).reshape(len(img), -1)
    return jnp.concatenate([h, c], -1) @ p["dense_w"] + p["dense_b"]

  return apply, params


def _inputs():
  ids = jax.random.randint(jax.random.fold_in(KEY, 1), (B, S), 0, VOCAB)
  return ids, jax.random.normal(jax.random.fold_in(KEY, 2), (B, 5, 5, 2))


BUILDERS = {
  "haiku": _haiku,
  "linen": _linen,
  "nnx": _nnx,
  "equinox": _equinox,
  "jax": _plain_jax,
}


def as_problem(apply, params, inputs, loss="squared", k=K):
  """A `gt.Problem` whose tagged function leaves the layers to the matcher
  (`k` outputs per example)."""
  register, per_example, kind = gt.LOSSES[loss]
  targets = gt.make_targets(kind, jax.random.fold_in(KEY, 3), B, k)

  def tagged(p, batch):
    x, t = batch
    z = register(apply(p, x), t)
    return jnp.mean(jax.vmap(per_example)(z, t))

  return gt.Problem(tagged, apply, per_example, f64(params), (inputs, targets))


@functools.cache
def model(framework):
  """The framework's model as a `gt.Problem`, and its registration report."""
  apply, params = BUILDERS[framework]()
  problem = as_problem(apply, params, _inputs())
  report = kfac.registration_report(
    problem.tagged, (problem.params, problem.batch)
  )
  return problem, report


def _kind(path):
  return next(k for k in EXPECTED if k in path.lower())


@pytest.mark.parametrize("kind", list(EXPECTED))
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_each_layer_kind_gets_its_tag(framework, kind):
  _, report = model(framework)
  rows = [r for r in report if _kind(r["path"]) == kind]
  assert rows, f"no {kind} parameters in {[r['path'] for r in report]}"
  for r in rows:
    assert r["tag"] == EXPECTED[kind], (r["path"], r["tag"], r["source"])
  # A layer's weight and bias share one tag; attention has 4 projections.
  assert len({r["layer"] for r in rows}) == LAYERS[kind], rows


def _blocks(problem):
  """The block groups of the report: parameter paths per layer number."""
  leaves = jax.tree_util.tree_flatten_with_path(problem.params)[0]
  paths = [jax.tree_util.keystr(p) for p, _ in leaves]
  report = kfac.registration_report(
    problem.tagged, (problem.params, problem.batch)
  )
  layer = {r["path"]: r["layer"] for r in report}
  sizes = [np.size(v) for _, v in leaves]
  owner = np.repeat([layer[p] for p in paths], sizes)
  return (owner[:, None] == owner[None, :]).astype(np.float64)


def estimate(problem, ctor_map=None, mode="ggn_exact"):
  """The estimator and its state after one batch (compiled as one, which is
  much faster than running it eagerly)."""
  est = kfac.BlockDiagonalCurvature(
    problem.tagged, layer_tag_to_block_ctor=ctor_map
  )

  def run(args):
    state = est.init(jax.random.PRNGKey(1), args)
    return est.update_curvature_matrix_estimate(
      state, 0.0, 1.0, B, jax.random.PRNGKey(2), args, estimation_mode=mode
    )

  return est, jax.jit(run)((problem.params, problem.batch))


def dense(est, state):
  return jax.jit(est.to_dense_matrix)(state)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_exact_full_blocks_equal_brute_force_ggn(framework):
  """Every block, whatever layout its weights have (output-major, several
  axes, a (C, 1, 1) conv bias), is the exact GGN's block."""
  problem, _ = model(framework)
  est, state = estimate(problem, FULL)
  expected = jax.jit(problem.ggn)() * _blocks(problem)
  np.testing.assert_allclose(dense(est, state), expected, rtol=1e-9, atol=1e-11)


# --- Equinox's output-major dense layers and (C, 1, 1) conv biases ---------


class _EqxConvNet(eqx.Module):
  conv: eqx.nn.Conv2d
  hidden: eqx.nn.Linear
  norm: eqx.nn.LayerNorm
  out: eqx.nn.Linear

  def __init__(self, key):
    k = jax.random.split(key, 3)
    self.conv = eqx.nn.Conv2d(2, 3, 3, padding=1, key=k[0])
    self.hidden = eqx.nn.Linear(3 * 16, D, key=k[1])
    self.norm = eqx.nn.LayerNorm(D)
    self.out = eqx.nn.Linear(D, K, key=k[2])

  def __call__(self, img):  # CHW
    h = jnp.tanh(self.conv(img)).reshape(-1)
    return self.out(jnp.tanh(self.norm(self.hidden(h))))


def _twin_apply(p, img):
  """`_EqxConvNet` in plain JAX with input-major weights and a (C,) bias."""
  c = lax.conv_general_dilated(
    img,
    p["conv_k"],
    (1, 1),
    ((1, 1), (1, 1)),
    dimension_numbers=("NCHW", "OIHW", "NCHW"),
  )
  h = jnp.tanh(c + p["conv_b"][:, None, None]).reshape(len(img), -1)
  h = h @ p["hidden_w"] + p["hidden_b"]
  h = h - h.mean(-1, keepdims=True)
  h = h * lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-5)
  h = jnp.tanh(h * p["norm_scale"] + p["norm_shift"])
  return h @ p["out_w"] + p["out_b"]


def to_twin(m):
  """An `_EqxConvNet`-shaped tree (params or a vector) in the twin's layout."""
  return {
    "conv_k": m.conv.weight,
    "conv_b": m.conv.bias.reshape(-1),
    "hidden_w": m.hidden.weight.T,
    "hidden_b": m.hidden.bias,
    "norm_scale": m.norm.weight,
    "norm_shift": m.norm.bias,
    "out_w": m.out.weight.T,
    "out_b": m.out.bias,
  }


@functools.cache
def eqx_and_twin():
  params, static = eqx.partition(f64(_EqxConvNet(KEY)), eqx.is_array)
  img = jax.random.normal(jax.random.fold_in(KEY, 4), (B, 2, 4, 4))
  ours = as_problem(
    lambda p, x: jax.vmap(eqx.combine(p, static))(x),
    params,
    img,
    loss="softmax",
  )
  twin = as_problem(_twin_apply, to_twin(params), img, loss="softmax")
  return ours, twin


def test_equinox_layers_are_whole_dense_and_conv_layers():
  ours, _ = eqx_and_twin()
  report = kfac.registration_report(ours.tagged, (ours.params, ours.batch))
  assert {r["path"]: (r["tag"], r["source"]) for r in report} == {
    ".conv.weight": ("conv2d_tag", "conv2d_with_bias"),
    ".conv.bias": ("conv2d_tag", "conv2d_with_bias"),
    ".hidden.weight": ("dense_tag", "dense_weight_first_with_bias"),
    ".hidden.bias": ("dense_tag", "dense_weight_first_with_bias"),
    ".norm.weight": ("scale_and_shift_tag", "scale_and_shift_broadcast_1"),
    ".norm.bias": ("scale_and_shift_tag", "scale_and_shift_broadcast_1"),
    ".out.weight": ("dense_tag", "dense_weight_first_with_bias"),
    ".out.bias": ("dense_tag", "dense_weight_first_with_bias"),
  }


BLOCK_TYPES = {
  "kfac": None,  # the estimator's defaults
  "diagonal": {
    "dense_tag": kfac.DenseDiagonal,
    "conv2d_tag": kfac.Conv2DDiagonal,
  },
  "ekfac": {"dense_tag": kfac.DenseEKFAC, "conv2d_tag": kfac.Conv2DEKFAC},
  "tnt": {"dense_tag": kfac.DenseTNT, "conv2d_tag": kfac.Conv2DTNT},
}


@pytest.mark.parametrize("block_type", list(BLOCK_TYPES))
def test_blocks_on_equinox_layouts_equal_those_of_the_usual_layout(block_type):
  """The same network with the usual layouts gives the same products:
  each block sees the layer, not how its weights are stored."""
  ours, twin = eqx_and_twin()
  ctors = BLOCK_TYPES[block_type]
  (est, state), (est_t, state_t) = (estimate(p, ctors) for p in (ours, twin))
  flat, unravel = ours.flat_params
  v = unravel(gt.random_normal(0, flat.size))
  for product in ("multiply", "multiply_inverse"):
    got = jax.jit(getattr(est, product))(state, v, 0.1)
    assert jax.tree.structure(got) == jax.tree.structure(v)
    assert jax.tree.map(jnp.shape, got) == jax.tree.map(jnp.shape, v)
    want = jax.jit(getattr(est_t, product))(state_t, to_twin(v), 0.1)
    np.testing.assert_allclose(
      ravel(to_twin(got)), ravel(want), rtol=1e-9, atol=1e-12, err_msg=product
    )


def test_optimizer_updates_equinox_params_in_their_own_shapes():
  ours, twin = eqx_and_twin()
  steps = []
  for problem in (ours, twin):
    opt = kfac.Optimizer(
      jax.value_and_grad(problem.tagged),
      l2_reg=0.0,
      estimation_mode="ggn_exact",
      num_burnin_steps=0,
      use_exact_inverses=True,
      multi_device=False,
    )
    new, _, _ = gt.one_step(
      opt,
      problem,
      learning_rate=0.5,
      momentum=0.0,
      damping=0.1,
      global_step_int=0,
    )
    assert jax.tree.map(jnp.shape, new) == jax.tree.map(
      jnp.shape, problem.params
    )
    steps.append(jax.tree.map(jnp.subtract, new, problem.params))
  np.testing.assert_allclose(
    ravel(to_twin(steps[0])), ravel(steps[1]), rtol=1e-8, atol=1e-12
  )
  assert float(jnp.max(jnp.abs(ravel(steps[1])))) > 1e-3


class _EqxLinear(eqx.Module):
  first: eqx.nn.Linear
  second: eqx.nn.Linear

  def __init__(self, key):
    k1, k2 = jax.random.split(key)
    self.first = eqx.nn.Linear(4, 3, key=k1)
    self.second = eqx.nn.Linear(3, 2, key=k2)

  def __call__(self, x):
    return self.second(self.first(x))


def test_kronecker_factors_of_output_major_layers_equal_closed_forms():
  """A deep linear Equinox network under squared error: `A = mean x̃ x̃ᵀ`,
  `G = Jᵀ H J` with `J` the map from a layer's outputs to the network's,
  and K-FAC is then the exact GGN's block diagonal."""
  m = f64(_EqxLinear(jax.random.fold_in(KEY, 5)))
  params, static = eqx.partition(m, eqx.is_array)
  x = jax.random.normal(jax.random.fold_in(KEY, 6), (B, 4))
  problem = as_problem(
    lambda p, x: jax.vmap(eqx.combine(p, static))(x), params, x, k=2
  )
  est, state = estimate(problem)
  hess = 2 * 0.7 * jnp.eye(2)  # of the squared error gt.LOSSES registers
  h = jax.vmap(m.first)(x)
  for block_state, inputs, g in zip(
    state.blocks_states,
    (x, h),
    (m.second.weight.T @ hess @ m.second.weight, hess),
  ):
    xt = jnp.concatenate([inputs, jnp.ones((B, 1))], 1)
    np.testing.assert_allclose(
      block_state.inputs_factor.value, xt.T @ xt / B, rtol=1e-10
    )
    np.testing.assert_allclose(block_state.outputs_factor.value, g, rtol=1e-10)
  np.testing.assert_allclose(
    dense(est, state),
    jax.jit(problem.ggn)() * _blocks(problem),
    rtol=1e-9,
    atol=1e-11,
  )


# --- what the matcher cannot claim says why ---------------------------------


def test_unclaimed_parameters_name_the_reason():
  p = {
    "w": np.ones((4, 3)),
    "log_scale": np.ones(3),
    "tied": np.ones((3, 3)),
    "w_t": np.ones((3, 3)),
  }

  def apply(p, x):
    h = jnp.tanh(x @ p["w"] * jnp.exp(p["log_scale"]))  # not a plain scale
    h = jnp.tanh(h @ p["tied"]) @ p["tied"]  # one weight, two layers
    return h @ p["w_t"].T  # a transposed copy feeds the matmul

  problem = as_problem(apply, p, np.ones((B, 4)))
  report = kfac.registration_report(
    problem.tagged, (problem.params, problem.batch)
  )
  rows = {r["path"].strip("[']"): r for r in report}
  assert rows["w"]["tag"] == "dense_tag"
  assert {n: r["tag"] for n, r in rows.items() if n != "w"} == dict.fromkeys(
    ("log_scale", "tied", "w_t"), "generic_tag"
  )
  assert rows["log_scale"]["source"] == (
    "unmatched: no layer pattern fits its use by exp (output (3,))"
  )
  assert rows["tied"]["source"] == (
    "shared by 2 layers: dense_no_bias (output (3, 3)) and dense_no_bias "
    "(output (3, 3))"
  )
  assert rows["w_t"]["source"] == (
    "unmatched: no layer pattern fits its use by dot_general of its "
    "transpose (output (3, 3))"
  )
