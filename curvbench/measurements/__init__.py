"""What a run measures (the `measure` config group), one module each.

A measurement is one folder (a package here, or a module): a `Measurement`
dataclass registered with `MEASUREMENTS.register`, whose fields are its
settings (the section `measure.<name>`), beside its computation, its
figures and its part of the report. It declares what it needs
(`uses_optimizer`, `uses_curvature`, the batches it splits across
devices), how it runs (`measure`, returning an `Outcome`: its tables and
its status), which tables it declares (`tables`), the numbers a run
prints when it ends (`headline`) and its section of the
report (`section`: the question it answers, its findings, tables, figures
and notes). A table may be written by several measurements (a spectra run
that trains writes `training` rows too); the one that declares it
reports it.

The `measure` section holds every measurement's settings, so that one
experiment can set them all and sweep `measure=spectra,timing,training`;
`measure.kind` picks the one that runs (`schema` builds that section's
type from the registry).
"""

import abc
import dataclasses
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pandas as pd

from curvbench.components import (
  ListOf,
  OneOf,
  Registry,
  Settings,
  Text,
  Whole,
  setting,
)
from curvbench.core import devices
from curvbench.core.sections import Section

PRECISIONS = ("float32", "float64")


@dataclasses.dataclass(frozen=True)
class Context:
  """What a measurement runs on: the built problem, the curvature (None
  where the run does not use one), the starting parameters and the fixed
  batch, the run's settings, a key, the run directory (for checkpoints)
  and the device mesh its batches are split across."""

  problem: Any
  curvature: Any
  params: Any
  batch: Any
  run: Any
  rng: Any
  run_dir: Any
  mesh: Any

  def log(self, line: str) -> None:
    """Prints a progress line, where the run shows progress."""
    if self.run.progress:
      print(line, flush=True)


@dataclasses.dataclass(frozen=True)
class Outcome:
  """What a measurement gives its run: `{table name: rows}` and how it
  ended: `status` 'complete', or 'diverged' with the `step` and the
  `reason` (the run's completion marker says so)."""

  tables: dict[str, list[dict]]
  status: str = "complete"
  reason: str = ""
  step: int | None = None

  @property
  def marker(self) -> dict:
    """The fields of the run's completion marker."""
    out: dict[str, Any] = dict(status=self.status)
    if self.reason:
      out["reason"] = self.reason
    if self.step is not None:
      out["step"] = self.step
    return out


@dataclasses.dataclass
class Measurement(Settings, abc.ABC):
  """What every measurement declares; see the module docstring."""

  name: ClassVar[str]
  # The tables it declares: those its `section` reports.
  tables: ClassVar[tuple[str, ...]] = ()
  # Whether its runs are the tuning protocol's: a sweep runs them at every
  # point of their optimizer's `tuning.grid`.
  tuned: ClassVar[bool] = False
  # Whether it needs the device to itself (a sweep refuses to run it beside
  # other jobs on one machine).
  needs_device_alone: ClassVar[bool] = False
  # The estimation mode of its curvature where `curvature.mode` is null:
  # the one people train K-FAC in, KFAC-JAX 0.0.8's optimizer's (its
  # estimation_mode=None falls back to the estimator's ggn_curvature_prop).
  default_mode: ClassVar[str] = "ggn_curvature_prop"

  precision: str = setting(
    "float32", OneOf(PRECISIONS), "the floating-point precision it runs in"
  )
  problems: list[str] = setting(
    [],
    ListOf(Text()),
    "in a sweep over problems, the ones it runs on "
    "(empty: every one); the others are left out",
  )

  @classmethod
  def what(cls) -> str:
    return f"measurement {cls.name}"

  def uses_optimizer(self, run) -> bool:
    """Whether the run's optimizer settings change what it records."""
    return False

  def uses_curvature(self, run) -> bool:
    """Whether the run's curvature settings change what it records."""
    return True

  def inputs(self, run) -> dict[str, str]:
    """`{setting: path}` of the files it reads besides the data (a run may
    not read from the folder it clears)."""
    return {}

  def batches(self, run) -> list[tuple[str, int | None]]:
    """`(setting, size)` of each batch it splits across `devices`."""
    return []

  def run_disagreements(self, run, prefix: str) -> Iterator[str]:
    """Messages for its settings that disagree with the rest of the run
    (`prefix`: its section's key), asked of every measurement's section
    whichever runs (e.g. steps beyond the training run)."""
    return iter(())

  def batch_disagreements(self, run) -> Iterator[str]:
    """Messages for the batches it would split (`batches`) that are larger
    than the training split, or do not split across the devices; asked of
    the measurement that runs."""
    train = (run.problem.data.sizes() or (None,))[0]
    for key, size in self.batches(run):
      if size is not None and train is not None and size > train:
        yield (
          f"{key}={size} is more than the {train} training examples "
          f"of dataset {run.problem.data.name!r}: lower it."
        )
      elif (
        size is not None
        and run.devices > 1
        and (complaint := devices.split_complaint(size, run.devices, key))
        is not None
      ):
        yield complaint

  def method_label(self, run, curvature) -> str:
    """The records' `method`: what was measured."""
    return run.optimizer.label(curvature if self.uses_curvature(run) else None)

  @abc.abstractmethod
  def measure(self, ctx: Context) -> Outcome:
    """Runs the measurement: its tables and how it ended."""

  def headline(self, tables: dict[str, pd.DataFrame]) -> str:
    """The numbers a run prints when it ends, from its `tables` as written
    (a run found finished earlier prints them too); by default, the
    tables it wrote and their rows."""
    return "wrote " + ", ".join(
      f"{name} ({len(rows)} rows)"
      for name, rows in sorted(tables.items())
      if name != "config"
    )

  def section(self, report, out: Path) -> Section | None:
    """Its part of the report, from a `curvbench.report.Report` (the
    sweep's tables, runs and colours), its figures saved under `out`; None
    where the sweep holds none of its records."""
    return None


MEASUREMENTS = Registry(
  "measurement",
  # The components' base class: abstract, and never instantiated.
  Measurement,  # type: ignore[type-abstract]
  package=__name__,
  group="measure",
)


@dataclasses.dataclass
class MeasureSettings(Settings):
  """The `measure` section: which measurement runs, the batch it measures
  on, and (in fields that `schema` adds) every measurement's settings."""

  kind: str = setting(
    "spectra", OneOf(MEASUREMENTS.names), "the measurement that runs"
  )
  batch_size: int | None = setting(
    None,
    Whole(1, null=True),
    "the spectra and timing batch (null: the problem's batch size)",
  )

  @property
  def chosen(self) -> Measurement:
    """The settings of the measurement that runs."""
    return getattr(self, self.kind)

  @classmethod
  def what(cls) -> str:
    return "the measure section"


def schema() -> type[MeasureSettings]:
  """The `measure` section's type: `MeasureSettings` with one field per
  registered measurement, its settings."""
  return _schema(MEASUREMENTS.names())


@functools.cache
def _schema(names: tuple[str, ...]) -> type[MeasureSettings]:
  fields = [
    (
      name,
      MEASUREMENTS.get(name),
      dataclasses.field(default_factory=MEASUREMENTS.get(name)),
    )
    for name in names
  ]
  return dataclasses.make_dataclass("Measure", fields, bases=(MeasureSettings,))


__all__ = [
  "Context",
  "MEASUREMENTS",
  "MeasureSettings",
  "Measurement",
  "Outcome",
  "PRECISIONS",
  "schema",
]
