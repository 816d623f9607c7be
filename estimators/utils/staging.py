"""Compiling a function without copying the inputs it hands back unchanged.

`jax.jit` gives every output its own buffer, so an input returned as it came
in is copied (jax-ml/jax#6284). An optimizer state whose cached inverses are
refreshed only every few steps would be copied whole on all the other steps.
`stage` records at trace time which outputs are inputs, leaves them out of
the compiled program, and puts the caller's arrays back in their place.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Forwarding:
  """Static part of a staged output: where each output leaf comes from."""

  tree: Any  # treedef of the full output
  sources: tuple  # per output leaf: the index of the input leaf it is, or None


# An optimizer step's time goes to library matrix products and LAPACK, which
# LLVM's default optimisation level does not speed up on CPU; it only makes
# the step slower to compile.
_CPU_OPTIONS = {"xla_backend_optimization_level": 1}


def _dynamic_leaves(args, static_argnums):
  return jax.tree.leaves(
    [a for i, a in enumerate(args) if i not in static_argnums]
  )


def _as_array(x):
  # A Python or NumPy input would have come back from `jit` as an array.
  return x if isinstance(x, jax.Array) else jnp.asarray(x)


def target_platform() -> str:
  """The platform a program compiled now runs on: that of JAX's default
  device when one is set (`jax.default_device`), else the default backend.

  `jax.pmap` would otherwise take the default backend's devices even inside
  `jax.default_device(cpu)` on a machine with a GPU.
  """
  # jax.config's options are attributes added at run time.
  device = jax.config.jax_default_device  # type: ignore[attr-defined]
  if device is None:
    return jax.default_backend()
  return device if isinstance(device, str) else device.platform


@functools.cache
def _cpu_option_known(name: str, value: Any) -> bool:
  # A trivial program compiled with the option: jaxlib checks option names
  # and values when compiling, and rejects them with INVALID_ARGUMENT.
  probe = jax.device_put(np.float32(0), jax.devices("cpu")[0])
  try:
    jax.jit(lambda x: x + 1, compiler_options={name: value}).lower(
      probe
    ).compile()
  except jax.errors.JaxRuntimeError:
    return False
  return True


def supported_cpu_options(options: dict[str, Any]) -> dict[str, Any]:
  """`options` less those this jaxlib's CPU compiler does not take.

  XLA's compiler options come and go between jaxlib releases, and an
  unknown one fails the whole compilation ("No such compile option"); the
  options passed here only tune compile and run time, so a program is
  better compiled without them. Each option is checked once per process,
  by compiling a trivial program with it.

  Args:
    options: XLA compiler options by name, with their values.

  Returns:
    The options this jaxlib accepts, with the same values.
  """
  return {k: v for k, v in options.items() if _cpu_option_known(k, v)}


def stage(
  fn: Callable,
  static_argnums: Sequence[int] = (),
  pmap_axis_name: str | None = None,
  cpu_options: dict | None = None,
) -> Callable:
  """Compiles `fn` like `jax.jit` (or `jax.pmap`), minus passthrough copies.

  Args:
    fn: the function to compile.
    static_argnums: positions of its static (hashable, non-array) arguments.
    pmap_axis_name: when given, compile with `jax.pmap` over this axis name
      instead of `jax.jit`.
    cpu_options: XLA compiler options added when compiling for CPU; those
      this jaxlib does not know are left out (`supported_cpu_options`).

  Returns:
    A function returning a tree equal to `fn(*args)`, in which outputs that
    are inputs returned untouched are the caller's own arrays.
  """
  static_argnums = tuple(static_argnums)

  def pruned(*args):
    out = fn(*args)
    position = {
      id(x): i for i, x in enumerate(_dynamic_leaves(args, static_argnums))
    }
    leaves, tree = jax.tree.flatten(out)
    sources = tuple(position.get(id(x)) for x in leaves)
    computed = [x for x, s in zip(leaves, sources) if s is None]
    return computed, _Forwarding(tree, sources)

  @functools.cache
  def compiled_for(platform):
    if pmap_axis_name is not None:
      return jax.pmap(
        pruned,
        axis_name=pmap_axis_name,
        backend=platform,
        static_broadcasted_argnums=static_argnums,
      )
    options = (
      supported_cpu_options({**_CPU_OPTIONS, **(cpu_options or {})})
      if platform == "cpu"
      else None
    )
    return jax.jit(
      pruned, static_argnums=static_argnums, compiler_options=options
    )

  def call(*args):
    computed, forwarding = compiled_for(target_platform())(*args)
    inputs = _dynamic_leaves(args, static_argnums)
    computed = iter(computed)
    return jax.tree.unflatten(
      forwarding.tree,
      [
        next(computed) if s is None else _as_array(inputs[s])
        for s in forwarding.sources
      ],
    )

  return call
