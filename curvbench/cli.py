"""The `curvbench` command's entry point. `curvbench --help` is read off
the components' sources (their `name` and docstring, Python's `ast`) and
the presets' first comment lines, so it prints without importing JAX;
`curvbench --help GROUP` and everything else go to `curvbench.app`."""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import sys
from pathlib import Path

from curvbench.components import documented
from curvbench.conf_dir import CONF_DIR

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


def _package_dir(parts: tuple[str, str]) -> Path:
  """The folder of `top.sub`, found without importing `top`."""
  spec = importlib.util.find_spec(parts[0])
  if spec is None or not spec.submodule_search_locations:
    raise ModuleNotFoundError(f"curvbench needs the package {parts[0]!r}.")
  return Path(list(spec.submodule_search_locations)[0]) / parts[1]


def _name_field(node: ast.ClassDef) -> str | None:
  """The string a class body gives `name`, if any."""
  target: ast.expr
  value: ast.expr | None
  for item in node.body:
    if isinstance(item, ast.AnnAssign):
      target, value = item.target, item.value
    elif isinstance(item, ast.Assign) and len(item.targets) == 1:
      target, value = item.targets[0], item.value
    else:
      continue
    if (
      isinstance(target, ast.Name)
      and target.id == "name"
      and isinstance(value, ast.Constant)
      and isinstance(value.value, str)
    ):
      return value.value
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
  for call in ast.walk(tree):
    if not (
      isinstance(call, ast.Call)
      and isinstance(call.func, ast.Attribute)
      and call.func.attr == "register"
      and call.args
      and isinstance(call.args[0], ast.Name)
      and call.args[0].id in classes
    ):
      continue
    cls = classes[call.args[0].id]
    values = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
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
  """`repro_NAME` of each gallery entry (its CPU size) and its title, and
  the experiments of every entry at one size."""
  folder = _package_dir(("curvbench", "gallery"))
  out = {
    "gallery": "every gallery entry at its CPU size (the other sizes, "
    "repro_NAME_SIZE: curvbench --help experiment)",
    "gallery_accelerator": "every gallery entry at its accelerator size, "
    "together within one 10-minute window on one GPU",
  }
  for path in sorted(folder.glob("*.py")):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Call) and getattr(node.func, "id", "") == (
        "Entry"
      ):
        kw = {k.arg: k.value for k in node.keywords}
        name = kw.get("name")
        if isinstance(name, ast.Constant):
          title = kw.get("title")
          out[f"repro_{name.value!s}"] = (
            ast.literal_eval(title) if title is not None else ""
          )
  return out


def options() -> dict[str, dict[str, str]]:
  """`{group: {option: one line}}`, read off the sources and presets."""
  out = {}
  for group, (package, presets) in GROUPS.items():
    found = {}
    if package is not None:
      found.update(_components(_package_dir(package)))
    if presets is not None:
      found.update(
        {
          k: v
          for k, v in _presets(CONF_DIR / presets).items()
          if k not in found
        }
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


def _settings(cls) -> list[str]:
  """Two lines per setting of `cls`: key, default and what it accepts;
  its doc."""
  return [
    f"    {d.key} = {d.default!r}  [{d.accepts}]\n        {d.doc}"
    for d in documented(cls)
  ]


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


def _print(text: str) -> None:
  """Prints help; a reader who stops reading (`| head`) is not an error."""
  try:
    print(text, flush=True)
  except BrokenPipeError:
    # Python would report the pipe again when it flushes stdout at exit.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def main(argv: list[str] | None = None):
  """`curvbench`: help from the sources, or the app."""
  argv = sys.argv[1:] if argv is None else list(argv)
  if argv and argv[0] in HELP_FLAGS:
    _print(usage() if len(argv) == 1 else group_help(argv[1], argv[2:]))
    return None
  from curvbench import app  # noqa: PLC0415 - imports JAX

  return app.cli(argv)
