"""Components declared outside curvbench: in a module, a `.py` file, or an
installed package.

A plugin is Python code that registers components as curvbench's own
modules do (`@PROBLEMS.register`, `@CURVATURES.register`, ...); importing it
is what adds them. Three ways in:

- the `plugins` setting, read from the command line before the config is
  composed (`curvbench plugins=[my_lab.models] problem=my_model`), each
  item a module name or a path to a `.py` file;
- `curvbench.measure(..., plugins=[...])` and `config.compose`, which read
  the same setting;
- an installed distribution's entry point in the group `curvbench.plugins`
  (`[project.entry-points."curvbench.plugins"] my_lab = "my_lab.models"`),
  imported before the first config is stored (`config.store`) and before a
  sweep's records are read (`sweep.load_sweep`).

Built-in components are registered before any plugin is imported, so a
plugin's name that clashes with one is refused naming both; a plugin that
fails to import is refused with its error. `source` gives the hash of a
component's code where it lies outside curvbench, for the run's identity.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import sys
from collections.abc import Iterable
from pathlib import Path

from curvbench.components.registry import Registry

ENTRY_POINTS = "curvbench.plugins"
# The packages whose code the run's `code` (the commit) already names.
OWN_PACKAGES = ("curvbench", "problems", "estimators", "hydra_plugins")

_installed_loaded: list[bool] = []  # [True] once the entry points were imported


class PluginError(ValueError):
  """A plugin that cannot be imported, or that registers a clashing name."""


def _builtins() -> None:
  """Registers every built-in component (each registry imports its own
  package), so that a plugin's clashing name is refused as the plugin's."""
  for registry in Registry.instances():
    registry.names()


def load_installed() -> None:
  """Imports every installed `curvbench.plugins` entry point, once."""
  if _installed_loaded:
    return
  _builtins()
  for entry in importlib.metadata.entry_points(group=ENTRY_POINTS):
    _import(f"entry point {entry.name!r} ({entry.value})", entry.load)
  _installed_loaded.append(True)  # not where one failed: it is refused again


def load(names: Iterable[str] | str | None) -> list:
  """Imports the plugins `names` (module names or `.py` paths), each once;
  returns the modules.

  Raises:
    PluginError: naming the plugin that failed to import and its error,
      or the two components whose names clash.
  """
  if names is None:
    return []
  if isinstance(names, str):
    names = [names]
  load_installed()
  return [
    _import(f"plugin {name!r}", functools.partial(_module, str(name)))
    for name in names
  ]


def _import(what: str, importer):
  try:
    return importer()
  except PluginError:
    raise
  except Exception as e:  # noqa: BLE001 - any import failure, named
    raise PluginError(
      f"{what} failed to import: {type(e).__name__}: {e}"
    ) from e


def _module(name: str):
  if not (name.endswith(".py") or "/" in name or "\\" in name):
    return importlib.import_module(name)
  path = Path(name).expanduser().resolve()
  if not path.is_file():
    raise FileNotFoundError(
      f"no file {path}: give a module name "
      "(my_lab.models) or the path of a .py file"
    )
  # One module per file, whatever path names it: a file loaded twice would
  # register its components twice.
  module_name = f"curvbench_plugin_{_digest(str(path))[:12]}_{path.stem}"
  if module_name in sys.modules:
    return sys.modules[module_name]
  spec = importlib.util.spec_from_file_location(module_name, path)
  if spec is None or spec.loader is None:  # not for a .py file
    raise ImportError(f"cannot load {path} as a module")
  module = importlib.util.module_from_spec(spec)
  sys.modules[module_name] = module
  try:
    spec.loader.exec_module(module)
  except BaseException:
    del sys.modules[module_name]
    raise
  return module


def _digest(text: str) -> str:
  return hashlib.sha256(text.encode()).hexdigest()


def source(cls: type) -> str | None:
  """A hash of the code of component `cls` where it lies outside curvbench
  (None for curvbench's own, which the commit names): a class's own
  `source_identity()` where it has one (a model given from Python), else
  every `.py` file of its top-level package, or its module's file."""
  own = getattr(cls, "source_identity", None)
  if callable(own):
    return own()
  module = sys.modules.get(cls.__module__)
  top = cls.__module__.split(".")[0]
  if top in OWN_PACKAGES or module is None:
    return None
  folders = getattr(sys.modules.get(top), "__path__", None)
  file = getattr(module, "__file__", None)
  if folders:  # a package: all of it (a component may import its helpers)
    texts = [
      f"{f.relative_to(d)}\n{f.read_text()}"
      for d in folders
      for f in sorted(Path(d).rglob("*.py"))
    ]
  elif file:
    texts = [Path(file).read_text()]
  else:  # defined in a notebook: its class's own code
    texts = [inspect.getsource(cls)]
  return _digest("\0".join(texts))[:12]
