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
