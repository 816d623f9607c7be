"""Sharing per-block work among the devices of a mapped axis.

Under `pmap` or `shard_map` every device holds the same curvature state, so
work that depends only on that state (a block's inverse refresh, a block's
product with a vector all devices share) need not be repeated on every
device. `run_on_owners` runs each piece of work on one device only; the
others contribute zeros, and one `psum` hands every device every result.
`balance` picks the owners so that the devices' estimated costs are even.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def balance(costs: Sequence[float], num_devices: int) -> tuple[int, ...]:
  """The owner device of each piece of work.

  Greedy longest-processing-time: the costliest piece first, each to the
  device with the least work so far; no device gets more than the lightest
  one plus the largest single cost.

  Args:
    costs: a non-negative estimated cost per piece.
    num_devices: the number of devices to share the pieces among.

  Returns:
    One device index in `[0, num_devices)` per piece.
  """
  if num_devices < 1:
    raise ValueError(f"num_devices must be positive, got {num_devices}.")
  owners = [0] * len(costs)
  loads = [0.0] * num_devices
  for piece in sorted(range(len(costs)), key=lambda i: -costs[i]):
    device = min(range(num_devices), key=loads.__getitem__)
    owners[piece] = device
    loads[device] += costs[piece]
  return tuple(owners)


def square_sides(tree: Any) -> list[tuple[int, int]]:
  """`(n, count)` for each stack of `count` square `n x n` matrices in the
  leaves of `tree` (the matrices that cost cubic work to factor)."""
  sides = []
  for leaf in jax.tree.leaves(tree):
    shape = np.shape(leaf)
    if len(shape) >= 2 and shape[-1] == shape[-2] and shape[-1] > 1:
      sides.append((shape[-1], int(np.prod(shape[:-2], dtype=np.int64))))
  return sides


def refresh_cost(state: Any) -> float:
  """An estimate of the flops of refreshing a block from its state: cubic in
  each square matrix it holds, linear in everything else."""
  size = sum(int(np.size(x)) for x in jax.tree.leaves(state))
  return float(size + sum(count * n**3 for n, count in square_sides(state)))


def product_cost(state: Any, dim: int) -> float:
  """An estimate of the flops of a block's product with a vector of `dim`
  elements: `dim` times each square matrix's side (a Kronecker factored
  block's `d_in d_out (d_in + d_out)`, a full block's `dim²`)."""
  sides = sum(count * n for n, count in square_sides(state))
  return float(dim * max(sides, 1))


def _bool_safe_psum(leaves, axis_name):
  summed = jax.lax.psum(
    [x.astype(jnp.int32) if x.dtype == bool else x for x in leaves], axis_name
  )
  return [
    s.astype(bool) if x.dtype == bool else s for s, x in zip(summed, leaves)
  ]


def _passthrough(fn: Callable, arg: Any):
  """Shapes of `fn(arg)`'s leaves and, per leaf, the index of the leaf of
  `arg` it returns unchanged (None where it computes a new value)."""
  found = []

  def probe(arg):
    position = {id(x): i for i, x in enumerate(jax.tree.leaves(arg))}
    out = fn(arg)
    found.append(tuple(position.get(id(x)) for x in jax.tree.leaves(out)))
    return out

  shapes = jax.eval_shape(probe, arg)
  return shapes, found[0]


def run_on_owners(
  fns: Sequence[Callable],
  args: Sequence[Any],
  owners: Sequence[int],
  axis_name: str,
) -> list:
  """`[fn(arg) for fn, arg in zip(fns, args)]`, each computed on one device.

  Must run inside `pmap` or `shard_map` over `axis_name`, with `args` equal
  on every device. Device `owners[i]` computes `fns[i](args[i])` (a
  `lax.switch` on the device index, so the other devices skip it); the
  results are summed over the axis. Leaves a function returns unchanged
  from its argument (a cache entry it does not refresh, say) are taken
  from the argument and not sent between devices.

  Args:
    fns: one function per piece of work.
    args: the argument of each function (a pytree).
    owners: the device index that computes each piece (see `balance`).
    axis_name: the mapped axis the devices are on.

  Returns:
    The results, on every device.
  """
  plans = [_passthrough(fn, arg) for fn, arg in zip(fns, args)]
  num_devices = jax.lax.axis_size(axis_name)

  def branch(device):
    def compute():
      computed = []
      for fn, arg, owner, (shapes, sources) in zip(fns, args, owners, plans):
        new = [s is None for s in sources]
        if owner == device:
          leaves = jax.tree.leaves(fn(arg))
          computed.append([x for x, n in zip(leaves, new) if n])
        else:
          computed.append(
            [
              jnp.zeros(x.shape, x.dtype)
              for x, n in zip(jax.tree.leaves(shapes), new)
              if n
            ]
          )
      return computed

    return compute

  computed = jax.lax.switch(
    jax.lax.axis_index(axis_name), [branch(d) for d in range(num_devices)]
  )
  summed = iter(_bool_safe_psum(jax.tree.leaves(computed), axis_name))
  results = []
  for arg, (shapes, sources) in zip(args, plans):
    inputs = jax.tree.leaves(arg)
    leaves = [next(summed) if s is None else inputs[s] for s in sources]
    results.append(jax.tree.unflatten(jax.tree.structure(shapes), leaves))
  return results


def map_blocks(
  fns: Sequence[Callable],
  args: Sequence[Any],
  costs: Sequence[float],
  axis_name: str | None,
) -> list:
  """`[fn(arg) ...]`, shared among the devices of `axis_name` by cost.

  Without an axis, on a single device, or for fewer than two pieces, every
  device computes every piece (nothing would be saved).
  """
  num_devices = 1 if axis_name is None else jax.lax.axis_size(axis_name)
  if axis_name is None or num_devices < 2 or len(fns) < 2:
    return [fn(arg) for fn, arg in zip(fns, args)]
  return run_on_owners(fns, args, balance(costs, num_devices), axis_name)
