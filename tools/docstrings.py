"""Every public name of the project's packages has a docstring.

`python tools/docstrings.py` (from the repository root, run by `make lint`)
parses each module of estimators, problems, curvbench and hydra_plugins,
without importing it, prints `path:line: name` for each public function,
class or method with no docstring, and exits 1 if there is any.

Public: a module-level function or class whose name does not start with
`_`, in a module no part of whose path starts with `_` (`__init__.py`
aside), and the methods of such a class whose names do not start with `_`
(a `@property` getter included). Exempt, as a reader would not want them
documented twice: a method that overrides a documented method of a base
class defined in the project (found by the base's name, through its own
bases too), a property's setter or deleter, and `@overload` stubs.
"""

import ast
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("estimators", "problems", "curvbench", "hydra_plugins")

Function = ast.FunctionDef | ast.AsyncFunctionDef


def is_public_module(path: str) -> bool:
  """Whether the module at `path` (relative, `/`-separated) is public: no
  folder or file name starts with `_`, but `__init__.py` counts as its
  package."""
  parts = path.split("/")
  if parts[-1] == "__init__.py":
    parts.pop()
  return not any(part.startswith("_") for part in parts)


def decorator_names(node: Function | ast.ClassDef) -> set[str]:
  """The decorators' names: `overload` for `@typing.overload`, `setter`
  for `@x.setter`, the called name for `@functools.cache()`."""
  names = set()
  for decorator in node.decorator_list:
    if isinstance(decorator, ast.Call):
      decorator = decorator.func
    if isinstance(decorator, ast.Attribute):
      names.add(decorator.attr)
    elif isinstance(decorator, ast.Name):
      names.add(decorator.id)
  return names


def base_names(node: ast.ClassDef) -> list[str]:
  """The names a class's bases are written with (`Block` for both `Block`
  and `blocks.Block`; `Generic[T]` as `Generic`)."""
  names = []
  for base in node.bases:
    if isinstance(base, ast.Subscript):
      base = base.value
    if isinstance(base, ast.Attribute):
      names.append(base.attr)
    elif isinstance(base, ast.Name):
      names.append(base.id)
  return names


def methods(node: ast.ClassDef | ast.If) -> Iterator[Function]:
  """The functions a class's body defines, those under an `if` in it too
  (a declaration for the type checker only, `if TYPE_CHECKING:`)."""
  for item in node.body + (node.orelse if isinstance(node, ast.If) else []):
    if isinstance(item, Function):
      yield item
    elif isinstance(item, ast.If):
      yield from methods(item)


class Project:
  """The project's classes by name, to look up a method's base classes."""

  def __init__(self, trees: Mapping[str, ast.Module]):
    self.classes: dict[str, list[ast.ClassDef]] = {}
    for tree in trees.values():
      for node in tree.body:
        if isinstance(node, ast.ClassDef):
          self.classes.setdefault(node.name, []).append(node)

  def documented_in_base(self, cls: ast.ClassDef, method: str) -> bool:
    """Whether a base class of `cls` (or one of theirs) defined in the
    project documents `method`. A base named as several project classes
    counts if any of them does."""
    seen: set[int] = set()
    pending = list(base_names(cls))
    while pending:
      for base in self.classes.get(pending.pop(), []):
        if id(base) in seen:
          continue
        seen.add(id(base))
        for item in methods(base):
          if item.name == method and ast.get_docstring(item):
            return True
        pending.extend(base_names(base))
    return False


def undocumented(sources: Mapping[str, str]) -> list[tuple[str, int, str]]:
  """The public names without a docstring in the modules `sources` holds
  (relative path to source text), as (path, line, name) with a method
  named `Class.method`, in path and line order."""
  trees = {path: ast.parse(text, path) for path, text in sources.items()}
  project = Project(trees)
  found = []
  for path, tree in sorted(trees.items()):
    if not is_public_module(path):
      continue
    for node in tree.body:
      if not isinstance(node, Function | ast.ClassDef):
        continue
      if node.name.startswith("_") or "overload" in decorator_names(node):
        continue
      if not ast.get_docstring(node):
        found.append((path, node.lineno, node.name))
      if not isinstance(node, ast.ClassDef):
        continue
      for method in methods(node):
        decorators = decorator_names(method)
        if (
          method.name.startswith("_")
          or decorators & {"overload", "setter", "deleter"}
          or ast.get_docstring(method)
          or project.documented_in_base(node, method.name)
        ):
          continue
        found.append((path, method.lineno, f"{node.name}.{method.name}"))
  return found


def project_sources(root: Path = ROOT) -> dict[str, str]:
  """Every module of the project's packages, by path relative to `root`."""
  return {
    path.relative_to(root).as_posix(): path.read_text()
    for package in PACKAGES
    for path in sorted((root / package).rglob("*.py"))
  }


def main() -> int:
  """Prints the undocumented public names and their count; 1 if any."""
  found = undocumented(project_sources())
  for path, line, name in found:
    print(f"{path}:{line}: {name}")
  if found:
    print(f"{len(found)} public names without a docstring")
    return 1
  print("every public name has a docstring")
  return 0


if __name__ == "__main__":
  sys.exit(main())
