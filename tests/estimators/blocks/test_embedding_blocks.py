"""Embedding blocks of every family against brute force (float64): each
equals its family's dense-layer block on the explicit one-hot inputs where
the family's definition makes them equal, and the per-example curvature's
definition everywhere; none stores a vocab x vocab matrix."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from estimators import blocks, tags, utils
from tests.estimators.blocks.test_blocks import (
  DAMPING,
  MODES,
  POWERS,
  S,
  dense_layer,
  fitted,
  make_case,
  matpower_products,
  random_vector,
)
from tests.groundtruth import numpy_psd_power

V, D, B, T = 9, 3, 4, 5
TOL = dict(rtol=1e-9, atol=1e-12)
TABLE = jnp.asarray(np.random.RandomState(1).standard_normal((V, D)))
_rng = np.random.RandomState(0)
# Token ids, batch first: tokens 6 to 8 never occur (zero frequencies).
IDS = {
  "repeats": _rng.randint(0, 6, (B, T)),  # tokens repeat within examples
  "distinct": np.stack([_rng.permutation(V)[:T] for _ in range(B)]),
  "one_per_example": _rng.randint(0, 6, (B,)),
}
assert any(len(set(row)) < T for row in IDS["repeats"])


def lookup(ids, params):
  return params[0][ids]


@functools.cache  # the cases are read, never changed
def embedding_case(name):
  ids = jnp.asarray(IDS[name])
  return make_case(lookup, tags.register_embedding, ids, (TABLE,))


@functools.cache
def one_hot_case(name):
  """The same layer as a dense layer on explicit one-hot inputs (the same
  output tangents: `make_case` draws them from the output shape)."""
  ids = jnp.asarray(IDS[name])
  register = (
    tags.register_dense if ids.ndim == 1 else tags.register_repeated_dense
  )
  return make_case(dense_layer, register, jax.nn.one_hot(ids, V), (TABLE,))


@functools.cache
def estimate(cls, case, name):
  """`cls`'s state and dense matrix on `case(name)` (one compiled call)."""
  eqn, data, _ = case(name)
  block = cls(eqn, "layer")

  @jax.jit
  def run(data):
    state = block.update_curvature_matrix_estimate(
      block.init(None, (), (), False), data, 0.0, 1.0, B, None
    )
    return state, block.to_dense_matrix(state)

  state, matrix = run(data)
  return state, np.asarray(matrix)


NEW_BLOCKS = [
  blocks.EmbeddingKFAC,
  blocks.EmbeddingEKFAC,
  blocks.EmbeddingTNT,
  blocks.EmbeddingDiagonal,
  blocks.EmbeddingFull,
]
# (embedding block, the family's dense-layer block, ids cases where their
# definitions agree).
FAMILIES = {
  "kfac": (
    blocks.EmbeddingKFAC,
    blocks.RepeatedDenseTwoKroneckerFactored,
    list(IDS),
  ),
  "diagonal": (blocks.EmbeddingDiagonal, blocks.DenseDiagonal, list(IDS)),
  "full": (blocks.EmbeddingFull, blocks.DenseFull, list(IDS)),
  # Per-example scalings equal per-position ones when no example repeats
  # a token.
  "ekfac": (
    blocks.EmbeddingEKFAC,
    blocks.DenseEKFAC,
    ["distinct", "one_per_example"],
  ),
  # TNT's input factor is diagonal only with one token per example.
  "tnt": (blocks.EmbeddingTNT, blocks.DenseTNT, ["one_per_example"]),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_equal_to_the_family_block_on_one_hot_inputs(family):
  embedding_cls, dense_cls, agree = FAMILIES[family]
  for name in IDS:
    cls = dense_cls
    if dense_cls is blocks.RepeatedDenseTwoKroneckerFactored and name == (
      "one_per_example"
    ):
      cls = blocks.DenseTwoKroneckerFactored
    got = estimate(embedding_cls, embedding_case, name)[1]
    want = estimate(cls, one_hot_case, name)[1]
    if name in agree:
      np.testing.assert_allclose(got, want, **TOL, err_msg=name)
    else:  # the check can fail: here the definitions differ
      assert not np.allclose(got, want, rtol=1e-3), name


def per_example_gradients(name):
  """`(S * B, V, D)`: each (sample, example) gradient of the table."""
  _, data, _ = embedding_case(name)
  dy = np.asarray(data["outputs_tangent"][0])
  one_hot = np.eye(V)[IDS[name]].reshape(B, -1, V)
  grads = np.einsum("brv,sbro->sbvo", one_hot, dy.reshape(S, B, -1, D))
  return grads.reshape(-1, V, D), dy


@pytest.mark.parametrize("name", list(IDS))
def test_equal_to_brute_force_per_example_definitions(name):
  c = embedding_case(name)[2]  # (1/B) Σ g gᵀ over per-example gradients
  grads, dy = per_example_gradients(name)
  flat = grads.reshape(len(grads), -1)
  np.testing.assert_allclose(flat.T @ flat / B, c, **TOL)
  got = {cls: estimate(cls, embedding_case, name) for cls in NEW_BLOCKS}
  np.testing.assert_allclose(got[blocks.EmbeddingFull][1], c, **TOL)
  np.testing.assert_allclose(
    got[blocks.EmbeddingDiagonal][1], np.diag(np.diag(c)), **TOL
  )
  repeats = IDS[name].size // B
  # K-FAC: token frequencies ⊗ the output factor over all positions.
  rows = dy.reshape(-1, D)
  g = rows.T @ rows / (B * repeats)
  freq = np.bincount(IDS[name].ravel(), minlength=V) / IDS[name].size
  np.testing.assert_allclose(
    got[blocks.EmbeddingKFAC][1], repeats * np.kron(np.diag(freq), g), **TOL
  )
  # EKFAC: the per-example curvature's diagonal in the basis I ⊗ U_G.
  u = np.kron(np.eye(V), np.linalg.eigh(g)[1])
  np.testing.assert_allclose(
    got[blocks.EmbeddingEKFAC][1],
    u @ np.diag(np.diag(u.T @ c @ u)) @ u.T,
    **TOL,
  )
  # TNT: diag(A) ⊗ G / tr(A) from the per-example gradients.
  a = np.einsum("nvo,nwo->vw", grads, grads) / B
  g_tnt = np.einsum("nvo,nvp->op", grads, grads) / B
  state, matrix = got[blocks.EmbeddingTNT]
  np.testing.assert_allclose(state.inputs_factor.value, np.diag(a), **TOL)
  np.testing.assert_allclose(
    matrix, np.kron(np.diag(np.diag(a)), g_tnt) / np.trace(a), **TOL
  )


@pytest.mark.parametrize("cls", NEW_BLOCKS)
def test_products_eigenvalues_and_state_size(cls):
  block, state, _, _ = fitted(
    cls, embedding_case("repeats"), exact=POWERS, approx=POWERS, eig=True
  )
  v = random_vector(block)

  @jax.jit
  def run(state, v):
    cached = block.update_cache(state, DAMPING, POWERS, POWERS, True)
    out = matpower_products(block, cached, v)
    out["dense"] = block.to_dense_matrix(cached)
    return cached, out

  cached, out = run(state, v)
  m = np.asarray(out["dense"])
  kronecker = cls in (blocks.EmbeddingKFAC, blocks.EmbeddingTNT)
  for p, e, c in MODES:
    if e or not kronecker:  # approximate Kronecker powers damp the factors
      want = numpy_psd_power(m + DAMPING * np.eye(len(m)), p) @ np.asarray(
        utils.flatten_arrays(v)
      )
      np.testing.assert_allclose(
        out[f"{p} {e} {c}"], want, rtol=1e-8, atol=1e-10
      )
  for key in ("eig", "eig_cached"):
    np.testing.assert_allclose(
      np.sort(out[key]), np.linalg.eigvalsh(m), rtol=1e-8, atol=1e-10
    )
  if cls is not blocks.EmbeddingFull:  # O(V D) state and cache
    sizes = [x.size for x in jax.tree.leaves(cached)]
    assert max(sizes) <= max(V * D, D * D) < V * V, sizes
  if hasattr(cached, "inputs_factor"):
    assert cached.inputs_factor.value.shape == (V,)


@pytest.mark.parametrize(
  "cls,dense_cls,name",
  [
    (blocks.EmbeddingKFAC, blocks.RepeatedDenseTwoKroneckerFactored, "repeats"),
    (blocks.EmbeddingTNT, blocks.DenseTNT, "one_per_example"),
  ],
)
def test_approximate_powers_match_the_family_block(cls, dense_cls, name):
  """The pi-damped factors' powers, cached or not, where the factors agree."""
  results = []
  for block_cls, case in ((cls, embedding_case), (dense_cls, one_hot_case)):
    block, state, _, _ = fitted(block_cls, case(name), approx=POWERS)
    v = random_vector(block)

    @jax.jit
    def run(state, v, block=block):
      cached = block.update_cache(state, DAMPING, None, POWERS, False)
      return [
        block.multiply_matpower(cached, v, DAMPING, p, False, c)[0]
        for p in POWERS
        for c in (True, False)
      ]

    results.append(run(state, v))
  for got, want in zip(*results):
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-11)


def test_ekfac_cadence_matches_dense_ekfac():
  """Two batches with a refresh between them, as the optimizer runs them:
  the basis, the restarted scalings and their average follow `EKFAC`."""
  results = []
  for cls, case in (
    (blocks.EmbeddingEKFAC, embedding_case),
    (blocks.DenseEKFAC, one_hot_case),
  ):
    block, state, data, _ = fitted(cls, case("distinct"))

    @jax.jit
    def run(state, data, block=block):
      second = dict(
        data, outputs_tangent=(2 * data["outputs_tangent"][0][::-1],)
      )
      state = block.update_cache(state, DAMPING, None, None, False)
      for batch in (second, data):
        state = block.update_curvature_matrix_estimate(
          state, batch, 0.5, 1.0, B, None
        )
      return block.to_dense_matrix(state)

    results.append(np.asarray(run(state, data)))
  np.testing.assert_allclose(*results, **TOL)
