"""The settings reference, generated from the components' declarations:
each config group's options with every setting's key, default, accepted
values and meaning, as MyST Markdown (the documentation site's
`reference/settings` page, built by `docs/_ext/settings_reference.py`)."""

from __future__ import annotations

import inspect

from curvbench import cli, config, measurements
from curvbench.components import SettingDoc, documented
from curvbench.conf_dir import CONF_DIR

# The run's fields that choose a config group's option: documented there.
_GROUP_FIELDS = {group.split("/")[0] for group in cli.GROUPS}


def _text(text: str) -> str:
  """`text` on one line, safe in Markdown (no tags or stray emphasis)."""
  return (
    " ".join(str(text).split())
    .replace("\\", "\\\\")
    .replace("<", "\\<")
    .replace("*", "\\*")
  )


def _cell(text: str) -> str:
  """`text` safe inside a Markdown table cell."""
  return _text(text).replace("|", "\\|")


def _table(rows: list[SettingDoc]) -> list[str]:
  if not rows:
    return ["No settings of its own.", ""]
  lines = ["| setting | default | accepts | meaning |", "|---|---|---|---|"]
  for row in rows:
    default = repr(row.default).replace("`", "'")
    lines.append(
      f"| `{row.key}` | `{_cell(default)}` | {_cell(row.accepts)} | "
      f"{_cell(row.doc)} |"
    )
  return lines + [""]


def _doc(cls) -> str:
  """A class's docstring as a paragraph."""
  return _text(inspect.getdoc(cls) or "")


def _registered(group: str, name: str):
  """The settings class of option `name` of `group`, and its rows under
  the keys a command line gives them; None for a preset."""
  prefix = "problem.data." if group == "problem/data" else f"{group}."
  for registry in config.REGISTRIES:
    if registry.group == group and name in registry.names():
      cls = registry.get(name)
      rows = [
        SettingDoc(f"{prefix}{d.key}", d.default, d.accepts, d.doc)
        for d in documented(cls)
        if d.key != "name"
      ]
      return cls, rows
  return None


def _option(group: str, name: str, presets: dict[str, str]) -> list[str]:
  """The section of one option of `group`."""
  lines = [f"### {group}={name}", ""]
  if found := _registered(group, name):
    cls, rows = found
    return lines + [_doc(cls), ""] + _table(rows)
  path = CONF_DIR / group / f"{name}.yaml"
  return lines + [
    f"A preset (`conf/{group}/{name}.yaml`): {presets.get(name, '')}",
    "",
    "```yaml",
    path.read_text().strip(),
    "```",
    "",
  ]


def markdown() -> str:
  """The whole settings reference page.

  Raises:
    SettingsError: naming any setting declared without a doc.
  """
  described = cli.options()  # one line per option, as `--help` prints
  lines = [
    "# Settings",
    "",
    "Every setting of every component, generated from the code that "
    "declares it (the same text `curvbench --help GROUP` prints). Choose an "
    "option with `GROUP=OPTION`, set a setting with `KEY=VALUE`, e.g. "
    "`curvbench problem=convnet curvature=diagonal curvature.mode=fisher_exact`; "
    "`curvbench --cfg job OVERRIDES` prints the settings a run would use.",
    "",
    "## The run",
    "",
    _doc(config.RunSettings),
    "",
  ]
  lines += _table(
    [
      d
      for d in documented(config.RunSettings)
      if d.key.split(".")[0] not in _GROUP_FIELDS
    ]
  )
  lines += [
    "## measure",
    "",
    "The `measure` section holds every measurement's settings under "
    "`measure.NAME.KEY`; `measure=NAME` (or `measure.kind`) says which one "
    "runs.",
    "",
  ]
  lines += _table(
    [
      d
      for d in documented(measurements.schema())
      if "." not in d.key  # the measurements' own sections follow
    ]
  )
  for group in cli.GROUPS:
    names = config.options(group)
    if group in ("launcher", "experiment"):
      lines += [f"## {group}", "", "| option | what it is |", "|---|---|"]
      lines += [
        f"| `{n}` | {_cell(described[group].get(n, ''))} |" for n in names
      ]
      lines.append("")
      continue
    if group != "measure":
      lines += [f"## {group}", ""]
    for name in names:
      lines += _option(
        "measure" if group == "measure" else group, name, described[group]
      )
  return "\n".join(lines).rstrip() + "\n"


def keys() -> set[str]:
  """Every dotted key a command line may set (`problem.width`,
  `measure.spectra.references`, `seed`, ...)."""
  found = {d.key for d in documented(config.RunSettings)}
  found |= {f"measure.{d.key}" for d in documented(measurements.schema())}
  for registry in config.REGISTRIES:
    for name in registry.names():
      _, rows = _registered(registry.group, name)
      found |= {row.key for row in rows}
  return found
