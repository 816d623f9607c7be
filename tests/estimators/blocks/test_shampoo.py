"""Shampoo², Shampoo, SOAP and the nearest Kronecker product against brute
force: per-example gradients from `jax.grad` and the exact block
`C = (1/B) Σ_n vec(G_n) vec(G_n)ᵀ` (float64), in the blocks' `(input_size,
output_size)` matrix layout."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from curvbench.approximations import CURVATURES
from estimators import tags, utils
from estimators.blocks import (
  eigenbasis,
  get_max_parallel_elements,
  kronecker,
  optimal_kronecker,
  set_max_parallel_elements,
  shampoo,
  stacked,
)
from tests.estimators.blocks.test_blocks import (
  DAMPING,
  MODES,
  conv_case,
  conv_layer,
  dense_layer,
  estimates_on_one_and_two_devices,
  fit_with_products,
  make_case,
  random_vector,
)
from tests.estimators.blocks.test_tnt import (
  example_matrices,
  matrix_order,
  repeated_case,
)
from tests.groundtruth import numpy_psd_power, random_normal

TOL = dict(rtol=1e-8, atol=1e-10)
Optimal = (
  optimal_kronecker.DenseOptimalKronecker,
  optimal_kronecker.Conv2DOptimalKronecker,
)


def dense_case():
  """A dense layer with bias: input_size 5, output_size 3, 6 examples."""
  params = (random_normal(1, 4, 3), random_normal(2, 3))
  return make_case(
    dense_layer, tags.register_dense, random_normal(3, 6, 4), params
  )


# name: (case, layer, kernel layout, index of the class in the pairs below)
CASES = {
  "dense": (dense_case, dense_layer, None, 0),
  "repeated": (repeated_case, dense_layer, None, 0),
  "conv": (
    lambda: conv_case("NCHW", 2, "SAME"),
    conv_layer("NCHW", 2, "SAME")[0],
    "NCHW",
    1,
  ),
}
# name: (dense class, conv class)
FAMILIES = {
  "shampoo2": (shampoo.DenseShampoo2, shampoo.Conv2DShampoo2),
  "shampoo": (shampoo.DenseShampoo, shampoo.Conv2DShampoo),
  "soap": (shampoo.DenseSOAP, shampoo.Conv2DSOAP),
  "optimal": Optimal,
  "optimal_0": tuple(functools.partial(c, max_iterations=0) for c in Optimal),
  "optimal_1": tuple(functools.partial(c, max_iterations=1) for c in Optimal),
  "kfac": (
    kronecker.DenseTwoKroneckerFactored,
    kronecker.Conv2DTwoKroneckerFactored,
  ),
}
PRODUCTS = ("shampoo2", "shampoo", "soap", "optimal")


def kfac_class(name):
  if name == "repeated":
    return kronecker.RepeatedDenseTwoKroneckerFactored
  return FAMILIES["kfac"][CASES[name][3]]


@functools.cache
def fit_all(name):
  """Every family fitted to one case, with products, in one program.

  Returns:
    (blocks, outputs as numpy, brute force): outputs per family: the state,
    the dense matrix in the matrix layout and, for `PRODUCTS`, every
    product mode, the round trips and the eigenvalues. The brute force:
    `C` in the matrix layout and the per-example gradients `(N, i, o)`.
  """
  case, layer, fmt, which = CASES[name]
  eqn, data, c = case()
  blocks = {
    f: (kfac_class(name) if f == "kfac" else cls[which])(eqn, "layer")
    for f, cls in FAMILIES.items()
  }
  v = random_vector(blocks["shampoo"])
  batch = data["inputs"][0].shape[0]

  @jax.jit
  def run(data):
    return {
      f: fit_with_products(
        block, data, batch, v, f in PRODUCTS, round_trip=True
      )
      for f, block in blocks.items()
    }

  out = jax.tree_util.tree_map(np.asarray, run(data))
  order = matrix_order(blocks["shampoo"], fmt)
  layout = np.ix_(order, order)
  for got in out.values():
    got["flat_dense"] = got["dense"]
    got["dense"] = got["dense"][layout]
  m = example_matrices(layer, data, fmt)
  return blocks, out, dict(c=np.asarray(c)[layout], m=m, v=v, batch=batch)


def rearranged(c, i, o):
  """`R(C)[(i, j), (o, p)] = C[(i, o), (j, p)]`: `||C - A ⊗ B|| =
  ||R(C) - vec(A) vec(B)ᵀ||`."""
  return c.reshape(i, o, i, o).transpose(0, 2, 1, 3).reshape(i * i, o * o)


def scaled_error(c, k):
  """`min_s ||C - s K||_F`, at `s = <C, K> / <K, K>`."""
  return np.linalg.norm(c - np.vdot(c, k) / np.vdot(k, k) * k)


def shampoo_factors(m, batch):
  return (
    np.einsum("nio,njo->ij", m, m) / batch,
    np.einsum("nio,nip->op", m, m) / batch,
  )


# --- statistics ---------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_factors_are_sums_of_per_example_products(name):
  _, out, truth = fit_all(name)
  m, batch = truth["m"], truth["batch"]
  rows = m.reshape(len(m), -1)  # row-major vec of each G_n
  np.testing.assert_allclose(rows.T @ rows / batch, truth["c"], **TOL)
  left, right = shampoo_factors(m, batch)
  for f in ("shampoo2", "shampoo", "soap", "optimal"):
    state = out[f]["state"]
    np.testing.assert_allclose(state.inputs_factor.value, left, **TOL)
    np.testing.assert_allclose(state.outputs_factor.value, right, **TOL)


@pytest.mark.parametrize("name", list(CASES))
def test_shampoo_and_shampoo2_keep_the_exact_trace(name):
  _, out, truth = fit_all(name)
  left, right = shampoo_factors(truth["m"], truth["batch"])
  trace = np.trace(truth["c"])
  for f in ("shampoo2", "shampoo", "soap"):
    np.testing.assert_allclose(np.trace(out[f]["dense"]), trace, **TOL)
  np.testing.assert_allclose(
    out["shampoo2"]["dense"], np.kron(left, right) / trace, **TOL
  )
  roots = [numpy_psd_power(x, 0.5) for x in (left, right)]
  expected = np.kron(*roots) * trace / np.trace(roots[0]) / np.trace(roots[1])
  # A conv's L is singular (rank <= 18 of 19): the root of a round-off
  # eigenvalue e is sqrt(e), so the two roots agree to about sqrt(eps).
  np.testing.assert_allclose(
    out["shampoo"]["dense"],
    expected,
    rtol=1e-6,
    atol=1e-7 * np.abs(expected).max(),
  )


# --- the power iteration ------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_shampoo2_is_one_step_from_the_identity(name):
  """Shampoo²'s factors are `R(C)` times the identity on either side;
  alternating from `B = I` gives `A = L`, then `B = E[Gᵀ L G]` (Morwani et
  al.); the block's first step starts from `B₀ ∝ R`, and zero steps keep
  Shampoo² with the optimal scalar."""
  _, out, truth = fit_all(name)
  c, m, batch = truth["c"], truth["m"], truth["batch"]
  i, o = m.shape[1:]
  r_c = rearranged(c, i, o)
  state = out["shampoo2"]["state"]
  left, right = state.inputs_factor.value, state.outputs_factor.value
  np.testing.assert_allclose(
    (r_c @ np.eye(o).reshape(-1)).reshape(i, i), left, **TOL
  )
  np.testing.assert_allclose(
    (r_c.T @ np.eye(i).reshape(-1)).reshape(o, o), right, **TOL
  )
  np.testing.assert_allclose(
    (r_c.T @ left.reshape(-1)).reshape(o, o),
    np.einsum("nio,ij,njp->op", m, left, m) / batch,
    **TOL,
  )
  # One step of the block's alternating iteration, from Shampoo²'s R.
  one = out["optimal_1"]["state"]
  a = r_c @ (right / np.linalg.norm(right)).reshape(-1)
  a /= np.linalg.norm(a)
  b = r_c.T @ a
  scale = np.linalg.norm(b)
  assert one.iterations == 1
  np.testing.assert_allclose(one.kronecker_inputs.reshape(-1), a, **TOL)
  np.testing.assert_allclose(
    one.kronecker_outputs.reshape(-1), b / scale, **TOL
  )
  np.testing.assert_allclose(one.kronecker_scale, scale, **TOL)
  # Zero steps: Shampoo², optimally scaled.
  s2 = out["shampoo2"]["dense"]
  np.testing.assert_allclose(
    out["optimal_0"]["dense"], np.vdot(c, s2) / np.vdot(s2, s2) * s2, **TOL
  )


@pytest.mark.parametrize("name", list(CASES))
def test_optimal_kronecker_is_the_nearest_kronecker_product(name):
  blocks, out, truth = fit_all(name)
  c = truth["c"]
  i, o = truth["m"].shape[1:]
  state, dense = out["optimal"]["state"], out["optimal"]["dense"]
  # Converged by its own criterion, to the top singular triple of R(C).
  block = blocks["optimal"]
  assert 1 < state.iterations < block.max_iterations
  assert state.change <= block.tolerance == np.finfo(np.float64).eps ** 0.5
  u, s, vt = np.linalg.svd(rearranged(c, i, o))
  best = s[0] * np.kron(u[:, 0].reshape(i, i), vt[0].reshape(o, o))
  np.testing.assert_allclose(
    dense, best, rtol=1e-6, atol=1e-7 * np.abs(c).max()
  )
  error = np.linalg.norm(c - dense)
  np.testing.assert_allclose(error, np.sqrt(np.sum(s[1:] ** 2)), rtol=1e-9)
  others = {f: out[f]["dense"] for f in ("kfac", "shampoo2", "shampoo")}
  rng = np.random.default_rng(0)
  a, b = state.kronecker_inputs, state.kronecker_outputs
  for k in range(10):  # anywhere, and near the optimum
    others[f"random {k}"] = np.kron(
      rng.normal(size=(i, i)), rng.normal(size=(o, o))
    )
    others[f"near {k}"] = np.kron(
      a + 1e-3 * rng.normal(size=(i, i)) * np.abs(a).max(),
      b + 1e-3 * rng.normal(size=(o, o)) * np.abs(b).max(),
    )
  for f, k in others.items():
    assert error <= scaled_error(c, k) * (1 + 1e-12), f


def two_dense_batches():
  """Two batches of 6 examples (seeds 0 and 1) through one dense layer with
  bias (input 5, output 3): its equation, both batches' block data and the
  second's exact block."""
  params = (random_normal(1, 4, 3), random_normal(2, 3))
  (eqn, d1, _), (_, d2, c2) = (
    make_case(
      dense_layer,
      tags.register_dense,
      random_normal(20 + k, 6, 4),
      params,
      seed=k,
    )
    for k in range(2)
  )
  return eqn, d1, d2, c2


def updated_twice(block, d1, d2):
  """`block`'s states after a first update from zero with `d1` (decay 0.9,
  weight 0.1) and a second with `d2` (decay 0.5, weight 1), and their dense
  matrices."""
  s1 = block.update_curvature_matrix_estimate(
    block.init(None, None, None, False), d1, 0.9, 0.1, 6, None
  )
  s2 = block.update_curvature_matrix_estimate(s1, d2, 0.5, 1.0, 6, None)
  return s1, s2, block.to_dense_matrix(s1), block.to_dense_matrix(s2)


def test_later_updates_fit_the_average_with_the_previous_estimate():
  """The second update is the nearest Kronecker product to the weighted
  mean of the first estimate and the second batch's exact block."""
  eqn, d1, d2, c2 = two_dense_batches()
  block = optimal_kronecker.DenseOptimalKronecker(eqn, "d")
  run = jax.jit(lambda d1, d2: updated_twice(block, d1, d2))
  s1, s2, k1, k2 = run(d1, d2)
  np.testing.assert_allclose(s1.kronecker_weight, 0.1, **TOL)
  np.testing.assert_allclose(s2.kronecker_weight, 1.05, **TOL)
  target = (0.05 * np.asarray(k1) + np.asarray(c2)) / 1.05
  u, s, vt = np.linalg.svd(rearranged(target, 5, 3))
  best = s[0] * np.kron(u[:, 0].reshape(5, 5), vt[0].reshape(3, 3))
  np.testing.assert_allclose(k2, best, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(  # Shampoo²'s factors: the usual average
    s2.inputs_factor.value,
    (
      0.05 * s1.inputs_factor.value
      + shampoo_factors(example_matrices(dense_layer, d2, None), 6)[0]
    )
    / 1.05,
    **TOL,
  )


# --- SOAP ---------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_soap_is_the_best_diagonal_in_shampoos_eigenbasis(name):
  _, out, truth = fit_all(name)
  c = truth["c"]
  state, soap = out["soap"]["state"], out["soap"]["dense"]
  q_l, q_r = state.inputs_basis, state.outputs_basis
  for q, factor in (
    (q_l, state.inputs_factor.value),
    (q_r, state.outputs_factor.value),
  ):
    np.testing.assert_allclose(q.T @ q, np.eye(len(q)), **TOL)
    rotated = q.T @ factor @ q
    np.testing.assert_allclose(
      rotated,
      np.diag(np.diag(rotated)),
      rtol=1e-8,
      atol=1e-10 * np.abs(factor).max(),
    )
  q = np.kron(q_l, q_r)
  d = np.diag(q.T @ c @ q)
  np.testing.assert_allclose(state.scalings.value.reshape(-1), d, **TOL)
  np.testing.assert_allclose(soap, q @ np.diag(d) @ q.T, **TOL)
  error = np.linalg.norm(c - soap)
  others = {f: out[f]["dense"] for f in ("shampoo2", "shampoo")}
  rng = np.random.default_rng(1)
  for k in range(10):
    others[f"random {k}"] = (
      q @ np.diag(rng.exponential(size=len(d)) * d.mean()) @ q.T
    )
    others[f"near {k}"] = (
      q @ np.diag(d * (1 + 0.1 * rng.normal(size=len(d)))) @ q.T
    )
  for f, other in others.items():
    assert error <= np.linalg.norm(c - other) * (1 + 1e-12), f


@pytest.mark.parametrize("name", list(CASES) + ["conv in chunks"])
def test_soap_forms_the_gradients_once_for_the_same_estimate(name):
  """An update forms the per-example gradients of repeated dense and conv
  tags once, where EKFAC's update forms them for the factors and again for
  the scalings, and gives the same state: a first update, a refresh, and
  a moving-average update (in chunks of two examples too, where a first
  update forms them again for the scalings in its new basis)."""
  case, _, _, which = CASES[name.split()[0]]
  eqn, data, _ = case()
  block = FAMILIES["soap"][which](eqn, "layer")
  batch = data["inputs"][0].shape[0]
  (dy,) = data["outputs_tangent"]
  second = dict(data, outputs_tangent=(2 * dy[:, ::-1],))
  formed = []
  hook = block._per_example_gradients  # counted while the update is traced
  block._per_example_gradients = lambda d: (formed.append(1), hook(d))[1]

  def run(update, data, second):
    state = update(
      block, block.init(None, None, None, False), data, 0.0, 1.0, batch, None
    )
    state = block.update_cache(state, DAMPING, None, None, False)
    state = update(block, state, second, 0.5, 1.0, batch, None)
    # What the bases' signs do not change.
    return (
      state.inputs_factor,
      state.outputs_factor,
      state.scalings,
      block.to_dense_matrix(state),
    )

  old = get_max_parallel_elements()
  if name.endswith("chunks"):
    set_max_parallel_elements(2 * 2 * block.input_size() * block.output_size())
  try:
    states = {}
    for key, update in (
      ("once", type(block).update_curvature_matrix_estimate),
      ("twice", eigenbasis.EKFAC.update_curvature_matrix_estimate),
    ):
      formed.clear()
      states[key] = jax.jit(functools.partial(run, update))(data, second)
      if name in ("repeated", "conv"):  # traced once per formation
        assert len(formed) == {"once": 2, "twice": 4}[key], (key, formed)
  finally:
    set_max_parallel_elements(old)
  for got, want in zip(
    jax.tree_util.tree_leaves(states["once"]),
    jax.tree_util.tree_leaves(states["twice"]),
    strict=True,
  ):
    np.testing.assert_allclose(
      got, want, rtol=1e-9, atol=1e-12 * np.abs(want).max()
    )


# --- products -----------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("family", PRODUCTS)
def test_products_and_eigenvalues_agree_with_the_dense_export(name, family):
  _, out, truth = fit_all(name)
  got, v = out[family], np.asarray(utils.flatten_arrays(truth["v"]))
  assert jax.tree_util.tree_structure(
    got["cached"]
  ) == jax.tree_util.tree_structure(got["state"])
  m = got["flat_dense"]
  np.testing.assert_allclose(m, m.T, **TOL)
  damped = m + DAMPING * np.eye(len(m))
  for p, e, u in MODES:
    # Shampoo² (TNT's machinery) splits the damping when not exact.
    if e or family != "shampoo2":
      np.testing.assert_allclose(
        got[f"{p} {e} {u}"], numpy_psd_power(damped, p) @ v, **TOL
      )
  for e in (True, False):
    for u in (True, False):
      np.testing.assert_allclose(got[f"back {e} {u}"], v, **TOL)
  want = np.sort(np.linalg.eigvalsh(m))
  for key in ("eig", "eig_cached"):
    np.testing.assert_allclose(
      np.sort(got[key]), want, rtol=1e-8, atol=1e-10 * want[-1]
    )


@pytest.mark.parametrize("name", ["repeated", "conv"])
def test_gradients_in_chunks_give_the_same_estimates(name):
  """With a budget of two examples' gradients (one zero-padded example for
  the conv's three), the averages are sums over chunks."""
  blocks, out, _ = fit_all(name)
  case, _, _, which = CASES[name]
  eqn, data, _ = case()
  families = ("soap", "optimal")
  budget = 2 * 2 * blocks["soap"].input_size() * blocks["soap"].output_size()
  old = get_max_parallel_elements()
  set_max_parallel_elements(budget)
  try:
    chunked = {f: FAMILIES[f][which](eqn, "layer") for f in families}
    states = jax.jit(
      lambda data: {
        f: b.update_curvature_matrix_estimate(
          b.init(None, None, None, False),
          data,
          0.0,
          1.0,
          data["inputs"][0].shape[0],
          None,
        )
        for f, b in chunked.items()
      }
    )(data)
  finally:
    set_max_parallel_elements(old)
  for f in families:
    want = out[f]["state"]
    # Not `change`: the last step's round-off-sized move.
    fields = [
      k.name
      for k in dataclasses.fields(want)
      if k.name not in ("cache", "change")
    ]
    for field in fields:
      for got, expected in zip(
        jax.tree_util.tree_leaves(getattr(states[f], field)),
        jax.tree_util.tree_leaves(getattr(want, field)),
        strict=True,
      ):
        np.testing.assert_allclose(
          got,
          expected,
          rtol=1e-8,
          atol=1e-10 * np.abs(expected).max(),
          err_msg=f"{f} {field}",
        )


def test_zero_estimates_give_zero_blocks_and_finite_inverses():
  eqn, data, _ = dense_case()
  (dy,) = data["outputs_tangent"]
  data = dict(data, outputs_tangent=(jnp.zeros_like(dy),))
  classes = (
    shampoo.DenseShampoo,
    shampoo.DenseSOAP,
    optimal_kronecker.DenseOptimalKronecker,
  )
  blocks = [cls(eqn, "zero") for cls in classes]
  v = random_vector(blocks[0])

  @jax.jit
  def run(data):
    out = []
    for block in blocks:
      state = block.update_curvature_matrix_estimate(
        block.init(None, -1, None, False), data, 0.0, 1.0, 6, None
      )
      cached = block.update_cache(state, DAMPING, -1, None, False)
      out.append(
        (
          block.to_dense_matrix(state),
          utils.flatten_arrays(
            block.multiply_inverse(cached, v, DAMPING, True, True)
          ),
        )
      )
    return out

  for dense, inverse in run(data):
    np.testing.assert_array_equal(dense, 0)
    np.testing.assert_allclose(
      inverse, utils.flatten_arrays(v) / DAMPING, rtol=1e-12
    )


def test_pmean_over_devices_equals_the_concatenated_batch():
  eqn, data, _ = dense_case()
  block = optimal_kronecker.DenseOptimalKronecker(eqn, "layer")
  single, multi = estimates_on_one_and_two_devices(block, data)
  fields = (
    "inputs_factor",
    "outputs_factor",
    "kronecker_inputs",
    "kronecker_outputs",
    "kronecker_scale",
    "iterations",
  )
  pick = lambda state: jax.tree_util.tree_leaves(
    [getattr(state, f) for f in fields]
  )
  for got, want in zip(pick(multi), pick(single), strict=True):
    for device in (0, 1):
      np.testing.assert_allclose(got[device], want, **TOL)


# --- settings and errors ------------------------------------------------------


def test_the_approximations_map_dense_and_conv_tags_to_the_families():
  expected = {
    "shampoo2": FAMILIES["shampoo2"],
    "shampoo": FAMILIES["shampoo"],
    "soap": FAMILIES["soap"],
    "optimal_kronecker": Optimal,
  }
  eqn = dense_case()[0]
  for name, (dense, conv) in expected.items():
    settings = CURVATURES.defaults(name)
    ctors = settings.blocks
    # Embeddings: tests/estimators/blocks/test_shampoo_embedding.py.
    assert set(ctors) == {
      "dense_tag",
      "repeated_dense_tag",
      "conv2d_tag",
      "embedding_tag",
    }
    for tag, cls in (
      ("dense_tag", dense),
      ("repeated_dense_tag", dense),
      ("conv2d_tag", conv),
    ):
      assert getattr(ctors[tag], "func", ctors[tag]) is cls, (name, tag)
  settings = dataclasses.replace(
    CURVATURES.defaults("optimal_kronecker"), max_iterations=3, tolerance=1e-4
  )
  block = settings.blocks["dense_tag"](eqn, "layer")
  assert (block.max_iterations, block.tolerance) == (3, 1e-4)


def test_clear_errors():
  eqn = dense_case()[0]
  cls = optimal_kronecker.DenseOptimalKronecker
  for bad in (-1, 1.5, True):
    with pytest.raises(ValueError, match="'d'.*max_iterations must be an int"):
      cls(eqn, "d", max_iterations=bad)
  with pytest.raises(ValueError, match="tolerance must be a number >= 0"):
    cls(eqn, "d", tolerance=-1.0)
  for bad in (cls, shampoo.DenseSOAP):
    with pytest.raises(ValueError, match=f"{bad.__name__}.*cannot be stacked"):
      stacked.Stacked(bad(eqn, "layer"), 2)
  with pytest.raises(ValueError, match="handles conv2d_tag"):
    shampoo.Conv2DShampoo(eqn, "d")
