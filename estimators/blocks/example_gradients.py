"""A layer's per-example gradients as the Shampoo family averages them.

The families of `shampoo`, `optimal_kronecker` and `kl_shampoo` need, over
the per-(sample, example) weight gradients `G_n` in K-FAC's `(input_size,
output_size)` layout, the averages `E_n[G_n b G_nᵀ]`, `E_n[G_nᵀ a G_n]` and
`E_n[(q_lᵀ G_n q_r)²]`. `ExampleGradients` computes them for dense, repeated
dense and conv tags, `EmbeddingGradients` for embedding lookups from the
gradients' nonzero rows; `ExampleGradientsMixin` and `EmbeddingFactors`
give a block its batch's.

A block's input-side factor is a square matrix or, for a large vocabulary,
its diagonal as a vector (see `EmbeddingFactors`); the `factor_*` functions
and `eigen_multiply` keep the families' code one for both forms.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from estimators import utils
from estimators.blocks import base, embedding, kronecker

if TYPE_CHECKING:
  # A mixin's methods run on the Kronecker block it is mixed into: the type
  # checker sees that block (at run time the mixin is a plain class).
  _KroneckerBlock = kronecker.TwoKroneckerFactored
else:
  _KroneckerBlock = object


# --- input factors that may be diagonal --------------------------------------


def factor_trace(factor: jax.Array) -> jax.Array:
  """The trace of a factor, a matrix or the vector of its diagonal."""
  return jnp.trace(factor) if factor.ndim == 2 else jnp.sum(factor)


def factor_inverse(factor: jax.Array) -> jax.Array:
  """The inverse of a positive definite factor, in the factor's form."""
  return utils.psd_inverse(factor) if factor.ndim == 2 else 1 / factor


def factor_apply(factor: jax.Array, v: jax.Array) -> jax.Array:
  """`factor @ v` for a `(rows, columns)` matrix `v`."""
  return factor @ v if factor.ndim == 2 else factor[:, None] * v


def factor_eigh(factor: jax.Array) -> tuple[jax.Array, jax.Array | None]:
  """`(values, vectors)` of a PSD factor (`safe_psd_eigh`); a diagonal's
  eigenvectors are the identity, given as None."""
  if factor.ndim == 2:
    return utils.safe_psd_eigh(factor)
  return jnp.maximum(factor, 0), None


def kronecker_eigh(
  inputs: jax.Array, outputs: jax.Array
) -> tuple[jax.Array | None, jax.Array | None, jax.Array]:
  """`(Q_a, Q_b, outer(values_a, values_b))` of `inputs ⊗ outputs`, from the
  factors' eigendecompositions (`factor_eigh`)."""
  a_values, q_a = factor_eigh(inputs)
  b_values, q_b = factor_eigh(outputs)
  return q_a, q_b, jnp.outer(a_values, b_values)


def device_mean(pmap_axis_name: str | None):
  """The average over the devices that share a batch (`pmap_axis_name`;
  None: one device, the identity)."""
  if pmap_axis_name is None:
    return lambda x: x
  return lambda x: jax.lax.pmean(x, pmap_axis_name)


def moving_shares(weight, ema_old, ema_new) -> tuple[jax.Array, ...]:
  """`(old, new, total)`: the shares of the old estimate (of total weight
  `weight`, scaled by `ema_old`) and of this batch's (weight `ema_new`) in
  their weighted average, and the average's weight; the old one's share
  is 0 while it has no weight."""
  w_old = ema_old * weight
  total = w_old + ema_new
  old = w_old / jnp.where(total > 0, total, jnp.ones_like(total))
  return old, 1 - old, total


def eigen_multiply(
  q_l: jax.Array | None, q_r: jax.Array, grid: jax.Array, v: jax.Array
) -> jax.Array:
  """`(q_l ⊗ q_r) diag(vec grid) (q_l ⊗ q_r)ᵀ vec(v)`, `q_l` None for the
  identity."""
  if q_l is not None:
    return utils.kronecker_eigen_multiply(q_l, q_r, grid, v)
  return ((v @ q_r) * grid) @ q_r.T


# --- settings and loop of the iterative fits ----------------------------------


def check_int_setting(block_name, setting: str, value, least: int):
  """Raises a ValueError unless `value` is an int (not a bool) >= `least`."""
  if (
    not isinstance(value, numbers.Integral)
    or isinstance(value, bool)
    or value < least
  ):
    raise ValueError(
      f"Block {block_name!r}: {setting} must be an int >= {least}, "
      f"got {value!r}."
    )


def check_nonnegative_setting(
  block_name, setting: str, value, none_allowed: bool = False
):
  """Raises a ValueError unless `value` is a real number (not a bool) >= 0,
  or None where `none_allowed`."""
  if none_allowed and value is None:
    return
  if (
    not isinstance(value, numbers.Real)
    or isinstance(value, bool)
    or not float(value) >= 0
  ):
    wanted = "a number >= 0 or None" if none_allowed else "a number >= 0"
    raise ValueError(
      f"Block {block_name!r}: {setting} must be {wanted}, got {value!r}."
    )


def fit_tolerance(tolerance: float | None, dtype) -> float:
  """The tolerance of an iterative fit: `tolerance`, or for None the square
  root of `dtype`'s machine epsilon."""
  if tolerance is None:
    return float(jnp.finfo(dtype).eps) ** 0.5
  return float(tolerance)


def fit_loop(step, start: tuple, max_iterations: int, tolerance: float, dtype):
  """Runs `step` on a carry `(*start, change, steps)` while `steps <
  max_iterations` and `change > tolerance`; `step` returns the next carry,
  `change` how far its iterate moved. Starts from infinite change and zero
  steps and returns the last carry."""

  def unfinished(carry):
    *_, change, steps = carry
    return (steps < max_iterations) & (change > tolerance)

  return jax.lax.while_loop(
    unfinished,
    step,
    (*start, jnp.full([], jnp.inf, dtype), jnp.zeros([], jnp.int32)),
  )


# --- dense, repeated dense and conv tags -------------------------------------


@dataclasses.dataclass(frozen=True)
class ExampleGradients:
  """A batch's gradients `G_n`, `(input_size, output_size)` each, for the
  averages `E_n[...] = (1/batch_size) Σ_n [...]` the blocks need.

  One of three forms: `matrices` `(N, input_size, output_size)` holds them;
  or `chunk_matrices(*chunk)` forms them for each chunk of `chunks` (arrays
  with a leading chunk axis), anew for every average; or (a dense tag
  without extra axes) they are the outer products `G_sb = x̃_b dy_sbᵀ` of
  `inputs` `(B, input_size)` and `tangents` `(S, B, output_size)`, never
  formed.
  """

  batch_size: base.Numeric
  matrices: jax.Array | None = None
  chunks: tuple[jax.Array, ...] | None = None
  chunk_matrices: Callable[..., jax.Array] | None = None
  inputs: jax.Array | None = None
  tangents: jax.Array | None = None

  def _mean(self, fn):
    """`(1/batch_size) Σ fn(m)` over the explicit gradients `m`, where `fn`
    sums over its argument's leading axis (into an array or a tuple of
    them, all from one pass over the chunks)."""
    tree = jax.tree_util
    chunk_matrices = self.chunk_matrices
    if self.chunks is None or chunk_matrices is None:
      return tree.tree_map(lambda t: t / self.batch_size, fn(self.matrices))
    add = lambda chunk: fn(chunk_matrices(*chunk))
    first = tree.tree_map(lambda a: a[0], self.chunks)
    zeros = tree.tree_map(
      lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(add, first)
    )
    total, _ = jax.lax.scan(
      lambda t, c: (tree.tree_map(jnp.add, t, add(c)), None), zeros, self.chunks
    )
    return tree.tree_map(lambda t: t / self.batch_size, total)

  def left(self, b: jax.Array) -> jax.Array:
    """`E_n[G_n b G_nᵀ]`, `(input_size, input_size)`; `L` for `b = I`."""
    if self.inputs is None or self.tangents is None:
      return self._mean(lambda m: jnp.einsum("nio,njo->ij", m @ b, m))
    dy = self.tangents
    weights = jnp.einsum("sbo,op,sbp->b", dy, b, dy)
    return (self.inputs * weights[:, None]).T @ self.inputs / self.batch_size

  def right(self, a: jax.Array) -> jax.Array:
    """`E_n[G_nᵀ a G_n]`, `(output_size, output_size)`; `R` for `a = I`."""
    if self.inputs is None or self.tangents is None:
      return self._mean(lambda m: jnp.einsum("nio,nip->op", m, a @ m))
    x, dy = self.inputs, self.tangents
    weights = jnp.einsum("bi,ij,bj->b", x, a, x)
    return jnp.einsum("sbo,b,sbp->op", dy, weights, dy) / self.batch_size

  def mean_squared_norm(self) -> jax.Array:
    """`E_n[||G_n||²_F]`, the trace of the exact block."""
    if self.inputs is None or self.tangents is None:
      return self._mean(lambda m: jnp.sum(jnp.square(m)))
    x_norms = jnp.sum(jnp.square(self.inputs), axis=1)
    return (
      jnp.vdot(x_norms, jnp.sum(jnp.square(self.tangents), axis=(0, 2)))
      / self.batch_size
    )

  def projected_squares(self, q_l: jax.Array, q_r: jax.Array) -> jax.Array:
    """`E_n[(q_lᵀ G_n q_r)²]` (elementwise), `(input_size, output_size)`:
    the diagonal of `C` in the basis `q_l ⊗ q_r`."""
    if self.inputs is None or self.tangents is None:
      return self._mean(lambda m: _squares(q_l, m, q_r))
    # A rank-one gradient projects to the outer product of the projections.
    px = jnp.square(self.inputs @ q_l)
    pg = jnp.sum(jnp.square(self.tangents @ q_r), axis=0)
    return px.T @ pg / self.batch_size

  def shampoo_moments(
    self, q_l: jax.Array, q_r: jax.Array
  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`(L, R, E_n[(q_lᵀ G_n q_r)²])`, `L = E[G Gᵀ]`, `R = E[Gᵀ G]`, with
    the gradients formed once: in one pass over the chunks when they are
    formed chunk by chunk."""
    if self.chunks is None:  # held, or never formed: one average at a time
      return (
        self.left(jnp.eye(q_r.shape[0], dtype=q_r.dtype)),
        self.right(jnp.eye(q_l.shape[0], dtype=q_l.dtype)),
        self.projected_squares(q_l, q_r),
      )
    return self._mean(
      lambda m: (
        jnp.einsum("nio,njo->ij", m, m),
        jnp.einsum("nio,nip->op", m, m),
        _squares(q_l, m, q_r),
      )
    )


def _squares(q_l, m, q_r):
  """`Σ_n (q_lᵀ m_n q_r)²` (elementwise) over the leading axis of `m`."""
  return jnp.sum(jnp.square(jnp.einsum("ia,nio,ob->nab", q_l, m, q_r)), axis=0)


class ExampleGradientsMixin(_KroneckerBlock):
  """Gives a dense or conv Kronecker block its batch's `ExampleGradients`.

  Dense tags without extra axes keep the rank-one form. Repeated dense and
  conv tags form every example's gradient: all at once when they have at
  most `get_max_parallel_elements()` elements (`S * B * input_size *
  output_size`), else in chunks of examples within that budget (zero-padded
  to whole chunks), formed again for every average.
  """

  if TYPE_CHECKING:
    # Given by the layer mixin a concrete block puts first (`layers`,
    # `embedding`): one `(rows, *shape)` array of gradients per parameter.
    def _per_example_gradients(self, data) -> tuple[jax.Array, ...]: ...

  def _inputs_identity(self) -> jax.Array:
    """The identity in the input factor's form, `(input_size, input_size)`."""
    return jnp.eye(self.input_size(), dtype=self.parameters_dtype)

  def _checked_gradients(self, estimation_data, batch_size, pmap_axis_name):
    """`(gradients, mean)` for an update: the batch's gradients, once its
    data is checked, and the average over the devices sharing the batch."""
    self._check_estimation_data(estimation_data, batch_size)
    gradients = self._example_gradients(estimation_data, batch_size)
    return gradients, device_mean(pmap_axis_name)

  def _example_gradients(
    self, data, batch_size
  ) -> ExampleGradients | EmbeddingGradients:
    # (`EmbeddingFactors` gives an embedding's, from its nonzero rows.)
    (x,), (dy,) = data["inputs"], data["outputs_tangent"]
    if isinstance(self, kronecker.DenseTwoKroneckerFactored) and x.ndim == 2:
      return ExampleGradients(
        batch_size, tangents=dy, inputs=self._rows((x,), (dy,))[0]
      )

    def matrices(xc, dyc):
      grads = self._per_example_gradients(
        dict(data, inputs=(xc,), outputs_tangent=(dyc,))
      )
      return jax.vmap(self._to_matrix)(grads)

    samples, batch = dy.shape[:2]
    per_example = samples * self.input_size() * self.output_size()
    chunk = max(1, min(batch, base.get_max_parallel_elements() // per_example))
    if chunk >= batch:
      return ExampleGradients(batch_size, matrices=matrices(x, dy))
    pad = -batch % chunk  # zero examples have zero gradients
    x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
    dy = jnp.pad(dy, [(0, 0), (0, pad)] + [(0, 0)] * (dy.ndim - 2))
    chunks = (
      x.reshape((-1, chunk) + x.shape[1:]),
      jnp.swapaxes(dy.reshape((samples, -1, chunk) + dy.shape[2:]), 0, 1),
    )
    return ExampleGradients(batch_size, chunks=chunks, chunk_matrices=matrices)


# --- embedding tags ----------------------------------------------------------

# Distributed Shampoo's default for `skip_preconditioning_dim_size_gt`: above
# it an axis gets a diagonal preconditioner (Anil et al., 2020).
MAX_FULL_VOCAB = 4096


@dataclasses.dataclass(frozen=True)
class EmbeddingGradients:
  """A batch's gradients of an embedding table by their nonzero rows, with
  `ExampleGradients`' averages.

  `tokens` `(B, T)` names the table row of each of an example's `T` slots
  and `rows` `(S, B, T, D)` holds each slot's gradient row, the sum of `dy`
  over the example's positions holding that token (`EmbeddingMixin`'s
  `_example_rows`; a slot left over is a zero row). With `diagonal`, the
  input-side averages keep only their diagonal, `(V,)`, and take input
  factors as such vectors; nothing of size `V x V` is then formed.
  """

  batch_size: base.Numeric
  tokens: jax.Array
  rows: jax.Array
  vocab_size: int
  diagonal: bool

  def left(self, b: jax.Array) -> jax.Array:
    """`E_n[G_n b G_nᵀ]`, `(V, V)`, or its diagonal `(V,)`: slot pairs of
    one example, scattered to their tokens."""
    projected = self.rows @ b
    if self.diagonal:
      weights = jnp.sum(projected * self.rows, axis=(0, 3))  # (B, T)
      return (
        jnp.zeros(self.vocab_size, weights.dtype).at[self.tokens].add(weights)
        / self.batch_size
      )
    pairs = jnp.einsum("snid,snjd->nij", projected, self.rows)
    tokens = self.tokens
    return (
      jnp.zeros((self.vocab_size,) * 2, pairs.dtype)
      .at[tokens[:, :, None], tokens[:, None, :]]
      .add(pairs)
      / self.batch_size
    )

  def right(self, a: jax.Array) -> jax.Array:
    """`E_n[G_nᵀ a G_n]`, `(D, D)`, for `a` `(V, V)` or a diagonal `(V,)`."""
    tokens, rows = self.tokens, self.rows
    if a.ndim == 1:
      return (
        jnp.einsum("snid,ni,snie->de", rows, a[tokens], rows) / self.batch_size
      )
    among = a[tokens[:, :, None], tokens[:, None, :]]  # (B, T, T)
    return jnp.einsum("snid,nij,snje->de", rows, among, rows) / self.batch_size

  def mean_squared_norm(self) -> jax.Array:
    """`E_n[||G_n||²_F]`, the trace of the exact block."""
    return jnp.sum(jnp.square(self.rows)) / self.batch_size

  def projected_squares(
    self, q_l: jax.Array | None, q_r: jax.Array
  ) -> jax.Array:
    """`E_n[(q_lᵀ G_n q_r)²]` (elementwise), `(V, D)`; `q_l` None for the
    identity.

    Rotated by a full `q_l`, an example's gradient is a dense `(V, D)`
    matrix: those are formed for at most `get_max_parallel_elements()`
    elements at a time, scanning over chunks of examples.
    """
    projected = self.rows @ q_r
    vocab, d = self.vocab_size, q_r.shape[1]
    if q_l is None:
      squares = jnp.sum(jnp.square(projected), axis=0)  # (B, T, D)
      return (
        jnp.zeros((vocab, d), squares.dtype).at[self.tokens].add(squares)
        / self.batch_size
      )
    samples, batch, slots = projected.shape[:3]
    chunk = max(
      1, min(batch, base.get_max_parallel_elements() // (samples * vocab * d))
    )
    pad = -batch % chunk  # zero rows add nothing
    tokens = jnp.pad(self.tokens, [(0, pad), (0, 0)]).reshape(-1, chunk, slots)
    projected = jnp.swapaxes(
      jnp.pad(projected, [(0, 0), (0, pad), (0, 0), (0, 0)]).reshape(
        samples, -1, chunk, slots, d
      ),
      0,
      1,
    )

    def add(total, part):
      chunk_tokens, chunk_rows = part
      rotated = jnp.einsum("ntv,sntd->snvd", q_l[chunk_tokens], chunk_rows)
      return total + jnp.sum(jnp.square(rotated), axis=(0, 1)), None

    total, _ = jax.lax.scan(
      add, jnp.zeros((vocab, d), projected.dtype), (tokens, projected)
    )
    return total / self.batch_size

  def shampoo_moments(
    self, q_l: jax.Array | None, q_r: jax.Array
  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`(L, R, E_n[(q_lᵀ G_n q_r)²])` from the rows held, `L` (or its
    diagonal) as `left`."""
    eye = jnp.eye(q_r.shape[0], dtype=q_r.dtype)
    identity = (
      jnp.ones(self.vocab_size, q_r.dtype)
      if self.diagonal
      else jnp.eye(self.vocab_size, dtype=q_r.dtype)
    )
    return (
      self.left(eye),
      self.right(identity),
      self.projected_squares(q_l, q_r),
    )


class EmbeddingFactors(
  ExampleGradientsMixin,
  embedding.EmbeddingMixin,
  kronecker.TwoKroneckerFactored,
):
  """An embedding tag in the Shampoo family's layout: the table `(V, D)` is
  the `(input_size, output_size)` matrix (no bias), an example's gradient
  `G_n = Σ_t e_(ids_t) dy_tᵀ` sums over its positions, and the statistics
  are Shampoo's `L = E[G Gᵀ]` (`inputs_factor`) and `R = E[Gᵀ G]`
  (`outputs_factor`) with `fixed_scale()` 1. Mixed in last, after a
  family's mixin, as `tnt.DenseTNT` is for dense tags.

  The input side is `V x V`. Like Distributed Shampoo, which falls back to
  a diagonal for an axis longer than `skip_preconditioning_dim_size_gt`
  (4096 by default), the block keeps it whole when `V <= max_full_vocab`
  and otherwise as its diagonal, a `(V,)` vector: the family's input
  factor is then restricted to diagonal matrices (its diagonal equations,
  e.g. `diag(L)` with `L`'s trace, or KL-Shampoo's diagonal optimum), and
  nothing of size `V x V` is stored or formed. `L[v, w]` couples two tokens
  of one example, so with one token per example (ids of shape `(B,)`) `L`
  is diagonal and both forms give the same block.

  Per-example gradients are never formed as `(V, D)` matrices (SOAP's
  rotated ones excepted, see `EmbeddingGradients.projected_squares`).
  """

  def __init__(
    self,
    layer_tag_eq,
    name: str | None = None,
    max_full_vocab: int = MAX_FULL_VOCAB,
    **kwargs,
  ):
    """Builds the block.

    Args:
      layer_tag_eq: the embedding tag's jaxpr equation.
      name: the block's name in messages.
      max_full_vocab: the largest vocabulary whose input factor is kept as
        a full matrix; a larger one keeps its diagonal.
      **kwargs: passed on to the block family's constructor.

    Raises:
      ValueError: for a negative or non-integer `max_full_vocab`, or a tag
        the block cannot take.
    """
    check_int_setting(name, "max_full_vocab", max_full_vocab, 0)
    self._max_full_vocab: int = int(max_full_vocab)
    super().__init__(layer_tag_eq, name, **kwargs)

  @property
  def max_full_vocab(self) -> int:
    """The largest vocabulary with a full input factor."""
    return self._max_full_vocab

  @property
  def full_inputs_factor(self) -> bool:
    """Whether the input factor is a `V x V` matrix (else its diagonal)."""
    return self.vocab_size <= self._max_full_vocab

  def input_size(self) -> int:
    return self.vocab_size

  def output_size(self) -> int:
    return self.parameters_shapes[0][1]

  def fixed_scale(self):
    return 1

  def _inputs_identity(self) -> jax.Array:
    """The identity as the input factor: `(V, V)`, or its diagonal `(V,)`."""
    dtype = self.parameters_dtype
    if self.full_inputs_factor:
      return jnp.eye(self.vocab_size, dtype=dtype)
    return jnp.ones(self.vocab_size, dtype)

  def _init(self, rng, exact_powers, approx_powers, cache_eigenvalues):
    del rng, exact_powers, approx_powers, cache_eigenvalues
    zeros = utils.WeightedMovingAverage.zeros
    d = self.output_size()
    dtype = self.parameters_dtype
    return kronecker.TwoKroneckerFactored.State(
      cache={},
      inputs_factor=zeros(self._inputs_identity().shape, dtype),
      outputs_factor=zeros((d, d), dtype),
    )

  def _example_gradients(self, data, batch_size) -> EmbeddingGradients:
    tokens, rows = self._example_rows(data)
    batch = data["inputs"][0].shape[0]
    return EmbeddingGradients(
      batch_size,
      tokens=tokens.reshape(batch, -1),
      rows=rows.reshape(rows.shape[0], batch, -1, rows.shape[-1]),
      vocab_size=self.vocab_size,
      diagonal=not self.full_inputs_factor,
    )

  def _batch_statistics(self, estimation_data, batch_size):
    grads = self._example_gradients(estimation_data, batch_size)
    eye = jnp.eye(self.output_size(), dtype=self.parameters_dtype)
    return grads.left(eye), grads.right(self._inputs_identity())
