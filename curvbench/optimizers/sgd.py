"""SGD with heavy-ball (or Nesterov) momentum: `optax.sgd`; its settings are
that function's arguments, `momentum_schedule` and `weight_decay`."""

import dataclasses

import jax.numpy as jnp
import optax

from curvbench.components import Flag, Number, OneOf, setting
from curvbench.core import palette, training
from curvbench.optimizers import DTYPES, OPTIMIZERS, OptimizerSettings

MOMENTUM_SCHEDULES = ("constant", "sutskever2013")


def sutskever_momentum(mu_max: float | None) -> optax.Schedule:
  """The momentum schedule of Sutskever, Martens, Dahl & Hinton (2013), "On
  the importance of initialization and momentum in deep learning" (ICML),
  section 3: at update t (from 0), `min(1 - 2^(-1 - log2(n)), mu_max)` with
  `n = floor(t / 250) + 1`, that is `1 - 1 / (2n)`: 0.5 for the first 250
  updates, then 3/4, 5/6, 7/8, ... growing towards 1 like Nesterov's
  `1 - 3 / (t + 5)`, capped at `mu_max`."""
  if mu_max is None:
    raise ValueError(
      "momentum_schedule=sutskever2013 needs a momentum cap: "
      "set momentum (not null)."
    )

  def schedule(count):
    return jnp.minimum(1 - 0.5 / (count // 250 + 1), mu_max)

  return schedule


@OPTIMIZERS.register
@dataclasses.dataclass
class SGD(OptimizerSettings):
  """`optax.sgd(learning_rate, momentum, nesterov, accumulator_dtype)`, the
  momentum optionally scheduled (`optax.inject_hyperparams`), after an
  optional weight decay (`optax.add_decayed_weights`)."""

  name: str = "sgd"
  colour = palette.GREY
  marker = "x"
  learning_rate: float = setting(0.1, Number(0, low_in=False), "the step size")
  momentum: float | None = setting(
    0.9,
    Number(0, 1, null=True),
    "momentum (null: none); under momentum_schedule=sutskever2013 its cap",
  )
  nesterov: bool = setting(False, Flag(), "Nesterov momentum")
  accumulator_dtype: str | None = setting(
    None,
    OneOf(DTYPES, null=True),
    "the momentum's dtype (null: the parameters')",
  )
  momentum_schedule: str = setting(
    "constant",
    OneOf(MOMENTUM_SCHEDULES),
    "constant: `momentum` at every "
    "update; sutskever2013: Sutskever et al.'s (2013) momentum, 0.5 "
    "rising towards 1 every 250 updates, capped at `momentum`",
  )

  weight_decay: float = setting(
    0.0,
    Number(0),
    "λ of the L2 penalty λ/2 |θ|², its gradient λθ added to each update's "
    "before the momentum (as the SGD trainings of image classifiers in the "
    "papers do); the loss and its curvature stay the data's",
  )

  def ignored(self):
    if self.momentum is None:
      return {
        "momentum_schedule": "momentum=null: there is no momentum to "
        "schedule (set momentum, its cap)"
      }
    return {}

  def transformation(self) -> optax.GradientTransformation:
    """The optax transformation of these settings."""
    if not self.weight_decay:
      return self._sgd()
    return optax.chain(
      optax.add_decayed_weights(self.weight_decay), self._sgd()
    )

  def _sgd(self) -> optax.GradientTransformation:
    if self.momentum_schedule == "constant":
      return optax.sgd(
        self.learning_rate,
        momentum=self.momentum,
        nesterov=self.nesterov,
        accumulator_dtype=self.accumulator_dtype,
      )
    return optax.inject_hyperparams(
      optax.sgd, static_args=("learning_rate", "nesterov", "accumulator_dtype")
    )(
      self.learning_rate,
      momentum=sutskever_momentum(self.momentum),
      nesterov=self.nesterov,
      accumulator_dtype=self.accumulator_dtype,
    )

  def make(self, loss_fn, curvature=None, mesh=None):
    del curvature, mesh  # runs SPMD on a split batch
    return training.OptaxTrainer(
      loss_fn, lambda batch, rng: self.transformation()
    )
