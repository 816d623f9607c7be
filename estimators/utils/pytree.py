"""Small helpers on tuples of arrays and static shapes."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp


def product(values: Sequence[int]) -> int:
  """The product of static integers, such as a shape's sizes.

  Args:
    values: integers known at trace time.

  Returns:
    Their product as a Python int (1 for an empty sequence).
  """
  return int(math.prod(int(v) for v in values))


def flatten_arrays(arrays: Sequence[jax.Array], leading: int = 0) -> jax.Array:
  """Flattens arrays into one, keeping some leading axes.

  Args:
    arrays: arrays that agree on their first `leading` axes.
    leading: how many leading axes to keep (0 gives one vector).

  Returns:
    The arrays, each flattened past its leading axes, concatenated along
    the first flattened axis.
  """
  return jnp.concatenate(
    [a.reshape(a.shape[:leading] + (-1,)) for a in arrays], axis=leading
  )


def unflatten_vector(
  vector: jax.Array, shapes: Sequence[Sequence[int]]
) -> tuple[jax.Array, ...]:
  """Splits a vector into arrays; undoes `flatten_arrays(..., leading=0)`.

  Args:
    vector: a vector with as many entries as the shapes hold together.
    shapes: the shapes of the arrays, in order.

  Returns:
    A tuple of arrays with the given shapes.

  Raises:
    ValueError: if the vector has the wrong size.
  """
  sizes = [product(s) for s in shapes]
  if vector.shape != (sum(sizes),):
    raise ValueError(
      f"Expected a vector of shape ({sum(sizes)},), got {vector.shape}."
    )
  parts, start = [], 0
  for shape, size in zip(shapes, sizes):
    parts.append(vector[start : start + size].reshape(tuple(shape)))
    start += size
  return tuple(parts)


def is_tracer(value: object) -> bool:
  """Whether `value` is a JAX tracer (an abstract value under a transform).

  Args:
    value: anything.

  Returns:
    True for a `jax.core.Tracer`.
  """
  return isinstance(value, jax.core.Tracer)


def inner_product(a: Any, b: Any) -> jax.Array | int:
  """The inner product of two pytrees with matching leaves.

  Args:
    a: a pytree of arrays.
    b: a pytree with the same leaf shapes.

  Returns:
    The sum over leaves of `vdot(leaf_a, leaf_b)` (0 for empty trees).
  """
  return sum(
    jnp.vdot(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
  )


# Leaves up to this size are stacked and multiplied in one matrix product;
# bigger ones get one `vdot` per pair, which reads them without a copy.
_STACKED_LEAF_MAX_SIZE = 1 << 14


def gram_matrix(trees: Sequence, others: Sequence | None = None) -> jax.Array:
  """Pairwise inner products of pytrees with matching leaves.

  This takes a handful of XLA ops instead of one reduction per pair and leaf:
  a small optimizer step is dominated by the count of ops, not arithmetic.

  Args:
    trees: the pytrees of the rows.
    others: the pytrees of the columns; `trees` when None.

  Returns:
    The matrix `[[<a, b> for b in others] for a in trees]`, in the dtype
    the leaves promote to.

  Raises:
    ValueError: if the pytrees do not all have the same number of leaves.
  """
  symmetric = others is None
  others = trees if others is None else others
  rows = [jax.tree.leaves(t) for t in trees]
  cols = [jax.tree.leaves(t) for t in others]
  if len({len(leaves) for leaves in rows + cols}) > 1:
    raise ValueError(
      "gram_matrix needs pytrees with the same leaves, got "
      f"{[jax.tree.structure(t) for t in [*trees, *others]]}."
    )
  dtype = jnp.result_type(*[x for leaves in rows + cols for x in leaves])
  total = jnp.zeros((len(rows), len(cols)), dtype)
  for left, right in zip(zip(*rows), zip(*cols)):
    if left[0].size <= _STACKED_LEAF_MAX_SIZE:
      a = jnp.stack([x.ravel() for x in left]).astype(dtype)
      b = (
        a if symmetric else jnp.stack([x.ravel() for x in right]).astype(dtype)
      )
      total += jnp.matmul(a, b.T, precision="highest")
      continue
    pairs: list[list[Any]] = [[None] * len(cols) for _ in rows]
    for i, x in enumerate(left):
      for j, y in enumerate(right):
        if symmetric and j < i:
          pairs[i][j] = pairs[j][i]
        else:
          pairs[i][j] = jnp.vdot(x, y, precision="highest")
    total += jnp.array(pairs, dtype)
  return total
