"""Small helpers on tuples of arrays and static shapes."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp


def product(values: Sequence[int]) -> int:
  """Product of static integers (1 for an empty sequence)."""
  return int(math.prod(int(v) for v in values))


def scalar_mul(arrays: Sequence[jax.Array], scalar) -> tuple[jax.Array, ...]:
  return tuple(a * scalar for a in arrays)


def flatten_arrays(arrays: Sequence[jax.Array], leading: int = 0) -> jax.Array:
  """Concatenates arrays after flattening all but their first `leading` axes."""
  return jnp.concatenate(
      [a.reshape(a.shape[:leading] + (-1,)) for a in arrays], axis=leading)


def unflatten_vector(vector: jax.Array,
                     shapes: Sequence[Sequence[int]]) -> tuple[jax.Array, ...]:
  """Inverse of `flatten_arrays(..., leading=0)` for the given shapes."""
  sizes = [product(s) for s in shapes]
  if vector.shape != (sum(sizes),):
    raise ValueError(f"Expected a vector of shape ({sum(sizes)},), got "
                     f"{vector.shape}.")
  parts, start = [], 0
  for shape, size in zip(shapes, sizes):
    parts.append(vector[start:start + size].reshape(tuple(shape)))
    start += size
  return tuple(parts)


def is_tracer(value) -> bool:
  return isinstance(value, jax.core.Tracer)


def inner_product(a, b):
  """Sum over all leaves of the elementwise product of two matching pytrees."""
  return sum(jnp.vdot(x, y) for x, y in zip(jax.tree.leaves(a),
                                            jax.tree.leaves(b)))


# Leaves up to this size are stacked and multiplied in one matrix product;
# bigger ones get one `vdot` per pair, which reads them without a copy.
_STACKED_LEAF_MAX_SIZE = 1 << 14


def gram_matrix(trees: Sequence, others: Sequence | None = None) -> jax.Array:
  """Pairwise inner products of matching pytrees: `[[<a, b> for b in others]
  for a in trees]`, with `others` defaulting to `trees`.

  This takes a handful of XLA ops instead of one reduction per pair and leaf:
  a small optimizer step is dominated by the count of ops, not arithmetic.
  """
  symmetric = others is None
  others = trees if symmetric else others
  rows = [jax.tree.leaves(t) for t in trees]
  cols = [jax.tree.leaves(t) for t in others]
  if len({len(leaves) for leaves in rows + cols}) > 1:
    raise ValueError("gram_matrix needs pytrees with the same leaves, got "
                     f"{[jax.tree.structure(t) for t in [*trees, *others]]}.")
  dtype = jnp.result_type(*[x for leaves in rows + cols for x in leaves])
  total = jnp.zeros((len(rows), len(cols)), dtype)
  for left, right in zip(zip(*rows), zip(*cols)):
    if left[0].size <= _STACKED_LEAF_MAX_SIZE:
      a = jnp.stack([x.ravel() for x in left]).astype(dtype)
      b = a if symmetric else jnp.stack([x.ravel() for x in right]).astype(
          dtype)
      total += jnp.matmul(a, b.T, precision="highest")
      continue
    pairs = [[None] * len(cols) for _ in rows]
    for i, x in enumerate(left):
      for j, y in enumerate(right):
        if symmetric and j < i:
          pairs[i][j] = pairs[j][i]
        else:
          pairs[i][j] = jnp.vdot(x, y, precision="highest")
    total += jnp.array(pairs, dtype)
  return total
