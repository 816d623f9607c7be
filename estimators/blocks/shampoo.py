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

The Frobenius-nearest Kronecker product to `C` (Van Loan and Pitsianis) is
in `estimators.blocks.optimal_kronecker`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from estimators import utils
from estimators.blocks import base
from estimators.blocks import eigenbasis
from estimators.blocks import layers
from estimators.blocks import tnt


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
    sums over its argument's leading axis."""
    if self.chunks is None:
      return fn(self.matrices) / self.batch_size
    add = lambda chunk: fn(self.chunk_matrices(*chunk))
    first = jax.tree_util.tree_map(lambda a: a[0], self.chunks)
    shape = jax.eval_shape(add, first)
    zeros = jnp.zeros(shape.shape, shape.dtype)
    total, _ = jax.lax.scan(lambda t, c: (t + add(c), None), zeros,
                            self.chunks)
    return total / self.batch_size

  def left(self, b: jax.Array) -> jax.Array:
    """`E_n[G_n b G_nᵀ]`, `(input_size, input_size)`; `L` for `b = I`."""
    if self.inputs is None:
      return self._mean(lambda m: jnp.einsum("nio,njo->ij", m @ b, m))
    dy = self.tangents
    weights = jnp.einsum("sbo,op,sbp->b", dy, b, dy)
    return (self.inputs * weights[:, None]).T @ self.inputs / self.batch_size

  def right(self, a: jax.Array) -> jax.Array:
    """`E_n[G_nᵀ a G_n]`, `(output_size, output_size)`; `R` for `a = I`."""
    if self.inputs is None:
      return self._mean(lambda m: jnp.einsum("nio,nip->op", m, a @ m))
    x, dy = self.inputs, self.tangents
    weights = jnp.einsum("bi,ij,bj->b", x, a, x)
    return jnp.einsum("sbo,b,sbp->op", dy, weights, dy) / self.batch_size

  def mean_squared_norm(self) -> jax.Array:
    """`E_n[||G_n||²_F]`, the trace of the exact block."""
    if self.inputs is None:
      return self._mean(lambda m: jnp.sum(jnp.square(m)))
    x_norms = jnp.sum(jnp.square(self.inputs), axis=1)
    return jnp.vdot(x_norms, jnp.sum(jnp.square(self.tangents), axis=(0, 2))
                    ) / self.batch_size

  def projected_squares(self, q_l: jax.Array, q_r: jax.Array) -> jax.Array:
    """`E_n[(q_lᵀ G_n q_r)²]` (elementwise), `(input_size, output_size)`:
    the diagonal of `C` in the basis `q_l ⊗ q_r`."""
    if self.inputs is None:
      return self._mean(lambda m: jnp.sum(jnp.square(
          jnp.einsum("ia,nio,ob->nab", q_l, m, q_r)), axis=0))
    # A rank-one gradient projects to the outer product of the projections.
    px = jnp.square(self.inputs @ q_l)
    pg = jnp.sum(jnp.square(self.tangents @ q_r), axis=0)
    return px.T @ pg / self.batch_size


class ExampleGradientsMixin:
  """Gives a dense or conv Kronecker block its batch's `ExampleGradients`.

  Dense tags without extra axes keep the rank-one form. Repeated dense and
  conv tags form every example's gradient: all at once when they have at
  most `get_max_parallel_elements()` elements (`S * B * input_size *
  output_size`), else in chunks of examples within that budget (zero-padded
  to whole chunks), formed again for every average.
  """

  def _inputs_identity(self) -> jax.Array:
    """The identity in the input factor's form, `(input_size, input_size)`."""
    return jnp.eye(self.input_size(), dtype=self.parameters_dtype)

  def _example_gradients(self, data, batch_size) -> ExampleGradients:
    (x,), (dy,) = data["inputs"], data["outputs_tangent"]
    if isinstance(self, layers.DenseMixin) and x.ndim == 2:
      return ExampleGradients(batch_size, tangents=dy,
                              inputs=self._rows((x,), (dy,))[0])

    def matrices(xc, dyc):
      grads = self._per_example_gradients(
          dict(data, inputs=(xc,), outputs_tangent=(dyc,)))
      return jax.vmap(self._to_matrix)(grads)

    samples, batch = dy.shape[:2]
    per_example = samples * self.input_size() * self.output_size()
    chunk = max(1, min(batch, base.get_max_parallel_elements() // per_example))
    if chunk >= batch:
      return ExampleGradients(batch_size, matrices=matrices(x, dy))
    pad = -batch % chunk  # zero examples have zero gradients
    x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
    dy = jnp.pad(dy, [(0, 0), (0, pad)] + [(0, 0)] * (dy.ndim - 2))
    chunks = (x.reshape((-1, chunk) + x.shape[1:]),
              jnp.swapaxes(dy.reshape((samples, -1, chunk) + dy.shape[2:]),
                           0, 1))
    return ExampleGradients(batch_size, chunks=chunks, chunk_matrices=matrices)


class AssembledOuterSum:
  """For dense blocks whose inverse does not split over the gradient's rows:
  `multiply_inverse_outer_sum` assembles the gradient first."""

  def outer_sum_is_cheaper(self) -> bool:
    """False: the inverse is not `A⁻¹ · V · B⁻¹` with cached factors."""
    return False

  def multiply_inverse_outer_sum(
      self, state: base.CurvatureBlock.State, inputs: Sequence[jax.Array],
      outputs_cotangent: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
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
    return self.multiply_inverse(state, self._from_matrix(x.T @ dy), 0.0,
                                 exact_power=False, use_cached=True)


class KroneckerSpectrum:
  """Mixin for a block `(Q_L ⊗ Q_R) diag(vec s) (Q_L ⊗ Q_R)ᵀ`.

  A family gives `_kronecker_spectrum(state) -> (Q_L, Q_R, s)` (orthogonal
  `Q_L`, `Q_R` and the `(input_size, output_size)` eigenvalues `s`), and
  may give a cheaper `_kronecker_multiply(state, V)` for the product. Any
  scale is inside `s`, so `state_dependent_scale` is 1. Exact and
  approximate powers are one computation (the damping adds to `s`).

  Cache: "inputs_eigenvectors", "outputs_eigenvectors" and "spectrum",
  shared by all powers, and per power the identity weight it was cached
  with; "eigenvalues" (`s`, flattened) when asked.
  """

  def state_dependent_scale(self, state):
    del state
    return 1

  def _kronecker_spectrum(self, state):
    """`(q_l, q_r, s)`: the block is `(q_l ⊗ q_r) diag(vec s) (q_l ⊗ q_r)ᵀ`,
    `s` of shape `(input_size, output_size)`. The one hook a family gives."""
    raise NotImplementedError(
        f"{type(self).__name__} must give its Kronecker eigenbasis and "
        "spectrum (`_kronecker_spectrum`).")

  def _kronecker_multiply(self, state, v):
    """The block times the `(input_size, output_size)` matrix `v`."""
    q_l, q_r, s = self._kronecker_spectrum(state)
    return utils.kronecker_eigen_multiply(q_l, q_r, s, v)

  def _multiply_matpower_unscaled(self, state, vector, identity_weight, power,
                                  exact_power, use_cached):
    v = self._to_matrix(vector)
    if use_cached:
      cache = state.cache
      q_l, q_r, s = (cache["inputs_eigenvectors"],
                     cache["outputs_eigenvectors"], cache["spectrum"])
      identity_weight = cache[base.cache_key(power, exact=exact_power)]
    elif power == 1:
      return self._from_matrix(self._kronecker_multiply(state, v)
                               + identity_weight * v)
    else:
      q_l, q_r, s = self._kronecker_spectrum(state)
    grid = s + identity_weight
    if power != 1:
      grid = jnp.power(grid, power)
    return self._from_matrix(utils.kronecker_eigen_multiply(q_l, q_r, grid, v))

  def _eigenvalues_unscaled(self, state):
    return self._kronecker_spectrum(state)[2].reshape(-1)

  def _update_cache(self, state, identity_weight, exact_powers, approx_powers,
                    eigenvalues, state_scale):
    del state_scale  # 1: the scale is part of the spectrum
    keys = base.power_cache_keys(exact_powers, approx_powers)
    if not (keys or eigenvalues):
      return {}
    q_l, q_r, s = self._kronecker_spectrum(state)
    updates = {}
    if keys:
      weight = jnp.asarray(identity_weight, self.parameters_dtype)
      updates.update(inputs_eigenvectors=q_l, outputs_eigenvectors=q_r,
                     spectrum=s)
      updates.update({key: weight for key, _ in keys})
    if eigenvalues:
      updates["eigenvalues"] = s.reshape(-1)
    return updates


# --- input factors that may be diagonal --------------------------------------
#
# A block's input-side factor is a square matrix, or (an embedding's large
# vocabulary) its diagonal as a vector. These keep the families' code one
# for both forms.

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


def _positive_or_one(value):
  """`value`, or 1 where it is below the dtype's `tiny` (a zero estimate,
  whose matrix is zero whatever it is multiplied by)."""
  return jnp.where(value >= jnp.finfo(value.dtype).tiny, value,
                   jnp.ones_like(value))


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


# --- Shampoo ------------------------------------------------------------------

def _root_of_spectrum(values):
  """`sqrt(values)` of a PSD factor's ascending eigenvalues, with those
  under round-off (`n eps` times the largest) taken as zero: the root would
  turn them into spurious eigenvalues of order `sqrt(eps)`."""
  cutoff = len(values) * jnp.finfo(values.dtype).eps * values[-1]
  return jnp.sqrt(jnp.where(values > cutoff, values, 0))


class ShampooSpectrum(KroneckerSpectrum):
  """`c (L ⊗ R)^(1/2)` with `c = tr L / (tr L^(1/2) tr R^(1/2))` (Gupta et
  al., 2018), trace-matched to the exact block; its eigenvectors are those
  of `L` and `R`, its eigenvalues `c sqrt(λ_L) sqrt(λ_R)`."""

  def _kronecker_spectrum(self, state):
    l_values, q_l = utils.safe_psd_eigh(state.inputs_factor.value)
    r_values, q_r = utils.safe_psd_eigh(state.outputs_factor.value)
    l_roots, r_roots = _root_of_spectrum(l_values), _root_of_spectrum(r_values)
    scale = jnp.sum(l_values) / _positive_or_one(
        jnp.sum(l_roots) * jnp.sum(r_roots))
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


# --- SOAP ---------------------------------------------------------------------

class SOAPScalings:
  """EKFAC's scalings refitted to per-example gradients in the eigenbasis of
  Shampoo's `L` and `R` (Vyas et al., 2024; George et al., 2018).

  Mixed in before `eigenbasis.EKFAC` and a TNT layer class: the factors are
  `L` and `R` (TNT's statistics), the scalings `D = E_n[(Q_Lᵀ G_n Q_R)²]`,
  the block `(Q_L ⊗ Q_R) diag(vec D) (Q_L ⊗ Q_R)ᵀ`, with scale 1.
  """

  def state_dependent_scale(self, state):
    del state
    return 1

  def _batch_scalings(self, estimation_data, batch_size, u_a, u_g):
    return self._example_gradients(
        estimation_data, batch_size).projected_squares(u_a, u_g)

  def _projected_rows(self, estimation_data, inputs_basis, outputs_basis):
    raise NotImplementedError(  # EKFAC's hook; `_batch_scalings` replaces it
        f"{type(self).__name__} fits its scalings to per-example gradients.")


class DenseSOAP(SOAPScalings, ExampleGradientsMixin, AssembledOuterSum,
                eigenbasis.EKFAC, tnt.DenseTNT):
  """SOAP's curvature for dense and repeated dense tags (Vyas et al., 2024):
  `(Q_L ⊗ Q_R) diag(vec D) (Q_L ⊗ Q_R)ᵀ`, `Q_L`, `Q_R` the eigenvectors of
  Shampoo's `L` and `R` and `D = E_n[(Q_Lᵀ G_n Q_R)²]` (George et al.'s
  correction), the nearest matrix to the exact block that is diagonal in
  that basis.

  Cadence as `eigenbasis.EKFAC`: `D` at every update in the state's basis,
  the basis at every `update_cache` (the first update sets it too).
  """


class Conv2DSOAP(SOAPScalings, ExampleGradientsMixin, eigenbasis.EKFAC,
                 tnt.Conv2DTNT):
  """SOAP's curvature for 2-D convolutions (Vyas et al., 2024): as
  `DenseSOAP`, from per-example kernel gradients."""
