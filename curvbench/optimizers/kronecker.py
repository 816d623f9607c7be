"""What the Kronecker-factored optimizers (`shampoo`, `soap`, `kl_shampoo`)
share: each parameter seen as a matrix, the eigenbases of its factors,
rotations into them and the references' weight decay; and the settings
SOAP and KL-Shampoo take alike (KL-Shampoo's reference implementation
grew out of SOAP's).

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
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from curvbench.components import Flag, Number, OneOf, Whole, setting
from estimators.utils import symmetrize

# How SOAP and KL-Shampoo refresh their eigenbases.
BASES = ("qr", "eigh")


def matrix_shape(shape) -> tuple[int, int]:
  """`(rows, cols)` of a parameter of `shape` seen as a matrix."""
  dims = [int(d) for d in shape if d > 1]
  if not dims:
    return 1, 1
  if len(dims) == 1:
    return dims[0], 1
  return math.prod(dims[:-1]), dims[-1]


# One side's factor or basis: None where the side keeps the standard basis.
Side = jax.Array | None


def empty_factors(
  p: jax.Array, max_dim: int, precondition_1d: bool
) -> tuple[Side, Side, Side, Side]:
  """`(left, right, left_basis, right_basis)` of SOAP and KL-Shampoo before
  the first gradient, for a parameter like `p`: zero factors and identity
  bases. A side gets none (None: it keeps the standard basis) if it has
  size 1, is longer than `max_dim`, or belongs to a vector while
  `precondition_1d` is false."""
  rows, cols = matrix_shape(p.shape)
  vector = cols == 1

  def side(d: int, make) -> Side:
    given = 1 < d <= max_dim and (precondition_1d or not vector)
    return make(d) if given else None

  zeros = lambda d: jnp.zeros((d, d), p.dtype)
  eye = lambda d: jnp.eye(d, dtype=p.dtype)
  return side(rows, zeros), side(cols, zeros), side(rows, eye), side(cols, eye)


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


class CountedState(NamedTuple):
  """The state `per_parameter_update` keeps: the call count and each
  parameter's state (SOAP's and KL-Shampoo's state types subclass it)."""

  # Calls so far (the first one takes no step); shadows `tuple.count`,
  # under optax's name for the step count.
  count: jax.Array  # type: ignore[assignment]
  parameters: Any  # one state per parameter, in the params' tree


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
  parameters)` (a `CountedState`): `step(g, st, p, count) -> (update, st)` for each parameter,
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


# --- the settings SOAP and KL-Shampoo share (each of them declares them) ---


def weight_decay_setting():
  """Decoupled weight decay applied after the step (`decay_after_step`)."""
  return setting(
    0.01,
    Number(0),
    "decoupled weight decay, times the learning rate, after the step",
  )


def precondition_frequency_setting():
  """How often the eigenbases are refreshed."""
  return setting(10, Whole(1), "steps between eigenbasis refreshes")


def max_precond_dim_setting():
  """The longest side given a factor (`factored_sides`)."""
  return setting(
    10000, Whole(1), "longest side given a factor (longer: the standard basis)"
  )


def precondition_1d_setting():
  """Whether vectors get a factor (`factored_sides`)."""
  return setting(False, Flag(), "give vectors a factor")


def normalize_grads_setting():
  """Whether each direction is scaled to unit RMS (`unit_rms`)."""
  return setting(False, Flag(), "scale each parameter's direction to unit RMS")


def eigenbasis_setting():
  """How the eigenbases are refreshed: one of `BASES`."""
  return setting(
    "qr",
    OneOf(BASES),
    "refresh the bases by one "
    "power-iteration step and QR (the paper's), or "
    "by an eigendecomposition",
  )
