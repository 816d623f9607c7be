"""A weighted exponential moving average of a pytree, itself a pytree.

It keeps `weight` (the decayed sum of the terms' weights) and `raw_value`
(the decayed weighted sum of the terms); the average is `raw_value /
weight`, so the first update after `zeros` gives exactly the new term
whatever the decay. KFAC-JAX's form is served too: the constructor and
serialisation take the average as `value`, and `update`, `sync`, `clear`
change the object in place (as well as returning it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic

import jax
import jax.numpy as jnp

from estimators.utils.collectives import pmean_if_pmap
from estimators.utils.pytree import get_float_dtype_and_check_consistency
from estimators.utils.state import State, register_state_class
from estimators.utils.types import TArrayTree

AddFunction = Callable[[Any, Any, Any, Any], Any]


def default_add_function(obj1: Any, obj2: Any, coeff1: Any, coeff2: Any) -> Any:
  """`coeff1 * obj1 + coeff2 * obj2`, leaf by leaf."""
  return jax.tree.map(lambda x, y: coeff1 * x + coeff2 * y, obj1, obj2)


def _is_zero(x: Any) -> bool:
  return isinstance(x, (int, float)) and x == 0


def _dtype_of(tree: Any) -> Any:
  leaves = jax.tree.leaves(tree)
  return jnp.result_type(leaves[0]) if leaves else None


class WeightedMovingAverage(State, Generic[TArrayTree]):
  """`weight` and `raw_value`; the average is `value = raw_value / weight`.

  Construct with `zeros(shape, dtype)`, `zeros_array(shape, dtype)` or
  `zeros_like(tree)`, from `weight` and `value` (the average), or with
  `from_raw(weight, raw_value)`. With zero weight `value` and `raw_value` coincide: such an
  average holds a value that the next update replaces.
  """

  weight: Any
  raw_value: Any

  def __init__(self, weight: Any, value: Any):
    self.weight = weight
    self.raw_value = None if value is None else self._raw_from(value)

  @classmethod
  def from_raw(cls, weight: Any, raw_value: Any) -> WeightedMovingAverage:
    """An average from its weight and weighted sum (`raw_value / weight`)."""
    obj = cls.__new__(cls)
    obj.weight, obj.raw_value = weight, raw_value
    return obj

  def _raw_from(self, value: Any) -> Any:
    """The weighted sum whose average with the current weight is `value`."""
    w = self.weight
    if isinstance(w, (int, float)):
      return value if w == 0 else jax.tree.map(lambda x: x * w, value)
    return jax.tree.map(
      lambda x: jnp.where(w == 0, x, x * jnp.asarray(w, jnp.result_type(x))),
      value,
    )

  # A pytree of (weight, raw_value); rebuilt without conversions, as JAX
  # transformations put tracers and placeholders in the leaves.
  def tree_flatten(self) -> tuple[tuple[Any, ...], tuple[str, ...]]:
    return (self.weight, self.raw_value), ()

  @classmethod
  def tree_unflatten(cls, aux_data, children):
    return cls.from_raw(*children)

  @classmethod
  def field_names(cls) -> tuple[str, ...]:
    """The serialised fields: the weight and the average."""
    return ("weight", "value")

  @property
  def value(self) -> Any:
    """The current average, `raw_value / weight` (`raw_value` itself while
    the weight is zero; None after `clear(value_to_none=True)`)."""
    w = self.weight
    if isinstance(w, (int, float)):
      w = jnp.asarray(w)

    def divide(x):
      safe = jnp.where(w == 0, jnp.ones_like(w), w)
      return x / safe.astype(jnp.result_type(x))

    return jax.tree.map(divide, self.raw_value)

  @value.setter
  def value(self, value: Any) -> None:
    """Makes `value` the average at the current weight (None clears it)."""
    self.raw_value = None if value is None else self._raw_from(value)

  @property
  def ndim(self) -> int:
    """The number of axes of the (array) average."""
    return jnp.ndim(self.raw_value)

  @property
  def shape(self) -> tuple[int, ...]:
    """The shape of the (array) average."""
    return jnp.shape(self.raw_value)

  @property
  def dtype(self) -> Any:
    """The dtype of the (array) average."""
    return jnp.result_type(self.raw_value)

  @classmethod
  def zeros(
    cls, shape: Sequence[int], dtype: Any = jnp.float32
  ) -> WeightedMovingAverage:
    """An array average with no terms yet, of this shape and dtype."""
    return cls.from_raw(jnp.zeros([], dtype), jnp.zeros(tuple(shape), dtype))

  @classmethod
  def zeros_array(
    cls, shape: Sequence[int], dtype: Any = None
  ) -> WeightedMovingAverage:
    """As `zeros`, with JAX's default float dtype when `dtype` is None."""
    return cls.from_raw(jnp.zeros([], dtype), jnp.zeros(tuple(shape), dtype))

  @classmethod
  def zeros_like(cls, value: Any) -> WeightedMovingAverage:
    """An average with no terms yet, of the structure of a pytree of floats
    (all of one dtype, which the weight takes too)."""
    dtype = get_float_dtype_and_check_consistency(value)
    return cls.from_raw(
      jnp.zeros([], dtype), jax.tree.map(jnp.zeros_like, value)
    )

  def _check_like(self, value: Any) -> None:
    mine: Any = jax.tree.structure(self.raw_value)
    theirs = jax.tree.structure(value)
    shapes = [jnp.shape(x) for x in jax.tree.leaves(self.raw_value)]
    new_shapes = [jnp.shape(x) for x in jax.tree.leaves(value)]
    if mine != theirs or shapes != new_shapes:
      raise ValueError(
        "WeightedMovingAverage.update: the new value (structure "
        f"{theirs}, shapes {new_shapes}) does not match the average "
        f"(structure {mine}, shapes {shapes})."
      )

  def updated(
    self,
    value: Any,
    old_weight_multiplier: Any,
    new_weight: Any,
    add_function: AddFunction = default_add_function,
  ) -> WeightedMovingAverage:
    """A new average with one more term; `self` is left unchanged.

    The weight becomes `old_weight_multiplier * weight + relu(new_weight)`
    and the weighted sum `old_weight_multiplier * raw_value +
    |new_weight| * value`: a negative `new_weight` adds the term without
    counting its weight (a sum rather than an average).

    Args:
      value: the new term, a pytree like the average.
      old_weight_multiplier: the decay of the old terms and their weight.
      new_weight: the weight of the new term.
      add_function: `add(old_avg, value, c_old, c_new)` combining the old
        average and the new term into the new average; the default is
        `c_old * old_avg + c_new * value`, applied to the weighted sums
        directly.

    Returns:
      The updated average.

    Raises:
      ValueError: if `value` is not shaped like the average, or the average
        was cleared to None.
    """
    if self.raw_value is None:
      raise ValueError(
        "This WeightedMovingAverage was cleared to None: build a new one "
        "(zeros_like) before updating."
      )
    self._check_like(value)
    dtype = _dtype_of(self.raw_value)
    value = jax.tree.map(lambda x: jnp.asarray(x, dtype), value)
    old = old_weight_multiplier
    counted = jnp.maximum(new_weight, 0)
    weight = (
      counted + 0 * self.weight
      if _is_zero(old)
      else old * self.weight + counted
    )
    weight = jnp.asarray(weight, jnp.result_type(self.weight))
    if add_function is default_add_function:
      if _is_zero(old):
        # A fresh estimate: skip reading the old value (large for dense
        # blocks).
        raw = jax.tree.map(lambda x: jnp.abs(new_weight) * x, value)
      else:
        raw = default_add_function(
          self.raw_value, value, old, jnp.abs(new_weight)
        )
      raw = jax.tree.map(lambda x: x.astype(dtype), raw)
      return WeightedMovingAverage.from_raw(weight, raw)
    # A custom rule combines averages: c_old = 1 - relu(w) / W, c_new =
    # |w| / W with W the new weight.
    average = add_function(
      self.value, value, 1.0 - counted / weight, jnp.abs(new_weight) / weight
    )
    return WeightedMovingAverage(weight=weight, value=average)

  def update(
    self,
    value: Any,
    old_weight_multiplier: Any,
    new_weight: Any,
    add_function: AddFunction = default_add_function,
  ) -> WeightedMovingAverage:
    """`updated(...)`, stored in this object too (KFAC-JAX's in-place
    update); returns `self`.

    Use `updated` where the old average must stay as it was (state kept by
    a caller, a value closed over by a traced function).
    """
    new = self.updated(value, old_weight_multiplier, new_weight, add_function)
    self.weight, self.raw_value = new.weight, new.raw_value
    return self

  def sync(self, pmap_axis_name: str | None) -> None:
    """Replaces the average by its mean over the devices of
    `pmap_axis_name` (no-op outside it); the weight is kept.

    Raises:
      ValueError: if the average was cleared to None.
    """
    if self.raw_value is None:
      raise ValueError("Cannot sync a WeightedMovingAverage cleared to None.")
    self.value = pmean_if_pmap(self.value, pmap_axis_name)

  def clear(self, value_to_none: bool = False) -> None:
    """Resets the weight to zero and the average to zeros (or None)."""
    self.weight = jnp.zeros_like(self.weight)
    self.raw_value = (
      None if value_to_none else jax.tree.map(jnp.zeros_like, self.raw_value)
    )

  def value_and_clear(self) -> Any:
    """The average, then `clear()`."""
    value = self.value
    self.clear()
    return value


register_state_class(WeightedMovingAverage)
