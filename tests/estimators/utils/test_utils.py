"""Pytree helpers of `estimators.utils` against NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from estimators import utils
from estimators.utils.array_math import symmetric_gram

# One leaf below the size where gram_matrix stacks leaves, one above it.
SHAPES = [(3, 4), (5,), (130, 130)]


def _trees(count, seed):
  rng = np.random.default_rng(seed)
  return [
    {
      "a": rng.standard_normal(SHAPES[0]),
      "b": [rng.standard_normal(SHAPES[1]), rng.standard_normal(SHAPES[2])],
    }
    for _ in range(count)
  ]


def _flat(tree):
  return np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])


def test_gram_matrix_equals_pairwise_inner_products():
  trees = _trees(3, seed=0)
  others = _trees(2, seed=1)
  as_jax = lambda ts: jax.tree.map(jnp.asarray, ts)
  flat, flat_others = (
    np.stack([_flat(t) for t in ts]) for ts in (trees, others)
  )
  np.testing.assert_allclose(
    utils.gram_matrix(as_jax(trees)), flat @ flat.T, rtol=1e-12
  )
  np.testing.assert_allclose(
    utils.gram_matrix(as_jax(trees), as_jax(others)),
    flat @ flat_others.T,
    rtol=1e-12,
  )
  np.testing.assert_allclose(
    utils.gram_matrix(as_jax(trees))[0, 1],
    utils.inner_product(as_jax(trees[0]), as_jax(trees[1])),
    rtol=1e-12,
  )


def test_gram_matrix_rejects_trees_with_different_leaves():
  tree = {"a": jnp.ones(3)}
  with pytest.raises(ValueError, match="same leaves"):
    utils.gram_matrix([tree, {"a": jnp.ones(3), "b": jnp.ones(2)}])


@pytest.mark.parametrize("columns", [3, 300, 384, 700, 1300])
def test_symmetric_gram_is_the_gram_matrix(columns):
  """Widths from 384 take the blocked path (block products above the
  diagonal only, mirrored below); in float64, to rounding."""
  x = np.random.default_rng(columns).standard_normal((40, columns))
  got = np.asarray(jax.jit(symmetric_gram)(jnp.asarray(x)))
  np.testing.assert_allclose(got, x.T @ x, rtol=1e-12, atol=1e-12)
  np.testing.assert_allclose(got, got.T, rtol=1e-13, atol=1e-12)
  # Eager, the lower blocks are the upper ones' transposes, bit for bit.
  eager = np.asarray(symmetric_gram(jnp.asarray(x)))
  np.testing.assert_array_equal(eager, eager.T)
