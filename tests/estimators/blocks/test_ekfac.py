"""EKFAC blocks against brute-force per-row curvature matrices (float64)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from estimators import tags, utils
from estimators.blocks import kronecker, stacked
from estimators.blocks.eigenbasis import Conv2DEKFAC, DenseEKFAC
from tests.estimators.blocks.test_blocks import (
  DAMPING,
  EXACT_CASES,
  MODES,
  POWERS,
  B,
  dense_case,
  dense_layer,
  fitted,
  flat,
  make_case,
  matpower_products,
  np_patches,
  random_vector,
)
from tests.groundtruth import numpy_psd_power, random_normal

TOL = dict(rtol=1e-8, atol=1e-10)

# The exact-data cases of the dense and conv blocks.
CASES = {k: case for k, case in EXACT_CASES.items() if not k.startswith("ss_")}
# (EKFAC block, the K-FAC block with the same rows)
CLASSES = {
  "dense": (DenseEKFAC, kronecker.DenseTwoKroneckerFactored),
  "dense_repeated": (DenseEKFAC, kronecker.RepeatedDenseTwoKroneckerFactored),
  # Per-location scalings: the per-row curvature below is their target
  # (the per-example default is tested in tests/estimators/blocks/test_ekfac_conv.py).
  "conv": (
    functools.partial(Conv2DEKFAC, scalings="per_location"),
    kronecker.Conv2DTwoKroneckerFactored,
  ),
}


def classes(name):
  if name.startswith("conv"):
    return CLASSES["conv"]
  return CLASSES["dense_repeated" if "repeated" in name else "dense"]


# --- numpy ground truth in the (input_size, output_size) matrix layout -------


def kernel_axes(block):
  """Kernel axes ordered (spatial, spatial, in, out)."""
  spec = block.dimension_numbers.rhs_spec
  return (spec[2], spec[3], spec[1], spec[0])


def matrix_order(block):
  """`perm` with `vec(V) = flat(params)[perm]`, V the block's matrix."""
  parts = utils.unflatten_vector(jnp.arange(block.dim), block.parameters_shapes)
  w = np.asarray(parts[0])
  if isinstance(block, Conv2DEKFAC):
    w = w.transpose(kernel_axes(block))
  rows = [w.reshape(-1, w.shape[-1])]
  if len(parts) == 2:
    rows.append(np.asarray(parts[1])[None])
  return np.concatenate(rows).reshape(-1).astype(int)


def in_matrix_layout(block, dense):
  perm = matrix_order(block)
  return np.asarray(dense)[np.ix_(perm, perm)]


def rows(block, data):
  """K-FAC's rows: x̃ `(N, input_size)` and dy `(S, N, output_size)`."""
  x = np.asarray(data["inputs"][0])
  dy = np.asarray(data["outputs_tangent"][0])
  if isinstance(block, Conv2DEKFAC):
    if block.dimension_numbers.lhs_spec[1] == 1:  # NCHW -> NHWC
      x, dy = x.transpose(0, 2, 3, 1), dy.transpose(0, 1, 3, 4, 2)
    p = block.layer_tag_extra_params
    kh = block.weights_spatial_shape[0]
    x = np_patches(x, kh, p["window_strides"][0], p["padding"])
  x = x.reshape(-1, x.shape[-1])
  if block.has_bias:
    x = np.concatenate([x, np.ones((len(x), 1))], axis=1)
  return x, dy.reshape(dy.shape[0], len(x), -1)


def per_row_curvature(block, data):
  """`Σ_{s,r} vec(x̃_r dy_srᵀ) vec(x̃_r dy_srᵀ)ᵀ / B`, matrix layout."""
  x, dy = rows(block, data)
  g = np.einsum("ri,sro->srio", x, dy).reshape(-1, x.shape[1] * dy.shape[2])
  return g.T @ g / data["inputs"][0].shape[0]


def numpy_basis(state):
  """`U_A ⊗ U_G` from numpy eigendecompositions of the block's factors."""
  _, u_a = np.linalg.eigh(np.asarray(state.inputs_factor.value))
  _, u_g = np.linalg.eigh(np.asarray(state.outputs_factor.value))
  return np.kron(u_a, u_g)


def state_basis(state):
  return np.kron(
    np.asarray(state.inputs_basis), np.asarray(state.outputs_basis)
  )


def assert_same_eigenvectors(basis, matrix):
  """The columns of `basis` are the eigenvectors of `matrix` (up to sign)."""
  _, u = np.linalg.eigh(matrix)
  np.testing.assert_allclose(np.abs(np.diag(basis.T @ u)), 1, rtol=1e-8)


# --- estimates ---------------------------------------------------------------


def batch_of(data):
  return data["inputs"][0].shape[0]


def fit_both(name):
  """EKFAC and K-FAC fitted to one case, with their dense matrices."""
  eqn, data, c = CASES[name]()
  block, kfac = (cls(eqn, "layer") for cls in classes(name))

  @jax.jit  # one program: compiling several small ones dominates test time
  def run(data):
    out = []
    for b in (block, kfac):
      state = b.update_curvature_matrix_estimate(
        b.init(None, None, None, False), data, 0.0, 1.0, batch_of(data), None
      )
      out += [state, b.to_dense_matrix(state)]
    return out

  return (block, kfac, data, c), run(data)


@pytest.mark.parametrize("name", list(CASES))
def test_scalings_are_the_curvature_in_the_kfac_eigenbasis(name):
  (block, kfac, data, c), (state, dense, kstate, kdense) = fit_both(name)
  assert block.fixed_scale() == kfac.fixed_scale()
  assert not block.outer_sum_is_cheaper()
  for got, want in [
    (state.inputs_factor.value, kstate.inputs_factor.value),
    (state.outputs_factor.value, kstate.outputs_factor.value),
  ]:
    np.testing.assert_allclose(got, want, **TOL)
  c_rows = per_row_curvature(block, data)
  if name.startswith("dense") and "repeated" not in name:
    np.testing.assert_allclose(c_rows, c, **TOL)  # a row is an example
  u = numpy_basis(state)
  s = np.diag(u.T @ c_rows @ u)
  np.testing.assert_allclose(
    block.fixed_scale() * np.asarray(state.scalings.value).reshape(-1), s, **TOL
  )
  ekfac = in_matrix_layout(block, dense)
  np.testing.assert_allclose(ekfac, u @ np.diag(s) @ u.T, **TOL)
  # George et al.'s optimality: the best diagonal in K-FAC's eigenbasis.
  ekfac_error = np.linalg.norm(c_rows - ekfac)
  kfac_error = np.linalg.norm(c_rows - in_matrix_layout(kfac, kdense))
  assert ekfac_error <= kfac_error * (1 + 1e-12)


@pytest.mark.parametrize("name", ["dense", "conv_nchw_s2_same_nobias"])
def test_products_and_eigenvalues_match_numpy(name):
  block, state, data, _ = fitted(
    classes(name)[0], CASES[name](), exact=POWERS, approx=POWERS, eig=True
  )
  v = random_vector(block)
  x, dy = data["inputs"][0], data["outputs_tangent"][0][0]

  @jax.jit
  def run(state, v, damping):
    cached = block.update_cache(state, damping, POWERS, POWERS, True)
    out = matpower_products(block, cached, v, damping)
    # Cached powers keep the weight given to update_cache.
    out["-1 True True"] = utils.flatten_arrays(
      block.multiply_inverse(cached, v, 5 * damping, True, True)
    )
    out["dense"] = block.to_dense_matrix(state)
    for c in (True, False):
      out[f"back {c}"] = utils.flatten_arrays(
        block.multiply_inverse(
          cached, block.multiply(cached, v, damping, True, c), damping, False, c
        )
      )
    if isinstance(block, DenseEKFAC):  # the gradient X̃ᵀ dY given as rows
      out["outer_sum"] = utils.flatten_arrays(
        block.multiply_inverse_outer_sum(cached, (x,), (dy,))
      )
    return cached, out

  cached, out = run(state, v, DAMPING)
  assert jax.tree_util.tree_structure(cached) == jax.tree_util.tree_structure(
    state
  )
  # Same factors, so the refresh keeps the basis.
  np.testing.assert_allclose(cached.inputs_basis, state.inputs_basis, **TOL)
  m = np.asarray(out["dense"])
  for p, e, c in MODES:
    expected = numpy_psd_power(m + DAMPING * np.eye(len(m)), p) @ flat(v)
    np.testing.assert_allclose(out[f"{p} {e} {c}"], expected, **TOL)
  for c in (True, False):
    np.testing.assert_allclose(out[f"back {c}"], flat(v), **TOL)
  want = np.sort(np.linalg.eigvalsh(m))
  for key in ("eig", "eig_cached"):
    np.testing.assert_allclose(np.sort(out[key]), want, **TOL)
  if "outer_sum" in out:
    gradient = flat((x.T @ dy, dy.sum(axis=0)))
    np.testing.assert_allclose(
      out["outer_sum"],
      np.linalg.solve(m + DAMPING * np.eye(len(m)), gradient),
      **TOL,
    )


# --- cadence: scalings every update, basis at each cache refresh --------------


def dense_batch(k):
  """A dense layer's batch with its own inputs and tangents."""
  params = (random_normal(1, 3, 2), random_normal(2, 2))
  return make_case(
    dense_layer,
    tags.register_dense,
    random_normal(20 + k, B, 3),
    params,
    seed=k,
  )


def test_basis_changes_only_at_cache_refresh():
  (eqn, d1, c1), (_, d2, c2), (_, d3, c3) = map(dense_batch, range(3))
  block = DenseEKFAC(eqn, "d")
  update = functools.partial(
    block.update_curvature_matrix_estimate, batch_size=B, pmap_axis_name=None
  )

  def run(d1, d2, d3):
    s1 = update(
      block.init(None, None, None, False), d1, ema_old=0.9, ema_new=0.1
    )
    s2 = update(s1, d2, ema_old=0.5, ema_new=1.0)
    s3 = block.update_cache(s2, 0.0, None, None, False)
    s4 = update(s3, d3, ema_old=0.5, ema_new=1.0)
    return s1, s2, s3, s4

  states = jax.jit(run)(d1, d2, d3)
  s1, s2, s3, s4 = states
  projected = lambda state, c: np.diag(
    state_basis(state).T @ c @ state_basis(state)
  )
  scalings = lambda state: np.asarray(state.scalings.value).reshape(-1)
  # The first update (weight 0 before it) sets the basis and gives the batch.
  assert_same_eigenvectors(
    np.asarray(s1.inputs_basis), np.asarray(s1.inputs_factor.value)
  )
  assert_same_eigenvectors(
    np.asarray(s1.outputs_basis), np.asarray(s1.outputs_factor.value)
  )
  np.testing.assert_allclose(scalings(s1), projected(s1, c1), **TOL)
  # A later update keeps the basis and averages the scalings measured in it.
  np.testing.assert_array_equal(s2.inputs_basis, s1.inputs_basis)
  np.testing.assert_array_equal(s2.outputs_basis, s1.outputs_basis)
  # Weights: 0.5 * 0.1 on the first batch, 1 on the second.
  np.testing.assert_allclose(
    scalings(s2), (0.05 * scalings(s1) + projected(s1, c2)) / 1.05, **TOL
  )
  # The refresh moves to the new factors' eigenvectors, keeps the value with
  # weight 0...
  a2 = np.asarray(s2.inputs_factor.value)
  assert_same_eigenvectors(np.asarray(s3.inputs_basis), a2)
  assert_same_eigenvectors(
    np.asarray(s3.outputs_basis), np.asarray(s2.outputs_factor.value)
  )
  assert not np.allclose(np.abs(s3.inputs_basis), np.abs(s2.inputs_basis))
  assert s3.scalings.weight == 0
  np.testing.assert_allclose(scalings(s3), scalings(s2), **TOL)
  # ...and the next update replaces the scalings, measured in the new basis.
  np.testing.assert_array_equal(s4.inputs_basis, s3.inputs_basis)
  np.testing.assert_allclose(scalings(s4), projected(s3, c3), **TOL)
  # Outside jit, the first update (the one that sets the basis) agrees.
  eager = update(
    block.init(None, None, None, False), d1, ema_old=0.9, ema_new=0.1
  )
  for got, want in zip(
    jax.tree_util.tree_leaves(eager), jax.tree_util.tree_leaves(s1)
  ):
    np.testing.assert_allclose(got, want, **TOL)


# --- errors -------------------------------------------------------------------


def test_clear_errors():
  block, state, _, _ = fitted(DenseEKFAC, dense_case(), exact=-1)
  v = random_vector(block)
  with pytest.raises(ValueError, match="approx_powers_to_cache"):
    block.update_cache(state, 0.1, None, -1, False)
  with pytest.raises(ValueError, match="damping"):
    block.multiply_inverse(state, v, 0.0, True, False)
  with pytest.raises(ValueError, match="handles conv2d_tag"):
    Conv2DEKFAC(dense_case()[0], "d")


def test_stacked_refuses_ekfac_by_name():
  eqn, _, _ = dense_case()
  with pytest.raises(ValueError, match="DenseEKFAC.*cannot be stacked"):
    stacked.Stacked(DenseEKFAC(eqn, "layer"), 2)
