"""Shampoo's family of Kronecker blocks: Shampoo², Shampoo and SOAP.

Every block here works on a layer's per-(sample, example) weight gradients
`G_n` in K-FAC's `(input_size, output_size)` layout (the bias, if any, as a
last row; conv kernels as `(kh, kw, c_in)` rows), whose exact curvature
block is `C = (1/B) Σ_n vec(G_n) vec(G_n)ᵀ` with row-major `vec`, so that
`(A ⊗ B) vec(V) = vec(A V B)`. All of them start from Shampoo's factors

  `L = (1/B) Σ_n G_n G_nᵀ`  (input side),  `R = (1/B) Σ_n G_nᵀ G_n`
  (output side),  `tr L = tr R = tr C = (1/B) Σ_n ||G_n||²`.

* Shampoo² (Morwani et al., "A New Perspective on Shampoo's
  Preconditioner", ICLR 2025): `L ⊗ R / tr L`. For a matrix parameter this
  is the two-factor TNT block, so it reuses `tnt`'s blocks.
* Shampoo (Gupta, Koren and Singer, ICML 2018): `c (L ⊗ R)^(1/2)` with
  `c = tr L / (tr L^(1/2) tr R^(1/2))`, so that its trace is `tr C`.
* SOAP (Vyas et al., "SOAP: Improving and Stabilizing Shampoo using Adam",
  2024), Shampoo with George et al.'s (NeurIPS 2018) eigenvalue
  correction: the eigenbasis `Q_L ⊗ Q_R` of `L ⊗ R` with the diagonal
  `D = (1/B) Σ_n (Q_Lᵀ G_n Q_R)²` (elementwise), the Frobenius-nearest
  matrix to `C` that is diagonal in that basis. It is EKFAC with Shampoo's
  factors in place of K-FAC's, and keeps EKFAC's cadence.

Each family has a block for dense and repeated dense tags, one for 2-D
convolutions and one for embedding lookups, whose gradients are sparse and
whose input factor is kept whole only up to a vocabulary size
(`example_gradients.EmbeddingFactors`). The Frobenius-nearest Kronecker
product to `C` (Van Loan and Pitsianis) is in
`estimators.blocks.optimal_kronecker`, the KL-nearest one (KL-Shampoo) in
`estimators.blocks.kl_shampoo`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from estimators import utils
from estimators.blocks import (
  base,
  eigenbasis,
  example_gradients,
  kronecker,
  tnt,
)

if TYPE_CHECKING:
  # A mixin's methods run on the block it is mixed into: the type checker
  # sees such a block (at run time the mixin is a plain class, placed
  # before the family's and the layer's classes among a block's bases).
  _KroneckerBlock = kronecker.TwoKroneckerFactored
  _DenseKroneckerBlock = kronecker.DenseTwoKroneckerFactored
  _ExampleGradientsBlock = example_gradients.ExampleGradientsMixin
else:
  _KroneckerBlock = _DenseKroneckerBlock = _ExampleGradientsBlock = object


class AssembledOuterSum(_DenseKroneckerBlock):
  """For dense blocks whose inverse does not split over the gradient's rows:
  `multiply_inverse_outer_sum` assembles the gradient first."""

  def outer_sum_is_cheaper(self) -> bool:
    """False: the inverse is not `A⁻¹ · V · B⁻¹` with cached factors."""
    return False

  def multiply_inverse_outer_sum(
    self,
    state: base.CurvatureBlock.State,
    inputs: Sequence[jax.Array],
    outputs_cotangent: Sequence[jax.Array],
  ) -> tuple[jax.Array, ...]:
    """The cached approximate inverse times the gradient `X̃ᵀ dY`.

    Args:
      state: the block state, with approximate power -1 cached.
      inputs: the layer's inputs `(x,)`.
      outputs_cotangent: the cotangent `(dy,)` of the layer's outputs.

    Returns:
      `multiply_inverse(state, X̃ᵀ dY, λ, exact_power=False,
      use_cached=True)`.

    Raises:
      ValueError: if the approximate inverse is not cached.
    """
    x, dy = self._rows(inputs, outputs_cotangent)
    return self.multiply_inverse(
      state,
      self._from_matrix(x.T @ dy),
      0.0,
      exact_power=False,
      use_cached=True,
    )


class KroneckerSpectrum(_KroneckerBlock):
  """Mixin for a block `(Q_L ⊗ Q_R) diag(vec s) (Q_L ⊗ Q_R)ᵀ`.

  A family gives `_kronecker_spectrum(state) -> (Q_L, Q_R, s)` (orthogonal
  `Q_L`, `Q_R` and the `(input_size, output_size)` eigenvalues `s`; `Q_L`
  None for the identity, an embedding's diagonal input factor), and
  may give a cheaper `_kronecker_multiply(state, V)` for the product. Any
  scale is inside `s`, so `state_dependent_scale` is 1. Exact and
  approximate powers are one computation (the damping adds to `s`).

  Cache: "inputs_eigenvectors" (none for the identity),
  "outputs_eigenvectors" and "spectrum", shared by all powers, and per
  power the identity weight it was cached with; "eigenvalues" (`s`,
  flattened) when asked.
  """

  def state_dependent_scale(self, state):
    """1: the scale is already part of the spectrum `s`."""
    del state
    return 1

  def _kronecker_spectrum(self, state):
    """`(q_l, q_r, s)`: the block is `(q_l ⊗ q_r) diag(vec s) (q_l ⊗ q_r)ᵀ`,
    `s` of shape `(input_size, output_size)`. The one hook a family gives."""
    raise NotImplementedError(
      f"{type(self).__name__} must give its Kronecker eigenbasis and "
      "spectrum (`_kronecker_spectrum`)."
    )

  def _kronecker_multiply(self, state, v):
    """The block times the `(input_size, output_size)` matrix `v`."""
    q_l, q_r, s = self._kronecker_spectrum(state)
    return example_gradients.eigen_multiply(q_l, q_r, s, v)

  def _multiply_matpower_unscaled(
    self, state, vector, identity_weight, power, exact_power, use_cached
  ):
    v = self._to_matrix(vector)
    if use_cached:
      cache = state.cache
      q_l, q_r, s = (
        cache.get("inputs_eigenvectors"),
        cache["outputs_eigenvectors"],
        cache["spectrum"],
      )
      identity_weight = cache[base.cache_key(power, exact=exact_power)]
    elif power == 1:
      return self._from_matrix(
        self._kronecker_multiply(state, v) + identity_weight * v
      )
    else:
      q_l, q_r, s = self._kronecker_spectrum(state)
    grid = s + identity_weight
    if power != 1:
      grid = jnp.power(grid, power)
    return self._from_matrix(
      example_gradients.eigen_multiply(q_l, q_r, grid, v)
    )

  def _eigenvalues_unscaled(self, state):
    return self._kronecker_spectrum(state)[2].reshape(-1)

  def _update_cache(
    self,
    state,
    identity_weight,
    exact_powers,
    approx_powers,
    eigenvalues,
    state_scale,
  ):
    del state_scale  # 1: the scale is part of the spectrum
    keys = base.power_cache_keys(exact_powers, approx_powers)
    if not (keys or eigenvalues):
      return {}
    q_l, q_r, s = self._kronecker_spectrum(state)
    updates = {}
    if keys:
      weight = jnp.asarray(identity_weight, self.parameters_dtype)
      if q_l is not None:
        updates["inputs_eigenvectors"] = q_l
      updates.update(outputs_eigenvectors=q_r, spectrum=s)
      updates.update({key: weight for key, _ in keys})
    if eigenvalues:
      updates["eigenvalues"] = s.reshape(-1)
    return updates


def _positive_or_one(value):
  """`value`, or 1 where it is below the dtype's `tiny` (a zero estimate,
  whose matrix is zero whatever it is multiplied by)."""
  return jnp.where(
    value >= jnp.finfo(value.dtype).tiny, value, jnp.ones_like(value)
  )


# --- Shampoo² -----------------------------------------------------------------


class DenseShampoo2(tnt.DenseTNT):
  """Shampoo² for dense and repeated dense tags: `L ⊗ R / tr L`.

  Morwani et al. (ICLR 2025). `L = E_n[G_n G_nᵀ]`, `R = E_n[G_nᵀ G_n]` over
  the per-example gradients (the bias as `G_n`'s last row) are the state's
  `inputs_factor` and `outputs_factor`; for a matrix parameter this is
  `DenseTNT`, whose machinery (powers, cache, outer sums) it keeps. It is
  also one step from the identity of the power iteration towards the
  nearest Kronecker product (`L = E[G I Gᵀ]`, `R = E[Gᵀ I G]`).
  """


class Conv2DShampoo2(tnt.Conv2DTNT):
  """Shampoo² for 2-D convolutions (Morwani et al., ICLR 2025): `L ⊗ R /
  tr L` from per-example kernel gradients in the `(kh, kw, c_in)` row
  layout (bias last); `Conv2DTNT`, under the name of the family."""


class Shampoo2Spectrum(KroneckerSpectrum):
  """`L ⊗ R / tr L` through the eigendecompositions of `L` (a matrix or a
  diagonal) and `R`: exact and approximate powers alike, where TNT's blocks
  split the damping between the factors for approximate ones."""

  def _kronecker_multiply(self, state, v):
    left = state.inputs_factor.value
    return (
      example_gradients.factor_apply(left, v)
      @ state.outputs_factor.value
      / _positive_or_one(example_gradients.factor_trace(left))
    )

  def _kronecker_spectrum(self, state):
    left = state.inputs_factor.value
    l_values, q_l = example_gradients.factor_eigh(left)
    r_values, q_r = utils.safe_psd_eigh(state.outputs_factor.value)
    return (
      q_l,
      q_r,
      jnp.outer(l_values, r_values)
      / _positive_or_one(example_gradients.factor_trace(left)),
    )


class EmbeddingShampoo2(Shampoo2Spectrum, example_gradients.EmbeddingFactors):
  """Shampoo² for an embedding tag (Morwani et al., ICLR 2025): `L ⊗ R /
  tr L` over the table's per-example gradients, `L` whole up to
  `max_full_vocab` tokens, else its diagonal, which makes it
  `EmbeddingTNT`'s block (see `example_gradients.EmbeddingFactors`)."""


# --- Shampoo ------------------------------------------------------------------


def _root_of_spectrum(values):
  """`sqrt(values)` of a PSD factor's eigenvalues, with those under
  round-off (`n eps` times the largest) taken as zero: the root would turn
  them into spurious eigenvalues of order `sqrt(eps)`."""
  cutoff = len(values) * jnp.finfo(values.dtype).eps * jnp.max(values)
  return jnp.sqrt(jnp.where(values > cutoff, values, 0))


class ShampooSpectrum(KroneckerSpectrum):
  """`c (L ⊗ R)^(1/2)` with `c = tr L / (tr L^(1/2) tr R^(1/2))` (Gupta et
  al., 2018), trace-matched to the exact block; its eigenvectors are those
  of `L` and `R`, its eigenvalues `c sqrt(λ_L) sqrt(λ_R)`."""

  def _kronecker_spectrum(self, state):
    l_values, q_l = example_gradients.factor_eigh(state.inputs_factor.value)
    r_values, q_r = utils.safe_psd_eigh(state.outputs_factor.value)
    l_roots, r_roots = _root_of_spectrum(l_values), _root_of_spectrum(r_values)
    scale = jnp.sum(l_values) / _positive_or_one(
      jnp.sum(l_roots) * jnp.sum(r_roots)
    )
    return q_l, q_r, scale * jnp.outer(l_roots, r_roots)


class DenseShampoo(ShampooSpectrum, AssembledOuterSum, tnt.DenseTNT):
  """Shampoo for dense and repeated dense tags: `c (L ⊗ R)^(1/2)` (Gupta et
  al., ICML 2018), trace-matched; `L` and `R` as in `DenseShampoo2`.

  Powers go through the eigendecompositions of `L` and `R`: `(c (L ⊗
  R)^(1/2) + λ I)^p = (Q_L ⊗ Q_R) diag((c sqrt(λ_L ⊗ λ_R) + λ)^p) (Q_L ⊗
  Q_R)ᵀ`. (Shampoo's own update, `L^(-1/4) G R^(-1/4)`, is the power -1/2.)
  """


class Conv2DShampoo(ShampooSpectrum, tnt.Conv2DTNT):
  """Shampoo for 2-D convolutions (Gupta et al., ICML 2018): `c (L ⊗
  R)^(1/2)` from per-example kernel gradients, as `DenseShampoo`."""


class EmbeddingShampoo(ShampooSpectrum, example_gradients.EmbeddingFactors):
  """Shampoo for an embedding tag (Gupta et al., ICML 2018): `c (L ⊗
  R)^(1/2)`, trace-matched, `L` whole or its diagonal as in
  `EmbeddingShampoo2`."""


# --- SOAP ---------------------------------------------------------------------


class SOAPScalings(_ExampleGradientsBlock):
  """EKFAC's scalings refitted to per-example gradients in the eigenbasis of
  Shampoo's `L` and `R` (Vyas et al., 2024; George et al., 2018).

  Mixed in before `eigenbasis.EKFAC` and a TNT layer class: the factors are
  `L` and `R` (TNT's statistics), the scalings `D = E_n[(Q_Lᵀ G_n Q_R)²]`,
  the block `(Q_L ⊗ Q_R) diag(vec D) (Q_L ⊗ Q_R)ᵀ`, with scale 1.
  """

  if TYPE_CHECKING:
    # Given by `eigenbasis.EKFAC`, after it.
    def _factor_bases(self, state): ...

  estimation_data_has_sample_axis = True

  def state_dependent_scale(self, state):
    """1: the fitted scalings `D` carry the whole scale of the block."""
    del state
    return 1

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
    """Folds this batch into `L`, `R` and the scalings with EKFAC's cadence
    (`eigenbasis.EKFAC.update_curvature_matrix_estimate`), forming the
    per-example gradients once for all three. Formed chunk by chunk, they
    are formed again only for a block's first update, whose scalings are in
    the basis of the factors it has just folded in.

    Args:
      state: the block state.
      estimation_data: the layer's arrays, as for
        `CurvatureBlock.update_curvature_matrix_estimate`.
      ema_old: the factor on the old estimates.
      ema_new: the weight of this batch's estimates.
      batch_size: the number of examples the statistics average over.
      pmap_axis_name: when not None, the statistics are averaged over this
        axis before they are folded in.

    Returns:
      The state with the new estimate; the cache is left as it is.

    Raises:
      ValueError: if the data lacks arrays or has shapes that do not fit.
    """
    grads, mean = self._checked_gradients(
      estimation_data, batch_size, pmap_axis_name
    )
    fresh = state.inputs_factor.weight == 0
    left, right, squares = mean(
      grads.shampoo_moments(state.inputs_basis, state.outputs_basis)
    )
    state = self._fold_statistics(state, (left, right), ema_old, ema_new)
    # Only the taken branches run: later updates cost no eigensolve and no
    # second pass.
    u_a, u_g = jax.lax.cond(
      fresh,
      self._factor_bases,
      lambda s: (s.inputs_basis, s.outputs_basis),
      state,
    )
    squares = jax.lax.cond(
      fresh, lambda: mean(grads.projected_squares(u_a, u_g)), lambda: squares
    )
    return dataclasses.replace(
      state,
      inputs_basis=u_a,
      outputs_basis=u_g,
      scalings=eigenbasis.fold_scalings(
        state.scalings, squares, ema_old, ema_new
      ),
    )

  def _batch_scalings(self, estimation_data, batch_size, u_a, u_g):
    # EKFAC's hook for a batch's scalings in a basis; the update above
    # takes them from the moments instead.
    return self._example_gradients(
      estimation_data, batch_size
    ).projected_squares(u_a, u_g)

  def _projected_rows(self, estimation_data, inputs_basis, outputs_basis):
    raise NotImplementedError(  # EKFAC's hook; `_batch_scalings` replaces it
      f"{type(self).__name__} fits its scalings to per-example gradients."
    )


class DenseSOAP(
  SOAPScalings,
  example_gradients.ExampleGradientsMixin,
  AssembledOuterSum,
  eigenbasis.EKFAC,
  tnt.DenseTNT,
):
  """SOAP's curvature for dense and repeated dense tags (Vyas et al., 2024):
  `(Q_L ⊗ Q_R) diag(vec D) (Q_L ⊗ Q_R)ᵀ`, `Q_L`, `Q_R` the eigenvectors of
  Shampoo's `L` and `R` and `D = E_n[(Q_Lᵀ G_n Q_R)²]` (George et al.'s
  correction), the nearest matrix to the exact block that is diagonal in
  that basis.

  Cadence as `eigenbasis.EKFAC`: `D` at every update in the state's basis,
  the basis at every `update_cache` (the first update sets it too).
  """


class Conv2DSOAP(
  SOAPScalings,
  example_gradients.ExampleGradientsMixin,
  eigenbasis.EKFAC,
  tnt.Conv2DTNT,
):
  """SOAP's curvature for 2-D convolutions (Vyas et al., 2024): as
  `DenseSOAP`, from per-example kernel gradients."""


class EmbeddingSOAP(
  SOAPScalings, eigenbasis.EKFAC, example_gradients.EmbeddingFactors
):
  """SOAP's curvature for an embedding tag (Vyas et al., 2024): as
  `DenseSOAP` over the table's per-example gradients, with `L` whole up to
  `max_full_vocab` tokens. Above, `L` is its diagonal, whose eigenbasis is
  the identity: the block is `(I ⊗ Q_R) diag(vec D) (I ⊗ Q_R)ᵀ` with
  `D = E_n[(G_n Q_R)²]` `(V, D)` (the state's `inputs_basis` is None), as
  `EmbeddingEKFAC` with Shampoo's `R` for K-FAC's output factor."""

  def _init(self, rng, exact_powers, approx_powers, cache_eigenvalues):
    # Not EKFAC's `_init`: its identity basis would be V x V.
    factors = example_gradients.EmbeddingFactors._init(
      self, rng, exact_powers, approx_powers, cache_eigenvalues
    )
    dtype = self.parameters_dtype
    d = self.output_size()
    return eigenbasis.EKFAC.State(
      cache={},
      inputs_factor=factors.inputs_factor,
      outputs_factor=factors.outputs_factor,
      inputs_basis=(
        jnp.eye(self.vocab_size, dtype=dtype)
        if self.full_inputs_factor
        else None
      ),
      outputs_basis=jnp.eye(d, dtype=dtype),
      scalings=utils.WeightedMovingAverage.zeros((self.vocab_size, d), dtype),
    )

  def _factor_bases(self, state):
    return (
      example_gradients.factor_eigh(state.inputs_factor.value)[1],
      utils.safe_psd_eigh(state.outputs_factor.value)[1],
    )

  def _multiply_matpower_unscaled(
    self, state, vector, identity_weight, power, exact_power, use_cached
  ):
    grid = eigenbasis.damped_scalings(
      self, state, identity_weight, power, exact_power, use_cached
    )
    return self._from_matrix(
      example_gradients.eigen_multiply(
        state.inputs_basis, state.outputs_basis, grid, self._to_matrix(vector)
      )
    )
