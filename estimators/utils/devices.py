"""Moving pytrees to and from the local devices, for code that runs steps
under `jax.pmap` (one slice of a leading device axis per device).

"Replicated" values carry that leading axis: entry `i` lives on local
device `i`. With a single device the axis has size one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from estimators.utils import pytree
from estimators.utils.collectives import pmean_if_pmap
from estimators.utils.pytree import tree_is_empty

# The mesh axis of device-stacked arrays made here when no axis name is given.
_DEVICE_AXIS = "devices"


def using_legacy_pmap() -> bool:
  """Whether `jax.pmap` is the legacy implementation rather than the one
  built on `shard_map` (the `jax_pmap_shmap_merge` option; the legacy one
  is gone from JAX releases that no longer have the option)."""
  values = jax.config.values
  if "jax_pmap_shmap_merge" in values:
    return not values["jax_pmap_shmap_merge"]
  return False


def _first(value: Any) -> Any:
  if pytree.is_scalar(value):
    return value
  if not isinstance(value, jax.Array) or isinstance(
    value.sharding, jax.sharding.SingleDeviceSharding
  ):
    return value[0]
  sharding = value.sharding
  spec = getattr(sharding, "spec", None)
  shard = value.addressable_shards[0].data
  if spec is not None and (len(spec) == 0 or spec[0] is None):
    # Not split over devices: every device holds the whole value already.
    return shard
  # The first device's slice of the device axis.
  return shard[0]


def get_first(obj: Any) -> Any:
  """The first local device's entry of every leaf of a replicated pytree
  (scalars are returned as they are)."""
  return jax.tree.map(_first, obj)


pmap_mean = jax.pmap(lambda x: jax.lax.pmean(x, "i"), axis_name="i")
pmap_mean.__doc__ = "Averages a replicated pytree over the local devices."
pmap_sum = jax.pmap(lambda x: jax.lax.psum(x, "i"), axis_name="i")
pmap_sum.__doc__ = "Sums a replicated pytree over the local devices."


def get_mean(obj: Any) -> Any:
  """The mean over the local devices of a replicated pytree."""
  return get_first(pmap_mean(obj))


def get_sum(obj: Any) -> Any:
  """The sum over the local devices of a replicated pytree."""
  return get_first(pmap_sum(obj))


def _device_sharding(axis_name: str | None) -> NamedSharding:
  name = axis_name or _DEVICE_AXIS
  mesh = Mesh(np.array(jax.local_devices()), (name,))
  return NamedSharding(mesh, PartitionSpec(name))


def broadcast_all_local_devices(obj: Any, axis_name: str | None = None) -> Any:
  """Puts entry `i` of the leading axis of every leaf on local device `i`.

  Args:
    obj: a pytree whose leaves have one leading entry per local device.
    axis_name: the name of the mesh axis of the result; give that of the
      `pmap` that will take it.

  Returns:
    The pytree, sharded over the local devices.
  """
  if tree_is_empty(obj):
    return obj
  return jax.device_put(obj, _device_sharding(axis_name))


def replicate_all_local_devices(obj: Any, axis_name: str | None = None) -> Any:
  """A copy of `obj` on every local device, stacked on a new leading axis.

  Args:
    obj: a pytree of arrays.
    axis_name: as for `broadcast_all_local_devices`.

  Returns:
    The pytree with leaves of shape `(num_local_devices, *shape)`.
  """
  if tree_is_empty(obj):
    return obj
  count = jax.local_device_count()
  stacked = jax.tree.map(lambda x: jnp.stack([jnp.asarray(x)] * count), obj)
  return broadcast_all_local_devices(stacked, axis_name)


pmap_zeros_like = jax.pmap(lambda x: jax.tree.map(jnp.zeros_like, x))
pmap_zeros_like.__doc__ = "Zeros like a replicated pytree, per device."
jit_zeros_like = jax.jit(lambda x: jax.tree.map(jnp.zeros_like, x))
jit_zeros_like.__doc__ = "Zeros like a pytree, compiled."


def make_different_rng_key_on_all_devices(rng: jax.Array) -> jax.Array:
  """A different key on every local device (and every process): `rng`
  folded with the process index, split once per local device, and
  broadcast."""
  rng = jax.random.fold_in(rng, jax.process_index())
  return broadcast_all_local_devices(
    jax.random.split(rng, jax.local_device_count())
  )


p_split = jax.pmap(lambda key: tuple(jax.random.split(key)))
p_split.__doc__ = "Splits a replicated key into two, on every device."
p_split_num = jax.pmap(
  lambda key, num: tuple(jax.random.split(key, num)),
  static_broadcasted_argnums=1,
)
p_split_num.__doc__ = "Splits a replicated key into `num`, on every device."


@functools.cache
def _host_sync_fn(sync_op: Callable[[Any, str], Any]) -> Callable:
  # One device per process: the first local device of each.
  devices = [
    jax.local_devices(process_index=p)[0] for p in range(jax.process_count())
  ]
  return jax.pmap(lambda x: sync_op(x, "i"), axis_name="i", devices=devices)


def host_sync(obj: Any, sync_op: Callable[[Any, str], Any]) -> Any:
  """`sync_op(obj, axis)` over the processes (hosts), with `axis` the
  axis of one device per process; `obj` itself with a single process."""
  if jax.process_count() == 1:
    return obj
  expanded = jax.tree.map(lambda x: jnp.expand_dims(x, 0), obj)
  return get_first(_host_sync_fn(sync_op)(expanded))


def host_all_gather(x: Any) -> Any:
  """Every process's value of each leaf, stacked on a new leading axis
  (unchanged with a single process)."""
  return host_sync(x, jax.lax.all_gather)


def host_mean(x: Any) -> Any:
  """The mean of each leaf over the processes."""
  return host_sync(x, jax.lax.pmean)


def sync_and_divide_value(
  value: Any, counter: Any, axis_name: str | None = None
) -> Any:
  """`value / counter`, averaged over `axis_name` when it is bound."""
  return pmean_if_pmap(jax.tree.map(lambda x: x / counter, value), axis_name)


jit_sync_and_divide_value = jax.jit(sync_and_divide_value)
jit_sync_and_divide_value.__doc__ = "`value / counter`, compiled."
pmap_sync_and_divide_value = jax.pmap(
  functools.partial(sync_and_divide_value, axis_name="i"), axis_name="i"
)
pmap_sync_and_divide_value.__doc__ = (
  "`value / counter` per device, averaged over the local devices."
)


def copy_array(x: jax.Array) -> jax.Array:
  """A copy of an array in a new buffer (safe to donate)."""
  return x + jnp.zeros_like(x)


copy_obj = jax.jit(lambda x: jax.tree.map(copy_array, x))
copy_obj.__doc__ = "A copy of a pytree of arrays in new buffers."
_pmap_copy_obj = jax.pmap(copy_obj)


def pmap_copy_obj(x: Any) -> Any:
  """`copy_obj` of a replicated pytree, per device (None and pytrees
  without leaves are returned as new containers with the same leaves)."""
  if x is None:
    return None
  if tree_is_empty(x):
    leaves, tree = jax.tree.flatten(x)
    return jax.tree.unflatten(tree, leaves)
  return _pmap_copy_obj(x)
