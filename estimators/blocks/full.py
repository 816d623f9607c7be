"""Full blocks: the whole (dim x dim) curvature matrix of a layer."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from estimators import utils
from estimators.blocks import base, layers, norms

_EIGEN = "eigendecomposition"


class Full(base.CurvatureBlock):
  """A dense matrix over the layer's parameters, flattened in operand order.

  Cached powers are stored as matrices, unless more powers than
  `eigen_decomposition_threshold` are requested at init: then the cache holds
  one eigendecomposition (key "eigendecomposition") and each power's entry is
  the identity weight it was cached with. Exact and approximate powers are the
  same for this block.
  """

  @jax.tree_util.register_dataclass
  @dataclasses.dataclass(frozen=True)
  class State(base.CurvatureBlock.State):
    """Full block state.

    Attributes:
      matrix: a WeightedMovingAverage of the `(dim, dim)` curvature.
    """

    matrix: utils.WeightedMovingAverage

  if TYPE_CHECKING:
    # Given by the layer mixin a concrete block puts first (`layers`,
    # `embedding`): one `(rows, *shape)` array of gradients per parameter.
    def _per_example_gradients(self, data) -> tuple[jax.Array, ...]: ...

  def __init__(
    self,
    layer_tag_eq: Any,
    name: str | None = None,
    eigen_decomposition_threshold: int | None = None,
  ):
    """Builds the block.

    Args:
      layer_tag_eq: the layer tag's jaxpr equation.
      name: the block's name in messages.
      eigen_decomposition_threshold: with more cached powers than this, the
        cache holds one eigendecomposition instead of one matrix per power.
        None uses `get_default_eigen_decomposition_threshold()`.
    """
    super().__init__(layer_tag_eq, name)
    if eigen_decomposition_threshold is None:
      eigen_decomposition_threshold = (
        base.get_default_eigen_decomposition_threshold()
      )
    self._eigen_decomposition_threshold = int(eigen_decomposition_threshold)

  @property
  def eigen_decomposition_threshold(self) -> int:
    """More cached powers than this are formed from an eigendecomposition."""
    return self._eigen_decomposition_threshold

  def parameters_list_to_single_vector(
    self, parameters_shaped_list: Sequence[jax.Array]
  ) -> jax.Array:
    """Flattens a block vector to `(dim,)`, the order of `State.matrix`.

    Args:
      parameters_shaped_list: one array per parameter.

    Returns:
      The arrays flattened row-major and concatenated in operand order.
    """
    return utils.flatten_arrays(parameters_shaped_list)

  def single_vector_to_parameters_list(
    self, vector: jax.Array
  ) -> tuple[jax.Array, ...]:
    """Inverts `parameters_list_to_single_vector`.

    Args:
      vector: a `(dim,)` array.

    Returns:
      One array per parameter, shaped as `parameters_shapes`.
    """
    return utils.unflatten_vector(vector, self.parameters_shapes)

  def _init(self, rng, exact_powers, approx_powers, cache_eigenvalues):
    del rng, cache_eigenvalues
    n, dtype = self.dim, self.parameters_dtype
    cache = {}
    num_powers = len(exact_powers) + len(approx_powers)
    if num_powers > self.eigen_decomposition_threshold:
      cache[_EIGEN] = {
        "eigenvalues": jnp.zeros([n], dtype),
        "eigenvectors": jnp.zeros([n, n], dtype),
      }
    return Full.State(
      cache=cache, matrix=utils.WeightedMovingAverage.zeros([n, n], dtype)
    )

  def _batch_statistics(self, estimation_data, batch_size):
    grads = utils.flatten_arrays(
      self._per_example_gradients(estimation_data), leading=1
    )
    return grads.T @ grads / batch_size

  def _fold_statistics(self, state, stats, ema_old, ema_new):
    return dataclasses.replace(
      state, matrix=state.matrix.updated(stats, ema_old, ema_new)
    )

  def _multiply_matpower_unscaled(
    self, state, vector, identity_weight, power, exact_power, use_cached
  ):
    v = self.parameters_list_to_single_vector(vector)
    matrix = state.matrix.value
    if use_cached:
      entry = state.cache[base.cache_key(power, exact=exact_power)]
      if _EIGEN in state.cache:
        eig = state.cache[_EIGEN]
        u = eig["eigenvectors"]
        result = u @ (jnp.power(eig["eigenvalues"] + entry, power) * (u.T @ v))
      else:
        result = entry @ v
    elif power == 1:  # no factorisation needed
      result = matrix @ v + identity_weight * v
    else:
      damped = matrix + identity_weight * jnp.eye(self.dim, dtype=matrix.dtype)
      result = utils.psd_matrix_power(damped, power) @ v
    return self.single_vector_to_parameters_list(result)

  def _eigenvalues_unscaled(self, state):
    return utils.psd_eigvalsh(state.matrix.value)

  def _norm_unscaled(self, state, norm_type):
    return norms.psd_matrix_norm(state.matrix.value, norm_type=norm_type)

  def _undamped_diagonal_unscaled(self, state):
    return utils.unflatten_vector(
      jnp.diagonal(state.matrix.value), self.parameters_shapes
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
    matrix = state_scale * state.matrix.value
    keys = base.power_cache_keys(exact_powers, approx_powers)
    updates: dict[str, Any] = {}
    if _EIGEN in state.cache:
      values, vectors = utils.safe_psd_eigh(matrix)
      updates[_EIGEN] = {"eigenvalues": values, "eigenvectors": vectors}
      weight = jnp.asarray(identity_weight, matrix.dtype)
      updates.update({key: weight for key, _ in keys})
      if eigenvalues:
        updates["eigenvalues"] = values
      return updates
    damped = matrix + identity_weight * jnp.eye(self.dim, dtype=matrix.dtype)
    updates.update({key: utils.psd_matrix_power(damped, p) for key, p in keys})
    if eigenvalues:
      updates["eigenvalues"] = utils.psd_eigvalsh(matrix)
    return updates


class NaiveFull(Full):
  """`(1/B) sum_s p_s p_sᵀ` with `p_s` the batch-summed parameter gradient.

  It only needs the parameter gradients, so it works for any tag. Its
  expectation is the curvature only for the sampled Fisher (cross-example
  terms cancel in expectation); with exact modes it is not `mean_i g_i g_iᵀ`.
  """

  _REQUIRED_DATA = ("params_tangent",)

  def _batch_statistics(self, estimation_data, batch_size):
    p = utils.flatten_arrays(estimation_data["params_tangent"], leading=1)
    return p.T @ p / batch_size


class DenseFull(layers.DenseMixin, Full):
  """Exact `(1/B) sum_si g_si g_siᵀ` for dense layers, from one matmul."""


class Conv2DFull(layers.PerExampleConv2DMixin, Full):
  """Exact `(1/B) sum_si g_si g_siᵀ` for 2-D convolutions.

  Per-example kernel gradients come from the convolution's VJP, vmapped over
  at most `max_elements_for_vmap` examples at a time (default
  `get_max_parallel_elements()`) and looped over the rest.
  """

  def __init__(
    self,
    layer_tag_eq: Any,
    name: str | None = None,
    max_elements_for_vmap: int | None = None,
    eigen_decomposition_threshold: int | None = None,
  ):
    """Builds the block.

    Args:
      layer_tag_eq: the conv2d tag's jaxpr equation.
      name: the block's name in messages.
      max_elements_for_vmap: how many examples to vmap over at once; None
        uses `get_max_parallel_elements()`.
      eigen_decomposition_threshold: as for `Full`.
    """
    super().__init__(
      layer_tag_eq,
      name,
      max_elements_for_vmap=max_elements_for_vmap,
      eigen_decomposition_threshold=eigen_decomposition_threshold,
    )

  def conv2d_tangent_outer_product(
    self, inputs: jax.Array, tangent_of_outputs: jax.Array
  ) -> jax.Array:
    """`g gᵀ` for the parameter gradient `g` of one example (KFAC-JAX's helper).

    Args:
      inputs: one example's input, without the batch axis.
      tangent_of_outputs: the tangent of that example's output, without the
        batch axis.

    Returns:
      `(dim, dim)`, in the order of `parameters_list_to_single_vector`
      (kernel, then bias).
    """
    g = self.parameters_list_to_single_vector(
      self._single_example_gradients(inputs, tangent_of_outputs)
    )
    return jnp.outer(g, g)


class ScaleAndShiftFull(layers.ScaleAndShiftMixin, Full):
  """Exact `(1/B) sum_si g_si g_siᵀ` for scale-and-shift layers."""


class ExplicitFull(NaiveFull):
  """`(1/B) Σ_r p_r p_rᵀ` over whatever rows `p_r` it is given, keeping the
  rows of the latest batch.

  `ExplicitExactCurvature` gives it one row per example and sample (the
  per-example gradients of the estimation mode), so the estimate is the
  whole exact matrix. When the estimate is that batch alone
  (`factor_is_exact`), its non-zero eigenvalues come from the small Gram
  matrix `R Rᵀ` of the rows `R` rather than the dense matrix. The state
  keeps as many rows as its `factor` has (`init` makes none;
  `ExplicitExactCurvature.init` sizes it for its batch); a batch with more
  rows keeps none and the eigenvalues come from the dense matrix.
  """

  estimation_data_has_sample_axis = True  # its update takes all rows

  @jax.tree_util.register_dataclass
  @dataclasses.dataclass(frozen=True)
  class State(Full.State):
    """Explicit full block state.

    Attributes:
      factor: rows `R`, `(rows, dim)`, with `matrix == Rᵀ R` when
        `factor_is_exact`.
      factor_is_exact: a boolean array.
    """

    factor: jax.Array
    factor_is_exact: jax.Array

  def _init(self, rng, exact_powers, approx_powers, cache_eigenvalues):
    state = super()._init(rng, exact_powers, approx_powers, cache_eigenvalues)
    return ExplicitFull.State(
      cache=state.cache,
      matrix=state.matrix,
      factor=jnp.zeros((0, self.dim), self.parameters_dtype),
      factor_is_exact=jnp.array(False),
    )

  def with_factor_rows(
    self, state: ExplicitFull.State, num_rows: int
  ) -> ExplicitFull.State:
    """`state` with room for `num_rows` rows of the latest batch."""
    return dataclasses.replace(
      state, factor=jnp.zeros((num_rows, self.dim), state.factor.dtype)
    )

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
    """As `CurvatureBlock`'s; also keeps the rows (on a single device)."""
    self._check_estimation_data(estimation_data, batch_size)
    rows = utils.flatten_arrays(estimation_data["params_tangent"], leading=1)
    rows = rows / jnp.sqrt(jnp.asarray(batch_size, rows.dtype))
    matrix = _symmetric_gram(rows)
    room = state.factor.shape[0]
    if pmap_axis_name is not None or rows.shape[0] > room:
      # Averaged over devices, or too many rows: no rows factor the estimate.
      if pmap_axis_name is not None:
        matrix = jax.lax.pmean(matrix, pmap_axis_name)
      factor, exact = jnp.zeros_like(state.factor), jnp.array(False)
    else:
      # Zero rows change nothing, so a smaller batch is padded.
      factor = jnp.pad(rows, ((0, room - rows.shape[0]), (0, 0)))
      exact = (jnp.asarray(ema_old) == 0) | (state.matrix.weight == 0)
    return dataclasses.replace(
      state,
      matrix=state.matrix.updated(matrix, ema_old, ema_new),
      factor=factor.astype(state.factor.dtype),
      factor_is_exact=exact,
    )

  def _multiply_matpower_unscaled(
    self, state, vector, identity_weight, power, exact_power, use_cached
  ):
    if use_cached or power != -1:
      return super()._multiply_matpower_unscaled(
        state, vector, identity_weight, power, exact_power, use_cached
      )
    # A solve is cheaper than the eigendecomposition of a general power.
    matrix = state.matrix.value
    damped = matrix + identity_weight * jnp.eye(self.dim, dtype=matrix.dtype)
    v = self.parameters_list_to_single_vector(vector)
    return self.single_vector_to_parameters_list(jnp.linalg.solve(damped, v))

  def _eigenvalues_unscaled(self, state):
    """Ascending. Outside `jit` the Gram route is chosen on the host; with a
    traced state the choice is a `lax.cond`, which on CPU copies the dense
    matrix."""
    num_rows = state.factor.shape[0]
    if num_rows == 0 or num_rows >= self.dim:
      return _dense_eigenvalues(state.matrix.value)
    try:
      use_gram = bool(state.factor_is_exact)
    except jax.errors.ConcretizationTypeError:
      return jax.lax.cond(
        state.factor_is_exact,
        _gram_eigenvalues,
        lambda f, m: _dense_eigenvalues(m),
        state.factor,
        state.matrix.value,
      )
    if use_gram:
      return _gram_eigenvalues(state.factor)
    return _dense_eigenvalues(state.matrix.value)


def _symmetric_gram(rows: jax.Array, tiles: int = 8) -> jax.Array:
  """`rowsᵀ rows`, computing only the tiles on and above the diagonal.

  The product is symmetric, so the tiles below the diagonal are transposes:
  this halves the arithmetic of the dominant step of an exact estimate.
  """
  dim = rows.shape[1]
  if dim < 512:
    return rows.T @ rows
  bounds = np.linspace(0, dim, tiles + 1).astype(int)
  cols = [rows[:, a:b] for a, b in zip(bounds[:-1], bounds[1:])]
  upper = {
    (i, j): cols[i].T @ cols[j] for i in range(tiles) for j in range(i, tiles)
  }
  return jnp.block(
    [
      [upper[i, j] if j >= i else upper[j, i].T for j in range(tiles)]
      for i in range(tiles)
    ]
  )


@jax.jit
def _dense_eigenvalues(matrix: jax.Array) -> jax.Array:
  """Eigenvalues of a symmetric matrix, ascending."""
  return jnp.linalg.eigvalsh(matrix)


@jax.jit
def _gram_eigenvalues(rows: jax.Array, unused_matrix=None) -> jax.Array:
  """Eigenvalues of `rowsᵀ rows` (ascending) from the smaller `rows rowsᵀ`,
  zeros padded."""
  del unused_matrix
  n_rows, dim = rows.shape
  small = jnp.maximum(jnp.linalg.eigvalsh(rows @ rows.T), 0)
  return jnp.concatenate([jnp.zeros(dim - n_rows, small.dtype), small])
