"""A weighted exponential moving average that is a pytree, so it jits."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WeightedMovingAverage:
  """Keeps `raw_value` (a decayed sum) and `weight` (the sum of its weights).

  The average is `raw_value / weight`. Because the weight is tracked, the
  first update after `zeros` gives exactly the new value whatever `ema_old` is.
  """

  weight: jax.Array
  raw_value: jax.Array

  @classmethod
  def zeros(
    cls, shape: Sequence[int], dtype: jnp.dtype = jnp.float32
  ) -> "WeightedMovingAverage":
    """An average with no terms yet.

    Args:
      shape: the shape of the averaged values.
      dtype: their dtype (the weight uses it too).

    Returns:
      A zero average with zero weight.
    """
    return cls(weight=jnp.zeros([], dtype), raw_value=jnp.zeros(shape, dtype))

  @property
  def value(self) -> jax.Array:
    """The current average, `raw_value / weight` (zeros before any update)."""
    # Before any update the weight is 0; report the (zero) raw value rather
    # than 0/0, so an untouched estimate reads as the zero matrix.
    weight = jnp.where(
      self.weight == 0, jnp.ones_like(self.weight), self.weight
    )
    return self.raw_value / weight.astype(self.raw_value.dtype)

  def update(
    self,
    value: jax.Array,
    ema_old: float | jax.Array,
    ema_new: float | jax.Array,
  ) -> "WeightedMovingAverage":
    """Adds a new term to the average.

    Args:
      value: the new term, shaped like the average.
      ema_old: factor on the old terms (and on their weight).
      ema_new: weight of the new term.

    Returns:
      A new average; `self` is left unchanged.
    """
    value = jnp.asarray(value, self.raw_value.dtype)
    if value.shape != self.raw_value.shape:
      raise ValueError(
        f"WeightedMovingAverage.update: value of shape "
        f"{value.shape} does not match the average's shape "
        f"{self.raw_value.shape}."
      )
    if isinstance(ema_old, (int, float)) and ema_old == 0:
      # A fresh estimate: skip reading the old value (large for dense blocks).
      return WeightedMovingAverage(
        weight=jnp.asarray(ema_new, self.weight.dtype) + 0 * self.weight,
        raw_value=(ema_new * value).astype(self.raw_value.dtype),
      )
    return WeightedMovingAverage(
      weight=(ema_old * self.weight + ema_new).astype(self.weight.dtype),
      raw_value=(ema_old * self.raw_value + ema_new * value).astype(
        self.raw_value.dtype
      ),
    )
