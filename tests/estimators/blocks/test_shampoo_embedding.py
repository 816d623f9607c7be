"""The Shampoo family's embedding blocks against brute force (float64):
per-example gradients of the table from `jax.grad`, the exact block
`C = (1/B) Σ_n vec(G_n) vec(G_n)ᵀ`, and the family's dense block on the
explicit one-hot inputs; the input factor whole (`V <= max_full_vocab`) or
its diagonal, which stores nothing of size `V x V`."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from curvbench.approximations import CURVATURES
from estimators import blocks, utils
from tests.estimators.blocks.test_blocks import (
  DAMPING,
  MODES,
  S,
  fit_with_products,
  random_vector,
)
from tests.estimators.blocks.test_embedding_blocks import (
  IDS,
  TABLE,
  B,
  D,
  V,
  embedding_case,
  lookup,
  one_hot_case,
)
from tests.estimators.blocks.test_kl_shampoo import kl_objective
from tests.groundtruth import numpy_psd_power

TOL = dict(rtol=1e-8, atol=1e-11)
# name: (embedding block, the family's block for dense tags)
FAMILIES = {
  "shampoo2": (blocks.EmbeddingShampoo2, blocks.DenseShampoo2),
  "shampoo": (blocks.EmbeddingShampoo, blocks.DenseShampoo),
  "soap": (blocks.EmbeddingSOAP, blocks.DenseSOAP),
  "optimal": (blocks.EmbeddingOptimalKronecker, blocks.DenseOptimalKronecker),
  "kl": (blocks.EmbeddingKLShampoo, blocks.DenseKLShampoo),
}
FORMS = {"full": {}, "diagonal": dict(max_full_vocab=V - 1)}
CONVERGED = {"kl": dict(max_iterations=1000, tolerance=0.0)}
WITH_FACTORS = ("shampoo2", "shampoo", "soap", "optimal")  # L and R kept


@functools.cache
def fit(name, products=False):
  """Every family in both forms, and K-FAC's and TNT's embedding blocks,
  on one ids case in one program; with `products`, every product mode."""
  eqn, data, c = embedding_case(name)
  fitted = {
    f"{f} {form}": cls(eqn, "layer", **options, **CONVERGED.get(f, {}))
    for f, (cls, _) in FAMILIES.items()
    for form, options in FORMS.items()
  }
  fitted["kfac"] = blocks.EmbeddingKFAC(eqn, "layer")
  fitted["tnt"] = blocks.EmbeddingTNT(eqn, "layer")
  v = random_vector(fitted["kfac"])

  @jax.jit
  def run(data):
    return {
      key: fit_with_products(
        block, data, B, v, products and key not in ("kfac", "tnt")
      )
      for key, block in fitted.items()
    }

  out = jax.tree_util.tree_map(np.asarray, run(data))
  return fitted, out, dict(c=np.asarray(c), g=example_gradients(name), v=v)


@functools.cache
def fit_one_hot(name):
  """Each family's dense block on the one-hot inputs (same tangents)."""
  eqn, data, _ = one_hot_case(name)
  fitted = {
    f: cls(eqn, "layer", **CONVERGED.get(f, {}))
    for f, (_, cls) in FAMILIES.items()
  }
  run = jax.jit(
    lambda data: {
      f: b.to_dense_matrix(
        b.update_curvature_matrix_estimate(
          b.init(None, None, None, False), data, 0.0, 1.0, B, None
        )
      )
      for f, b in fitted.items()
    }
  )
  return jax.tree_util.tree_map(np.asarray, run(data))


def example_gradients(name):
  """`(S * B, V, D)`: each (sample, example) gradient of the table, from
  `jax.grad` of `<dy, lookup(ids, table)>`."""
  _, data, _ = embedding_case(name)
  ids, (dy,) = jnp.asarray(IDS[name]), data["outputs_tangent"]

  def one(ids_n, dy_n):
    return jax.grad(lambda w: jnp.vdot(dy_n, lookup(ids_n[None], (w,))[0]))(
      TABLE
    )

  grads = jax.jit(jax.vmap(jax.vmap(one), (None, 0)))(ids, dy)
  return np.asarray(grads).reshape(-1, V, D)


def shampoo_factors(g):
  return (
    np.einsum("nvo,nwo->vw", g, g) / B,
    np.einsum("nvo,nvp->op", g, g) / B,
  )


def scaled_error(c, k):
  """`min_s ||C - s K||_F`."""
  return np.linalg.norm(c - np.vdot(c, k) / np.vdot(k, k) * k)


def diag_kron(a, b):
  return np.kron(np.diag(a), b)


# --- statistics ---------------------------------------------------------------


@pytest.mark.parametrize("form", list(FORMS))
def test_factors_are_sums_of_per_example_products(form):
  _, out, truth = fit("repeats")
  g, c = truth["g"], truth["c"]
  flat = g.reshape(len(g), -1)
  np.testing.assert_allclose(flat.T @ flat / B, c, **TOL)
  left, right = shampoo_factors(g)
  assert np.abs(left - np.diag(np.diag(left))).max() > 0.1  # tokens couple
  want = left if form == "full" else np.diag(left)
  for f in WITH_FACTORS:
    state = out[f"{f} {form}"]["state"]
    np.testing.assert_allclose(state.inputs_factor.value, want, **TOL)
    np.testing.assert_allclose(state.outputs_factor.value, right, **TOL)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_full_form_is_the_family_block_on_one_hot_inputs(family):
  """With the whole `V x V` factor every family equals its dense block on
  the one-hot inputs, where tokens repeat within examples too."""
  got = fit("repeats")[1][f"{family} full"]["dense"]
  np.testing.assert_allclose(got, fit_one_hot("repeats")[family], **TOL)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_both_forms_agree_with_one_token_per_example(family):
  """`L` is diagonal when no example holds two tokens."""
  out = fit("one_per_example")[1]
  np.testing.assert_allclose(
    out[f"{family} diagonal"]["dense"], out[f"{family} full"]["dense"], **TOL
  )
  repeats = fit("repeats")[1]
  assert not np.allclose(
    repeats[f"{family} diagonal"]["dense"],
    repeats[f"{family} full"]["dense"],
    rtol=1e-3,
  )


@pytest.mark.parametrize("form", list(FORMS))
def test_shampoo2_shampoo_and_soap_from_the_factors(form):
  """Shampoo² is `L ⊗ R / tr L` (with `diag(L)`: `EmbeddingTNT`'s block),
  Shampoo its trace-matched root, SOAP the best diagonal of `C` in the
  eigenbasis of `L ⊗ R` (the identity for `diag(L)`)."""
  _, out, truth = fit("repeats")
  c = truth["c"]
  left, right = shampoo_factors(truth["g"])
  if form == "diagonal":
    left = np.diag(np.diag(left))
    np.testing.assert_allclose(
      out[f"shampoo2 {form}"]["dense"], out["tnt"]["dense"], **TOL
    )
  trace = np.trace(left)
  np.testing.assert_allclose(
    out[f"shampoo2 {form}"]["dense"], np.kron(left, right) / trace, **TOL
  )
  roots = [numpy_psd_power(x, 0.5) for x in (left, right)]
  np.testing.assert_allclose(
    out[f"shampoo {form}"]["dense"],
    np.kron(*roots) * trace / np.trace(roots[0]) / np.trace(roots[1]),
    rtol=1e-7,
    atol=1e-9,
  )
  state = out[f"soap {form}"]["state"]
  q_l = np.eye(V) if form == "diagonal" else state.inputs_basis
  assert (state.inputs_basis is None) == (form == "diagonal")
  q = np.kron(q_l, state.outputs_basis)
  np.testing.assert_allclose(
    q.T @ np.kron(left, right) @ q,
    np.diag(np.diag(q.T @ np.kron(left, right) @ q)),
    rtol=1e-8,
    atol=1e-10,
  )
  d = np.diag(q.T @ c @ q)
  np.testing.assert_allclose(state.scalings.value.reshape(-1), d, **TOL)
  np.testing.assert_allclose(
    out[f"soap {form}"]["dense"], q @ np.diag(d) @ q.T, **TOL
  )


# --- the nearest Kronecker products -------------------------------------------


@pytest.mark.parametrize("form", list(FORMS))
def test_optimal_kronecker_is_no_farther_than_the_others(form):
  """The nearest `σ A ⊗ B` (`A` diagonal in the diagonal form: the top
  singular pair of the diagonal blocks `C_vv` as rows) and no Kronecker
  product of its class nearer: the other families, K-FAC's and TNT's
  embedding blocks (`diag(a) ⊗ G`), random ones."""
  _, out, truth = fit("repeats")
  c = truth["c"]
  dense = out[f"optimal {form}"]["dense"]
  blocks4 = c.reshape(V, D, V, D)
  if form == "full":
    rearranged = blocks4.transpose(0, 2, 1, 3).reshape(V * V, D * D)
    u, s, vt = np.linalg.svd(rearranged)
    best = s[0] * np.kron(u[:, 0].reshape(V, V), vt[0].reshape(D, D))
  else:
    rows = np.stack([blocks4[i, :, i, :].reshape(-1) for i in range(V)])
    u, s, vt = np.linalg.svd(rows)
    best = s[0] * diag_kron(u[:, 0], vt[0].reshape(D, D))
  np.testing.assert_allclose(
    dense, best, rtol=1e-6, atol=1e-7 * np.abs(c).max()
  )
  error = np.linalg.norm(c - dense)
  others = {
    f: out[f"{f} {form}"]["dense"]  # SOAP's is no Kronecker product
    for f in ("shampoo2", "shampoo", "kl")
  }
  others.update(kfac=out["kfac"]["dense"], tnt=out["tnt"]["dense"])
  rng = np.random.default_rng(0)
  for k in range(10):
    a = rng.normal(size=V) if form == "diagonal" else rng.normal(size=(V, V))
    others[f"random {k}"] = (diag_kron if a.ndim == 1 else np.kron)(
      a, rng.normal(size=(D, D))
    )
  for f, k in others.items():
    assert error <= scaled_error(c, k) * (1 + 1e-10), f


@pytest.mark.parametrize("form", list(FORMS))
def test_kl_shampoo_solves_its_fixed_point_and_minimises_kl(form):
  """The fixed point (its diagonal, in the diagonal form) and no Kronecker
  product of its class with a smaller KL objective."""
  fitted, out, truth = fit("repeats")
  g, c = truth["g"], truth["c"]
  block, state = fitted[f"kl {form}"], out[f"kl {form}"]["state"]
  kappa = block.damping * np.trace(c) / c.shape[0]
  b_inv = np.linalg.inv(state.kl_outputs)
  left = np.einsum("nvo,op,nwp->vw", g, b_inv, g) / B + kappa * np.trace(
    b_inv
  ) * np.eye(V)
  if form == "full":
    a = state.kl_inputs
  else:
    a = np.diag(state.kl_inputs)
    left = np.diag(np.diag(left))
  a_inv = np.linalg.inv(a)
  right = np.einsum("nvo,vw,nwp->op", g, a_inv, g) / B + kappa * np.trace(
    a_inv
  ) * np.eye(D)
  np.testing.assert_allclose(D * a, left, rtol=1e-10, atol=1e-13)
  np.testing.assert_allclose(
    V * state.kl_outputs, right, rtol=1e-10, atol=1e-13
  )
  target = c + kappa * np.eye(V * D)
  best = kl_objective(target, np.kron(a, state.kl_outputs))
  assert np.isfinite(best)
  np.testing.assert_allclose(
    best, kl_objective(target, out[f"kl {form}"]["dense"]), rtol=1e-10
  )
  rng = np.random.default_rng(1)
  others = {
    f: out[f"{f} {form}"]["dense"] for f in ("shampoo2", "shampoo", "optimal")
  }
  others.update(kfac=out["kfac"]["dense"], tnt=out["tnt"]["dense"])
  for k in range(10):
    x, y = rng.normal(size=(V, V)), rng.normal(size=(D, D))
    a_k = x @ x.T + 0.1 * np.eye(V)
    if form == "diagonal":
      a_k = np.diag(np.diag(a_k))
    others[f"random {k}"] = np.kron(a_k, y @ y.T)
  for f, k in others.items():
    s = (
      np.trace(np.linalg.solve(k, target)) / len(k)
      if np.linalg.eigvalsh(k)[0] > 1e-10 * np.abs(k).max()
      else 1.0
    )
    assert best <= kl_objective(target, s * k) + 1e-12 * abs(best), f
  if form == "diagonal":  # the full form's optimum is at least as good
    full = kl_objective(target, out["kl full"]["dense"])
    assert full <= best + 1e-12 * abs(best)


# --- products and sizes -------------------------------------------------------


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_products_eigenvalues_and_state_size(family, form):
  _, out, truth = fit("repeats", products=True)
  got = out[f"{family} {form}"]
  v = np.asarray(utils.flatten_arrays(truth["v"]))
  np.testing.assert_allclose(
    got["dense"], fit("repeats")[1][f"{family} {form}"]["dense"], **TOL
  )
  m = got["dense"]
  np.testing.assert_allclose(m, m.T, **TOL)
  damped = m + DAMPING * np.eye(len(m))
  for p, e, u in MODES:
    np.testing.assert_allclose(
      got[f"{p} {e} {u}"], numpy_psd_power(damped, p) @ v, **TOL
    )
  want = np.linalg.eigvalsh(m)
  for key in ("eig", "eig_cached"):
    np.testing.assert_allclose(
      np.sort(got[key]), want, rtol=1e-8, atol=1e-10 * want[-1]
    )
  sizes = [x.size for x in jax.tree.leaves(got["cached"])]
  if form == "diagonal":
    assert max(sizes) <= max(V * D, D * D) < V * V, sizes
  else:
    assert max(sizes) == V * V


def test_soaps_rotated_gradients_in_chunks_give_the_same_scalings():
  """With a budget of one example's rotated `(V, D)` gradients per sample,
  the full form's scalings are summed over chunks of examples."""
  eqn, data, _ = embedding_case("repeats")
  old = blocks.get_max_parallel_elements()
  blocks.set_max_parallel_elements(S * V * D)
  try:
    block = blocks.EmbeddingSOAP(eqn, "layer")
    state = jax.jit(
      lambda d: block.update_curvature_matrix_estimate(
        block.init(None, None, None, False), d, 0.0, 1.0, B, None
      )
    )(data)
  finally:
    blocks.set_max_parallel_elements(old)
  want = fit("repeats")[1]["soap full"]["state"].scalings.value
  np.testing.assert_allclose(state.scalings.value, want, **TOL)


# --- settings and errors ------------------------------------------------------

APPROXIMATIONS = {
  "shampoo2": "shampoo2",
  "shampoo": "shampoo",
  "soap": "soap",
  "optimal_kronecker": "optimal",
  "kl_shampoo": "kl",
}


def test_the_approximations_map_embeddings_with_their_setting():
  eqn = embedding_case("repeats")[0]
  for name, family in APPROXIMATIONS.items():
    settings = CURVATURES.defaults(name)
    assert settings.max_full_vocab == blocks.MAX_FULL_VOCAB == 4096
    ctor = settings.blocks["embedding_tag"]
    assert ctor.func is FAMILIES[family][0], name
    assert ctor(eqn, "layer").full_inputs_factor
    small = dataclasses.replace(settings, max_full_vocab=V - 1)
    block = small.blocks["embedding_tag"](eqn, "layer")
    assert (block.max_full_vocab, block.full_inputs_factor) == (V - 1, False)
  assert blocks.EmbeddingSOAP(eqn, "layer", max_full_vocab=V).full_inputs_factor


def test_clear_errors():
  eqn = embedding_case("repeats")[0]
  for cls, _ in FAMILIES.values():
    for bad in (-1, 1.5, True):
      with pytest.raises(
        ValueError, match="'e'.*max_full_vocab must be an int >= 0"
      ):
        cls(eqn, "e", max_full_vocab=bad)
  dense_eqn = one_hot_case("repeats")[0]
  with pytest.raises(ValueError, match="handles embedding_tag"):
    blocks.EmbeddingShampoo(dense_eqn, "d")
