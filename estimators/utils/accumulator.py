"""Summing weighted statistics over several chunks (e.g. the batches of an
evaluation) and normalising them once at the end."""

from __future__ import annotations

from typing import Any, Generic

import jax
import jax.numpy as jnp

from estimators.utils.devices import (
  jit_sync_and_divide_value,
  jit_zeros_like,
  pmap_sync_and_divide_value,
  pmap_zeros_like,
  replicate_all_local_devices,
)
from estimators.utils.pytree import tree_is_empty
from estimators.utils.types import TArrayTree


class MultiChunkAccumulator(Generic[TArrayTree]):
  """A running sum `sum_i w_i x_i` and its weight `sum_i w_i`.

  `value` is their ratio (averaged over the local devices when
  `multi_device`, where the accumulated objects are `pmap` outputs with a
  leading device axis). A pytree of (accumulator, weight).
  """

  def __init__(
    self, init_obj_value: Any, weight: Any, multi_device: bool
  ) -> None:
    """
    Args:
      init_obj_value: the initial sum, or None for none yet (the first
        `add` then sets it).
      weight: the weight already counted in `init_obj_value`.
      multi_device: whether the objects carry a leading device axis.
    """
    self._accumulator = init_obj_value
    self._weight = weight
    self._multi_device = multi_device

  @property
  def accumulator(self) -> Any:
    """The weighted sum so far (not normalised)."""
    return self._accumulator

  @property
  def weight(self) -> Any:
    """The sum of the weights so far."""
    return self._weight

  @property
  def multi_device(self) -> bool:
    """Whether the objects carry a leading device axis."""
    return self._multi_device

  @property
  def value(self) -> Any:
    """The weighted mean, `accumulator / weight` (averaged over the local
    devices when `multi_device`)."""
    if tree_is_empty(self._accumulator):
      return self._accumulator
    divide = (
      pmap_sync_and_divide_value
      if self._multi_device
      else jit_sync_and_divide_value
    )
    return divide(self._accumulator, self._weight)

  def clear(self) -> None:
    """Forgets the sum and the weight (both become None)."""
    self._accumulator = None
    self._weight = None

  def value_and_clear(self) -> Any:
    """`value`, then `clear()`."""
    value = self.value
    self.clear()
    return value

  def add(self, value_obj: Any, weight: Any = 1) -> None:
    """Adds `weight * value_obj` to the sum and `weight` to the weight.

    Raises:
      ValueError: if exactly one of the sum and `value_obj` has no leaves,
        or the first `weight` is neither a number nor an array shaped like
        the accumulator's weight.
    """
    value_obj = jax.tree.map(lambda x: x * weight, value_obj)
    if self._accumulator is None:
      self._accumulator = value_obj
      if isinstance(weight, (int, float)):
        self._weight = jnp.full_like(self._weight, weight)
      elif not isinstance(weight, jax.Array):
        raise ValueError(
          f"weight must be a number or a jax.Array, got {type(weight)}."
        )
      elif jnp.shape(self._weight) != weight.shape:
        raise ValueError(
          f"An array weight must have the accumulator weight's shape "
          f"{jnp.shape(self._weight)}, got {weight.shape}."
        )
      else:
        self._weight = weight
      return
    if tree_is_empty(self._accumulator) != tree_is_empty(value_obj):
      raise ValueError(
        "The accumulator and the added value must both have leaves or both "
        f"have none; got {jax.tree.structure(self._accumulator)} and "
        f"{jax.tree.structure(value_obj)}."
      )
    if not tree_is_empty(value_obj):
      self._accumulator = jax.tree.map(jnp.add, self._accumulator, value_obj)
    self._weight = self._weight + weight

  @classmethod
  def zeros_like(
    cls, obj: Any, multi_device: bool
  ) -> MultiChunkAccumulator[Any]:
    """A zero sum shaped like `obj` (per device when `multi_device`), with
    weight 0."""
    weight = jnp.zeros([], jnp.int32)
    if multi_device:
      value = obj if tree_is_empty(obj) else pmap_zeros_like(obj)
      weight = replicate_all_local_devices(weight)
    else:
      value = obj if tree_is_empty(obj) else jit_zeros_like(obj)
    return cls(value, weight, multi_device)

  @classmethod
  def empty(cls, multi_device: bool) -> MultiChunkAccumulator[Any]:
    """An accumulator with no sum yet and weight 0 (per device when
    `multi_device`)."""
    weight = jnp.zeros([], jnp.int32)
    if multi_device:
      weight = replicate_all_local_devices(weight)
    return cls(None, weight, multi_device)

  def copy(self) -> MultiChunkAccumulator[Any]:
    """A new accumulator holding the same arrays."""
    leaves, tree = jax.tree.flatten(self)
    return jax.tree.unflatten(tree, leaves)

  def __repr__(self) -> str:
    return (
      f"{type(self).__name__}({self._accumulator!r}, {self._weight!r}, "
      f"{self._multi_device})"
    )


jax.tree_util.register_pytree_node(
  MultiChunkAccumulator,
  lambda x: ((x.accumulator, x.weight), (x.multi_device,)),
  lambda fixed, children: MultiChunkAccumulator(*children, *fixed),
)
