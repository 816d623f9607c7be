"""A self-contained HTML page of headings, text, tables and figures.

The page is one file with nothing outside it: figures are inlined as base64
PNG data URIs, style and script are inline, and a Content-Security-Policy
forbids any other source. Tables sort by a column when its header is clicked
(numerically where the cells are numbers; a second click reverses), and a
table of contents is built from the headings.

  html_page.write(path, "Sweep", [
      html_page.Heading("Quality"),
      html_page.Table(df, caption="metrics per block type"),
      html_page.Figure("quality.png", caption="relative error")])
"""

from __future__ import annotations

import base64
import dataclasses
import html
import math
import numbers
import re
from pathlib import Path
from typing import Any

import pandas as pd

from curvbench.records import atomic_write

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_NUM = ' class="num"'


@dataclasses.dataclass(frozen=True)
class Heading:
  """A section heading (level 2 to 6; the page title is level 1)."""
  text: str
  level: int = 2

  def __post_init__(self):
    if not isinstance(self.level, int) or not 2 <= self.level <= 6:
      raise ValueError(f"Heading level must be an integer from 2 to 6 (the "
                       f"page title is level 1), got {self.level!r} for "
                       f"heading {self.text!r}")


@dataclasses.dataclass(frozen=True)
class Paragraph:
  """A paragraph of plain text (escaped, never read as HTML)."""
  text: str


@dataclasses.dataclass(frozen=True)
class Bullets:
  """A bulleted list of plain-text items."""
  items: tuple[str, ...]

  def __post_init__(self):
    if isinstance(self.items, str):
      raise ValueError(f"Bullets takes a list of items, got the string "
                       f"{self.items!r}: wrap it in a list")
    object.__setattr__(self, "items", tuple(self.items))


@dataclasses.dataclass(frozen=True, eq=False)
class Table:
  """A DataFrame shown as a sortable table; a non-default index is shown as
  leading columns."""
  df: pd.DataFrame
  caption: str = ""

  def __post_init__(self):
    if not isinstance(self.df, pd.DataFrame):
      raise ValueError(f"Table needs a pandas DataFrame, got "
                       f"{type(self.df).__name__}")


@dataclasses.dataclass(frozen=True)
class Figure:
  """A PNG file, embedded into the page."""
  png_path: str | Path
  caption: str = ""


Block = Heading | Paragraph | Bullets | Table | Figure


def write(path: str | Path, title: str, blocks: list[Block]) -> Path:
  """Writes the page atomically to `path` and returns `path`."""
  path = Path(path)
  text = render(title, blocks)
  return atomic_write(path, lambda tmp: Path(tmp).write_text(
      text, encoding="utf-8"))


def render(title: str, blocks: list[Block]) -> str:
  """The page as one HTML string."""
  anchors = _anchors(blocks)
  body = [f"<h1>{_esc(title)}</h1>"]
  headings = [(b, anchors[i]) for i, b in enumerate(blocks)
              if isinstance(b, Heading)]
  if headings:
    body.append(_toc(headings))
  for i, block in enumerate(blocks):
    body.append(_block(block, anchors.get(i)))
  return _PAGE.format(title=_esc(title), style=_STYLE, script=_SCRIPT,
                      body="\n".join(body))


def _esc(text: Any) -> str:
  return html.escape(str(text), quote=True)


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


def _toc(headings) -> str:
  items = "\n".join(
      f'<li class="toc-{h.level}"><a href="#{a}">{_esc(h.text)}</a></li>'
      for h, a in headings)
  return (f'<nav class="toc" aria-label="Contents"><strong>Contents</strong>'
          f"<ul>\n{items}\n</ul></nav>")


def _block(block, anchor) -> str:
  if isinstance(block, Heading):
    n = block.level
    return f'<h{n} id="{anchor}">{_esc(block.text)}</h{n}>'
  if isinstance(block, Paragraph):
    return f"<p>{_esc(block.text)}</p>"
  if isinstance(block, Bullets):
    items = "".join(f"<li>{_esc(item)}</li>" for item in block.items)
    return f"<ul>{items}</ul>"
  if isinstance(block, Table):
    return _table(block)
  if isinstance(block, Figure):
    return _figure(block)
  raise ValueError(f"cannot put a {type(block).__name__} on the page: blocks "
                   f"must be Heading, Paragraph, Bullets, Table or Figure")


def _figure(figure: Figure) -> str:
  path = Path(figure.png_path)
  if not path.is_file():
    raise ValueError(f"figure file {str(path)!r} does not exist")
  data = path.read_bytes()
  if not data.startswith(PNG_SIGNATURE):
    raise ValueError(f"figure file {str(path)!r} is not a PNG (its first "
                     f"bytes are not the PNG signature); save it as PNG")
  uri = "data:image/png;base64," + base64.b64encode(data).decode("ascii")
  alt = figure.caption or path.stem
  caption = (f"<figcaption>{_esc(figure.caption)}</figcaption>"
             if figure.caption else "")
  return (f'<figure><img src="{uri}" alt="{_esc(alt)}">{caption}'
          f"</figure>")


def _table(table: Table) -> str:
  df = table.df
  if not isinstance(df.index, pd.RangeIndex) or any(df.index.names):
    df = df.reset_index()
  names = [" / ".join(map(str, c)) if isinstance(c, tuple) else str(c)
           for c in df.columns]
  cells = [[_cell(v) for v in row]
           for row in df.itertuples(index=False, name=None)]
  numeric = [all(r[j] == "<td></td>" or r[j].startswith('<td class="num"')
                 for r in cells) for j in range(len(names))]
  head = "".join(
      f'<th scope="col"{_NUM if num else ""}><button type="button">'
      f"{_esc(n)}</button></th>" for n, num in zip(names, numeric))
  rows = "\n".join("<tr>" + "".join(r) + "</tr>" for r in cells)
  caption = (f"<caption>{_esc(table.caption)}</caption>"
             if table.caption else "")
  return (f'<div class="table-wrap"><table class="sortable">{caption}'
          f"<thead><tr>{head}</tr></thead>\n<tbody>\n{rows}\n</tbody>"
          f"</table></div>")


def _cell(value) -> str:
  """A <td>; numbers keep their exact value in data-value for sorting."""
  if value is None or value is pd.NA or value is pd.NaT:
    return "<td></td>"
  if isinstance(value, numbers.Real) and not isinstance(
      value, numbers.Integral):
    x = float(value)
    if math.isnan(x):
      return "<td></td>"
    if math.isinf(x):
      return (f'<td class="num" data-value="{"-" if x < 0 else ""}Infinity">'
              f'{"-" if x < 0 else ""}inf</td>')
    return f'<td class="num" data-value="{x!r}">{x:.4g}</td>'
  if isinstance(value, numbers.Integral) and not isinstance(value, bool):
    return f'<td class="num" data-value="{int(value)}">{int(value)}</td>'
  return f"<td>{_esc(value)}</td>"


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; \
img-src data:; style-src 'unsafe-inline'; script-src 'unsafe-inline'">
<title>{title}</title>
<style>{style}</style>
</head>
<body>
<main>
{body}
</main>
<script>{script}</script>
</body>
</html>
"""

_STYLE = """
body { margin: 0; color: #1f2328; background: #fff; line-height: 1.5;
  font-family: system-ui, -apple-system, "Segoe UI", Roboto,
    "Helvetica Neue", Arial, "Noto Sans", "DejaVu Sans", sans-serif; }
main { max-width: 72rem; margin: 0 auto; padding: 1.5rem; }
h1, h2, h3, h4, h5, h6 { line-height: 1.25; margin: 1.6em 0 0.5em; }
h1 { margin-top: 0.5em; }
nav.toc { background: #f6f8fa; border: 1px solid #d0d7de;
  border-radius: 6px; padding: 0.75rem 1rem; margin-bottom: 1.5rem; }
nav.toc ul { list-style: none; margin: 0.3rem 0 0; padding: 0; }
nav.toc li.toc-3 { padding-left: 1.2em; }
nav.toc li.toc-4 { padding-left: 2.4em; }
nav.toc li.toc-5, nav.toc li.toc-6 { padding-left: 3.6em; }
a { color: #0969da; }
.table-wrap { overflow: auto; max-height: 80vh; margin: 1rem 0;
  width: fit-content; max-width: 100%;
  border: 1px solid #d0d7de; border-radius: 6px; }
table { border-collapse: collapse; font-size: 0.9rem; }
caption { caption-side: top; text-align: left; padding: 0.4rem 0.6rem;
  color: #57606a; }
th, td { padding: 0.3rem 0.6rem; border-bottom: 1px solid #eaeef2;
  text-align: left; white-space: nowrap; }
td.num, thead th.num button { text-align: right;
  font-variant-numeric: tabular-nums; }
thead th { position: sticky; top: 0; background: #f6f8fa; z-index: 1;
  border-bottom: 1px solid #d0d7de; padding: 0; }
thead th { cursor: pointer; }
thead th button { all: unset; display: block; width: 100%;
  box-sizing: border-box; padding: 0.3rem 1.4rem 0.3rem 0.6rem;
  font-weight: 600; }
thead th button:focus-visible { outline: 2px solid #0969da; }
thead th[aria-sort] { background: #ddf4ff; }
thead th[aria-sort="ascending"] button::after { content: " \\25B2"; }
thead th[aria-sort="descending"] button::after { content: " \\25BC"; }
tbody tr:nth-child(even) { background: #fafbfc; }
tbody tr:hover { background: #fff8c5; }
figure { margin: 1.5rem 0; }
figure img { max-width: 100%; height: auto; display: block; }
figcaption { color: #57606a; font-size: 0.9rem; margin-top: 0.3rem; }
"""

# Sorting: numeric when every non-empty cell of the column has a data-value,
# text otherwise; empty cells stay last in either direction.
_SCRIPT = """
(function () {
  function key(cell, numeric) {
    if (!cell || cell.textContent === "") return null;
    return numeric ? Number(cell.dataset.value) : cell.textContent;
  }
  function sortBy(table, th) {
    var headers = Array.from(th.parentNode.children);
    var col = headers.indexOf(th);
    var body = table.tBodies[0];
    var rows = Array.from(body.rows);
    var numeric = rows.every(function (r) {
      var c = r.cells[col];
      return !c || c.textContent === "" || c.dataset.value !== undefined;
    });
    var dir = th.getAttribute("aria-sort") === "ascending" ? -1 : 1;
    headers.forEach(function (h) { h.removeAttribute("aria-sort"); });
    th.setAttribute("aria-sort", dir === 1 ? "ascending" : "descending");
    rows.sort(function (a, b) {
      var x = key(a.cells[col], numeric), y = key(b.cells[col], numeric);
      if (x === null || y === null) return (x === null) - (y === null);
      if (numeric) return dir * (x < y ? -1 : x > y ? 1 : 0);
      return dir * x.localeCompare(y, undefined, {numeric: true});
    });
    rows.forEach(function (r) { body.appendChild(r); });
  }
  document.querySelectorAll("table.sortable").forEach(function (table) {
    table.querySelectorAll("thead th").forEach(function (th) {
      th.addEventListener("click", function () { sortBy(table, th); });
    });
  });
})();
"""
