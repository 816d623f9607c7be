"""The run's settings: declared in code, stored in Hydra's ConfigStore,
composed from the command line or from Python, and checked.

Every setting is a field of a dataclass: the run's own (`RunSettings`), and
those of the components each config group chooses from its registry
(`problems.PROBLEMS`, `problems.DATASETS` under `problem/data`,
`curvbench.approximations.CURVATURES`, `curvbench.optimizers.OPTIMIZERS`,
`curvbench.measurements.MEASUREMENTS`). `store` puts them all in Hydra's
ConfigStore; the YAML tree `conf/` keeps only the primary config, presets,
experiments and launchers.

`compose` gives, for the same overrides, the config the `curvbench` command
runs, checked: a value of the wrong type, a key no component has (named
with the nearest ones it has), a value out of range, a key the other
settings make pointless, and settings that disagree each raise a
`ConfigError` naming the key, its value and what is allowed.
"""

import dataclasses
import difflib
import hashlib
import re
import uuid
from collections.abc import Iterator, Mapping
from typing import Any, cast

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

import estimators
from curvbench import gallery, measurements, plugins
from curvbench.approximations import CURVATURES
from curvbench.components import (
  Check,
  Choice,
  Component,
  Flag,
  ListOf,
  Number,
  OneOf,
  Parsed,
  Settings,
  SettingsError,
  Text,
  Whole,
  setting,
)
from curvbench.conf_dir import CONF_DIR
from curvbench.core import devices, tuning
from curvbench.optimizers import OPTIMIZERS
from problems import DATASETS, PROBLEMS

# The ConfigStore name of `RunSettings`, first in conf/config.yaml.
RUN_SCHEMA = "curvbench"

ConfigError = SettingsError

SEED = Whole(0, 2**32 - 1)


# --- the tuning grid ---------------------------------------------------------


def _flat(grid: Mapping, prefix: str = "") -> dict[str, Any]:
  out = {}
  for key, values in grid.items():
    if isinstance(values, Mapping):
      out.update(_flat(values, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = values
  return out


def _with(values: dict, dotted_key: str, value) -> dict:
  """A copy of `values` with `dotted_key` set to `value`."""
  head, _, rest = dotted_key.partition(".")
  if not rest:
    return dict(values, **{head: value})
  inner = values.get(head)
  return dict(
    values,
    **{head: _with(inner if isinstance(inner, dict) else {}, rest, value)},
  )


def grid_points(grid: Mapping) -> dict[str, dict[str, list]]:
  """`{optimizer: {dotted key: values}}` of a tuning grid; nested keys
  (e.g. `{step: {damping: [...]}}`) flattened to dotted ones."""
  return {name: _flat(points) for name, points in grid.items()}


@dataclasses.dataclass(frozen=True)
class Grid(Check):
  """A tuning grid: `{optimizer: {key: [values]}}`, every key a setting of
  that optimizer and every value one it allows."""

  def _accepts(self, value) -> bool:
    return next(self.complaints("tuning.grid", value), None) is None

  def _describe(self) -> str:
    return "a mapping {optimizer: {key: [values]}} of non-empty lists"

  def complaints(self, key: str, value) -> Iterator[str]:
    if not isinstance(value, Mapping):
      yield (
        f"{key}={value!r} must be a mapping {{optimizer: {{key: [values]}}}}."
      )
      return
    for name, points in value.items():
      where = f"{key}.{name}"
      if name not in OPTIMIZERS or not isinstance(points, Mapping):
        yield (
          f"{where}={points!r}: the grid's keys are optimizer names "
          f"({', '.join(OPTIMIZERS)}), each mapping that optimizer's "
          "settings to lists of values."
        )
        continue
      defaults = dataclasses.asdict(OPTIMIZERS.defaults(name))
      for point, values in _flat(points).items():
        if not isinstance(values, (list, tuple)) or not values:
          yield (
            f"{where}.{point} must be a non-empty list of values, got "
            f"{values!r}."
          )
          continue
        for v in values:  # each value as the optimizer's settings hold it
          message = next(
            OPTIMIZERS.refusals(_with(defaults, point, v), where), None
          )
          if message is not None:
            yield message


# --- the run's own settings ---------------------------------------------------


@dataclasses.dataclass
class Tuning(Settings):
  """A tuning protocol (DeepOBS-style): the sweep trains each optimizer at
  every point of its grid, and the report picks the setting with the best
  `metric` (mean over seeds) for each optimizer."""

  grid: dict[str, Any] = setting(
    {}, Grid(), "e.g. {adam: {learning_rate: [1.0e-4, 1.0e-3]}}"
  )
  metric: str = setting(
    "final_train_error",
    OneOf(tuple(tuning.METRICS)),
    "what the best setting minimises",
  )
  claim: str | None = setting(
    None,
    OneOf(OPTIMIZERS.names, null=True),
    "an optimizer claimed to "
    "reach a lower training error than every other one in the same time "
    "(as Martens & Grosse claim of K-FAC): the report says whether these "
    "runs bear it out",
  )


# A run's estimation mode where its curvature names none: the
# measurement's (`Measurement.default_mode`), resolved in the config so
# that the run's identity, records and labels name it.
MEASUREMENT_MODE = "${curvbench_mode:${measure.kind}}"


@dataclasses.dataclass
class Canonical(Settings):
  """In a sweep, a dimension that a measurement does not use runs only at
  these values (e.g. spectra runs only with this optimizer; sgd and adam
  training only with this curvature and mode); the other points are
  recorded as skipped."""

  optimizer: str = setting(
    "kfac",
    OneOf(OPTIMIZERS.names),
    "the optimizer that trains runs whose measurement does not compare "
    "optimizers (spectra)",
  )
  curvature: str = setting(
    "kfac",
    OneOf(CURVATURES.names),
    "the curvature of runs whose optimizer uses none (sgd, adam)",
  )
  mode: str = setting(
    MEASUREMENT_MODE,
    OneOf(estimators.ESTIMATION_MODES),
    "the estimation mode of runs whose optimizer uses no curvature "
    "(by default the measurement's, as curvature.mode's)",
  )
  train_every_curvature: bool = setting(
    True,
    Flag(),
    "an optimizer that uses a curvature (K-FAC) trains and "
    "is timed with every swept curvature it accepts; false: with this "
    "curvature only, so a sweep over approximations for their quality "
    "compares the optimizers once",
  )


@dataclasses.dataclass(frozen=True)
class MeasureSection(Check):
  """The `measure` section (`measurements.schema`)."""

  def _accepts(self, value) -> bool:
    return next(self.complaints("measure", value), None) is None

  def _describe(self) -> str:
    return "the settings of every measurement, and which one runs"

  def complaints(self, key, value):
    yield from measurements.schema().refusals(value, key)

  def build(self, value, key):
    return measurements.schema().from_values(value, key, checked=True)


def folder_name(value) -> None:
  """Raises unless `value` names one folder (a sweep's, under reports/)."""
  if (
    not isinstance(value, str)
    or not value.strip()
    or value in (".", "..")
    or "/" in value
    or "\\" in value
    or "\0" in value
  ):
    raise ValueError(
      f"name={value!r} is not allowed: name must be a non-empty folder "
      "name (no '/', not '.' or '..'): the sweep's runs go under "
      "reports/<name>/."
    )


def _gallery_entry(name) -> None:
  if name not in gallery.entries():
    raise ValueError(
      f"repro={name!r} is no gallery entry; the entries are "
      f"{', '.join(gallery.entries())}."
    )


def _gallery_size(size) -> None:
  if size not in gallery.SIZES:
    raise ValueError(
      f"repro_size={size!r} is no gallery size; the sizes are "
      f"{', '.join(gallery.SIZES)}."
    )


@dataclasses.dataclass
class RunSettings(Settings):
  """One run: a problem, a curvature, an optimizer and a measurement (each
  chosen by its config group), and how the run goes."""

  name: str = setting(
    "default",
    Parsed(folder_name, "a folder name"),
    "sweep name: its runs go under reports/<name>/",
  )
  device: str = setting(
    "auto",
    OneOf(devices.PLATFORMS),
    "auto (JAX's "
    "default backend), cpu, gpu or tpu: fails clearly "
    "where that platform is absent",
  )
  devices: int = setting(
    1,
    Parsed(devices.check_count, "a whole number >= 1"),
    "local devices of that platform each batch is split across (data parallel)",
  )
  seed: int = setting(0, SEED, "the repetition: sweep seed=0,1,2 for three")
  init_seed: int = setting("${seed}", SEED, "parameter initialisation")
  data_seed: int = setting("${seed}", SEED, "the order of the batches")
  force: bool = setting(False, Flag(), "redo a run even if it finished")
  progress: bool = setting(True, Flag(), "progress bars and lines")
  continue_on_error: bool = setting(
    False, Flag(), "a failing run records ERROR.json, the sweep goes on"
  )
  lock_wait_s: float = setting(
    0.0,
    Number(0, finite=False),
    "seconds to wait for a run directory "
    "another process holds (inf: until free), then skip the run",
  )
  plugins: list[str] = setting(
    [],
    ListOf(Text()),
    "modules or .py files declaring components of "
    "your own, imported before the config is composed (give it on the "
    "command line: plugins=[my_lab.models,./my_model.py])",
  )
  compilation_cache: str | None = setting(
    "reports/.jax_cache",
    Text(null=True),
    "where the command keeps JAX's "
    "compiled programs (null: no cache; safe to delete)",
  )
  repro: str | None = setting(
    None,
    Parsed(_gallery_entry, "a gallery entry's name", null=True),
    "the gallery entry this run reproduces (+experiment=repro_NAME and "
    "+experiment=gallery set it; curvbench report judges its claims)",
  )
  repro_size: str | None = setting(
    None,
    Parsed(_gallery_size, "a gallery size", null=True),
    "the size of the gallery entry this run belongs to (cpu, accelerator "
    "or tiny; the gallery's presets set it), which its page describes",
  )
  tuning: Tuning = dataclasses.field(default_factory=Tuning)
  canonical: Canonical = dataclasses.field(default_factory=Canonical)
  problem: Any = setting(None, Choice(PROBLEMS), "problem=NAME")
  curvature: Any = setting(None, Choice(CURVATURES), "curvature=NAME")
  optimizer: Any = setting(None, Choice(OPTIMIZERS), "optimizer=NAME")
  measure: Any = setting(None, MeasureSection(), "measure=NAME")

  @classmethod
  def what(cls) -> str:
    return "the run"

  def disagreements(self, prefix):
    yield from super().disagreements(prefix)
    for name in measurements.MEASUREMENTS:
      yield from getattr(self.measure, name).run_disagreements(
        self, f"measure.{name}"
      )
      for problem in getattr(self.measure, name).problems:
        if problem not in options("problem"):
          yield (
            f"Unknown measure.{name}.problems {problem!r}"
            f"{_nearest(problem, options('problem'))}; choose among "
            f"{', '.join(options('problem'))}."
          )
    yield from self.measure.chosen.batch_disagreements(self)
    if self.curvature.per_example_alone and self.problem.couples_examples:
      yield (
        f"curvature={self.curvature.name} forms each example's gradient "
        f"from that example alone, but problem {self.problem.name!r} "
        "normalises over the batch (batch norm), so an example's "
        "gradient depends on the rest of its batch: use "
        "curvature=implicit_exact (products through the whole batch), "
        "or a normalisation per example (problem.norm=group or layer)."
      )
    if self.devices > 1 and self.problem.couples_examples:
      yield (
        f"devices={self.devices} splits each batch over devices, and "
        f"problem {self.problem.name!r} normalises over the batch "
        "(batch norm): K-FAC's steps and the curvature phases would "
        "normalise each device's part by its own statistics, the other "
        "steps by the whole batch's; use devices=1, or a normalisation "
        "per example (problem.norm=group or layer)."
      )


# --- the ConfigStore ----------------------------------------------------------


@dataclasses.dataclass
class SweeperSettings:
  """The `hydra/sweeper: tuning` node: curvbench's sweeper, Hydra's adapter
  over `curvbench.planning` (hydra_plugins/curvbench_sweeper)."""

  _target_: str = "hydra_plugins.curvbench_sweeper.tuning_sweeper.TuningSweeper"
  max_batch_size: Any = None
  params: Any = None
  sweeps: Any = None  # a list of `params`-like mappings: their union


ConfigStore.instance().store(
  group="hydra/sweeper",
  name="tuning",
  node=SweeperSettings,
  provider="curvbench",
)


def _problem_node(name: str) -> DictConfig:
  """The problem's settings with a defaults list that picks its dataset
  (group problem/data) unless another is chosen."""
  node = OmegaConf.structured(PROBLEMS.defaults(name))
  with open_dict(node):
    node.defaults = ["_self_", {"data": PROBLEMS.get(name).default_data}]
  return node


def _measurement_mode(kind: str) -> str:
  """The estimation mode of measurement `kind`; an unknown kind is left
  to the check of `measure.kind`, which names it."""
  known = kind in measurements.MEASUREMENTS.names()
  chosen = measurements.MEASUREMENTS.get(kind) if known else None
  return (chosen or measurements.Measurement).default_mode


def _measured_mode(settings):
  """A component's settings as its config group's node: a curvature whose
  `mode` is null takes the measurement's."""
  if getattr(settings, "mode", "") is not None:
    return settings
  node = OmegaConf.structured(settings)
  node.mode = MEASUREMENT_MODE
  return node


# The registries whose components the config groups choose from.
REGISTRIES = (
  PROBLEMS,
  DATASETS,
  CURVATURES,
  OPTIMIZERS,
  measurements.MEASUREMENTS,
)
_stored: list[tuple] = []  # the registered names when `store` last ran


def options(group: str) -> list[str]:
  """The choices of a config group (e.g. 'problem'): its registered
  components and its presets in conf/."""
  names = [n for r in REGISTRIES if r.group == group for n in r.names()]
  nested = measure_groups().get(group.removeprefix("measure/"))
  if group.startswith("measure/") and nested is not None:
    names += nested.registry.names()
  names += [p.stem for p in (CONF_DIR / group).glob("*.yaml")]
  if group == "experiment":
    names += gallery.experiments()
  return sorted(set(names))


def store() -> None:
  """Puts every registered component's settings, and the run's, in Hydra's
  ConfigStore: again where components were registered or removed since."""
  plugins.load_installed()
  # By class too: a model given from Python again replaces its class.
  registered = tuple((n, r.get(n)) for r in REGISTRIES for n in r.names())
  if _stored == [registered]:
    return
  _stored[:] = [registered]
  cs = ConfigStore.instance()
  cs.store(name=RUN_SCHEMA, node=RunSettings, provider="curvbench")
  for name in PROBLEMS:
    cs.store(
      group="problem", name=name, node=_problem_node(name), provider="curvbench"
    )
  for registry in (DATASETS, CURVATURES, OPTIMIZERS):
    for name in registry:
      cs.store(
        group=registry.group,
        name=name,
        node=_measured_mode(registry.defaults(name)),
        provider="curvbench",
      )
  nested = measure_groups()
  for group, choice in nested.items():
    for name in choice.registry:
      cs.store(
        group=f"measure/{group}",
        name=name,
        node=choice.registry.defaults(name),
        provider="curvbench",
      )
  section = measurements.schema()
  for name in measurements.MEASUREMENTS:
    node = OmegaConf.structured(section(kind=name))
    with open_dict(node):
      node.defaults = [
        "_self_",
        *({group: choice.default} for group, choice in nested.items()),
      ]
    cs.store(group="measure", name=name, node=node, provider="curvbench")
  for name, node in gallery.experiments().items():
    cs.store(
      group="experiment",
      name=name,
      node=node,
      package="_global_",
      provider="curvbench",
    )


def measure_groups() -> dict[str, Choice]:
  """The config groups inside the `measure` section: each measurement's
  `Choice` settings (e.g. `timing/baseline`, chosen by
  `measure/timing/baseline=NAME`; one without a default component is
  null until chosen), by group path."""
  return {
    f"{name}/{f.name}": f.metadata["check"]
    for name in measurements.MEASUREMENTS
    for f in dataclasses.fields(measurements.MEASUREMENTS.get(name))
    if isinstance(f.metadata.get("check"), Choice)
  }


# --- checking a config --------------------------------------------------------


def plain(node) -> dict:
  """A config (section) as a plain dict, interpolations resolved."""
  if isinstance(node, DictConfig):
    return cast(dict, OmegaConf.to_container(node, resolve=True))
  if dataclasses.is_dataclass(node) and not isinstance(node, type):
    return dataclasses.asdict(node)
  return dict(node)


def run_values(cfg) -> dict:
  """The run's settings in a composed config (Hydra's own left out), as a
  plain dict."""
  if not isinstance(cfg, DictConfig):
    return {k: v for k, v in cfg.items() if k != "hydra"}
  return {
    k: OmegaConf.to_container(cfg[k], resolve=True)
    if OmegaConf.is_config(cfg[k])
    else cfg[k]
    for k in cfg
    if k != "hydra"
  }


def refusals(cfg) -> Iterator[str]:
  """A message for each setting of `cfg` (a composed config) that is not
  allowed: unknown keys and bad values first, then ignored keys and
  settings that disagree."""
  values = run_values(cfg)
  # A group's settings renamed (optimizer=adam optimizer.name=sgd): checked
  # as the settings they are, which says how to choose another one.
  if isinstance(cfg, DictConfig):
    for group in _groups():
      chosen = OmegaConf.get_type(cfg, group) if group in cfg else None
      if (
        isinstance(chosen, type)
        and issubclass(chosen, Component)
        and values[group].get("name") not in chosen.registered_names
      ):
        yield from chosen.refusals(values[group], group)
        return
    for path in measure_groups():
      key = "measure." + path.replace("/", ".")
      node = OmegaConf.select(cfg, key)
      chosen = (
        OmegaConf.get_type(node) if isinstance(node, DictConfig) else None
      )
      name = node.get("name") if isinstance(node, DictConfig) else None
      if (
        isinstance(chosen, type)
        and issubclass(chosen, Component)
        and name not in chosen.registered_names
      ):
        yield (
          f"{key}.name={name!r} is not allowed: these are the settings "
          f"of {chosen.what()}; choose another by its config group "
          f"(measure/{path}={name}), not by {key}.name."
        )
        return
  yield from RunSettings.refusals(values)


def _choosers() -> set[str]:
  """The config groups that choose a component (`problem`,
  `measure/timing/baseline`, ...)."""
  return {r.group for r in REGISTRIES} | {
    f"measure/{g}" for g in measure_groups()
  }


def _nearest(name: str, names) -> str:
  close = difflib.get_close_matches(name, list(names), n=3)
  return f" (did you mean {' or '.join(close)}?)" if close else ""


def _groups() -> dict:
  return {
    f.name: f.metadata["check"].registry
    for f in dataclasses.fields(RunSettings)
    if isinstance(f.metadata.get("check"), Choice)
  }


def validate(cfg) -> None:
  """Raises a `ConfigError` naming the first setting of `cfg` (a composed
  config) that is not allowed, its value and what is allowed."""
  for message in refusals(cfg):
    raise ConfigError(message)


def load(cfg) -> RunSettings:
  """The typed settings of `cfg` (a composed config), checked."""
  validate(cfg)
  return RunSettings.from_values(run_values(cfg), checked=True)


def explain(error: Exception, overrides=()) -> str:
  """What a Hydra composition error means, in the words `validate` uses
  where it can tell: a value of the wrong type, or a key that is not a
  setting (named with the nearest ones; with its value where one of the
  `overrides` gave it)."""
  cause = error.__cause__
  where = getattr(cause, "object_type", None)
  key = getattr(cause, "key", None)
  if not (
    isinstance(cause, OmegaConfBaseException)
    and isinstance(where, type)
    and issubclass(where, Settings)
    and isinstance(key, str)
  ):
    missing = re.search(r"Could not find '([\w/]+)/([^']+)'", str(error))
    if missing and missing[1] in _choosers():
      return (
        f"Unknown {missing[1]} {missing[2]!r}"
        f"{_nearest(missing[2], options(missing[1]))}; choose one of "
        f"{', '.join(options(missing[1]))}, or declare your own in a "
        "module named by plugins=[...]."
      )
    unchosen = re.search(
      r"Could not override 'measure\.(\w+)\.(\w+)\.", str(error)
    )
    path = unchosen and f"{unchosen[1]}/{unchosen[2]}"
    if (
      unchosen
      and path in measure_groups()
      and measure_groups()[path].default is None
    ):
      return (
        f"measure.{unchosen[1]}.{unchosen[2]} is null until chosen: "
        f"give measure/{path}=NAME before its settings (one of "
        f"{', '.join(options('measure/' + path))})."
      )
    # Hydra's own words, less its search path (not the user's concern).
    text = f"{error}{f': {cause}' if cause else ''}"
    return text.split("\nConfig search path")[0].strip()
  full = cause.full_key or key
  prefix = full[: -len(key)].rstrip(".")
  field = {f.name: f for f in dataclasses.fields(where)}.get(key)
  if field is None:
    given = {
      o.partition("=")[0].lstrip("+~"): o.partition("=")[2] for o in overrides
    }
    return (
      where.unknown(key, prefix, given[full])
      if full in given
      else where.unknown(key, prefix)
    )
  check = field.metadata.get("check")
  allowed = (
    check.describe()
    if check is not None
    else f"a {getattr(field.type, '__name__', field.type)}"
  )
  return f"{full}={cause.value!r} is not allowed: {full} must be {allowed}."


# --- composing ----------------------------------------------------------------


def run_dir_name(override_dirname: str, limit: int = 120) -> str:
  """A sweep run's directory name: its overrides, hashed when too long."""
  if len(override_dirname) <= limit:
    return override_dirname or "default"
  digest = hashlib.sha1(override_dirname.encode()).hexdigest()[:12]
  return f"{override_dirname[: limit - 14]}..{digest}"


def register_resolvers() -> None:
  """The resolvers the config uses: `curvbench_run_dir` (a sweep run's
  directory name), `curvbench_mode` (a measurement's estimation mode) and
  `curvbench_token` (random, once per config: single runs started in the
  same second get different directories)."""
  if not OmegaConf.has_resolver("curvbench_run_dir"):
    OmegaConf.register_new_resolver("curvbench_run_dir", run_dir_name)
  if not OmegaConf.has_resolver("curvbench_mode"):
    OmegaConf.register_new_resolver("curvbench_mode", _measurement_mode)
  if not OmegaConf.has_resolver("curvbench_token"):
    # Cached per config, as Hydra's `now` is, so that every read of the
    # run directory gives the same name.
    OmegaConf.register_new_resolver(
      "curvbench_token", lambda: uuid.uuid4().hex[:6], use_cache=True
    )


def coerced_flags(cfg, overrides) -> Iterator[str]:
  """A message for each override that gave a true/false setting a value
  other than true or false (`force=1`, `per_block=yes`): OmegaConf reads
  those as booleans, so only the override itself shows them."""
  for override in OverridesParser.create().parse_overrides(list(overrides)):
    if override.is_sweep_override():
      continue
    key = override.get_key_element().lstrip("+~")
    value = override.value()
    if isinstance(
      OmegaConf.select(cfg, key, default=None), bool
    ) and not isinstance(value, bool):
      yield f"{key}={value!r} is not allowed: {key} must be true or false."


def plugins_of(overrides) -> list[str]:
  """The plugins an override list names (`plugins=[a,b]`, `+plugins=a`):
  read before Hydra composes, since they add the config groups' choices."""
  found = []
  for override in OverridesParser.create().parse_overrides(list(overrides)):
    if override.get_key_element().lstrip("+~") != "plugins":
      continue
    if override.is_sweep_override():
      raise ConfigError(
        "plugins cannot be swept: give one list, "
        "plugins=[a,b], for every run of the sweep."
      )
    value = override.value()
    found += [str(v) for v in (value if isinstance(value, list) else [value])]
  return found


def compose(
  *overrides: str, check: bool = True, with_hydra: bool = False
) -> DictConfig:
  """The config of `curvbench OVERRIDES...`, e.g.
  `compose("problem=convnet", "curvature=diagonal", "seed=1")`; checked
  (`validate`) unless `check` is False; with Hydra's own node (`hydra`:
  its directories, launcher, ...) where `with_hydra`.

  Raises:
    ConfigError: for a value of the wrong type, an unknown key, or (when
      checked) any setting `validate` refuses.
  """
  register_resolvers()
  plugins.load(plugins_of(overrides))
  store()
  with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
    try:
      cfg = hydra_compose(
        "config", overrides=list(overrides), return_hydra_config=with_hydra
      )
    except ConfigCompositionException as e:
      raise ConfigError(explain(e, overrides)) from e
  for message in coerced_flags(cfg, overrides):
    raise ConfigError(message)
  if check:
    validate(cfg)
  return cfg
