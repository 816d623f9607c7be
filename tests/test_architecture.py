"""The codebase's seams: the layers (docs/architecture.md) import only
downwards, no import circle anywhere, no module reads another module's
private names, and outside a component's own package nothing branches on a
component's name."""

import ast
import importlib
from pathlib import Path

import pytest

from curvbench import config

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("estimators", "problems", "curvbench", "hydra_plugins")


def modules(packages=PACKAGES) -> dict[str, ast.Module]:
  """Every module of the project's packages by dotted name, parsed."""
  out = {}
  for package in packages:
    for path in sorted((ROOT / package).rglob("*.py")):
      parts = list(path.relative_to(ROOT).with_suffix("").parts)
      if parts[-1] == "__init__":
        parts.pop()
      out[".".join(parts)] = ast.parse(path.read_text(), str(path))
  return out


def imported(name: str, tree: ast.Module, known) -> set[str]:
  """The project modules `name` imports, anywhere in its body (a function's
  imports too), less the packages it belongs to (Python runs those first
  whatever it imports)."""
  package = (
    name
    if (ROOT / name.replace(".", "/")).is_dir()
    else (name.rpartition(".")[0])
  )
  targets = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(
          package.split(".")[: len(package.split(".")) + 1 - node.level]
          + ([base] if base else [])
        )
      names = [
        f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
        for a in node.names
      ]
    else:
      continue
    for target in names:
      while target and target not in known:
        target = target.rpartition(".")[0]
      if target and target != name and not name.startswith(f"{target}."):
        targets.add(target)
  return targets


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of `graph` with more than one
  module (Tarjan's algorithm)."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in graph[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for v in graph:
    if v not in index:
      visit(v)
  return found


# The layers, lowest first: a module imports its own layer and those below.
# An import inside a function counts as the module's (`imported` walks the
# whole body), so none can hide an import against the layers or a circle.
LAYERS = (
  ("library", ("estimators",)),
  ("declarations", ("curvbench.components",)),
  ("problems", ("problems",)),
  ("core", ("curvbench.core",)),
  (
    "components",
    (
      "curvbench.approximations",
      "curvbench.optimizers",
      "curvbench.measurements",
      "curvbench.gallery",
    ),
  ),
  ("app", ("curvbench",)),
  ("hydra adapter", ("hydra_plugins",)),
)


def layer(module: str) -> int:
  """The index in `LAYERS` of the layer `module` belongs to: the one whose
  package prefix is longest."""
  matches = [
    (len(prefix), i)
    for i, (_, prefixes) in enumerate(LAYERS)
    for prefix in prefixes
    if module == prefix or module.startswith(f"{prefix}.")
  ]
  if not matches:
    raise ValueError(f"{module} is in no layer: add its package to LAYERS")
  return max(matches)[1]


def against_layers(graph: dict[str, set[str]]) -> list[str]:
  """Each import in `graph` that points to a higher layer, in words."""
  return [
    f"{name} ({LAYERS[layer(name)][0]}) imports {target} "
    f"({LAYERS[layer(target)][0]})"
    for name, targets in sorted(graph.items())
    for target in sorted(targets)
    if layer(target) > layer(name)
  ]


def project_graph() -> dict[str, set[str]]:
  parsed = modules()
  return {name: imported(name, tree, parsed) for name, tree in parsed.items()}


def test_imports_follow_the_layers():
  graph = project_graph()
  assert against_layers(graph) == []
  assert "curvbench.planning" in graph["curvbench.api"]


def test_each_layer_rule_fails_on_a_planted_violation():
  planted = {
    "curvbench.core.stats": {"curvbench.measurements.training"},
    "curvbench.core.plots": {"curvbench.report"},
    "curvbench.approximations.kfac": {"curvbench.config"},
    "curvbench.api": {"hydra_plugins.curvbench_sweeper.tuning_sweeper"},
    "estimators.utils.linalg": {"curvbench.core.stats"},
  }
  assert len(against_layers(planted)) == len(planted)
  assert (
    against_layers(
      {"curvbench.measurements.spectra": {"curvbench.core.stats", "problems"}}
    )
    == []
  )


def test_an_import_inside_a_function_counts():
  """`a` imports `b` at the top and `b` imports `a` inside a function: the
  circle, and an import against the layers, are found all the same."""
  known = {"curvbench.core.stats", "curvbench.report"}
  tree = ast.parse("def f():\n  from curvbench import report\n")
  graph = {
    "curvbench.core.stats": imported("curvbench.core.stats", tree, known)
  }
  assert graph == {"curvbench.core.stats": {"curvbench.report"}}
  assert against_layers(graph) != []
  graph["curvbench.report"] = {"curvbench.core.stats"}
  assert cycles(graph) == [["curvbench.core.stats", "curvbench.report"]]


def test_no_import_circle():
  parsed = modules()
  graph = {name: imported(name, tree, parsed) for name, tree in parsed.items()}
  assert graph["curvbench.app"] >= {"curvbench.config", "curvbench.runs"}
  assert cycles(graph) == []
  assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [
    ["a", "b", "c"]
  ]


def test_no_module_reads_another_modules_private_names():
  parsed = modules((*PACKAGES, "tests"))
  uses = []
  for name, tree in parsed.items():
    aliases = {}
    for node in ast.walk(tree):
      if (
        isinstance(node, ast.ImportFrom)
        and node.module
        and (node.module.split(".")[0] in (*PACKAGES, "tests"))
      ):
        for a in node.names:
          if a.name.startswith("_") and not a.name.startswith("__"):
            uses.append(f"{name}: from {node.module} import {a.name}")
          aliases[a.asname or a.name] = node.module
      elif isinstance(node, ast.Import):
        for a in node.names:
          if a.name.split(".")[0] in (*PACKAGES, "tests"):
            aliases[a.asname or a.name.split(".")[0]] = a.name
    for node in ast.walk(tree):
      if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in aliases
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
      ):
        uses.append(f"{name}: {node.value.id}.{node.attr}")
  assert uses == []


def test_outside_its_package_nothing_branches_on_a_components_name():
  """A comparison with a registered name (`kind == "timing"`) outside the
  component's package is a hand-kept list in disguise."""
  names = {n for registry in config.REGISTRIES for n in registry}
  own = {registry.package for registry in config.REGISTRIES}
  branches = []
  for name, tree in modules().items():
    if any(name == p or name.startswith(f"{p}.") for p in own):
      continue
    for node in ast.walk(tree):
      if not isinstance(node, ast.Compare):
        continue
      for operand in (node.left, *node.comparators):
        values = (
          operand.elts
          if isinstance(operand, (ast.List, ast.Tuple, ast.Set))
          else [operand]
        )
        for value in values:
          if isinstance(value, ast.Constant) and value.value in names:
            branches.append(f"{name}:{node.lineno}: {value.value!r}")
  assert branches == []


def test_the_toolkits_old_paths_import_the_same_modules():
  """Code written before the toolkit moved to curvbench.core still runs:
  `curvbench.stats` is `curvbench.core.stats`; a name no module holds is
  still an error."""
  for name in ("stats", "records", "palette", "curvatures"):
    old = importlib.import_module(f"curvbench.{name}")
    assert old is importlib.import_module(f"curvbench.core.{name}")
  with pytest.raises(ModuleNotFoundError):
    importlib.import_module("curvbench.no_such_module")
