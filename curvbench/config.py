"""Where the configs live, composing them from Python, and checking them.

Every default lives once, in the YAML tree `conf/` (installed with the
package as `curvbench/conf`); code reads keys without fallbacks. `compose`
gives, for the same overrides, the config the `curvbench` command runs.

`validate` (which both call, and the sweeper for every point before it
launches any) checks every key against `SETTINGS`, one declarative table of
what each setting may hold (type and range), then the `COMBINATIONS` of
settings that must agree; the first bad one raises a `ConfigError` naming
the key, its value and what is allowed. A key outside the table is refused
as unknown, except under the optimizer sections, whose keys are the
optimizer's own arguments.
"""

from __future__ import annotations

import abc
import hashlib
import math
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import DictConfig, OmegaConf

import estimators
import problems
from curvbench import curvatures, data, devices, measurements, spectra, timing
from curvbench import training, tuning
# Stores the `hydra/sweeper: tuning` node that conf/config.yaml selects.
from hydra_plugins.curvbench_sweeper import tuning_sweeper  # noqa: F401


def _conf_dir() -> Path:
  installed = Path(__file__).resolve().parent / "conf"
  if installed.is_dir():  # a wheel or a non-editable install
    return installed
  return Path(__file__).resolve().parent.parent / "conf"  # a source checkout


CONF_DIR = _conf_dir()
PRECISIONS = ("float32", "float64")


class ConfigError(ValueError):
  """A setting whose value is not allowed, alone or with another one."""


# --- what one setting may hold ------------------------------------------------

class Setting(abc.ABC):
  """What one key may hold: `accepts(value)`, and `describe()` in words.
  Subclasses say what a value may be (`_accepts`, `_describe`); null is
  allowed where `null` is True (conf/ says what it means there)."""
  null = False

  def accepts(self, value) -> bool:
    return self.null if value is None else self._accepts(value)

  def describe(self) -> str:
    return ("null or " if self.null else "") + self._describe()

  @abc.abstractmethod
  def _accepts(self, value) -> bool:
    """Whether a value other than None is allowed."""

  @abc.abstractmethod
  def _describe(self) -> str:
    """What is allowed, in words (null aside)."""

  def complaint(self, key: str, value) -> str | None:
    """Why `value` is not allowed at `key` (None when it is)."""
    if self.accepts(value):
      return None
    return f"{key}={value!r} is not allowed: {key} must be {self.describe()}."


@dataclass(frozen=True)
class Whole(Setting):
  """A whole number (an int, not a bool) in `[low, high]`."""
  low: int = 0
  high: int | None = None
  null: bool = False

  def _accepts(self, value) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)
            and value >= self.low and (self.high is None or value <= self.high))

  def _describe(self) -> str:
    span = (f">= {self.low}" if self.high is None
            else f"between {self.low} and {self.high}")
    return f"a whole number {span}"


@dataclass(frozen=True)
class Number(Setting):
  """A real number (int or float) above `low` (or at it, with `low_in`) and
  below `high`; infinite only where `finite` is False."""
  low: float | None = None
  high: float | None = None
  low_in: bool = True
  finite: bool = True
  null: bool = False

  def _accepts(self, value) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      return False
    if math.isnan(value) or (self.finite and math.isinf(value)):
      return False
    if self.low is not None and (value < self.low or (
        value == self.low and not self.low_in)):
      return False
    return self.high is None or value < self.high

  def _describe(self) -> str:
    if self.low is not None and self.high is not None:
      span = f"in [{self.low:g}, {self.high:g})"
    else:
      span = f"{'>=' if self.low_in else '>'} {self.low:g}"
    return f"a number {span}" + ("" if self.finite else " (inf: no limit)")


@dataclass(frozen=True)
class Flag(Setting):
  def _accepts(self, value) -> bool:
    return isinstance(value, bool)

  def _describe(self) -> str:
    return "true or false"


@dataclass(frozen=True)
class Text(Setting):
  null: bool = False

  def _accepts(self, value) -> bool:
    return isinstance(value, str) and bool(value.strip())

  def _describe(self) -> str:
    return "a non-empty text"


@dataclass(frozen=True)
class OneOf(Setting):
  """One of a fixed set of names."""
  options: tuple

  def _accepts(self, value) -> bool:
    return isinstance(value, str) and value in self.options

  def _describe(self) -> str:
    return f"one of {', '.join(map(str, self.options))}"

  def complaint(self, key: str, value) -> str | None:
    if self.accepts(value):
      return None
    return f"Unknown {key} {value!r}; choose one of {', '.join(self.options)}."


@dataclass(frozen=True)
class ListOf(Setting):
  """A list whose every item `item` accepts, at least `min_len` long."""
  item: object
  min_len: int = 0
  null: bool = False

  def _accepts(self, value) -> bool:
    return (isinstance(value, list) and len(value) >= self.min_len
            and all(self.item.accepts(v) for v in value))

  def _describe(self) -> str:
    size = f"at least {self.min_len} " if self.min_len else ""
    return f"a list of {size}items, each {self.item.describe()}"

  def complaint(self, key: str, value) -> str | None:
    if isinstance(value, list) and len(value) >= self.min_len:
      for item in value:  # name the item that is wrong
        if not self.item.accepts(item):
          if isinstance(self.item, OneOf):
            return self.item.complaint(key, item)
          return (f"{key}={value!r} is not allowed: its item {item!r} must "
                  f"be {self.item.describe()}.")
    return super().complaint(key, value)


@dataclass(frozen=True)
class Parsed(Setting):
  """Whatever `parse` takes without a ValueError, whose message says what
  is wrong; `words` says what is allowed."""
  parse: Callable
  words: str

  def _accepts(self, value) -> bool:
    return self.complaint("", value) is None

  def _describe(self) -> str:
    return self.words

  def complaint(self, key: str, value) -> str | None:
    try:
      self.parse(value)
    except (TypeError, ValueError) as e:
      return str(e) if key in str(e) else f"{key}: {e}"
    return None


def _grid(value) -> None:
  """Raises unless `value` is `{optimizer: {key: [values...]}}`."""
  if not isinstance(value, dict):
    raise ValueError(f"tuning.grid={value!r} must be a mapping.")
  for name, points in value.items():
    if name not in training.OPTIMIZERS or not isinstance(points, dict):
      raise ValueError(
          f"tuning.grid.{name}={points!r}: the grid's keys are optimizer "
          f"names ({', '.join(training.OPTIMIZERS)}), each mapping that "
          "optimizer's settings to lists of values.")
    tuning_sweeper.expand([["measure=training"]], {name: points}, name,
                          "training")


def _adam(name) -> None:
  if name != "adam":
    raise ValueError(
        f"measure.timing.baseline is optimizer {name!r}, but the "
        f"{timing.BASELINE_PHASE} phase times adam: override its settings "
        "(e.g. measure.timing.baseline.learning_rate=...), not its choice.")


# --- the table ----------------------------------------------------------------

SEED = Whole(0, 2**32 - 1)
COUNT = Whole(1)
POSITIVE = Number(0, low_in=False)
FRACTION = Number(0, 1)  # [0, 1): momenta, moving-average weights
GIB = Number(0, low_in=False, finite=False)
STEPS = Parsed(lambda v: training.measurement_steps(v, 2**62),
               "a list of whole numbers >= 0, or 'log:N' (N >= 2)")


def _measured_steps(value) -> None:
  if not training.measurement_steps(value, 2**62):
    raise ValueError("measure.spectra.steps is empty: give at least one "
                     "training step to measure at (0: initialisation).")

OPTIMIZER = {
    "name": OneOf(tuple(training.OPTIMIZERS)),
    "learning_rate": POSITIVE, "momentum": FRACTION, "nesterov": Flag(),
    "b1": FRACTION, "b2": FRACTION, "eps": Number(0),
    "damping": POSITIVE, "curvature_ema": FRACTION,
    "curvature_update_period": COUNT, "inverse_update_period": COUNT,
    "l2_reg": Number(0), "initial_damping": POSITIVE,
    "num_burnin_steps": Whole(0), "damping_adaptation_interval": COUNT,
    "use_adaptive_learning_rate": Flag(), "use_adaptive_momentum": Flag(),
    "use_adaptive_damping": Flag(), "distributed_inverses": Flag(),
    "distributed_precon_apply": Flag(),
    "step.learning_rate": POSITIVE, "step.momentum": FRACTION,
    "step.damping": POSITIVE,
}


def _prefixed(prefix: str, table: dict) -> dict:
  return {f"{prefix}.{key}": setting for key, setting in table.items()}


def _options(group: str) -> tuple:
  return tuple(sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml")
                      if not p.stem.startswith("_")))


SETTINGS = {
    "name": Text(), "device": OneOf(devices.PLATFORMS),
    "devices": Parsed(devices.check_count, "a whole number >= 1"),
    "seed": SEED, "init_seed": SEED, "data_seed": SEED,
    "force": Flag(), "progress": Flag(), "continue_on_error": Flag(),
    "lock_wait_s": Number(0, finite=False),
    "compilation_cache": Text(null=True),
    "tuning.grid": Parsed(_grid, "a mapping {optimizer: {key: [values]}} "
                          "of non-empty lists"),
    "tuning.metric": OneOf(tuple(tuning.METRICS)),
    "canonical.optimizer": OneOf(tuple(training.OPTIMIZERS)),
    "canonical.curvature": OneOf(_options("curvature")),
    "canonical.mode": OneOf(estimators.ESTIMATION_MODES),
    **_prefixed("problem", {
        "name": OneOf(tuple(problems.BUILDERS)), "label": Text(),
        "batch_size": COUNT, "width": COUNT, "depth": Whole(0),
        "hidden": ListOf(COUNT, null=True),
        "activation": OneOf(tuple(problems.layers.ACTIVATIONS)),
        "loss": OneOf(tuple(problems.LOSSES)), "encoder": ListOf(COUNT),
        "code": COUNT, "channels": ListOf(COUNT), "kernel": COUNT,
        "dense": ListOf(COUNT), "normalize": Flag(),
        "data.name": OneOf(tuple(problems.data.DATASETS)),
        "data.size": COUNT, "data.num_train": Whole(1, null=True),
        "data.num_test": Whole(1, null=True), "data.seed": SEED,
        "data.num_points": Whole(2), "data.num_samples": Whole(2),
        "data.length": COUNT, "data.width": POSITIVE,
        "data.cache": Text(null=True), "data.data_dir": Text(null=True)}),
    **_prefixed("curvature", {
        "name": Text(), "estimator": OneOf(tuple(curvatures.FAMILIES)),
        "block_type": OneOf(tuple(curvatures.BLOCK_TYPES)),
        "matrix": OneOf(tuple(curvatures.IMPLICIT_PRODUCTS)),
        "mode": OneOf(estimators.ESTIMATION_MODES), "cg_iters": COUNT,
        "max_dense_gib": GIB, "max_state_gib": GIB, "distributed": Flag()}),
    **_prefixed("optimizer", OPTIMIZER),
    "measure.kind": OneOf(tuple(measurements.MEASUREMENTS)),
    "measure.batch_size": Whole(1, null=True),
    **{f"measure.{kind}.precision": OneOf(PRECISIONS)
       for kind in measurements.MEASUREMENTS},
    **_prefixed("measure.spectra", {
        "method": OneOf(tuple(spectra.METHODS)),
        "data": Parsed(data.parse_scope, "batch, batches:N (N >= 1) or "
                       "train"),
        "chunk_size": Whole(1, null=True),
        "steps": Parsed(_measured_steps, "a non-empty list of whole numbers "
                        ">= 0, or 'log:N' (N >= 2)"),
        "checkpoint": Text(null=True), "save_checkpoints": Flag(),
        "references": ListOf(OneOf(curvatures.EXACT_MATRICES), 1),
        "damping": POSITIVE, "top_k": COUNT, "relative_floor": FRACTION,
        "num_samples": COUNT, "lanczos_iters": COUNT, "slq_probes": COUNT,
        "frobenius_probes": COUNT, "trace_probes": COUNT,
        "diagonal_probes": COUNT, "per_block": Flag(),
        "heatmap_blocks": Whole(0), "heatmap_units": COUNT,
        "cg_iters": COUNT, "max_dense_gib": GIB}),
    **_prefixed("measure.timing", {
        "phases": ListOf(OneOf(timing.PHASES)), "warmup": Whole(0),
        "repeats": COUNT, "damping": POSITIVE, "learning_rate": POSITIVE,
        **_prefixed("baseline", dict(OPTIMIZER, name=Parsed(
            _adam, "adam: the settings of the Adam step timing compares "
            "with")))}),
    **_prefixed("measure.training", {
        "num_steps": COUNT, "log_every": COUNT, "eval_every": COUNT,
        "train_eval_size": Whole(1, null=True),
        "eval_size": Whole(1, null=True), "checkpoint_steps": STEPS}),
}
# Keys under these take the optimizer's other arguments too (see README).
OPEN_SECTIONS = ("optimizer.", "measure.timing.baseline.")


# --- settings that must agree -----------------------------------------------

def _steps_within_training(c: dict) -> Iterator[str]:
  num_steps = c["measure"]["training"]["num_steps"]
  for kind, name in (("spectra", "steps"), ("training", "checkpoint_steps")):
    try:
      training.measurement_steps(c["measure"][kind][name], num_steps)
    except ValueError as e:
      yield f"measure.{kind}.{name}: {e}"


def _batches_split_across_devices(c: dict) -> Iterator[str]:
  """With devices > 1, each batch the measurement splits across them: the
  training batch, and the measured batch or chunk (when set)."""
  count, measure, problem = c["devices"], c["measure"], c["problem"]
  kind, spectra = measure["kind"], measure["spectra"]
  if count == 1:
    return
  measured = (("measure.batch_size", measure["batch_size"])
              if measure["batch_size"] is not None
              else ("problem.batch_size", problem["batch_size"]))
  sizes = []
  if kind == "training" or (kind == "spectra" and spectra["steps"] != [0]
                            and spectra["checkpoint"] is None):
    sizes.append(("problem.batch_size", problem["batch_size"]))
  if kind == "timing" or (kind == "spectra" and spectra["data"] != "train"):
    sizes.append(measured)
  if kind == "spectra" and spectra["data"] == "train":
    sizes.append(("measure.spectra.chunk_size", spectra["chunk_size"]))
  for key, size in sizes:
    if size is not None and (
        complaint := devices.split_complaint(size, count, key)) is not None:
      yield complaint


# The side of a dataset's images, where its config does not give `size`.
IMAGE_SIDE = {"mnist": 28, "cifar10": 32, "curves": 28}


def _images_outlast_pooling(c: dict) -> Iterator[str]:
  problem = c["problem"]
  side = problem["data"].get("size", IMAGE_SIDE.get(problem["data"]["name"]))
  if problem["name"] != "convnet" or side is None:
    return
  blocks = len(problem["channels"])
  if side >> blocks < 1:  # each block halves the side (2x2 max-pooling)
    yield (f"problem.channels={problem['channels']}: {blocks} conv blocks "
           f"halve the {side}x{side} images of problem.data.name="
           f"{problem['data']['name']} to nothing; use at most "
           f"{side.bit_length() - 1} blocks, or larger images.")


def _digits_leave_training_examples(c: dict) -> Iterator[str]:
  data_cfg = c["problem"]["data"]
  total = problems.data.NUM_DIGITS
  if data_cfg["name"] == "digits" and (data_cfg.get("num_test") or 0) >= total:
    yield (f"problem.data.num_test={data_cfg['num_test']} leaves no "
           f"training examples: the digits set has {total}; choose between "
           f"1 and {total - 1}.")


COMBINATIONS = (_steps_within_training, _batches_split_across_devices,
                _images_outlast_pooling, _digits_leave_training_examples)


# --- checking a config ------------------------------------------------------

def _leaves(node: dict, prefix: str = "") -> Iterator[tuple[str, object]]:
  """`(dotted key, value)` of every setting; a mapping that is a setting of
  its own (`tuning.grid`) is one leaf."""
  for key, value in node.items():
    name = f"{prefix}{key}"
    if isinstance(value, dict) and name not in SETTINGS:
      yield from _leaves(value, f"{name}.")
    else:
      yield name, value


def refusals(cfg) -> Iterator[str]:
  """A message for each setting of `cfg` that is not allowed: unknown keys
  and bad values first, then disagreeing settings."""
  plain = (OmegaConf.to_container(cfg, resolve=True)
           if isinstance(cfg, DictConfig) else cfg)
  plain = {k: v for k, v in plain.items() if k != "hydra"}
  bad_values = False
  for key, value in _leaves(plain):
    setting = SETTINGS.get(key)
    if setting is None:
      if not key.startswith(OPEN_SECTIONS):
        bad_values = True
        yield (f"Unknown setting {key}={value!r}: nothing reads it. Check "
               "its spelling against `curvbench --cfg job`.")
    elif (complaint := setting.complaint(key, value)) is not None:
      bad_values = True
      yield complaint
  if not bad_values:  # the combinations read values of the right type
    for combination in COMBINATIONS:
      yield from combination(plain)


def validate(cfg) -> None:
  """Raises a `ConfigError` naming the first setting of `cfg` (a composed
  config) that is not allowed, its value and what is allowed."""
  for message in refusals(cfg):
    raise ConfigError(message)


# --- composing ----------------------------------------------------------------

def run_dir_name(override_dirname: str, limit: int = 120) -> str:
  """A sweep run's directory name: its overrides, hashed when too long."""
  if len(override_dirname) <= limit:
    return override_dirname or "default"
  digest = hashlib.sha1(override_dirname.encode()).hexdigest()[:12]
  return f"{override_dirname[:limit - 14]}..{digest}"


def register_resolvers() -> None:
  """The resolvers conf/config.yaml uses: `curvbench_run_dir` (a sweep
  run's directory name) and `curvbench_token` (random, once per config:
  single runs started in the same second get different directories)."""
  if not OmegaConf.has_resolver("curvbench_run_dir"):
    OmegaConf.register_new_resolver("curvbench_run_dir", run_dir_name)
  if not OmegaConf.has_resolver("curvbench_token"):
    # Cached per config, as Hydra's `now` is, so that every read of the
    # run directory gives the same name.
    OmegaConf.register_new_resolver(
        "curvbench_token", lambda: uuid.uuid4().hex[:6], use_cache=True)


def compose(*overrides: str) -> DictConfig:
  """The validated config of `curvbench OVERRIDES...`, e.g.
  `compose("problem=convnet", "curvature=diagonal", "seed=1")`."""
  register_resolvers()
  with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
    cfg = hydra_compose("config", overrides=list(overrides))
  validate(cfg)
  return cfg
