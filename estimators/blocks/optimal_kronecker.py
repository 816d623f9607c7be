"""The Frobenius-nearest Kronecker product to a layer's exact block.

Van Loan and Pitsianis, "Approximation with Kronecker Products" (1993):
with `C = E_n[vec(G_n) vec(G_n)ᵀ]` over the per-(sample, example) gradients
`G_n` (`(input_size, output_size)`, row-major `vec`, as in
`estimators.blocks.shampoo`), `||C - A ⊗ B||_F = ||R(C) - vec(A) vec(B)ᵀ||_F`
for the rearrangement `R(C)[(i, j), (o, p)] = C[(i, o), (j, p)]`. The
nearest `σ A ⊗ B` is the top singular triple of `R(C)`, and

  `R(C) vec(B) = vec(E_n[G_n B G_nᵀ])`,  `R(C)ᵀ vec(A) = vec(E_n[G_nᵀ A G_n])`,

so power iteration needs only products with the `G_n`, never `C`:
`A ← E[G B Gᵀ] / ||·||`, `B ← E[Gᵀ A G] / ||·||`. From the identity, one
step in each factor gives Shampoo²'s `L = E[G Gᵀ]` and `R = E[Gᵀ G]`
(Morwani et al., ICLR 2025); the alternating iteration from `B = I` gives
`A ∝ L`, then `B ∝ E[Gᵀ L G]`. Iterates from PSD matrices stay PSD, so the
block is PSD and its powers use the eigendecompositions of `A` and `B`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp

from estimators.blocks import base, example_gradients, kronecker, shampoo, tnt


def _normalized(matrix):
  """`(matrix / ||matrix||_F, ||matrix||_F)`; a zero matrix stays zero."""
  norm = jnp.linalg.norm(matrix)
  tiny = jnp.finfo(matrix.dtype).tiny
  return matrix / jnp.where(norm >= tiny, norm, jnp.ones_like(norm)), norm


class OptimalKroneckerMixin(
  shampoo.KroneckerSpectrum, example_gradients.ExampleGradientsMixin
):
  """`σ A ⊗ B`, the Frobenius-nearest Kronecker product to the exact block.

  Mixed in before a TNT layer class (or `EmbeddingFactors`, whose diagonal
  input factor restricts `A` to diagonals: the left step keeps the
  diagonal of `E[G B Gᵀ]`, which gives the nearest `σ diag(a) ⊗ B`). Each
  update runs the power iteration
  (module docstring) on the batch's per-example gradients, started from
  Shampoo²'s factors (`B₀ ∝ R`, and `A₀ ∝ L` for zero iterations), until
  the unit-norm `A` moves by at most `tolerance` (Frobenius) in one step or
  after `max_iterations` steps. The default tolerance is the square root of
  the dtype's machine epsilon: the excess of the Frobenius error over its
  minimum is quadratic in `A`'s error, so it is then at round-off level
  (`iterations` and `change` in the state tell whether it got there; with
  a small gap between the top two singular values the remaining error can
  exceed the last change). `A`, `B` are kept with unit Frobenius norm and
  `σ = <A, R(C) B>`, the optimal scalar for them. One iteration costs
  two averages over the batch, `O(N input_size output_size (input_size +
  output_size))` with the gradients explicit (repeated dense and conv
  tags), `O(N (input_size² + output_size²))` for a dense tag.

  Several updates: the iteration fits the moving average of the previous
  estimate `σ A ⊗ B` (its weight `ema_old * w`) and this batch's exact
  block (weight `ema_new`), whose rearrangement is that batch's plus a
  rank-one term. With `ema_old = 0` this is the batch's nearest Kronecker
  product, exactly; over several batches it is a streaming approximation of
  the nearest Kronecker product to their mean, not that product itself.
  Shampoo²'s `L` and `R` are averaged as usual (`inputs_factor`,
  `outputs_factor`).

  The update works on every sample at once and overrides
  `update_curvature_matrix_estimate`, so the block cannot be `Stacked`.
  """

  estimation_data_has_sample_axis = True

  @jax.tree_util.register_dataclass
  @dataclasses.dataclass(frozen=True)
  class State(kronecker.TwoKroneckerFactored.State):
    """Optimal Kronecker state.

    Attributes:
      kronecker_inputs: `A`, `(input_size, input_size)`, unit Frobenius norm.
      kronecker_outputs: `B`, `(output_size, output_size)`, unit norm.
      kronecker_scale: `σ`, so that the block is `σ A ⊗ B`.
      kronecker_weight: the total weight of the batches in `σ A ⊗ B`.
      iterations: the power iteration's steps at the last update.
      change: how far (Frobenius) `A` moved in the last of them.
    """

    kronecker_inputs: jax.Array
    kronecker_outputs: jax.Array
    kronecker_scale: jax.Array
    kronecker_weight: jax.Array
    iterations: jax.Array
    change: jax.Array

  def __init__(
    self,
    layer_tag_eq,
    name: str | None = None,
    max_iterations: int = 100,
    tolerance: float | None = None,
    **kwargs,
  ):
    """Builds the block.

    Args:
      layer_tag_eq: the layer tag's jaxpr equation.
      name: the block's name in messages.
      max_iterations: the most power-iteration steps per update (0 keeps
        Shampoo²'s factors, optimally scaled).
      tolerance: stop once a step moves the unit-norm `A` by at most this
        (Frobenius norm); 0 runs `max_iterations` steps; None is the square
        root of the parameters' machine epsilon.
      **kwargs: passed on to the layer class (e.g. a conv's
        `max_elements_for_vmap`).

    Raises:
      ValueError: for a negative or non-integer `max_iterations`, a negative
        `tolerance`, or a layer the block cannot take.
    """
    example_gradients.check_int_setting(
      name, "max_iterations", max_iterations, 0
    )
    example_gradients.check_nonnegative_setting(
      name, "tolerance", tolerance, none_allowed=True
    )
    self._max_iterations: int = int(max_iterations)
    super().__init__(layer_tag_eq, name, **kwargs)
    self._tolerance = example_gradients.fit_tolerance(
      tolerance, self.parameters_dtype
    )

  @property
  def max_iterations(self) -> int:
    """The most power-iteration steps per update."""
    return self._max_iterations

  @property
  def tolerance(self) -> float:
    """The change in `A` (Frobenius, unit norm) that ends the iteration."""
    return self._tolerance

  def _init(self, rng, exact_powers, approx_powers, cache_eigenvalues):
    factors = super()._init(rng, exact_powers, approx_powers, cache_eigenvalues)
    dtype = self.parameters_dtype
    o = self.output_size()
    zero = jnp.zeros([], dtype)
    return OptimalKroneckerMixin.State(
      cache={},
      inputs_factor=factors.inputs_factor,
      outputs_factor=factors.outputs_factor,
      kronecker_inputs=jnp.zeros_like(self._inputs_identity()),
      kronecker_outputs=jnp.zeros((o, o), dtype),
      kronecker_scale=zero,
      kronecker_weight=zero,
      iterations=jnp.zeros([], jnp.int32),
      change=zero,
    )

  def update_curvature_matrix_estimate(
    self,
    # Narrower than the base's: a family takes its own State.
    state: OptimalKroneckerMixin.State,  # type: ignore[override]
    estimation_data: Mapping[str, Sequence[jax.Array]],
    ema_old: base.Numeric,
    ema_new: base.Numeric,
    batch_size: base.Numeric,
    pmap_axis_name: str | None = None,
    identity_weight: float | jax.Array | None = None,
  ) -> OptimalKroneckerMixin.State:
    """Folds `L` and `R` in, then refits `σ A ⊗ B` (see the class).

    Args:
      state: the block state.
      estimation_data: the layer's arrays, as for
        `CurvatureBlock.update_curvature_matrix_estimate`.
      ema_old: the factor on the old estimates.
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
    eye_in = self._inputs_identity()
    eye_out = jnp.eye(self.output_size(), dtype=dtype)
    old = state
    state = self._fold_statistics(
      state,
      (mean(grads.left(eye_out)), mean(grads.right(eye_in))),
      ema_old,
      ema_new,
    )
    # The target: (w_old σ A ⊗ B + ema_new C_batch) / (w_old + ema_new).
    share, new_share, total = example_gradients.moving_shares(
      old.kronecker_weight, ema_old, ema_new
    )
    old_term = share * old.kronecker_scale

    def left(b):
      return (
        new_share * mean(grads.left(b))
        + old_term * jnp.vdot(old.kronecker_outputs, b) * old.kronecker_inputs
      )

    def right(a):
      return (
        new_share * mean(grads.right(a))
        + old_term * jnp.vdot(old.kronecker_inputs, a) * old.kronecker_outputs
      )

    a0 = _normalized(state.inputs_factor.value)[0]
    b0 = _normalized(state.outputs_factor.value)[0]
    if self._max_iterations == 0:
      a, b, scale = a0, b0, jnp.vdot(a0, left(b0))
      steps, change = jnp.zeros([], jnp.int32), jnp.zeros([], dtype)
    else:

      def step(carry):
        a_prev, b, _, _, steps = carry
        a = _normalized(left(b))[0]
        b, scale = _normalized(right(a))
        return a, b, scale, jnp.linalg.norm(a - a_prev), steps + 1

      a, b, scale, change, steps = example_gradients.fit_loop(
        step,
        (a0, b0, jnp.zeros([], dtype)),
        self._max_iterations,
        self._tolerance,
        dtype,
      )
    return dataclasses.replace(
      state,
      kronecker_inputs=a,
      kronecker_outputs=b,
      kronecker_scale=scale,
      kronecker_weight=jnp.asarray(total, dtype),
      iterations=steps,
      change=change,
    )

  def _kronecker_multiply(self, state, v):
    return (
      state.kronecker_scale
      * example_gradients.factor_apply(state.kronecker_inputs, v)
      @ state.kronecker_outputs
    )

  def _kronecker_spectrum(self, state):
    q_a, q_b, values = example_gradients.kronecker_eigh(
      state.kronecker_inputs, state.kronecker_outputs
    )
    return q_a, q_b, state.kronecker_scale * values


class DenseOptimalKronecker(
  OptimalKroneckerMixin, shampoo.AssembledOuterSum, tnt.DenseTNT
):
  """The nearest Kronecker product to a dense or repeated dense tag's exact
  block (Van Loan and Pitsianis, 1993); see `OptimalKroneckerMixin`."""


class Conv2DOptimalKronecker(OptimalKroneckerMixin, tnt.Conv2DTNT):
  """The nearest Kronecker product to a 2-D convolution's exact block (Van
  Loan and Pitsianis, 1993), from per-example kernel gradients; see
  `OptimalKroneckerMixin`."""


class EmbeddingOptimalKronecker(
  OptimalKroneckerMixin, example_gradients.EmbeddingFactors
):
  """The nearest Kronecker product to an embedding tag's exact block (Van
  Loan and Pitsianis, 1993), from the table's sparse per-example
  gradients; above `max_full_vocab` tokens the nearest `σ diag(a) ⊗ B`
  (see `example_gradients.EmbeddingFactors`)."""
