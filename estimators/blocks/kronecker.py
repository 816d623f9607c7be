"""Kronecker-factored blocks: curvature ≈ scale * A ⊗ G (K-FAC).

A block's parameters are laid out as one `(input_size, output_size)` matrix
`V` (for a dense layer: the weight as `x @ W` uses it, whatever its stored
layout, with the bias as an extra last row), and
`(A ⊗ G) vec(V) = A V G` with row-major `vec`. The layout is KFAC-JAX's
`parameters_specs` / `parameters_concat_axis` (see `ParametersArrayLayout`):
each parameter is rearranged by a spec and the results are concatenated.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import string
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from estimators import patches, tags, utils
from estimators.blocks import base, layers, norms
from estimators.utils import array_math

_ALPHABET = string.ascii_lowercase


def _group(letters: str) -> str:
  """`letters` as one output axis of a spec: bare if one letter, else merged."""
  return letters if len(letters) == 1 else f"({letters})"


class ParametersArrayLayout(base.CurvatureBlock):
  """A block whose parameters are laid out as one array, as KFAC-JAX's
  Kronecker-factored blocks lay them out.

  Each parameter is rearranged by its spec in `parameters_specs` (the
  einops-like syntax of `utils.rearrange`, e.g. `"abc -> (ab)c"` merges
  the first two axes, `"ab -> ba"` transposes, `"a -> 1a"` makes a row)
  and the results are concatenated along `parameters_concat_axis`. The
  block's factors act on the axes of that array. Subclasses give the
  default specs and, where their statistics fix it, the array's shape.
  """

  def __init__(
    self,
    layer_tag_eq: Any,
    name: str | None = None,
    parameters_specs: Sequence[str] | None = None,
    parameters_concat_axis: int = 0,
  ):
    """Builds the block and checks the layout.

    Args:
      layer_tag_eq: the layer tag's jaxpr equation.
      name: the block's name in messages.
      parameters_specs: one rearrange spec per parameter (in operand
        order); None takes the block's defaults.
      parameters_concat_axis: the axis along which the rearranged
        parameters are concatenated.

    Raises:
      ValueError: if the tag does not fit the block, or the specs do not
        give an array the block can use.
    """
    # Kept as given until the tag has been checked (`_check_layer` may look).
    self._requested_specs: Any = parameters_specs
    super().__init__(layer_tag_eq, name)
    self.parameters_concat_axis: int = parameters_concat_axis
    if isinstance(parameters_specs, str):
      self.parameters_specs: tuple[str, ...] = (parameters_specs,)
      raise self._layout_error(
        "parameters_specs takes one spec per parameter (a list of "
        "strings), not one string"
      )
    if parameters_specs is None:
      self.parameters_specs = tuple(self._default_parameters_specs())
    else:
      self.parameters_specs = tuple(parameters_specs)
    self._piece_shapes = self._check_parameters_layout()

  def _default_parameters_specs(self) -> list[str]:
    """The specs used when none are given, one per parameter.

    Here, as in KFAC-JAX: the first parameter, when it has 2 axes or more,
    merges all its axes but the last (`"abc -> (ab)c"`); every other one
    becomes one row (`"a -> 1a"`, `"ab -> 1(ab)"`), as a bias does.
    """
    specs = []
    for i, shape in enumerate(self.parameters_shapes):
      letters = _ALPHABET[: len(shape)]
      if i == 0 and len(shape) >= 2:
        specs.append(f"{letters} -> ({letters[:-1]}){letters[-1]}")
      else:
        specs.append(_row_spec(len(shape)))
    return specs

  def _expected_array_shape(self) -> tuple[int, ...] | None:
    """The array shape the block's statistics need; None for any shape."""
    return None

  def _layout_error(self, problem: str) -> ValueError:
    return ValueError(
      f"Block {self.name!r}: {type(self).__name__}(parameters_specs="
      f"{list(self.parameters_specs)!r}, parameters_concat_axis="
      f"{self.parameters_concat_axis!r}) for parameters of shapes "
      f"{list(self.parameters_shapes)}: {problem}."
    )

  def _check_parameters_layout(self) -> list[tuple[int, ...]]:
    """The shape of each rearranged parameter, after checking the layout."""
    specs, shapes = self.parameters_specs, self.parameters_shapes
    if len(specs) != len(shapes):
      raise self._layout_error(
        f"expected one spec per parameter ({len(shapes)}), got {len(specs)}"
      )
    pieces = []
    for i, (spec, shape) in enumerate(zip(specs, shapes)):
      try:
        left, _ = utils.parse_rearrange_spec(spec)
      except ValueError as e:
        raise self._layout_error(
          f"spec {i} ({spec!r}) is malformed: {e}"
        ) from None
      if len(left) != len(shape):
        raise self._layout_error(
          f"spec {i} ({spec!r}) names {len(left)} axes, but parameter {i} "
          f"has shape {shape}"
        )
      zeros = jax.ShapeDtypeStruct(shape, self.parameters_dtype)
      rearranged = functools.partial(utils.rearrange, spec=spec)
      pieces.append(tuple(jax.eval_shape(rearranged, zeros).shape))
    ranks = {len(p) for p in pieces}
    axis = self.parameters_concat_axis
    if len(ranks) != 1:
      raise self._layout_error(
        f"the rearranged parameters have shapes {pieces}, of different "
        "ranks, and cannot be concatenated"
      )
    (rank,) = ranks
    if (
      not isinstance(axis, int)
      or isinstance(axis, bool)
      or not -rank <= axis < rank
    ):
      raise self._layout_error(
        f"the concatenation axis must be an int in [{-rank}, {rank}) for "
        f"rearranged parameters of rank {rank}"
      )
    others = {p[: axis % rank] + p[axis % rank + 1 :] for p in pieces}
    if len(others) != 1:
      raise self._layout_error(
        f"the rearranged parameters have shapes {pieces}, which differ "
        f"along axes other than {axis} and cannot be concatenated"
      )
    concatenated = list(pieces[0])
    concatenated[axis % rank] = sum(p[axis % rank] for p in pieces)
    expected = self._expected_array_shape()
    if expected is not None and tuple(concatenated) != tuple(expected):
      raise self._layout_error(
        f"they form an array of shape {tuple(concatenated)}, but the block's "
        f"statistics need shape {tuple(expected)} (a "
        f"{len(expected)}-D array, one axis per factor: input side, then "
        "output side); give specs that lay the parameters out that way"
      )
    return pieces

  @property
  def array_shape(self) -> tuple[int, ...]:
    """The shape of the array the parameters are laid out as."""
    rank = len(self._piece_shapes[0])
    axis = self.parameters_concat_axis % rank
    shape = list(self._piece_shapes[0])
    shape[axis] = sum(p[axis] for p in self._piece_shapes)
    return tuple(shape)

  @property
  def array_ndim(self) -> int:
    """The rank of that array (the number of factors it has)."""
    return len(self.array_shape)

  def parameters_shaped_list_to_array(
    self, parameters_shaped_list: Sequence[jax.Array]
  ) -> jax.Array:
    """Lays a block vector out as one array.

    Args:
      parameters_shaped_list: one array per parameter, shaped as
        `parameters_shapes`.

    Returns:
      The parameters rearranged by their specs and concatenated along
      `parameters_concat_axis`, of shape `array_shape`.
    """
    pieces = [
      utils.rearrange(jnp.asarray(p), spec)
      for p, spec in zip(
        parameters_shaped_list, self.parameters_specs, strict=True
      )
    ]
    if len(pieces) == 1:
      return pieces[0]
    return jnp.concatenate(pieces, axis=self.parameters_concat_axis)

  def array_to_parameters_shaped_list(
    self, array: jax.Array
  ) -> tuple[jax.Array, ...]:
    """Inverts `parameters_shaped_list_to_array`.

    Args:
      array: of shape `array_shape`.

    Returns:
      One array per parameter, shaped as `parameters_shapes`.
    """
    rank = len(self._piece_shapes[0])
    axis = self.parameters_concat_axis % rank
    result = []
    start = 0
    for spec, shape, piece_shape in zip(
      self.parameters_specs, self.parameters_shapes, self._piece_shapes
    ):
      stop = start + piece_shape[axis]
      piece = lax.slice_in_dim(array, start, stop, axis=axis)
      start = stop
      result.append(utils.unrearrange(piece, spec, shape))
    return tuple(result)


def _row_spec(rank: int) -> str:
  """A spec laying a parameter of this rank out as one row."""
  if rank == 0:
    return " -> 11"
  letters = _ALPHABET[:rank]
  return f"{letters} -> 1{_group(letters)}"


class TwoKroneckerFactored(ParametersArrayLayout):
  """`A ⊗ G` with `A` from the layer inputs and `G` from the output tangents.

  The factors act on the parameters laid out as one `(input_size,
  output_size)` matrix by `parameters_specs` (KFAC-JAX's keyword options,
  see `ParametersArrayLayout`): rows on the input side (`A`), columns on
  the output side (`G`). The statistics fix that matrix's shape; specs that
  give another shape are refused when the block is built.

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

  def _expected_array_shape(self) -> tuple[int, ...]:
    """`(input_size, output_size)`: the factors' sides."""
    return (self.input_size(), self.output_size())

  def _to_matrix(self, vector):
    """Parameters-shaped tuple -> `(input_size, output_size)` matrix."""
    return self.parameters_shaped_list_to_array(vector)

  def _from_matrix(self, matrix):
    """Inverts `_to_matrix`."""
    return self.array_to_parameters_shaped_list(matrix)

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
    updates.update(
      power_entries(
        exact_powers,
        approx_powers,
        identity_weight,
        a.dtype,
        lambda p: _approx_power_entry(a, g, identity_weight, p),
      )
    )
    return updates


# A factor's inverse is cached as its Cholesky root `L⁻¹` (in blocks, see
# `utils.psd_inverse_root`) instead when the factor is big and the other one
# small: the parameter matrix then has few columns (or rows) for the root's
# two products, and the root is much cheaper to refresh than the inverse.
_ROOT_MIN_SIZE = 1024
_ROOT_MIN_RATIO = 8


def power_entries(
  exact_powers, approx_powers, identity_weight, dtype, approx_entry
) -> dict[str, Any]:
  """The cache entries of a Kronecker-factored block's powers.

  An exact power keeps only its identity weight (the eigendecompositions it
  uses are shared by all exact powers and cached apart); an approximate one
  keeps `approx_entry(power)`.
  """
  entries: dict[str, Any] = {
    base.cache_key(p, exact=True): jnp.asarray(identity_weight, dtype)
    for p in exact_powers
  }
  for p in approx_powers:
    entries[base.cache_key(p, exact=False)] = approx_entry(p)
  return entries


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

  def _default_parameters_specs(self) -> list[str]:
    """The weight as `x @ W` uses it (the specs `weight_to_matrix` follows),
    then the bias as one row: `"ab -> (a)b"` for a `(d_in, d_out)` weight,
    `"ab -> ba"` for an output-major one (`transposed_weight`), `"abc ->
    (ab)c"` for a `(2, 3, d_out)` weight on 6 input features."""
    shape = self.parameters_shapes[0]
    letters = _ALPHABET[: len(shape)]
    split = tags.dense_weight_split(
      shape, self.weight_matrix_shape[0], self.transposed_weight
    )
    assert split is not None  # `_check_layer` has checked it
    lead, rest = letters[:split], letters[split:]
    if self.transposed_weight:  # (outputs..., inputs...)
      weight = f"{letters} -> {_group(rest)}{_group(lead)}"
    else:
      weight = f"{letters} -> ({lead}){_group(rest)}"
    return [weight] + [_row_spec(len(s)) for s in self.parameters_shapes[1:]]

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
    gram = array_math.symmetric_gram
    return gram(x) / batch_size, gram(dy) / batch_size

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

  With `use_masking` (KFAC-JAX 0.0.8's default), a row (one example at one
  position) whose output tangents are all zero, in every sample, is taken
  for padding: its input row, bias entry included, is left out of `A`, and
  the number of rows the estimate is normalised by is the number of rows
  left. The state then also keeps `average_repeats`, a moving average
  (weighted as the factors are) of the number of rows left per example,
  and `state_dependent_scale()` is `R / average_repeats`: the block is
  `(X̃ᵀX̃ / B) ⊗ (dYᵀdY / B) / average_repeats` over the rows left, which
  is the unmasked estimate when no row is masked. Families built on this
  block that keep a state of their own (`DenseEKFAC`) do not mask.
  """

  @jax.tree_util.register_dataclass
  @dataclasses.dataclass(frozen=True)
  class State(TwoKroneckerFactored.State):
    """The Kronecker state with the average number of rows kept.

    Attributes:
      average_repeats: a WeightedMovingAverage of the number of rows per
        example that were not masked, a scalar.
    """

    average_repeats: utils.WeightedMovingAverage

  def __init__(
    self,
    layer_tag_eq: Any,
    name: str | None = None,
    use_masking: bool = True,
    parameters_specs: Sequence[str] | None = None,
    parameters_concat_axis: int = 0,
  ):
    """Builds the block.

    Args:
      layer_tag_eq: the dense or repeated dense tag's jaxpr equation.
      name: the block's name in messages.
      use_masking: whether rows whose output tangents are all zero are
        left out of the estimate (see the class docstring); False averages
        over all `B * R` rows.
      parameters_specs: one rearrange spec per parameter, as for
        `TwoKroneckerFactored`; None lays the weight out as `x @ W` uses it
        with the bias as the last row.
      parameters_concat_axis: the axis the rearranged parameters are
        concatenated along.

    Raises:
      ValueError: if the tag does not fit the block or the specs do not
        give an `(input_size, output_size)` matrix.
    """
    self._use_masking = bool(use_masking)
    super().__init__(
      layer_tag_eq,
      name,
      parameters_specs=parameters_specs,
      parameters_concat_axis=parameters_concat_axis,
    )

  @property
  def use_masking(self) -> bool:
    """Whether rows with all-zero output tangents are left out."""
    return self._use_masking

  @property
  def num_repeats(self) -> int:
    """`R`, the number of applications of the layer within an example."""
    (x_shape,) = self.inputs_shapes
    return utils.product(x_shape[1:-1])

  # False in subclasses that keep a state of their own (without the count).
  _CAN_MASK_REPEATS: bool = True

  def _masks_repeats(self) -> bool:
    """Whether this block masks: asked to, and able to."""
    return self._use_masking and self._CAN_MASK_REPEATS

  def fixed_scale(self):
    return self.num_repeats

  def state_dependent_scale(self, state):
    """`R / average_repeats` when masking (1 before any row is kept)."""
    if not self._masks_repeats():
      return super().state_dependent_scale(state)
    average = state.average_repeats.value
    repeats = jnp.asarray(self.num_repeats, average.dtype)
    return repeats / jnp.where(average > 0, average, repeats)

  def _init(self, rng, exact_powers, approx_powers, cache_eigenvalues):
    state = super()._init(rng, exact_powers, approx_powers, cache_eigenvalues)
    if not self._masks_repeats():
      return state
    return RepeatedDenseTwoKroneckerFactored.State(
      cache=state.cache,
      inputs_factor=state.inputs_factor,
      outputs_factor=state.outputs_factor,
      average_repeats=utils.WeightedMovingAverage.zeros(
        (), self.parameters_dtype
      ),
    )

  def _batch_statistics(self, estimation_data, batch_size):
    rows = batch_size * self.num_repeats
    if not self._masks_repeats():
      return super()._batch_statistics(estimation_data, rows)
    (dy,) = estimation_data["outputs_tangent"]  # (S, B, r1, ..., d_out)
    x, dy_rows = self._rows(estimation_data["inputs"], (dy,))
    # A row is kept when some sample's tangent there is nonzero.
    kept = jnp.any(dy.reshape(dy.shape[0], -1, dy.shape[-1]) != 0, axis=(0, 2))
    x = x * kept[:, None].astype(x.dtype)
    kept_per_example = jnp.sum(kept).astype(x.dtype) / batch_size
    gram = array_math.symmetric_gram
    return gram(x) / rows, gram(dy_rows) / rows, kept_per_example

  def _fold_statistics(self, state, stats, ema_old, ema_new):
    if not self._masks_repeats():
      return super()._fold_statistics(state, stats, ema_old, ema_new)
    a, g, repeats = stats
    state = super()._fold_statistics(state, (a, g), ema_old, ema_new)
    return dataclasses.replace(
      state,
      average_repeats=state.average_repeats.updated(repeats, ema_old, ema_new),
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

  def _default_parameters_specs(self) -> list[str]:
    """The kernel as `(kernel_h * kernel_w * in_channels, out_channels)` in
    the patch layout (`"abcd -> (abc)d"` for HWIO, `"abcd -> (cdb)a"` for
    OIHW), then the bias as one row."""
    h, w, c_in, c_out = (_ALPHABET[i] for i in self._kernel_axes())
    kernel = f"{_ALPHABET[:4]} -> ({h}{w}{c_in}){c_out}"
    return [kernel] + [_row_spec(len(s)) for s in self.parameters_shapes[1:]]

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
