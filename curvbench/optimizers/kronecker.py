"""What the Kronecker-factored optimizers (`shampoo`, `soap`, `kl_shampoo`)
share: each parameter seen as a matrix, the eigenbases of its factors,
rotations into them and the references' weight decay.

A parameter is preconditioned as a matrix `G` of shape `(rows, cols)`: its
size-1 axes dropped and its leading axes merged, so a dense kernel stays
`(d_in, d_out)`, a conv kernel `(kh, kw, c_in, c_out)` becomes
`(kh·kw·c_in, c_out)`, an embedding `(vocab, d)` stays, and a vector
(bias, layer-norm scale) is a column `(d, 1)`. None of the optimizers
gives a vector's columns a factor: it would be the scalar `‖g‖²`, which
the rows' factor and the step size already absorb.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from estimators.utils import symmetrize


def matrix_shape(shape) -> tuple[int, int]:
  """`(rows, cols)` of a parameter of `shape` seen as a matrix."""
  dims = [int(d) for d in shape if d > 1]
  if not dims:
    return 1, 1
  if len(dims) == 1:
    return dims[0], 1
  return math.prod(dims[:-1]), dims[-1]


def as_matrix(x: jax.Array) -> jax.Array:
  """`x` reshaped to its `matrix_shape`."""
  return x.reshape(matrix_shape(x.shape))


def outer_products(g: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`(G Gᵀ, Gᵀ G)` of a matrix (or of a stack of matrices)."""
  return g @ jnp.swapaxes(g, -1, -2), jnp.swapaxes(g, -1, -2) @ g


def eigenbasis(factor: jax.Array) -> jax.Array:
  """The eigenvectors of a symmetric matrix as columns, the largest
  eigenvalue's first (the order SOAP's reference keeps)."""
  _, vectors = jnp.linalg.eigh(symmetrize(factor))
  return vectors[..., ::-1]


def power_qr(factor: jax.Array, basis: jax.Array) -> jax.Array:
  """One power-iteration step from `basis` towards the eigenvectors of
  `factor`, re-orthonormalised: the `Q` of `factor @ basis = Q R` (Vyas
  et al.'s cheap refresh of a stale eigenbasis)."""
  q, _ = jnp.linalg.qr(factor @ basis)
  return q


def rotate(x: jax.Array, left, right) -> jax.Array:
  """`leftᵀ x right`, a side whose basis is None left alone."""
  if left is not None:
    x = left.T @ x
  if right is not None:
    x = x @ right
  return x


def unrotate(x: jax.Array, left, right) -> jax.Array:
  """`left x rightᵀ`: `rotate` undone."""
  if left is not None:
    x = left @ x
  if right is not None:
    x = x @ right.T
  return x


def unit_rms(x: jax.Array) -> jax.Array:
  """`x` over its root mean square (the references' `normalize_grads`)."""
  return x / (1e-30 + jnp.sqrt(jnp.mean(x * x)))


def decay_after_step(direction, params, step_size, decay):
  """The update of `p ← p - step_size·direction`, then `p ← p - decay·p`
  on the stepped parameter: the decoupled weight decay of SOAP's and
  KL-Shampoo's reference implementations, which decay after stepping."""
  stepped = -step_size * direction
  if decay == 0:
    return stepped
  return stepped - decay * (params + stepped)


def per_parameter_update(
  name: str,
  weight_decay: float,
  frequency: int,
  step,
  first,
  refresh,
  state_type,
):
  """The optax `update` of an optimizer whose state is `state_type(count,
  parameters)`: `step(g, st, p, count) -> (update, st)` for each parameter,
  then every parameter's state through `first` at the first call and
  `refresh` every `frequency` calls after it (SOAP, KL-Shampoo)."""

  def update(grads, state, params=None):
    if params is None and weight_decay:
      raise ValueError(
        f"{name} with weight_decay needs the parameters: "
        "call update(grads, state, params)."
      )
    count = state.count
    # jax's stubs leave the tree definition's type unresolved.
    treedef: Any
    leaves, treedef = jax.tree.flatten(grads)
    ps = (
      treedef.flatten_up_to(params)
      if params is not None
      else [None] * len(leaves)
    )
    out = [
      step(g, st, p, count)
      for g, st, p in zip(leaves, treedef.flatten_up_to(state.parameters), ps)
    ]
    every = lambda fn: lambda sts: [fn(st) for st in sts]
    states = jax.lax.cond(
      count == 0,
      every(first),
      lambda sts: jax.lax.cond(
        count % frequency == 0, every(refresh), lambda x: x, sts
      ),
      [st for _, st in out],
    )
    return (
      treedef.unflatten([u for u, _ in out]),
      state_type(count + 1, treedef.unflatten(states)),
    )

  return update
