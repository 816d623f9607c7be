"""Writes the facts of KFAC-JAX's public API that `estimators` must match.

Run with a Python that imports the KFAC-JAX release to compare against (see
this folder's README): it walks the package and its public submodules and
records, per public name, its kind and, for classes and functions, each
parameter's name, kind and default. Defaults that are not plain literals are
recorded as "<object>". Only facts are kept (no code, no docstrings), in
tests/estimators/kfac_jax/kfac_jax_api.json, which
tests/estimators/kfac_jax/test_kfac_jax_signatures.py reads.

  python benchmarks/kfac_jax/api_facts.py \
    [--out tests/estimators/kfac_jax/kfac_jax_api.json]
"""

import argparse
import ast
import importlib
import inspect
import json
import pathlib
import re
import types

SUBMODULES = (
  "utils",
  "curvature_blocks",
  "curvature_estimator",
  "optimizer",
  "loss_functions",
  "layers_and_loss_tags",
  "tag_graph_matcher",
  "tracer",
  "patches_second_moment",
)
LITERALS = (type(None), bool, int, float, str)


def default_fact(value):
  """A default as JSON: literals (and tuples of them) as is, else a marker."""
  if isinstance(value, LITERALS):
    return value
  if isinstance(value, tuple) and all(isinstance(v, LITERALS) for v in value):
    return list(value)
  return "<object>"


def signature_facts(obj):
  """A signature as a list of parameters written as in Python: `name`,
  `name=default` (the default as JSON), `*args`, `**kwargs`, and a bare `*`
  before keyword-only parameters."""
  try:
    parameters = inspect.signature(obj).parameters.values()
  except (TypeError, ValueError):
    return None
  rows, starred = [], False
  for p in parameters:
    if p.kind is p.VAR_POSITIONAL:
      rows.append("*" + p.name)
      starred = True
      continue
    if p.kind is p.VAR_KEYWORD:
      rows.append("**" + p.name)
      continue
    if p.kind is p.KEYWORD_ONLY and not starred:
      rows.append("*")
      starred = True
    row = p.name
    if p.default is not inspect.Parameter.empty:
      row += "=" + json.dumps(default_fact(p.default))
    rows.append(row)
  return rows


def bound_names(module, reexports):
  """Names a module's own source binds at top level (not starting with _)."""
  tree = ast.parse(inspect.getsource(module))
  names = []
  for node in tree.body:
    if isinstance(node, ast.Assign):
      names += [t.id for t in node.targets if isinstance(t, ast.Name)]
    elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
      names.append(node.target.id)
    elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
      names.append(node.name)
    elif reexports and isinstance(node, ast.ImportFrom):
      names += [a.asname or a.name for a in node.names]
  return [n for n in names if not n.startswith("_") and hasattr(module, n)]


def class_members(cls):
  members = {}
  for name, value in vars(cls).items():
    if name.startswith("_") and name != "__init__":
      continue
    if isinstance(value, property):
      members[name] = {"kind": "property"}
    elif inspect.isclass(value):
      members[name] = {"kind": "class"}
    elif callable(value) or isinstance(value, (staticmethod, classmethod)):
      members[name] = {
        "kind": "method",
        "signature": signature_facts(getattr(cls, name)),
      }
  return members


def name_facts(value, package, classes):
  """A name's facts; a class of the package is described once, in `classes`
  (keyed by its defining module and name), and referred to by that key."""
  if isinstance(value, types.ModuleType):
    return {"kind": "module"}
  if inspect.isclass(value):
    if not getattr(value, "__module__", "").startswith(package):
      return {"kind": "class", "signature": signature_facts(value)}
    key = f"{value.__module__.removeprefix(package + '._src.')}.{value.__qualname__}"
    classes[key] = {
      "signature": signature_facts(value),
      "members": class_members(value),
    }
    return {"kind": "class", "class": key}
  if inspect.isfunction(value) or isinstance(value, types.BuiltinFunctionType):
    return {"kind": "function", "signature": signature_facts(value)}
  if callable(value) and not type(value).__module__.startswith("typing"):
    return {"kind": "callable"}
  return {"kind": "value"}


def borrowed(module, value):
  """Whether a module merely re-binds a name defined elsewhere: a class or
  function of another module, or one of the package's `utils` types."""
  if isinstance(value, types.ModuleType):
    return False
  if inspect.isclass(value) or inspect.isfunction(value):
    return not getattr(value, "__module__", "").startswith(module.__name__)
  utils = importlib.import_module(module.__name__.split(".")[0]).utils
  return module is not utils and any(value is v for v in vars(utils).values())


def module_facts(package, sub, classes):
  module = getattr(package, sub) if sub else package
  names = getattr(module, "__all__", None)
  if names:
    names = list(names)
  else:
    # A package's __init__ re-exports by design; a plain module's
    # re-bindings of names defined elsewhere are incidental imports.
    is_package = hasattr(module, "__path__")
    names = bound_names(module, is_package)
    if not is_package:
      names = [n for n in names if not borrowed(module, getattr(module, n))]
  return {
    name: name_facts(getattr(module, name), package.__name__, classes)
    for name in sorted(set(names))
  }


def _one_line(match):
  return "[" + re.sub(r"\n\s*", " ", match.group(1)) + "]"


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--package", default="kfac_jax")
  parser.add_argument(
    "--out", default="tests/estimators/kfac_jax/kfac_jax_api.json"
  )
  args = parser.parse_args()
  package = importlib.import_module(args.package)
  classes = {}
  modules = {
    sub: module_facts(package, sub, classes) for sub in ("", *SUBMODULES)
  }
  facts = {
    "package": args.package,
    "version": package.__version__,
    "modules": modules,
    "classes": classes,
  }
  text = json.dumps(facts, indent=1, sort_keys=True) + "\n"
  # One line per signature: the file stays short enough to read.
  text = re.sub(r"\[\n\s+(\"[^\]]*?)\n\s*\]", _one_line, text)
  pathlib.Path(args.out).write_text(text)
  counts = {sub or ".": len(rows) for sub, rows in facts["modules"].items()}
  print(f"{args.package} {facts['version']}: {counts} -> {args.out}")


if __name__ == "__main__":
  main()
