"""Where the configs live, composing them from Python, and checking them.

Every default lives once, in the YAML tree `conf/` (installed with the
package as `curvbench/conf`); code reads keys without fallbacks. `compose`
gives, for the same overrides, the config the `curvbench` command runs, and
`validate` (which both call) refuses a bad choice by naming the key and the
values it takes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import DictConfig

import estimators
import problems
from curvbench import curvatures, data, devices, measurements, spectra, timing
from curvbench import training
# Stores the `hydra/sweeper: tuning` node that conf/config.yaml selects.
from hydra_plugins.curvbench_sweeper import tuning_sweeper  # noqa: F401


def _conf_dir() -> Path:
  installed = Path(__file__).resolve().parent / "conf"
  if installed.is_dir():  # a wheel or a non-editable install
    return installed
  return Path(__file__).resolve().parent.parent / "conf"  # a source checkout


CONF_DIR = _conf_dir()
PRECISIONS = ("float32", "float64")


def compose(*overrides: str) -> DictConfig:
  """The validated config of `curvbench OVERRIDES...`, e.g.
  `compose("problem=convnet", "curvature=diagonal", "seed=1")`."""
  with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
    cfg = hydra_compose("config", overrides=list(overrides))
  validate(cfg)
  return cfg


def choices(cfg: DictConfig) -> Iterator[tuple[str, object, tuple]]:
  """`(key, value, allowed values)` of every choice in `cfg`."""
  curvature, measure = cfg.curvature, cfg.measure
  yield "device", cfg.device, devices.PLATFORMS
  yield "problem.name", cfg.problem.name, tuple(problems.BUILDERS)
  yield "curvature.estimator", curvature.estimator, tuple(curvatures.FAMILIES)
  yield "curvature.mode", curvature.mode, estimators.ESTIMATION_MODES
  for key, allowed in (("block_type", curvatures.BLOCK_TYPES),
                       ("matrix", curvatures.IMPLICIT_PRODUCTS)):
    if key in curvature:  # the families that have the key
      yield f"curvature.{key}", curvature[key], tuple(allowed)
  yield "optimizer.name", cfg.optimizer.name, tuple(training.OPTIMIZERS)
  yield "measure.kind", measure.kind, tuple(measurements.MEASUREMENTS)
  for kind in measurements.MEASUREMENTS:
    yield f"measure.{kind}.precision", measure[kind].precision, PRECISIONS
  yield "measure.spectra.method", measure.spectra.method, spectra.METHODS
  for matrix in measure.spectra.references:
    yield ("measure.spectra.references", matrix,
           curvatures.EXACT_MATRICES)
  for phase in measure.timing.phases:
    yield "measure.timing.phases", phase, timing.PHASES


def validate(cfg: DictConfig) -> None:
  """Raises a ValueError naming the first key whose value is not allowed."""
  for key, value, allowed in choices(cfg):
    if value not in allowed:
      raise ValueError(f"Unknown {key} {value!r}; choose one of "
                       f"{', '.join(map(str, allowed))}.")
  data.parse_scope(cfg.measure.spectra.data)
  num_steps = int(cfg.measure.training.num_steps)
  for key in ("spectra.steps", "training.checkpoint_steps"):
    kind, name = key.split(".")
    try:
      training.measurement_steps(cfg.measure[kind][name], num_steps)
    except ValueError as e:
      raise ValueError(f"measure.{key}: {e}") from None
