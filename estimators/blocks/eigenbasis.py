"""EKFAC blocks: K-FAC's eigenbasis with scalings refitted to the gradients.

George, Laurent, Bouthillier, Ballas and Vincent, "Fast Approximate Natural
Gradient Descent in a Kronecker-factored Eigenbasis" (NeurIPS 2018).

K-FAC approximates a block by `A ⊗ G = U diag(λ_A ⊗ λ_G) Uᵀ` with
`U = U_A ⊗ U_G`. EKFAC keeps `U` and replaces the eigenvalues by the second
moments `s` of the per-row gradients expressed in that basis, which is the
best (Frobenius) diagonal approximation of the per-row curvature in `U`.
A row's gradient `x̃ dyᵀ` projects to `(U_Aᵀ x̃) (U_Gᵀ dy)ᵀ`, so its squares
are an outer product of elementwise squares and `s` never needs per-example
gradients.

A convolution has several rows (output locations) per example. George et
al. fit `s` to the per-example gradients `Σ_l x̃_l dy_lᵀ`, which makes
`U diag(s) Uᵀ` the Frobenius-nearest matrix of that form to the layer's
curvature; `Conv2DEKFAC` does so by default. Fitting to each location's
gradient alone (`scalings="per_location"`) drops the cross-location terms, as
K-FAC's conv factors do.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping, Sequence
from typing import cast

import jax
import jax.numpy as jnp

from estimators import utils
from estimators.blocks import base, kronecker


def restarted_scalings(
  scalings: utils.WeightedMovingAverage,
) -> utils.WeightedMovingAverage:
  """The scalings' average restarted for a new basis: its value kept as the
  starting point, its weight zeroed."""
  return utils.WeightedMovingAverage(
    weight=jnp.zeros_like(scalings.weight), value=scalings.value
  )


def damped_scalings(
  block, state, identity_weight, power, exact_power: bool, use_cached: bool
) -> jax.Array:
  """`(scalings + damping) ** power`, the eigenvalues of the damped power in
  the block's eigenbasis (exact and approximate powers alike: the damping
  adds to the scalings); with `use_cached`, the damping and the state
  dependent scale of the cache entry."""
  s = state.scalings.value
  if use_cached:
    # Cached weights already include the state dependent scale's share.
    identity_weight = state.cache[base.cache_key(power, exact=exact_power)]
    s = block.state_dependent_scale(state) * s
  grid = s + identity_weight
  return grid if power == 1 else jnp.power(grid, power)


def fold_scalings(
  old: utils.WeightedMovingAverage, scalings: jax.Array, ema_old, ema_new
) -> utils.WeightedMovingAverage:
  """`old` with a batch's `scalings` folded in; a refresh leaves `old` with
  weight 0, and then its value, from the old basis, is dropped."""
  ema_old = jnp.where(old.weight == 0, 0, ema_old)
  return old.updated(scalings, ema_old, ema_new)


class EKFAC(kronecker.TwoKroneckerFactored):
  """`U diag(s) Uᵀ` with `U = U_A ⊗ U_G` from K-FAC's factors (see module).

  Rows and `fixed_scale()` are those of the matching K-FAC block, and `A`,
  `G` are folded exactly as K-FAC folds them. The block is
  `fixed_scale() * U diag(s) Uᵀ`, `s` an `(input_size, output_size)` matrix.

  Cadence, as in the paper: the scalings are folded in at every curvature
  update, in the basis held by the state; the basis is recomputed from the
  factors at every `update_cache` (the inverse refresh), which also restarts
  the scalings' average (its value is kept until the next update replaces
  it), so scalings measured in different bases are never mixed. The first
  update of a block that has seen no data also sets the basis, so one update
  gives a complete estimate.

  Exact and approximate powers are the same thing here (the damping is added
  to the eigenvalues). A cached power holds only the identity weight given
  to `update_cache`; cached products use the state's basis and current
  scalings with that weight. The cached "eigenvalues" are the scalings at
  the refresh.

  Subclasses provide `_projected_rows`.
  """

  estimation_data_has_sample_axis = True  # its update takes all samples
  statistics_in_cached_basis = True  # the scalings, in the factors' basis

  @jax.tree_util.register_dataclass
  @dataclasses.dataclass(frozen=True)
  class State(kronecker.TwoKroneckerFactored.State):
    """EKFAC block state.

    Attributes:
      inputs_basis: the eigenvectors of `A` (columns) that define the basis,
        `(input_size, input_size)`; None for the identity (`EmbeddingSOAP`
        above its `max_full_vocab`).
      outputs_basis: the same for `G`, `(output_size, output_size)`.
      scalings: a WeightedMovingAverage of `s`, `(input_size, output_size)`.
    """

    inputs_basis: jax.Array | None
    outputs_basis: jax.Array
    scalings: utils.WeightedMovingAverage

  @abc.abstractmethod
  def _projected_rows(self, estimation_data, inputs_basis, outputs_basis):
    """This batch's rows in the basis.

    Args:
      estimation_data: as for `update_curvature_matrix_estimate`.
      inputs_basis: `U_A`.
      outputs_basis: `U_G`.

    Returns:
      `(x̃ U_A, dy U_G, rows_per_example)`: shapes `(N, input_size)` and
      `(S, N, output_size)`, N the number of rows (those of K-FAC's factors).
    """

  def outer_sum_is_cheaper(self) -> bool:
    """False: EKFAC's inverse does not split into `A⁻¹ · V · G⁻¹`."""
    return False

  def _init(self, rng, exact_powers, approx_powers, cache_eigenvalues):
    factors = super()._init(rng, exact_powers, approx_powers, cache_eigenvalues)
    dtype = self.parameters_dtype
    i, o = self.input_size(), self.output_size()
    # Before any data the factors are zero, and the identity is a basis of
    # eigenvectors; the first update replaces it.
    return EKFAC.State(
      cache={},
      inputs_factor=factors.inputs_factor,
      outputs_factor=factors.outputs_factor,
      inputs_basis=jnp.eye(i, dtype=dtype),
      outputs_basis=jnp.eye(o, dtype=dtype),
      scalings=utils.WeightedMovingAverage.zeros((i, o), dtype),
    )

  def _factor_bases(self, state):
    """Eigenvectors of the current factors, `(U_A, U_G)`."""
    _, u_a = utils.safe_psd_eigh(state.inputs_factor.value)
    _, u_g = utils.safe_psd_eigh(state.outputs_factor.value)
    return u_a, u_g

  def _batch_scalings(self, estimation_data, batch_size, u_a, u_g):
    """`(1/(B R)) Σ_{s,r} (x̃_r U_A)² ⊗ (dy_sr U_G)²`, R rows per example."""
    px, pg, rows_per_example = self._projected_rows(estimation_data, u_a, u_g)
    # Σ_s Σ_r outer(a_r, b_sr) = Σ_r outer(a_r, Σ_s b_sr): one product.
    summed = jnp.sum(jnp.square(pg), axis=0)
    return jnp.square(px).T @ summed / (batch_size * rows_per_example)

  def update_curvature_matrix_estimate(
    self,
    # Narrower than the base's: a family takes its own State.
    state: EKFAC.State,  # type: ignore[override]
    estimation_data: Mapping[str, Sequence[jax.Array]],
    ema_old: base.Numeric,
    ema_new: base.Numeric,
    batch_size: base.Numeric,
    pmap_axis_name: str | None = None,
    identity_weight: float | jax.Array | None = None,
  ) -> EKFAC.State:
    """Folds this batch into the factors and the scalings.

    The factors are folded as K-FAC folds them. If the block had seen no
    data, the basis is then set from the new factors. The batch's scalings,
    in the state's basis, are folded into `scalings`; after an
    `update_cache` (weight 0) they replace the kept value whatever
    `ema_old` is.

    Args:
      state: the block state.
      estimation_data: the layer's arrays, as for
        `CurvatureBlock.update_curvature_matrix_estimate`.
      ema_old: the factor on the old estimates.
      ema_new: the weight of this batch's estimates.
      batch_size: the number of examples the statistics average over.
      pmap_axis_name: when not None, the factors and the scalings are
        averaged over this axis before they are folded in.

    Returns:
      The state with the new estimate; the cache is left as it is.

    Raises:
      ValueError: if the data lacks arrays or has shapes that do not fit.
    """
    fresh = state.inputs_factor.weight == 0
    # The base returns the state it is given, with the factors folded in.
    state = cast(
      EKFAC.State,
      super().update_curvature_matrix_estimate(
        state, estimation_data, ema_old, ema_new, batch_size, pmap_axis_name
      ),
    )
    # Only the taken branch runs, so later updates cost no eigensolve.
    u_a, u_g = jax.lax.cond(
      fresh,
      self._factor_bases,
      lambda s: (s.inputs_basis, s.outputs_basis),
      state,
    )
    scalings = self._batch_scalings(estimation_data, batch_size, u_a, u_g)
    if pmap_axis_name is not None:
      scalings = jax.lax.pmean(scalings, pmap_axis_name)
    return dataclasses.replace(
      state,
      inputs_basis=u_a,
      outputs_basis=u_g,
      scalings=fold_scalings(state.scalings, scalings, ema_old, ema_new),
    )

  def update_cache(
    self,
    # Narrower than the base's: a family takes its own State.
    state: EKFAC.State,  # type: ignore[override]
    identity_weight: base.Numeric,
    exact_powers: base.ScalarOrSequence,
    approx_powers: base.ScalarOrSequence,
    eigenvalues: bool,
  ) -> EKFAC.State:
    """Recomputes the basis, restarts the scalings, refreshes the entries.

    The basis becomes the eigenvectors of the current factors, even when no
    entry is requested. The scalings keep their value with weight 0, so the
    next update replaces them with scalings measured in the new basis. The
    requested entries are then refreshed as in `CurvatureBlock.update_cache`.

    Args:
      state: the block state.
      identity_weight: the damping `λ` later cached products use.
      exact_powers: None, a power or powers among `init`'s
        `exact_powers_to_cache`.
      approx_powers: the same among `approx_powers_to_cache`.
      eigenvalues: whether to cache the (undamped) eigenvalues, the current
        scalings times the state dependent scale.

    Returns:
      The state with the new basis and entries.

    Raises:
      ValueError: as `CurvatureBlock.update_cache`.
    """
    u_a, u_g = self._factor_bases(state)
    state = dataclasses.replace(
      state,
      inputs_basis=u_a,
      outputs_basis=u_g,
      scalings=restarted_scalings(state.scalings),
    )
    return cast(
      EKFAC.State,
      super().update_cache(
        state, identity_weight, exact_powers, approx_powers, eigenvalues
      ),
    )

  def _multiply_matpower_unscaled(
    self, state, vector, identity_weight, power, exact_power, use_cached
  ):
    grid = damped_scalings(
      self, state, identity_weight, power, exact_power, use_cached
    )
    result = utils.kronecker_eigen_multiply(
      state.inputs_basis, state.outputs_basis, grid, self._to_matrix(vector)
    )
    return self._from_matrix(result)

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
    dtype = self.parameters_dtype
    updates = {
      key: jnp.asarray(identity_weight, dtype)
      for key, _ in base.power_cache_keys(exact_powers, approx_powers)
    }
    if eigenvalues:
      updates["eigenvalues"] = state_scale * state.scalings.value.reshape(-1)
    return updates


# EKFAC's state comes first in the order: the repeats count is not kept.
class DenseEKFAC(EKFAC, kronecker.RepeatedDenseTwoKroneckerFactored):  # type: ignore[misc]
  """EKFAC for dense and repeated dense tags.

  Rows are those of `RepeatedDenseTwoKroneckerFactored`: one per example
  and position, `fixed_scale()` the number of positions (1 for a dense
  tag). Its state is EKFAC's, so it does not mask repeats.
  """

  _CAN_MASK_REPEATS = False

  def _projected_rows(self, estimation_data, inputs_basis, outputs_basis):
    dy = estimation_data["outputs_tangent"][0]
    x, dy_rows = self._rows(estimation_data["inputs"], (dy,))
    # `_rows` stacks the samples' rows one sample after the other.
    dy_rows = dy_rows.reshape(dy.shape[0], x.shape[0], -1)
    return x @ inputs_basis, dy_rows @ outputs_basis, self.num_repeats

  def multiply_inverse_outer_sum(
    self,
    state: kronecker.TwoKroneckerFactored.State,
    inputs: Sequence[jax.Array],
    outputs_cotangent: Sequence[jax.Array],
  ) -> tuple[jax.Array, ...]:
    """The cached inverse times the gradient `X̃ᵀ dY`, assembled first.

    Unlike K-FAC's, EKFAC's inverse does not factor over the rows, so this
    is only `multiply_inverse` on the assembled gradient (and
    `outer_sum_is_cheaper()` is False).

    Args:
      state: the block state, with approximate power -1 cached.
      inputs: the layer's inputs `(x,)`.
      outputs_cotangent: the cotangent `(dy,)` of the layer's outputs.

    Returns:
      `multiply_inverse(state, grad, λ, exact_power=False, use_cached=True)`
      for that gradient.

    Raises:
      ValueError: if the approximate inverse is not cached.
    """
    x, dy = self._rows(inputs, outputs_cotangent)
    gradient = self._from_matrix(x.T @ dy)
    return self.multiply_inverse(
      state, gradient, 0.0, exact_power=False, use_cached=True
    )


class Conv2DEKFAC(EKFAC, kronecker.Conv2DTwoKroneckerFactored):
  """EKFAC for 2-D convolutions.

  Factors, basis and `fixed_scale()` (the number of locations) are those of
  `Conv2DTwoKroneckerFactored`, with its layer restrictions. The scalings
  are fitted either to each example's gradient (`"per_example"`, George et
  al. 2018, the default) or to each output location's share of it
  (`"per_location"`, one row per example and location, like K-FAC's conv
  factors). Either way the block is `num_locations * U diag(s) Uᵀ`.
  """

  SCALINGS = ("per_example", "per_location")

  def __init__(
    self, layer_tag_eq, name: str | None = None, scalings: str = "per_example"
  ):
    """Builds the block.

    Args:
      layer_tag_eq: the conv2d tag's jaxpr equation.
      name: the block's name in messages.
      scalings: `"per_example"` fits `s` to the second moments of the
        per-example gradients in the eigenbasis, the Frobenius-optimal
        diagonal there; `"per_location"` to those of the per-location
        gradients, ignoring how locations of one example correlate.

    Raises:
      ValueError: for another `scalings`, or a layer the block cannot take.
    """
    if scalings not in self.SCALINGS:
      raise ValueError(
        f"Conv2DEKFAC(scalings={scalings!r}) for block {name!r}: choose "
        f"one of {', '.join(map(repr, self.SCALINGS))}."
      )
    self._scalings = scalings
    super().__init__(layer_tag_eq, name)

  @property
  def scalings(self) -> str:
    """How the scalings are fitted: "per_example" or "per_location"."""
    return self._scalings

  def _batch_scalings(self, estimation_data, batch_size, u_a, u_g):
    """Per example: `(1/(B L)) Σ_{s,n} (U_Aᵀ G_sn U_G)²`, where
    `G_sn = Σ_l x̃_nl dy_snlᵀ` and L the locations (the `1/L` is undone by
    `fixed_scale()`, as for the per-location rows)."""
    if self._scalings == "per_location":
      return super()._batch_scalings(estimation_data, batch_size, u_a, u_g)
    px, pg, locations = self._projected_rows(estimation_data, u_a, u_g)
    # Rows are example-major, so each example's locations are contiguous.
    px = px.reshape(-1, locations, px.shape[-1])
    pg = pg.reshape(pg.shape[0], -1, locations, pg.shape[-1])
    # Projecting is linear, so the projected per-example gradient is the sum
    # over locations of the projected rows' outer products: one (i, o)
    # matrix per sample and example, never a dense (P, P) one.
    projected = jnp.einsum("nli,snlo->snio", px, pg)
    return jnp.sum(jnp.square(projected), axis=(0, 1)) / (
      batch_size * locations
    )

  def _projected_rows(self, estimation_data, inputs_basis, outputs_basis):
    (x,), (dy,) = estimation_data["inputs"], estimation_data["outputs_tangent"]
    k = self.input_size() - int(self.has_bias)
    # Every patch times U_A is one convolution whose kernel holds U_A's
    # columns, so the patches are never formed; the layer's own settings
    # keep the locations those of the tangents.
    axes = self._kernel_axes()
    spatial = tuple(self.parameters_shapes[0][a] for a in axes[:2])
    kernel = inputs_basis[:k].reshape(spatial + (self.num_inputs_channels, -1))
    kernel = jnp.transpose(kernel, tuple(axes.index(a) for a in range(4)))
    channel = self.outputs_channel_index
    px = jnp.moveaxis(self._conv(x, kernel), channel, -1)
    px = px.reshape(-1, px.shape[-1])
    if self.has_bias:  # the appended 1 of every patch
      px = px + inputs_basis[k]
    dy = jnp.moveaxis(dy, 1 + channel, -1)
    dy = dy.reshape(dy.shape[0], -1, dy.shape[-1])
    return px, dy @ outputs_basis, self.num_locations
