"""Matrices and vectors of inner products between pytrees.

Each pytree stands for one vector (its leaves flattened and concatenated);
`ip_function` may replace the Euclidean inner product by another one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from estimators.utils.pytree import inner_product

InnerProduct = Callable[[Any, Any], Any]


def _check_lengths(vectors1: Sequence[Any], vectors2: Sequence[Any]) -> None:
  if len(vectors1) != len(vectors2):
    raise ValueError(
      f"Expected two sequences of the same length, got {len(vectors1)} "
      f"and {len(vectors2)} pytrees."
    )


def symmetric_matrix_inner_products(
  vectors1: Sequence[Any],
  vectors2: Sequence[Any],
  ip_function: InnerProduct = inner_product,
) -> jax.Array:
  """`m[i, j] = ip(vectors1[i], vectors2[j])`, computed for `i <= j` only.

  The lower triangle is copied from the upper one, so use this only where
  the result is known to be symmetric (e.g. `vectors2` is `vectors1`);
  `asymmetric_matrix_inner_products` computes every entry.

  Raises:
    ValueError: if the sequences differ in length.
  """
  _check_lengths(vectors1, vectors2)
  n = len(vectors1)
  rows: list[list[Any]] = [[None] * n for _ in range(n)]
  for i in range(n):
    for j in range(i, n):
      rows[i][j] = ip_function(vectors1[i], vectors2[j])
      rows[j][i] = rows[i][j]
  return jnp.asarray(rows)


def asymmetric_matrix_inner_products(
  vectors1: Sequence[Any],
  vectors2: Sequence[Any],
  ip_function: InnerProduct = inner_product,
) -> jax.Array:
  """`m[i, j] = ip(vectors1[i], vectors2[j])` for every pair.

  Raises:
    ValueError: if the sequences differ in length.
  """
  _check_lengths(vectors1, vectors2)
  return jnp.asarray([[ip_function(a, b) for b in vectors2] for a in vectors1])


def matrix_of_inner_products(
  vectors: Sequence[Any], ip_function: InnerProduct = inner_product
) -> jax.Array:
  """The Gram matrix `m[i, j] = ip(vectors[i], vectors[j])`."""
  return symmetric_matrix_inner_products(vectors, vectors, ip_function)


def vector_of_inner_products(
  base: Any, vectors: Sequence[Any], ip_function: InnerProduct = inner_product
) -> jax.Array:
  """`v[i] = ip(vectors[i], base)`."""
  return jnp.asarray([ip_function(v, base) for v in vectors])
