"""curvbench's harness: the Hydra app, measurements, records and reports.

It comes in layers, each importing only those below it
(docs/architecture.md; tests/test_architecture.py holds them to it):

- `curvbench.components`: how a component declares its settings and
  registry.
- `curvbench.core`: the toolkit components build on (the `Curvature`
  interface, records, statistics, figures, training loop, devices, ...).
- the components, one module each, found through their registries:
  `curvbench.approximations` (the `curvature` group),
  `curvbench.optimizers` (`optimizer`), `curvbench.measurements`
  (`measure`, one folder per measurement) and `curvbench.gallery`
  (published findings); problems and datasets are in `problems`.
- the app: `config` declares and checks a run's settings, `planning` plans
  a sweep, `runs` runs one, `app` and `cli` are the `curvbench` command,
  `api` the same from Python over any JAX model (`measure`, `Model`,
  `Data`, here at the top), `plugins` imports components declared outside
  the package, `report` merges a sweep that `sweep` loads, and `bench` is
  the benchmark of record.
"""

import importlib
import importlib.abc
import importlib.util
import sys
from typing import TYPE_CHECKING

# The type checker reads the API's types from here; at run time
# `__getattr__` imports it.
if TYPE_CHECKING:
  from curvbench.api import Data, Model, Results, measure, register_model

__all__ = ["Data", "Model", "Results", "measure", "register_model"]


def __getattr__(name):
  # The Python API (`curvbench.api`) is imported when first used: the
  # registries' modules import `curvbench.components` through this package.
  if name in __all__:
    api = importlib.import_module("curvbench.api")
    return getattr(api, name)
  raise AttributeError(f"module 'curvbench' has no attribute {name!r}")


class _ToolkitPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """`curvbench.stats` and the other toolkit modules' paths from before
  they moved to `curvbench.core`, kept working for code written against
  them: the same module object under both names. Last on the search path,
  so it answers only for a name no file holds."""

  def find_spec(self, fullname, path=None, target=None):
    head, _, leaf = fullname.partition(".")
    if head != "curvbench" or not leaf or "." in leaf or leaf == "core":
      return None
    if importlib.util.find_spec(f"curvbench.core.{leaf}") is None:
      return None
    return importlib.util.spec_from_loader(fullname, self)

  def create_module(self, spec):
    return importlib.import_module(
      f"curvbench.core.{spec.name.partition('.')[2]}"
    )

  def exec_module(self, module):
    pass


if not any(isinstance(f, _ToolkitPaths) for f in sys.meta_path):
  sys.meta_path.append(_ToolkitPaths())
