"""Block-tridiagonal K-FAC (Martens & Grosse, 2015, Section 4.3).

Consecutive dense layers are coupled. With `Ā_ij = E[ā_i ā_jᵀ]` (inputs with
an appended 1 for the bias) and `G_ij = E[g_i g_jᵀ]` (output derivatives),
K-FAC's Kronecker-factored curvature `F̃` has blocks `F̃_ij = Ā_ij ⊗ G_ij`.
The approximation `F̂` is the covariance of a Gaussian chain in which each
layer's gradient depends only on the next layer's: it agrees with `F̃` on the
diagonal and first off-diagonal blocks, and its inverse is block-tridiagonal,

  F̂⁻¹ = Ξᵀ Λ Ξ,  Ξ = I with -Ψ_i on the superdiagonal,
  Λ = diag(Σ_{1|2}⁻¹, ..., Σ_{m-1|m}⁻¹, F̃_mm⁻¹),

where `Ψ_i = F̃_{i,i+1} F̃_{i+1,i+1}⁻¹ = Ψᴬ_i ⊗ Ψᴳ_i` and
`Σ_{i|i+1} = F̃_ii - Ψ_i F̃_{i+1,i+1} Ψ_iᵀ = A_i ⊗ G_i - C_i ⊗ D_i`, a
difference of Kronecker products. Its inverse comes from two generalized
eigenproblems (`C k = s A k`, `D k = s G k`): with `K₁ᵀ A K₁ = I`,
`K₁ᵀ C K₁ = diag(s₁)` and likewise `K₂, s₂`,
`Σ⁻¹ = (K₁ ⊗ K₂) diag(1 / (1 - s₁ ⊗ s₂)) (K₁ ⊗ K₂)ᵀ` (the paper's Appendix B).
Every product is a few small matrix products per layer: no dense inverse.

Damping follows the paper: the diagonal blocks' factors are damped as in
block-diagonal K-FAC (the pi-adjusted split of `λ`) wherever they appear,
the off-diagonal factors are not, and `F̂` is rebuilt from those.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
from jax.scipy import linalg as jsl

from estimators import blocks as curvature_blocks
from estimators import curvature, tags, utils
from estimators.blocks.base import Numeric, ScalarOrSequence, canonical_powers
from estimators.utils import distributed
from estimators.utils.types import FuncArgs, Params


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LinkState:
  """The coupling of two consecutive layers `i`, `i + 1`.

  Attributes:
    inputs_cross: a WeightedMovingAverage of `Ā_{i,i+1}`.
    outputs_cross: a WeightedMovingAverage of `G_{i,i+1}`.
    cache: `Ψᴬ_i`, `Ψᴳ_i` and the generalized eigendecompositions of
      `Σ_{i|i+1}` at the last `update_cache` (empty without a cached
      inverse).
  """

  inputs_cross: utils.WeightedMovingAverage
  outputs_cross: utils.WeightedMovingAverage
  cache: dict


def _is_chain_layer(block) -> bool:
  # The coupling formulas hold for K-FAC's own statistics on layers with one
  # row per example; subclasses (EKFAC, TNT) estimate something else.
  return (
    type(block) is curvature_blocks.DenseTwoKroneckerFactored
    and block.layer_tag_primitive is tags.dense
  )


def _as_matrix(block, vector):
  """A dense layer's `(w, [b])` as the `(inputs + bias, outputs)` matrix."""
  w = block.weight_to_matrix(vector[0])
  if not block.has_bias:
    return w
  return jnp.concatenate([w, vector[1].reshape(1, -1)])


def _as_vector(block, matrix):
  if not block.has_bias:
    return (block.weight_from_matrix(matrix),)
  return (
    block.weight_from_matrix(matrix[:-1]),
    matrix[-1].reshape(block.parameters_shapes[1]),
  )


def _rows(block, data):
  """The layer's inputs (bias column appended) and output tangents."""
  (x,), (dy,) = data["inputs"], data["outputs_tangent"]
  if block.has_bias:
    x = jnp.concatenate([x, jnp.ones_like(x[:, :1])], axis=1)
  return x, dy


def _psd_pinv(matrix):
  """A PSD pseudo-inverse that drops eigenvalues below sqrt(eps) * max.

  `Ψ = Ā A⁺` enters `F̂` through cancelling terms whose round-off grows with
  the kept condition number; truncating there keeps it near sqrt(eps),
  while `F̂`'s diagonal blocks stay `A ⊗ G` exactly (`A⁺ A A⁺ = A⁺` for any
  truncation) and its off-diagonal ones move by about eps^(1/4).
  """
  values, vectors = utils.safe_psd_eigh(matrix)
  cutoff = values[-1] * jnp.sqrt(jnp.finfo(matrix.dtype).eps)
  inverse = jnp.where(values > cutoff, 1 / jnp.where(values > 0, values, 1), 0)
  return (vectors * inverse) @ vectors.T


def _generalized_eigh(other, base):
  """`(s, K)` with `Kᵀ base K = I`, `Kᵀ other K = diag(s)`; base PD."""
  root = jnp.linalg.cholesky(utils.symmetrize(base))
  half = jsl.solve_triangular(root, other, lower=True)
  whitened = jsl.solve_triangular(root, half.T, lower=True)
  values, vectors = jnp.linalg.eigh(utils.symmetrize(whitened))
  return values, jsl.solve_triangular(root.T, vectors, lower=False)


@dataclasses.dataclass(frozen=True)
class _Factors:
  """One layer's (possibly damped) factors and, towards the next layer of
  its chain, `Ψᴬ`, `Ψᴳ`, `C = Ψᴬ Ā_crossᵀ` and `D = Ψᴳ G_crossᵀ`."""

  a: jax.Array
  g: jax.Array
  psi: tuple | None = None
  cd: tuple | None = None


class BlockTridiagonalCurvature(curvature.BlockDiagonalCurvature):
  """Block-tridiagonal K-FAC over chains of consecutive dense layers.

  Layers are visited in the order the model applies them; a maximal run of
  plain dense tags with `DenseTwoKroneckerFactored` blocks forms a chain,
  and any other layer (a convolution, a normalisation, a block of another
  type) ends it. Chains are coupled as in the module docstring; layers in
  no chain of two or more keep their own block, as in
  `BlockDiagonalCurvature`, whose constructor arguments this takes.

  Products: `multiply` (power 1) with `exact_power=True` is `F̂ + λI`
  (pseudo-inverses stand in for singular factors); with `exact_power=False`
  it is the paper's damped approximation. `multiply_inverse` (power -1)
  needs `exact_power=False` (`(F̂ + λI)⁻¹` has no such structure) and gives
  the inverse of the damped approximation, which is what `update_cache`
  caches (as `approx_powers=-1`). Other powers are not offered. Power 1
  always uses the current estimate.
  """

  # The methods below take this State, narrower than the base class's (so
  # each `state` is a `type: ignore[override]`).
  @jax.tree_util.register_dataclass
  @dataclasses.dataclass(frozen=True)
  class State(curvature.BlockDiagonalCurvature.State):
    """Block-diagonal state plus one `LinkState` per coupled pair.

    Attributes:
      links: in `links` order.
    """

    links: tuple = ()

  # --- structure ---------------------------------------------------------

  def _finalize(self, func_args):
    if self._blocks is not None:
      return
    super()._finalize(func_args)
    blocks = self._require_finalized()
    position = {id(e): i for i, e in enumerate(self.jaxpr.jaxpr.eqns)}
    order = sorted(
      range(self.num_blocks),
      key=lambda j: position.get(id(self.jaxpr.layer_tags[j]), np.inf),
    )
    chains, run = [], []
    for j in order + [None]:
      if j is not None and _is_chain_layer(blocks[j]):
        run.append(j)
        continue
      if len(run) > 1:
        chains.append(tuple(run))
      run = []
    self._chains = tuple(chains)

  def _chain_block(self, j: int) -> curvature_blocks.DenseTwoKroneckerFactored:
    """Block `j`, a layer of a chain (so a dense K-FAC block)."""
    return cast(
      curvature_blocks.DenseTwoKroneckerFactored, self._require_finalized()[j]
    )

  @property
  def chains(self) -> tuple[tuple[int, ...], ...]:
    """The coupled chains: block indices in the order the model applies them."""
    self._require_finalized()
    return self._chains

  @property
  def links(self) -> tuple[tuple[int, int], ...]:
    """Each coupled pair of consecutive layers, as block indices."""
    return tuple(
      pair for chain in self.chains for pair in zip(chain[:-1], chain[1:])
    )

  # --- state -------------------------------------------------------------

  def init(
    self,
    rng: jax.Array,
    func_args: FuncArgs,
    exact_powers_to_cache: ScalarOrSequence = None,
    approx_powers_to_cache: ScalarOrSequence = None,
    cache_eigenvalues: bool = False,
  ) -> State:
    """Builds the blocks and chains; see `CurvatureEstimator.init`.

    Raises:
      ValueError: for cached powers other than the approximate inverse.
    """
    exact = canonical_powers(exact_powers_to_cache)
    approx = canonical_powers(approx_powers_to_cache)
    if exact or set(approx) - {-1}:
      raise ValueError(
        "BlockTridiagonalCurvature caches only the inverse of the paper's "
        "damped approximation: pass exact_powers_to_cache=None and "
        f"approx_powers_to_cache=-1 (got exact={exact}, approx={approx})."
      )
    base = super().init(rng, func_args, None, approx, cache_eigenvalues)
    links = []
    for i, j in self.links:
      block_i, block_j = self._chain_block(i), self._chain_block(j)
      a_i, g_i = block_i.input_size(), block_i.output_size()
      a_j, g_j = block_j.input_size(), block_j.output_size()
      dtype = block_i.parameters_dtype
      cache = {}
      if approx:  # `_link_cache`'s entries, for the first layer's `Σ`
        shapes = dict(
          inputs_psi=(a_i, a_j),
          outputs_psi=(g_i, g_j),
          inputs_basis=(a_i, a_i),
          inputs_values=(a_i,),
          outputs_basis=(g_i, g_i),
          outputs_values=(g_i,),
        )
        cache = {k: jnp.zeros(shape, dtype) for k, shape in shapes.items()}
      zeros = utils.WeightedMovingAverage.zeros
      links.append(
        LinkState(zeros((a_i, a_j), dtype), zeros((g_i, g_j), dtype), cache)
      )
    return self.State(base.blocks_states, tuple(links))

  def update_curvature_matrix_estimate(
    self,
    state: State,  # type: ignore[override]
    ema_old: Numeric,
    ema_new: Numeric,
    batch_size: Numeric,
    rng: jax.Array,
    func_args: FuncArgs,
    pmap_axis_name: str | None = None,
    estimation_mode: str | None = None,
    identity_weight: Numeric | None = None,
  ) -> State:
    del identity_weight  # the estimates do not depend on the damping
    data = self.blocks_estimation_data(
      func_args, rng, estimation_mode, batch_size
    )
    blocks = self._require_finalized()
    blocks_states = tuple(
      curvature.update_block_estimate(
        b, s, d, ema_old, ema_new, batch_size, pmap_axis_name
      )
      for b, s, d in zip(blocks, state.blocks_states, data)
    )
    links = []
    for (i, j), link in zip(self.links, state.links):
      x_i, dy_i = _rows(blocks[i], data[i])
      x_j, dy_j = _rows(blocks[j], data[j])
      cross = (
        x_i.T @ x_j / batch_size,
        jnp.einsum("sbo,sbp->op", dy_i, dy_j) / batch_size,
      )
      if pmap_axis_name is not None:
        cross = jax.lax.pmean(cross, pmap_axis_name)
      links.append(
        dataclasses.replace(
          link,
          inputs_cross=link.inputs_cross.updated(cross[0], ema_old, ema_new),
          outputs_cross=link.outputs_cross.updated(cross[1], ema_old, ema_new),
        )
      )
    return self.State(blocks_states, tuple(links))

  def update_cache(
    self,
    state: State,  # type: ignore[override]
    identity_weight: Numeric | Sequence[Numeric],
    exact_powers: ScalarOrSequence = None,
    approx_powers: ScalarOrSequence = None,
    eigenvalues: bool = False,
    pmap_axis_name: str | None = None,
    norm_to_scale_identity_weight_per_block: str | None = None,
  ) -> State:
    """Refreshes the cached damped inverse (`approx_powers=-1`).

    A chain's layers but its last are not refreshed as blocks (their
    inverse comes from the links); the other blocks are, as in
    block-diagonal K-FAC (with `matrix_power_method`; the links always use
    generalized eigendecompositions).
    """
    if norm_to_scale_identity_weight_per_block not in (None, "none"):
      raise ValueError(
        "BlockTridiagonalCurvature does not scale the damping by block "
        "norms: leave norm_to_scale_identity_weight_per_block out."
      )
    blocks = self._require_finalized()
    exact, approx = (
      canonical_powers(exact_powers),
      canonical_powers(approx_powers),
    )
    if exact or set(approx) - {-1}:
      raise ValueError(
        "BlockTridiagonalCurvature refreshes only "
        f"approx_powers=-1, not exact={exact}, approx={approx}."
      )
    weights = self._per_block(identity_weight, "identity_weight")
    inner = {i for i, _ in self.links}
    # The pieces of work: each block refreshed as a block (all but a chain's
    # inner layers) and each chain's links.
    own = [j for j in range(self.num_blocks) if j not in inner]
    fns: list[Callable[..., Any]] = [
      lambda s, j=j: blocks[j].update_cache(
        s, weights[j], None, approx, eigenvalues=eigenvalues
      )
      for j in own
    ]
    args: list[Any] = [state.blocks_states[j] for j in own]
    costs = [distributed.refresh_cost(a) for a in args]
    chains = self.chains if approx else ()
    for chain in chains:
      fns.append(
        lambda st, chain=chain: tuple(
          _link_cache(f)
          for f in self._chain_factors(
            st, weights, damped=True, chains=[chain]
          ).values()
          if f.psi
        )
      )
      args.append(state)
      costs.append(distributed.refresh_cost(self._chain_states(state, chain)))
    axis = pmap_axis_name if self.distributed_cache_updates else None
    results = iter(self._refresh(fns, args, costs, axis))
    blocks_states = list(state.blocks_states)
    for j, refreshed in zip(
      own,
      self._newton_verdicts(
        [state.blocks_states[j] for j in own], [next(results) for _ in own]
      ),
    ):
      blocks_states[j] = refreshed
    caches: dict[int, dict[str, jax.Array]] = {}
    for chain in chains:
      caches.update(zip(chain, next(results)))
    links = tuple(
      dataclasses.replace(link, cache=caches[i]) if i in caches else link
      for (i, _), link in zip(self.links, state.links)
    )
    return self.State(tuple(blocks_states), links)

  def _chain_states(self, state, chain):
    """The block states and link states of one chain."""
    return (
      [state.blocks_states[j] for j in chain],
      [link for (i, _), link in zip(self.links, state.links) if i in chain],
    )

  # --- products ------------------------------------------------------------

  def _chain_factors(self, state, weights, damped, chains=None):
    """Per layer of `chains` (all by default): its factors (damped or not)
    and its link's terms."""
    factors = {}
    for chain in self.chains if chains is None else chains:
      for j in chain:
        s = state.blocks_states[j]
        a, g = s.inputs_factor.value, s.outputs_factor.value
        if damped:
          a, g = utils.pi_adjusted_kronecker_damping(a, g, weights[j])
        factors[j] = _Factors(a, g)
    for (i, j), link in zip(self.links, state.links):
      if i not in factors:
        continue
      inverse = jnp.linalg.inv if damped else _psd_pinv
      a_cross, g_cross = link.inputs_cross.value, link.outputs_cross.value
      psi = (a_cross @ inverse(factors[j].a), g_cross @ inverse(factors[j].g))
      factors[i] = dataclasses.replace(
        factors[i], psi=psi, cd=(psi[0] @ a_cross.T, psi[1] @ g_cross.T)
      )
    return factors

  def multiply_matpower(
    self,
    state: State,  # type: ignore[override]
    parameter_structured_vector: Params,
    identity_weight: Numeric | Sequence[Numeric],
    power: float,
    exact_power: bool,
    use_cached: bool,
    pmap_axis_name: str | None = None,
    norm_to_scale_identity_weight_per_block: str | None = None,
  ) -> Params:
    if norm_to_scale_identity_weight_per_block not in (None, "none"):
      raise ValueError(
        "BlockTridiagonalCurvature does not scale the damping by block "
        "norms: leave norm_to_scale_identity_weight_per_block out."
      )
    if power not in (1, -1):
      raise ValueError(
        "BlockTridiagonalCurvature multiplies by its estimate "
        f"(power 1) or its damped inverse (power -1), not power "
        f"{power}."
      )
    if power == -1 and exact_power:
      raise ValueError(
        "The inverse of the block-tridiagonal estimate plus a multiple of "
        "the identity has no tridiagonal structure; use exact_power=False "
        "for the inverse of the paper's damped approximation."
      )
    vectors = self.params_vector_to_blocks_vectors(parameter_structured_vector)
    blocks = self._require_finalized()
    weights = self._per_block(identity_weight, "identity_weight")
    in_chain = {j for chain in self.chains for j in chain}
    # The pieces of work: each uncoupled block's product, each chain's.
    single = [j for j in range(self.num_blocks) if j not in in_chain]
    # Each takes its (state, vector) or (estimator state, blocks' vectors).
    fns: list[Callable[..., Any]] = [
      lambda args, j=j: blocks[j].multiply_matpower(
        args[0],
        args[1],
        weights[j],
        power,
        exact_power=exact_power,
        use_cached=use_cached,
      )
      for j in single
    ]
    args: list[tuple[Any, Any]] = [
      (state.blocks_states[j], vectors[j]) for j in single
    ]
    costs = [
      distributed.product_cost(a[0], blocks[j].dim)
      for j, a in zip(single, args)
    ]
    for chain in self.chains:
      fns.append(
        lambda args, chain=chain: self._chain_product(
          chain, args[0], args[1], weights, power, exact_power, use_cached
        )
      )
      args.append((state, vectors))
      costs.append(
        distributed.product_cost(
          self._chain_states(state, chain),
          sum(blocks[j].dim for j in chain),
        )
      )
    axis = pmap_axis_name if self.distributed_multiplies else None
    results = iter(distributed.map_blocks(fns, args, costs, axis))
    out = list(vectors)
    for j in single:
      out[j] = next(results)
    for chain in self.chains:
      for j, result in zip(chain, next(results)):
        out[j] = result
    return self.blocks_vectors_to_params_vector(tuple(out))

  def _chain_product(
    self, chain, state, vectors, weights, power, exact_power, use_cached
  ):
    """One chain's part of `multiply_matpower`: its layers' results."""
    results = list(vectors)
    damped = not exact_power
    if power == 1:
      factors = self._chain_factors(state, weights, damped, chains=[chain])
      self._chain_multiply(chain, factors, results)
      if not damped:
        for j in chain:
          results[j] = tuple(
            r + weights[j] * v for r, v in zip(results[j], vectors[j])
          )
    else:
      caches = (
        {i: link.cache for (i, _), link in zip(self.links, state.links)}
        if use_cached
        else {
          i: _link_cache(f)
          for i, f in self._chain_factors(
            state, weights, damped=True, chains=[chain]
          ).items()
          if f.psi
        }
      )
      root = chain[-1]
      self._chain_inverse(
        chain,
        caches,
        results,
        lambda v: (
          self._require_finalized()[root].multiply_inverse(
            state.blocks_states[root],
            v,
            weights[root],
            exact_power=False,
            use_cached=use_cached,
          )
        ),
      )
    return tuple(results[j] for j in chain)

  def _chain_multiply(self, chain, factors, vectors):
    """`F̂ v = Ξ⁻¹ Λ⁻¹ Ξ⁻ᵀ v` over one chain, in place in `vectors`."""
    blocks = [self._chain_block(j) for j in chain]
    v = [_as_matrix(b, vectors[j]) for b, j in zip(blocks, chain)]
    f = [factors[j] for j in chain]
    for k in range(1, len(v)):  # z = Ξ⁻ᵀ v
      psi_a, psi_g = f[k - 1].psi
      v[k] = v[k] + psi_a.T @ v[k - 1] @ psi_g
    for k in range(len(v)):  # Λ⁻¹: the conditional covariances
      y = f[k].a @ v[k] @ f[k].g
      if f[k].cd is not None:
        c, d = f[k].cd
        y = y - c @ v[k] @ d
      v[k] = y
    for k in range(len(v) - 2, -1, -1):  # Ξ⁻¹
      psi_a, psi_g = f[k].psi
      v[k] = v[k] + psi_a @ v[k + 1] @ psi_g.T
    for b, j, m in zip(blocks, chain, v):
      vectors[j] = _as_vector(b, m)

  def _chain_inverse(self, chain, caches, vectors, root_inverse: Callable):
    """`F̆⁻¹ v = Ξᵀ Λ Ξ v` over one chain, in place in `vectors`."""
    blocks = [self._chain_block(j) for j in chain]
    v = [_as_matrix(b, vectors[j]) for b, j in zip(blocks, chain)]
    c = [caches.get(j) for j in chain]
    u = [
      v[k] - c[k]["inputs_psi"] @ v[k + 1] @ c[k]["outputs_psi"].T
      for k in range(len(v) - 1)
    ] + [v[-1]]
    w = []
    for k in range(len(blocks) - 1):
      k_a, k_g = c[k]["inputs_basis"], c[k]["outputs_basis"]
      grid = 1 - jnp.outer(c[k]["inputs_values"], c[k]["outputs_values"])
      w.append(k_a @ ((k_a.T @ u[k] @ k_g) / grid) @ k_g.T)
    w.append(
      _as_matrix(blocks[-1], root_inverse(_as_vector(blocks[-1], u[-1])))
    )
    for k in range(len(w) - 1, 0, -1):  # Ξᵀ
      w[k] = (
        w[k] - c[k - 1]["inputs_psi"].T @ w[k - 1] @ c[k - 1]["outputs_psi"]
      )
    for b, j, m in zip(blocks, chain, w):
      vectors[j] = _as_vector(b, m)

  def multiply_inverse_of_gradient(
    self,
    state: State,  # type: ignore[override]
    grads: Params,
    func_args: FuncArgs,
    identity_weight: Numeric | Sequence[Numeric] = 0.0,
    exact_power: bool = False,
    use_cached: bool = False,
    pmap_axis_name: str | None = None,
  ) -> Params:
    """`multiply_inverse(grads)`; coupled layers need the whole gradient."""
    del func_args
    return self.multiply_inverse(
      state,
      grads,
      identity_weight,
      exact_power=exact_power,
      use_cached=use_cached,
      pmap_axis_name=pmap_axis_name,
    )

  # --- dense exports -------------------------------------------------------

  def to_dense_matrix(
    self,
    state: State,  # type: ignore[override]
    use_cached: bool = False,
    identity_weight: Numeric | Sequence[Numeric] = 0.0,
    exact_power: bool = True,
    power: float = 1,
  ) -> jax.Array:
    """`(C + identity_weight I) ** power` as a dense matrix, couplings
    included, in `ravel_pytree` order; see `multiply_matpower`."""
    self._require_finalized()
    shapes = [v.aval.shape for v in self.jaxpr.params_vars_flat]
    dtype = jnp.result_type(
      *[v.aval.dtype for v in self.jaxpr.params_vars_flat]
    )
    zeros = jax.tree.unflatten(
      self.jaxpr.params_tree, [jnp.zeros(s, dtype) for s in shapes]
    )
    _, unravel = jax.flatten_util.ravel_pytree(zeros)

    def column(e):
      out = self.multiply_matpower(
        state,
        unravel(e),
        identity_weight,
        power,
        exact_power=exact_power,
        use_cached=use_cached,
      )
      return jax.flatten_util.ravel_pytree(out)[0]

    return jax.vmap(column, out_axes=1)(jnp.eye(self.dim, dtype=dtype))

  def eigenvalues(
    self,
    state: State,  # type: ignore[override]
    use_cached: bool = False,
  ) -> jax.Array:
    """Eigenvalues of the undamped estimate: the uncoupled blocks' own, and
    each chain's from its dense matrix (so chains must be small enough)."""
    if use_cached:
      raise ValueError(
        "BlockTridiagonalCurvature does not cache eigenvalues;"
        " use use_cached=False."
      )
    in_chain = {j for chain in self.chains for j in chain}
    values = [
      b.eigenvalues(s, use_cached=False)
      for j, (b, s) in enumerate(
        zip(self._require_finalized(), state.blocks_states)
      )
      if j not in in_chain
    ]
    dense = self.to_dense_matrix(state)
    offsets = np.concatenate([[0], np.cumsum(self._param_sizes)])
    for chain in self.chains:
      where = np.concatenate(
        [
          np.arange(offsets[i], offsets[i + 1])
          for j in chain
          for i in self.jaxpr.layer_indices[j]
        ]
      )
      values.append(utils.psd_eigvalsh(dense[np.ix_(where, where)]))
    return jnp.concatenate(values)


def _link_cache(factors: _Factors) -> dict:
  """A link's cached terms for the inverse of its first layer's `Σ`."""
  # A layer followed by another in its chain: `psi` and `cd` are set.
  psi, (c, d) = cast(tuple, factors.psi), cast(tuple, factors.cd)
  a_values, a_basis = _generalized_eigh(c, factors.a)
  g_values, g_basis = _generalized_eigh(d, factors.g)
  return dict(
    inputs_psi=psi[0],
    outputs_psi=psi[1],
    inputs_basis=a_basis,
    inputs_values=a_values,
    outputs_basis=g_basis,
    outputs_values=g_values,
  )
