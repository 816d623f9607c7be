"""A sweeper that adds each optimizer's tuning grid to the training runs.

Hydra's basic sweeper runs the cartesian product of the swept values; a grid
that differs per optimizer (learning rates for Adam, learning rates and
momenta for SGD, none for K-FAC) is not a product. This sweeper takes the
basic sweeper's jobs and multiplies each training job by the grid that the
config's `tuning.grid` declares for its optimizer:

    tuning:
      grid:
        adam: {learning_rate: [1.0e-4, 1.0e-3, 1.0e-2]}
        sgd: {learning_rate: [0.01, 0.1], momentum: [0.9, 0.99]}

gives `optimizer.learning_rate=...` (and `optimizer.momentum=...`)
overrides, so every point has its own run directory. Jobs of other
measurements, and optimizers without a grid, run once.
"""

# No `from __future__ import annotations`: Hydra executes plugin modules
# outside sys.modules, where dataclasses cannot resolve string annotations.
import itertools
from dataclasses import dataclass
from typing import Any

from hydra._internal.core_plugins import basic_sweeper
from hydra.core.config_store import ConfigStore
from hydra.plugins.sweeper import Sweeper
from omegaconf import OmegaConf


@dataclass
class TuningSweeperConf:
  _target_: str = (
      "hydra_plugins.curvbench_sweeper.tuning_sweeper.TuningSweeper")
  max_batch_size: Any = None
  params: Any = None


ConfigStore.instance().store(group="hydra/sweeper", name="tuning",
                             node=TuningSweeperConf, provider="curvbench")


def register() -> None:
  """Makes the sweeper known to Hydra where its plugin scan misses it.

  Hydra lists `hydra_plugins` modules with pkgutil, which cannot see
  through setuptools' editable-install finder; importing this module stores
  the config node, and this adds the class to Hydra's plugin table.
  """
  from hydra.core.plugins import Plugins  # pylint: disable=g-import-not-at-top
  name = f"{TuningSweeper.__module__}.{TuningSweeper.__name__}"
  Plugins.instance().class_name_to_class.setdefault(name, TuningSweeper)


def _flat(grid: dict, prefix: str = "") -> dict[str, list]:
  out = {}
  for key, values in grid.items():
    if isinstance(values, dict):
      out.update(_flat(values, f"{prefix}{key}."))
    elif isinstance(values, list) and values:
      out[f"{prefix}{key}"] = values
    else:
      raise ValueError(
          f"tuning.grid: {prefix}{key} must be a non-empty list of values, "
          f"got {values!r}.")
  return out


def expand(jobs: list[list[str]], grid: dict, default_optimizer: str,
           default_measure: str) -> list[list[str]]:
  """Each training job of `jobs` (lists of `key=value` overrides) once per
  point of its optimizer's grid; other jobs unchanged."""

  def choice(job, group, default):
    for item in job:
      key, _, value = item.partition("=")
      if key.lstrip("+") == group:
        return value
    return default

  out = []
  for job in jobs:
    points = _flat(grid.get(choice(job, "optimizer", default_optimizer), {}))
    if choice(job, "measure", default_measure) != "training" or not points:
      out.append(job)
      continue
    taken = {item.partition("=")[0] for item in job}
    clash = sorted(f"optimizer.{k}" for k in points
                   if f"optimizer.{k}" in taken)
    if clash:
      raise ValueError(
          f"{', '.join(clash)} is both swept on the command line and in "
          "tuning.grid; give it in one place.")
    for values in itertools.product(*points.values()):
      out.append(job + [f"optimizer.{k}={v}"
                        for k, v in zip(points, values)])
  return out


class TuningSweeper(Sweeper):
  """The basic sweeper, with each optimizer's `tuning.grid` expanded.

  It wraps a `BasicSweeper` rather than subclassing it, and looks the class
  up when it is needed: Hydra's plugin scan executes the basic sweeper's
  module again, replacing the class that an import would have bound.
  """

  def __init__(self, max_batch_size=None, params=None):
    super().__init__()
    self.basic = basic_sweeper.BasicSweeper(max_batch_size=max_batch_size,
                                            params=params)
    self.basic.split_arguments = self.split_arguments

  def setup(self, *, hydra_context, task_function, config) -> None:
    self.basic.setup(hydra_context=hydra_context,
                     task_function=task_function, config=config)

  def sweep(self, arguments):
    return self.basic.sweep(arguments)

  def split_arguments(self, overrides, max_batch_size):
    config = self.basic.config
    basic = basic_sweeper.BasicSweeper
    batches = basic.split_arguments(overrides, None)
    jobs = [job for batch in batches for job in batch]
    grid = {}
    if "tuning" in config and config.tuning.grid:
      grid = OmegaConf.to_container(config.tuning.grid, resolve=True)
    jobs = expand(jobs, grid, config.optimizer.name, config.measure.kind)
    return list(basic.split_overrides_to_chunks(jobs, max_batch_size))
