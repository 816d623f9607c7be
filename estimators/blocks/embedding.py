"""K-FAC for embedding lookups, `y = one_hot(ids) @ W` with `W: (V, D)`.

An embedding is a dense layer on one-hot inputs. Its K-FAC input factor
`A = mean over rows of e_id e_idᵀ = diag(token frequencies)` is diagonal,
so it is kept as a `(V,)` vector and never as a `V x V` matrix; the output
factor `G` is dense, `(D, D)`. Each position of a sequence counts as a row
(K-FAC-expand, Eschenhagen et al., NeurIPS 2023): both factors average over
examples and positions, and `fixed_scale()` is the number of positions, as
for `RepeatedDenseKFACExpand`, whose statistics on the one-hot inputs these
equal. (K-FAC-reduce would average the one-hot inputs over positions, which
leaves the factor dense; this block is used for embeddings under both.)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from estimators import tags
from estimators import utils
from estimators.blocks import base


class EmbeddingKFAC(base.CurvatureBlock):
  """`diag(a) ⊗ G` for an embedding tag; the table `W` is the `(V, D)`
  matrix of the Kronecker convention `(A ⊗ G) vec(W) = A W G`.

  Exact powers need only `G`'s eigendecomposition (`diag(a)` is its own);
  approximate powers damp both factors with the pi-adjusted rule.
  """

  _TAG_PRIMITIVES = (tags.embedding,)
  _REQUIRED_DATA = ("inputs", "outputs_tangent")

  @jax.tree_util.register_dataclass
  @dataclasses.dataclass(frozen=True)
  class State(base.CurvatureBlock.State):
    """Attributes: `inputs_factor`, the moving average of `a`, `(V,)`;
    `outputs_factor`, that of `G`, `(D, D)`."""
    inputs_factor: utils.WeightedMovingAverage
    outputs_factor: utils.WeightedMovingAverage

  def _check_layer(self):
    (w,), (ids,) = self.parameters_shapes, self.inputs_shapes
    if len(w) != 2 or not ids:
      raise ValueError(f"Block {self.name!r}: an embedding tag needs ids "
                       f"(batch, ...) and a (vocab, d_out) table, got ids "
                       f"{ids} and table {w}.")

  @property
  def vocab_size(self) -> int:
    return self.parameters_shapes[0][0]

  @property
  def num_repeats(self) -> int:
    """Positions per example (1 for ids of shape `(batch,)`)."""
    return utils.product(self.inputs_shapes[0][1:])

  def fixed_scale(self):
    return self.num_repeats

  def _init(self, rng, exact_powers, approx_powers, cache_eigenvalues):
    del rng, exact_powers, approx_powers, cache_eigenvalues
    zeros = utils.WeightedMovingAverage.zeros
    v, d = self.parameters_shapes[0]
    dtype = self.parameters_dtype
    return EmbeddingKFAC.State(cache={}, inputs_factor=zeros([v], dtype),
                               outputs_factor=zeros([d, d], dtype))

  def _batch_statistics(self, estimation_data, batch_size):
    (ids,), (dy,) = estimation_data["inputs"], estimation_data["outputs_tangent"]
    rows = batch_size * self.num_repeats
    ids = jnp.asarray(ids).reshape(-1).astype(jnp.int32)
    counts = jnp.zeros(self.vocab_size, dy.dtype).at[ids].add(1)
    dy = dy.reshape(-1, dy.shape[-1])
    return counts / rows, dy.T @ dy / rows

  def _fold_statistics(self, state, stats, ema_old, ema_new):
    a, g = stats
    return dataclasses.replace(
        state, inputs_factor=state.inputs_factor.update(a, ema_old, ema_new),
        outputs_factor=state.outputs_factor.update(g, ema_old, ema_new))

  def _multiply_matpower_unscaled(self, state, vector, identity_weight, power,
                                  exact_power, use_cached):
    (w,) = vector
    a, g = state.inputs_factor.value, state.outputs_factor.value
    if exact_power and use_cached:
      vals, vecs = (state.cache["outputs_factor_eigenvalues"],
                    state.cache["outputs_factor_eigenvectors"])
      a = state.cache["inputs_factor_eigenvalues"]
      damping = state.cache[base.cache_key(power, exact=True)]
      return (_eigen_multiply(a, vals, vecs, damping, power, w),)
    if exact_power and power == 1:
      return (a[:, None] * (w @ g) + identity_weight * w,)
    if exact_power:
      vals, vecs = utils.safe_psd_eigh(g)
      return (_eigen_multiply(a, vals, vecs, identity_weight, power, w),)
    entry = (state.cache[base.cache_key(power, exact=False)] if use_cached
             else _approx_power_entry(a, g, identity_weight, power))
    return (entry["inputs_factor"][:, None] * (w @ entry["outputs_factor"]),)

  def _eigenvalues_unscaled(self, state):
    return utils.kronecker_product_eigenvalues(
        state.inputs_factor.value,
        utils.psd_eigvalsh(state.outputs_factor.value))

  def _update_cache(self, state, identity_weight, exact_powers, approx_powers,
                    eigenvalues, state_scale):
    a = state.inputs_factor.value
    g = state_scale * state.outputs_factor.value
    updates = {}
    if exact_powers or eigenvalues:
      vals, vecs = utils.safe_psd_eigh(g)
      if eigenvalues:
        updates["eigenvalues"] = utils.kronecker_product_eigenvalues(a, vals)
      if exact_powers:
        updates.update(inputs_factor_eigenvalues=a,
                       outputs_factor_eigenvalues=vals,
                       outputs_factor_eigenvectors=vecs)
      for p in exact_powers:
        updates[base.cache_key(p, exact=True)] = jnp.asarray(
            identity_weight, a.dtype)
    for p in approx_powers:
      updates[base.cache_key(p, exact=False)] = _approx_power_entry(
          a, g, identity_weight, p)
    return updates


def _eigen_multiply(a, g_vals, g_vecs, damping, power, w):
  """`(diag(a) ⊗ G + damping I)^power` applied to `w`, from `G`'s
  eigendecomposition."""
  grid = jnp.power(jnp.outer(a, g_vals) + damping, power)
  return ((w @ g_vecs) * grid) @ g_vecs.T


def _approx_power_entry(a, g, identity_weight, power):
  """The pi-damped factors raised to `power`: `a` as a vector, `G` dense."""
  a_norm, g_norm = jnp.mean(a), jnp.trace(g) / g.shape[0]
  ok = (a_norm > 0) & (g_norm > 0)
  pi = jnp.sqrt(jnp.where(ok, a_norm, 1) / jnp.where(ok, g_norm, 1))
  root = jnp.sqrt(jnp.asarray(identity_weight, a.dtype))
  g_damped = g + root / pi * jnp.eye(g.shape[0], dtype=g.dtype)
  return {"inputs_factor": jnp.power(a + pi * root, power),
          "outputs_factor": utils.psd_matrix_power(g_damped, power)}
