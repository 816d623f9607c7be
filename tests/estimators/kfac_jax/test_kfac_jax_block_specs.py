"""KFAC-JAX 0.0.8's layout options of the Kronecker blocks, in float64:
`parameters_specs` / `parameters_concat_axis`, `use_masking` of the repeated
dense block and `weighting_per_location` of `Conv2DTNT`, each checked against
factors built by hand from the layer's inputs and output tangents."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from estimators import blocks, tags
from tests.groundtruth import conv2d_layer, random_normal

B, S = 3, 2
TOL = dict(rtol=1e-10, atol=1e-12)
RNG = jax.random.PRNGKey(0)


def _tag_eqn(fn, *args):
  """The (first) layer tag equation of `fn(*args)`."""
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  return [e for e in jaxpr.eqns if tags.is_layer_tag_eqn(e)][0]


def _state(block, data, batch=B, powers=None):
  state = block.init(RNG, powers, None, False)
  return block.update_curvature_matrix_estimate(state, data, 0.0, 1.0, batch)


def _dense(block, data, batch=B):
  return np.asarray(block.to_dense_matrix(_state(block, data, batch)))


def _layout_matrix(to_params, size):
  """`T` with `params_vector = T @ vec(matrix)`, from a numpy layout map."""
  columns = [
    np.concatenate([np.ravel(a) for a in to_params(e)]) for e in np.eye(size)
  ]
  return np.stack(columns, axis=1)


def _kfac(x_rows, dy_rows, batch):
  """`(X̃ᵀX̃ / B) ⊗ (dYᵀdY / B)` from explicit rows."""
  return np.kron(x_rows.T @ x_rows / batch, dy_rows.T @ dy_rows / batch)


def _with_ones(x):
  return np.concatenate([x, np.ones(x.shape[:-1] + (1,))], axis=-1)


# --- dense layers ------------------------------------------------------------

D_IN, D_OUT = 3, 2


def _dense_data(x, params, dy, layer):
  return dict(
    inputs=(x,),
    outputs=(layer(x, params),),
    params=params,
    outputs_tangent=(dy,),
  )


def _standard_dense():
  x = random_normal(1, B, D_IN)
  w, b = random_normal(2, D_IN, D_OUT), random_normal(3, D_OUT)
  dy = random_normal(4, S, B, D_OUT)

  def layer(x, p):
    return x @ p[0] + p[1]

  eqn = _tag_eqn(
    lambda x, w, b: tags.register_dense(layer(x, (w, b)), x, w, b), x, w, b
  )
  return eqn, _dense_data(x, (w, b), dy, layer), x, dy


def _transposed_dense():
  """The same layer with its weight stored output-major, `(d_out, d_in)`."""
  _, data, x, dy = _standard_dense()
  w, b = data["params"]

  def layer(x, p):
    return x @ p[0].T + p[1]

  eqn = _tag_eqn(
    lambda x, w, b: tags.register_dense(
      layer(x, (w, b)), x, w, b, transposed_weight=True
    ),
    x,
    w.T,
    b,
  )
  return eqn, _dense_data(x, (w.T, b), dy, layer), x, dy


def _brute_dense(x, dy):
  return _kfac(_with_ones(np.asarray(x)), np.asarray(dy).reshape(-1, D_OUT), B)


def test_default_dense_layout_is_weight_rows_then_bias_row():
  eqn, data, x, dy = _standard_dense()
  block = blocks.DenseTwoKroneckerFactored(eqn, "d")
  w, b = data["params"]
  assert block.parameters_specs == ("ab -> (a)b", "a -> 1a")
  assert block.parameters_concat_axis == 0
  assert block.array_shape == (D_IN + 1, D_OUT) and block.array_ndim == 2
  array = block.parameters_shaped_list_to_array((w, b))
  np.testing.assert_array_equal(array, np.concatenate([w, b[None]]))
  back = block.array_to_parameters_shaped_list(array)
  assert isinstance(back, tuple)
  for got, want in zip(back, (w, b)):
    np.testing.assert_array_equal(got, want)
  np.testing.assert_allclose(_dense(block, data), _brute_dense(x, dy), **TOL)


def test_transposed_weight_spec_gives_the_standard_layer_estimate():
  eqn, data, x, dy = _transposed_dense()
  std_eqn, std_data, _, _ = _standard_dense()
  default = blocks.DenseTwoKroneckerFactored(eqn, "t")
  # The tag's `transposed_weight` already picks the transposing spec.
  assert default.parameters_specs == ("ab -> ba", "a -> 1a")
  block = blocks.DenseTwoKroneckerFactored(
    eqn, "t", parameters_specs=["ab -> ba", "a -> 1a"]
  )
  assert block.array_shape == (D_IN + 1, D_OUT)
  w_t, b = data["params"]
  np.testing.assert_array_equal(
    block.parameters_shaped_list_to_array((w_t, b)),
    np.concatenate([w_t.T, b[None]]),
  )
  # params (W_t, b) from a `(d_in + 1, d_out)` matrix [W; b].
  t = _layout_matrix(
    lambda m: (m.reshape(D_IN + 1, D_OUT)[:-1].T, m.reshape(-1, D_OUT)[-1]),
    (D_IN + 1) * D_OUT,
  )
  expected = t @ _brute_dense(x, dy) @ t.T
  got = _dense(block, data)
  np.testing.assert_allclose(got, expected, **TOL)
  np.testing.assert_allclose(_dense(default, data), expected, **TOL)
  standard = _dense(blocks.DenseTwoKroneckerFactored(std_eqn, "s"), std_data)
  np.testing.assert_allclose(got, t @ standard @ t.T, **TOL)
  # Products on the stored layout: (A ⊗ G) vec([W; b]) mapped back.
  v = (random_normal(5, D_OUT, D_IN), random_normal(6, D_OUT))
  state = _state(block, data)
  out = block.multiply(state, v, 0.5, exact_power=True, use_cached=False)
  flat = np.concatenate([np.ravel(v[0]), v[1]])
  want = (expected + 0.5 * np.eye(flat.size)) @ flat
  np.testing.assert_allclose(
    np.concatenate([np.ravel(out[0]), out[1]]), want, **TOL
  )


def test_a_spec_changes_the_matrix_the_factors_act_on():
  """On a square layer a transposing spec is accepted and the factors then
  act on `[Wᵀ; b]`, a different block."""
  d = 3
  x, w, b = random_normal(1, B, d), random_normal(2, d, d), random_normal(3, d)
  dy = random_normal(4, S, B, d)

  def layer(x, p):
    return x @ p[0] + p[1]

  eqn = _tag_eqn(
    lambda x, w, b: tags.register_dense(layer(x, (w, b)), x, w, b), x, w, b
  )
  data = _dense_data(x, (w, b), dy, layer)
  swapped = blocks.DenseTwoKroneckerFactored(
    eqn, "sq", parameters_specs=["ab -> ba", "a -> 1a"]
  )
  kron = _kfac(_with_ones(np.asarray(x)), np.asarray(dy).reshape(-1, d), B)
  t = _layout_matrix(
    lambda m: (m.reshape(d + 1, d)[:-1].T, m.reshape(-1, d)[-1]), (d + 1) * d
  )
  got = _dense(swapped, data)
  np.testing.assert_allclose(got, t @ kron @ t.T, **TOL)
  default = _dense(blocks.DenseTwoKroneckerFactored(eqn, "sq"), data)
  np.testing.assert_allclose(default, kron, **TOL)
  assert not np.allclose(got, default)


def test_multi_axis_weight_spec():
  x = random_normal(1, B, 6)
  w, b = random_normal(2, 2, 3, D_OUT), random_normal(3, D_OUT)
  dy = random_normal(4, S, B, D_OUT)

  def layer(x, p):
    return x @ p[0].reshape(6, D_OUT) + p[1]

  eqn = _tag_eqn(
    lambda x, w, b: tags.register_dense(layer(x, (w, b)), x, w, b), x, w, b
  )
  data = _dense_data(x, (w, b), dy, layer)
  specs = ["abc -> (ab)c", "a -> 1a"]
  block = blocks.DenseTwoKroneckerFactored(eqn, "g", parameters_specs=specs)
  assert blocks.DenseTwoKroneckerFactored(eqn, "g").parameters_specs == tuple(
    specs
  )
  assert block.array_shape == (7, D_OUT)
  back = block.array_to_parameters_shaped_list(
    block.parameters_shaped_list_to_array((w, b))
  )
  np.testing.assert_array_equal(back[0], w)
  np.testing.assert_array_equal(back[1], b)
  expected = _kfac(
    _with_ones(np.asarray(x)), np.asarray(dy).reshape(-1, D_OUT), B
  )
  np.testing.assert_allclose(_dense(block, data), expected, **TOL)
  # TNT on the same layout: A = X̃ᵀ diag(Σ_s |dy|²) X̃ / B, / tr(A).
  tnt = blocks.DenseTNT(eqn, "g", parameters_specs=specs)
  xt, dyn = _with_ones(np.asarray(x)), np.asarray(dy)
  a = (xt * np.sum(dyn**2, axis=(0, 2))[:, None]).T @ xt / B
  g = sum(
    (dyn[s] * np.sum(xt**2, axis=1)[:, None]).T @ dyn[s] for s in range(S)
  )
  np.testing.assert_allclose(
    _dense(tnt, data), np.kron(a, g / B) / np.trace(a), **TOL
  )


@pytest.mark.parametrize(
  "kwargs, words",
  [
    (dict(parameters_specs=["ab -> (a)b"]), ["one spec per parameter", "1"]),
    (dict(parameters_specs="ab -> (a)b"), ["list of strings"]),
    (
      dict(parameters_specs=["ab -> ba", "a -> a1"], parameters_concat_axis=1),
      ["(2, 4)", "(4, 2)", "ab -> ba"],
    ),
    (
      dict(
        parameters_specs=["ab -> 1ab", "a -> 11a"], parameters_concat_axis=1
      ),
      ["(1, 4, 2)", "(4, 2)", "2-D"],
    ),
    (dict(parameters_specs=["ab -> ba", "a -> 1a"]), ["concatenated"]),
    (dict(parameters_specs=["aa -> aa", "a -> 1a"]), ["its own", "aa -> aa"]),
    (dict(parameters_specs=["ab -> a", "a -> 1a"]), ["exactly once"]),
    (dict(parameters_specs=["abc -> (ab)c", "a -> 1a"]), ["names 3 axes"]),
    (
      dict(
        parameters_specs=["ab -> (a)b", "a -> 1a"], parameters_concat_axis=2
      ),
      ["concatenation axis"],
    ),
  ],
)
def test_bad_specs_are_refused_by_name(kwargs, words):
  eqn, _, _, _ = _standard_dense()
  with pytest.raises(ValueError) as info:
    blocks.DenseTwoKroneckerFactored(eqn, "bad_block", **kwargs)
  message = str(info.value)
  assert "bad_block" in message and "DenseTwoKroneckerFactored" in message
  for word in words:
    assert word in message, message


# --- NaiveTNT on a laid-out array ---------------------------------------------


def test_naive_tnt_on_specs_with_concat_axis_one():
  w, b = random_normal(1, 3, 4), random_normal(2, 4)
  eqn = _tag_eqn(lambda w, b: tags.register_generic(w, b), w, b)
  with pytest.raises(ValueError, match="parameters_specs"):
    blocks.NaiveTNT(eqn, "n")
  specs = ["ab -> ba", "a -> a1"]
  block = blocks.NaiveTNT(
    eqn, "n", parameters_specs=specs, parameters_concat_axis=1
  )
  assert block.array_shape == (4, 4) and block.factor_sizes == (4, 4)
  array = block.parameters_shaped_list_to_array((w, b))
  np.testing.assert_array_equal(array, np.concatenate([w.T, b[:, None]], 1))
  back = block.array_to_parameters_shaped_list(array)
  np.testing.assert_array_equal(back[0], w)
  np.testing.assert_array_equal(back[1], b)
  pw, pb = random_normal(3, S, 3, 4), random_normal(4, S, 4)
  data = dict(params=(w, b), params_tangent=(pw, pb))
  arrays = [np.concatenate([pw[s].T, pb[s][:, None]], 1) for s in range(S)]
  u1 = sum(p @ p.T for p in arrays) / B
  u2 = sum(p.T @ p for p in arrays) / B
  t = _layout_matrix(lambda m: (m.reshape(4, 4)[:, :3].T, m[3::4]), 16)
  expected = t @ np.kron(u1, u2 / np.trace(u1)) @ t.T
  np.testing.assert_allclose(_dense(block, data), expected, **TOL)


def test_naive_tnt_default_keeps_one_factor_per_axis():
  w = random_normal(1, 2, 3, 2)
  eqn = _tag_eqn(lambda w: tags.register_generic(w), w)
  block = blocks.NaiveTNT(eqn, "n")
  assert block.parameters_specs == ("abc -> abc",) and block.array_shape == (
    2,
    3,
    2,
  )


# --- conv layers ----------------------------------------------------------------


def _conv(fmt, strides, padding, bias=True):
  eqn, x, params, layer = conv2d_layer(
    fmt, strides, padding, bias, batch=B, spatial=(5, 4)
  )
  dy = random_normal(4, S, *jax.eval_shape(layer, x, params).shape)
  data = dict(
    inputs=(x,),
    outputs=(layer(x, params),),
    params=params,
    outputs_tangent=(dy,),
  )
  return eqn, data


def _hwio(fmt, kernel):
  return kernel if fmt == "NHWC" else jnp.transpose(kernel, (2, 3, 1, 0))


@pytest.mark.parametrize("fmt", ["NHWC", "NCHW"])
@pytest.mark.parametrize("bias", [True, False])
def test_default_conv_layout(fmt, bias):
  eqn, data = _conv(fmt, 1, "SAME", bias)
  block = blocks.Conv2DTwoKroneckerFactored(eqn, "c")
  assert block.array_shape == (3 * 2 * 2 + int(bias), 3)
  params = data["params"]
  rows = [np.asarray(_hwio(fmt, params[0])).reshape(-1, 3)]
  if bias:
    rows.append(np.asarray(params[1])[None])
  array = block.parameters_shaped_list_to_array(params)
  np.testing.assert_array_equal(array, np.concatenate(rows))
  for got, want in zip(block.array_to_parameters_shaped_list(array), params):
    np.testing.assert_array_equal(got, want)


def _patches(fmt, x, strides, padding):
  """`(B, locations, kh * kw * C)` patches, in the `(kh, kw, C)` order."""
  rhs = "HWIO" if fmt == "NHWC" else "OIHW"
  p = lax.conv_general_dilated_patches(
    x, (3, 2), (strides,) * 2, padding, dimension_numbers=(fmt, rhs, "NHWC")
  )
  p = p.reshape(p.shape[:3] + (2, 3, 2))  # features: (C, kh, kw)
  return np.asarray(jnp.moveaxis(p, 3, -1).reshape(B, -1, 12))


@pytest.mark.parametrize(
  "fmt, strides, padding", [("NHWC", 1, "SAME"), ("NCHW", 2, "VALID")]
)
def test_conv_tnt_without_weighting_per_location(fmt, strides, padding):
  eqn, data = _conv(fmt, strides, padding)
  block = blocks.Conv2DTNT(eqn, "c", weighting_per_location=False)
  assert not block.weighting_per_location
  x, (dy,) = data["inputs"][0], data["outputs_tangent"]
  p = _with_ones(_patches(fmt, x, strides, padding))  # (B, T, 13)
  t_locations = p.shape[1]
  dyn = np.asarray(jnp.moveaxis(dy, 2, -1) if fmt == "NCHW" else dy)
  dyn = dyn.reshape(S, B, t_locations, 3)
  w = np.sum(dyn**2, axis=(0, 2, 3))  # (B,)
  v = np.sum(p**2, axis=(1, 2))  # (B,)
  a = np.einsum("n,nti,ntj->ij", w, p, p) / (B * t_locations)
  g = np.einsum("n,snti,sntj->ij", v, dyn, dyn) / (B * t_locations)
  assert block.fixed_scale() == t_locations
  expected = t_locations * np.kron(a, g) / np.trace(a)
  # params (kernel, bias) from the (kh kw C + 1, O) matrix.
  k_shape = data["params"][0].shape

  def to_params(m):
    m = m.reshape(13, 3)
    kernel = m[:-1].reshape(3, 2, 2, 3)
    if fmt == "NCHW":
      kernel = np.transpose(kernel, (3, 2, 0, 1))
    assert kernel.shape == k_shape
    return kernel, m[-1]

  t = _layout_matrix(to_params, 39)
  got = _dense(block, data)
  np.testing.assert_allclose(got, t @ expected @ t.T, **TOL)
  default = _dense(blocks.Conv2DTNT(eqn, "c"), data)
  np.testing.assert_allclose(
    _dense(blocks.Conv2DTNT(eqn, "c", weighting_per_location=True), data),
    default,
    rtol=0,
    atol=0,
  )
  assert not np.allclose(got, default)


def test_weighting_per_location_false_is_refused_by_other_statistics():
  eqn, _ = _conv("NHWC", 1, "SAME")
  with pytest.raises(ValueError, match="weighting_per_location"):
    blocks.Conv2DShampoo(eqn, "c", weighting_per_location=False)


# --- masking of repeated dense rows ---------------------------------------------

R = 4


def _repeated(zero_rows=()):
  x = random_normal(1, B, R, D_IN)
  w, b = random_normal(2, D_IN, D_OUT), random_normal(3, D_OUT)
  dy = np.array(random_normal(4, S, B, R, D_OUT))
  for n, r in zero_rows:
    dy[:, n, r] = 0.0
  dy = jnp.asarray(dy)

  def layer(x, p):
    return x @ p[0] + p[1]

  eqn = _tag_eqn(
    lambda x, w, b: tags.register_repeated_dense(layer(x, (w, b)), x, w, b),
    x,
    w,
    b,
  )
  return eqn, _dense_data(x, (w, b), dy, layer)


def _masked_brute(data):
  """K-FAC over the kept rows only: `X̃ᵀX̃ ⊗ dYᵀdY / (B K)`, K kept rows."""
  x = _with_ones(np.asarray(data["inputs"][0])).reshape(B * R, -1)
  dy = np.asarray(data["outputs_tangent"][0]).reshape(S, B * R, -1)
  kept = np.any(dy != 0, axis=(0, 2))
  xk, dyk = x[kept], dy[:, kept].reshape(-1, D_OUT)
  return np.kron(xk.T @ xk, dyk.T @ dyk) / (B * kept.sum()), kept.sum()


def _unmasked_brute(data):
  x = _with_ones(np.asarray(data["inputs"][0])).reshape(B * R, -1)
  dy = np.asarray(data["outputs_tangent"][0]).reshape(-1, D_OUT)
  return R * _kfac(x, dy, B * R)


def test_masking_leaves_out_rows_with_zero_tangents():
  eqn, data = _repeated(zero_rows=[(0, 3), (2, 1), (2, 2)])
  block = blocks.RepeatedDenseTwoKroneckerFactored(eqn, "r")
  assert block.use_masking
  expected, kept = _masked_brute(data)
  assert kept == B * R - 3
  state = _state(block, data)
  np.testing.assert_allclose(state.average_repeats.value, kept / B, **TOL)
  np.testing.assert_allclose(block.to_dense_matrix(state), expected, **TOL)
  # The cached inverse holds the state's scale too.
  state = _state(block, data, powers=-1)
  state = block.update_cache(state, 0.1, -1, None, False)
  v = (random_normal(5, D_IN, D_OUT), random_normal(6, D_OUT))
  flat = np.concatenate([np.ravel(v[0]), v[1]])
  got = block.multiply_inverse(state, v, 0.1, exact_power=True, use_cached=True)
  np.testing.assert_allclose(
    np.concatenate([np.ravel(got[0]), got[1]]),
    np.linalg.solve(expected + 0.1 * np.eye(flat.size), flat),
    **TOL,
  )
  unmasked = blocks.RepeatedDenseTwoKroneckerFactored(
    eqn, "r", use_masking=False
  )
  got_unmasked = _dense(unmasked, data)
  np.testing.assert_allclose(got_unmasked, _unmasked_brute(data), **TOL)
  assert not np.allclose(got_unmasked, expected)


def test_masking_changes_nothing_without_zero_rows():
  eqn, data = _repeated()
  masked = _dense(blocks.RepeatedDenseTwoKroneckerFactored(eqn, "r"), data)
  plain = _dense(
    blocks.RepeatedDenseTwoKroneckerFactored(eqn, "r", use_masking=False),
    data,
  )
  np.testing.assert_allclose(masked, plain, rtol=1e-13, atol=0)
  np.testing.assert_allclose(masked, _unmasked_brute(data), **TOL)
  np.testing.assert_allclose(masked, _masked_brute(data)[0], **TOL)


def test_masking_averages_the_kept_rows_as_the_factors():
  """Over two batches (equal weights) the block is the factors' averages
  over the average number of kept rows per example, as in KFAC-JAX."""
  eqn, first = _repeated(zero_rows=[(1, 0)])
  _, second = _repeated(zero_rows=[(0, 0), (0, 1), (2, 3)])
  second = dict(second, inputs=(second["inputs"][0] * 2.0,))
  block = blocks.RepeatedDenseTwoKroneckerFactored(eqn, "r")
  state = block.init(RNG, None, None, False)
  for data in (first, second):
    state = block.update_curvature_matrix_estimate(state, data, 1.0, 1.0, B)
  sums = []
  for data in (first, second):
    x = _with_ones(np.asarray(data["inputs"][0])).reshape(B * R, -1)
    dy = np.asarray(data["outputs_tangent"][0]).reshape(S, B * R, -1)
    kept = np.any(dy != 0, axis=(0, 2))
    xk = x * kept[:, None]
    sums.append(
      (
        xk.T @ xk / B,
        dy.reshape(-1, D_OUT).T @ dy.reshape(-1, D_OUT) / B,
        kept.sum() / B,
      )
    )
  a = (sums[0][0] + sums[1][0]) / 2
  g = (sums[0][1] + sums[1][1]) / 2
  repeats = (sums[0][2] + sums[1][2]) / 2
  np.testing.assert_allclose(
    block.to_dense_matrix(state), np.kron(a, g) / repeats, **TOL
  )
