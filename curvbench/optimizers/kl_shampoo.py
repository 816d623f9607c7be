"""KL-Shampoo (Lin, Lowe, Dangel, Eschenhagen, Xu & Grosse 2025,
"Understanding and Improving Shampoo and SOAP via Kullback-Leibler
Minimization", arXiv 2509.03378): Shampoo whose factors are the
KL-divergence fit of a Kronecker product to the gradients' second moment,
each factor estimated from the gradient whitened by the other.
`kl_shampoo(learning_rate, **options)` is the optax transformation; it
follows the paper's practical scheme as the authors' reference
implementation runs it (github.com/yorkerlin/KL-Methods, `KLOpt` with
`using_klsoap=False`): eigenbases refreshed by QR, eigenvalues estimated
by their own moving average, no Adam and no grafting.

The fit's fixed point is `S_a = E[G S_b⁻¹ Gᵀ] / d_b`, `S_b = E[Gᵀ S_a⁻¹ G] /
d_a` for a `d_a × d_b` gradient `G` (`kronecker.matrix_shape`: a conv kernel
`(kh·kw·c_in, c_out)`; the reference takes 2-D and 3-D tensors only). Each
side keeps a basis `Q` and eigenvalue estimates `λ`, so that its inverse is
`Q diag(1/λ) Qᵀ`; a side of size 1, longer than `max_precond_dim`, or of a
vector (unless `precondition_1d`) keeps the standard basis (`Q = I`), its
`λ` a diagonal factor fitted by the same rule. With `β = shampoo_beta`,
`s = λ^(-1/2)` (at most `max(10, min(d, max_clamp_value))` with clamping,
as in the reference) and call `c` from 0:

  c = 0: S_a = (1 - β) G Gᵀ / d_b, S_b = (1 - β) Gᵀ G / d_a, Q their
         eigenvectors, λ = eigenvalue_init; no step (as the reference)
  c = t ≥ 1:
    M ← b1 M + (1 - b1) G
    N = Q_a [(Q_aᵀ M Q_b) ⊙ P] Q_bᵀ,  P_ij = x / (1 + eps x), x = s_a,i s_b,j
      (the damped (S_a ⊗ S_b)^(-1/2); over its RMS when normalize_grads)
    w ← w - lr N, then w ← w - lr · weight_decay · w
    with the λ before this step, Ĝ = Q_aᵀ G Q_b:
      S_a ← β S_a + (1 - β) G Q_b diag(1/λ_b) Q_bᵀ Gᵀ / d_b,  S_b likewise
      λ_a ← β λ_a + (1 - β) Σ_j Ĝ_ij² / λ_b,j / d_b,  λ_b likewise
    every precondition_frequency steps: Q ← QR(S Q)'s Q (eigenbasis=eigh:
      Q ← eigh(S)); λ kept
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from curvbench.components import Flag, Number, Whole, setting
from curvbench.core import palette
from curvbench.optimizers import OPTIMIZERS, TransformationSettings
from curvbench.optimizers.kronecker import (
  CountedState,
  as_matrix,
  decay_after_step,
  eigenbasis,
  eigenbasis_setting,
  empty_factors,
  matrix_shape,
  max_precond_dim_setting,
  normalize_grads_setting,
  per_parameter_update,
  power_qr,
  precondition_1d_setting,
  precondition_frequency_setting,
  rotate,
  unit_rms,
  unrotate,
  weight_decay_setting,
)


class ParameterState(NamedTuple):
  """One parameter's KL-Shampoo state: the two factors, their bases
  and eigenvalue estimates, and the gradients' average."""

  left: jax.Array | None  # S_a (None: the side keeps the standard basis)
  right: jax.Array | None  # S_b
  left_basis: jax.Array | None  # Q_a
  right_basis: jax.Array | None  # Q_b
  left_eigenvalues: jax.Array  # λ_a, one per column of Q_a
  right_eigenvalues: jax.Array  # λ_b
  momentum: jax.Array  # M, the gradients' average, as a matrix


class KLShampooState(CountedState):
  """The KL-Shampoo transformation's state: the call count and each
  parameter's `ParameterState`."""

  __slots__ = ()  # a tuple still, as the NamedTuple it extends


@OPTIMIZERS.register
@dataclasses.dataclass
class KLShampoo(TransformationSettings):
  """`kl_shampoo(learning_rate, ...)`; defaults the reference
  implementation's (its docstring's learning rate: its signature's 1e-4
  suits the language models it was tuned on)."""

  name: str = "kl_shampoo"
  colour = palette.PURPLE
  marker = "h"
  learning_rate: float = setting(3e-3, Number(0, low_in=False), "the step size")
  b1: float = setting(0.9, Number(0, 1), "decay of the gradients' average")
  shampoo_beta: float = setting(
    0.98, Number(0, 1), "decay of the factors' and eigenvalues' averages"
  )
  eps: float = setting(
    1e-8, Number(0), "damping: added to √(λ_a λ_b) in the step"
  )
  weight_decay: float = weight_decay_setting()
  precondition_frequency: int = precondition_frequency_setting()
  eigenvalue_init: float = setting(
    0.1, Number(0, low_in=False), "the eigenvalue estimates' start"
  )
  clamping: bool = setting(
    True,
    Flag(),
    "bound λ^(-1/2) by max(10, min(d, max_clamp_value)) on a side of d",
  )
  max_clamp_value: int = setting(4000, Whole(1), "the bound's cap")
  max_precond_dim: int = max_precond_dim_setting()
  precondition_1d: bool = precondition_1d_setting()
  normalize_grads: bool = normalize_grads_setting()
  eigenbasis: str = eigenbasis_setting()

  def ignored(self):
    if self.clamping:
      return {}
    return {"max_clamp_value": "clamping=false bounds nothing"}

  def transformation(self) -> optax.GradientTransformation:
    return _transformation(self)


def kl_shampoo(learning_rate: float, **options) -> optax.GradientTransformation:
  """KL-Shampoo (see the module docstring) as an optax transformation;
  `options` are the `KLShampoo` settings (bad ones raise `SettingsError`
  naming them)."""
  settings = KLShampoo.from_values({"learning_rate": learning_rate, **options})
  return settings.transformation()


def _transformation(s: KLShampoo) -> optax.GradientTransformation:
  beta = s.shampoo_beta

  def floor(d: int) -> float:
    """The least eigenvalue estimate on a side of `d` (clamping)."""
    return max(10, min(d, s.max_clamp_value)) ** -2.0 if s.clamping else 0.0

  def init_one(p):
    rows, cols = matrix_shape(p.shape)
    # Eigenvalues of one before the first call make its factor update the
    # reference's plain G Gᵀ / d_b.
    return ParameterState(
      *empty_factors(p, s.max_precond_dim, s.precondition_1d),
      jnp.ones(rows, p.dtype),
      jnp.ones(cols, p.dtype),
      jnp.zeros((rows, cols), p.dtype),
    )

  def init(params):
    return KLShampooState(
      jnp.zeros([], jnp.int32), jax.tree.map(init_one, params)
    )

  def step(g, st, p, count):
    """The update of one parameter, its average, factors and eigenvalues."""
    first = count == 0
    gm = as_matrix(g)
    (rows, cols) = gm.shape
    qa, qb = st.left_basis, st.right_basis
    sa, sb = st.left_eigenvalues**-0.5, st.right_eigenvalues**-0.5
    momentum = s.b1 * st.momentum + (1 - s.b1) * gm
    x = sa[:, None] * sb[None, :]
    direction = unrotate(
      rotate(momentum, qa, qb) * (x / (1 + s.eps * x)), qa, qb
    )
    if s.normalize_grads:
      direction = unit_rms(direction)
    update = decay_after_step(
      direction.reshape(g.shape),
      p,
      s.learning_rate,
      s.learning_rate * s.weight_decay,
    )
    # The factors and eigenvalues, whitened by the other side's inverse.
    left, right = st.left, st.right
    if left is not None:
      half = (gm if qb is None else gm @ qb) * sb[None, :]
      left = beta * left + (1 - beta) * (half @ half.T) / cols
    if right is not None:
      half = (gm if qa is None else qa.T @ gm) * sa[:, None]
      right = beta * right + (1 - beta) * (half.T @ half) / rows
    squares = rotate(gm, qa, qb) ** 2
    lam_a = beta * st.left_eigenvalues + (1 - beta) * jnp.mean(
      squares * sb[None, :] ** 2, axis=1
    )
    lam_b = beta * st.right_eigenvalues + (1 - beta) * jnp.mean(
      squares * sa[:, None] ** 2, axis=0
    )
    lam_a = jnp.where(first, s.eigenvalue_init, jnp.maximum(lam_a, floor(rows)))
    lam_b = jnp.where(first, s.eigenvalue_init, jnp.maximum(lam_b, floor(cols)))
    return jnp.where(first, jnp.zeros_like(update), update), st._replace(
      left=left,
      right=right,
      left_eigenvalues=lam_a,
      right_eigenvalues=lam_b,
      momentum=jnp.where(first, st.momentum, momentum),
    )

  def bases(fresh: bool):
    def new(factor, basis):
      if factor is None:
        return None
      if fresh or s.eigenbasis == "eigh":
        return eigenbasis(factor)
      return power_qr(factor, basis)

    return lambda st: st._replace(
      left_basis=new(st.left, st.left_basis),
      right_basis=new(st.right, st.right_basis),
    )

  update = per_parameter_update(
    "kl_shampoo",
    s.weight_decay,
    s.precondition_frequency,
    step,
    bases(fresh=True),
    bases(fresh=False),
    KLShampooState,
  )
  return optax.GradientTransformation(init, update)
