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


def parse_rearrange_spec(spec: str) -> tuple[str, list[list[str]]]:
  """Splits an einops-style spec into its input axes and its output axes.

  Args:
    spec: e.g. `"abc -> (ab)c"`: one lowercase letter per input axis (spaces
      are ignored), each named once on both sides; on the right, letters in
      parentheses merge into one axis and a `1` is a new axis of size one.

  Returns:
    The input letters, and for each output axis the letters (or `"1"`)
    merged into it.

  Raises:
    ValueError: for a malformed spec; the message says what is wrong.
  """
  if not isinstance(spec, str) or spec.count("->") != 1:
    raise ValueError("a spec is a string with one '->'")
  left, right = (side.replace(" ", "") for side in spec.split("->"))
  if not all(c in string.ascii_lowercase for c in left) or len(
    set(left)
  ) != len(left):
    raise ValueError(
      "the left side must name each axis with its own lowercase letter"
    )
  groups: list[list[str]] = []
  current: list[str] | None = None
  for c in right:
    if c == "(":
      if current is not None:
        raise ValueError("parentheses cannot be nested")
      current = []
    elif c == ")":
      if current is None:
        raise ValueError("a ')' closes no '('")
      groups.append(current)
      current = None
    elif c == "1" or c in string.ascii_lowercase:
      if current is None:
        groups.append([c])
      else:
        current.append(c)
    else:
      raise ValueError(f"the right side has the character {c!r}")
  if current is not None:
    raise ValueError("a '(' is not closed")
  names = [c for g in groups for c in g if c != "1"]
  if sorted(names) != sorted(left):
    raise ValueError(
      "the right side must name each axis of the left side exactly once"
    )
  return left, groups


def _checked_spec(spec: str, ndim: int, fn: str) -> tuple[str, list[list[str]]]:
  try:
    left, groups = parse_rearrange_spec(spec)
  except ValueError as e:
    raise ValueError(f"{fn}: {spec!r} is malformed: {e}.") from None
  if len(left) != ndim:
    raise ValueError(
      f"{fn}: {spec!r} names {len(left)} axes, for an array of {ndim}."
    )
  return left, groups


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
    ValueError: if the spec is malformed (see `parse_rearrange_spec`) or
      does not name each axis of `x`.
  """
  left, groups = _checked_spec(spec, jnp.ndim(x), "rearrange")
  names = [c for g in groups for c in g if c != "1"]
  x = jnp.transpose(x, [left.index(c) for c in names])
  sizes = dict(zip(names, x.shape), **{"1": 1})
  return x.reshape([int(np.prod([sizes[c] for c in g])) for g in groups])


def unrearrange(y: jax.Array, spec: str, shape: Sequence[int]) -> jax.Array:
  """Inverts `rearrange(x, spec)` for an `x` of the given shape.

  Args:
    y: the rearranged array.
    spec: the spec `y` was rearranged by.
    shape: the original array's shape.

  Returns:
    `x`, with `rearrange(x, spec) == y`.
  """
  left, groups = _checked_spec(spec, len(shape), "unrearrange")
  names = [c for g in groups for c in g if c != "1"]
  sizes = dict(zip(left, shape))
  y = y.reshape([sizes[c] for c in names])
  return jnp.transpose(y, [names.index(c) for c in left])


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


# Column blocks of about this many columns: matrix products that size still
# run near peak, and fewer blocks leave more of the symmetric half computed.
_GRAM_BLOCK = 256


def symmetric_gram(x: jax.Array) -> jax.Array:
  """`x.T @ x` for a matrix `x`, each product under the diagonal taken as
  the transpose of the one above it.

  The columns are split into blocks of about `_GRAM_BLOCK`; with `k` blocks
  only `k (k + 1) / 2` of the `k²` block products are computed (a quarter
  fewer flops for two blocks, nearly half for many), which XLA's dense
  product cannot do by itself. (Under `jit`, XLA may fold a transpose into
  its product and sum in another order: symmetric to rounding.)
  """
  n = x.shape[-1]
  k = max(1, round(n / _GRAM_BLOCK))
  if x.ndim != 2 or k == 1:
    return x.T @ x
  edges = [n * i // k for i in range(k + 1)]
  cols = [x[:, a:b] for a, b in zip(edges[:-1], edges[1:])]
  upper = {(i, j): cols[i].T @ cols[j] for i in range(k) for j in range(i, k)}
  return jnp.concatenate(
    [
      jnp.concatenate(
        [upper[i, j] if j >= i else upper[j, i].T for j in range(k)], axis=1
      )
      for i in range(k)
    ],
    axis=0,
  )
