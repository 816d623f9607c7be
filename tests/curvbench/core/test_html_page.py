"""The HTML page: escaping, linked figures, and a real browser."""

import math
import re
import shutil
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest

from curvbench.core import html_page

SCRIPT = "<script>alert(1)</script>"


def _png(path, kind):
  fig, ax = plt.subplots(figsize=(3, 2), dpi=50)
  x = np.linspace(0, 1, 20)
  ax.plot(x, x**2) if kind == "line" else ax.bar(["a", "b"], [1, 2])
  fig.savefig(path, format="png")
  plt.close(fig)
  return path


def _numbers():
  return pd.DataFrame(
    {
      "block": ["kfac", "diagonal", "full", "identity", "kfac-2"],
      "error": [0.5, 12.0, 3.25, math.nan, 100.0],
      "steps": [10, 2, 300, 40, 5],
    }
  )


def _blocks(tmp_path):
  return [
    html_page.Heading("Summary"),
    html_page.Paragraph(f"Text with {SCRIPT} & friends."),
    html_page.Bullets(["one", "two <b>"]),
    html_page.Heading("Quality"),
    html_page.Table(_numbers(), caption="relative error"),
    html_page.Heading("Details", level=3),
    html_page.Table(pd.DataFrame({"name": [SCRIPT, "b"], "x": [1e-9, 2]})),
    html_page.Table(
      pd.DataFrame({"x": [1.0, 2.0]}, index=pd.Index(["p", "q"], name="k"))
    ),
    html_page.Table(pd.DataFrame(np.arange(80.0).reshape(2, 40)) * 1e6),
    html_page.Heading("Figures"),
    html_page.Figure(_png(tmp_path / "line.png", "line"), caption="line"),
    html_page.Figure(_png(_folder(tmp_path) / "bars #1.png", "bars")),
  ]


def _folder(tmp_path):
  (tmp_path / "figures").mkdir(exist_ok=True)
  return tmp_path / "figures"


def test_text_and_cells_are_escaped(tmp_path):
  text = html_page.render(f"Title {SCRIPT}", _blocks(tmp_path), tmp_path)
  assert SCRIPT not in text
  assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
  assert "<td>&lt;script&gt;alert(1)&lt;/script&gt;</td>" in text
  assert "two &lt;b&gt;" in text and "&amp; friends" in text


def test_figures_are_linked_beside_the_page_and_nothing_else(tmp_path):
  """Figures are linked by their paths relative to the page (quoted), not
  inlined, so the page stays small; nothing else is referenced."""
  text = html_page.render("t", _blocks(tmp_path), tmp_path)
  sources = re.findall(r'src="([^"]*)"', text)
  assert sources == ["line.png", "figures/bars%20%231.png"]
  assert "data:" not in text and "base64" not in text
  assert "http://" not in text and "https://" not in text
  assert not re.search(r"<link|\.css|\.js\b|href=\"(?!#)", text)
  assert len(text) < 20_000


def test_numbers_are_formatted_and_nan_is_empty(tmp_path):
  df = pd.DataFrame(
    {
      "v": [1 / 3, math.nan, None, 12345678.0, 7],
      "s": ["a", None, "c", "d", "e"],
    },
    dtype=object,
  )
  text = html_page.render("t", [html_page.Table(df)])
  assert '<td class="num" data-value="0.3333333333333333">0.3333</td>' in text
  assert '<td class="num" data-value="12345678.0">1.235e+07</td>' in text
  assert '<td class="num" data-value="7">7</td>' in text
  assert text.count("<td></td>") == 3
  assert ">nan<" not in text and ">None<" not in text


def test_toc_links_to_unique_heading_ids(tmp_path):
  text = html_page.render(
    "t", [html_page.Heading("A b"), html_page.Heading("A b", level=3)]
  )
  assert '<a href="#a-b">' in text and '<a href="#a-b-2">' in text
  assert '<h2 id="a-b">' in text and '<h3 id="a-b-2">' in text


def test_write_is_atomic_and_returns_the_path(tmp_path):
  path = html_page.write(
    tmp_path / "out" / "page.html", "t", [html_page.Paragraph("hi")]
  )
  assert path == tmp_path / "out" / "page.html"
  assert path.read_text().startswith("<!DOCTYPE html>")
  assert [p.name for p in path.parent.iterdir()] == ["page.html"]


def test_bad_figures_and_blocks_are_named(tmp_path):
  missing = tmp_path / "nope.png"
  with pytest.raises(ValueError, match=re.escape(str(missing))):
    html_page.render("t", [html_page.Figure(missing)])
  fake = tmp_path / "fake.png"
  fake.write_bytes(b"GIF89a not a png")
  with pytest.raises(ValueError, match=f"{re.escape(str(fake))}.*not a PNG"):
    html_page.write(tmp_path / "p.html", "t", [html_page.Figure(fake)])
  assert not (tmp_path / "p.html").exists()
  outside = _png(tmp_path / "outside.png", "line")
  with pytest.raises(ValueError, match="outside the page's folder"):
    html_page.write(
      tmp_path / "sub" / "p.html", "t", [html_page.Figure(outside)]
    )
  with pytest.raises(ValueError, match="give render.*folder="):
    html_page.render("t", [html_page.Figure(outside)])
  with pytest.raises(ValueError, match="cannot put a str on the page"):
    html_page.render("t", ["text"])
  with pytest.raises(ValueError, match="level must be"):
    html_page.Heading("x", level=1)


def _column(page, table, col):
  return page.eval_on_selector_all(
    f"table >> nth={table} >> tbody tr",
    f"rows => rows.map(r => r.cells[{col}].textContent)",
  )


def test_page_in_headless_chromium(chromium_page, tmp_path):
  first = tmp_path / "first"
  first.mkdir()
  html_page.write(first / "page.html", "Report", _blocks(first))
  # The folder moved whole: its figures still load from the page.
  moved = shutil.move(first, tmp_path / "moved")
  page = chromium_page.open(Path(moved) / "page.html")

  assert page.title() == "Report"
  assert page.locator("h2").all_inner_texts() == [
    "Summary",
    "Quality",
    "Figures",
  ]
  assert page.locator("nav.toc a").count() == 4
  assert page.locator("table").count() == 4
  assert page.locator("table >> nth=0 >> tbody tr").count() == 5
  widths = page.eval_on_selector_all(
    "img", "imgs => imgs.map(i => i.complete && i.naturalWidth)"
  )
  assert len(widths) == 2 and all(w > 0 for w in widths)

  # A wide table scrolls inside its box; the page itself does not widen.
  page.set_viewport_size({"width": 800, "height": 600})
  assert page.evaluate("""() => {
    const wrap = document.querySelectorAll(".table-wrap")[3];
    return wrap.scrollWidth > wrap.clientWidth &&
      document.documentElement.scrollWidth <= window.innerWidth &&
      getComputedStyle(wrap.querySelector("th")).position === "sticky";
  }""")

  # The numeric column "error" (with an empty cell) sorts numerically, empty
  # last; a second click reverses; the text column sorts as text.
  header = page.locator("table >> nth=0 >> thead th >> nth=1")
  header.click()
  assert _column(page, 0, 1) == ["0.5", "3.25", "12", "100", ""]
  assert header.get_attribute("aria-sort") == "ascending"
  header.click()
  assert _column(page, 0, 1) == ["100", "12", "3.25", "0.5", ""]
  assert header.get_attribute("aria-sort") == "descending"
  page.locator("table >> nth=0 >> thead th >> nth=0").click()
  assert _column(page, 0, 0) == [
    "diagonal",
    "full",
    "identity",
    "kfac",
    "kfac-2",
  ]
  assert header.get_attribute("aria-sort") is None

  assert chromium_page.errors == []
