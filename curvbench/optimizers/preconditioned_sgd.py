"""SGD with heavy-ball momentum on `(C + damping I)^-1 g`, C a moving
average of the run's curvature: any approximation, or the exact matrix
(`curvature=explicit_exact` or `implicit_exact`). An optax chain of
`precondition_by_curvature` and `optax.sgd`."""

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from curvbench.components import Number, Whole, setting
from curvbench.core import training
from curvbench.core.curvatures import Curvature
from curvbench.optimizers import OPTIMIZERS, OptimizerSettings


class PreconditionState(NamedTuple):
  """The state of `precondition_by_curvature`: the steps taken and
  the curvature's own state."""

  # Shadows `tuple.count`, under optax's name for the step count.
  count: jax.Array  # type: ignore[assignment]  # steps taken
  curvature: Any  # the curvature's state


def precondition_by_curvature(
  curvature: Curvature,
  batch,
  rng,
  *,
  damping: float,
  curvature_ema: float,
  curvature_update_period: int,
  inverse_update_period: int,
) -> optax.GradientTransformationExtraArgs:
  """Maps a gradient g to `(C + damping I)^-1 g`, C an EMA of `curvature`.

  Every `curvature_update_period` steps C is re-estimated on the step's batch
  (`update(..., batch=, rng=)`) and averaged in with weight
  `1 - curvature_ema` (the first estimate replaces the empty one); every
  `inverse_update_period` steps its damped inverse is recomputed.

  Args:
    curvature: the curvature to precondition with.
    batch: an example batch: the estimator is traced on it by `init`.
    rng: the key of the initial (empty) estimate.
    damping: added to the curvature before inverting.
    curvature_ema: the weight of the old estimate in the average.
    curvature_update_period: steps between curvature estimates.
    inverse_update_period: steps between inverse refreshes.

  Returns:
    An optax transformation whose `update` needs `batch=` and `rng=`.
  """

  def init(params):
    return PreconditionState(
      jnp.zeros([], jnp.int32), curvature.init(rng, params, batch)
    )

  def update(grads, state, params=None, *, batch, rng, **extra):
    del extra
    ema_old = jnp.where(state.count == 0, 0.0, curvature_ema)

    def estimate(curv):
      return curvature.update(curv, params, batch, rng, ema_old, 1 - ema_old)

    curv = jax.lax.cond(
      state.count % curvature_update_period == 0,
      estimate,
      lambda c: c,
      state.curvature,
    )
    curv = jax.lax.cond(
      state.count % inverse_update_period == 0,
      lambda c: curvature.refresh(c, damping),
      lambda c: c,
      curv,
    )
    direction = curvature.precondition(curv, grads, damping)
    return direction, PreconditionState(state.count + 1, curv)

  return optax.GradientTransformationExtraArgs(init, update)


@OPTIMIZERS.register
@dataclasses.dataclass
class PreconditionedSGD(OptimizerSettings):
  """`precondition_by_curvature` chained with `optax.sgd`."""

  name: str = "preconditioned_sgd"
  learning_rate: float = setting(0.05, Number(0, low_in=False), "the step size")
  momentum: float = setting(0.9, Number(0, 1), "heavy-ball momentum")
  damping: float = setting(
    0.1, Number(0, low_in=False), "added to the curvature before inverting"
  )
  curvature_ema: float = setting(
    0.95, Number(0, 1), "weight of the old estimate in the average"
  )
  curvature_update_period: int = setting(
    1, Whole(1), "steps between curvature estimates"
  )
  inverse_update_period: int = setting(
    5, Whole(1), "steps between inverse refreshes"
  )

  uses_curvature = True

  def make(self, loss_fn, curvature=None, mesh=None):
    del mesh  # the optax step runs SPMD on the split batch

    def transformation(batch, rng):
      return optax.chain(
        precondition_by_curvature(
          curvature,
          batch,
          rng,
          damping=self.damping,
          curvature_ema=self.curvature_ema,
          curvature_update_period=self.curvature_update_period,
          inverse_update_period=self.inverse_update_period,
        ),
        optax.sgd(self.learning_rate, momentum=self.momentum),
      )

    return training.OptaxTrainer(loss_fn, transformation)
