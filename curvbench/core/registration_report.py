"""The report's "Registration" section: which block each layer gets under
every approximation, read from the runs' `registration.json`.

Layers are listed in the order the model computes them (the graph
matcher's `layer` numbers), each named as the model's code names it (its
module path, e.g. `layers.1.norm`, and its parameters), with what kind of
layer the graph matcher took it for. A layer that every approximation
compared gives the same block class, under the same estimation mode, has
the same matrix in each: its per-layer scores are identical by
construction, and the section and the per-layer quality table say so
(`same_blocks`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from curvbench.core.sections import Section, Table
from estimators.tags import LayerTag


def _tag_words(tag: str) -> str:
  """What a layer tag stands for, in words (`LayerTag.description`); a
  tag no layer kind was made for is named as is."""
  try:
    return LayerTag.of_variant(tag.removesuffix("_tag")).description
  except ValueError:
    return tag


# The row of an approximation that is one block over the whole network
# (exact, matrix-free), listed after the layers.
WHOLE = "(the whole network)"
AFTER_ALL = 2**31


def _kind(tag: str, source: str) -> str:
  """The kind of layer a parameter was registered as: the tag's in words,
  'normalization' where the pattern found a normalization's affine end,
  and for a generic tag why the parameter got one."""
  kind = _tag_words(tag)
  if source.startswith("normalization"):
    return "normalization (scale and shift)"
  if source == "manual":
    return f"{kind} (registered by hand)"
  if tag == "generic_tag":
    return f"generic: {source}"
  return kind


def _read(root: Path, run_dir: str) -> dict | None:
  try:
    return json.loads((root / run_dir / "registration.json").read_text())
  except (OSError, ValueError):
    return None


def layers(report) -> pd.DataFrame:
  """One row per problem, approximation (`label`) and layer block of the
  finished runs that built per-layer blocks: `layer` (the number of its
  first layer, in forward order), `module`, `parameters` (names and
  shapes), `kind`, `block_class`, `dim`, `mode` and `measure`.
  An approximation that is one block over the whole network has one row,
  `module` WHOLE; registrations from before blocks carried `module` and
  `layer` give no rows."""
  rows = []
  for run in report.done.itertuples():
    found = _read(report.root, run.run_dir)
    if not found or not found.get("blocks"):
      continue
    params = pd.DataFrame(found.get("parameters", []))
    for block in found["blocks"]:
      if block.get("dim") is None:  # one block for the whole network
        block = dict(block, module=WHOLE, layer=AFTER_ALL)
      if "module" not in block or "layer" not in block:
        continue  # records from before blocks named their modules
      mine = (
        params[params.module.eq(block["module"])]
        if "module" in params
        else params.iloc[:0]
      )
      rows.append(
        dict(
          problem=run.problem,
          measure=run.measure,
          label=run.label,
          mode=getattr(run, "mode", None),
          layer=block["layer"],
          module=block["module"],
          parameters=", ".join(
            f"{r.name} {tuple(r.shape)}" for r in mine.itertuples()
          ),
          kind="; ".join(
            dict.fromkeys(_kind(r.tag, r.source) for r in mine.itertuples())
          ),
          block_class=block["block_class"],
          dim=block["dim"],
        )
      )
  columns = [
    "problem",
    "measure",
    "label",
    "mode",
    "layer",
    "module",
    "parameters",
    "kind",
    "block_class",
    "dim",
  ]
  return pd.DataFrame(rows, columns=columns).drop_duplicates(
    ["problem", "measure", "label", "module"]
  )


def _alike(group: pd.DataFrame, labels: int) -> str | None:
  """The block class a layer gets under all `labels` approximations of
  `group` (its rows, one per approximation), where it is one class under
  one estimation mode; else None."""
  if labels < 2 or group.label.nunique() < labels:
    return None
  if group.block_class.nunique() != 1 or group["mode"].nunique() > 1:
    return None
  return str(group.block_class.iloc[0])


def same_blocks(report, measure: str | None = None) -> dict[tuple, str]:
  """`{(problem, module): block class}` for the layers that every approximation
  compared (of `measure`'s runs, where given) gives the same block class
  under the same estimation mode: the same matrix, so scores that are
  identical by construction."""
  found = report.once("registration_layers", layers)
  if found.empty:
    return {}
  if measure is not None:
    found = found[found.measure == measure]
  out = {}
  for problem, runs in found.groupby("problem"):
    labels = runs.label.nunique()
    for module, group in runs.groupby("module"):
      if module == WHOLE:
        continue
      cls = _alike(group.drop_duplicates("label"), labels)
      if cls is not None:
        out[(problem, module)] = cls
  return out


def reason(block_class: str) -> str:
  """Why a layer's scores are alike in every approximation."""
  return (
    f"same block ({block_class}) under every approximation: scores "
    "identical by construction"
  )


def section(report) -> Section | None:
  """The Registration section: per problem, a table of its layers in
  forward order, a column per approximation naming the block it gets, and
  a note on each layer that gets the same block under all of them."""
  found = report.once("registration_layers", layers)
  if found.empty:
    return None
  out = Section(
    "Registration",
    "Which block does each layer get under each approximation, and where "
    "must the methods score alike?",
  )
  alike = same_blocks(report)
  for problem, runs in found.groupby("problem"):
    runs = runs.drop_duplicates(["label", "module"])
    columns = list(dict.fromkeys(runs.sort_values("label").label))
    table = (
      runs.pivot_table(
        index=["layer", "module", "parameters", "kind"],
        columns="label",
        values="block_class",
        aggfunc="first",
      )
      .reindex(columns=columns)
      .fillna("")
      .reset_index()
      .sort_values("layer", kind="stable")
    )
    table.columns.name = None
    table["layer"] = [("" if n == AFTER_ALL else n) for n in table.layer]
    table["note"] = [
      reason(alike[problem, m]) if (problem, m) in alike else ""
      for m in table.module
    ]
    out.tables.append(
      Table(
        f"registration_{problem}",
        f"{problem}: each layer's block under each approximation, layers "
        "in the order the model computes them, named as its code names "
        "them",
        table,
      )
    )
    same = [m for m in table.module if (problem, m) in alike]
    if same:
      out.findings.append(
        f"{problem}: {', '.join(same)} get the same block under every "
        f"approximation compared ({', '.join(columns)}), so their "
        "per-layer scores are identical by construction (see "
        "Registration)."
      )
  out.notes.append(
    "Layers are numbered in the order the model computes them; a layer "
    "is named by its module's path in the model's parameters and its "
    "parameters' names. A layer's kind is the graph matcher's reading of "
    "its computation (registration.json's `source` names the pattern)."
  )
  return out
