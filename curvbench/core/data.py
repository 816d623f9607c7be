"""The examples a curvature is measured on: one batch, N batches, or the
whole training split (`measure.spectra.data`: `batch`, `batches:N`, `train`).

A `Data` holds its examples as equal chunks stacked on a leading axis, plus
the remainder as one smaller chunk, so `mean` averages any per-batch quantity
over all of them in one `lax.scan`: the examples sit on the device and no
Python code runs per chunk. Chunks are weighted by their number of examples,
so the result is the mean over examples, as the papers define full-dataset
curvature (every per-batch quantity here is itself a mean over its batch).
With several devices (`split`), every chunk is spread over them along its
examples, so a jitted `mean` runs on all of them and sums their parts.

On CPU, XLA runs a convolution through its fast (Eigen) kernel only in the
layout `(batch, spatial..., feature)` with an `(spatial..., in, out)`
kernel, and brings other layouts to it only outside loops, so the backward
convolutions of a gradient in the scan's body took the slow generic loop:
over 4 chunks, the gradient of two 3x3 convolutions cost 5 to 10 times the
4 batches' (2 cores). Importing this module therefore lowers every ungrouped
CPU convolution in that layout, between transposes
(`canonical_cpu_convolutions`); values are unchanged.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import mlir
from jax.sharding import Mesh

from curvbench.core import devices

Batch = Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Data:
  """Examples as `chunks` (a batch with a leading chunk axis) and `rest`.

  Attributes:
    chunks: a batch pytree whose leaves have shape `(num_chunks, size, ...)`.
    rest: a batch of the remaining examples (fewer than `size`), or None.
  """

  chunks: Batch
  rest: Batch | None = None

  @classmethod
  def of(cls, batch: Batch | Data) -> Data:
    """`batch` as one chunk (a `Data` is returned as it is)."""
    if isinstance(batch, Data):
      return batch
    return cls(jax.tree.map(lambda x: x[None], batch))

  @property
  def num_chunks(self) -> int:
    """The number of full chunks."""
    return jax.tree.leaves(self.chunks)[0].shape[0]

  @property
  def chunk_size(self) -> int:
    """The number of examples in each chunk."""
    return jax.tree.leaves(self.chunks)[0].shape[1]

  @property
  def rest_size(self) -> int:
    """The number of examples in `rest` (0 where there is none)."""
    return 0 if self.rest is None else jax.tree.leaves(self.rest)[0].shape[0]

  @property
  def num_examples(self) -> int:
    """The number of examples in all: the chunks' and the rest's."""
    return self.num_chunks * self.chunk_size + self.rest_size

  @property
  def first(self) -> Batch:
    """The first chunk, as a batch (for tracing a model)."""
    return jax.tree.map(lambda x: x[0], self.chunks)

  def concatenated(self) -> Batch:
    """Every example as one batch (for small data and tests)."""
    whole = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), self.chunks)
    if self.rest is None:
      return whole
    return jax.tree.map(lambda a, b: jnp.concatenate([a, b]), whole, self.rest)

  def split(self, mesh: Mesh, setting: str) -> Data:
    """The examples spread over the mesh's devices (`devices.split`): each
    chunk along its examples; the rest too where it splits evenly, else a
    copy on every device.

    Raises:
      ValueError: naming `setting` when the chunk size does not split.
    """
    rest = self.rest
    if rest is not None:
      rest = (
        devices.split(rest, mesh, setting)
        if self.rest_size % mesh.size == 0
        else devices.replicate(rest, mesh)
      )
    return Data(devices.split(self.chunks, mesh, setting, axis=1), rest)

  def mean(self, fn: Callable[[Batch], Any]) -> Any:
    """The example-weighted mean of `fn(chunk)` over the chunks.

    Args:
      fn: maps a batch to a pytree of arrays (a mean over that batch).

    Returns:
      A pytree like `fn`'s output: the mean over every example.
    """

    def add(total, chunk):
      return jax.tree.map(jnp.add, total, fn(chunk)), None

    zeros = jax.tree.map(
      lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(fn, self.first)
    )
    total, _ = jax.lax.scan(add, zeros, self.chunks)
    if self.rest is None:
      return jax.tree.map(lambda t: t / self.num_chunks, total)
    full = self.num_chunks * self.chunk_size
    return jax.tree.map(
      lambda t, r: (t * self.chunk_size + r * self.rest_size)
      / (full + self.rest_size),
      total,
      fn(self.rest),
    )


def _canonical(ndim: int) -> jax.lax.ConvDimensionNumbers:
  """Batch first, features last; kernel `(spatial..., in, out)`."""
  spatial = tuple(range(1, ndim - 1))
  return jax.lax.ConvDimensionNumbers(
    (0, ndim - 1) + spatial,
    (ndim - 1, ndim - 2) + tuple(range(ndim - 2)),
    (0, ndim - 1) + spatial,
  )


def canonical_cpu_convolutions() -> bool:
  """Lowers CPU convolutions in the layout XLA's fast kernel takes.

  An ungrouped convolution in another layout becomes transposes of its
  operands, the convolution in `_canonical` layout and a transpose of the
  result: what XLA's own canonicalisation does, but only in a program's
  top level, not in loop bodies (jax issue 12868). Spatial dimensions keep
  their order, so strides, padding and dilations are unchanged. Other
  devices and grouped or sharded convolutions keep jax's lowering.

  Returns:
    Whether the lowering is in place: False where this jax keeps its
    lowering rules elsewhere (the convolutions are then slower in loops,
    their values the same).
  """
  conv = jax.lax.conv_general_dilated_p
  try:  # jax's rule, to lower the canonical convolution itself
    # (jax's private tables: a rule, or an entry holding it, by version)
    entry: Any = (
      mlir._platform_specific_lowerings["cpu"].get(conv)
      or mlir._lowerings[conv]
    )
  except (AttributeError, KeyError, TypeError):
    return False
  default = getattr(entry, "rule", entry)
  if getattr(default, "canonicalizes", False):
    return True

  def rule(ctx, lhs, rhs, *, dimension_numbers, **params):
    canonical = _canonical(len(dimension_numbers.lhs_spec))
    if (
      dimension_numbers == canonical
      or params["feature_group_count"] != 1
      or params["batch_group_count"] != 1
      or params.get("out_sharding") is not None
    ):
      return default(
        ctx, lhs, rhs, dimension_numbers=dimension_numbers, **params
      )
    lhs_spec, rhs_spec, out_spec = dimension_numbers
    out_order = (out_spec[0],) + tuple(out_spec[2:]) + (out_spec[1],)

    def transposed(x, kernel):
      y = conv.bind(
        jax.lax.transpose(
          x, (lhs_spec[0],) + tuple(lhs_spec[2:]) + (lhs_spec[1],)
        ),
        jax.lax.transpose(
          kernel, tuple(rhs_spec[2:]) + (rhs_spec[1], rhs_spec[0])
        ),
        dimension_numbers=canonical,
        **params,
      )
      return jax.lax.transpose(y, tuple(np.argsort(out_order)))

    return mlir.lower_fun(transposed, multiple_results=False)(ctx, lhs, rhs)

  # Marks our rule, so that a second call keeps it (read back above).
  rule.canonicalizes = True  # type: ignore[attr-defined]
  mlir.register_lowering(conv, rule, platform="cpu")
  return True


canonical_cpu_convolutions()


SCOPE = re.compile(r"^(batch|train|batches:([1-9][0-9]*))$")


def parse_scope(scope: str) -> tuple[str, int | None]:
  """`'batch'`, `'train'` or `'batches:N'` as `(kind, N)`."""
  match = SCOPE.match(str(scope))
  if not match:
    raise ValueError(
      f"measure.spectra.data={scope!r} is not a data scope: use 'batch' "
      "(one batch), 'batches:N' (the first N batches, N >= 1) or 'train' "
      "(the whole training split)."
    )
  return match.group(1).split(":")[0], (
    int(match.group(2)) if match.group(2) else None
  )


def select(
  problem,
  scope: str,
  batch_size: int | None = None,
  chunk_size: int | None = None,
  dtype=np.float32,
  seed: int | None = None,
  sample: int = 0,
) -> Data:
  """The examples of `scope` from `problem`, on the device.

  Args:
    problem: a `problems.Problem`.
    scope: 'batch', 'batches:N' or 'train' (see `parse_scope`).
    batch_size: the batch of 'batch' and 'batches:N' (None: the problem's).
    chunk_size: examples per chunk for 'train' (None: the batch size).
    dtype: the inputs' dtype.
    seed: the batch order of 'batch' and 'batches:N' (None: the problem's).
    sample: which of consecutive draws of 'batch' or 'batches:N' (0: the
      first batches of the order, 1: the ones after them, ...); 'train' has
      one.

  Returns:
    A `Data`. Batches are taken in the problem's seeded order, so 'batch'
    with sample 0 is `problem.fixed_batch`; 'train' keeps the split's order.
  """
  kind, count = parse_scope(scope)
  if kind == "train":
    x, y = problem.data.x_train, problem.data.y_train
    if len(x) == 0:
      raise ValueError(
        f"measure.spectra.data=train, but problem "
        f"{problem.name!r} has no training examples; use "
        "'batch' or give the problem a training split."
      )
    size = min(chunk_size or batch_size or problem.batch_size, len(x))
    full = len(x) // size * size
    inputs = x.astype(dtype)
    targets = problem.targets(inputs, y)
    stack = lambda a: jnp.asarray(a[:full].reshape(-1, size, *a.shape[1:]))
    rest = (
      (jnp.asarray(inputs[full:]), jnp.asarray(targets[full:]))
      if full < len(x)
      else None
    )
    return Data((stack(inputs), stack(targets)), rest)
  size = batch_size or problem.batch_size
  if (count or 1) * size > len(problem.data.x_train):
    raise ValueError(
      f"measure.spectra.data={scope!r} asks for {count} batches of {size}, "
      f"more than the {len(problem.data.x_train)} training examples; use "
      "'train' for the whole split."
    )
  batches = problem.batches(batch_size=size, seed=seed, dtype=dtype)
  for _ in range(sample * (count or 1)):
    next(batches)
  chosen = [next(batches) for _ in range(count or 1)]
  return Data(jax.tree.map(lambda *b: jnp.stack(b), *chosen))
