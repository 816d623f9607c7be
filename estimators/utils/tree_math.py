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
    A pytree of the same structure (`obj` itself for the Python number 1).
  """
  if isinstance(scalar, (int, float)) and scalar == 1:
    return obj
  return jax.tree.map(lambda x: x * scalar, obj)


def scalar_div(obj: Any, scalar: Any) -> Any:
  """Divides every leaf of a pytree by one scalar.

  Args:
    obj: a pytree of arrays.
    scalar: a non-zero number or scalar array.

  Returns:
    A pytree of the same structure (`obj` itself for the Python number 1).
  """
  if isinstance(scalar, (int, float)) and scalar == 1:
    return obj
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


def sum_of_objects(objects: Sequence[Any]) -> Any:
  """The sum of pytrees of one structure (`weighted_sum_of_objects` with
  unit coefficients)."""
  return weighted_sum_of_objects(objects, [1] * len(objects))


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


def _path_part(entry: Any) -> str:
  for name in ("key", "name", "idx"):
    if hasattr(entry, name):
      return str(getattr(entry, name))
  return str(entry)


def per_parameter_norm(obj: Any, key_prefix: str) -> dict[str, jax.Array]:
  """The Euclidean norm of every leaf of a pytree, keyed by its path.

  Args:
    obj: a pytree of arrays, e.g. Haiku parameters
      `{"mlp/linear": {"w": ...}}`.
    key_prefix: put before each key.

  Returns:
    A dict from `key_prefix + "(" + path + ")"` to the leaf's norm, the
    path's parts (dictionary keys, sequence indices, attribute names)
    joined by slashes, e.g. `"norm(mlp/linear/w)"`.
  """
  flat, _ = jax.tree_util.tree_flatten_with_path(obj)
  return {
    key_prefix + "(" + "/".join(_path_part(e) for e in path) + ")": norm(leaf)
    for path, leaf in flat
  }


def cosine_similarity(v1: Any, v2: Any) -> jax.Array:
  """`<v1, v2> / (|v1| |v2|)` for two pytrees seen as flat vectors."""
  return inner_product(v1, v2) / (norm(v1) * norm(v2))


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
