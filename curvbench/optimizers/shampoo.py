"""Shampoo as Distributed Shampoo runs it (Gupta et al. 2018; Anil et al.
2020; Shi et al. 2023, the PyTorch implementation that won AlgoPerf's
external tuning track): `shampoo(learning_rate, **options)`, an optax
transformation, and the optimizer that trains with it.

Each parameter is a matrix `G` (`kronecker.matrix_shape`: a conv kernel
`(kh·kw·c_in, c_out)`, a vector a column `(d, 1)`). A side longer than
`max_preconditioner_dim` is cut into blocks of at most that length, each
block preconditioned on its own, as Distributed Shampoo does; unlike its
dimension merging, which stops at `max_preconditioner_dim` and may leave
a tensor of order 3, the leading axes are always merged into one. At step
`t` (from 1), with `g` the gradient and `ĝ = m / (1 - β1^t)` its β1-average
(`g` itself when `beta1=0`), per block:

  L ← β2 L + (1 - β2) G Gᵀ,  R ← β2 R + (1 - β2) Gᵀ G  (β2 = 1: L ← L + G Gᵀ)
  every `precondition_frequency` steps from `start_preconditioning_step`:
    X_L = (L / (1 - β2^t) + ε I)^(-η/p),  X_R likewise
  d = X_L Ĝ X_R,  scaled to the grafting method's norm on the block
  before `start_preconditioning_step`: d = the grafting method's step
  d ← d + weight_decay · w;  b ← μ b + d;  d ← b (Nesterov: d + μ b)
  w ← w - learning_rate · d

`p` is `exponent_override`, by default twice the number of factors (4 for
a matrix: `L^(-1/4) G R^(-1/4)`; 2 for a vector: `L^(-1/2) g`), and `η` the
`exponent_multiplier`; `exponent_override=2` on a matrix gives Shampoo²,
`(L ⊗ R)^(-1/2) vec G`. The grafting methods keep `A` from the raw gradients
(Adagrad `A ← A + g²`, RMSProp and Adam `A ← β A + (1 - β) g²`, Adam's
bias-corrected) and step `ĝ / (√A + ε_g)` (SGD: `ĝ`). Roots come from
`estimators.utils` (`safe_psd_eigh`, or the coupled Newton iteration of
`newton.inverse_root`, which keeps the previous root where it does not
converge, as Distributed Shampoo's protected root does); until the first
root they are zero, so without grafting the steps before
`start_preconditioning_step` are zero, as in Distributed Shampoo.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from curvbench.components import Flag, Number, OneOf, Parsed, Whole, setting
from curvbench.core import palette
from curvbench.optimizers import OPTIMIZERS, TransformationSettings
from curvbench.optimizers.kronecker import as_matrix, matrix_shape
from estimators.utils import newton, safe_psd_eigh

GRAFTING = ("none", "sgd", "adagrad", "rmsprop", "adam")
ROOT_METHODS = ("eigh", "newton")


class Factor(NamedTuple):
  """One side's Kronecker factor, per block, and its inverse root."""

  statistics: jax.Array  # (row blocks, column blocks, b, b): L or R per block
  root: jax.Array  # its inverse root at the last refresh


class ParameterState(NamedTuple):
  """One parameter's Shampoo state: its row and column factors, the
  grafting method's average, the filtered gradient and the
  momentum."""

  left: Factor | None  # rows' factor
  right: Factor | None  # columns' factor (none for a vector)
  grafting: jax.Array | None  # the grafting method's average of g²
  filtered: jax.Array | None  # the β1-average of the gradients
  momentum: jax.Array | None  # the heavy-ball buffer


class ShampooState(NamedTuple):
  """The Shampoo transformation's state: the step count and each
  parameter's `ParameterState`."""

  # Shadows `tuple.count`, under optax's name for the step count.
  count: jax.Array  # type: ignore[assignment]  # steps taken
  parameters: Any  # a ParameterState per parameter, in the params' tree


@dataclasses.dataclass(frozen=True)
class Blocks:
  """How a parameter's matrix splits into blocks of at most `size` rows
  and columns (zero-padded at the ends)."""

  shape: tuple
  size: int

  @property
  def matrix(self) -> tuple[int, int]:
    """`(rows, cols)` of the parameter seen as a matrix."""
    return matrix_shape(self.shape)

  @property
  def block(self) -> tuple[int, ...]:
    """`(rows, cols)` of one block: at most `size` each."""
    return tuple(min(d, self.size) for d in self.matrix)

  @property
  def grid(self) -> tuple[int, ...]:
    """The number of row blocks and of column blocks."""
    return tuple(math.ceil(d / b) for d, b in zip(self.matrix, self.block))

  def split(self, x: jax.Array) -> jax.Array:
    """`(row blocks, column blocks, b_rows, b_cols)` of a parameter-shaped
    array."""
    (m, n), (bm, bn), (pm, pn) = self.matrix, self.block, self.grid
    padded = jnp.pad(as_matrix(x), ((0, pm * bm - m), (0, pn * bn - n)))
    return padded.reshape(pm, bm, pn, bn).transpose(0, 2, 1, 3)

  def join(self, blocks: jax.Array) -> jax.Array:
    """The parameter-shaped array whose blocks are `blocks` (the inverse
    of `split`, the padding dropped)."""
    (m, n), (bm, bn), (pm, pn) = self.matrix, self.block, self.grid
    whole = blocks.transpose(0, 2, 1, 3).reshape(pm * bm, pn * bn)
    return whole[:m, :n].reshape(self.shape)

  def padding(self, side: int, dtype) -> jax.Array:
    """The identity on the padded rows (side 0) or columns (side 1), in
    the shape of that side's factors: added before the root, it keeps the
    padding apart from the parameter's own entries."""
    d, b, p = self.matrix[side], self.block[side], self.grid[side]
    mask = (jnp.arange(p * b) >= d).astype(dtype).reshape(p, b)
    diagonal = mask[..., None] * jnp.eye(b, dtype=dtype)
    return diagonal[:, None] if side == 0 else diagonal[None]


def _unit_interval(value) -> None:
  if (
    isinstance(value, bool)
    or not isinstance(value, (int, float))
    or not 0 <= value <= 1
  ):
    raise ValueError(
      f"must be a number in [0, 1] (1: a plain sum), not {value!r}"
    )


@OPTIMIZERS.register
@dataclasses.dataclass
class Shampoo(TransformationSettings):
  """`shampoo(learning_rate, ...)`. Defaults: Distributed Shampoo's
  (`DistributedShampoo`, 2024), with the grafting its README recommends in
  place of Adam (Adam grafting, β2 0.999, ε 1e-8; betas (0.9, 0.999))."""

  name: str = "shampoo"
  colour = palette.TEAL
  marker = "P"
  learning_rate: float = setting(1e-2, Number(0, low_in=False), "the step size")
  beta1: float = setting(
    0.9,
    Number(0, 1),
    "decay of the gradient's average (0: the gradient itself)",
  )
  beta2: float = setting(
    0.999,
    Parsed(_unit_interval, "a number in [0, 1]"),
    "decay of the factors' averages (1: their sums, as the original Shampoo)",
  )
  epsilon: float = setting(
    1e-12,
    Number(0, low_in=False),
    "added to the factors' eigenvalues before the root",
  )
  momentum: float = setting(
    0.0, Number(0, 1), "heavy-ball momentum on the grafted direction (0: none)"
  )
  nesterov: bool = setting(False, Flag(), "Nesterov momentum")
  weight_decay: float = setting(
    0.0, Number(0), "decoupled weight decay (added to the direction)"
  )
  max_preconditioner_dim: int = setting(
    1024, Whole(1), "longest side of a factor: longer sides are cut into blocks"
  )
  precondition_frequency: int = setting(
    1, Whole(1), "steps between root refreshes"
  )
  start_preconditioning_step: int | None = setting(
    None,
    Whole(1, null=True),
    "the step of the first roots (null: "
    "precondition_frequency); before it the grafting method steps",
  )
  exponent_override: int = setting(
    0,
    Whole(0),
    "the root p of each factor, X = F^(-1/p) (0: twice the "
    "number of factors, 4 for a matrix; 2 on a matrix gives Shampoo²)",
  )
  exponent_multiplier: float = setting(
    1.0, Number(0, low_in=False), "multiplies the roots' exponent"
  )
  use_bias_correction: bool = setting(
    True, Flag(), "divide the averages by 1 - β^t (gradient and factors)"
  )
  grafting_type: str = setting(
    "adam",
    OneOf(GRAFTING),
    "the method whose per-block step length Shampoo takes",
  )
  grafting_epsilon: float = setting(
    1e-8, Number(0, low_in=False), "the grafting method's epsilon"
  )
  grafting_beta2: float = setting(
    0.999, Number(0, 1), "decay of the grafting method's second moment"
  )
  matrix_power_method: str = setting(
    "eigh",
    OneOf(ROOT_METHODS),
    "eigendecomposition, or the coupled "
    "Newton iteration (matrix products only)",
  )

  def ignored(self):
    out = {}
    if self.momentum == 0:
      out["nesterov"] = "momentum=0: there is no momentum to look ahead with"
    if self.grafting_type in ("none", "sgd"):
      out["grafting_epsilon"] = (
        f"grafting_type={self.grafting_type} keeps no second moment"
      )
    if self.grafting_type in ("none", "sgd", "adagrad"):
      out["grafting_beta2"] = (
        f"grafting_type={self.grafting_type} has no second-moment decay"
      )
    return out

  def disagreements(self, prefix):
    yield from super().disagreements(prefix)
    key = f"{prefix}." if prefix else ""
    start = self.start_preconditioning_step
    if start is not None and start < self.precondition_frequency:
      yield (
        f"{key}start_preconditioning_step={start} is below "
        f"{key}precondition_frequency={self.precondition_frequency}: "
        "Distributed Shampoo needs the first roots no earlier than the "
        "first refresh; raise it or leave it null."
      )
    if self.matrix_power_method == "newton" and self.exponent_multiplier != 1:
      yield (
        f"{key}matrix_power_method=newton computes inverse p-th roots "
        f"only, not the power of {key}exponent_multiplier="
        f"{self.exponent_multiplier}: use matrix_power_method=eigh."
      )

  def transformation(self) -> optax.GradientTransformation:
    return _transformation(self)


def shampoo(learning_rate: float, **options) -> optax.GradientTransformation:
  """Distributed Shampoo (see the module docstring) as an optax
  transformation; `options` are the `Shampoo` settings (bad ones raise
  `SettingsError` naming them)."""
  settings = Shampoo.from_values({"learning_rate": learning_rate, **options})
  return settings.transformation()


def _transformation(s: Shampoo) -> optax.GradientTransformation:
  start = s.start_preconditioning_step or s.precondition_frequency
  grafting = s.grafting_type != "none"

  def factors(shape) -> int:
    return 1 if matrix_shape(shape)[1] == 1 else 2

  def init_one(p):
    blocks = Blocks(p.shape, s.max_preconditioner_dim)
    (pm, pn), (bm, bn) = blocks.grid, blocks.block

    def factor(b):
      zeros = jnp.zeros((pm, pn, b, b), p.dtype)
      return Factor(zeros, zeros)

    diagonal = s.grafting_type in ("adagrad", "rmsprop", "adam")
    return ParameterState(
      factor(bm),
      factor(bn) if factors(p.shape) == 2 else None,
      jnp.zeros_like(p) if diagonal else None,
      jnp.zeros_like(p) if s.beta1 > 0 else None,
      jnp.zeros_like(p) if s.momentum > 0 else None,
    )

  def init(params):
    return ShampooState(
      jnp.zeros([], jnp.int32), jax.tree.map(init_one, params)
    )

  def average(old, new, beta):
    return old + new if beta == 1 else beta * old + (1 - beta) * new

  def accumulate(g, state):
    """The factors, grafting statistics and gradient average with `g`."""
    gb = Blocks(g.shape, s.max_preconditioner_dim).split(g)
    gt = jnp.swapaxes(gb, -1, -2)
    left = state.left._replace(
      statistics=average(state.left.statistics, gb @ gt, s.beta2)
    )
    right = state.right
    if right is not None:
      right = right._replace(
        statistics=average(right.statistics, gt @ gb, s.beta2)
      )
    second = state.grafting
    if second is not None:
      decay = 1.0 if s.grafting_type == "adagrad" else s.grafting_beta2
      second = average(second, g * g, decay)
    filtered = state.filtered
    if filtered is not None:
      filtered = s.beta1 * filtered + (1 - s.beta1) * g
    return state._replace(
      left=left, right=right, grafting=second, filtered=filtered
    )

  def refresh(state, shape, t):
    """New inverse roots of the factors."""
    blocks = Blocks(shape, s.max_preconditioner_dim)
    root = s.exponent_override or 2 * factors(shape)
    dtype = state.left.statistics.dtype
    scale = 1.0
    if s.use_bias_correction and s.beta2 < 1:
      scale = 1 - s.beta2 ** t.astype(dtype)

    def one(factor, side):
      matrix = factor.statistics / scale + blocks.padding(
        side, factor.statistics.dtype
      )
      eye = jnp.eye(matrix.shape[-1], dtype=matrix.dtype)
      if s.matrix_power_method == "newton":
        roots = newton.inverse_root(matrix + s.epsilon * eye, root)
        new = jnp.where(
          roots.converged[..., None, None], roots.roots, factor.root
        )
      else:
        values, vectors = safe_psd_eigh(matrix)
        powered = (values + s.epsilon) ** (-s.exponent_multiplier / root)
        new = (vectors * powered[..., None, :]) @ jnp.swapaxes(vectors, -1, -2)
      return factor._replace(root=new)

    return state._replace(
      left=one(state.left, 0),
      right=None if state.right is None else one(state.right, 1),
    )

  def direction(g, state, p, t):
    blocks = Blocks(g.shape, s.max_preconditioner_dim)
    t = t.astype(g.dtype)  # bias corrections in the parameter's dtype
    avg = g
    if state.filtered is not None:
      avg = state.filtered
      if s.use_bias_correction:
        avg = avg / (1 - s.beta1**t)
    d = state.left.root @ blocks.split(avg)
    if state.right is not None:
      d = d @ state.right.root
    if grafting:
      graft = avg
      if state.grafting is not None:
        second = state.grafting
        if s.grafting_type == "adam":
          second = second / (1 - s.grafting_beta2**t)
        graft = avg / (jnp.sqrt(second) + s.grafting_epsilon)
      norms = jnp.linalg.norm(blocks.split(graft), axis=(-2, -1))
      d = (
        d
        * (norms / (jnp.linalg.norm(d, axis=(-2, -1)) + 1e-16))[..., None, None]
      )
      d = jnp.where(t < start, graft, blocks.join(d))
    else:
      d = blocks.join(d)
    if s.weight_decay:
      d = d + s.weight_decay * p
    buffer = state.momentum
    if buffer is not None:
      buffer = s.momentum * buffer + d
      d = d + s.momentum * buffer if s.nesterov else buffer
    return -s.learning_rate * d, state._replace(momentum=buffer)

  def update(grads, state, params=None):
    if s.weight_decay and params is None:
      raise ValueError(
        "shampoo with weight_decay needs the parameters: "
        "call update(grads, state, params)."
      )
    t = state.count + 1
    # jax's stubs leave the tree definition's type unresolved.
    treedef: Any
    leaves, treedef = jax.tree.flatten(grads)
    states = [
      accumulate(g, st)
      for g, st in zip(leaves, treedef.flatten_up_to(state.parameters))
    ]
    shapes = [g.shape for g in leaves]
    due = ((t % s.precondition_frequency == 0) & (t > start)) | (t == start)
    states = jax.lax.cond(
      due,
      lambda sts: [refresh(st, shape, t) for st, shape in zip(sts, shapes)],
      lambda sts: sts,
      states,
    )
    ps = (
      treedef.flatten_up_to(params)
      if params is not None
      else [None] * len(leaves)
    )
    out = [direction(g, st, p, t) for g, st, p in zip(leaves, states, ps)]
    return (
      treedef.unflatten([u for u, _ in out]),
      ShampooState(t, treedef.unflatten([st for _, st in out])),
    )

  return optax.GradientTransformation(init, update)
