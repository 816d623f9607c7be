"""The optimizers a run can train with (the `optimizer` config group), one
module each: its settings (the keyword arguments of what it builds) and
the trainer it makes.

A trainer has `init(params, batch, rng)`, `step(params, state, batch, rng)
-> (params, state, loss)`, `cycle` (steps after which its kinds of step
recur) and `compiled_programs(params, state, batch, rng)` (the compiled
program of each of the `cycle` steps, in order, for their memory and flop
figures); it may have `failure(state) -> str |
None`, which says, once the loss is no longer finite, whether the state
shows a fault of its settings rather than divergence (a run then stops with
that error instead of recording a diverged run). All optimizers see the same initial
parameters and the same batches in the same order (`curvbench.core.training`).
"""

import abc
import dataclasses
from collections.abc import Callable
from typing import ClassVar

import optax
from jax.sharding import Mesh

from curvbench.components import Component, Registry
from curvbench.core import training
from curvbench.core.curvatures import Curvature


@dataclasses.dataclass
class OptimizerSettings(Component, abc.ABC):
  """What every optimizer has: whether it uses a curvature (and which)."""

  # Whether it preconditions with the run's curvature.
  uses_curvature: ClassVar[bool] = False
  # Whether that curvature must be block-diagonal (estimators.Optimizer).
  needs_block_diagonal: ClassVar[bool] = False

  @abc.abstractmethod
  def make(
    self,
    loss_fn: Callable,
    curvature: Curvature | None = None,
    mesh: Mesh | None = None,
  ):
    """A trainer of `loss_fn` (see the module docstring); with a `mesh` of
    several devices (`devices.mesh`), for batches split over them."""

  def accepts(self, curvature) -> bool:
    """Whether it can train with `curvature` (its settings)."""
    return curvature.is_block_diagonal or not self.needs_block_diagonal

  def divergence_knobs(self) -> dict:
    """The settings a diverged run's reason may name, by role
    (`curvbench.measurements.training.divergence.diagnose`): none unless
    the optimizer says."""
    return {}

  def label(self, curvature: Curvature | None) -> str:
    """A training run's method: the optimizer, and the curvature it uses."""
    if self.uses_curvature and curvature is not None:
      return f"{self.name}[{curvature.label}]"
    return self.name


@dataclasses.dataclass
class TransformationSettings(OptimizerSettings):
  """An optimizer that is one optax transformation of its settings and no
  curvature (`shampoo`, `soap`, `kl_shampoo`)."""

  @abc.abstractmethod
  def transformation(self) -> optax.GradientTransformation:
    """The optax transformation of these settings."""

  def make(self, loss_fn, curvature=None, mesh=None):
    del curvature, mesh  # runs SPMD on a split batch
    return training.OptaxTrainer(
      loss_fn, lambda batch, rng: self.transformation()
    )


OPTIMIZERS = Registry(
  "optimizer",
  # The components' base class: abstract, and never instantiated.
  OptimizerSettings,  # type: ignore[type-abstract]
  package=__name__,
)
# Floating-point types an optimizer's own state may be kept in.
DTYPES = ("float32", "float64", "bfloat16", "float16")


def make(
  settings,
  loss_fn: Callable,
  curvature: Curvature | None = None,
  mesh: Mesh | None = None,
):
  """The trainer of `settings` (a mapping with `name`, or the settings)."""
  if not isinstance(settings, OptimizerSettings):
    settings = OPTIMIZERS.load(settings, "optimizer")
  if settings.uses_curvature and curvature is None:
    raise ValueError(f"optimizer={settings.name} needs a curvature.")
  return settings.make(loss_fn, curvature, mesh)


__all__ = [
  "DTYPES",
  "OPTIMIZERS",
  "OptimizerSettings",
  "TransformationSettings",
  "make",
]
