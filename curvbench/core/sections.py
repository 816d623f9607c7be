"""What a measurement gives the report: a `Section` with the question it
answers, its findings (the headline answers, each with the interval it
rests on), its tables and figures and its notes. The report opens with
every section's question and findings, then shows the sections in turn.

A `Table` is written whole as CSV (`data`, long and tidy: one row per
quantity with its spread and count); the pages show `view` instead where
one is given (`wide`: a row per method, a column per metric, each cell the
median with its quartiles). A `detail` table is collapsed in the HTML page
and only linked from `report.md`, so the markdown stays short.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pandas as pd


@dataclasses.dataclass
class Table:
  """A summary table: `name` (its CSV's stem), `title` (what it shows and
  over which samples), `data` (written as CSV), `view` (what the pages
  show; default `data`) and whether it is a `detail`."""

  name: str
  title: str
  data: pd.DataFrame
  view: pd.DataFrame | None = None
  detail: bool = False

  @property
  def shown(self) -> pd.DataFrame:
    """What the pages show: `view`, or `data` where there is no view."""
    return self.data if self.view is None else self.view


@dataclasses.dataclass
class Section:
  """One measurement's part of the report."""

  title: str
  question: str
  findings: list[str] = dataclasses.field(default_factory=list)
  tables: list[Table] = dataclasses.field(default_factory=list)
  figures: list[Path] = dataclasses.field(default_factory=list)
  notes: list[str] = dataclasses.field(default_factory=list)


def number(value, digits: int = 3) -> str:
  """A number as a short text ('' for NaN)."""
  if value is None or (isinstance(value, float) and math.isnan(value)):
    return ""
  if isinstance(value, float):
    if 10**digits <= abs(value) < 1e6:  # a count of steps, say: whole
      return f"{value:.0f}"
    return f"{value:.{digits}g}"
  return str(value)


def spread(centre, low, high, digits: int = 3) -> str:
  """`'centre [low, high]'`, or the centre alone where the ends are
  missing or equal to it."""
  text = number(centre, digits)
  if not text:
    return ""
  ends = [number(v, digits) for v in (low, high)]
  if not all(ends) or ends[0] == ends[1] == text:
    return text
  return f"{text} [{ends[0]}, {ends[1]}]"


def wide(
  data: pd.DataFrame,
  index: list[str],
  column: str,
  centre: str = "median",
  low: str = "q25",
  high: str = "q75",
  count: str | None = "n",
  digits: int = 3,
) -> pd.DataFrame:
  """`data` pivoted: a row per `index`, a column per value of `column`,
  each cell `centre [low, high]`; with `count`, a last column `n` (the
  range of counts where they differ between cells)."""
  if data.empty:
    return data
  cells = data.assign(
    _cell=[
      spread(c, lo, hi, digits)
      for c, lo, hi in zip(data[centre], data[low], data[high])
    ]
  )
  grouped = cells.groupby([*index, column], dropna=False, sort=False)
  view = grouped["_cell"].first().unstack(column).fillna("")
  view = view[[c for c in dict.fromkeys(data[column]) if c in view]]
  view.columns = [str(c) for c in view.columns]
  if count is not None:
    counts = (
      data.groupby(index, dropna=False, sort=False)[count]
      .agg(["min", "max"])
      .reindex(view.index)
    )
    view["n"] = [
      str(lo) if lo == hi else f"{lo}-{hi}"
      for lo, hi in zip(counts["min"], counts["max"])
    ]
  return view.reset_index()


def to_markdown(df: pd.DataFrame, digits: int = 4) -> str:
  """A GitHub markdown table (no extra dependency)."""

  def cell(v):
    if isinstance(v, float):
      return "" if pd.isna(v) else f"{v:.{digits}g}"
    return "" if v is None else str(v).replace("|", "\\|")

  head = "| " + " | ".join(map(str, df.columns)) + " |"
  rule = "|" + "|".join("---" for _ in df.columns) + "|"
  rows = [
    "| " + " | ".join(cell(v) for v in row) + " |"
    for row in df.itertuples(index=False)
  ]
  return "\n".join([head, rule, *rows])


__all__ = ["Section", "Table", "number", "spread", "to_markdown", "wide"]


def unreadable(error: Exception) -> str:
  """Why records could not be read as expected, in words: a section, claim
  or figure that cannot be computed says so, and the rest of the report
  stands."""
  if isinstance(error, KeyError):
    return f"the records lack the column or key {error}"
  return (
    "the records are not as expected (a column of another type, or "
    f"values of another kind): {type(error).__name__}: {error}"
  )
