"""Arithmetic on pytrees of arrays, as KFAC-JAX's `utils` names it.

Parameter-shaped vectors (gradients, updates, preconditioned directions) are
pytrees; these treat them as one long vector without flattening them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from estimators.utils.pytree import inner_product


def scalar_mul(obj: Any, scalar: Any) -> Any:
  """Multiplies every leaf of a pytree by one scalar.

  Args:
    obj: a pytree of arrays.
    scalar: a number or scalar array.

  Returns:
    A pytree of the same structure.
  """
  return jax.tree.map(lambda x: x * scalar, obj)


def scalar_div(obj: Any, scalar: Any) -> Any:
  """Divides every leaf of a pytree by one scalar.

  Args:
    obj: a pytree of arrays.
    scalar: a non-zero number or scalar array.

  Returns:
    A pytree of the same structure.
  """
  return jax.tree.map(lambda x: x / scalar, obj)


def weighted_sum_of_objects(
  objects: Sequence[Any], coefficients: Sequence[Any]
) -> Any:
  """`sum_i coefficients[i] * objects[i]` for pytrees of one structure.

  Args:
    objects: pytrees with the same structure and leaf shapes.
    coefficients: one scalar per pytree.

  Returns:
    The weighted sum, a pytree of that structure.

  Raises:
    ValueError: if the two sequences differ in length or are empty.
  """
  objects, coefficients = list(objects), list(coefficients)
  if not objects or len(objects) != len(coefficients):
    raise ValueError(
      "weighted_sum_of_objects needs as many coefficients as "
      f"objects (at least one); got {len(objects)} objects and "
      f"{len(coefficients)} coefficients."
    )
  return jax.tree.map(
    lambda *leaves: sum(c * x for c, x in zip(coefficients, leaves)), *objects
  )


def squared_norm(obj: Any) -> jax.Array:
  """The squared Euclidean norm of a pytree seen as one vector.

  Args:
    obj: a pytree of arrays.

  Returns:
    `<obj, obj>`, a scalar.
  """
  return jnp.real(inner_product(obj, obj))


def norm(obj: Any) -> jax.Array:
  """The Euclidean norm of a pytree seen as one vector.

  Args:
    obj: a pytree of arrays.

  Returns:
    `sqrt(<obj, obj>)`, a scalar.
  """
  return jnp.sqrt(squared_norm(obj))


def first_dim_is_size(size: int, *args: jax.Array) -> bool:
  """Whether every array has `size` entries along its first (batch) axis.

  Args:
    size: the expected size.
    *args: arrays with at least one axis.

  Returns:
    True when all leading sizes equal `size`.
  """
  return all(jnp.ndim(a) > 0 and jnp.shape(a)[0] == size for a in args)


def default_batch_size_extractor(batch: Any) -> int:
  """The batch size of a batch pytree.

  Args:
    batch: a pytree of arrays with the batch axis first.

  Returns:
    The size of the leading axis of its first leaf.
  """
  return jax.tree.leaves(batch)[0].shape[0]
