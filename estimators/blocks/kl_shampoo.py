"""KL-Shampoo: the Kronecker product nearest a layer's exact block in KL.

Lin, Lowe, Dangel, Eschenhagen, Xu and Grosse, "Understanding and Improving
Shampoo and SOAP via Kullback-Leibler Minimization" (arXiv 2509.03378,
2025). With `C = E_n[vec(G_n) vec(G_n)ᵀ]` over the per-(sample, example)
gradients `G_n` of shape `(d_a, d_b) = (input_size, output_size)` (row-major
`vec`, as in `estimators.blocks.shampoo`), KL-Shampoo estimates `C` by the
`S = S_a ⊗ S_b` that minimises the KL divergence from the zero-mean Gaussian
with covariance `C + κ I` to the one with covariance `S`,

  `KL(S) = ½ [tr(S⁻¹ (C + κ I)) + log det S] + const`.

Its gradient in either factor vanishes where

  `d_b S_a = E[G S_b⁻¹ Gᵀ] + κ tr(S_b⁻¹) I`,
  `d_a S_b = E[Gᵀ S_a⁻¹ G] + κ tr(S_a⁻¹) I`,

the paper's fixed point (its Claim 2, stated for `κ = 0`). Each equation is
the exact minimiser of `KL` in one factor with the other held (Shampoo's
one-sided rule, the paper's Claim 1, is the first with `S_b = I`), so
alternating them is block-coordinate descent: `KL` never increases, and the
iterates approach the maximum-likelihood Kronecker covariance of a matrix
normal ("flip-flop"), which is the minimum of `KL` over all Kronecker
products since that problem is geodesically convex (Wiesel, 2012).

The curvature is `S` itself: KL-Shampoo's step `S_a^(-1/2) G S_b^(-1/2)` is
`S^(-1/2) vec(G)`, the power -1/2 of this block, as Shampoo's `L^(-1/4) G
R^(-1/4)` is that of `(L ⊗ R)^(1/2)`. Its scale is the KL fit's (at the
fixed point `tr(S⁻¹ (C + κ I)) = d_a d_b`), not a matched trace.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp

from estimators.blocks import base, example_gradients, shampoo, tnt

_trace = example_gradients.factor_trace


def _unit(factor):
  """`factor / ||factor||_F` (a zero factor stays zero)."""
  norm = jnp.linalg.norm(factor)
  return factor / jnp.where(norm >= jnp.finfo(factor.dtype).tiny, norm, 1)


class KLShampooMixin(
  shampoo.KroneckerSpectrum, example_gradients.ExampleGradientsMixin
):
  """`S_a ⊗ S_b`, the KL-nearest Kronecker product (see the module).

  Mixed in before a TNT layer class (or `EmbeddingFactors`, whose diagonal
  input factor restricts `S_a` to diagonals: the first equation's diagonal
  then gives the optimum over them). An
  update alternates the fixed-point equations on this batch's per-example
  gradients, left factor first, until the unit-Frobenius-norm `S_a` moves by
  at most `tolerance` in one step or after `max_iterations` steps. It starts
  from the previous factors, or, for an empty block, from the one-sided
  optimum `d_a S_b = E[Gᵀ G] + κ d_a I`. The state keeps
  `tr S_a / d_a = tr S_b / d_b` (the product is unchanged by moving a
  scalar between the factors).

  Damping: `κ = damping * tr(C) / (d_a d_b)`, a fraction of the batch
  block's mean eigenvalue, the same in every dtype. A batch's `C` has rank
  at most its number of examples; without damping the fixed point exists
  only with enough of them (about `d_a / d_b + d_b / d_a`), and it nears
  singular factors as their number falls towards that, while every step
  inverts the factors. With `κ > 0` every eigenvalue of `S` at the fixed
  point is at least `κ / min(d_a, d_b)` (either equation, as `tr(S_b⁻¹) >=
  1 / λ_min(S_b)`); the default, a thousandth, keeps the factors
  well-conditioned in float32 and the iteration short.

  Several updates: like `OptimalKroneckerMixin`, an update fits the mean
  of the previous estimate `S_old` (its weight `ema_old * w`) and this
  batch's damped block (weight `ema_new`), `T = ρ S_old + (1 - ρ)(C + κ I)`.
  `E_T[G M Gᵀ] = ρ tr(S_b,old M) S_a,old + (1 - ρ)(E[G M Gᵀ] + κ tr(M) I)`,
  so one step from the previous factors is the paper's moving average
  `S_a ← ρ S_a + (1 - ρ)/d_b (E[G S_b⁻¹ Gᵀ] + κ tr(S_b⁻¹) I)` with `β = ρ`
  (the paper updates `S_b` from the old `S_a`, here from the new one, which
  keeps each half-step a descent step). With `ema_old = 0` the result is
  the batch's own KL-nearest product; over several batches it is a
  streaming approximation of the one for their mean.

  One step costs two inversions and two averages over the batch (see
  `OptimalKroneckerMixin` for their cost). The update works on every sample
  at once and overrides `update_curvature_matrix_estimate`, so the block
  cannot be `Stacked`. Exact and approximate powers are one computation,
  through the factors' eigendecompositions.
  """

  estimation_data_has_sample_axis = True

  @jax.tree_util.register_dataclass
  @dataclasses.dataclass(frozen=True)
  class State(base.CurvatureBlock.State):
    """KL-Shampoo state.

    Attributes:
      kl_inputs: `S_a`, `(input_size, input_size)` (or its diagonal).
      kl_outputs: `S_b`, `(output_size, output_size)`.
      weight: the total weight of the batches in `S_a ⊗ S_b`.
      iterations: the fixed-point steps of the last update.
      change: how far (Frobenius) the unit-norm `S_a` moved in the last.
    """

    kl_inputs: jax.Array
    kl_outputs: jax.Array
    weight: jax.Array
    iterations: jax.Array
    change: jax.Array

  def __init__(
    self,
    layer_tag_eq,
    name: str | None = None,
    max_iterations: int = 100,
    tolerance: float | None = None,
    damping: float = 1e-3,
    **kwargs,
  ):
    """Builds the block.

    Args:
      layer_tag_eq: the layer tag's jaxpr equation.
      name: the block's name in messages.
      max_iterations: the most fixed-point steps per update (at least 1;
        1 from the previous factors is the paper's moving-average step).
      tolerance: stop once a step moves the unit-Frobenius-norm `S_a` by at
        most this; 0 runs `max_iterations` steps; None is the square root of
        the parameters' machine epsilon.
      damping: `κ` as a fraction of the batch block's mean eigenvalue; 0 is
        the paper's undamped fixed point (with enough examples).
      **kwargs: passed on to the layer class.

    Raises:
      ValueError: for an invalid setting or a layer the block cannot take.
    """
    example_gradients.check_int_setting(
      name, "max_iterations", max_iterations, 1
    )
    example_gradients.check_nonnegative_setting(
      name, "tolerance", tolerance, none_allowed=True
    )
    example_gradients.check_nonnegative_setting(name, "damping", damping)
    self._max_iterations: int = int(max_iterations)
    super().__init__(layer_tag_eq, name, **kwargs)
    self._tolerance = example_gradients.fit_tolerance(
      tolerance, self.parameters_dtype
    )
    self._damping = float(damping)

  @property
  def max_iterations(self) -> int:
    """The most fixed-point steps per update."""
    return self._max_iterations

  @property
  def tolerance(self) -> float:
    """The change in the unit-norm `S_a` that ends the iteration."""
    return self._tolerance

  @property
  def damping(self) -> float:
    """`κ` over the batch block's mean eigenvalue."""
    return self._damping

  def _init(self, rng, exact_powers, approx_powers, cache_eigenvalues):
    del rng, exact_powers, approx_powers, cache_eigenvalues
    dtype = self.parameters_dtype
    o = self.output_size()
    zero = jnp.zeros([], dtype)
    return KLShampooMixin.State(
      cache={},
      kl_inputs=jnp.zeros_like(self._inputs_identity()),
      kl_outputs=jnp.zeros((o, o), dtype),
      weight=zero,
      iterations=jnp.zeros([], jnp.int32),
      change=zero,
    )

  def update_curvature_matrix_estimate(
    self,
    # Narrower than the base's: a family takes its own State.
    state: KLShampooMixin.State,  # type: ignore[override]
    estimation_data: Mapping[str, Sequence[jax.Array]],
    ema_old: base.Numeric,
    ema_new: base.Numeric,
    batch_size: base.Numeric,
    pmap_axis_name: str | None = None,
    identity_weight: float | jax.Array | None = None,
  ) -> KLShampooMixin.State:
    """Refits `S_a ⊗ S_b` to the previous estimate and this batch (see the
    class).

    Args:
      state: the block state.
      estimation_data: the layer's arrays, as for
        `CurvatureBlock.update_curvature_matrix_estimate`.
      ema_old: the factor on the old estimate.
      ema_new: the weight of this batch's.
      batch_size: the number of examples the averages are over.
      pmap_axis_name: when not None, every average over the batch is also
        averaged over this axis.

    Returns:
      The state with the new estimate; the cache is left as it is.

    Raises:
      ValueError: if the data lacks arrays or has shapes that do not fit.
    """
    grads, mean = self._checked_gradients(
      estimation_data, batch_size, pmap_axis_name
    )
    dtype = self.parameters_dtype
    eye_a = self._inputs_identity()
    eye_b = jnp.eye(self.output_size(), dtype=dtype)
    d_a, d_b = self.input_size(), self.output_size()
    size = d_a * d_b
    old_a, old_b = state.kl_inputs, state.kl_outputs
    share, new_share, total = example_gradients.moving_shares(
      state.weight, ema_old, ema_new
    )
    trace_c = mean(grads.mean_squared_norm())
    kappa = self._damping * trace_c / size
    # The target's mean eigenvalue; the iteration runs on the target over
    # it (the fixed point scales with the target), the identity for a zero
    # target, whose estimate is then set to zero.
    trace = (
      share * _trace(old_a) * jnp.trace(old_b)
      + new_share * (1 + self._damping) * trace_c
    )
    scale = trace / size
    nonzero = scale >= jnp.finfo(dtype).tiny
    scale = jnp.where(nonzero, scale, jnp.ones_like(scale))

    def left(m):  # E_T[G m Gᵀ] / scale
      batch = mean(grads.left(m)) + kappa * jnp.trace(m) * eye_a
      value = new_share * batch + share * jnp.vdot(old_b, m) * old_a
      return jnp.where(nonzero, value / scale, jnp.trace(m) * eye_a)

    def right(m):  # E_T[Gᵀ m G] / scale
      batch = mean(grads.right(m)) + kappa * _trace(m) * eye_b
      value = new_share * batch + share * jnp.vdot(old_a, m) * old_b
      return jnp.where(nonzero, value / scale, _trace(m) * eye_b)

    b0 = jax.lax.cond(share > 0, lambda: old_b, lambda: right(eye_a) / d_a)

    def step(carry):
      a_prev, b, _, steps = carry
      a = left(example_gradients.factor_inverse(b)) / d_b
      b = right(example_gradients.factor_inverse(a)) / d_a
      return a, b, jnp.linalg.norm(_unit(a) - _unit(a_prev)), steps + 1

    a, b, change, steps = example_gradients.fit_loop(
      step,
      (jnp.zeros_like(eye_a), b0),
      self._max_iterations,
      self._tolerance,
      dtype,
    )
    # Back to the target's units, balanced: tr S_a / d_a = tr S_b / d_b.
    mean_a = _trace(a) / d_a
    mean_b = jnp.trace(b) / d_b
    balance = jnp.sqrt(scale * mean_b / jnp.where(mean_a > 0, mean_a, 1))
    kept = jnp.where(nonzero, 1, 0).astype(dtype)
    return dataclasses.replace(
      state,
      kl_inputs=kept * balance * a,
      kl_outputs=kept * scale * b / jnp.where(balance > 0, balance, 1),
      weight=jnp.asarray(total, dtype),
      iterations=steps,
      change=change,
    )

  def _kronecker_multiply(self, state, v):
    return example_gradients.factor_apply(state.kl_inputs, v) @ state.kl_outputs

  def _kronecker_spectrum(self, state):
    return example_gradients.kronecker_eigh(state.kl_inputs, state.kl_outputs)


class DenseKLShampoo(KLShampooMixin, shampoo.AssembledOuterSum, tnt.DenseTNT):
  """KL-Shampoo for dense and repeated dense tags (Lin et al., 2025): the
  KL-nearest `S_a ⊗ S_b` to the per-example curvature, the bias as the
  gradient's last row; see `KLShampooMixin`."""


class Conv2DKLShampoo(KLShampooMixin, tnt.Conv2DTNT):
  """KL-Shampoo for 2-D convolutions (Lin et al., 2025), from per-example
  kernel gradients in the `(kh, kw, c_in)` row layout (bias last); see
  `KLShampooMixin`."""


class EmbeddingKLShampoo(KLShampooMixin, example_gradients.EmbeddingFactors):
  """KL-Shampoo for an embedding tag (Lin et al., 2025), from the table's
  sparse per-example gradients; above `max_full_vocab` tokens the
  KL-nearest `diag(s_a) ⊗ S_b` (see `example_gradients.EmbeddingFactors`)."""
