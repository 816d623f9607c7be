"""Small tagged models and brute-force curvature matrices (float64).

Each model is written twice in effect: `forward(params, x)` is plain JAX, and
`tagged(params, batch)` is the same computation with layer tags and a loss
registration. Ground truth uses only `forward`, `jax.jacobian` and
`jax.hessian` on hand-written per-example losses.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
from jax import lax

import estimators as kfac
from curvbench.core import curvatures

# --- per-example losses: (registration, per-example loss of (z, t)) ----------


def softmax_cross_entropy(z, t):
  """Softmax cross-entropy of one example's logits `z` at its label `t`."""
  return -jax.nn.log_softmax(z)[t]


def _sigmoid_xent(z, t):
  return jnp.sum(jnp.logaddexp(0, z) - t * z)


def _squared(z, t, weight=1.0):
  return weight * jnp.sum((t - z) ** 2)


LOSSES = {
  "softmax": (
    lambda z, t: kfac.register_softmax_cross_entropy_loss(z, t),
    softmax_cross_entropy,
    "int",
  ),
  "categorical": (
    lambda z, t: kfac.register_categorical_predictive_distribution(z, t),
    softmax_cross_entropy,
    "int",
  ),
  "sigmoid": (
    lambda z, t: kfac.register_sigmoid_cross_entropy_loss(z, t),
    _sigmoid_xent,
    "binary",
  ),
  "squared": (
    lambda z, t: kfac.register_squared_error_loss(z, t, weight=0.7),
    lambda z, t: _squared(z, t, 0.7),
    "real",
  ),
  "normal": (
    lambda z, t: kfac.register_normal_predictive_distribution(
      z, t, variance=2.0
    ),
    lambda z, t: jnp.sum((t - z) ** 2) / (2 * 2.0),
    "real",
  ),
}


def make_targets(kind, rng, batch, k):
  if kind == "int":
    return jax.random.randint(rng, (batch,), 0, k)
  if kind == "binary":
    return jax.random.bernoulli(rng, 0.5, (batch, k)).astype(jnp.float64)
  return jax.random.normal(rng, (batch, k))


@dataclasses.dataclass
class Problem:
  tagged: Callable  # (params, batch) -> scalar, with tags
  forward: Callable  # (params, x) -> outputs z, plain JAX
  per_example_loss: Callable  # (z_i, t_i) -> scalar
  params: dict
  batch: tuple  # (x, t); x an array or a tuple of arrays
  tagged_forward: Callable = None  # (params, x) -> outputs z, with layer tags

  @property
  def flat_params(self):
    return jax.flatten_util.ravel_pytree(self.params)

  def ggn(self):
    """mean_i J_iᵀ H_i J_i, J_i the Jacobian of example i's outputs."""
    flat, unravel = self.flat_params
    x, t = self.batch

    def one(xi, ti):
      z_of = lambda p: self.forward(unravel(p), _as_batch(xi))[0]
      jac = jax.jacobian(z_of)(flat).reshape(-1, flat.size)
      z = z_of(flat)
      hess = jax.hessian(self.per_example_loss)(z, ti).reshape(
        jac.shape[0], jac.shape[0]
      )
      return jac.T @ hess @ jac

    return jnp.mean(jax.vmap(one)(x, t), axis=0)

  def per_example_grads(self):
    flat, unravel = self.flat_params
    x, t = self.batch

    def loss(p, xi, ti):
      return self.per_example_loss(
        self.forward(unravel(p), _as_batch(xi))[0], ti
      )

    return jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))(flat, x, t)

  def empirical_fisher(self):
    g = self.per_example_grads()
    return g.T @ g / g.shape[0]

  def hessian(self):
    flat, unravel = self.flat_params
    x, t = self.batch

    def mean_loss(p):
      z = self.forward(unravel(p), x)
      return jnp.mean(jax.vmap(self.per_example_loss)(z, t))

    return jax.hessian(mean_loss)(flat)


def _as_batch(example):
  """One example (an array, or a tuple of arrays) as a batch of one."""
  return jax.tree.map(lambda a: a[None], example)


def _problem(register, per_example, layers, params, batch):
  """A Problem from `layers(params, x, tag)` and a loss registration."""

  def tagged(p, batch):
    x, t = batch
    z = register(layers(p, x, True), t)
    return jnp.mean(jax.vmap(per_example)(z, t))

  return Problem(
    tagged,
    lambda p, x: layers(p, x, False),
    per_example,
    params,
    batch,
    lambda p, x: layers(p, x, True),
  )


def _init(rng, shapes):
  keys = jax.random.split(rng, len(shapes))
  return {
    name: 0.5 * jax.random.normal(k, s)
    for k, (name, s) in zip(keys, shapes.items())
  }


def mlp(
  loss="softmax",
  batch=6,
  d_in=4,
  hidden=5,
  k=3,
  seed=0,
  bias=True,
  activation=jnp.tanh,
):
  register, per_example, target_kind = LOSSES[loss]
  rng = jax.random.PRNGKey(seed)
  shapes = {"w1": (d_in, hidden), "w2": (hidden, k)}
  if bias:
    shapes |= {"b1": (hidden,), "b2": (k,)}
  params = _init(rng, shapes)
  x = jax.random.normal(jax.random.fold_in(rng, 1), (batch, d_in))
  t = make_targets(target_kind, jax.random.fold_in(rng, 2), batch, k)

  def layers(p, x, tag):
    h = x @ p["w1"] + (p["b1"] if bias else 0)
    if tag:
      h = kfac.register_dense(h, x, p["w1"], p.get("b1"))
    a = activation(h)
    z = a @ p["w2"] + (p["b2"] if bias else 0)
    if tag:
      z = kfac.register_dense(z, a, p["w2"], p.get("b2"))
    return z

  return _problem(register, per_example, layers, params, (x, t))


def convnet(
  loss="softmax",
  batch=3,
  data_format="NHWC",
  k=3,
  seed=0,
  padding="SAME",
  strides=2,
):
  register, per_example, target_kind = LOSSES[loss]
  rng = jax.random.PRNGKey(seed)
  kernel = "HWIO" if data_format == "NHWC" else "OIHW"
  kshape = (3, 3, 2, 3) if kernel == "HWIO" else (3, 2, 3, 3)
  xshape = (batch, 6, 6, 2) if data_format == "NHWC" else (batch, 2, 6, 6)
  params = _init(rng, {"k": kshape, "kb": (3,)})
  x = jax.random.normal(jax.random.fold_in(rng, 1), xshape)
  dn = (data_format, kernel, data_format)
  feat = jax.eval_shape(
    lambda: lax.conv_general_dilated(
      x, params["k"], (strides, strides), padding, dimension_numbers=dn
    )
  ).shape
  params |= _init(
    jax.random.fold_in(rng, 3), {"w": (int(np.prod(feat[1:])), k), "b": (k,)}
  )
  t = make_targets(target_kind, jax.random.fold_in(rng, 2), batch, k)
  bias_shape = (1, 1, 1, 3) if data_format == "NHWC" else (1, 3, 1, 1)

  def layers(p, x, tag):
    h = lax.conv_general_dilated(
      x, p["k"], (strides, strides), padding, dimension_numbers=dn
    )
    h = h + p["kb"].reshape(bias_shape)
    if tag:
      h = kfac.register_conv2d(
        h,
        x,
        p["k"],
        p["kb"],
        window_strides=strides,
        padding=padding,
        data_format=data_format,
      )
    a = jnp.tanh(h).reshape(x.shape[0], -1)
    z = a @ p["w"] + p["b"]
    if tag:
      z = kfac.register_dense(z, a, p["w"], p["b"])
    return z

  return _problem(register, per_example, layers, params, (x, t))


def scale_shift_net(loss="squared", batch=5, seed=0):
  register, per_example, target_kind = LOSSES[loss]
  rng = jax.random.PRNGKey(seed)
  params = _init(
    rng, {"w1": (3, 4), "b1": (4,), "scale": (4,), "shift": (4,), "w2": (4, 2)}
  )
  params["scale"] = params["scale"] + 1.0
  x = jax.random.normal(jax.random.fold_in(rng, 1), (batch, 3))
  t = make_targets(target_kind, jax.random.fold_in(rng, 2), batch, 2)

  def layers(p, x, tag):
    h = x @ p["w1"] + p["b1"]
    if tag:
      h = kfac.register_dense(h, x, p["w1"], p["b1"])
    s = h * p["scale"] + p["shift"]
    if tag:
      s = kfac.register_scale_and_shift(s, h, p["scale"], p["shift"])
    z = jnp.tanh(s) @ p["w2"]
    if tag:
      z = kfac.register_dense(z, jnp.tanh(s), p["w2"])
    return z

  return _problem(register, per_example, layers, params, (x, t))


# The models above by name, each built with its defaults (the convnet also
# channels-first with unit strides and VALID padding).
MODELS = {
  "mlp": mlp,
  "convnet": convnet,
  "convnet_nchw": functools.partial(
    convnet, data_format="NCHW", padding="VALID", strides=1
  ),
  "scale_shift": scale_shift_net,
}


def deep_linear(batch=7, seed=0):
  """Three bias-free linear layers and squared error."""
  rng = jax.random.PRNGKey(seed)
  params = _init(rng, {"w1": (4, 3), "w2": (3, 3), "w3": (3, 2)})
  x = jax.random.normal(jax.random.fold_in(rng, 1), (batch, 4))
  t = jax.random.normal(jax.random.fold_in(rng, 2), (batch, 2))

  def layers(p, x, tag):
    for name in ("w1", "w2", "w3"):
      y = x @ p[name]
      x = kfac.register_dense(y, x, p[name]) if tag else y
    return x

  def tagged(p, batch):
    x, t = batch
    z = kfac.register_squared_error_loss(layers(p, x, True), t)
    return jnp.mean(jnp.sum((t - z) ** 2, -1))

  return Problem(
    tagged,
    lambda p, x: layers(p, x, False),
    lambda z, t: _squared(z, t),
    params,
    (x, t),
  )


def random_normal(seed, *shape):
  """A standard normal array of `shape`, reproducible from `seed`."""
  return jnp.asarray(np.random.RandomState(seed).standard_normal(shape))


def conv2d_layer(fmt, strides, padding, bias=True, batch=3, spatial=(6, 5)):
  """A tagged 3x2 convolution, 2 -> 3 channels, in either layout.

  Returns:
    `(tag equation, x, params, layer)`, `layer(x, params)` the plain
    convolution and `params` the kernel (then the bias).
  """
  dn = (fmt, "HWIO" if fmt == "NHWC" else "OIHW", fmt)
  kshape = (3, 2, 2, 3) if fmt == "NHWC" else (3, 2, 3, 2)
  xshape = (batch, *spatial, 2) if fmt == "NHWC" else (batch, 2, *spatial)
  bias_shape = (1, 1, 1, -1) if fmt == "NHWC" else (1, -1, 1, 1)
  params = (random_normal(1, *kshape),) + (
    (random_normal(2, 3),) if bias else ()
  )
  x = random_normal(3, *xshape)

  def layer(x, p):
    y = lax.conv_general_dilated(
      x, p[0], (strides,) * 2, padding, dimension_numbers=dn
    )
    return y + p[1].reshape(bias_shape) if len(p) > 1 else y

  def tagged(x, *p):
    return kfac.register_conv2d(
      layer(x, p),
      x,
      *p,
      window_strides=strides,
      padding=padding,
      data_format=fmt,
    )

  jaxpr = jax.make_jaxpr(tagged)(x, *params).jaxpr
  eqn = next(e for e in jaxpr.eqns if kfac.tags.is_layer_tag_eqn(e))
  return eqn, x, params, layer


def numpy_psd_power(matrix, power):
  """`matrix ** power` in numpy, through an eigendecomposition.

  The matrix is symmetrised and its eigenvalues clipped at zero first.
  """
  values, vectors = np.linalg.eigh((matrix + matrix.T) / 2)
  return (vectors * np.maximum(values, 0) ** power) @ vectors.T


def softmax_ggn(jac, logits):
  """The GGN of the mean softmax cross-entropy over N outputs.

  `jac` is the (N, C, P) Jacobian of the logits in the flat parameters and
  `logits` their (N, C) values.
  """
  p = jax.nn.softmax(logits)
  h = jax.vmap(jnp.diag)(p) - p[:, :, None] * p[:, None, :]
  return jnp.einsum("nci,ncd,ndj->ij", jac, h, jac) / len(logits)


def assert_exact_products_equal(loss_fn, params, batch, truths):
  """The harness's matrix-free exact curvatures multiply like brute force.

  `truths` maps a curvature name ("ggn", "hessian") to its dense matrix in
  the flat parameters; two random vectors are multiplied both ways.
  """
  unravel = jax.flatten_util.ravel_pytree(params)[1]
  rng = jax.random.PRNGKey(1)
  for name, truth in truths.items():
    exact = curvatures.exact(name, loss_fn, matrix_free=True)
    state = curvatures.estimate(exact, rng, params, batch)
    multiply = jax.jit(exact.multiply)
    for seed in range(2):
      vec = np.random.default_rng(seed).normal(size=len(truth))
      got = jax.flatten_util.ravel_pytree(multiply(state, unravel(vec)))[0]
      np.testing.assert_allclose(
        got, truth @ vec, rtol=1e-8, atol=1e-10 * np.abs(truth @ vec).max()
      )


def one_batch_state(
  est, args, batch_size, mode="ggn_exact", rngs=(0, 1), **init_kwargs
):
  """`est`'s state after one update that replaces its zero start with the
  statistics of `args` (decay 0, weight 1), estimated in `mode`.

  `rngs` seeds the keys of `init` and of the update; `init_kwargs` go to
  `init` (the powers to cache).
  """
  init_rng, update_rng = (jax.random.PRNGKey(seed) for seed in rngs)
  state = est.init(init_rng, args, **init_kwargs)
  return est.update_curvature_matrix_estimate(
    state, 0.0, 1.0, batch_size, update_rng, args, estimation_mode=mode
  )


def one_batch_dense(est, args, batch_size, mode="ggn_exact"):
  """`est`'s dense matrix after `one_batch_state`."""
  return est.to_dense_matrix(one_batch_state(est, args, batch_size, mode))


def one_step(opt, problem, params=None, state=None, **hyper):
  """`opt.step` on `problem`'s batch from `params` (the problem's own by
  default) and `state` (a fresh `opt.init` by default), both keyed by
  PRNGKey(0): what `step` returns, (params, state, stats)."""
  params = problem.params if params is None else params
  rng = jax.random.PRNGKey(0)
  if state is None:
    state = opt.init(params, rng, problem.batch)
  return opt.step(params, state, rng, batch=problem.batch, **hyper)


def block_mask(problem: Problem, groups):
  """0/1 mask of the block diagonal whose blocks are the given param groups."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(problem.params)
  names = [jax.tree_util.keystr(p)[2:-2] for p, _ in leaves]
  sizes = [np.size(v) for _, v in leaves]
  offsets = np.concatenate([[0], np.cumsum(sizes)])
  owner = np.empty(offsets[-1], int)
  for g, group in enumerate(groups):
    for name in group:
      i = names.index(name)
      owner[offsets[i] : offsets[i + 1]] = g
  return (owner[:, None] == owner[None, :]).astype(np.float64)


# --- a layer stack: one scan over stacked weights -----------------------------

STACK = 3


def layer_stack_params(rng=None):
  """Parameters of an MLP whose `STACK` middle layers share one scan.

  `ws` and `bs` hold the middle layers' weights and biases stacked on a
  leading axis; `w0`/`b0` and `w1`/`b1` are the first and last layers;
  drawn from `rng`, by default a new generator seeded 0.
  """
  rng = np.random.default_rng(0) if rng is None else rng

  def normal(*shape):
    return rng.normal(size=shape)

  return dict(
    w0=normal(4, 3),
    b0=normal(3),
    ws=normal(STACK, 3, 3),
    bs=normal(STACK, 3),
    w1=normal(3, 2),
    b1=normal(2),
  )
