"""Blocks for embedding lookups, `y = one_hot(ids) @ W` with `W: (V, D)`.

An embedding is a dense layer on one-hot inputs, so every block family has
a form for it; what they share is that nothing of size `V x V` is stored.
Each family keeps its usual statistics, written for one-hot rows:

- K-FAC (`EmbeddingKFAC`): the input factor `A = diag(token frequencies)`
  is diagonal, kept as a `(V,)` vector; the output factor `G` is dense.
- EKFAC (`EmbeddingEKFAC`): the eigenbasis of a diagonal `A` is the
  identity, so the basis is `I ⊗ U_G` and the scalings a `(V, D)` array.
- TNT (`EmbeddingTNT`): the per-example input factor is diagonal only when
  no example holds two tokens; its diagonal is kept (the trace, hence the
  TNT normalisation, is unchanged).
- Diagonal (`EmbeddingDiagonal`): the exact per-example diagonal, `(V, D)`.
- Full (`EmbeddingFull`): the dense `VD x VD` block of the family, for
  small vocabularies only.

A lookup over positions (`ids: (B, T)`) is a dense layer shared over them:
K-FAC and EKFAC count each position as a row (K-FAC-expand, Eschenhagen et
al., NeurIPS 2023) with `fixed_scale()` the number of positions; the
others use per-example gradients, summed over the example's positions.
(K-FAC-reduce would average the one-hot inputs over positions, which makes
the input factor dense, so `EmbeddingKFAC` stands in for it too.)

Per-example gradients are sparse: example n's gradient has one non-zero row
per distinct token it holds, the sum of `dy` over that token's positions.
`_example_rows` forms only those rows, `B * T` of them at most.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from estimators import tags, utils
from estimators.blocks import base, diagonal, eigenbasis, full, kronecker

if TYPE_CHECKING:
  # As `layers`' mixins: the type checker sees the block it is mixed into.
  _Block = base.CurvatureBlock
else:
  _Block = object


class EmbeddingMixin(_Block):
  """Embedding tags: inputs `(ids,)` of any shape `(B, ...)`, parameters
  `(table,)` of shape `(V, D)`, outputs `ids.shape + (D,)`."""

  _TAG_PRIMITIVES = (tags.embedding,)
  _REQUIRED_DATA = ("inputs", "outputs_tangent")

  def _check_layer(self):
    (w,), (ids,) = self.parameters_shapes, self.inputs_shapes
    if len(w) != 2 or not ids:
      raise ValueError(
        f"Block {self.name!r}: an embedding tag needs ids "
        f"(batch, ...) and a (vocab, d_out) table, got ids "
        f"{ids} and table {w}."
      )

  @property
  def vocab_size(self) -> int:
    """`V`, the number of rows of the table."""
    return self.parameters_shapes[0][0]

  @property
  def num_repeats(self) -> int:
    """Positions per example (1 for ids of shape `(batch,)`)."""
    return utils.product(self.inputs_shapes[0][1:])

  def _example_rows(self, data):
    """The non-zero rows of every (sample, example) gradient of the table.

    Returns:
      `(tokens, rows)`: `rows` `(S, B * T, D)` holds, for each distinct
      token of each example, the sum of that example's `dy` over the
      positions holding it, and `tokens` `(B * T,)` says which row of the
      table it belongs to. Rows left over (an example with repeated
      tokens) are zero, with token 0.
    """
    (ids,), (dy,) = data["inputs"], data["outputs_tangent"]
    batch, samples, d = ids.shape[0], dy.shape[0], dy.shape[-1]
    ids = jnp.asarray(ids).reshape(batch, -1).astype(jnp.int32)
    per_example = ids.shape[1]
    # Sorting each example's ids puts equal tokens next to each other; a
    # new segment starts wherever the token changes.
    order = jnp.argsort(ids, axis=1)
    sorted_ids = jnp.take_along_axis(ids, order, axis=1)
    starts = jnp.concatenate(
      [jnp.ones((batch, 1), bool), sorted_ids[:, 1:] != sorted_ids[:, :-1]],
      axis=1,
    )
    segments = (
      jnp.cumsum(starts, axis=1) - 1 + per_example * jnp.arange(batch)[:, None]
    ).reshape(-1)
    dy = dy.reshape(samples, batch, per_example, d)
    dy = jnp.take_along_axis(dy, order[None, :, :, None], axis=2)
    rows = jax.ops.segment_sum(
      jnp.moveaxis(dy.reshape(samples, -1, d), 0, 1),
      segments,
      num_segments=segments.size,
      indices_are_sorted=True,
    )
    tokens = (
      jnp.zeros(segments.size, jnp.int32)
      .at[segments]
      .set(sorted_ids.reshape(-1))
    )
    return tokens, jnp.moveaxis(rows, 1, 0)

  def _per_example_gradients(self, data):
    """Dense per-(sample, example) gradients `(S * B, V, D)`."""
    (ids,), (dy,) = data["inputs"], data["outputs_tangent"]
    batch, samples = ids.shape[0], dy.shape[0]
    one_hot = jax.nn.one_hot(ids, self.vocab_size, dtype=dy.dtype)
    grads = jnp.einsum(
      "brv,sbro->sbvo",
      one_hot.reshape(batch, -1, self.vocab_size),
      dy.reshape(samples, batch, -1, dy.shape[-1]),
    )
    return (grads.reshape((-1,) + self.parameters_shapes[0]),)


class EmbeddingKFAC(EmbeddingMixin, base.CurvatureBlock):
  """K-FAC `diag(a) ⊗ G` for an embedding tag; the table `W` is the
  `(V, D)` matrix of the Kronecker convention `(A ⊗ G) vec(W) = A W G`.

  Its statistics equal those of `RepeatedDenseTwoKroneckerFactored` on the
  one-hot inputs (one row per example and position). Exact powers need
  only `G`'s eigendecomposition (`diag(a)` is its own); approximate powers
  damp both factors with the pi-adjusted rule.
  """

  @jax.tree_util.register_dataclass
  @dataclasses.dataclass(frozen=True)
  class State(base.CurvatureBlock.State):
    """Attributes: `inputs_factor`, the moving average of `a`, `(V,)`;
    `outputs_factor`, that of `G`, `(D, D)`."""

    inputs_factor: utils.WeightedMovingAverage
    outputs_factor: utils.WeightedMovingAverage

  def fixed_scale(self):
    return self.num_repeats

  def _init(self, rng, exact_powers, approx_powers, cache_eigenvalues):
    del rng, exact_powers, approx_powers, cache_eigenvalues
    zeros = utils.WeightedMovingAverage.zeros
    v, d = self.parameters_shapes[0]
    dtype = self.parameters_dtype
    return EmbeddingKFAC.State(
      cache={},
      inputs_factor=zeros([v], dtype),
      outputs_factor=zeros([d, d], dtype),
    )

  def _batch_statistics(self, estimation_data, batch_size):
    (ids,), (dy,) = (
      estimation_data["inputs"],
      estimation_data["outputs_tangent"],
    )
    rows = batch_size * self.num_repeats
    ids = jnp.asarray(ids).reshape(-1).astype(jnp.int32)
    counts = jnp.zeros(self.vocab_size, dy.dtype).at[ids].add(1)
    dy = dy.reshape(-1, dy.shape[-1])
    return counts / rows, dy.T @ dy / rows

  def _fold_statistics(self, state, stats, ema_old, ema_new):
    a, g = stats
    return dataclasses.replace(
      state,
      inputs_factor=state.inputs_factor.updated(a, ema_old, ema_new),
      outputs_factor=state.outputs_factor.updated(g, ema_old, ema_new),
    )

  def _multiply_matpower_unscaled(
    self, state, vector, identity_weight, power, exact_power, use_cached
  ):
    (w,) = vector
    a, g = state.inputs_factor.value, state.outputs_factor.value
    if exact_power and use_cached:
      vals, vecs = (
        state.cache["outputs_factor_eigenvalues"],
        state.cache["outputs_factor_eigenvectors"],
      )
      a = state.cache["inputs_factor_eigenvalues"]
      damping = state.cache[base.cache_key(power, exact=True)]
      return (_eigen_multiply(a, vals, vecs, damping, power, w),)
    if exact_power and power == 1:
      return (a[:, None] * (w @ g) + identity_weight * w,)
    if exact_power:
      vals, vecs = utils.safe_psd_eigh(g)
      return (_eigen_multiply(a, vals, vecs, identity_weight, power, w),)
    entry = (
      state.cache[base.cache_key(power, exact=False)]
      if use_cached
      else _approx_power_entry(a, g, identity_weight, power)
    )
    return (entry["inputs_factor"][:, None] * (w @ entry["outputs_factor"]),)

  def _eigenvalues_unscaled(self, state):
    return utils.kronecker_product_eigenvalues(
      state.inputs_factor.value, utils.psd_eigvalsh(state.outputs_factor.value)
    )

  def _update_cache(
    self,
    state,
    identity_weight,
    exact_powers,
    approx_powers,
    eigenvalues,
    state_scale,
  ):
    a = state.inputs_factor.value
    g = state_scale * state.outputs_factor.value
    updates = {}
    if exact_powers or eigenvalues:
      vals, vecs = utils.safe_psd_eigh(g)
      if eigenvalues:
        updates["eigenvalues"] = utils.kronecker_product_eigenvalues(a, vals)
      if exact_powers:
        updates.update(
          inputs_factor_eigenvalues=a,
          outputs_factor_eigenvalues=vals,
          outputs_factor_eigenvectors=vecs,
        )
    updates.update(
      kronecker.power_entries(
        exact_powers,
        approx_powers,
        identity_weight,
        a.dtype,
        lambda p: _approx_power_entry(a, g, identity_weight, p),
      )
    )
    return updates


def _eigen_multiply(a, g_vals, g_vecs, damping, power, w):
  """`(diag(a) ⊗ G + damping I)^power` applied to `w`, from `G`'s
  eigendecomposition."""
  grid = jnp.power(jnp.outer(a, g_vals) + damping, power)
  return ((w @ g_vecs) * grid) @ g_vecs.T


def _approx_power_entry(a, g, identity_weight, power):
  """The pi-damped factors raised to `power`: `a` as a vector, `G` dense."""
  a_norm, g_norm = jnp.mean(a), jnp.trace(g) / g.shape[0]
  ok = (a_norm > 0) & (g_norm > 0)
  pi = jnp.sqrt(jnp.where(ok, a_norm, 1) / jnp.where(ok, g_norm, 1))
  root = jnp.sqrt(jnp.asarray(identity_weight, a.dtype))
  g_damped = g + root / pi * jnp.eye(g.shape[0], dtype=g.dtype)
  return {
    "inputs_factor": jnp.power(a + pi * root, power),
    "outputs_factor": utils.psd_matrix_power(g_damped, power),
  }


class EmbeddingEKFAC(EmbeddingKFAC):
  """EKFAC (George et al., NeurIPS 2018) for an embedding tag.

  K-FAC's factors are `EmbeddingKFAC`'s. The eigenbasis of the diagonal
  `diag(a)` is the identity, so the block is
  `num_repeats * (I ⊗ U_G) diag(s) (I ⊗ U_G)ᵀ` with `U_G` the eigenvectors
  of `G` and `s` a `(V, D)` array: as George et al. fit it, the second
  moments of the per-example gradients in that basis,
  `s = (1/(B T)) Σ_{s,n} (G_sn U_G)²` (the `1/T` undone by
  `fixed_scale()`, as `Conv2DEKFAC` does for locations). That is the
  Frobenius-nearest matrix of this form to the per-example curvature;
  where no example repeats a token it equals `DenseEKFAC` on the one-hot
  inputs, which fits `s` to each position's gradient.

  Cadence and cache are `EKFAC`'s: the scalings are folded in at each
  update in the state's basis, the basis is recomputed from `G` at each
  `update_cache`, which restarts the scalings' average, and the first
  update of an empty block sets the basis.
  """

  estimation_data_has_sample_axis = True  # its update takes all samples
  statistics_in_cached_basis = True  # the scalings, in G's eigenbasis

  @jax.tree_util.register_dataclass
  @dataclasses.dataclass(frozen=True)
  class State(EmbeddingKFAC.State):
    """Attributes: `outputs_basis`, the eigenvectors of `G` (columns),
    `(D, D)`; `scalings`, a WeightedMovingAverage of `s`, `(V, D)`."""

    outputs_basis: jax.Array
    scalings: utils.WeightedMovingAverage

  def _init(self, rng, exact_powers, approx_powers, cache_eigenvalues):
    factors = super()._init(rng, exact_powers, approx_powers, cache_eigenvalues)
    v, d = self.parameters_shapes[0]
    dtype = self.parameters_dtype
    # Before any data `G` is zero and the identity is a basis of its
    # eigenvectors; the first update replaces it.
    return EmbeddingEKFAC.State(
      cache={},
      inputs_factor=factors.inputs_factor,
      outputs_factor=factors.outputs_factor,
      outputs_basis=jnp.eye(d, dtype=dtype),
      scalings=utils.WeightedMovingAverage.zeros((v, d), dtype),
    )

  def _outputs_basis(self, state):
    return utils.safe_psd_eigh(state.outputs_factor.value)[1]

  def _batch_scalings(self, estimation_data, batch_size, basis):
    tokens, rows = self._example_rows(estimation_data)
    squares = jnp.sum(jnp.square(rows @ basis), axis=0)
    return jnp.zeros(self.parameters_shapes[0], squares.dtype).at[tokens].add(
      squares
    ) / (batch_size * self.num_repeats)

  def update_curvature_matrix_estimate(
    self,
    state,
    estimation_data,
    ema_old,
    ema_new,
    batch_size,
    pmap_axis_name=None,
    identity_weight=None,
  ):
    """Folds this batch into the factors and the scalings, as
    `EKFAC.update_curvature_matrix_estimate` does."""
    fresh = state.inputs_factor.weight == 0
    state = super().update_curvature_matrix_estimate(
      state, estimation_data, ema_old, ema_new, batch_size, pmap_axis_name
    )
    # Only the taken branch runs, so later updates cost no eigensolve.
    basis = jax.lax.cond(
      fresh, self._outputs_basis, lambda s: s.outputs_basis, state
    )
    scalings = self._batch_scalings(estimation_data, batch_size, basis)
    if pmap_axis_name is not None:
      scalings = jax.lax.pmean(scalings, pmap_axis_name)
    return dataclasses.replace(
      state,
      outputs_basis=basis,
      scalings=eigenbasis.fold_scalings(
        state.scalings, scalings, ema_old, ema_new
      ),
    )

  def update_cache(
    self, state, identity_weight, exact_powers, approx_powers, eigenvalues
  ):
    """Recomputes the basis, restarts the scalings and refreshes the
    entries, as `EKFAC.update_cache` does."""
    state = dataclasses.replace(
      state,
      outputs_basis=self._outputs_basis(state),
      scalings=eigenbasis.restarted_scalings(state.scalings),
    )
    return super().update_cache(
      state, identity_weight, exact_powers, approx_powers, eigenvalues
    )

  def _multiply_matpower_unscaled(
    self, state, vector, identity_weight, power, exact_power, use_cached
  ):
    grid = eigenbasis.damped_scalings(
      self, state, identity_weight, power, exact_power, use_cached
    )
    u = state.outputs_basis
    return (((vector[0] @ u) * grid) @ u.T,)

  def _eigenvalues_unscaled(self, state):
    return state.scalings.value.reshape(-1)

  def _update_cache(
    self,
    state,
    identity_weight,
    exact_powers,
    approx_powers,
    eigenvalues,
    state_scale,
  ):
    updates = {
      key: jnp.asarray(identity_weight, self.parameters_dtype)
      for key, _ in base.power_cache_keys(exact_powers, approx_powers)
    }
    if eigenvalues:
      updates["eigenvalues"] = state_scale * state.scalings.value.reshape(-1)
    return updates


class EmbeddingTNT(EmbeddingKFAC):
  """TNT (Ren & Goldfarb, NeurIPS 2021) for an embedding tag.

  With `G_n` example n's `(V, D)` gradient (summed over its positions and
  per sample), TNT's factors are `A = (1/B) Σ G_n G_nᵀ` and
  `G = (1/B) Σ G_nᵀ G_n`, and the block `A ⊗ G / tr(A)`. `A[v, w]` couples
  two tokens of one example, so `A` is diagonal only when no example holds
  two tokens (ids of shape `(batch,)`); the block keeps `diag(A)` as a
  `(V,)` vector, which has the same trace, so the block keeps TNT's
  property that its trace is that of the per-example curvature. Products,
  powers and cache are `EmbeddingKFAC`'s with `state_dependent_scale`
  `1 / tr(A)` and `fixed_scale` 1.
  """

  def fixed_scale(self):
    return 1

  def state_dependent_scale(self, state):
    """`1 / tr(A)` (1 for a zero estimate, whose matrix is zero anyway)."""
    a = state.inputs_factor.value
    trace = jnp.sum(a)
    return 1 / jnp.where(
      trace >= jnp.finfo(a.dtype).tiny, trace, jnp.ones_like(trace)
    )

  def _batch_statistics(self, estimation_data, batch_size):
    tokens, rows = self._example_rows(estimation_data)
    norms = jnp.sum(jnp.square(rows), axis=(0, 2))
    a = jnp.zeros(self.vocab_size, rows.dtype).at[tokens].add(norms)
    rows = rows.reshape(-1, rows.shape[-1])
    return a / batch_size, rows.T @ rows / batch_size


class EmbeddingDiagonal(EmbeddingMixin, diagonal.Diagonal):
  """The exact per-example diagonal of an embedding's curvature, `(V, D)`:
  `(1/B) Σ_{s,n} G_sn ⊙ G_sn` from the sparse per-example gradients."""

  def _batch_statistics(self, estimation_data, batch_size):
    tokens, rows = self._example_rows(estimation_data)
    squares = jnp.sum(jnp.square(rows), axis=0)
    return (
      jnp.zeros(self.parameters_shapes[0], squares.dtype)
      .at[tokens]
      .add(squares)
      / batch_size,
    )


class EmbeddingFull(EmbeddingMixin, full.Full):
  """The exact per-example curvature of an embedding as a dense
  `(V D) x (V D)` matrix, from dense per-example gradients; for small
  vocabularies (the harness refuses a state over `max_state_gib`)."""
