"""Problems: a model, its registered loss and offline data, built from
settings.

`problems.make(settings)` takes the settings of the `problem` config group
(a mapping with `name`, `data` and the model's sizes; missing keys take the
problem's defaults) and returns a `Problem`. The problems are the modules of
`problems.models`, the datasets those of `problems.datasets`.
"""

from typing import cast

from problems import data, layers
from problems.base import (
  LOSSES,
  PROBLEMS,
  TASKS,
  Network,
  Problem,
  ProblemSettings,
)
from problems.data import Dataset
from problems.datasets import DATASETS, DatasetSettings


def make(settings) -> Problem:
  """The problem of `settings` (a mapping, or `ProblemSettings`) on its
  dataset.

  Raises:
    curvbench.components.SettingsError: naming the first setting that is
      not allowed.
  """
  if not isinstance(settings, ProblemSettings):
    settings = PROBLEMS.load(_plain(settings), "problem")
  return settings.build(settings.data.load())


def _plain(settings) -> dict:
  """A plain dict from a dict or an OmegaConf config."""
  try:
    from omegaconf import DictConfig, OmegaConf

    if isinstance(settings, DictConfig):
      return cast(dict, OmegaConf.to_container(settings, resolve=True))
  except ImportError:
    pass
  return dict(settings)


__all__ = [
  "DATASETS",
  "Dataset",
  "DatasetSettings",
  "LOSSES",
  "Network",
  "PROBLEMS",
  "Problem",
  "ProblemSettings",
  "TASKS",
  "data",
  "layers",
  "make",
]
