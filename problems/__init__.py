"""Problems: a model, its registered loss and offline data, built from
settings.

`problems.make(settings)` takes the settings of the `problem` config group
(a mapping with `name`, `data` and the model's sizes; missing keys take the
problem's defaults) and returns a `Problem`. The problems are the modules of
`problems.models`, the datasets those of `problems.datasets`.
"""

import dataclasses
import json
from typing import cast

from problems import checks, data, layers, model_outputs
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
  dataset, whose examples are checked against its task, loss and model
  (`checks.check_problem`).

  Raises:
    curvbench.components.SettingsError: naming the first setting that is
      not allowed.
    problems.checks.ExamplesError: naming the array that does not fit and
      how to fix it.
  """
  if not isinstance(settings, ProblemSettings):
    settings = PROBLEMS.load(_plain(settings), "problem")
  problem = settings.build(settings.data.load())
  checks.check_problem(problem)
  return problem


# The problems `check` found fitting: (classes, settings, data fingerprint).
_CHECKED: set[tuple] = set()


def check(settings) -> None:
  """Refuses, before any run starts, examples that do not fit the problem
  of `settings` (a mapping, or `ProblemSettings`): builds it (`make`,
  which checks them), once per process for the same problem and dataset
  classes, settings and data (its fingerprint), so a sweep's points share
  one check.

  Raises:
    problems.checks.ExamplesError: as `make`; and what loading the data
      raises (e.g. `FileNotFoundError` for data files that are missing).
  """
  if not isinstance(settings, ProblemSettings):
    settings = PROBLEMS.load(_plain(settings), "problem")
  key = (
    type(settings),
    type(settings.data),
    json.dumps(dataclasses.asdict(settings), sort_keys=True, default=str),
    settings.data.fingerprint(),
  )
  if key not in _CHECKED:
    make(settings)
    _CHECKED.add(key)


def _plain(settings) -> dict:
  """A plain dict from a dict or an OmegaConf config."""
  try:  # optional: only a caller with an OmegaConf config has it
    from omegaconf import DictConfig, OmegaConf  # noqa: PLC0415 - see above

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
  "check",
  "checks",
  "data",
  "layers",
  "make",
  "model_outputs",
]
