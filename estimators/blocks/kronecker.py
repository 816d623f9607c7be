"""Kronecker-factored blocks: curvature ≈ scale * A ⊗ G (K-FAC).

A block's parameters are laid out as one `(input_size, output_size)` matrix
`V` (for a dense layer: the weight as `x @ W` uses it, whatever its stored
layout, with the bias as an extra last row), and
`(A ⊗ G) vec(V) = A V G` with row-major `vec`.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from estimators import patches
from estimators import utils
from estimators.blocks import base
from estimators.blocks import layers
from estimators.blocks import norms


class TwoKroneckerFactored(base.CurvatureBlock):
  """`A ⊗ G` with `A` from the layer inputs and `G` from the output tangents.

  Exact powers use eigendecompositions of both factors. Approximate powers
  (`exact_power=False`) split the damping between the factors with the
  pi-adjusted rule and raise each damped factor to the power.

  Cache: when exact powers are cached, both factors' eigendecompositions
  ("inputs_factor_eigenvalues", "inputs_factor_eigenvectors" and the same for
  "outputs_factor"), shared by all exact powers, and per exact power the
  identity weight it was cached with. Per approximate power, the two powered
  damped factors under "inputs_factor" and "outputs_factor"; for power -1 a
  big factor facing a small one is kept as its inverse Cholesky root `L⁻¹`
  (`factor⁻¹ = L⁻ᵀ L⁻¹`, in the blocks of `utils.psd_inverse_root`) under
  "inputs_factor_inverse_root" or "outputs_factor_inverse_root".
  """

  @jax.tree_util.register_dataclass
  @dataclasses.dataclass(frozen=True)
  class State(base.CurvatureBlock.State):
    """Kronecker block state.

    Attributes:
      inputs_factor: a WeightedMovingAverage of `A`, `(input_size,
        input_size)`.
      outputs_factor: a WeightedMovingAverage of `G`, `(output_size,
        output_size)`.
    """

    inputs_factor: utils.WeightedMovingAverage
    outputs_factor: utils.WeightedMovingAverage

    @property
    def factors(self) -> tuple[utils.WeightedMovingAverage, ...]:
      """`(inputs_factor, outputs_factor)`, as KFAC-JAX's state lists them."""
      return (self.inputs_factor, self.outputs_factor)

  @property
  def has_bias(self) -> bool:
    """Whether the tag has a bias (a second parameter)."""
    return self.number_of_parameters == 2

  @abc.abstractmethod
  def input_size(self) -> int:
    """Size of the inputs factor A."""

  @abc.abstractmethod
  def output_size(self) -> int:
    """Size of the outputs factor G."""

  def _kernel_to_matrix(self, kernel):
    """The first parameter as the matrix's rows above the bias."""
    return kernel.reshape(-1, self.output_size())

  def _kernel_from_matrix(self, matrix):
    """Inverts `_kernel_to_matrix`."""
    return matrix.reshape(self.parameters_shapes[0])

  def _to_matrix(self, vector):
    """Parameters-shaped tuple -> `(input_size, output_size)` matrix."""
    w = self._kernel_to_matrix(vector[0])
    if not self.has_bias:
      return w
    return jnp.concatenate([w, vector[1].reshape(1, -1)])

  def _from_matrix(self, matrix):
    if not self.has_bias:
      return (self._kernel_from_matrix(matrix),)
    return (
      self._kernel_from_matrix(matrix[:-1]),
      matrix[-1].reshape(self.parameters_shapes[1]),
    )

  def _init(self, rng, exact_powers, approx_powers, cache_eigenvalues):
    del rng, exact_powers, approx_powers, cache_eigenvalues
    zeros = utils.WeightedMovingAverage.zeros
    dtype = self.parameters_dtype
    return TwoKroneckerFactored.State(
      cache={},
      inputs_factor=zeros([self.input_size()] * 2, dtype),
      outputs_factor=zeros([self.output_size()] * 2, dtype),
    )

  def _is_plain_kronecker(self) -> bool:
    """Whether the block is `A ⊗ G` itself (families built on this one,
    such as EKFAC, hold other matrices)."""
    cls = type(self)
    return all(
      getattr(cls, name) is getattr(TwoKroneckerFactored, name)
      for name in ("_multiply_matpower_unscaled", "_eigenvalues_unscaled")
    )

  def _norm_unscaled(self, state, norm_type):
    if not self._is_plain_kronecker():
      return super()._norm_unscaled(state, norm_type)
    return norms.psd_matrix_norm(
      state.inputs_factor.value, norm_type=norm_type
    ) * norms.psd_matrix_norm(state.outputs_factor.value, norm_type=norm_type)

  def _undamped_diagonal_unscaled(self, state):
    if not self._is_plain_kronecker():
      return super()._undamped_diagonal_unscaled(state)
    return self._from_matrix(
      jnp.outer(
        jnp.diagonal(state.inputs_factor.value),
        jnp.diagonal(state.outputs_factor.value),
      )
    )

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
    v = self._to_matrix(vector)
    cache = state.cache
    a, g = state.inputs_factor.value, state.outputs_factor.value
    if exact_power and use_cached:
      grid = jnp.outer(
        cache["inputs_factor_eigenvalues"], cache["outputs_factor_eigenvalues"]
      )
      grid = jnp.power(grid + cache[base.cache_key(power, exact=True)], power)
      result = utils.kronecker_eigen_multiply(
        cache["inputs_factor_eigenvectors"],
        cache["outputs_factor_eigenvectors"],
        grid,
        v,
      )
    elif exact_power and power == 1:  # cheap without eigendecompositions
      result = a @ v @ g + identity_weight * v
    elif exact_power:
      a_vals, a_vecs = utils.safe_psd_eigh(a)
      g_vals, g_vecs = utils.safe_psd_eigh(g)
      grid = jnp.power(jnp.outer(a_vals, g_vals) + identity_weight, power)
      result = utils.kronecker_eigen_multiply(a_vecs, g_vecs, grid, v)
    else:
      entry = (
        cache[base.cache_key(power, exact=False)]
        if use_cached
        else _approx_power_entry(a, g, identity_weight, power)
      )
      result = _apply_approx_power(entry, v)
    return self._from_matrix(result)

  def _eigenvalues_unscaled(self, state):
    return utils.kronecker_product_eigenvalues(
      utils.psd_eigvalsh(state.inputs_factor.value),
      utils.psd_eigvalsh(state.outputs_factor.value),
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
    # The state dependent scale is folded into G; A is left as is.
    a = state.inputs_factor.value
    g = state_scale * state.outputs_factor.value
    updates = {}
    if exact_powers or eigenvalues:
      a_vals, a_vecs = utils.safe_psd_eigh(a)
      g_vals, g_vecs = utils.safe_psd_eigh(g)
      if eigenvalues:
        updates["eigenvalues"] = utils.kronecker_product_eigenvalues(
          a_vals, g_vals
        )
      if exact_powers:
        # Shared by all exact powers, so refreshing one power keeps the
        # others consistent (they keep their own identity weights).
        updates.update(
          inputs_factor_eigenvalues=a_vals,
          inputs_factor_eigenvectors=a_vecs,
          outputs_factor_eigenvalues=g_vals,
          outputs_factor_eigenvectors=g_vecs,
        )
      for p in exact_powers:
        updates[base.cache_key(p, exact=True)] = jnp.asarray(
          identity_weight, a.dtype
        )
    for p in approx_powers:
      updates[base.cache_key(p, exact=False)] = _approx_power_entry(
        a, g, identity_weight, p
      )
    return updates


# A factor's inverse is cached as its Cholesky root `L⁻¹` (in blocks, see
# `utils.psd_inverse_root`) instead when the factor is big and the other one
# small: the parameter matrix then has few columns (or rows) for the root's
# two products, and the root is much cheaper to refresh than the inverse.
_ROOT_MIN_SIZE = 1024
_ROOT_MIN_RATIO = 8


def _approx_power_entry(a, g, identity_weight, power):
  """Both pi-damped factors raised to `power`, keyed as in the cache."""
  a_damped, g_damped = utils.pi_adjusted_kronecker_damping(
    a, g, identity_weight
  )
  return {
    **_factor_power("inputs_factor", a_damped, power, g.shape[0]),
    **_factor_power("outputs_factor", g_damped, power, a.shape[0]),
  }


def _factor_power(name, factor, power, other_size):
  n = factor.shape[0]
  if power == -1 and n >= _ROOT_MIN_SIZE and n >= _ROOT_MIN_RATIO * other_size:
    return {f"{name}_inverse_root": utils.psd_inverse_root(factor)}
  return {name: utils.psd_matrix_power(factor, power)}


def _apply_approx_power(entry, v):
  """`A^p V G^p` from an entry of `_approx_power_entry`."""
  return _outputs_side(entry, _inputs_side(entry, v))


def _inputs_side(entry, v):
  """`A^p V`."""
  if "inputs_factor_inverse_root" in entry:
    return _solve_with_root(entry["inputs_factor_inverse_root"], v)
  return entry["inputs_factor"] @ v


def _outputs_side(entry, v):
  """`V G^p`."""
  if "outputs_factor_inverse_root" in entry:
    return _solve_with_root(entry["outputs_factor_inverse_root"], v.T).T
  return v @ entry["outputs_factor"]


def _solve_with_root(root, v):
  """`factor⁻¹ v = L⁻ᵀ (L⁻¹ v)` for the factor's inverse Cholesky root."""
  return utils.inverse_root_multiply(
    root, utils.inverse_root_multiply(root, v), transpose=True
  )


class DenseTwoKroneckerFactored(layers.DenseMixin, TwoKroneckerFactored):
  """K-FAC for dense layers: `A = mean_i x̃ x̃ᵀ`, `G = (1/B) sum_si dy dyᵀ`.

  `x̃` is the input with a 1 appended when the layer has a bias.
  """

  def input_size(self) -> int:
    return self.weight_matrix_shape[0] + int(self.has_bias)

  def output_size(self) -> int:
    return self.weight_matrix_shape[1]

  def _kernel_to_matrix(self, kernel):
    return self.weight_to_matrix(kernel)

  def _kernel_from_matrix(self, matrix):
    return self.weight_from_matrix(matrix)

  def _rows(self, inputs, outputs_tangent):
    """(x̃, dy) as matrices with one row per example (and position)."""
    (x,), (dy,) = inputs, outputs_tangent
    x = x.reshape(-1, x.shape[-1])
    dy = dy.reshape(-1, dy.shape[-1])
    if self.has_bias:
      x = jnp.concatenate([x, jnp.ones_like(x[:, :1])], axis=1)
    return x, dy

  def _batch_statistics(self, estimation_data, batch_size):
    x, dy = self._rows(
      estimation_data["inputs"], estimation_data["outputs_tangent"]
    )
    return x.T @ x / batch_size, dy.T @ dy / batch_size

  def outer_sum_is_cheaper(self) -> bool:
    rows = utils.product(self.inputs_shapes[0][:-1])
    i, o = self.input_size(), self.output_size()
    return rows * (i * i + o * o + i * o) < i * o * (i + o)

  def multiply_inverse_outer_sum(
    self,
    state: TwoKroneckerFactored.State,
    inputs: Sequence[jax.Array],
    outputs_cotangent: Sequence[jax.Array],
  ) -> tuple[jax.Array, ...]:
    """The cached approximate inverse times the gradient `X̃ᵀ dY`.

    The gradient is never formed: `A⁻¹ (X̃ᵀ dY) G⁻¹ = (A⁻¹ X̃ᵀ)(dY G⁻¹)`
    costs rows·(i² + o² + i·o) against i·o·(i + o) for the assembled
    matrix, which `outer_sum_is_cheaper` compares.

    Args:
      state: the block state, with approximate power -1 cached.
      inputs: the layer's inputs `(x,)`, `x` of shape `(B, ..., d_in)`.
      outputs_cotangent: the cotangent `(dy,)` of the layer's outputs for
        the value being differentiated, shaped like the outputs.

    Returns:
      What `multiply_inverse(state, grad, λ, exact_power=False,
      use_cached=True)` gives for that gradient, one array per parameter.

    Raises:
      ValueError: if the approximate inverse is not cached.
    """
    self._check_cached(state, -1, exact=False)
    x, dy = self._rows(inputs, outputs_cotangent)
    entry = state.cache[base.cache_key(-1, exact=False)]
    result = self._from_matrix(
      _inputs_side(entry, x.T) @ _outputs_side(entry, dy)
    )
    return utils.scalar_mul(
      result, self._scale_power(self.scale(state, use_cache=True), -1)
    )


class RepeatedDenseTwoKroneckerFactored(DenseTwoKroneckerFactored):
  """K-FAC for a dense layer applied over extra axes, `x: (B, r1, ..., d_in)`.

  Every axis but the last acts as a batch axis of the factors, which are
  averaged over `B * R` rows (`R = r1 * ...`); `fixed_scale() = R` restores
  the sum over the R applications inside each example.
  """

  @property
  def num_repeats(self) -> int:
    """`R`, the number of applications of the layer within an example."""
    (x_shape,) = self.inputs_shapes
    return utils.product(x_shape[1:-1])

  def fixed_scale(self):
    return self.num_repeats

  def _batch_statistics(self, estimation_data, batch_size):
    return super()._batch_statistics(
      estimation_data, batch_size * self.num_repeats
    )


class Conv2DTwoKroneckerFactored(layers.Conv2DMixin, TwoKroneckerFactored):
  """K-FAC for 2-D convolutions (Grosse & Martens, 2016).

  `A` is the second moment of the input patches (bias as an appended 1) and
  `G` that of the output tangents, both averaged over examples and output
  locations; `fixed_scale() = num_locations`. The patch layout is
  `(kernel_h, kernel_w, in_channels)`. Only ungrouped, undilated convolutions
  are supported.
  """

  def _check_layer(self):
    super()._check_layer()
    p = self.layer_tag_extra_params
    if (
      p["feature_group_count"] != 1
      or p["batch_group_count"] != 1
      or tuple(p["lhs_dilation"]) != (1, 1)
      or tuple(p["rhs_dilation"]) != (1, 1)
    ):
      raise ValueError(
        f"Block {self.name!r}: {type(self).__name__} supports only "
        "convolutions without grouping or dilation; use Conv2DDiagonal or "
        "Conv2DFull for this layer."
      )

  def input_size(self) -> int:
    return self.weights_spatial_size * self.num_inputs_channels + int(
      self.has_bias
    )

  def output_size(self) -> int:
    return self.num_outputs_channels

  def fixed_scale(self):
    return self.num_locations

  def _kernel_axes(self):
    """Kernel axes ordered (spatial..., in, out), the patch layout."""
    spec = self.dimension_numbers.rhs_spec
    return (spec[2], spec[3], spec[1], spec[0])

  def _kernel_to_matrix(self, kernel):
    kernel = jnp.transpose(kernel, self._kernel_axes())
    return kernel.reshape(-1, self.output_size())

  def _kernel_from_matrix(self, matrix):
    axes = self._kernel_axes()
    shape = tuple(self.parameters_shapes[0][i] for i in axes)
    inverse = tuple(axes.index(i) for i in range(4))
    return jnp.transpose(matrix.reshape(shape), inverse)

  def compute_inputs_stats(
    self, inputs: jax.Array, weighting_array: jax.Array | None = None
  ) -> jax.Array:
    """The input factor `A` of one batch (KFAC-JAX's helper).

    Args:
      inputs: the convolution's batched input.
      weighting_array: per-location weights, as for
        `patches.patches_moments`, or None.

    Returns:
      `(input_size, input_size)`: the patches' second moment averaged over
      examples and output locations, bordered with their first moment and,
      in the corner, the mean weight (1 unweighted) when there is a bias.
    """
    p = self.layer_tag_extra_params
    # One matrix product over explicit patches is far faster than the
    # memory-saving loop over kernel offsets; use it when the patches fit the
    # same element budget the conv blocks use for vmapping.
    rows = inputs.shape[self.dimension_numbers.lhs_spec[0]] * self.num_locations
    explicit = rows * self.input_size() <= base.get_max_parallel_elements()
    moments = (
      patches.patches_moments_explicit if explicit else patches.patches_moments
    )
    second, first = moments(
      inputs,
      self.weights_spatial_shape,
      strides=p["window_strides"],
      padding=p["padding"],
      data_format=None,
      dim_numbers=self.dimension_numbers,
      weighting_array=weighting_array,
    )
    k = second.shape[0] * second.shape[1] * second.shape[2]
    a = second.reshape(k, k)
    if self.has_bias:
      first = first.reshape(k, 1)
      if weighting_array is None:
        corner = jnp.ones((1, 1), a.dtype)
      else:  # the average weight, as the patches' moments are averages
        corner = jnp.mean(weighting_array).reshape(1, 1).astype(a.dtype)
      a = jnp.block([[a, first], [first.T, corner]])
    return a

  def compute_outputs_stats(self, tangent_of_output: jax.Array) -> jax.Array:
    """The output factor `G` of one batch (KFAC-JAX's helper).

    Args:
      tangent_of_output: `(B, *output_shape[1:])`, one tangent per example.

    Returns:
      `(C_out, C_out)`, the tangents' second moment averaged over the B
      examples and the output locations.
    """
    return self._outputs_moment(tangent_of_output, tangent_of_output.shape[0])

  def _outputs_moment(self, dy, batch_size):
    """`Σ dy dyᵀ / (batch_size * num_locations)` over rows of `dy`'s channels."""
    dy = jnp.moveaxis(dy, self.outputs_channel_index, -1)
    dy = dy.reshape(-1, self.num_outputs_channels)
    return dy.T @ dy / (batch_size * self.num_locations)

  def _batch_statistics(self, estimation_data, batch_size):
    (x,), (dy,) = estimation_data["inputs"], estimation_data["outputs_tangent"]
    # (S, B, ...) -> (S * B, ...): every sample's tangents are rows of G.
    dy = dy.reshape((-1,) + dy.shape[2:])
    return self.compute_inputs_stats(x), self._outputs_moment(dy, batch_size)


# KFAC-JAX's names for the same blocks (their two-factor case).
KroneckerFactored = TwoKroneckerFactored
RepeatedDenseKroneckerFactored = RepeatedDenseTwoKroneckerFactored
