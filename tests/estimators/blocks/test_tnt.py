"""Tensor Normal Training blocks against brute-force per-example gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from estimators import blocks, tags, utils
from estimators.blocks import tnt
from tests.estimators.blocks.test_blocks import (
  DAMPING,
  MODES,
  POWERS,
  TOL,
  B,
  conv_case,
  conv_layer,
  dense_case,
  dense_layer,
  fitted,
  flat,
  make_case,
  matpower_products,
  random_vector,
  round_trips,
  to_dense,
)
from tests.groundtruth import numpy_psd_power, random_normal


def repeated_case(bias=True):
  params = (random_normal(1, 3, 2),) + ((random_normal(2, 2),) if bias else ())
  return make_case(
    dense_layer, tags.register_repeated_dense, random_normal(3, B, 2, 3), params
  )


# name: (block class, case, layer, kernel layout) -- the layer and layout
# rebuild the per-example gradients in the block's matrix layout.
CASES = {
  "dense": (tnt.DenseTNT, dense_case, dense_layer, None),
  "dense_nobias_7_samples": (
    tnt.DenseTNT,
    functools.partial(dense_case, bias=False, samples=7),
    dense_layer,
    None,
  ),
  "repeated": (tnt.DenseTNT, repeated_case, dense_layer, None),
  "repeated_nobias": (
    tnt.DenseTNT,
    functools.partial(repeated_case, bias=False),
    dense_layer,
    None,
  ),
  "conv_nhwc_s2_same": (
    tnt.Conv2DTNT,
    lambda: conv_case("NHWC", 2, "SAME"),
    conv_layer("NHWC", 2, "SAME")[0],
    "NHWC",
  ),
  "conv_nchw_s2_same_nobias": (
    tnt.Conv2DTNT,
    lambda: conv_case("NCHW", 2, "SAME", False),
    conv_layer("NCHW", 2, "SAME")[0],
    "NCHW",
  ),
  "conv_nchw_s1_valid": (
    tnt.Conv2DTNT,
    lambda: conv_case("NCHW", 1, "VALID"),
    conv_layer("NCHW", 1, "VALID")[0],
    "NCHW",
  ),
  "conv_nhwc_s2_valid_nobias": (
    tnt.Conv2DTNT,
    lambda: conv_case("NHWC", 2, "VALID", False),
    conv_layer("NHWC", 2, "VALID")[0],
    "NHWC",
  ),
}


def example_matrices(layer, data, fmt):
  """Per-(sample, example) gradients as `(N, input_size, output_size)`."""
  (x,), (dy,), params = data["inputs"], data["outputs_tangent"], data["params"]

  def one(xi, dyi):
    return jax.grad(lambda p: jnp.vdot(dyi, layer(xi[None], p)[0]))(params)

  # Compiled: running the vmapped gradients op by op is slower.
  grads = [
    np.asarray(g).reshape((-1,) + g.shape[2:])
    for g in jax.jit(jax.vmap(jax.vmap(one), (None, 0)))(x, dy)
  ]
  kernel = grads[0]
  if fmt == "NCHW":  # OIHW -> HWIO, the patch layout (kh, kw, c_in)
    kernel = kernel.transpose(0, 3, 4, 2, 1)
  m = kernel.reshape(len(kernel), -1, kernel.shape[-1])
  if len(grads) > 1:
    m = np.concatenate([m, grads[1][:, None]], axis=1)
  return m


def matrix_order(block, fmt):
  """Indices into the flat parameter vector, in the matrix layout's order."""
  shapes = block.parameters_shapes
  kernel = np.arange(np.prod(shapes[0])).reshape(shapes[0])
  if fmt == "NCHW":
    kernel = kernel.transpose(2, 3, 1, 0)
  bias = (
    [np.prod(shapes[0]) + np.arange(shapes[1][0])] if len(shapes) > 1 else []
  )
  return np.concatenate([kernel.reshape(-1)] + bias)


# Fitted with a budget of two examples' gradients: the examples are scanned
# over in chunks of 2 (the conv's 3 with one zero-padded example).
CHUNKED = ("repeated_nobias", "conv_nchw_s2_same_nobias")


@pytest.mark.parametrize("name", list(CASES))
def test_two_factors_match_per_example_gradients(name):
  cls, case, layer, fmt = CASES[name]
  eqn, data, c = case()
  old = blocks.get_max_parallel_elements()
  if name in CHUNKED:
    block = cls(eqn, "layer")
    blocks.set_max_parallel_elements(
      2 * 2 * block.input_size() * block.output_size()
    )
  try:
    block, state, _, _ = fitted(cls, (eqn, data, c))
  finally:
    blocks.set_max_parallel_elements(old)
  m = example_matrices(layer, data, fmt)
  batch = len(data["inputs"][0])
  a = np.einsum("nio,njo->ij", m, m) / batch
  g = np.einsum("nio,nip->op", m, m) / batch
  np.testing.assert_allclose(state.inputs_factor.value, a, **TOL)
  np.testing.assert_allclose(state.outputs_factor.value, g, **TOL)
  trace = np.sum(m * m) / batch
  np.testing.assert_allclose([np.trace(a), np.trace(g)], trace, **TOL)
  np.testing.assert_allclose(np.trace(c), trace, **TOL)
  assert block.fixed_scale() == 1
  np.testing.assert_allclose(
    block.state_dependent_scale(state), 1 / trace, **TOL
  )
  dense = to_dense(block, state)
  np.testing.assert_allclose(np.trace(dense), np.trace(c), **TOL)
  order = matrix_order(block, fmt)
  np.testing.assert_allclose(
    dense[np.ix_(order, order)], np.kron(a, g) / trace, **TOL
  )


# --- NaiveTNT -----------------------------------------------------------------


def generic_case(*shapes, samples=3):
  params = tuple(random_normal(1 + i, *s) for i, s in enumerate(shapes))
  eqn = [
    e
    for e in jax.make_jaxpr(tags.register_generic)(*params).jaxpr.eqns
    if tags.is_layer_tag_eqn(e)
  ][0]
  tangents = tuple(
    random_normal(20 + i, samples, *s) for i, s in enumerate(shapes)
  )
  return eqn, dict(params=params, params_tangent=tangents), None


def np_kron(*factors):
  return functools.reduce(np.kron, factors)


@pytest.mark.parametrize("shape", [(2, 3, 2), (3, 2), (4,), ()])
def test_naive_tnt_factors(shape):
  eqn, data, _ = generic_case(shape)
  block, state, _, _ = fitted(tnt.NaiveTNT, (eqn, data, None))
  p = np.asarray(data["params_tangent"][0]).reshape((3,) + (shape or (1,)))
  c = p.reshape(3, -1).T @ p.reshape(3, -1) / B
  # Factor j contracts the samples and every other axis.
  others = [[i for i in range(p.ndim) if i != j] for j in range(1, p.ndim)]
  factors = [np.tensordot(p, p, axes=(o, o)) / B for o in others]
  for got, want in zip(state.factors, factors, strict=True):
    np.testing.assert_allclose(got.value, want, **TOL)
  trace = np.trace(c)
  np.testing.assert_allclose([np.trace(f) for f in factors], trace, **TOL)
  dense = to_dense(block, state)
  np.testing.assert_allclose(np.trace(dense), trace, **TOL)
  np.testing.assert_allclose(
    dense, np_kron(*factors) / trace ** (len(factors) - 1), **TOL
  )


def test_naive_tnt_needs_one_parameter():
  eqn, _, _ = generic_case((3, 2), (2,))
  with pytest.raises(ValueError, match="exactly one parameter"):
    tnt.NaiveTNT(eqn, "two")


# --- products, caches and eigenvalues ---------------------------------------

PRODUCT_BLOCKS = {
  "dense": (tnt.DenseTNT, dense_case),
  "conv": (tnt.Conv2DTNT, lambda: conv_case("NCHW", 2, "SAME")),
  "naive_3d": (tnt.NaiveTNT, lambda: generic_case((2, 3, 2))),
  "naive_scalar": (tnt.NaiveTNT, lambda: generic_case(())),
}


def products(block, state, v):
  """Every product mode, a round trip per mode, the dense matrix and the
  eigenvalues, in one compiled program."""

  @jax.jit
  def run(state, v):
    cached = block.update_cache(state, DAMPING, POWERS, POWERS, True)
    out = matpower_products(block, cached, v)
    out.update(round_trips(block, cached, v))
    out["dense"] = block.to_dense_matrix(state)
    return cached, out

  return MODES, run(state, v)


@pytest.mark.parametrize("name", list(PRODUCT_BLOCKS))
def test_products_match_numpy(name):
  cls, case = PRODUCT_BLOCKS[name]
  block, state, _, _ = fitted(
    cls, case(), exact=POWERS, approx=POWERS, eig=True
  )
  v = random_vector(block)
  modes, (cached, out) = products(block, state, v)
  assert jax.tree_util.tree_structure(cached) == jax.tree_util.tree_structure(
    state
  )
  m = np.asarray(out["dense"])
  for p, e, c in modes:
    # Two-factor blocks split the damping between factors when not exact.
    if e or name.startswith("naive"):
      expected = numpy_psd_power(m + DAMPING * np.eye(len(m)), p) @ flat(v)
      np.testing.assert_allclose(
        out[f"{p} {e} {c}"], expected, rtol=1e-8, atol=1e-10
      )
  for e in (True, False):
    for c in (True, False):
      np.testing.assert_allclose(
        out[f"back {e} {c}"], flat(v), rtol=1e-8, atol=1e-10
      )
  want = np.sort(np.linalg.eigvalsh(m))
  for key in ("eig", "eig_cached"):
    np.testing.assert_allclose(np.sort(out[key]), want, rtol=1e-8, atol=1e-10)


def test_dense_outer_sum_matches_the_cached_inverse():
  block, state, data, _ = fitted(tnt.DenseTNT, repeated_case(), approx=-1)
  (x,), (dy,) = data["inputs"], data["outputs_tangent"]
  cotangent = dy[0]

  @jax.jit
  def run(state):
    cached = block.update_cache(state, DAMPING, None, -1, False)
    grad = jax.vjp(lambda *p: (dense_layer(x, p),), *data["params"])[1](
      (cotangent,)
    )
    return (
      block.multiply_inverse_outer_sum(cached, (x,), (cotangent,)),
      block.multiply_inverse(cached, tuple(grad), DAMPING, False, True),
    )

  got, want = run(state)
  np.testing.assert_allclose(flat(got), flat(want), rtol=1e-8, atol=1e-10)


# --- zero estimates and bad layers ------------------------------------------


@pytest.mark.parametrize("name", ["dense", "naive_3d"])
def test_zero_state_gives_zeros(name):
  cls, case = PRODUCT_BLOCKS[name]
  eqn, data, _ = case()
  zero = {
    k: tuple(jnp.zeros_like(t) for t in data[k])
    for k in ("outputs_tangent", "params_tangent")
    if k in data
  }
  block, updated, _, _ = fitted(
    cls, (eqn, {**data, **zero}, None), exact=-1, approx=-1, eig=True
  )
  v = random_vector(block)

  @jax.jit
  def run(state):
    cached = block.update_cache(state, DAMPING, -1, -1, True)
    out = {
      f"{e} {c}": utils.flatten_arrays(
        block.multiply_inverse(cached, v, DAMPING, e, c)
      )
      for e in (True, False)
      for c in (True, False)
    }
    return dict(
      out,
      dense=block.to_dense_matrix(state),
      eig=block.eigenvalues(cached, False),
      eig_cached=block.eigenvalues(cached, True),
    )

  for state in (block.init(None, -1, -1, True), updated):
    out = run(state)
    for key in ("dense", "eig", "eig_cached"):
      np.testing.assert_array_equal(out.pop(key), 0)
    for got in out.values():  # (0 + λ I)⁻¹ v
      np.testing.assert_allclose(got, flat(v) / DAMPING, rtol=1e-12)
