"""Adam (Kingma & Ba, 2015): `optax.adam`; its settings are that function's
arguments."""

import dataclasses

import optax

from curvbench.components import Flag, Number, OneOf, setting
from curvbench.core import palette, training
from curvbench.optimizers import DTYPES, OPTIMIZERS, OptimizerSettings


@OPTIMIZERS.register
@dataclasses.dataclass
class Adam(OptimizerSettings):
  """`optax.adam(learning_rate, b1, b2, eps, eps_root, mu_dtype,
  nesterov=...)`."""

  name: str = "adam"
  colour = palette.BLUE
  marker = "+"
  learning_rate: float = setting(1e-2, Number(0, low_in=False), "the step size")
  b1: float = setting(0.9, Number(0, 1), "decay of the first moment")
  b2: float = setting(0.999, Number(0, 1), "decay of the second moment")
  eps: float = setting(
    1e-8, Number(0), "added to the root of the second moment"
  )
  eps_root: float = setting(
    0.0, Number(0), "added to the second moment under the root"
  )
  mu_dtype: str | None = setting(
    None,
    OneOf(DTYPES, null=True),
    "the first moment's dtype (null: the parameters')",
  )
  nesterov: bool = setting(False, Flag(), "Nesterov momentum (NAdam)")

  def make(self, loss_fn, curvature=None, mesh=None):
    del curvature, mesh  # runs SPMD on a split batch
    return training.OptaxTrainer(
      loss_fn,
      lambda batch, rng: optax.adam(
        self.learning_rate,
        b1=self.b1,
        b2=self.b2,
        eps=self.eps,
        eps_root=self.eps_root,
        mu_dtype=self.mu_dtype,
        nesterov=self.nesterov,
      ),
    )
