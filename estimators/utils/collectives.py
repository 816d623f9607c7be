"""Cross-device reductions that are no-ops outside a mapped axis.

The same code then runs under `jax.pmap`/`shard_map` (statistics averaged
over devices) and on one device (unchanged).
"""

from __future__ import annotations

from typing import Any

import jax


def in_pmap(axis_name: str | None) -> bool:
  """Whether the current trace is inside a mapped axis of this name.

  Args:
    axis_name: the axis name (None is never bound).

  Returns:
    True under `jax.pmap` or `shard_map` over `axis_name`.
  """
  if axis_name is None:
    return False
  try:
    # JAX has no query for bound axes; naming an unbound one raises.
    jax.lax.axis_index(axis_name)
  except NameError:
    return False
  return True


def pmean_if_pmap(obj: Any, axis_name: str | None) -> Any:
  """The mean of a pytree over the devices of `axis_name`, when bound.

  Args:
    obj: a pytree of arrays.
    axis_name: the mapped axis, or None.

  Returns:
    `obj` averaged over the axis, or `obj` itself outside it.
  """
  return jax.lax.pmean(obj, axis_name) if in_pmap(axis_name) else obj


def psum_if_pmap(obj: Any, axis_name: str | None) -> Any:
  """The sum of a pytree over the devices of `axis_name`, when bound.

  Args:
    obj: a pytree of arrays.
    axis_name: the mapped axis, or None.

  Returns:
    `obj` summed over the axis, or `obj` itself outside it.
  """
  return jax.lax.psum(obj, axis_name) if in_pmap(axis_name) else obj
