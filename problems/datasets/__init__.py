"""Datasets, each one module: its settings (the config group `problem/data`)
and how it is read or generated (`load`)."""

import abc
import dataclasses

from components import Component, Registry, Whole, setting
from problems.data import Dataset


@dataclasses.dataclass
class DatasetSettings(Component, abc.ABC):
  """What every dataset is asked: its split sizes, its input shape before
  it is loaded, and its arrays (`load`)."""

  num_train: int | None = setting(
      None, Whole(1, null=True), "the first N training examples (null: all)")
  num_test: int | None = setting(
      None, Whole(1, null=True), "the first N test examples (null: all)")

  @abc.abstractmethod
  def input_shape(self) -> tuple[int, ...]:
    """The shape of one input, known without loading."""

  @abc.abstractmethod
  def load(self) -> Dataset:
    """The data, read or generated (and cached)."""


DATASETS = Registry("dataset", DatasetSettings, package=__name__,
                    group="problem/data")

__all__ = ["DATASETS", "DatasetSettings"]
