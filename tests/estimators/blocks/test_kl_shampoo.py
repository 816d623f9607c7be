"""KL-Shampoo against brute force (float64): per-example gradients from
`jax.grad`, the exact block `C = (1/B) Σ_n vec(G_n) vec(G_n)ᵀ` and the KL
objective `½ [tr(S⁻¹ (C + κ I)) + log det S]` evaluated densely, in the
blocks' `(input_size, output_size)` matrix layout (Lin et al., 2025)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from curvbench.approximations import CURVATURES
from estimators import utils
from estimators.blocks import (
  get_max_parallel_elements,
  kl_shampoo,
  set_max_parallel_elements,
  stacked,
)
from tests.estimators.blocks.test_blocks import (
  DAMPING,
  MODES,
  dense_layer,
  estimates_on_one_and_two_devices,
  fit_with_products,
  random_vector,
)
from tests.estimators.blocks.test_shampoo import (
  CASES,
  FAMILIES,
  dense_case,
  kfac_class,
  two_dense_batches,
  updated_twice,
)
from tests.estimators.blocks.test_tnt import example_matrices, matrix_order
from tests.groundtruth import numpy_psd_power

TOL = dict(rtol=1e-8, atol=1e-10)
CLASSES = (kl_shampoo.DenseKLShampoo, kl_shampoo.Conv2DKLShampoo)
STEPS = (1, 3)
OTHERS = ("shampoo2", "shampoo", "kfac", "optimal")


def variants(name):
  """The blocks fitted per case: converged (κ as the default, and 0 where
  the batch has enough examples for it) and after a few steps."""
  out = {"kl": dict(max_iterations=2000, tolerance=0.0)}
  if name != "conv":  # 6 examples of 19 x 3: no undamped fixed point
    out["undamped"] = dict(max_iterations=2000, tolerance=0.0, damping=0.0)
  out.update({f"steps {k}": dict(max_iterations=k) for k in STEPS})
  return out


@functools.cache
def fit(name):
  """Every variant on one case in one program, with the converged block's
  products, and the other Kronecker families to compare with. Returns
  (blocks, outputs as numpy, brute force: `C` in the matrix layout, the
  per-example gradients `(N, i, o)`, the products' vector, the batch
  size)."""
  case, layer, fmt, which = CASES[name]
  eqn, data, c = case()
  blocks = {
    k: CLASSES[which](eqn, "layer", **options)
    for k, options in variants(name).items()
  }
  blocks.update(
    {
      f: (kfac_class(name) if f == "kfac" else FAMILIES[f][which])(eqn, "layer")
      for f in OTHERS
    }
  )
  v = random_vector(blocks["kl"])
  batch = data["inputs"][0].shape[0]

  @jax.jit
  def run(data):
    return {
      key: fit_with_products(block, data, batch, v, key == "kl")
      for key, block in blocks.items()
    }

  out = jax.tree_util.tree_map(np.asarray, run(data))
  layout = np.ix_(*[matrix_order(blocks["kl"], fmt)] * 2)
  for got in out.values():
    got["flat_dense"] = got["dense"]
    got["dense"] = got["dense"][layout]
  m = example_matrices(layer, data, fmt)
  return blocks, out, dict(c=np.asarray(c)[layout], m=m, v=v, batch=batch)


def kappa(block, m, batch):
  """The block's `κ`: its damping times the batch block's mean eigenvalue."""
  return block.damping * np.sum(m * m) / batch / m[0].size


def kl_objective(c, k):
  """`½ [tr(K⁻¹ C) + log det K]` for a positive definite `K`; inf for one
  singular to round-off (a conv's `L`), where `C` is positive definite."""
  values = np.linalg.eigvalsh(k)
  if values[0] <= 1e-10 * values[-1]:
    return np.inf
  return 0.5 * (np.trace(np.linalg.solve(k, c)) + np.sum(np.log(values)))


def best_scaled(c, k):
  """The objective at the best multiple of `k`, `s = tr(k⁻¹ C) / n`."""
  s = np.trace(np.linalg.solve(k, c)) / len(c)
  return kl_objective(c, s * k)


# --- the fixed point ------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_factors_satisfy_the_fixed_point_equations(name):
  """`d_b S_a = E[G S_b⁻¹ Gᵀ] + κ tr(S_b⁻¹) I` and `d_a S_b = E[Gᵀ S_a⁻¹
  G] + κ tr(S_a⁻¹) I` (the paper's Claim 2 at κ = 0), and the block is
  `S_a ⊗ S_b` with the factors' traces balanced."""
  blocks, out, truth = fit(name)
  m, batch = truth["m"], truth["batch"]
  d_a, d_b = m.shape[1:]
  for key in ("kl", "undamped"):
    if key not in out:
      continue
    state = out[key]["state"]
    a, b = state.kl_inputs, state.kl_outputs
    k = kappa(blocks[key], m, batch)
    a_inv, b_inv = np.linalg.inv(a), np.linalg.inv(b)
    left = np.einsum("nio,op,njp->ij", m, b_inv, m) / batch + k * np.trace(
      b_inv
    ) * np.eye(d_a)
    right = np.einsum("nio,ij,njp->op", m, a_inv, m) / batch + k * np.trace(
      a_inv
    ) * np.eye(d_b)
    np.testing.assert_allclose(
      d_b * a, left, rtol=1e-10, atol=1e-12 * np.abs(left).max(), err_msg=key
    )
    np.testing.assert_allclose(
      d_a * b, right, rtol=1e-10, atol=1e-12 * np.abs(right).max(), err_msg=key
    )
    np.testing.assert_allclose(np.trace(a) / d_a, np.trace(b) / d_b, **TOL)
    np.testing.assert_allclose(out[key]["dense"], np.kron(a, b), **TOL)
    # At the fixed point the whitened trace is the dimension.
    s = np.kron(a, b)
    np.testing.assert_allclose(
      np.trace(np.linalg.solve(s, truth["c"] + k * np.eye(len(s)))),
      len(s),
      rtol=1e-9,
    )


@pytest.mark.parametrize("name", list(CASES))
def test_the_fixed_point_minimises_the_kl_objective(name):
  """No Kronecker product does better: Shampoo², Shampoo, K-FAC and the
  Frobenius-nearest one, at their own scale and at their best multiple,
  random ones of the same trace, ones near the fixed point, and the
  iteration's own earlier steps, which descend."""
  blocks, out, truth = fit(name)
  m, batch = truth["m"], truth["batch"]
  d_a, d_b = m.shape[1:]
  target = truth["c"] + kappa(blocks["kl"], m, batch) * np.eye(d_a * d_b)
  kl = out["kl"]["dense"]
  best = kl_objective(target, kl)
  assert np.isfinite(best)
  others = {f: out[f]["dense"] for f in OTHERS}
  rng = np.random.default_rng(0)
  state = out["kl"]["state"]
  for k in range(10):
    x, y = rng.normal(size=(d_a, d_a)), rng.normal(size=(d_b, d_b))
    product = np.kron(x @ x.T + 0.1 * np.eye(d_a), y @ y.T)
    others[f"random {k}"] = product * np.trace(kl) / np.trace(product)
    x = rng.normal(size=(d_a, d_a)) * 1e-3 * np.abs(state.kl_inputs).max()
    others[f"near {k}"] = np.kron(state.kl_inputs + x @ x.T, state.kl_outputs)
  for f, k in others.items():
    for got in (kl_objective(target, k), best_scaled(target, k)):
      assert best <= got + 1e-12 * abs(best), (f, best, got)
  steps = [kl_objective(target, out[f"steps {k}"]["dense"]) for k in STEPS]
  assert all(
    later <= earlier + 1e-12 * abs(earlier)
    for earlier, later in zip(steps, steps[1:])
  ), steps
  assert best <= steps[-1] + 1e-12 * abs(best)


def test_later_updates_fit_the_average_with_the_previous_estimate():
  """One step from the previous factors is the paper's moving average
  (`S_a ← ρ S_a + (1-ρ)/d_b (E[G S_b⁻¹ Gᵀ] + κ tr(S_b⁻¹) I)`, then `S_b`
  from the new `S_a`); iterated, the estimate is the fixed point for the
  weighted mean `T` of the previous estimate and the damped batch block."""
  eqn, d1, d2, c2 = two_dense_batches()
  blocks = [
    kl_shampoo.DenseKLShampoo(
      eqn, "d", max_iterations=k, tolerance=0.0, damping=0.01
    )
    for k in (1, 2000)
  ]

  @jax.jit
  def run(d1, d2):
    return [updated_twice(block, d1, d2) for block in blocks]

  (s1, one, _, k_one), (f1, fixed, k1, k_fixed) = run(d1, d2)
  m = example_matrices(dense_layer, d2, None)
  kap = 0.01 * np.trace(c2) / 15
  rho = 0.05 / 1.05
  a0, b0 = np.asarray(s1.kl_inputs), np.asarray(s1.kl_outputs)
  a = rho * a0 + (1 - rho) / 3 * (
    np.einsum("nio,op,njp->ij", m, np.linalg.inv(b0), m) / 6
    + kap * np.trace(np.linalg.inv(b0)) * np.eye(5)
  )
  a_inv = np.linalg.inv(a)
  b = rho * np.trace(a0 @ a_inv) / 5 * b0 + (1 - rho) / 5 * (
    np.einsum("nio,ij,njp->op", m, a_inv, m) / 6
    + kap * np.trace(a_inv) * np.eye(3)
  )
  np.testing.assert_allclose(k_one, np.kron(a, b), **TOL)
  assert int(one.iterations) == 1
  np.testing.assert_allclose(fixed.weight, 1.05, **TOL)
  # The fixed point for T: `d_b S_a = R_T(S_b⁻¹)` through T's rearrangement.
  target = (0.05 * np.asarray(k1) + (c2 + kap * np.eye(15))) / 1.05
  t = target.reshape(5, 3, 5, 3)
  a, b = np.asarray(fixed.kl_inputs), np.asarray(fixed.kl_outputs)
  np.testing.assert_allclose(
    3 * a,
    np.einsum("iojp,op->ij", t, np.linalg.inv(b)),
    rtol=1e-10,
    atol=1e-12 * np.abs(a).max(),
  )
  np.testing.assert_allclose(
    5 * b,
    np.einsum("iojp,ij->op", t, np.linalg.inv(a)),
    rtol=1e-10,
    atol=1e-12 * np.abs(b).max(),
  )
  np.testing.assert_allclose(k_fixed, np.kron(a, b), **TOL)


# --- products -------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_products_and_eigenvalues_agree_with_the_kronecker_product(name):
  _, out, truth = fit(name)
  got, v = out["kl"], np.asarray(utils.flatten_arrays(truth["v"]))
  assert jax.tree_util.tree_structure(
    got["cached"]
  ) == jax.tree_util.tree_structure(got["state"])
  state = got["state"]
  s = np.kron(state.kl_inputs, state.kl_outputs)
  np.testing.assert_allclose(got["dense"], s, **TOL)
  flat = got["flat_dense"]  # the products' (parameters') order
  np.testing.assert_allclose(flat, flat.T, **TOL)
  damped = flat + DAMPING * np.eye(len(s))
  for p, e, u in MODES:
    np.testing.assert_allclose(
      got[f"{p} {e} {u}"], numpy_psd_power(damped, p) @ v, **TOL
    )
  want = np.linalg.eigvalsh(s)
  for key in ("eig", "eig_cached"):
    np.testing.assert_allclose(
      np.sort(got[key]), want, rtol=1e-8, atol=1e-10 * want[-1]
    )


def test_gradients_in_chunks_give_the_same_estimate():
  """With a budget of two examples' gradients (the conv's three in chunks
  of two, one zero-padded), every average is a sum over chunks."""
  name = "conv"
  blocks, out, _ = fit(name)
  case, _, _, which = CASES[name]
  eqn, data, _ = case()
  block = blocks["steps 3"]
  old = get_max_parallel_elements()
  set_max_parallel_elements(2 * 2 * block.input_size() * block.output_size())
  try:
    chunked = CLASSES[which](eqn, "layer", max_iterations=3)
    state = jax.jit(
      lambda d: chunked.update_curvature_matrix_estimate(
        chunked.init(None, None, None, False),
        d,
        0.0,
        1.0,
        d["inputs"][0].shape[0],
        None,
      )
    )(data)
  finally:
    set_max_parallel_elements(old)
  want = out["steps 3"]["state"]
  for field in ("kl_inputs", "kl_outputs", "weight", "iterations"):
    expected = getattr(want, field)
    np.testing.assert_allclose(
      getattr(state, field),
      expected,
      rtol=1e-8,
      atol=1e-10 * np.abs(expected).max(),
      err_msg=field,
    )


def test_zero_estimates_give_zero_blocks_and_finite_inverses():
  eqn, data, _ = dense_case()
  (dy,) = data["outputs_tangent"]
  data = dict(data, outputs_tangent=(jnp.zeros_like(dy),))
  block = kl_shampoo.DenseKLShampoo(eqn, "zero")
  v = random_vector(block)

  @jax.jit
  def run(data):
    state = block.update_curvature_matrix_estimate(
      block.init(None, -1, None, False), data, 0.0, 1.0, 6, None
    )
    cached = block.update_cache(state, DAMPING, -1, None, False)
    return block.to_dense_matrix(state), utils.flatten_arrays(
      block.multiply_inverse(cached, v, DAMPING, True, True)
    )

  dense, inverse = run(data)
  np.testing.assert_array_equal(dense, 0)
  np.testing.assert_allclose(
    inverse, utils.flatten_arrays(v) / DAMPING, rtol=1e-12
  )


def test_pmean_over_devices_equals_the_concatenated_batch():
  eqn, data, _ = dense_case()
  block = kl_shampoo.DenseKLShampoo(eqn, "layer")
  single, multi = estimates_on_one_and_two_devices(block, data)
  for field in ("kl_inputs", "kl_outputs", "iterations"):
    for device in (0, 1):
      np.testing.assert_allclose(
        getattr(multi, field)[device], getattr(single, field), **TOL
      )


# --- settings and errors --------------------------------------------------------


def test_the_approximation_maps_dense_and_conv_tags_with_its_settings():
  settings = dataclasses.replace(
    CURVATURES.defaults("kl_shampoo"),
    max_iterations=3,
    tolerance=1e-4,
    damping=0.1,
  )
  ctors = settings.blocks
  for tag, cls in (
    ("dense_tag", CLASSES[0]),
    ("repeated_dense_tag", CLASSES[0]),
    ("conv2d_tag", CLASSES[1]),
  ):
    assert ctors[tag].func is cls, tag
  block = ctors["dense_tag"](dense_case()[0], "layer")
  assert (block.max_iterations, block.tolerance, block.damping) == (
    3,
    1e-4,
    0.1,
  )
  default = CURVATURES.defaults("kl_shampoo").blocks["dense_tag"](
    dense_case()[0], "layer"
  )
  assert default.damping == 1e-3
  assert default.tolerance == np.finfo(np.float64).eps ** 0.5


def test_clear_errors():
  eqn = dense_case()[0]
  cls = kl_shampoo.DenseKLShampoo
  for bad in (0, -1, 1.5, True):
    with pytest.raises(ValueError, match="'d'.*max_iterations must be an int"):
      cls(eqn, "d", max_iterations=bad)
  with pytest.raises(ValueError, match="tolerance must be a number >= 0"):
    cls(eqn, "d", tolerance=-1.0)
  for bad in (-1e-3, None, "x"):
    with pytest.raises(ValueError, match="damping must be a number >= 0"):
      cls(eqn, "d", damping=bad)
  with pytest.raises(ValueError, match="DenseKLShampoo.*cannot be stacked"):
    stacked.Stacked(cls(eqn, "layer"), 2)
  with pytest.raises(ValueError, match="handles conv2d_tag"):
    kl_shampoo.Conv2DKLShampoo(eqn, "d")
