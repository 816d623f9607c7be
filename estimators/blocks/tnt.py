"""Tensor Normal Training blocks: one Kronecker factor per parameter axis.

Ren & Goldfarb, "Tensor Normal Training for Deep Learning Models" (NeurIPS
2021). With per-(sample, example) gradients `G_n` of a parameter tensor and
`C = (1/B) sum_n vec(G_n) vec(G_n)ᵀ`, TNT approximates `C` by
`U_1 ⊗ ... ⊗ U_k / tr(C)^(k-1)`, where `U_j = (1/B) sum_n G_n,(j) G_n,(j)ᵀ`
contracts the mode-j unfolding with itself over all other axes. Every
`tr(U_j)` equals `tr(C)`, so the approximation keeps the trace of `C`.
"""

from __future__ import annotations

import dataclasses
import string
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax import lax

from estimators import utils
from estimators.blocks import base, kronecker, layers

if TYPE_CHECKING:
  # A mixin's methods run on the Kronecker block it is mixed into: the type
  # checker sees that block (at run time the mixin is a plain class).
  _KroneckerBlock = kronecker.TwoKroneckerFactored
else:
  _KroneckerBlock = object


def _inverse_trace(factor: jax.Array) -> jax.Array:
  """`1 / tr(factor)`, or 1 when the trace is zero (or below `tiny`).

  A factor with a vanishing trace is (numerically) zero, so the scale does not
  matter for the matrix; 1 keeps damped powers finite, where `1 / tiny` would
  make the base's `identity_weight / scale` underflow.
  """
  trace = jnp.trace(factor)
  tiny = jnp.finfo(factor.dtype).tiny
  return 1 / jnp.where(trace >= tiny, trace, jnp.ones_like(trace))


class TwoFactorTNT(_KroneckerBlock):
  """TNT for layers with K-FAC's `(input_size, output_size)` layout.

  Mixed into a `TwoKroneckerFactored` layer class (before it): the block is
  `A ⊗ G / tr(A)` with `A = (1/B) sum_n G_n G_nᵀ`, `G = (1/B) sum_n G_nᵀ G_n`
  over the per-example gradients `G_n` in that layout (bias as the last row).
  The Kronecker machinery (powers, cache, eigenvalues, outer sums) is
  inherited; `state_dependent_scale` is `1 / tr(A)` and `fixed_scale` is 1,
  since the statistics are per example, not per location or position.
  """

  if TYPE_CHECKING:
    # Given by the layer mixin a concrete block puts first (`layers`,
    # `embedding`): one `(rows, *shape)` array of gradients per parameter.
    def _per_example_gradients(self, data) -> tuple[jax.Array, ...]: ...

  def fixed_scale(self):
    """1: the statistics average over examples, with nothing to restore."""
    return 1

  def state_dependent_scale(self, state):
    """`1 / tr(A)` (1 for a zero estimate, whose matrix is zero anyway)."""
    return _inverse_trace(state.inputs_factor.value)

  def _batch_statistics(self, estimation_data, batch_size):
    a, g = self._per_example_factor_sums(estimation_data)
    return a / batch_size, g / batch_size

  def _per_example_factor_sums(self, data):
    """`(sum_n G_n G_nᵀ, sum_n G_nᵀ G_n)` from explicit per-example gradients.

    The gradients of at most `get_max_parallel_elements()` elements (about
    `S * examples * input_size * output_size`) are formed at a time; the
    examples are scanned over in chunks, zero-padded to a whole number of
    chunks (zero examples have zero gradients).
    """
    (x,), (dy,) = data["inputs"], data["outputs_tangent"]
    samples, batch = dy.shape[:2]
    per_example = samples * self.input_size() * self.output_size()
    chunk = max(1, min(batch, base.get_max_parallel_elements() // per_example))

    def sums(xc, dyc):
      grads = self._per_example_gradients(
        dict(data, inputs=(xc,), outputs_tangent=(dyc,))
      )
      m = jax.vmap(self._to_matrix)(grads)  # (rows, input_size, output_size)
      return (jnp.einsum("nio,njo->ij", m, m), jnp.einsum("nio,nip->op", m, m))

    if chunk >= batch:
      return sums(x, dy)
    pad = -batch % chunk
    x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
    dy = jnp.pad(dy, [(0, 0), (0, pad)] + [(0, 0)] * (dy.ndim - 2))
    xs = x.reshape((-1, chunk) + x.shape[1:])
    dys = jnp.swapaxes(dy.reshape((samples, -1, chunk) + dy.shape[2:]), 0, 1)

    def step(carry, args):
      a, g = sums(*args)
      return (carry[0] + a, carry[1] + g), None

    zeros = jax.tree_util.tree_map(
      lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(sums, xs[0], dys[0])
    )
    return lax.scan(step, zeros, (xs, dys))[0]


class DenseTNT(TwoFactorTNT, kronecker.DenseTwoKroneckerFactored):
  """TNT for dense and repeated dense layers (Ren & Goldfarb, NeurIPS 2021).

  The block is `A ⊗ G / tr(A)` over the weight with the bias as an extra
  row. For a dense tag each example's gradient `x̃ dyᵀ` has rank one, so
  `A = X̃ᵀ diag(sum_s |dy_sb|²) X̃ / B` and `G = (1/B) sum_sb |x̃_b|² dy dyᵀ`
  cost no more memory than the tangents. A repeated dense tag's example
  gradient sums over positions: it is formed explicitly, in chunks of
  examples of at most `get_max_parallel_elements()` elements in all.
  """

  def _batch_statistics(self, estimation_data, batch_size):
    if len(self.inputs_shapes[0]) != 2:  # repeated: no rank-one shortcut
      return super()._batch_statistics(estimation_data, batch_size)
    x, rows = self._rows(
      estimation_data["inputs"], estimation_data["outputs_tangent"]
    )
    (dy,) = estimation_data["outputs_tangent"]  # (S, B, d_out)
    dy_norms = jnp.sum(dy * dy, axis=(0, 2))  # (B,)
    x_norms = jnp.sum(x * x, axis=1)  # (B,)
    a = (x * dy_norms[:, None]).T @ x
    weighted = (dy * x_norms[:, None]).reshape(rows.shape)
    return a / batch_size, weighted.T @ rows / batch_size


class Conv2DTNT(
  TwoFactorTNT,
  layers.PerExampleConv2DMixin,
  kronecker.Conv2DTwoKroneckerFactored,
):
  """TNT for 2-D convolutions (Ren & Goldfarb, NeurIPS 2021).

  `A ⊗ G / tr(A)` in the layout of `Conv2DTwoKroneckerFactored` (rows:
  kernel positions and input channels `(kh, kw, c_in)`, then the bias;
  columns: output channels). Only ungrouped, undilated convolutions are
  supported.

  With `weighting_per_location=True` (the default) the factors come from
  the per-example kernel gradients `G_n`, `A = (1/B) sum_n G_n G_nᵀ` and
  `G = (1/B) sum_n G_nᵀ G_n`, and `fixed_scale()` is 1. At most
  `get_max_parallel_elements()` gradient elements are formed at a time, and
  at most `max_elements_for_vmap` examples are vmapped over.

  With `weighting_per_location=False` (KFAC-JAX 0.0.8's mixed form) the
  contractions are per example, with the squared norms summed over the
  example's locations first, while the factors keep K-FAC's location
  independence: with `p̃_nt` the patch at location t (a 1 appended for the
  bias) and `dy_snt` the tangents, `A = (1/(B T)) sum_nt w_n p̃_nt p̃_ntᵀ`
  with `w_n = sum_st |dy_snt|²`, `G = (1/(B T)) sum_snt v_n dy_snt dy_sntᵀ`
  with `v_n = sum_t |p̃_nt|²`, and `fixed_scale()` is the number of
  locations T. No per-example gradient is formed.
  """

  def __init__(
    self,
    layer_tag_eq: Any,
    name: str | None = None,
    max_elements_for_vmap: int | None = None,
    weighting_per_location: bool = True,
    parameters_specs: Sequence[str] | None = None,
    parameters_concat_axis: int = 0,
    **kwargs,
  ):
    """Builds the block.

    Args:
      layer_tag_eq: the conv2d tag's jaxpr equation.
      name: the block's name in messages.
      max_elements_for_vmap: how many examples to vmap over at once when
        forming per-example gradients; None uses
        `get_max_parallel_elements()`.
      weighting_per_location: True for the factors of the per-example
        gradients; False for KFAC-JAX's per-example weighting of the
        location-independent statistics (see the class docstring).
      parameters_specs: one rearrange spec per parameter, as for
        `TwoKroneckerFactored`; None takes the patch layout.
      parameters_concat_axis: the axis the rearranged parameters are
        concatenated along.
      **kwargs: passed on to the block family's constructor.

    Raises:
      ValueError: for a layer or specs the block cannot take, or
        `weighting_per_location=False` on a block built on this one that
        computes statistics of its own.
    """
    self._weighting_per_location = bool(weighting_per_location)
    super().__init__(
      layer_tag_eq,
      name,
      max_elements_for_vmap=max_elements_for_vmap,
      parameters_specs=parameters_specs,
      parameters_concat_axis=parameters_concat_axis,
      **kwargs,
    )
    cls = type(self)
    if not self._weighting_per_location and not all(
      getattr(cls, hook) is getattr(Conv2DTNT, hook)
      for hook in ("_batch_statistics", "fixed_scale", "state_dependent_scale")
    ):
      raise ValueError(
        f"Block {self.name!r}: {cls.__name__} computes its own statistics "
        "and does not take weighting_per_location=False; use Conv2DTNT, or "
        "leave the option at True."
      )

  @property
  def weighting_per_location(self) -> bool:
    """Whether the factors come from the per-example gradients (True) or
    from per-example weighted location statistics (False)."""
    return self._weighting_per_location

  def fixed_scale(self):
    if self._weighting_per_location:
      return super().fixed_scale()
    return self.num_locations

  def _batch_statistics(self, estimation_data, batch_size):
    if self._weighting_per_location:
      return super()._batch_statistics(estimation_data, batch_size)
    (x,), (dy,) = estimation_data["inputs"], estimation_data["outputs_tangent"]
    # w_n: each example's tangents' squared norm over samples, channels and
    # locations, (B,); v_n: its patches' squared norms over locations.
    dy_sq_norms = jnp.sum(dy * dy, axis=(0,) + tuple(range(2, dy.ndim)))
    x_sq_norms = self.x_squared_spatial_norms(x)
    if self.has_bias:
      x_sq_norms = x_sq_norms + 1
    x_sq_norms = jnp.sum(
      x_sq_norms, axis=tuple(range(1, x_sq_norms.ndim)), keepdims=True
    )
    a = self.compute_inputs_stats(x, weighting_array=dy_sq_norms)
    weighted = dy * jnp.sqrt(x_sq_norms)  # (S, B, ...) * (B, 1, 1, 1)
    g = self._outputs_moment(weighted.reshape((-1,) + dy.shape[2:]), batch_size)
    return a, g

  def x_squared_spatial_norms(self, x: jax.Array) -> jax.Array:
    """The squared norm of every input patch (KFAC-JAX's helper).

    Args:
      x: the convolution's batched input.

    Returns:
      The layer's output shape with one channel: at each example and output
      location, the sum of squares of the patch that location sees.
    """
    # Convolving `x²` with an all-ones kernel sums each patch's squares.
    shape = list(self.parameters_shapes[0])
    shape[self.kernel_output_axis] = 1
    return self._conv(x * x, jnp.ones(shape, x.dtype))


class NaiveTNT(kronecker.ParametersArrayLayout):
  """TNT for any tag (Ren & Goldfarb, NeurIPS 2021).

  From the per-sample batch-summed gradients `p_s` (like `NaiveFull`), laid
  out as one array by `parameters_specs` (KFAC-JAX's option; by default
  the tag's single parameter as it is): one factor `U_j = (1/B) sum_s
  p_s,(j) p_s,(j)ᵀ` per axis of that array (a scalar or vector parameter
  has one factor, `(1/B) sum_s p_s p_sᵀ`), and the block `U_1 ⊗ ... ⊗ U_k /
  tr(U_1)^(k-1)`. Factors after the first are divided by the trace before
  they are combined, so the products stay of the order of the trace;
  `state_dependent_scale` is 1. A tag with several parameters needs specs
  that lay them out as one array (e.g. `["ab -> ab", "a -> 1a"]` for a
  weight and its bias).

  Powers rotate the vector into the factors' eigenbases axis by axis,
  multiply by `(product of eigenvalues + λ)^p` and rotate back; exact and
  approximate powers are this same computation. Cache: the factors'
  eigenvalues and eigenvectors ("factors_eigenvalues",
  "factors_eigenvectors", shared by all powers) and per power the identity
  weight it was cached with; "eigenvalues" when asked.
  """

  @jax.tree_util.register_dataclass
  @dataclasses.dataclass(frozen=True)
  class State(base.CurvatureBlock.State):
    """NaiveTNT state.

    Attributes:
      factors: one WeightedMovingAverage per factor, `(d_j, d_j)`.
    """

    factors: tuple[utils.WeightedMovingAverage, ...]

  _REQUIRED_DATA = ("params_tangent",)

  def _check_layer(self):
    if self.number_of_parameters != 1 and self._requested_specs is None:
      raise ValueError(
        f"Block {self.name!r}: NaiveTNT needs a tag with exactly one "
        f"parameter, got {self.number_of_parameters} with shapes "
        f"{self.parameters_shapes}; give parameters_specs that lay them "
        "out as one array (e.g. ['ab -> ab', 'a -> 1a']), tag each "
        "parameter on its own (e.g. register_generic(w)) or use NaiveFull / "
        "NaiveDiagonal."
      )

  def _default_parameters_specs(self) -> list[str]:
    """The parameter as it is (`"abc -> abc"`), a scalar as `(1,)`."""
    (shape,) = self.parameters_shapes
    letters = string.ascii_lowercase[: len(shape)]
    return [f"{letters} -> {letters or '1'}"]

  @property
  def factor_sizes(self) -> tuple[int, ...]:
    """The side of each factor: the parameters' array shape (by default
    the parameter's shape, `(1,)` for a scalar)."""
    return self.array_shape

  def _init(self, rng, exact_powers, approx_powers, cache_eigenvalues):
    del rng, exact_powers, approx_powers, cache_eigenvalues
    zeros = utils.WeightedMovingAverage.zeros
    return NaiveTNT.State(
      cache={},
      factors=tuple(
        zeros((n, n), self.parameters_dtype) for n in self.factor_sizes
      ),
    )

  def _batch_statistics(self, estimation_data, batch_size):
    p = jax.vmap(self.parameters_shaped_list_to_array)(
      tuple(estimation_data["params_tangent"])
    )  # (S, d_1, ..., d_k)
    stats = []
    for axis, n in enumerate(self.factor_sizes):
      unfolded = jnp.moveaxis(p, axis + 1, 0).reshape(n, -1)
      stats.append(unfolded @ unfolded.T / batch_size)
    return tuple(stats)

  def _fold_statistics(self, state, stats, ema_old, ema_new):
    return dataclasses.replace(
      state,
      factors=tuple(
        f.updated(s, ema_old, ema_new) for f, s in zip(state.factors, stats)
      ),
    )

  def _normalized_factors(self, state, state_scale=1):
    """The factors whose Kronecker product is `state_scale` times the block."""
    values = [f.value for f in state.factors]
    inverse_trace = _inverse_trace(values[0])
    return [state_scale * values[0]] + [inverse_trace * f for f in values[1:]]

  def _along_axes(self, matrices, tensor, transpose=False):
    """Applies `matrices[j]` (or its transpose) along axis j of `tensor`."""
    for axis, m in enumerate(matrices):
      tensor = jnp.moveaxis(
        jnp.tensordot(m.T if transpose else m, tensor, axes=([1], [axis])),
        0,
        axis,
      )
    return tensor

  def _eigen_grid(self, values):
    """The eigenvalues of the Kronecker product, shaped as `factor_sizes`."""
    grid = values[0]
    for v in values[1:]:
      grid = jnp.multiply.outer(grid, v)
    return grid

  def _multiply_matpower_unscaled(
    self, state, vector, identity_weight, power, exact_power, use_cached
  ):
    # Approximate powers are exact for this block: the flag only picks the
    # cache entry.
    v = self.parameters_shaped_list_to_array(vector)
    if use_cached:
      cache = state.cache
      values, vectors = (
        cache["factors_eigenvalues"],
        cache["factors_eigenvectors"],
      )
      identity_weight = cache[base.cache_key(power, exact=exact_power)]
    elif power == 1:  # cheap without eigendecompositions
      factors = self._normalized_factors(state)
      result = self._along_axes(factors, v) + identity_weight * v
      return self.array_to_parameters_shaped_list(result)
    else:
      values, vectors = zip(
        *[utils.safe_psd_eigh(f) for f in self._normalized_factors(state)]
      )
    grid = jnp.power(self._eigen_grid(values) + identity_weight, power)
    rotated = self._along_axes(vectors, v, transpose=True)
    result = self._along_axes(vectors, grid * rotated)
    return self.array_to_parameters_shaped_list(result)

  def _eigenvalues_unscaled(self, state):
    values = [utils.psd_eigvalsh(f) for f in self._normalized_factors(state)]
    return self._eigen_grid(values).reshape(-1)

  def _update_cache(
    self,
    state,
    identity_weight,
    exact_powers,
    approx_powers,
    eigenvalues,
    state_scale,
  ):
    keys = base.power_cache_keys(exact_powers, approx_powers)
    values, vectors = zip(
      *[
        utils.safe_psd_eigh(f)
        for f in self._normalized_factors(state, state_scale)
      ]
    )
    updates: dict[str, Any] = {}
    if keys:
      weight = jnp.asarray(identity_weight, self.parameters_dtype)
      updates.update(
        factors_eigenvalues=tuple(values), factors_eigenvectors=tuple(vectors)
      )
      updates.update({key: weight for key, _ in keys})
    if eigenvalues:
      updates["eigenvalues"] = self._eigen_grid(values).reshape(-1)
    return updates
