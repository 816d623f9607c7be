"""Cross-device reductions that are no-ops outside a mapped axis.

The same code then runs under `jax.pmap`/`shard_map` (statistics averaged
over devices) and on one device (unchanged).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from estimators.utils.distributed import run_on_owners


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


def wrap_if_pmap(
  p_func: Callable[[Any, str], Any],
) -> Callable[[Any, str | None], Any]:
  """`p_func(obj, axis_name)` (a collective such as `jax.lax.pmean`) made a
  no-op returning `obj` outside a mapped axis of that name."""

  def if_pmap(obj: Any, axis_name: str | None) -> Any:
    if axis_name is None or not in_pmap(axis_name):
      return obj
    return p_func(obj, axis_name)

  return if_pmap


def distribute_thunks(
  thunks: Sequence[Callable[[], Any]], pmap_axis_name: str
) -> tuple[Any, ...]:
  """The results of zero-argument functions, each computed on one device.

  Inside `pmap`/`shard_map` over `pmap_axis_name`, thunk `i` runs on device
  `i % num_devices` only and the results are summed over the axis, so every
  device gets all of them. The thunks must give the same result on every
  device.

  Raises:
    ValueError: outside a mapped axis of that name.
  """
  if not in_pmap(pmap_axis_name):
    raise ValueError(
      f"distribute_thunks must run inside pmap or shard_map over the axis "
      f"{pmap_axis_name!r}."
    )
  num_devices = jax.lax.axis_size(pmap_axis_name)
  return tuple(
    run_on_owners(
      [lambda _, thunk=thunk: thunk() for thunk in thunks],
      [None] * len(thunks),
      [i % num_devices for i in range(len(thunks))],
      pmap_axis_name,
    )
  )
