"""What identifies a run, and the provenance columns its records carry (the
code, versions and device behind them come from `core.environment`).

A run's id is a hash of what it measures with: its fully resolved config,
less the keys that do not change its results (`NOT_IDENTITY`: the sweep's
name, progress output, error handling, the skip rule, the report-only
tuning section, the lock's wait and the compilation cache), the code (the
commit, and a hash of uncommitted changes) and the data (the dataset's
fingerprint: the sha256 of the files it reads, or its generator, version
and settings) and the code it runs from outside curvbench: each plugin it
names with the local modules they import, and the code of a model given
from Python (`plugin_code`). Two runs that differ in any of these never
share an id, are never taken for each other on resume, and the report
keeps them apart.
Every record row carries the id and the provenance columns of `columns`;
the run's whole config, flattened to dotted keys, is the run's `config`
table, joined on `run_id`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Iterator

from omegaconf import DictConfig, OmegaConf

import problems
from curvbench import config, plugins
from curvbench.core.environment import code_version, device, versions

NOT_IDENTITY = (
  "name",
  "force",
  "progress",
  "continue_on_error",
  "canonical",
  "tuning",
  "lock_wait_s",
  "compilation_cache",
)


def flatten(node, prefix: str = "") -> dict:
  """`{dotted.key: value}` of a config; lists become JSON text."""
  if isinstance(node, DictConfig):
    node = OmegaConf.to_container(node, resolve=True)
  out = {}
  for key, value in node.items():
    name = f"{prefix}{key}"
    if isinstance(value, dict):
      out.update(flatten(value, f"{name}."))
    elif isinstance(value, (list, tuple)):
      out[name] = json.dumps(value)
    else:
      out[name] = value
  return out


def identity_config(cfg) -> dict:
  """The flattened config keys that make up a run's identity."""
  return {
    k: v for k, v in flatten(cfg).items() if k.split(".")[0] not in NOT_IDENTITY
  }


def inputs(cfg) -> dict:
  """The code (`code_version`), the data (the dataset's fingerprint) and
  the code from outside curvbench (`plugin_code`) a run with `cfg`
  measures with."""
  section = cfg["problem"]["data"]
  if isinstance(section, DictConfig):
    section = OmegaConf.to_container(section, resolve=True)
  return dict(
    code=code_version()["code"],
    dataset=problems.DATASETS.load(section).fingerprint(),
    **plugin_code(cfg),
  )


def _components(settings) -> Iterator[type]:
  """The classes of `settings` and of the settings nested in it; of the
  `measure` section, the measurement that runs only."""
  yield type(settings)
  for field in dataclasses.fields(settings):
    value = getattr(settings, field.name)
    if field.name == "measure" and hasattr(value, "chosen"):
      value = value.chosen
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
      yield from _components(value)


def plugin_code(cfg) -> dict:
  """The code a run with `cfg` executes outside curvbench: `plugin_sources`,
  JSON of `{plugin: hash}` for each plugin it names (`plugins.digest`: its
  files and the local modules they import, whether or not it registers
  anything), and `plugins`, one hash over those and the code of each of
  its components declared outside curvbench (`plugins.source`); both None
  where it runs curvbench's own code only."""
  named = {
    str(name): plugins.digest(str(name)) for name in cfg.get("plugins") or []
  }
  sources = sorted(
    {
      f"{c.__module__}.{c.__qualname__}={code}"
      for c in _components(config.load(cfg))
      if (code := plugins.source(c)) is not None
    }
    | {f"plugin {name}={code}" for name, code in named.items()}
  )
  if not sources:
    return dict(plugins=None, plugin_sources=None)
  return dict(
    plugins=hashlib.sha256("\n".join(sources).encode()).hexdigest()[:12],
    plugin_sources=json.dumps(named, sort_keys=True) if named else None,
  )


def run_id(cfg) -> str:
  """A 12-hex-digit hash of the resolved config's identity keys, the code
  and the data (`inputs`)."""
  text = json.dumps(
    dict(identity_config(cfg), **inputs(cfg)), sort_keys=True, default=str
  )
  return hashlib.sha256(text.encode()).hexdigest()[:12]


def differences(old: dict, new: dict, limit: int = 5) -> str:
  """`key: old -> new` for the first `limit` keys that differ."""
  keys = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
  parts = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys[:limit]]
  if len(keys) > limit:
    parts.append(f"and {len(keys) - limit} more")
  return "; ".join(parts)


def columns(cfg, precision: str) -> dict:
  """The provenance columns every record row of the run carries."""
  code = code_version()
  return dict(
    run_id=run_id(cfg),
    **inputs(cfg),
    init_seed=int(cfg.init_seed),
    data_seed=int(cfg.data_seed),
    precision=precision,
    **device(cfg.device, int(cfg.devices)),
    versions=" ".join(f"{k}={v}" for k, v in versions().items()),
    commit=code["commit"],
    dirty=code["dirty"],
    timestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
  )
