"""Datasets, each one module: its settings (the config group `problem/data`)
and how it is read or generated (`load`)."""

import abc
import dataclasses
from pathlib import Path
from typing import ClassVar

from curvbench.components import Component, Registry, Whole, setting
from problems import data
from problems.data import Dataset


@dataclasses.dataclass
class DatasetSettings(Component, abc.ABC):
  """What every dataset is asked: its split sizes, its input shape before
  it is loaded, and its arrays (`load`)."""

  # Whether inputs are integer token ids and targets the next token at
  # every position (for sequence models, `ProblemSettings.sequence_model`).
  tokens: ClassVar[bool] = False
  num_train: int | None = setting(
    None, Whole(1, null=True), "the first N training examples (null: all)"
  )
  num_test: int | None = setting(
    None, Whole(1, null=True), "the first N test examples (null: all)"
  )

  @abc.abstractmethod
  def input_shape(self) -> tuple[int, ...]:
    """The shape of one input, known without loading."""

  @abc.abstractmethod
  def load(self) -> Dataset:
    """The data, read or generated (and cached)."""

  @abc.abstractmethod
  def source(self) -> str:
    """Where the examples come from: a generator and its version, or the
    name of the data its files hold."""

  def sizes(self) -> tuple[int, ...] | None:
    """The number of training and test examples `load` gives, known without
    loading it (None where the files cannot tell)."""
    available = self.available()
    if available is None:
      return None
    return tuple(
      asked if asked is not None else have
      for asked, have in zip((self.num_train, self.num_test), available)
    )

  def disagreements(self, prefix):
    yield from super().disagreements(prefix)
    available = self.available()
    for split, asked, have in zip(
      ("train", "test"),
      (self.num_train, self.num_test),
      available or (None, None),
    ):
      if asked is not None and have is not None and asked > have:
        yield (
          f"{prefix}.num_{split}={asked} asks for more {split} "
          f"examples than {self.name} has ({have}); choose at most "
          f"{have}."
        )

  def available(self) -> tuple[int, int] | None:
    """The training and test examples there are before `num_train` and
    `num_test` take their first ones (None where unknown)."""
    return None

  def files(self) -> list[Path]:
    """The files `load` would read (none for generated data; none where
    they cannot be found: then `load` says what is missing)."""
    return []

  def stand_in(self) -> "DatasetSettings | None":
    """The generated data used instead of files that are missing, where
    the settings ask for it (`when_missing=synthetic`); None otherwise."""
    return None

  def fingerprint(self) -> str:
    """What identifies the examples: the source, the settings (less where
    files are kept) and the sha256 of the files read; part of a run's
    identity, so a run on other data is never taken for this one."""
    stand_in = self.stand_in()
    if stand_in is not None:  # the examples are the generator's settings
      return data.fingerprint(self.source(), dataclasses.asdict(stand_in))
    spec = {
      k: v
      for k, v in dataclasses.asdict(self).items()
      if k not in ("cache", "data_dir")
    }
    return data.fingerprint(self.source(), spec, self.files())


DATASETS = Registry(
  "dataset",
  # The components' base class: abstract, and never instantiated.
  DatasetSettings,  # type: ignore[type-abstract]
  package=__name__,
  group="problem/data",
)

__all__ = ["DATASETS", "DatasetSettings"]
