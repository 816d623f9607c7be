"""KFAC-JAX's module name `patches_second_moment`: the convolution-patch
moments of `estimators.patches`, and the names of KFAC-JAX's module."""

from collections.abc import Sequence
from typing import Any, TypeVar

from jax import lax

from estimators.patches import (
  num_conv_locations,
  patches_moments,
  patches_moments_explicit,
)

T = TypeVar("T")
PaddingVariants = str | int | Sequence[tuple[int, int]]
DimNumbers = tuple[str, str, str] | lax.ConvDimensionNumbers | Any

# KFAC-JAX chooses between two ways of computing the same moments (a 4-D
# convolution in its loop, or not); ours has one way, the strided views of
# `estimators.patches`, so the flag is recorded and the results are the
# same either way.
_use_4d_convolution = True


def set_use_4d_convolution_in_psm_loop(value: bool) -> None:
  """Records KFAC-JAX's choice of loop body (see above: ours computes the
  same moments either way).

  Raises:
    ValueError: unless `value` is a Python bool.
  """
  if not isinstance(value, bool):
    raise ValueError(
      f"set_use_4d_convolution_in_psm_loop takes a Python bool, got {value!r}."
    )
  global _use_4d_convolution
  _use_4d_convolution = value


def get_use_4d_convolution_in_psm_loop() -> bool:
  """The value last given to `set_use_4d_convolution_in_psm_loop`."""
  return _use_4d_convolution


__all__ = [
  "DimNumbers",
  "PaddingVariants",
  "T",
  "get_use_4d_convolution_in_psm_loop",
  "num_conv_locations",
  "patches_moments",
  "patches_moments_explicit",
  "set_use_4d_convolution_in_psm_loop",
]
