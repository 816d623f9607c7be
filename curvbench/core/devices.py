"""Which devices a run measures on: the `device` and `devices` settings.

`device` picks the platform: `auto` takes JAX's default backend (a GPU or
TPU when one is installed and visible, else the CPU); `cpu`, `gpu` and `tpu`
require that platform and fail with the fix when it is absent, rather than
silently measuring something else. `devices=N` uses the first N local
devices of that platform, data parallel: a 1-D `mesh` over them (axis
`AXIS`), batches `split` along their examples, parameters and states
`replicate`d. Jitted functions of such inputs run SPMD, with XLA summing the
devices' partial results; `per_device` runs a function under `shard_map`
instead, for code that averages over `AXIS` itself (the estimators'
`pmap_axis_name`). `stack`, `stack_split`, `device_keys` and `unstack` move
between these layouts and `jax.pmap`'s, whose inputs carry a leading device
axis.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
from collections.abc import Callable, Iterator, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

# JAX notes at INFO that it found no TPU whenever it looks for backends,
# which Hydra's logging prints on every command; its warnings still show.
logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)

PLATFORMS = ("auto", "cpu", "gpu", "tpu")
AXIS = "data"  # the mesh axis batches are split along
_INSTALL = {
  "gpu": "install the CUDA build of jax (`make cuda`, or `pip install -c "
  "constraints.txt -e '.[cuda]'`) and check that `nvidia-smi` sees "
  "the GPU",
  "tpu": "install jax with TPU support (`pip install 'jax[tpu]'`) on a TPU "
  "host",
}
_HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"
# The devices of the innermost `use` block (None outside one).
_IN_USE: contextvars.ContextVar[list[jax.Device] | None] = (
  contextvars.ContextVar("devices_in_use", default=None)
)


def select(platform: str) -> jax.Device:
  """The first device of `platform` (one of `PLATFORMS`).

  Raises:
    ValueError: for an unknown platform, or one JAX cannot find here.
  """
  if platform not in PLATFORMS:
    raise ValueError(
      f"Unknown device {platform!r}; choose one of {', '.join(PLATFORMS)}."
    )
  if platform == "auto":
    return jax.devices()[0]
  try:
    return jax.devices(platform)[0]
  except RuntimeError:
    found = sorted({d.platform for d in jax.devices()})
    raise ValueError(
      f"device={platform}, but JAX finds no {platform.upper()} here (it "
      f"finds: {', '.join(found)}). To use one, {_INSTALL[platform]}; or "
      "run with device=auto (the default backend) or device=cpu."
    ) from None


def check_count(count) -> int:
  """`count` as an int, or a ValueError naming the `devices` setting."""
  if (
    isinstance(count, bool)
    or not isinstance(count, (int, np.integer))
    or (count < 1)
  ):
    raise ValueError(
      f"devices={count!r} must be a positive integer: the "
      "number of local devices a run splits its batches "
      "across (1: one device)."
    )
  return int(count)


def request_host_devices(count: int) -> None:
  """Asks JAX for `count` CPU devices, where that is still possible.

  JAX gives one CPU device unless asked before its backends start; this
  asks (`jax_num_cpu_devices`) unless XLA_FLAGS already sets the count, and
  does nothing once the backends run (then `local` says how to get them).
  """
  if count < 2 or _HOST_DEVICES_FLAG in os.environ.get("XLA_FLAGS", ""):
    return
  try:
    jax.config.update("jax_num_cpu_devices", count)
  except RuntimeError:  # the backends have started: too late
    pass


def local(platform: str, count: int = 1) -> list[jax.Device]:
  """The first `count` local devices of `platform`.

  Raises:
    ValueError: for a platform JAX cannot find, or fewer devices than
      `count`, with how to get more.
  """
  count = check_count(count)
  first = select(platform)
  found = jax.local_devices(backend=first.platform)
  if count <= len(found):
    return found[:count]
  kind = first.platform.upper()
  if first.platform == "cpu":
    fix = (
      f"JAX makes one CPU device unless asked before it starts: start "
      f"the process with XLA_FLAGS={_HOST_DEVICES_FLAG}={count} (a "
      f"`curvbench` run asks by itself when it is the process's first "
      f"run; a sweep with several device counts in one process needs "
      f"the flag for the largest)"
    )
  else:
    fix = (
      f"make more {kind}s visible to this process (e.g. "
      f"CUDA_VISIBLE_DEVICES on NVIDIA GPUs)"
    )
  raise ValueError(
    f"devices={count}, but JAX finds {len(found)} local {kind} "
    f"device{'s' if len(found) != 1 else ''} here ({found[0].device_kind}"
    f"). Lower devices= to at most {len(found)}, or {fix}."
  )


def mesh(platform: str, count: int = 1) -> Mesh:
  """A 1-D mesh, axis `AXIS`, over the first `count` devices of
  `platform` (see `local`)."""
  return Mesh(np.array(local(platform, count)), (AXIS,))


@contextlib.contextmanager
def use(platform: str, count: int = 1) -> Iterator[jax.Device]:
  """Runs the block with `platform`'s first device as JAX's default device,
  after checking that `count` devices of it exist (asking for CPU host
  devices first where needed); `describe` records `count` inside."""
  count = check_count(count)
  if platform in ("auto", "cpu"):
    request_host_devices(count)
  used = local(platform, count)
  token = _IN_USE.set(used)
  try:
    with jax.default_device(used[0]):
      yield used[0]
  finally:
    _IN_USE.reset(token)


def in_use() -> list[jax.Device]:
  """The devices of the enclosing `use` block; outside one, the default
  backend's first device."""
  return _IN_USE.get() or jax.local_devices()[:1]


def describe(device: jax.Device, count: int | None = None) -> dict:
  """The record columns of a device: its kind and platform, how many of
  its platform are local, how many the run uses (`count`; None: the count
  of the enclosing `use` block, else 1), and the runtime's version string
  (on GPUs, the CUDA and driver versions JAX reports)."""
  used = len(in_use()) if count is None else check_count(count)
  return dict(
    device_kind=device.device_kind,
    platform=device.platform,
    num_devices=len(jax.local_devices(backend=device.platform)),
    devices_used=used,
    platform_version=str(device.client.platform_version),
  )


# --- placing data on a mesh --------------------------------------------------


def split_complaint(size: int, count: int, setting: str) -> str | None:
  """Why `size` examples (set by `setting`) do not split evenly over
  `count` devices; None when they do."""
  if size % count:
    return (
      f"{setting}={size} does not split evenly across devices="
      f"{count}: set {setting} to a multiple of {count}, or change "
      "devices=."
    )
  return None


def split(tree, mesh: Mesh, setting: str, axis: int = 0):
  """`tree` on the mesh, every leaf split along `axis` (its examples).

  Args:
    tree: a batch pytree; every leaf has the same size along `axis`.
    mesh: a mesh from `mesh`.
    setting: the config key that sets that size, for the error.
    axis: the examples' axis.

  Raises:
    ValueError: when the size is not a multiple of the device count.
  """
  for leaf in jax.tree.leaves(tree):
    complaint = split_complaint(np.shape(leaf)[axis], mesh.size, setting)
    if complaint is not None:
      raise ValueError(complaint)
  spec = P(*([None] * axis), AXIS)
  return jax.device_put(tree, NamedSharding(mesh, spec))


def replicate(tree, mesh: Mesh):
  """`tree` on the mesh, a whole copy on every device."""
  return jax.device_put(tree, NamedSharding(mesh, P()))


def per_device(
  fn: Callable, mesh: Mesh, split_args: Sequence[int] = ()
) -> Callable:
  """`fn` run on every device of the mesh by `jax.shard_map`.

  The arguments at positions `split_args` are split along their leading
  axis (each device sees its part), the others replicated; inside, `AXIS`
  names the devices (e.g. for `jax.lax.pmean` or an estimator's
  `pmap_axis_name`). `fn` must return the same result on every device
  (averaging over `AXIS` does that); it is taken from each device as it is.
  """

  def wrapped(*args):
    specs = tuple(P(AXIS) if i in split_args else P() for i in range(len(args)))
    # The result's equality across devices is fn's promise, not something
    # shard_map's type check can see through the estimators' collectives.
    return jax.shard_map(
      fn, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False
    )(*args)

  return wrapped


# --- jax.pmap's layout: a leading device axis ---------------------------------


@functools.cache
def _layout_programs(mesh: Mesh) -> dict[str, Callable]:
  add_axis = lambda tree: jax.tree.map(lambda x: x[None], tree)
  shard = functools.partial(jax.shard_map, mesh=mesh)
  return dict(
    stack=jax.jit(shard(add_axis, in_specs=P(), out_specs=P(AXIS))),
    stack_split=jax.jit(shard(add_axis, in_specs=P(AXIS), out_specs=P(AXIS))),
    keys=jax.jit(
      shard(
        lambda key: jax.random.fold_in(key, jax.lax.axis_index(AXIS))[None],
        in_specs=P(),
        out_specs=P(AXIS),
      )
    ),
    unstack=jax.jit(
      shard(
        lambda tree: jax.tree.map(lambda x: x[0], tree),
        in_specs=P(AXIS),
        out_specs=P(),
        check_vma=False,
      )
    ),
  )


def stack(tree, mesh: Mesh):
  """A copy of `tree` per device, stacked on a leading device axis."""
  return _layout_programs(mesh)["stack"](tree)


def stack_split(tree, mesh: Mesh):
  """A batch split along its examples (`split`) as `(devices, examples per
  device, ...)`, each device holding its own part; no data moves."""
  return _layout_programs(mesh)["stack_split"](tree)


def device_keys(key: jax.Array, mesh: Mesh) -> jax.Array:
  """One PRNG key per device, `fold_in(key, device index)`, stacked."""
  return _layout_programs(mesh)["keys"](key)


def unstack(tree, mesh: Mesh):
  """A tree stacked on a leading device axis whose entries are equal, as
  one replicated tree: each device keeps its own entry; no data moves."""
  return _layout_programs(mesh)["unstack"](tree)
