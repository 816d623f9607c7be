"""An HTML page of headings, text, tables and figures, from the template
`templates/page.html` (jinja2, every text escaped); a `Details` block
holds others behind a line that opens it (collapsed until clicked).

The page is one file with its figures beside it: each figure is linked by
its path relative to the page (so the page stays small, and its folder can
be moved or copied whole), style and script are inline, and a
Content-Security-Policy forbids any other source (images come only from
the page's own files). Tables sort by a column when its header is clicked
(numerically where the cells are numbers; a second click reverses), and a
table of contents is built from the headings.

  html_page.write(out / "page.html", "Sweep", [
      html_page.Heading("Quality"),
      html_page.Table(df, caption="metrics per block type"),
      html_page.Figure(out / "figures/quality.png", caption="relative error")])
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import quote

import jinja2
import pandas as pd

from curvbench.core.records import atomic_write

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@dataclasses.dataclass(frozen=True)
class Heading:
  """A section heading (level 2 to 6; the page title is level 1)."""

  text: str
  level: int = 2

  def __post_init__(self):
    if not isinstance(self.level, int) or not 2 <= self.level <= 6:
      raise ValueError(
        f"Heading level must be an integer from 2 to 6 (the "
        f"page title is level 1), got {self.level!r} for "
        f"heading {self.text!r}"
      )


@dataclasses.dataclass(frozen=True)
class Paragraph:
  """A paragraph of plain text (escaped, never read as HTML)."""

  text: str


@dataclasses.dataclass(frozen=True)
class Bullets:
  """A bulleted list of plain-text items."""

  items: Sequence[str]  # kept as a tuple

  def __post_init__(self):
    if isinstance(self.items, str):
      raise ValueError(
        f"Bullets takes a list of items, got the string "
        f"{self.items!r}: wrap it in a list"
      )
    object.__setattr__(self, "items", tuple(self.items))


@dataclasses.dataclass(frozen=True, eq=False)
class Table:
  """A DataFrame shown as a sortable table; a non-default index is shown as
  leading columns."""

  df: pd.DataFrame
  caption: str = ""

  def __post_init__(self):
    if not isinstance(self.df, pd.DataFrame):
      raise ValueError(
        f"Table needs a pandas DataFrame, got {type(self.df).__name__}"
      )


@dataclasses.dataclass(frozen=True)
class Figure:
  """A PNG file, linked from the page: it must lie in the page's folder or
  below it, so that the folder travels whole."""

  png_path: str | Path
  caption: str = ""


@dataclasses.dataclass(frozen=True, eq=False)
class Details:
  """Blocks collapsed behind `summary`, shown when it is clicked."""

  summary: str
  blocks: Sequence[Paragraph | Bullets | Table | Figure]  # kept as a tuple

  def __post_init__(self):
    inner = tuple(self.blocks)
    bad = [
      b
      for b in inner
      if isinstance(b, (Heading, Details))
      or not isinstance(b, (Paragraph, Bullets, Table, Figure))
    ]
    if bad:
      raise ValueError(
        f"Details holds paragraphs, bullets, tables and "
        f"figures, got a {type(bad[0]).__name__}"
      )
    object.__setattr__(self, "blocks", inner)


Block = Heading | Paragraph | Bullets | Table | Figure | Details


def write(path: str | Path, title: str, blocks: Sequence[Block]) -> Path:
  """Writes the page atomically to `path` and returns `path`."""
  path = Path(path)
  text = render(title, blocks, folder=path.parent)
  return atomic_write(
    path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8")
  )


def render(
  title: str, blocks: Sequence[Block], folder: str | Path | None = None
) -> str:
  """The page as one HTML string, its figures linked relative to `folder`
  (where the page will lie; needed where there are figures)."""
  anchors = _anchors(blocks)
  shown = [
    _block(block, anchors.get(i), folder) for i, block in enumerate(blocks)
  ]
  toc = [b for b in shown if b["kind"] == "heading"]
  return _TEMPLATE.render(title=title, toc=toc, blocks=shown)


def _anchors(blocks) -> dict[int, str]:
  """Unique ids for the headings, keyed by block position."""
  anchors, used = {}, set()
  for i, block in enumerate(blocks):
    if isinstance(block, Heading):
      base = re.sub(r"[^a-z0-9]+", "-", str(block.text).lower()).strip("-")
      base = base or "section"
      anchor, n = base, 1
      while anchor in used:
        n += 1
        anchor = f"{base}-{n}"
      used.add(anchor)
      anchors[i] = anchor
  return anchors


def _block(block, anchor, folder) -> dict:
  """What the template draws of a block (its text escaped there)."""
  if isinstance(block, Heading):
    return dict(
      kind="heading", text=block.text, level=block.level, anchor=anchor
    )
  if isinstance(block, Paragraph):
    return dict(kind="paragraph", text=block.text)
  if isinstance(block, Bullets):
    return dict(kind="bullets", entries=block.items)
  if isinstance(block, Table):
    return _table(block)
  if isinstance(block, Figure):
    return _figure(block, folder)
  if isinstance(block, Details):
    return dict(
      kind="details",
      summary=block.summary,
      blocks=[_block(inner, None, folder) for inner in block.blocks],
    )
  raise ValueError(
    f"cannot put a {type(block).__name__} on the page: blocks "
    f"must be Heading, Paragraph, Bullets, Table, Figure or "
    f"Details"
  )


def _figure(figure: Figure, folder) -> dict:
  path = Path(figure.png_path)
  if not path.is_file():
    raise ValueError(f"figure file {str(path)!r} does not exist")
  with path.open("rb") as f:
    if f.read(len(PNG_SIGNATURE)) != PNG_SIGNATURE:
      raise ValueError(
        f"figure file {str(path)!r} is not a PNG (its first "
        f"bytes are not the PNG signature); save it as PNG"
      )
  if folder is None:
    raise ValueError(
      f"cannot link figure {str(path)!r} without the page's folder: "
      "give render(..., folder=) the folder the page will be written to"
    )
  try:
    relative = path.resolve().relative_to(Path(folder).resolve())
  except ValueError:
    raise ValueError(
      f"figure file {str(path)!r} lies outside the page's folder "
      f"{str(folder)!r}: save it there (or below it), so that the page "
      "and its figures can be moved together"
    ) from None
  return dict(
    kind="figure",
    uri=quote(relative.as_posix()),
    alt=figure.caption or path.stem,
    caption=figure.caption,
  )


def _table(table: Table) -> dict:
  df = table.df
  if not isinstance(df.index, pd.RangeIndex) or any(df.index.names):
    df = df.reset_index()
  names = [
    " / ".join(map(str, c)) if isinstance(c, tuple) else str(c)
    for c in df.columns
  ]
  rows = [
    [_cell(v) for v in row] for row in df.itertuples(index=False, name=None)
  ]
  numeric = [
    all(c is None or c["value"] is not None for c in [r[j] for r in rows])
    for j in range(len(names))
  ]
  return dict(
    kind="table",
    caption=table.caption,
    header=list(zip(names, numeric)),
    rows=rows,
  )


def _cell(value) -> dict | None:
  """A cell's text and, for a number, its exact value (`data-value`, what
  the page sorts by); None for an empty cell."""
  if value is None or value is pd.NA or value is pd.NaT:
    return None
  if isinstance(value, numbers.Real) and not isinstance(
    value, numbers.Integral
  ):
    x = float(value)
    if math.isnan(x):
      return None
    if math.isinf(x):
      sign = "-" if x < 0 else ""
      return dict(text=f"{sign}inf", value=f"{sign}Infinity")
    return dict(text=f"{x:.4g}", value=repr(x))
  if isinstance(value, numbers.Integral) and not isinstance(value, bool):
    return dict(text=str(int(value)), value=str(int(value)))
  return dict(text=str(value), value=None)


# Autoescaped: every text the page shows is escaped, never read as HTML.
_TEMPLATE = jinja2.Environment(
  loader=jinja2.PackageLoader("curvbench", "templates"),
  autoescape=True,
  trim_blocks=True,
  lstrip_blocks=True,
  undefined=jinja2.StrictUndefined,
).get_template("page.html")
