"""SOAP (Vyas et al. 2024, "SOAP: Improving and Stabilizing Shampoo using
Adam"): Adam run in the eigenbasis of Shampoo's factors.
`soap(learning_rate, **options)` is the optax transformation, following
the authors' reference implementation (github.com/nikhilvyas/SOAP).

Each parameter is a matrix `G` (`kronecker.matrix_shape`: a conv kernel
`(kh·kw·c_in, c_out)`; the reference, with its default `merge_dims=False`,
keeps one factor per axis instead). A side has a factor unless it has
size 1, is longer than `max_precond_dim`, or belongs to a vector while
`precondition_1d` is false; such a side keeps the standard basis. At call
`c` (from 0), with bases `Q_L`, `Q_R` and `β_s = shampoo_beta`:

  c = 0: L = (1 - β_s) G Gᵀ, R = (1 - β_s) Gᵀ G, Q their eigenvectors
         (largest eigenvalue first); no step: the first gradient only
         sets the bases, as in the reference
  c = t ≥ 1:
    G̃ = Q_Lᵀ G Q_R,  M ← b1 M + (1 - b1) G̃,  V ← b2 V + (1 - b2) G̃²
    N = Q_L (M / (√V + eps)) Q_Rᵀ  (over its RMS when normalize_grads)
    w ← w - η_t N,  η_t = lr √(1 - b2^t) / (1 - b1^t) (lr without
      correct_bias); then w ← w - lr · weight_decay · w
    L ← β_s L + (1 - β_s) G Gᵀ,  R likewise
    every precondition_frequency steps, per side: its columns sorted by
      the estimates diag(Qᵀ L Q), V's axis with them, then Q ← QR(L Q)'s
      Q (one power-iteration step; eigenbasis=eigh: Q ← eigh(L)), and M
      rotated into the new bases (M ← Q_L'ᵀ Q_L M Q_Rᵀ Q_R').
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from curvbench.components import Flag, Number, setting
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
  outer_products,
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
  """One parameter's SOAP state: its two factors and their bases, and
  Adam's moments in the rotated basis."""

  left: jax.Array | None  # L (None: the side keeps the standard basis)
  right: jax.Array | None  # R
  left_basis: jax.Array | None  # Q_L
  right_basis: jax.Array | None  # Q_R
  mu: jax.Array  # Adam's first moment, in the rotated basis
  nu: jax.Array  # Adam's second moment, in the rotated basis


class SoapState(CountedState):
  """The SOAP transformation's state: the call count and each
  parameter's `ParameterState`."""

  __slots__ = ()  # a tuple still, as the NamedTuple it extends


@OPTIMIZERS.register
@dataclasses.dataclass
class SOAP(TransformationSettings):
  """`soap(learning_rate, ...)`; defaults the reference implementation's."""

  name: str = "soap"
  colour = palette.GREEN
  marker = "*"
  learning_rate: float = setting(3e-3, Number(0, low_in=False), "the step size")
  b1: float = setting(0.95, Number(0, 1), "decay of Adam's first moment")
  b2: float = setting(0.95, Number(0, 1), "decay of Adam's second moment")
  shampoo_beta: float | None = setting(
    None, Number(0, 1, null=True), "decay of the factors' averages (null: b2)"
  )
  eps: float = setting(
    1e-8, Number(0, low_in=False), "added to the root of the second moment"
  )
  weight_decay: float = weight_decay_setting()
  precondition_frequency: int = precondition_frequency_setting()
  max_precond_dim: int = max_precond_dim_setting()
  precondition_1d: bool = precondition_1d_setting()
  normalize_grads: bool = normalize_grads_setting()
  correct_bias: bool = setting(True, Flag(), "Adam's bias correction")
  eigenbasis: str = eigenbasis_setting()

  def transformation(self) -> optax.GradientTransformation:
    return _transformation(self)


def soap(learning_rate: float, **options) -> optax.GradientTransformation:
  """SOAP (see the module docstring) as an optax transformation;
  `options` are the `SOAP` settings (bad ones raise `SettingsError` naming
  them)."""
  settings = SOAP.from_values({"learning_rate": learning_rate, **options})
  return settings.transformation()


def _transformation(s: SOAP) -> optax.GradientTransformation:
  beta = s.b2 if s.shampoo_beta is None else s.shampoo_beta

  def init_one(p):
    zeros = jnp.zeros(matrix_shape(p.shape), p.dtype)
    return ParameterState(
      *empty_factors(p, s.max_precond_dim, s.precondition_1d), zeros, zeros
    )

  def init(params):
    return SoapState(jnp.zeros([], jnp.int32), jax.tree.map(init_one, params))

  def step(g, st, p, count):
    """The update of one parameter and its moments and factors."""
    first = count == 0
    t = jnp.maximum(count, 1).astype(g.dtype)
    gm = as_matrix(g)
    rotated = rotate(gm, st.left_basis, st.right_basis)
    mu = s.b1 * st.mu + (1 - s.b1) * rotated
    nu = s.b2 * st.nu + (1 - s.b2) * rotated * rotated
    direction = unrotate(
      mu / (jnp.sqrt(nu) + s.eps), st.left_basis, st.right_basis
    )
    if s.normalize_grads:
      direction = unit_rms(direction)
    size: float | jax.Array = s.learning_rate
    if s.correct_bias:
      size = size * jnp.sqrt(1 - s.b2**t) / (1 - s.b1**t)
    update = decay_after_step(
      direction.reshape(g.shape), p, size, s.learning_rate * s.weight_decay
    )
    left, right = outer_products(gm)
    ema = (
      lambda old, new: None if old is None else (beta * old + (1 - beta) * new)
    )
    return jnp.where(first, jnp.zeros_like(update), update), st._replace(
      left=ema(st.left, left),
      right=ema(st.right, right),
      mu=jnp.where(first, st.mu, mu),
      nu=jnp.where(first, st.nu, nu),
    )

  def first_bases(st):
    basis = lambda f: None if f is None else eigenbasis(f)
    return st._replace(left_basis=basis(st.left), right_basis=basis(st.right))

  def refresh(st):
    """New bases, the moments following them."""
    mu = unrotate(st.mu, st.left_basis, st.right_basis)
    nu, bases = st.nu, []
    for axis, (factor, basis) in enumerate(
      ((st.left, st.left_basis), (st.right, st.right_basis))
    ):
      if factor is not None:
        if s.eigenbasis == "eigh":
          basis = eigenbasis(factor)
        else:
          order = jnp.argsort(
            -jnp.diagonal(basis.T @ factor @ basis), stable=True
          )
          nu = jnp.take(nu, order, axis=axis)
          basis = power_qr(factor, basis[:, order])
      bases.append(basis)
    return st._replace(
      left_basis=bases[0], right_basis=bases[1], mu=rotate(mu, *bases), nu=nu
    )

  update = per_parameter_update(
    "soap",
    s.weight_decay,
    s.precondition_frequency,
    step,
    first_bases,
    refresh,
    SoapState,
  )
  return optax.GradientTransformation(init, update)
