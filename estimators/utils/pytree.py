"""Small helpers on tuples of arrays and static shapes."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def product(iterable_object: Iterable[Any]) -> Any:
  """The product of the elements of an iterable (1 when it is empty).

  Integers (a shape's sizes, NumPy's included) give a Python int; other
  elements (floats, arrays) are multiplied as they are.

  Args:
    iterable_object: the factors.

  Returns:
    Their product.
  """
  values = list(iterable_object)
  if all(isinstance(v, (int, np.integer)) for v in values):
    return int(math.prod(int(v) for v in values))
  result: Any = 1
  for value in values:
    result = result * value
  return result


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


def is_scalar(x: Any) -> bool:
  """Whether `x` is a Python number or a 0-d array."""
  return isinstance(x, (int, float)) or (
    isinstance(x, (jax.Array, np.ndarray)) and x.ndim == 0
  )


def tree_is_empty(obj: Any) -> bool:
  """Whether a pytree has no leaves."""
  return not jax.tree.leaves(obj)


def abstract_objects_equal(
  obj1: Any, obj2: Any, check_dtype: bool = True
) -> bool:
  """Whether two pytrees have the same structure and leaf shapes (and leaf
  dtypes, when `check_dtype`)."""
  tree1: Any = jax.tree.structure(obj1)  # PyTreeDef has no typed __eq__
  if tree1 != jax.tree.structure(obj2):
    return False
  return all(
    jnp.shape(x) == jnp.shape(y)
    and (not check_dtype or jnp.result_type(x) == jnp.result_type(y))
    for x, y in zip(jax.tree.leaves(obj1), jax.tree.leaves(obj2))
  )


_FLOAT_DTYPES = tuple(
  jnp.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)
)


def get_float_dtype_and_check_consistency(obj: Any) -> Any:
  """The one floating dtype of all the leaves of a pytree.

  Args:
    obj: a pytree of floating arrays.

  Returns:
    Their common dtype, or None for a pytree without leaves.

  Raises:
    ValueError: if a leaf is not floating, or two leaves differ in dtype.
  """
  dtype = None
  for leaf in jax.tree.leaves(obj):
    leaf_dtype = jnp.result_type(leaf)
    if leaf_dtype not in _FLOAT_DTYPES:
      raise ValueError(
        f"Expected floating-point leaves only, got a leaf of dtype "
        f"{leaf_dtype}; cast it to a float dtype first."
      )
    if dtype is not None and leaf_dtype != dtype:
      raise ValueError(
        f"Leaves of different float dtypes ({dtype} and {leaf_dtype}); "
        "cast them to one dtype."
      )
    dtype = leaf_dtype
  return dtype


def pytree_size(pytree: Any) -> int:
  """The total number of elements of a pytree's leaves."""
  return sum(int(np.size(x)) for x in jax.tree.leaves(pytree))


def inner_product(obj1: Any, obj2: Any, in_float64: bool = False) -> Any:
  """The inner product of two pytrees seen as flat vectors.

  Args:
    obj1: a pytree of arrays.
    obj2: a pytree with the same leaf shapes, in the same order.
    in_float64: accumulate in float64 and return the result in the
      leaves' dtype (needs `jax_enable_x64`).

  Returns:
    The sum over leaves of `vdot(leaf1, leaf2)` (0 for empty trees).

  Raises:
    ValueError: if the leaves do not match in number and shapes, or
      `in_float64` is asked without float64 support.
  """
  leaves1, leaves2 = jax.tree.leaves(obj1), jax.tree.leaves(obj2)
  if len(leaves1) != len(leaves2) or any(
    jnp.shape(x) != jnp.shape(y) for x, y in zip(leaves1, leaves2)
  ):
    raise ValueError(
      "inner_product needs two pytrees with the same leaf shapes, got "
      f"{[jnp.shape(x) for x in leaves1]} and "
      f"{[jnp.shape(y) for y in leaves2]}."
    )
  if not in_float64:
    return sum(jnp.vdot(x, y) for x, y in zip(leaves1, leaves2))
  if not jax.config.jax_enable_x64:  # type: ignore[attr-defined]
    raise ValueError(
      "inner_product(in_float64=True) needs float64 arrays: set "
      'jax.config.update("jax_enable_x64", True) first.'
    )
  if not leaves1:
    return 0
  dtype = jnp.result_type(*leaves1, *leaves2)
  total = sum(
    jnp.vdot(x.astype(jnp.float64), y.astype(jnp.float64), precision="highest")
    for x, y in zip(leaves1, leaves2)
  )
  return jnp.asarray(total).astype(dtype)


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
  # The small leaves of each pytree go into one row, so that all of them
  # take one matrix product (and one copy), whatever their number.
  small = {
    k
    for k, x in enumerate(rows[0] if rows else ())
    if x.size <= _STACKED_LEAF_MAX_SIZE
  }
  if small:

    def stacked(trees_leaves):
      return jnp.stack(
        [
          jnp.concatenate(
            [leaves[k].ravel().astype(dtype) for k in sorted(small)]
          )
          for leaves in trees_leaves
        ]
      )

    a = stacked(rows)
    b = a if symmetric else stacked(cols)
    total += jnp.matmul(a, b.T, precision="highest")
  for k, (left, right) in enumerate(zip(zip(*rows), zip(*cols))):
    if k in small:
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
