"""Curvature blocks against brute-force per-example gradients (float64)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from estimators import blocks, tags, utils
from tests.groundtruth import numpy_psd_power, random_normal

B, S = 4, 2
TOL = dict(rtol=1e-9, atol=1e-11)


# --- layers: (layer(x, params) -> y, register(y, x, *params) -> y) ----------


def dense_layer(x, p):
  return x @ p[0] + (p[1] if len(p) > 1 else 0)


def conv_layer(fmt, strides, padding):
  dn = (fmt, "HWIO" if fmt == "NHWC" else "OIHW", fmt)
  bias_shape = (1, 1, 1, -1) if fmt == "NHWC" else (1, -1, 1, 1)

  def layer(x, p):
    y = lax.conv_general_dilated(
      x, p[0], (strides,) * 2, padding, dimension_numbers=dn
    )
    return y + p[1].reshape(bias_shape) if len(p) > 1 else y

  def register(y, x, *p):
    return tags.register_conv2d(
      y, x, *p, window_strides=strides, padding=padding, data_format=fmt
    )

  return layer, register


def scale_shift_layer(has_scale, has_shift):
  def layer(x, p):
    p = list(p)
    y = x * p.pop(0) if has_scale else x
    return y + p.pop(0) if has_shift else y

  def register(y, x, *p):
    p = list(p)
    return tags.register_scale_and_shift(
      y, x, p.pop(0) if has_scale else None, p.pop(0) if has_shift else None
    )

  return layer, register


def make_case(layer, register, x, params, seed=0, same_dy=False, samples=S):
  """(tag equation, estimation data, brute-force curvature C) for one layer."""
  eqn = [
    e
    for e in jax.make_jaxpr(lambda x, *p: register(layer(x, p), x, *p))(
      x, *params
    ).jaxpr.eqns
    if tags.is_layer_tag_eqn(e)
  ][0]
  y_shape = jax.eval_shape(layer, x, params).shape
  dy = random_normal(100 + seed, samples, *y_shape)
  if same_dy:
    dy = jnp.broadcast_to(dy[:, :1], dy.shape)
  data, c = _brute_force(layer, x, tuple(params), dy)
  return eqn, data, np.asarray(c)


@functools.partial(jax.jit, static_argnums=0)
def _brute_force(layer, x, params, dy):
  y = layer(x, params)

  def example_grad(xi, dyi):
    g = jax.grad(lambda p: jnp.vdot(dyi, layer(xi[None], p)[0]))(params)
    return utils.flatten_arrays(g)

  grads = jax.vmap(jax.vmap(example_grad), (None, 0))(x, dy)  # (S, B, P)
  rows = grads.reshape(-1, grads.shape[-1])
  summed = utils.unflatten_vector  # per-sample gradients summed over the batch
  params_tangent = jax.vmap(lambda g: summed(g, [p.shape for p in params]))(
    grads.sum(axis=1)
  )
  data = dict(
    inputs=(x,),
    outputs=(y,),
    params=params,
    outputs_tangent=(dy,),
    params_tangent=params_tangent,
  )
  return data, rows.T @ rows / x.shape[0]


def dense_case(bias=True, **kw):
  params = (
    (random_normal(1, 3, 2), random_normal(2, 2))
    if bias
    else (random_normal(1, 3, 2),)
  )
  return make_case(
    dense_layer, tags.register_dense, random_normal(3, B, 3), params, **kw
  )


def conv_case(fmt="NHWC", strides=2, padding="SAME", bias=True, batch=3, **kw):
  layer, register = conv_layer(fmt, strides, padding)
  kshape = (3, 3, 2, 3) if fmt == "NHWC" else (3, 2, 3, 3)
  xshape = (batch, 5, 5, 2) if fmt == "NHWC" else (batch, 2, 5, 5)
  params = (random_normal(1, *kshape),) + (
    (random_normal(2, 3),) if bias else ()
  )
  return make_case(layer, register, random_normal(3, *xshape), params, **kw)


SCALE_SHIFT = {  # name: (has_scale, has_shift, param shapes), x: (B, 3, 4)
  "both": (True, True, [(4,), (3, 4)]),
  "scale_only": (True, False, [(1, 3, 1)]),
  "shift_only": (False, True, [(1,)]),
  "scalar_scale": (True, True, [(), (4,)]),
}


def scale_shift_case(name, **kw):
  has_scale, has_shift, shapes = SCALE_SHIFT[name]
  layer, register = scale_shift_layer(has_scale, has_shift)
  params = tuple(random_normal(10 + i, *s) for i, s in enumerate(shapes))
  return make_case(layer, register, random_normal(3, B, 3, 4), params, **kw)


def fitted(
  block_cls, case, *args, exact=(), approx=(), eig=False, batch=B, **kwargs
):
  eqn, data, c = case
  block = block_cls(eqn, "layer", *args, **kwargs)
  state = block.init(None, exact, approx, eig)
  update = jax.jit(
    block.update_curvature_matrix_estimate, static_argnums=(4, 5)
  )
  state = update(
    state,
    data,
    0.0,
    1.0,
    data["inputs"][0].shape[0] if "inputs" in data else batch,
    None,
  )
  return block, state, data, c


def to_dense(block, state):
  return np.asarray(jax.jit(block.to_dense_matrix)(state))


def random_vector(block, seed=5):
  return tuple(
    random_normal(seed + i, *s) for i, s in enumerate(block.parameters_shapes)
  )


def flat(v):
  return np.asarray(utils.flatten_arrays(v))


# --- Full and Diagonal equal the brute-force curvature -----------------------

EXACT_CASES = {
  "dense": lambda: dense_case(),
  "dense_nobias": lambda: dense_case(bias=False),
  "dense_repeated": lambda: make_case(
    dense_layer,
    tags.register_repeated_dense,
    random_normal(3, B, 2, 3),
    (random_normal(1, 3, 2), random_normal(2, 2)),
  ),
  "conv_nhwc_s2_same": lambda: conv_case("NHWC", 2, "SAME"),
  "conv_nchw_s2_same_nobias": lambda: conv_case("NCHW", 2, "SAME", False),
  "conv_nchw_s1_valid": lambda: conv_case("NCHW", 1, "VALID"),
  "conv_nhwc_s2_valid_nobias": lambda: conv_case("NHWC", 2, "VALID", False),
  **{f"ss_{k}": functools.partial(scale_shift_case, k) for k in SCALE_SHIFT},
}
FULL = {
  "dense": blocks.DenseFull,
  "conv": blocks.Conv2DFull,
  "ss": blocks.ScaleAndShiftFull,
}
DIAG = {
  "dense": blocks.DenseDiagonal,
  "conv": blocks.Conv2DDiagonal,
  "ss": blocks.ScaleAndShiftDiagonal,
}


@pytest.mark.parametrize("name", list(EXACT_CASES))
def test_full_and_diagonal_match_per_example_curvature(name):
  case = EXACT_CASES[name]()
  kind = name.split("_")[0]
  # Conv blocks vmap over 2 of the 3 examples at a time (a remainder chunk).
  kw = dict(max_elements_for_vmap=2) if kind == "conv" else {}
  block, state, _, c = fitted(FULL[kind], case, **kw)
  np.testing.assert_allclose(state.matrix.value, c, **TOL)
  np.testing.assert_allclose(to_dense(block, state), c, **TOL)
  block, state, _, c = fitted(DIAG[kind], case, **kw)
  np.testing.assert_allclose(
    flat([f.value for f in state.diagonal_factors]), np.diag(c), **TOL
  )


def test_conv_properties():
  eqn, _, _ = conv_case("NCHW", 2, "SAME")
  block = blocks.Conv2DTwoKroneckerFactored(eqn, "conv")
  assert (block.inputs_channel_index, block.outputs_channel_index) == (1, 1)
  assert block.weights_output_channel_index == 0
  assert block.weights_spatial_size == 9
  assert block.num_locations == 9 and block.fixed_scale() == 9
  assert (block.num_inputs_channels, block.num_outputs_channels) == (2, 3)
  assert block.has_bias and (block.input_size(), block.output_size()) == (19, 3)
  full = blocks.Conv2DFull(eqn, "conv")
  assert full.max_elements_for_vmap == blocks.get_max_parallel_elements()


def test_block_properties():
  eqn, _, _ = dense_case()
  block = blocks.DenseFull(eqn, "d", eigen_decomposition_threshold=3)
  assert block.layer_tag_primitive is tags.dense
  assert block.parameters_shapes == ((3, 2), (2,))
  assert block.inputs_shapes == ((B, 3),) and block.outputs_shapes == ((B, 2),)
  assert block.number_of_parameters == 2 and block.dim == 8
  assert block.parameters_canonical_order == (0, 1)
  # Only the metadata (the block named the equation), as in KFAC-JAX 0.0.8.
  assert list(block.layer_tag_extra_params) == ["meta"]
  assert block.layer_tag_extra_params["meta"].name == block.name
  assert block.eigen_decomposition_threshold == 3
  v = random_vector(block)
  back = block.single_vector_to_parameters_list(
    block.parameters_list_to_single_vector(v)
  )
  for a, b in zip(v, back):
    np.testing.assert_array_equal(a, b)
  ss = blocks.ScaleAndShiftDiagonal(scale_shift_case("scale_only")[0], "s")
  assert ss.has_scale and not ss.has_shift


# --- naive blocks -------------------------------------------------------------


def test_naive_blocks_use_summed_gradients_on_generic_tags():
  eqn, data, _ = dense_case(samples=3)
  p = np.concatenate(
    [np.reshape(t, (3, -1)) for t in data["params_tangent"]], axis=1
  )
  expected = p.T @ p / B
  block, state, _, _ = fitted(blocks.NaiveFull, (eqn, data, None))
  np.testing.assert_allclose(state.matrix.value, expected, **TOL)
  block, state, _, _ = fitted(blocks.NaiveDiagonal, (eqn, data, None))
  np.testing.assert_allclose(
    flat([f.value for f in state.diagonal_factors]), np.diag(expected), **TOL
  )
  # A generic tag provides only parameter data.
  w = random_normal(1, 3, 2)
  geqn = [
    e
    for e in jax.make_jaxpr(tags.register_generic)(w).jaxpr.eqns
    if tags.is_layer_tag_eqn(e)
  ][0]
  gdata = dict(params=(w,), params_tangent=data["params_tangent"][:1])
  block, state, _, _ = fitted(blocks.NaiveFull, (geqn, gdata, None))
  np.testing.assert_allclose(state.matrix.value, expected[:6, :6], **TOL)


# --- Kronecker factors --------------------------------------------------------


def test_dense_kronecker_factors_and_exactness_for_shared_tangents():
  eqn, data, c = dense_case(same_dy=True, samples=3)
  block, state, _, _ = fitted(blocks.DenseTwoKroneckerFactored, (eqn, data, c))
  x = np.concatenate([data["inputs"][0], np.ones((B, 1))], axis=1)
  dy = np.reshape(data["outputs_tangent"][0], (-1, 2))
  np.testing.assert_allclose(state.inputs_factor.value, x.T @ x / B, **TOL)
  np.testing.assert_allclose(state.outputs_factor.value, dy.T @ dy / B, **TOL)
  # With the same dy for every example, A ⊗ G is the exact curvature.
  np.testing.assert_allclose(to_dense(block, state), c, **TOL)


def test_repeated_dense_kronecker():
  x, w, b = (
    random_normal(1, B, 2, 3, 4),
    random_normal(2, 4, 2),
    random_normal(3, 2),
  )
  eqn, data, _ = make_case(dense_layer, tags.register_repeated_dense, x, (w, b))
  block, state, _, _ = fitted(
    blocks.RepeatedDenseTwoKroneckerFactored, (eqn, data, None)
  )
  assert block.fixed_scale() == 6
  xs = np.concatenate([np.reshape(x, (-1, 4)), np.ones((B * 6, 1))], axis=1)
  dy = np.reshape(data["outputs_tangent"][0], (-1, 2))
  a, g = xs.T @ xs / (B * 6), dy.T @ dy / (B * 6)
  np.testing.assert_allclose(state.inputs_factor.value, a, **TOL)
  np.testing.assert_allclose(state.outputs_factor.value, g, **TOL)
  np.testing.assert_allclose(to_dense(block, state), 6 * np.kron(a, g), **TOL)


def np_patches(x, k, s, pads):
  xp = np.pad(x, ((0, 0), pads[0], pads[1], (0, 0)))
  out = [(xp.shape[1 + i] - k) // s + 1 for i in range(2)]
  return np.array(
    [
      xp[n, i * s : i * s + k, j * s : j * s + k].reshape(-1)
      for n in range(len(x))
      for i in range(out[0])
      for j in range(out[1])
    ]
  )


@pytest.mark.parametrize("fmt", ["NHWC", "NCHW"])
def test_conv_kronecker_factors(fmt):
  eqn, data, _ = conv_case(fmt, 2, "SAME")
  block, state, _, _ = fitted(
    blocks.Conv2DTwoKroneckerFactored, (eqn, data, None)
  )
  x, dy = np.asarray(data["inputs"][0]), np.asarray(data["outputs_tangent"][0])
  if fmt == "NCHW":
    x, dy = x.transpose(0, 2, 3, 1), dy.transpose(0, 1, 3, 4, 2)
  pads = lax.padtype_to_pads((5, 5), (3, 3), (2, 2), "SAME")
  p = np_patches(x, 3, 2, pads)
  p = np.concatenate([p, np.ones((len(p), 1))], axis=1)
  a = p.T @ p / len(p)
  dyr = dy.reshape(-1, 3)
  g = dyr.T @ dyr / len(p)
  np.testing.assert_allclose(state.inputs_factor.value, a, **TOL)
  np.testing.assert_allclose(state.outputs_factor.value, g, **TOL)
  # multiply applies L * A V G with V the (kh*kw*C_in + 1, C_out) matrix.
  v = random_vector(block)
  kernel = (
    np.asarray(v[0])
    if fmt == "NHWC"
    else np.asarray(v[0]).transpose(2, 3, 1, 0)
  )
  vm = np.concatenate([kernel.reshape(-1, 3), np.asarray(v[1])[None]])
  out = block.multiply(state, v, 0.0, True, False)
  expected = 9 * a @ vm @ g
  got_kernel = (
    np.asarray(out[0])
    if fmt == "NHWC"
    else np.asarray(out[0]).transpose(2, 3, 1, 0)
  )
  np.testing.assert_allclose(got_kernel.reshape(-1, 3), expected[:-1], **TOL)
  np.testing.assert_allclose(out[1], expected[-1], **TOL)


# --- moving averages ----------------------------------------------------------


def test_weighted_moving_average():
  ema = utils.WeightedMovingAverage.zeros((2,), jnp.float64)
  np.testing.assert_array_equal(ema.value, 0)
  ema = ema.update(jnp.array([1.0, 2.0]), 0.9, 0.1)
  np.testing.assert_allclose(ema.value, [1.0, 2.0])
  ema = ema.update(jnp.array([3.0, 4.0]), 0.5, 1.0)
  np.testing.assert_allclose(ema.value, ([0.05, 0.1] + np.array([3, 4])) / 1.05)
  leaves = jax.tree_util.tree_leaves(ema)
  assert len(leaves) == 2


@pytest.mark.parametrize(
  "cls",
  [blocks.DenseFull, blocks.DenseDiagonal, blocks.DenseTwoKroneckerFactored],
)
def test_ema_over_two_updates(cls):
  (eqn, d1, _), (_, d2, _) = dense_case(seed=0), dense_case(seed=1)
  block = cls(eqn, "d")
  update = jax.jit(
    functools.partial(
      block.update_curvature_matrix_estimate, batch_size=B, pmap_axis_name=None
    )
  )
  s0 = block.init(None, None, None, False)

  @jax.jit
  def run(d1, d2):
    one = lambda d: block.to_dense_matrix(
      update(s0, d, ema_old=0.0, ema_new=1.0)
    )
    state = update(
      update(s0, d1, ema_old=0.7, ema_new=0.3), d2, ema_old=0.7, ema_new=0.3
    )
    # weights: 0.7 * 0.3 for the first batch, 0.3 for the second.
    expected = (0.21 * one(d1) + 0.3 * one(d2)) / 0.51
    return block.to_dense_matrix(state), expected

  got, expected = run(d1, d2)
  np.testing.assert_allclose(got, expected, **TOL)


# --- products, caches and eigenvalues against numpy --------------------------

DAMPING = 0.3  # the products' identity weight, not a block's own damping
POWERS = [1, -1, -0.5]
# Every product mode: (power, exact, from the cache).
MODES = [
  (p, e, c) for p in POWERS for e in (True, False) for c in (True, False)
]


def matpower_products(block, cached, v, damping=DAMPING):
  """The product of `v` with every power in every mode (keyed "p e c"),
  and the eigenvalues computed afresh ("eig") and from the cache
  ("eig_cached"); traceable, for one program per test."""
  out = {
    f"{p} {e} {c}": utils.flatten_arrays(
      block.multiply_matpower(cached, v, damping, p, e, c)
    )
    for p, e, c in MODES
  }
  out["eig"] = block.eigenvalues(cached, False)
  out["eig_cached"] = block.eigenvalues(cached, True)
  return out


def fit_with_products(block, data, batch, v, products, round_trip=False):
  """The block's state and dense matrix after one update on `data`; with
  `products`, also its cache at every power and `matpower_products` of
  `v`, and with `round_trip` its `round_trips`. Traceable."""
  powers = POWERS if products else None
  state = block.init(None, powers, powers, products)
  state = block.update_curvature_matrix_estimate(
    state, data, 0.0, 1.0, batch, None
  )
  got = dict(state=state, dense=block.to_dense_matrix(state))
  if products:
    cached = block.update_cache(state, DAMPING, POWERS, POWERS, True)
    got["cached"] = cached
    got.update(matpower_products(block, cached, v))
    if round_trip:
      got.update(round_trips(block, cached, v))
  return got


def round_trips(block, cached, v, damping=DAMPING):
  """`v` multiplied, then multiplied by the inverse, in each exact and
  cache mode (keyed "back e c")."""
  out = {}
  for e in (True, False):
    for c in (True, False):
      forth = block.multiply(cached, v, damping, e, c)
      out[f"back {e} {c}"] = utils.flatten_arrays(
        block.multiply_inverse(cached, forth, damping, e, c)
      )
  return out


PRODUCT_BLOCKS = {
  "full": (blocks.DenseFull, dense_case),
  "full_eigh": (
    functools.partial(blocks.DenseFull, eigen_decomposition_threshold=1),
    dense_case,
  ),
  "diag": (blocks.DenseDiagonal, dense_case),
  "kfac": (blocks.DenseTwoKroneckerFactored, dense_case),
  "kfac_conv": (
    blocks.Conv2DTwoKroneckerFactored,
    lambda: conv_case("NCHW", 2, "SAME"),
  ),
  "identity": (functools.partial(blocks.ScaledIdentity, scale=2.5), dense_case),
}


@pytest.mark.parametrize("name", list(PRODUCT_BLOCKS))
def test_products_match_numpy(name):
  cls, case = PRODUCT_BLOCKS[name]
  block, state, _, _ = fitted(
    cls, case(), exact=POWERS, approx=POWERS, eig=True
  )
  if name == "full_eigh":
    assert "eigendecomposition" in state.cache
  v = random_vector(block)

  @jax.jit  # one program: compiling many small ones dominates test time
  def run(state, v, damping):
    cached = block.update_cache(state, damping, POWERS, POWERS, True)
    out = matpower_products(block, cached, v, damping)
    out["dense"] = block.to_dense_matrix(state)
    out["back"] = utils.flatten_arrays(
      block.multiply_inverse(
        state,
        block.multiply(state, v, damping, True, False),
        damping,
        True,
        False,
      )
    )
    return cached, out

  cached, out = run(state, v, DAMPING)
  assert jax.tree_util.tree_structure(cached) == jax.tree_util.tree_structure(
    state
  )
  m = np.asarray(out["dense"])
  for p, e, c in MODES:
    if e or "kfac" not in name:  # approximate powers are exact here
      expected = numpy_psd_power(m + DAMPING * np.eye(len(m)), p) @ flat(v)
      np.testing.assert_allclose(
        out[f"{p} {e} {c}"], expected, rtol=1e-8, atol=1e-10
      )
  np.testing.assert_allclose(out["back"], flat(v), rtol=1e-8, atol=1e-10)
  want = np.sort(np.linalg.eigvalsh(m))
  for key in ("eig", "eig_cached"):
    np.testing.assert_allclose(np.sort(out[key]), want, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize(
  "cls",
  [
    blocks.DenseFull,
    blocks.DenseDiagonal,
    blocks.DenseTwoKroneckerFactored,
    blocks.DenseEKFAC,
  ],
)
def test_state_dependent_scale_is_folded_into_the_cache(cls):
  class Scaled(cls):
    def state_dependent_scale(self, state):
      return 2.5

  block, state, _, _ = fitted(
    Scaled, dense_case(), exact=[-1], approx=[-1], eig=True
  )
  assert block.scale(state, True) == 1 and block.scale(state, False) == 2.5
  v = random_vector(block)

  @jax.jit
  def run(state, v):
    cached = block.update_cache(state, DAMPING, -1, -1, True)
    pairs = [
      (
        utils.flatten_arrays(
          block.multiply_inverse(cached, v, DAMPING, exact, True)
        ),
        utils.flatten_arrays(
          block.multiply_inverse(state, v, DAMPING, exact, False)
        ),
      )
      for exact in (True, False)
    ]
    return pairs + [
      (
        jnp.sort(block.eigenvalues(cached, True)),
        jnp.sort(block.eigenvalues(state, False)),
      )
    ]

  for got, want in run(state, v):
    np.testing.assert_allclose(got, want, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize(
  "cls",
  [
    blocks.DenseTwoKroneckerFactored,
    functools.partial(blocks.DenseFull, eigen_decomposition_threshold=1),
  ],
)
def test_refreshing_one_cached_power_keeps_the_others_consistent(cls):
  (eqn, d1, _), (_, d2, _) = dense_case(seed=0), dense_case(seed=1)
  block = cls(eqn, "d")
  v = random_vector(block)

  @jax.jit
  def run(d1, d2, v):
    state = block.init(None, [-1, -0.5], None, False)
    state = block.update_curvature_matrix_estimate(state, d1, 0.0, 1.0, B, None)
    state = block.update_cache(state, 0.5, [-1, -0.5], None, False)
    state = block.update_curvature_matrix_estimate(state, d2, 0.0, 1.0, B, None)
    state = block.update_cache(state, DAMPING, -0.5, None, False)
    # Shared eigendecompositions: power -1 now uses the new estimate and the
    # identity weight it was itself cached with.
    return (
      block.multiply_inverse(state, v, 0.5, True, True),
      block.multiply_inverse(state, v, 0.5, True, False),
    )

  got, want = run(d1, d2, v)
  np.testing.assert_allclose(flat(got), flat(want), rtol=1e-8, atol=1e-10)


def test_pi_adjusted_powers_with_block_scale():
  x, w = random_normal(1, B, 3, 4), random_normal(2, 4, 2)
  eqn, data, _ = make_case(dense_layer, tags.register_repeated_dense, x, (w,))
  block, state, _, _ = fitted(
    blocks.RepeatedDenseTwoKroneckerFactored, (eqn, data, None), approx=POWERS
  )
  s = block.fixed_scale()
  v = random_vector(block)

  @jax.jit
  def run(state, v):
    cached = block.update_cache(state, DAMPING, None, POWERS, False)
    out = {
      f"{p} {c}": utils.flatten_arrays(
        block.multiply_matpower(cached, v, DAMPING, p, False, c)
      )
      for p in POWERS
      for c in (True, False)
    }
    out["damped"] = utils.pi_adjusted_kronecker_damping(
      state.inputs_factor.value, state.outputs_factor.value, DAMPING / s
    )
    return out

  out = run(state, v)
  a, g = (
    np.asarray(state.inputs_factor.value),
    np.asarray(state.outputs_factor.value),
  )
  pi = np.sqrt((np.trace(a) / 4) / (np.trace(g) / 2))
  c = np.sqrt(DAMPING / s)
  a_d, g_d = a + pi * c * np.eye(4), g + c / pi * np.eye(2)
  np.testing.assert_allclose(out["damped"][0], a_d, **TOL)
  np.testing.assert_allclose(out["damped"][1], g_d, **TOL)
  damped = s * np.kron(a_d, g_d)  # the explicitly damped Kronecker product
  for power in POWERS:
    expected = numpy_psd_power(damped, power) @ flat(v)
    for use_cached in (False, True):
      np.testing.assert_allclose(
        out[f"{power} {use_cached}"], expected, rtol=1e-8, atol=1e-10
      )
  np.testing.assert_allclose(
    out["-1 False"], np.linalg.solve(damped, flat(v)), rtol=1e-8, atol=1e-10
  )


# --- multiple devices ---------------------------------------------------------


def estimates_on_one_and_two_devices(block, data):
  """The block's first estimate from the whole batch on one device, and
  from its halves on two (`pmap`, the parameters on both), as
  `(single, multi)`: `multi`'s leaves have a leading device axis."""
  state = block.init(None, None, None, False)
  n = data["inputs"][0].shape[0]
  single = jax.jit(
    block.update_curvature_matrix_estimate, static_argnums=(4, 5)
  )(state, data, 0.0, 1.0, n, None)

  def split(key, value):
    axis = 1 if key == "outputs_tangent" else 0
    if key in ("params", "params_tangent"):
      return jnp.broadcast_to(value, (2,) + value.shape)
    parts = jnp.split(value, 2, axis=axis)
    return jnp.stack(parts)

  sharded = {k: tuple(split(k, v) for v in vs) for k, vs in data.items()}
  multi = jax.pmap(
    lambda d: block.update_curvature_matrix_estimate(
      state, d, 0.0, 1.0, n // 2, "i"
    ),
    axis_name="i",
  )(sharded)
  return single, multi


@pytest.mark.parametrize(
  "cls,case",
  [
    (blocks.DenseFull, dense_case),
    (blocks.DenseTwoKroneckerFactored, dense_case),
    (blocks.Conv2DDiagonal, lambda: conv_case("NHWC", batch=4)),
    (blocks.Conv2DTwoKroneckerFactored, lambda: conv_case("NCHW", batch=4)),
    # EKFAC averages its scalings over devices on top of the factors.
    (blocks.DenseEKFAC, dense_case),
  ],
)
def test_pmean_over_devices_equals_concatenated_batch(cls, case):
  eqn, data, _ = case()
  single, multi = estimates_on_one_and_two_devices(cls(eqn, "layer"), data)
  for got, want in zip(
    jax.tree_util.tree_leaves(multi), jax.tree_util.tree_leaves(single)
  ):
    np.testing.assert_allclose(got[0], want, **TOL)
    np.testing.assert_allclose(got[1], want, **TOL)


# --- errors -------------------------------------------------------------------


def test_clear_errors():
  eqn, data, _ = dense_case()
  diag = blocks.DenseDiagonal(eqn, "d")
  state = diag.init(
    None,
    exact_powers_to_cache=-1,
    approx_powers_to_cache=None,
    cache_eigenvalues=False,
  )
  state = diag.update_curvature_matrix_estimate(state, data, 0.0, 1.0, B, None)
  v = random_vector(diag)
  with pytest.raises(ValueError, match="pass it in exact_powers_to_cache"):
    diag.multiply_matpower(state, v, 0.1, -0.5, True, True)
  with pytest.raises(ValueError, match="approx_powers_to_cache"):
    diag.multiply_inverse(state, v, 0.1, False, True)
  with pytest.raises(ValueError, match="pass it in exact_powers_to_cache"):
    diag.update_cache(state, 0.1, 2, None, False)
  with pytest.raises(ValueError, match="cache_eigenvalues=True"):
    diag.eigenvalues(state, True)
  with pytest.raises(ValueError, match="cache_eigenvalues=True"):
    diag.update_cache(state, 0.1, None, None, True)
  with pytest.raises(ValueError, match="damping"):
    diag.multiply_inverse(state, v, 0, True, False)
  with pytest.raises(ValueError, match="damping"):
    diag.update_cache(state, 0, -1, None, False)
  with pytest.raises(ValueError, match="non-integer power"):
    diag.multiply_matpower(state, v, -0.1, 0.5, True, False)
  with pytest.raises(ValueError, match="finite"):
    diag.multiply_matpower(state, v, 0.1, float("nan"), True, False)
  with pytest.raises(ValueError, match="known at trace time"):
    jax.jit(lambda p: diag.multiply_matpower(state, v, 0.1, p, True, False))(
      -1.0
    )
  with pytest.raises(ValueError, match="do not match the parameter shapes"):
    diag.multiply(state, (v[0],), 0.1, True, False)
  with pytest.raises(ValueError, match="do not match the parameter shapes"):
    diag.multiply(state, (v[0].T, v[1]), 0.1, True, False)
  with pytest.raises(TypeError, match="tuples of arrays"):
    diag.multiply(state, v[0], 0.1, True, False)
  bad = dict(data, inputs=(data["inputs"][0][:, :2],))
  with pytest.raises(ValueError, match="estimation_data\\['inputs'\\]"):
    diag.update_curvature_matrix_estimate(state, bad, 0.0, 1.0, B, None)
  bad = dict(data, outputs_tangent=(data["outputs_tangent"][0][0],))
  with pytest.raises(ValueError, match="outputs_tangent"):
    diag.update_curvature_matrix_estimate(state, bad, 0.0, 1.0, B, None)
  with pytest.raises(ValueError, match="needs \\['inputs'"):
    diag.update_curvature_matrix_estimate(
      state, dict(params_tangent=data["params_tangent"]), 0.0, 1.0, B, None
    )
  with pytest.raises(ValueError, match="handles conv2d_tag"):
    blocks.Conv2DFull(eqn, "d")
  # Undamped inverses are fine for the (non-singular) scaled identity.
  ident = blocks.ScaledIdentity(eqn, "i", scale=2.0)
  out = ident.multiply_inverse(
    ident.init(None, None, None, False), v, 0, True, False
  )
  np.testing.assert_allclose(flat(out), flat(v) / 2)


def grouped_conv_case():
  """A convolution with two feature groups (Kronecker layouts refuse it)."""

  def layer(x, p):
    return lax.conv_general_dilated(
      x,
      p[0],
      (1, 1),
      "VALID",
      dimension_numbers=("NHWC", "HWIO", "NHWC"),
      feature_group_count=2,
    )

  def register(y, x, k):
    return tags.register_conv2d(y, x, k, feature_group_count=2)

  return make_case(
    layer,
    register,
    random_normal(0, 2, 4, 4, 2),
    (random_normal(1, 2, 2, 1, 4),),
  )


@pytest.mark.parametrize(
  "kronecker_layout",
  [
    blocks.Conv2DTwoKroneckerFactored,
    blocks.Conv2DEKFAC,
    blocks.Conv2DTNT,
    blocks.Conv2DKFACReduce,
  ],
)
def test_grouped_conv_rejected_by_kronecker_but_fine_per_example(
  kronecker_layout,
):
  case = grouped_conv_case()
  with pytest.raises(
    ValueError,
    match=f"{kronecker_layout.__name__} supports "
    "only.*Conv2DDiagonal or Conv2DFull",
  ):
    kronecker_layout(case[0], "c")
  _, state, _, c = fitted(blocks.Conv2DFull, case)
  np.testing.assert_allclose(state.matrix.value, c, **TOL)


def test_settings_round_trip():
  old = blocks.get_max_parallel_elements()
  blocks.set_max_parallel_elements(7)
  assert blocks.get_max_parallel_elements() == 7
  blocks.set_max_parallel_elements(old)
  old = blocks.get_default_eigen_decomposition_threshold()
  blocks.set_default_eigen_decomposition_threshold(2)
  assert blocks.get_default_eigen_decomposition_threshold() == 2
  blocks.set_default_eigen_decomposition_threshold(old)
  with pytest.raises(ValueError):
    blocks.set_max_parallel_elements(0)


@pytest.mark.parametrize("sizes", [(1100, 2), (2, 1100)])
def test_big_factor_facing_a_small_one_is_cached_as_its_inverse_root(sizes):
  d_in, d_out = sizes
  eqn, data, _ = make_case(
    dense_layer,
    tags.register_dense,
    random_normal(3, B, d_in),
    (random_normal(1, d_in, d_out),),
  )
  block, state, _, _ = fitted(
    blocks.DenseTwoKroneckerFactored, (eqn, data, None), approx=(-1,)
  )
  v = random_vector(block)

  @jax.jit
  def run(state, v):
    cached = block.update_cache(state, DAMPING, None, (-1,), False)
    return (
      cached.cache,
      block.multiply_inverse(cached, v, DAMPING, False, True),
      utils.pi_adjusted_kronecker_damping(
        state.inputs_factor.value, state.outputs_factor.value, DAMPING
      ),
    )

  cache, got, (a_d, g_d) = run(state, v)
  big = "inputs_factor" if d_in > d_out else "outputs_factor"
  assert f"{big}_inverse_root" in cache["approx_pow_-1"]
  damped = np.kron(np.asarray(a_d), np.asarray(g_d))
  np.testing.assert_allclose(
    flat(got), np.linalg.solve(damped, flat(v)), rtol=1e-7, atol=1e-9
  )
