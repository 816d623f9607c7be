"""Automatic layer registration (estimators.graph_matcher)."""

import functools
import logging

import haiku as hk
import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import estimators as kfac
from estimators import graph_matcher as gm
from estimators import tags
from tests import groundtruth as gt

F32 = jnp.float32


def _short(path):
  return path.replace("']['", "/").strip("[']")


def layers(report):
  """{(tag, *sorted parameter paths)} for each registered layer."""
  groups = {}
  for r in report:
    groups.setdefault(r["layer"], [r["tag"]]).append(_short(r["path"]))
  return {(g[0], *sorted(g[1:])) for g in groups.values()}


def haiku_problem(
  forward, x, labels=None, loss="softmax", state=False, values=False
):
  """(loss_fn(params, [state,] x), args) for a Haiku forward function.

  Parameters are abstract (shapes only) unless `values`: matching needs no
  values, and eager initialisation would compile every op.
  """
  labels = np.zeros((x.shape[0],), np.int32) if labels is None else labels
  init = jax.jit if values else lambda f: functools.partial(jax.eval_shape, f)
  if state:
    model = hk.transform_with_state(forward)
    params, st = init(model.init)(jax.random.PRNGKey(0), x)

    def loss_fn(p, s, x):
      out, _ = model.apply(p, s, None, x)
      return _register(loss, out, labels)

    return loss_fn, (params, st, x)
  model = hk.transform(forward)
  params = init(model.init)(jax.random.PRNGKey(0), x)

  def loss_fn(p, x):
    return _register(loss, model.apply(p, None, x), labels)

  return loss_fn, (params, x)


def _register(loss, out, labels):
  if loss == "softmax":
    out = kfac.register_softmax_cross_entropy_loss(out, labels)
    return -jnp.mean(jax.nn.log_softmax(out)[jnp.arange(len(labels)), labels])
  out = kfac.register_sigmoid_cross_entropy_loss(out, labels)
  return jnp.mean(jnp.logaddexp(0, out) - labels * out)


def report_of(loss_fn, args, **kwargs):
  return gm.registration_report(loss_fn, args, **kwargs)


def dense(*names):
  return {("dense_tag", f"{n}/b", f"{n}/w") for n in names}


# --- Haiku models --------------------------------------------------------


def test_haiku_mlp_every_layer_is_dense():
  def forward(x):
    x = jax.nn.relu(hk.Linear(6)(x))
    x = jax.nn.gelu(hk.Linear(5)(x))
    x = jnp.tanh(hk.Linear(4, with_bias=False)(x))
    return hk.Linear(3)(x)

  loss_fn, args = haiku_problem(forward, np.ones((4, 7), np.float32))
  assert layers(report_of(loss_fn, args)) == (
    dense("linear", "linear_1", "linear_3") | {("dense_tag", "linear_2/w")}
  )
  # Calls holding no layer stay calls: relu keeps its custom derivative.
  jaxpr = jax.make_jaxpr(gm.auto_register_tags(loss_fn, args))(*args)
  assert "custom_jvp_call" in {e.primitive.name for e in jaxpr.eqns}


def test_haiku_deep_autoencoder():
  widths = (8, 6, 4, 2, 4, 6)

  def forward(x):
    for w in widths:
      x = jax.nn.sigmoid(hk.Linear(w)(x))
    return hk.Linear(10)(x)

  x = np.ones((3, 10), np.float32)
  loss_fn, args = haiku_problem(forward, x, labels=x, loss="sigmoid")
  names = ["linear"] + [f"linear_{i}" for i in range(1, len(widths) + 1)]
  assert layers(report_of(loss_fn, args)) == dense(*names)


def test_haiku_convnet_with_pooling_flatten_and_strides():
  def forward(x):
    x = jax.nn.relu(hk.Conv2D(4, 3, stride=2)(x))
    x = hk.avg_pool(x, (1, 2, 2, 1), (1, 1, 1, 1), "SAME")
    x = jax.nn.relu(hk.Conv2D(5, 3, padding="VALID", with_bias=False)(x))
    x = hk.max_pool(x, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    x = hk.Conv2D(3, 1, data_format="NCHW")(jnp.transpose(x, (0, 3, 1, 2)))
    x = hk.DepthwiseConv2D(1, 3, data_format="NCHW")(x)
    return hk.Linear(3)(hk.Flatten()(x))

  loss_fn, args = haiku_problem(forward, np.ones((2, 12, 12, 3), np.float32))
  report = report_of(loss_fn, args)
  # Haiku's NCHW biases have shape (C, 1, 1): one entry per channel, so
  # they join their convolution like (C,) ones.
  assert layers(report) == {
    ("conv2d_tag", "conv2_d/b", "conv2_d/w"),
    ("conv2d_tag", "conv2_d_1/w"),
    ("conv2d_tag", "conv2_d_2/b", "conv2_d_2/w"),
    ("conv2d_tag", "depthwise_conv2_d/b", "depthwise_conv2_d/w"),
    ("dense_tag", "linear/b", "linear/w"),
  }
  proc = kfac.ProcessedJaxpr.make_from_func(loss_fn, args)
  convs = [e.params for e in proc.layer_tags if e.primitive is tags.conv2d]
  assert sorted(p["window_strides"] for p in convs) == [(1, 1)] * 3 + [(2, 2)]
  assert sorted(p["feature_group_count"] for p in convs) == [1, 1, 1, 3]
  assert {p["dimension_numbers"].lhs_spec for p in convs} == {
    (0, 3, 1, 2),
    (0, 1, 2, 3),
  }


def test_haiku_resnet_block_with_batch_norm_and_layer_norm():
  def forward(x):
    h = hk.Conv2D(4, 3, with_bias=False)(x)
    h = jax.nn.relu(hk.BatchNorm(True, True, 0.9)(h, is_training=True))
    h = hk.Conv2D(4, 3, with_bias=False)(h)
    h = hk.BatchNorm(True, True, 0.9)(h, is_training=True)
    x = jax.nn.relu(x + h)
    x = hk.LayerNorm(-1, True, True)(jnp.mean(x, axis=(1, 2)))
    x = hk.RMSNorm(-1)(x)
    return hk.Linear(3)(x)

  loss_fn, args = haiku_problem(
    forward, np.ones((2, 6, 6, 4), np.float32), state=True
  )
  assert layers(report_of(loss_fn, args)) == {
    ("conv2d_tag", "conv2_d/w"),
    ("conv2d_tag", "conv2_d_1/w"),
    ("scale_and_shift_tag", "batch_norm/offset", "batch_norm/scale"),
    ("scale_and_shift_tag", "batch_norm_1/offset", "batch_norm_1/scale"),
    ("scale_and_shift_tag", "layer_norm/offset", "layer_norm/scale"),
    ("scale_and_shift_tag", "rms_norm/scale"),
    ("dense_tag", "linear/b", "linear/w"),
  }


def test_normalization_tag_inputs_are_the_normalized_values():
  def forward(x):
    return hk.Linear(2)(hk.LayerNorm(-1, True, True)(x))

  x = np.random.default_rng(1).normal(size=(5, 4)).astype(np.float32) * 3 + 1
  loss_fn, args = haiku_problem(forward, x, values=True)

  @jax.jit
  def layer_values(args):
    _, vjp = kfac.layer_tags_vjp(loss_fn)(args)
    return vjp(((jnp.ones((5, 2), F32),),))

  values = layer_values(args)
  norm = next(
    v for v in values if len(v["params"]) == 2 and v["params"][0].shape == (4,)
  )
  (x_hat,) = norm["inputs"]
  expected = (x - x.mean(-1, keepdims=True)) / jnp.sqrt(
    x.var(-1, keepdims=True) + 1e-5
  )
  np.testing.assert_allclose(x_hat, expected, rtol=1e-4, atol=1e-5)


def test_haiku_layer_stack_layers_are_dense_and_stay_in_the_scan():
  def forward(x):
    x = hk.Linear(4)(x)
    stack = hk.experimental.layer_stack(3)(
      lambda h: jax.nn.relu(hk.Linear(4)(h))
    )
    return hk.Linear(2)(stack(x))

  loss_fn, args = haiku_problem(forward, np.ones((3, 5), np.float32))
  report = report_of(loss_fn, args)
  stacked = "__layer_stack_no_per_layer/linear"
  assert layers(report) == dense("linear", "linear_1", stacked)
  assert {_short(r["path"]): r["stacked"] for r in report} == {
    f"{stacked}/b": 3,
    f"{stacked}/w": 3,
    "linear/b": None,
    "linear/w": None,
    "linear_1/b": None,
    "linear_1/w": None,
  }
  jaxpr = jax.make_jaxpr(gm.auto_register_tags(loss_fn, args))(*args)
  assert "scan" in {e.primitive.name for e in jaxpr.eqns}  # not unrolled

  est = kfac.BlockDiagonalCurvature(loss_fn)
  est.init(jax.random.PRNGKey(0), args)
  (stack_block,) = [b for b in est.blocks if isinstance(b, kfac.Stacked)]
  assert stacked in stack_block.name
  assert isinstance(stack_block.block, kfac.DenseTwoKroneckerFactored)
  assert stack_block.length == 3
  assert stack_block.parameters_shapes == ((3, 4, 4), (3, 4))
  assert (
    sum(isinstance(b, kfac.DenseTwoKroneckerFactored) for b in est.blocks) == 2
  )


# --- plain jax.numpy models ---------------------------------------------


def _plain_mlp(p, x):
  h = jnp.tanh(x @ p["w1"] + p["b1"])
  h = jax.nn.relu(jnp.dot(h, p["w2"].astype(F32)) + p["b2"].reshape(1, -1))
  return jnp.matmul(h, p["w3"])


def _init(shapes, seed=0):
  rng = np.random.default_rng(seed)
  return {
    n: (0.3 * rng.normal(size=s)).astype(np.float32) for n, s in shapes.items()
  }


def _loss(forward):
  def loss_fn(p, batch):
    x, t = batch
    out = kfac.register_softmax_cross_entropy_loss(forward(p, x), t)
    return -jnp.mean(jax.nn.log_softmax(out)[jnp.arange(len(t)), t])

  return loss_fn


def _batch(shape, classes=3):
  x = np.random.default_rng(7).normal(size=shape).astype(np.float32)
  return x, np.arange(shape[0]) % classes


def test_plain_mlp_with_cast_and_reshaped_parameters():
  p = _init({"w1": (5, 4), "b1": (4,), "w2": (4, 4), "b2": (4,), "w3": (4, 3)})
  report = report_of(_loss(_plain_mlp), (p, _batch((6, 5))))
  assert layers(report) == {
    ("dense_tag", "b1", "w1"),
    ("dense_tag", "b2", "w2"),
    ("dense_tag", "w3"),
  }


def test_layers_are_numbered_in_the_order_the_model_computes_them():
  # Alphabetical parameters and the matcher's claim order (dense layers,
  # then scale-and-shift, then a manual tag, then generic) disagree with
  # the forward order: z_in, a_norm, manual, m_out, c_gen.
  p = _init(
    {
      "z_in": (5, 4),
      "a_norm": (4,),
      "manual": (4, 4),
      "m_out": (4, 3),
      "c_gen": (3,),
    }
  )

  def forward(p, x):
    h = jnp.tanh(x @ p["z_in"]) * p["a_norm"]
    h = kfac.register_dense(h @ p["manual"], h, p["manual"])
    return jnp.sin(h @ p["m_out"]) ** p["c_gen"]

  report = report_of(_loss(forward), (p, _batch((6, 5))))
  layer = {_short(r["path"]): r["layer"] for r in report}
  assert layer == dict(z_in=0, a_norm=1, manual=2, m_out=3, c_gen=4)


def test_plain_deep_autoencoder_under_jit_and_checkpoint():
  sizes = (6, 4, 2, 4, 6)
  p = _init(
    {f"w{i}": (a, b) for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))}
    | {f"b{i}": (b,) for i, b in enumerate(sizes[1:])}
  )

  @jax.checkpoint
  def block(w, b, x):
    return jax.nn.softplus(x @ w + b)

  @jax.jit
  def forward(p, x):
    for i in range(len(sizes) - 1):
      x = block(p[f"w{i}"], p[f"b{i}"], x)
    return x

  def loss_fn(p, x):
    out = kfac.register_squared_error_loss(forward(p, x), x)
    return jnp.mean((out - x) ** 2)

  x = np.random.default_rng(3).normal(size=(5, 6)).astype(np.float32)
  assert layers(report_of(loss_fn, (p, x))) == {
    ("dense_tag", f"b{i}", f"w{i}") for i in range(len(sizes) - 1)
  }
  tagged = gm.auto_register_tags(loss_fn, (p, x), compute_only_loss_tags=False)
  both = jax.jit(
    lambda p, x: [jax.value_and_grad(f)(p, x) for f in (tagged, loss_fn)]
  )
  jax.tree.map(
    functools.partial(np.testing.assert_allclose, rtol=1e-5), *both(p, x)
  )


@pytest.mark.parametrize("data_format", ["NHWC", "NCHW"])
def test_plain_convnet(data_format):
  nhwc = data_format == "NHWC"
  dn = (data_format, "HWIO" if nhwc else "OIHW", data_format)
  p = _init(
    {
      "k1": (3, 3, 2, 4) if nhwc else (4, 2, 3, 3),
      "b1": (4,),
      "k2": (2, 2, 1, 4) if nhwc else (4, 1, 2, 2),
      "k3": (1, 1, 4, 2) if nhwc else (2, 4, 1, 1),
      "w": (18, 3),
      "b": (3,),
    }
  )
  bias_shape = (1, 1, 1, -1) if nhwc else (1, -1, 1, 1)

  def forward(p, x):
    x = lax.conv_general_dilated(
      x, p["k1"], (2, 2), "SAME", dimension_numbers=dn
    )
    x = jax.nn.relu(x + p["b1"].reshape(bias_shape))
    x = lax.conv_general_dilated(
      x,
      p["k2"],
      (1, 1),
      [(1, 0), (1, 0)],
      rhs_dilation=(1, 1),
      dimension_numbers=dn,
      feature_group_count=4,
    )
    x = lax.conv_general_dilated(
      x, p["k3"], (1, 1), "VALID", dimension_numbers=dn
    )
    return x.reshape(x.shape[0], -1) @ p["w"] + p["b"]

  x, t = _batch((2, 6, 6, 2) if nhwc else (2, 2, 6, 6))
  assert layers(report_of(_loss(forward), (p, (x, t)))) == {
    ("conv2d_tag", "b1", "k1"),
    ("conv2d_tag", "k2"),
    ("conv2d_tag", "k3"),
    ("dense_tag", "b", "w"),
  }


def test_plain_scale_and_shift_with_broadcasting():
  p = _init(
    {
      "w": (3, 4),
      "s1": (4,),
      "t1": (4,),
      "s2": (1, 4),
      "t2": (4,),
      "s3": (3, 4),
      "t3": (1, 1, 4),
      "v": (4, 3),
    }
  )

  def forward(p, x):  # x: (batch, 3, 3)
    h = x @ p["w"]  # repeated dense: (batch, 3, 4)
    h = jnp.tanh(h * p["s1"] + p["t1"])  # both
    h = jnp.tanh(p["s2"] * h)  # scale only, leading 1
    h = jnp.tanh(h * p["s3"])  # scale over two trailing axes
    h = jnp.tanh(p["t2"] + h)  # shift only
    h = jnp.tanh(h + p["t3"])  # shift, batch-aligned 1
    return jnp.mean(h, axis=1) @ p["v"]

  report = report_of(_loss(forward), (p, _batch((5, 3, 3))))
  ss = "scale_and_shift_tag"
  assert layers(report) == {
    ("repeated_dense_tag", "w"),
    (ss, "s1", "t1"),
    (ss, "s2"),
    (ss, "s3"),
    (ss, "t2"),
    (ss, "t3"),
    ("dense_tag", "v"),
  }


def test_unusual_parameters_get_generic_tags():
  p = _init(
    {
      "w": (4, 3),
      "b": (3,),
      "temperature": (),
      "log_scale": (3,),
      "w_t": (3, 3),
      "shared": (3, 3),
      "gate": (1,),
      "beta": (),
    }
  )

  def forward(p, x):
    h = jnp.tanh((x @ p["w"] + p["b"]) * jnp.exp(p["log_scale"]))
    h = h @ p["w_t"].T  # transposed weight
    h = jnp.tanh(h @ p["shared"]) @ p["shared"]  # shared weight
    h = h * p["gate"] + h * p["beta"]  # scalar gates
    return h / p["temperature"]  # learned temperature

  report = report_of(_loss(forward), (p, _batch((4, 4))))
  assert layers(report) == {("dense_tag", "b", "w")} | {
    ("generic_tag", n)
    for n in ("temperature", "log_scale", "w_t", "shared", "gate", "beta")
  }
  sources = {_short(r["path"]): r["source"] for r in report}
  assert sources["shared"] == (
    "shared by 2 layers: dense_no_bias (output "
    "(4, 3)) and dense_no_bias (output (4, 3))"
  )
  assert sources["w_t"] == (  # one use, transposed
    "unmatched: no layer pattern fits its use by dot_general of its "
    "transpose (output (4, 3))"
  )
  shared = report_of(
    _loss(forward), (p, _batch((4, 4))), allow_multiple_registrations=True
  )
  assert ("dense_tag", "shared") in layers(shared)


def test_weight_decay_inside_the_function_does_not_hide_layers():
  p = _init({"w": (4, 3), "b": (3,)})

  def loss_fn(p, batch):
    return _loss(lambda p, x: x @ p["w"] + p["b"])(p, batch) + 1e-3 * sum(
      jnp.sum(v**2) for v in jax.tree.leaves(p)
    )

  assert layers(report_of(loss_fn, (p, _batch((4, 4))))) == {
    ("dense_tag", "b", "w")
  }


# --- agreement with hand registration ------------------------------------


@pytest.mark.parametrize("name", list(gt.MODELS))
def test_auto_tags_equal_hand_written_tags(name):
  problem = gt.MODELS[name]()
  register = gt.LOSSES["softmax" if name != "scale_shift" else "squared"][0]

  def untagged(p, batch):
    return jnp.sum(register(problem.forward(p, batch[0]), batch[1]))

  args = (problem.params, problem.batch)
  hand = kfac.ProcessedJaxpr.make_from_func(problem.tagged, args)
  auto = kfac.ProcessedJaxpr.make_from_func(untagged, args)
  assert auto.layer_indices == hand.layer_indices
  assert [e.primitive for e in auto.layer_tags] == [
    e.primitive for e in hand.layer_tags
  ]
  for a, h in zip(auto.layer_tags, hand.layer_tags):
    assert a.params == h.params


def test_estimator_registers_layers_by_default():
  problem = gt.scale_shift_net()
  register = gt.LOSSES["squared"][0]

  def untagged(p, batch):
    return jnp.sum(register(problem.forward(p, batch[0]), batch[1]))

  @jax.jit
  def curvature(args):
    matrices = []
    for func in (untagged, problem.tagged):
      est = kfac.BlockDiagonalCurvature(func)
      matrices.append(gt.one_batch_dense(est, args, 5))
    return matrices

  auto, hand = curvature((problem.params, problem.batch))
  np.testing.assert_allclose(auto, hand, rtol=1e-10)


def test_full_blocks_on_auto_tags_equal_the_exact_ggn_blocks():
  def forward(x):
    x = jnp.tanh(hk.LayerNorm(-1, True, True)(hk.Linear(5)(x)))
    x = hk.RMSNorm(-1)(hk.Linear(4, with_bias=False)(x))
    return hk.Linear(3)(jnp.tanh(x))

  model = hk.transform(forward)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(6, 4))
  t = np.arange(6) % 3
  params = jax.jit(model.init)(jax.random.PRNGKey(0), x)
  problem = gt.Problem(
    None,
    lambda p, x: model.apply(p, None, x),
    gt.LOSSES["softmax"][1],
    params,
    (x, t),
  )

  def untagged(p, batch):
    return jnp.sum(
      kfac.register_softmax_cross_entropy_loss(
        problem.forward(p, batch[0]), batch[1]
      )
    )

  args = (params, (x, t))
  owner = np.concatenate(
    [
      np.full(int(np.prod(r["shape"])), r["layer"])
      for r in report_of(untagged, args)
    ]
  )
  ctors = {
    "dense_tag": kfac.DenseFull,
    "scale_and_shift_tag": kfac.ScaleAndShiftFull,
  }

  @jax.jit
  def curvature(args):
    est = kfac.BlockDiagonalCurvature(untagged, layer_tag_to_block_ctor=ctors)
    return gt.one_batch_dense(est, args, 6), problem.ggn()

  estimate, ggn = curvature(args)
  np.testing.assert_allclose(
    estimate, ggn * (owner[:, None] == owner), rtol=1e-8, atol=1e-10
  )


# --- embeddings ------------------------------------------------------------

VOCAB = 7
LOOKUPS = {
  "one_hot": lambda table, ids: jax.nn.one_hot(ids, VOCAB, dtype=table.dtype)
  @ table,
  "index": lambda table, ids: table[ids],
  "take": lambda table, ids: jnp.take(table, ids, axis=0),
  "take_clip": lambda table, ids: jnp.take(table, ids, axis=0, mode="clip"),
}


def _token_model(lookup):
  """Class logits from the embeddings of two tokens per example."""

  def loss_fn(p, batch):
    ids, t = batch
    h = jnp.tanh(lookup(p["table"], ids)).reshape(len(ids), -1)
    return _loss(lambda p, h: h @ p["out"])(p, (h, t))

  return loss_fn


def test_embedding_lookups_register_alike_however_written():
  rng = np.random.default_rng(0)
  params = {
    "table": rng.normal(size=(VOCAB, 3)),
    "out": rng.normal(size=(6, 3)),
  }
  args = (
    params,
    (np.array([[1, 4], [4, 4], [0, 6], [1, 2], [6, 1]]), np.arange(5) % 3),
  )
  reports = {
    name: report_of(_token_model(lookup), args)
    for name, lookup in LOOKUPS.items()
  }
  for name, report in reports.items():
    assert [(r["path"], r["tag"], r["layer"]) for r in report] == [
      ("['out']", "dense_tag", 1),
      ("['table']", "embedding_tag", 0),
    ], name
    assert report[1]["source"] == (
      "embedding" if name == "one_hot" else "embedding_gather"
    ), name

  @jax.jit
  def curvatures(args):
    out = []
    for lookup in LOOKUPS.values():
      est = kfac.BlockDiagonalCurvature(_token_model(lookup))
      out.append(gt.one_batch_dense(est, args, 5))
    return out

  first, *others = curvatures(args)
  assert np.abs(first[-21:, -21:]).max() > 0.1  # the table's block
  for other in others:
    np.testing.assert_allclose(other, first, rtol=1e-12, atol=1e-14)
  # A gather of columns is no row lookup.
  columns = {"table": params["table"].T, "out": params["out"]}
  report = report_of(
    _token_model(
      lambda table, ids: jnp.moveaxis(jnp.take(table, ids, axis=1), 0, -1)
    ),
    (columns, args[1]),
  )
  assert [r["tag"] for r in report] == ["dense_tag", "generic_tag"]


def test_a_parameter_two_layers_use_is_reported_as_shared():
  """Tied embeddings: the table feeds a lookup and, transposed, the output
  layer; no block of either layer's kind covers both uses."""

  def loss_fn(p, batch):
    ids, t = batch
    h = jnp.tanh(p["table"][ids].sum(axis=1))
    return _loss(lambda p, h: h @ p["table"].T)(p, (h, t))

  params = {"table": np.ones((VOCAB, 3))}
  args = (params, (np.zeros((5, 2), np.int32), np.arange(5) % VOCAB))
  (row,) = report_of(loss_fn, args)
  assert row["tag"] == "generic_tag"
  assert row["source"] == (
    "shared by 2 layers: embedding_gather (output (5, 2, 3)) and "
    "dot_general of its transpose (output (5, 7))"
  )
  (row,) = report_of(loss_fn, args, allow_multiple_registrations=True)
  assert (row["tag"], row["source"]) == ("embedding_tag", "embedding_gather")


# --- options, manual tags and errors ----------------------------------------


def test_manual_registrations_take_precedence():
  p = _init({"w1": (4, 3), "b1": (3,), "w2": (3, 3)})

  def forward(p, x):
    h = x @ p["w1"] + p["b1"]
    h = kfac.register_dense(h, x, p["w1"])  # the bias is left out on purpose
    return jnp.tanh(h) @ p["w2"]

  report = report_of(_loss(forward), (p, _batch((4, 4))))
  assert layers(report) == {
    ("dense_tag", "w1"),
    ("dense_tag", "w2"),
    ("scale_and_shift_tag", "b1"),
  }
  assert {r["path"]: r["source"] for r in report}["['w1']"] == "manual"


def test_conflicting_manual_registrations():
  p = _init({"w": (4, 3)})

  def forward(p, x):
    y = kfac.register_dense(x @ p["w"], x, p["w"])
    return kfac.register_generic(p["w"]) * 0 + y

  with pytest.raises(ValueError, match=r"\['w'\] is registered in two"):
    report_of(_loss(forward), (p, _batch((4, 4))))
  report = report_of(
    _loss(forward), (p, _batch((4, 4))), allow_multiple_registrations=True
  )
  assert layers(report) == {("dense_tag", "w")}
  proc = kfac.ProcessedJaxpr.make_from_func(
    _loss(forward), (p, _batch((4, 4))), allow_multiple_registrations=True
  )
  assert [e.primitive.name for e in proc.layer_tags] == ["dense_tag"]


def test_no_loss_registered():
  p = _init({"w": (4, 3)})
  with pytest.raises(ValueError, match="registers no loss"):
    gm.auto_register_tags(lambda p, x: x @ p["w"], (p, np.ones((2, 4))))


def test_pattern_whose_example_args_do_not_trace():
  bad = gm.GraphPattern(
    name="bad_dense",
    tag_primitive=tags.dense,
    compute_func=gm.dense_layer,
    parameters_extractor_func=lambda eqns: {},
    example_args=[np.zeros([11, 13]), [np.zeros([12, 7])]],
  )
  p = _init({"w": (4, 3)})
  with pytest.raises(ValueError, match="'bad_dense'.*could not be traced"):
    report_of(
      _loss(lambda p, x: x @ p["w"]), (p, _batch((4, 4))), graph_patterns=(bad,)
    )


def test_register_only_generic_and_patterns_to_skip():
  p = _init({"w1": (5, 4), "b1": (4,), "w2": (4, 4), "b2": (4,), "w3": (4, 3)})
  args = (p, _batch((6, 5)))
  generic = report_of(_loss(_plain_mlp), args, register_only_generic=True)
  assert {r["tag"] for r in generic} == {"generic_tag"} and len(generic) == 5
  skipped = report_of(
    _loss(_plain_mlp), args, patterns_to_skip=("dense_with_bias",)
  )
  assert layers(skipped) == {
    ("dense_tag", "w1"),
    ("dense_tag", "w2"),
    ("dense_tag", "w3"),
    ("scale_and_shift_tag", "b1"),
    ("scale_and_shift_tag", "b2"),
  }
  with pytest.raises(
    ValueError,
    match=r"unknown graph patterns \['dense'\]"
    r".*'dense_no_bias', .*'dense_with_bias'",
  ):
    report_of(_loss(_plain_mlp), args, patterns_to_skip=("dense",))


def test_default_patterns_have_the_documented_names():
  documented = [
    "dense_with_bias",
    "dense_no_bias",
    "conv2d_with_bias",
    "conv2d_no_bias",
    "scale_and_shift_broadcast_1",
    "scale_and_shift_broadcast_0",
    "normalization_haiku_broadcast_1",
    "normalization_haiku_broadcast_0",
    "scale_only_broadcast_1",
    "scale_only_broadcast_0",
    "shift_only_broadcast_1",
    "shift_only_broadcast_0",
  ]
  names = [p.name for p in gm.DEFAULT_GRAPH_PATTERNS]
  assert [n for n in names if n in documented] == documented
  # The additions: Haiku norms without an offset (e.g. RMSNorm), dense
  # layers on output-major weights (einsum, Equinox), and embedding
  # lookups as one-hot matmuls or gathers (Equinox's too).
  assert set(names) - set(documented) == {
    "normalization_haiku_scale_only_broadcast_1",
    "normalization_haiku_scale_only_broadcast_0",
    "dense_transposed_with_bias",
    "dense_transposed_no_bias",
    "dense_weight_first_with_bias",
    "dense_weight_first_no_bias",
    "embedding",
    "embedding_gather",
    "embedding_row_gather",
  }


def test_broadcast_0_and_1_patterns_split_scale_and_shift_layers():
  p = _init({"w": (3, 4), "s": (4,), "t": (4,), "v": (4, 3)})
  one = _init({"w": (3, 4), "s": (1, 4), "t": (1, 4), "v": (4, 3)})

  def forward(p, x):
    return jnp.tanh(jnp.tanh(x @ p["w"]) * p["s"] + p["t"]) @ p["v"]

  def sources(params, batch, **kwargs):
    report = report_of(_loss(forward), (params, _batch((batch, 3))), **kwargs)
    return {_short(r["path"]): r["source"] for r in report}

  # Parameters broadcast over the batch, or (batch of one) used at the
  # output's own shape.
  assert sources(p, 5)["s"] == "scale_and_shift_broadcast_1"
  assert sources(one, 1)["s"] == "scale_and_shift_broadcast_0"
  assert (
    sources(one, 1, patterns_to_skip=("scale_and_shift_broadcast_1",))["t"]
    == "scale_and_shift_broadcast_0"
  )
  # Without the broadcast pattern, the layer splits into a scale and a shift.
  split = sources(p, 5, patterns_to_skip=("scale_and_shift_broadcast_1",))
  assert (split["s"], split["t"]) == (
    "scale_only_broadcast_1",
    "shift_only_broadcast_1",
  )


def test_compute_only_loss_tags_skips_work_the_loss_does_not_need():
  p = _init({"w": (4, 3), "b": (3,), "unused": (3,)})

  def loss_fn(p, batch):
    value = _loss(lambda p, x: x @ p["w"] + p["b"])(p, batch)
    return value, jnp.sin(p["unused"]).sum()

  args = (p, _batch((4, 4)))
  only = jax.make_jaxpr(gm.auto_register_tags(loss_fn, args))(*args)
  assert "sin" not in {e.primitive.name for e in only.eqns}
  full = gm.auto_register_tags(loss_fn, args, compute_only_loss_tags=False)
  jax.tree.map(np.testing.assert_allclose, full(*args), loss_fn(*args))
  assert {r["path"]: r["tag"] for r in full.registrations(*args)}[
    "['unused']"
  ] == "generic_tag"


def test_custom_pattern_from_the_internals_guide():
  def _dense_parameter_extractor(eqns):
    for eqn in eqns:
      if eqn.primitive.name == "dot_general":
        return dict(**eqn.params)
    raise AssertionError()

  dense_with_bias_pattern = kfac.graph_matcher.GraphPattern(
    name="dense_with_bias",
    tag_primitive=tags.dense,
    precedence=0,
    compute_func=gm.dense_layer,
    parameters_extractor_func=_dense_parameter_extractor,
    example_args=[np.zeros([11, 13]), [np.zeros([13, 7]), np.zeros([7])]],
  )
  p = _init({"w1": (5, 4), "b1": (4,), "w2": (4, 4), "b2": (4,), "w3": (4, 3)})
  args = (p, _batch((6, 5)))
  proc = kfac.ProcessedJaxpr.make_from_func(
    _loss(_plain_mlp),
    args,
    graph_patterns=(dense_with_bias_pattern,) + gm.DEFAULT_GRAPH_PATTERNS,
  )
  metas = [e.params for e in proc.layer_tags]
  assert [("dimension_numbers" in m) for m in metas] == [True, True, False]
  # `graph_patterns` is the whole list: alone, the custom pattern leaves the
  # bias-free layer to a generic tag.
  alone = report_of(
    _loss(_plain_mlp), args, graph_patterns=(dense_with_bias_pattern,)
  )
  assert layers(alone) == {
    ("dense_tag", "b1", "w1"),
    ("dense_tag", "b2", "w2"),
    ("generic_tag", "w3"),
  }


def test_report_is_logged(caplog):
  p = _init({"w": (4, 3), "b": (3,)})
  with caplog.at_level(logging.INFO, logger="estimators.graph_matcher"):
    report_of(_loss(lambda p, x: x @ p["w"] + p["b"]), (p, _batch((4, 4))))
  assert "Graph parameter registrations:" in caplog.text
  assert "['w'] -> dense_tag (dense_with_bias" in caplog.text


def test_new_argument_shapes_are_matched_again():
  p = _init({"w": (4, 3), "b": (3,)})
  forward = lambda p, x: jnp.mean(
    x @ p["w"] + p["b"],
    axis=tuple(range(1, x.ndim - 1)),
  )
  tagged = gm.auto_register_tags(_loss(forward), (p, _batch((4, 4))))
  for shape in [(4, 4), (2, 5, 4)]:
    jaxpr = jax.make_jaxpr(tagged)(p, _batch(shape))
    names = {e.primitive.name for e in jaxpr.eqns}
    assert ("dense_tag" if len(shape) == 2 else "repeated_dense_tag") in names


# --- layer stacks: layers applied by a scan over stacked parameters --------


def _scanned_net(p, batch, manual=False):
  """An MLP whose middle layers are one `lax.scan` over stacked weights."""
  x, t = batch

  def layer(h, wb):
    z = h @ wb[0] + wb[1]
    if manual:
      z = kfac.register_dense(z, h, *wb)
    return jnp.tanh(z), None

  h, _ = lax.scan(layer, jnp.tanh(x @ p["w0"] + p["b0"]), (p["ws"], p["bs"]))
  out = kfac.register_softmax_cross_entropy_loss(h @ p["w1"] + p["b1"], t)
  return jnp.sum(out)


def _unrolled(p):
  flat = {k: v for k, v in p.items() if k not in ("ws", "bs")}
  flat.update({f"w_{i}": p["ws"][i] for i in range(gt.STACK)})
  flat.update({f"b_{i}": p["bs"][i] for i in range(gt.STACK)})
  return flat


def _unrolled_net(p, batch):
  x, t = batch
  h = jnp.tanh(x @ p["w0"] + p["b0"])
  for i in range(gt.STACK):
    h = jnp.tanh(h @ p[f"w_{i}"] + p[f"b_{i}"])
  out = kfac.register_softmax_cross_entropy_loss(h @ p["w1"] + p["b1"], t)
  return jnp.sum(out)


def _dense_curvature(func, params, batch, mode, family):
  est = kfac.BlockDiagonalCurvature(
    func, layer_tag_to_block_ctor={"dense_tag": family}
  )
  return gt.one_batch_dense(est, (params, batch), len(batch[0]), mode)


@pytest.mark.parametrize("mode", ["ggn_exact", "fisher_exact"])
@pytest.mark.parametrize(
  "family", [kfac.DenseTwoKroneckerFactored, kfac.DenseDiagonal, kfac.DenseFull]
)
def test_layer_stack_curvature_equals_the_unrolled_and_hand_tagged_twins(
  mode, family
):
  params = gt.layer_stack_params()
  batch = (np.random.default_rng(1).normal(size=(5, 4)), np.arange(5) % 2)
  auto, manual = (
    jax.jit(
      functools.partial(
        _dense_curvature,
        functools.partial(_scanned_net, manual=m),
        mode=mode,
        family=family,
      )
    )(params, batch)
    for m in (False, True)
  )
  unrolled = jax.jit(
    functools.partial(_dense_curvature, _unrolled_net, mode=mode, family=family)
  )(_unrolled(params), batch)
  # Where each stacked-model coordinate sits in the unrolled model's vector.
  flat_index, unravel = jax.flatten_util.ravel_pytree(params)
  order = jax.flatten_util.ravel_pytree(
    _unrolled(unravel(np.arange(flat_index.size, dtype=np.float64)))
  )[0].astype(int)
  np.testing.assert_allclose(auto, manual, rtol=1e-12, atol=1e-14)
  np.testing.assert_allclose(
    auto[np.ix_(order, order)], unrolled, rtol=1e-10, atol=1e-12
  )


def test_layer_stack_cached_inverse_and_eigenvalues_equal_the_unrolled_twin():
  params = gt.layer_stack_params()
  batch = (np.random.default_rng(1).normal(size=(5, 4)), np.arange(5) % 2)

  @functools.partial(jax.jit, static_argnums=0)
  def run(func, params, vector):
    est = kfac.BlockDiagonalCurvature(func)
    args = (params, batch)
    state = est.init(
      jax.random.PRNGKey(0),
      args,
      exact_powers_to_cache=-1,
      cache_eigenvalues=True,
    )
    state = est.update_curvature_matrix_estimate(
      state,
      0.0,
      1.0,
      5,
      jax.random.PRNGKey(1),
      args,
      estimation_mode="fisher_exact",
    )
    state = est.update_cache(state, 0.1, exact_powers=-1, eigenvalues=True)
    return (
      est.multiply_inverse(state, vector, 0.1, use_cached=True),
      jnp.sort(est.eigenvalues(state, use_cached=True)),
      jnp.sort(est.eigenvalues(state)),
    )

  vector = jax.tree.map(np.cos, gt.layer_stack_params(np.random.default_rng(2)))
  inv, eig_cached, eig = run(_scanned_net, params, vector)
  twin = run(_unrolled_net, _unrolled(params), _unrolled(vector))
  jax.tree.map(
    functools.partial(np.testing.assert_allclose, rtol=1e-10),
    _unrolled(inv),
    twin[0],
  )
  np.testing.assert_allclose(eig_cached, twin[1], rtol=1e-10, atol=1e-14)
  np.testing.assert_allclose(eig, twin[2], rtol=1e-10, atol=1e-14)


def test_layer_stack_full_blocks_equal_the_exact_ggn_blocks():
  params = gt.layer_stack_params()
  batch = (np.random.default_rng(1).normal(size=(5, 4)), np.arange(5) % 2)
  estimate = _dense_curvature(
    _scanned_net, params, batch, "ggn_exact", kfac.DenseFull
  )

  def logits(p, x):
    h = jnp.tanh(x @ p["w0"] + p["b0"])
    h, _ = lax.scan(
      lambda h, wb: (jnp.tanh(h @ wb[0] + wb[1]), None), h, (p["ws"], p["bs"])
    )
    return h @ p["w1"] + p["b1"]

  ggn = gt.Problem(None, logits, gt.LOSSES["softmax"][1], params, batch).ggn()
  # Each layer of the stack is its own block: label every coordinate.
  labels = {
    "w0": 0,
    "b0": 0,
    "w1": 1,
    "b1": 1,
    "ws": 2 + np.arange(gt.STACK)[:, None, None] + np.zeros((1, 3, 3)),
    "bs": 2 + np.arange(gt.STACK)[:, None] + np.zeros((1, 3)),
  }
  owner = jax.flatten_util.ravel_pytree(
    jax.tree.map(
      lambda p, label: np.broadcast_to(label, np.shape(p)).astype(float),
      params,
      labels,
    )
  )[0]
  np.testing.assert_allclose(
    estimate, ggn * (owner[:, None] == owner), rtol=1e-8, atol=1e-10
  )


def test_stacked_weight_used_outside_its_scan_is_generic():
  def tied(p, batch):  # the first stacked weight also feeds the output
    x, t = batch
    h, _ = lax.scan(
      lambda h, wb: (jnp.tanh(h @ wb[0] + wb[1]), None),
      jnp.tanh(x @ p["w0"] + p["b0"]),
      (p["ws"], p["bs"]),
    )
    out = h @ p["w1"] + p["b1"] + p["ws"][0, 0, :2]
    return jnp.sum(kfac.register_softmax_cross_entropy_loss(out, t))

  params = gt.layer_stack_params()
  batch = (np.ones((5, 4)), np.arange(5) % 2)
  report = {_short(r["path"]): r for r in report_of(tied, (params, batch))}
  # The shifts left alone in the scan still form stacked layers.
  assert {k: (r["tag"], r["stacked"]) for k, r in report.items()} == {
    "ws": ("generic_tag", None),
    "bs": ("scale_and_shift_tag", gt.STACK),
    "w0": ("dense_tag", None),
    "b0": ("dense_tag", None),
    "w1": ("dense_tag", None),
    "b1": ("dense_tag", None),
  }
  assert report["ws"]["source"] == (
    "shared by 2 layers: dense_with_bias with ['bs'] (output (5, 3)) and "
    "slice (output (1, 1, 2))"
  )
  matrix = _dense_curvature(
    tied, params, batch, "ggn_exact", kfac.DenseDiagonal
  )
  assert np.all(np.isfinite(matrix)) and np.trace(matrix) > 0


def test_model_with_a_learned_temperature_and_a_layer_stack_trains():
  params = dict(gt.layer_stack_params(), temperature=np.array(0.5))
  rng = np.random.default_rng(3)
  x = rng.normal(size=(32, 4))
  batch = (x, (x[:, 0] + x[:, 1] > 0).astype(int))

  def loss_fn(p, batch):
    x, t = batch
    h = jnp.tanh(x @ p["w0"] + p["b0"])
    h, _ = lax.scan(
      lambda h, wb: (jnp.tanh(h @ wb[0] + wb[1]), None), h, (p["ws"], p["bs"])
    )
    logits = kfac.register_softmax_cross_entropy_loss(
      (h @ p["w1"] + p["b1"]) / p["temperature"], t
    )
    return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(len(t)), t])

  opt = kfac.Optimizer(
    jax.value_and_grad(loss_fn),
    l2_reg=0.0,
    use_adaptive_learning_rate=True,
    use_adaptive_momentum=True,
    use_adaptive_damping=True,
    initial_damping=1.0,
  )
  state = opt.init(params, jax.random.PRNGKey(0), batch)
  assert {type(b).__name__ for b in opt.estimator.blocks} == {
    "NaiveDiagonal",
    "DenseTwoKroneckerFactored",
    "Stacked",
  }
  first = float(loss_fn(params, batch))
  for i in range(15):
    params, state, stats = opt.step(
      params, state, jax.random.PRNGKey(i), batch=batch
    )
    assert np.isfinite(stats["loss"])
  assert float(loss_fn(params, batch)) < 0.5 * first
  assert float(params["temperature"]) != 0.5
