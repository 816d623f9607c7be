"""SGD with heavy-ball (or Nesterov) momentum: `optax.sgd`; its settings are
that function's arguments."""

import dataclasses

import optax

from curvbench.components import Flag, Number, OneOf, setting
from curvbench import training
from curvbench.optimizers import DTYPES, OPTIMIZERS, OptimizerSettings


@OPTIMIZERS.register
@dataclasses.dataclass
class SGD(OptimizerSettings):
  """`optax.sgd(learning_rate, momentum, nesterov, accumulator_dtype)`."""

  name: str = "sgd"
  colour = "tab:cyan"
  learning_rate: float = setting(0.1, Number(0, low_in=False),
                                 "the step size")
  momentum: float | None = setting(0.9, Number(0, 1, null=True),
                                   "momentum (null: none)")
  nesterov: bool = setting(False, Flag(), "Nesterov momentum")
  accumulator_dtype: str | None = setting(
      None, OneOf(DTYPES, null=True), "the momentum's dtype (null: the "
      "parameters')")

  def make(self, loss_fn, curvature=None, mesh=None):
    del curvature, mesh  # runs SPMD on a split batch
    return training.OptaxTrainer(loss_fn, lambda batch, rng: optax.sgd(
        self.learning_rate, momentum=self.momentum, nesterov=self.nesterov,
        accumulator_dtype=self.accumulator_dtype))
