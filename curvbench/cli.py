"""The `curvbench` command's entry point. `curvbench --help` is read off
the components' sources (their `name` and docstring, Python's `ast`) and
the presets' first comment lines, so it prints without importing JAX;
`curvbench --help GROUP` and everything else go to `curvbench.app`."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import shutil
import sys
from pathlib import Path

HELP_FLAGS = ("-h", "--help")
# The config groups a user swaps, and where their components live: a
# package of modules (each registering classes with a `name`), the preset
# folder of `conf/` beside them, or both.
GROUPS = {
  "problem": (("problems", "models"), "problem"),
  "problem/data": (("problems", "datasets"), None),
  "curvature": (("curvbench", "approximations"), None),
  "optimizer": (("curvbench", "optimizers"), None),
  "measure": (("curvbench", "measurements"), None),
  "launcher": (None, "launcher"),
  "experiment": (None, "experiment"),
}
USAGE = """\
curvbench: curvature approximations of neural networks (K-FAC and its
relatives, exact Fisher / GGN / Hessian) measured and compared.

usage:
  curvbench                                  the default benchmark, then its report
  curvbench GROUP=OPTION ... KEY=VALUE ...   one run
  curvbench -m GROUP=A,B ... KEY=V1,V2 ...   a sweep (every combination)
  curvbench -m +experiment=NAME              a preset sweep (see experiment)
  curvbench report SWEEP_DIR                 a sweep's report (report.md)
  curvbench --help GROUP                     every setting of GROUP's options
  curvbench --cfg job [overrides]            the settings one run would use
  curvbench --hydra-help                     Hydra's own options
"""


def _first_line(text: str | None) -> str:
  """The first sentence of `text`, on one line."""
  if not text:
    return ""
  flat = " ".join(text.split())
  end = flat.find(". ")
  return flat if end < 0 else flat[: end + 1]


def _package_dir(parts: tuple[str, str]) -> Path | None:
  """The folder of `top.sub`, found without importing `top`."""
  spec = importlib.util.find_spec(parts[0])
  if spec is None or not spec.submodule_search_locations:
    return None
  return Path(list(spec.submodule_search_locations)[0]) / parts[1]


def _name_field(node: ast.ClassDef) -> str | None:
  """The string a class body gives `name`, if any."""
  for item in node.body:
    target = (
      item.target
      if isinstance(item, ast.AnnAssign)
      else item.targets[0]
      if isinstance(item, ast.Assign) and len(item.targets) == 1
      else None
    )
    if (
      isinstance(target, ast.Name)
      and target.id == "name"
      and isinstance(item.value, ast.Constant)
      and isinstance(item.value.value, str)
    ):
      return item.value.value
  return None


def _registered(tree: ast.Module) -> dict[str, str]:
  """`{name: first docstring line}` of each class a registry's `register`
  takes, as a decorator or called (`register(Cls, name=..., **values)`)."""
  classes = {
    node.name: node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
  }
  found = {}
  for node in classes.values():
    name = _name_field(node)
    if name and any(
      isinstance(d, ast.Attribute) and d.attr == "register"
      for d in node.decorator_list
    ):
      found[name] = _first_line(ast.get_docstring(node))
  for node in ast.walk(tree):
    if not (
      isinstance(node, ast.Call)
      and isinstance(node.func, ast.Attribute)
      and node.func.attr == "register"
      and node.args
      and isinstance(node.args[0], ast.Name)
      and node.args[0].id in classes
    ):
      continue
    cls = classes[node.args[0].id]
    values = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
    name = values.pop("name", None) or _name_field(cls)
    if name:
      found[name] = " ".join(
        filter(
          None,
          (
            _first_line(ast.get_docstring(cls)),
            ", ".join(f"{k}={v}" for k, v in values.items()),
          ),
        )
      )
  return found


def _components(folder: Path) -> dict[str, str]:
  """The registered components of the modules (and subpackages) in
  `folder`."""
  out = {}
  for path in sorted(folder.glob("*.py")) + sorted(
    folder.glob("*/__init__.py")
  ):
    out.update(_registered(ast.parse(path.read_text(), str(path))))
  return out


def _presets(folder: Path) -> dict[str, str]:
  """Each preset's first comment line (after a `# @package` line)."""
  out = {}
  for path in sorted(folder.glob("*.yaml")):
    comments = [
      line.lstrip("# ").rstrip()
      for line in path.read_text().splitlines()
      if line.startswith("#") and not line.startswith("# @package")
    ]
    out[path.stem] = _first_line(" ".join(comments[:3]))
  return out


def _gallery() -> dict[str, str]:
  """`repro_NAME` of each gallery entry (its CPU size) and its title."""
  folder = _package_dir(("curvbench", "gallery"))
  out = {
    "gallery": "every gallery entry at its CPU size (the other sizes, "
    "repro_NAME_SIZE: curvbench --help experiment)"
  }
  for path in sorted(folder.glob("*.py")):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Call) and getattr(node.func, "id", "") == (
        "Entry"
      ):
        kw = {k.arg: k.value for k in node.keywords}
        if isinstance(kw.get("name"), ast.Constant):
          title = kw.get("title")
          out[f"repro_{kw['name'].value}"] = (
            ast.literal_eval(title) if title is not None else ""
          )
  return out


def options() -> dict[str, dict[str, str]]:
  """`{group: {option: one line}}`, read off the sources and presets."""
  from curvbench.conf_dir import CONF_DIR as conf  # noqa: PLC0415

  out = {}
  for group, (package, presets) in GROUPS.items():
    found = {}
    if package is not None:
      found.update(_components(_package_dir(package)))
    if presets is not None:
      found.update(
        {k: v for k, v in _presets(conf / presets).items() if k not in found}
      )
    if group == "experiment":
      found.update(_gallery())
    out[group] = dict(sorted(found.items()))
  return out


def usage() -> str:
  """The top-level help: how to run, then every group's options."""
  lines = [USAGE, "groups (GROUP=OPTION; defaults in conf/config.yaml):"]
  columns = shutil.get_terminal_size((100, 24)).columns
  for group, opts in options().items():
    width = max(map(len, opts))
    lines.append(f"\n{group}:")
    for name, text in opts.items():
      line = f"  {name:<{width}}  {text}".rstrip()
      lines.append(
        line if len(line) <= columns else line[: columns - 3].rstrip() + "..."
      )
  lines.append(
    "\nComponents from plugins (plugins=[...]) are not listed "
    "here; `curvbench --help GROUP plugins=[...]` lists them."
  )
  return "\n".join(lines)


def _default(field):
  if field.default is not dataclasses.MISSING:
    return field.default
  if field.default_factory is not dataclasses.MISSING:
    return field.default_factory()
  return "(required)"


def _settings(cls, prefix: str = "") -> list[str]:
  """A line per setting of `cls` (nested ones under their dotted key):
  key, default, what it accepts, its doc."""
  lines = []
  for field in dataclasses.fields(cls):
    nested = cls.nested().get(field.name)
    if nested is not None:
      lines += _settings(nested, f"{prefix}{field.name}.")
      continue
    check = field.metadata.get("check")
    if check is None:
      continue
    lines.append(
      f"    {prefix}{field.name} = {_default(field)!r}  "
      f"[{check.describe()}]\n        {field.metadata['doc']}"
    )
  return lines


def group_help(group: str, overrides=()) -> str:
  """Every option of `group` with each of its settings (plugins named in
  `overrides` loaded first)."""
  from curvbench import config, plugins  # noqa: PLC0415 - imports JAX

  plugins.load(config.plugins_of(overrides))
  names = config.options(group)
  if not names:
    raise SystemExit(
      f"curvbench: no config group {group!r}; the groups: {', '.join(GROUPS)}."
    )
  registries = [r for r in config.REGISTRIES if r.group == group]
  lines = [
    f"{group}: choose with {group}=OPTION; set with "
    f"{group.split('/')[0]}.KEY=VALUE"
  ]
  for name in names:
    registered = [r.get(name) for r in registries if name in r.names()]
    if registered:
      cls = registered[0]
      lines.append(f"\n{name}: {_first_line(cls.__doc__)}")
      lines += _settings(cls)
    else:
      lines.append(
        f"\n{name}: a preset, conf/{group}/{name}.yaml (or "
        "built in); `curvbench --cfg job "
        f"{'+' if group == 'experiment' else ''}{group}={name}` "
        "prints what it sets"
      )
  return "\n".join(lines)


def main(argv: list[str] | None = None):
  """`curvbench`: help from the sources, or the app."""
  argv = sys.argv[1:] if argv is None else list(argv)
  if argv and argv[0] in HELP_FLAGS:
    if len(argv) == 1:
      print(usage())
    else:
      print(group_help(argv[1], argv[2:]))
    return None
  from curvbench import app  # noqa: PLC0415 - imports JAX

  return app.cli(argv)
