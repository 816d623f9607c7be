"""Small array operations: outer products, block permutations, axis
rearrangement and a square root whose derivative is bounded."""

from __future__ import annotations

import functools
import string
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def outer_product(*arrays: jax.Array) -> jax.Array:
  """The outer product of any number of vectors, `out[i, j, ...] = a[i] b[j]
  ...`.

  Raises:
    ValueError: if an argument is not a vector.
  """
  if not all(jnp.ndim(a) == 1 for a in arrays):
    raise ValueError(
      "outer_product takes vectors only, got arrays of shapes "
      f"{[jnp.shape(a) for a in arrays]}."
    )
  letters = string.ascii_lowercase[: len(arrays)]
  return jnp.einsum(f"{','.join(letters)}->{letters}", *arrays)


def block_permuted(
  matrix: jax.Array, block_sizes: Sequence[int], block_order: Sequence[int]
) -> jax.Array:
  """A square matrix with its blocks of rows and columns reordered.

  The matrix is cut into blocks of `block_sizes` along both axes; block
  `(i, j)` of the result is block `(block_order[i], block_order[j])` of
  the input.

  Raises:
    ValueError: if the two sequences differ in length.
  """
  if len(block_sizes) != len(block_order):
    raise ValueError(
      f"block_sizes ({len(block_sizes)} entries) and block_order "
      f"({len(block_order)} entries) must have the same length."
    )
  if list(block_order) == list(range(len(block_order))):
    return matrix
  starts = np.concatenate([[0], np.cumsum(block_sizes)[:-1]])
  index = np.concatenate(
    [np.arange(starts[b], starts[b] + block_sizes[b]) for b in block_order]
  )
  return matrix[np.ix_(index, index)]


def rearrange(x: jax.Array, spec: str) -> jax.Array:
  """Transposes and reshapes an array as an einops-style `spec` says.

  Every axis is one letter (spaces are ignored): `"b h w c -> b (c h w)"`
  moves `c` before `h` and merges the last three axes; a `1` on the right
  adds an axis of size one (`"b->b1"`).

  Args:
    x: the array.
    spec: `"<input axes> -> <output axes>"`.

  Returns:
    The rearranged array.

  Raises:
    ValueError: if the spec does not name each axis of `x` exactly once on
      both sides.
  """
  if spec.count("->") != 1:
    raise ValueError(f"rearrange: the spec {spec!r} needs one '->'.")
  inputs, outputs = (side.replace(" ", "") for side in spec.split("->"))
  names = [c for c in outputs if c not in "()1"]
  if len(inputs) != x.ndim or sorted(names) != sorted(inputs):
    raise ValueError(
      f"rearrange: {spec!r} must name each of the {x.ndim} axes of an "
      f"array of shape {x.shape} once on each side."
    )
  x = jnp.transpose(x, [inputs.index(c) for c in names])
  sizes = dict(zip(names, x.shape))
  shape: list[int] = []
  group: list[int] | None = None
  for c in outputs:
    if c == "(":
      group = []
    elif c == ")":
      shape.append(int(np.prod(group or [1], dtype=np.int64)))
      group = None
    else:
      size = 1 if c == "1" else sizes[c]
      (shape if group is None else group).append(size)
  return x.reshape(shape)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _sqrt_with_max_gradient(x: jax.Array, max_gradient: float) -> jax.Array:
  return jnp.sqrt(x)


@_sqrt_with_max_gradient.defjvp
def _sqrt_with_max_gradient_jvp(max_gradient, primals, tangents):
  (x,), (dx,) = primals, tangents
  # sqrt'(x) = 1 / (2 sqrt(x)) is at most `max_gradient` for x at least:
  floor = 1 / (4 * max_gradient**2)
  return jnp.sqrt(x), dx / (2 * jnp.sqrt(jnp.maximum(x, floor)))


def stable_sqrt(x: jax.Array, max_gradient: float = 1000.0) -> jax.Array:
  """`sqrt(x)` whose derivative is capped at `max_gradient` near zero.

  Args:
    x: non-negative values.
    max_gradient: the largest derivative (reached for `x <= 1 / (4
      max_gradient²)`).

  Returns:
    `jnp.sqrt(x)`; its JVP and VJP use `min(1 / (2 sqrt(x)),
    max_gradient)`.
  """
  return _sqrt_with_max_gradient(x, max_gradient)
