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

Reading records imports none of the plugins they name unless the reader
trusts it by name, and then only where its code is the code the records
were made with (`load_recorded`): a folder received from someone, or a
plugin edited since, runs nothing on the reader's machine.

Built-in components are registered before any plugin is imported, so a
plugin's name that clashes with one is refused naming both; a plugin that
fails to import is refused with its error. `digest` gives the hash of a
plugin's code (with the local modules it imports, found without running
it) and `source` that of a component's, for the run's identity.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import sys
import sysconfig
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


def trusted(name: str, trust: Iterable[str]) -> bool:
  """Whether `trust` names plugin `name` (the same module name, or a path
  to the same file)."""
  for item in trust:
    if item == name or (
      is_file_name(item)
      and is_file_name(name)
      and Path(item).expanduser().resolve() == Path(name).expanduser().resolve()
    ):
      return True
  return False


def load_recorded(
  name: str, recorded: str | None, trust: Iterable[str], how: str
) -> str | None:
  """Imports plugin `name`, named by records being read, only where `trust`
  names it and its code now is the code the records were made with
  (`recorded`: its `digest` then); returns why it was not imported (None
  where it was). `how` says how to trust it (a command line)."""
  if not trusted(name, trust):
    return (
      f"plugin {name!r} was not imported: reading records runs no code "
      f"they name; once you have checked its code, trust it with {how}"
    )
  if recorded is None:
    return (
      f"plugin {name!r} was not imported although trusted: its runs "
      "recorded no hash of its code to check it against (recorded before "
      "curvbench kept one); run them again to record it"
    )
  now = digest(name)
  if now != recorded:
    found = "is not found here" if now is None else f"is now {now}"
    return (
      f"plugin {name!r} was not imported although trusted: its code "
      f"{found}, not the code its runs recorded ({recorded}); restore "
      "that code, or run the sweep again with this code"
    )
  try:
    load([name])
  except PluginError as e:
    return str(e)
  return None


def _import(what: str, importer):
  try:
    return importer()
  except PluginError:
    raise
  except Exception as e:
    raise PluginError(
      f"{what} failed to import: {type(e).__name__}: {e}"
    ) from e


def _module(name: str):
  if not is_file_name(name):
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
  # As `python path` would: the file's own folder first on the path, so the
  # local modules it imports are the ones its identity hashes (`code_files`).
  if str(path.parent) not in sys.path:
    sys.path.insert(0, str(path.parent))
  module = importlib.util.module_from_spec(spec)
  sys.modules[module_name] = module
  try:
    spec.loader.exec_module(module)
  except BaseException:
    del sys.modules[module_name]
    raise
  return module


def is_file_name(name: str) -> bool:
  """Whether plugin `name` is the path of a `.py` file (else a module)."""
  return name.endswith(".py") or "/" in name or "\\" in name


def _digest(text: str) -> str:
  return hashlib.sha256(text.encode()).hexdigest()


def _installed_folders() -> list[Path]:
  """Where the standard library and installed distributions lie: their code
  is named by the versions a run records, and never followed here."""
  names = ("stdlib", "platstdlib", "purelib", "platlib")
  paths = sysconfig.get_paths()
  return [Path(paths[n]).resolve() for n in names if n in paths]


def _inside(path: Path, folders) -> bool:
  return any(path.is_relative_to(f) for f in folders)


def _local(module: str, roots: list[Path]) -> list[Path]:
  """The files under `roots` that importing `module` (dotted) executes: each
  package's `__init__.py` on the way and the module's own file."""
  parts = module.split(".")
  for root in roots:
    found, folder = [], root
    for i, part in enumerate(parts):
      if (folder / part / "__init__.py").is_file():
        folder = folder / part
        found.append(folder / "__init__.py")
      elif i == len(parts) - 1 and (folder / f"{part}.py").is_file():
        found.append(folder / f"{part}.py")
      else:
        break  # an attribute of the package, or not under this root
    if found:
      return found
  return []


def _imports(path: Path) -> list[tuple[str, Path | None]]:
  """The modules the import statements of `path` name, wherever they stand
  (in a function too): `(dotted name, folder)` with the folder a relative
  import starts from, else None."""
  try:
    tree = ast.parse(path.read_text(), str(path))
  except (OSError, SyntaxError, ValueError):
    return []  # importing it fails and says why
  found: list[tuple[str, Path | None]] = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      found += [(alias.name, None) for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = None
      if node.level > len(path.parents):
        continue  # beyond the file system's root: importing it fails
      if node.level:  # relative: from the file's own package upwards
        base = path.parents[node.level - 1]
      module = node.module or ""
      if module:
        found.append((module, base))
      found += [  # `from package import module`
        (f"{module}.{alias.name}".lstrip("."), base) for alias in node.names
      ]
  return found


def code_files(name: str) -> list[Path]:
  """The files of plugin `name` (a module name or a `.py` path) and of
  every local module it imports, found without importing anything: the
  module's file (with its packages' `__init__.py`), then, followed from
  each file's import statements, the modules that lie in the folder the
  plugin is imported from; never curvbench's own (the commit names it),
  the standard library's or another installed distribution's (their
  versions do). Empty where `name` is curvbench's own or is not found.
  """
  top = None
  if is_file_name(name):
    path = Path(name).expanduser().resolve()
    start, roots = ([path], [path.parent]) if path.is_file() else ([], [])
  else:
    top = name.split(".")[0]
    try:  # a top-level name: finding it runs nothing
      spec = None if top in OWN_PACKAGES else importlib.util.find_spec(top)
    except (ImportError, ValueError):
      spec = None
    folders = [
      Path(f) for f in (spec and spec.submodule_search_locations) or []
    ]
    if folders:
      roots = [d.resolve().parent for d in folders]
      start = _local(name, roots) or [
        f for d in folders for f in sorted(d.rglob("*.py"))
      ]
    elif spec and spec.origin and spec.origin.endswith(".py"):
      start = [Path(spec.origin).resolve()]
      roots = [start[0].parent]
    else:
      start, roots = [], []
  installed = _installed_folders()

  def follow(module: str) -> bool:
    first = module.split(".")[0]
    if first in OWN_PACKAGES:
      return False
    return first == top or not any(_inside(r, installed) for r in roots)

  seen: set[Path] = set()
  todo = [p.resolve() for p in start]
  while todo:
    path = todo.pop()
    if path in seen:
      continue
    seen.add(path)
    for module, base in _imports(path):
      if base is not None:
        todo += [p.resolve() for p in _local(module, [base])]
      elif follow(module):
        todo += [p.resolve() for p in _local(module, roots)]
  return sorted(seen)


def digest(name: str) -> str | None:
  """A hash of the code of plugin `name` (`code_files`: its files and the
  local modules they import), computed without importing it; None where it
  is curvbench's own or cannot be found."""
  files = code_files(name)
  if not files:
    return None
  return _hash_files(files)


def _hash_files(files: list[Path]) -> str:
  texts = []
  for f in files:
    try:
      texts.append(f"{f.name}\n{f.read_text()}")
    except (OSError, UnicodeDecodeError) as e:
      texts.append(f"{f.name}\n<unreadable: {type(e).__name__}>")
  return _digest("\0".join(sorted(texts)))[:12]


def source(cls: type) -> str | None:
  """A hash of the code of component `cls` where it lies outside curvbench
  (None for curvbench's own, which the commit names): a class's own
  `source_identity()` where it has one (a model given from Python), else
  the code of its module with the local modules it imports
  (`code_files`), or, defined in a notebook, its class's source."""
  own = getattr(cls, "source_identity", None)
  if callable(own):
    return own()
  module = sys.modules.get(cls.__module__)
  top = cls.__module__.split(".")[0]
  if top in OWN_PACKAGES or module is None:
    return None
  file = getattr(module, "__file__", None)
  if not file:  # defined in a notebook
    return _digest(inspect.getsource(cls))[:12]
  if getattr(sys.modules.get(top), "__path__", None) is None:
    return digest(str(file))  # a module of its own, or a plugin file
  return digest(cls.__module__)
