r"""A report's summary table as a booktabs LaTeX table, ready to `\input`
into a paper (`curvbench report DIR --latex`).

Each table is a `table` float: its caption is the table's title (which
says what the brackets hold: quartiles or an interval, and over which
samples), its label `tab:<name>`, and its tabular the rows the report
pages show: a row per method, each cell `centre [low, high]`, and the
count `n` of each row. A table with no such view shows its long form,
each `median` with its quartiles and each `mean` with its interval in one
cell. The tabular is shrunk to the line's width only where it is wider.

Needs `\usepackage{booktabs}` and `\usepackage{graphicx}` in the paper.
"""

from __future__ import annotations

import re

import pandas as pd

from curvbench.core import metrics
from curvbench.core.sections import Table, number, spread

# LaTeX's special characters, each as text that prints it.
SPECIALS = {
  "\\": r"\textbackslash{}",
  "&": r"\&",
  "%": r"\%",
  "$": r"\$",
  "#": r"\#",
  "_": r"\_",
  "{": r"\{",
  "}": r"\}",
  "~": r"\textasciitilde{}",
  "^": r"\textasciicircum{}",
  # Printed as other glyphs by the default (OT1) font encoding.
  "<": r"\textless{}",
  ">": r"\textgreater{}",
  "|": r"\textbar{}",
}
# Characters the report's names and titles use that pdflatex's default
# input encoding does not typeset, as commands that do.
UNICODE = {
  "×": r"$\times$",
  "±": r"$\pm$",
  "²": r"\textsuperscript{2}",
  "³": r"\textsuperscript{3}",
  "≤": r"$\leq$",
  "≥": r"$\geq$",
  "−": r"$-$",
  "–": "--",
  "—": "---",
  "…": r"\dots{}",
  "ρ": r"$\rho$",
  "λ": r"$\lambda$",
  "’": "'",
  **{chr(0x2080 + d): rf"\textsubscript{{{d}}}" for d in range(10)},
}
_ESCAPE = re.compile("|".join(map(re.escape, {**SPECIALS, **UNICODE})))
# A cell that holds a number (possibly with its interval): set flush right.
_NUMBER = re.compile(r"[-+]?(\d|\.\d|inf\b|nan\b)")
# A minus sign before a number (not a hyphen within a word), and a range
# of counts (`n` of 3-5 where cells differ).
_MINUS = re.compile(r"(?<![\w.])-(?=\d|inf)")
_RANGE = re.compile(r"(?<=\d)-(?=\d)")
# Which way is better, after a quantity's header.
ARROWS = {"lower": r"$\downarrow$", "higher": r"$\uparrow$", "1": "(1 best)"}


def escape(text) -> str:
  """`text` with every LaTeX special character escaped."""
  return _ESCAPE.sub(
    lambda m: SPECIALS.get(m.group(), UNICODE.get(m.group(), "")), str(text)
  )


def _cell(value) -> str:
  if isinstance(value, float) or value is None:
    return number(value)
  return "" if value is pd.NA else str(value)


def cells(table: Table) -> pd.DataFrame:
  """What the LaTeX table shows, as text: the table's `view`, or its
  data with each median and its quartiles, and each mean and its
  interval, in one cell."""
  if table.view is not None:
    return table.view.map(_cell)
  data = table.data
  shown = data.map(_cell)
  for centre, low, high, name in (
    ("median", "q25", "q75", "median [q25, q75]"),
    ("mean", "ci_low", "ci_high", "mean [interval]"),
  ):
    if {centre, low, high} <= set(data):
      at = shown.columns.get_loc(centre)
      joined = [
        spread(c, lo, hi)
        for c, lo, hi in zip(data[centre], data[low], data[high])
      ]
      shown = shown.drop(columns=[centre, low, high])
      shown.insert(at, name, joined)
  return shown


def header(column) -> str:
  """A column's header in LaTeX: the quantity in words (`metrics`), a
  damping in its name said as ρ, and an arrow (or "1 best") for the way that is better
  ("Relative Frobenius error $\\downarrow$"); the count `n` as $n$."""
  if column == "n":
    return "$n$"
  name, _, extra = str(column).partition(" (")
  described = metrics.described(name)
  text = escape(described.words)
  if extra:
    text += f" ({escape(extra.rstrip(')').replace('rho=', 'ρ = '))})"
  arrow = ARROWS.get(described.better)
  return f"{text} {arrow}" if arrow else text


def tabular(df: pd.DataFrame) -> str:
  """`df` (cells as text) as a booktabs tabular: text columns flush left,
  number columns flush right."""
  spec = "".join(
    "r"
    if (filled := [v for v in df[c] if v]) and all(map(_NUMBER.match, filled))
    else "l"
    for c in df.columns
  )

  def row(texts) -> str:
    return "    " + " & ".join(texts) + r" \\"

  def numbers(values) -> list[str]:
    texts = [escape(v) for v in values]
    return [
      _RANGE.sub("--", _MINUS.sub("$-$", t)) if kind == "r" else t
      for t, kind in zip(texts, spec)
    ]

  return "\n".join(
    [
      rf"  \begin{{tabular}}{{{spec}}}",
      r"    \toprule",
      row(map(header, df.columns)),
      r"    \midrule",
      *[row(numbers(r)) for r in df.itertuples(index=False, name=None)],
      r"    \bottomrule",
      r"  \end{tabular}",
    ]
  )


def table(t: Table) -> str:
  r"""`t` as a `table` float to `\input`: caption, label and tabular."""
  short = t.title.split(":")[0]
  return "\n".join(
    [
      f"% {t.name}: written by curvbench report (every statistic and count "
      f"in {t.name}.csv).",
      r"% Needs \usepackage{booktabs} and \usepackage{graphicx}.",
      r"\begin{table}[tbp]",
      r"  \centering",
      rf"  \caption[{{{escape(short)}}}]{{{escape(t.title)}}}",
      rf"  \label{{tab:{re.sub(r'[^A-Za-z0-9_.:-]', '-', t.name)}}}",
      # Shrunk to the line only where wider: never enlarged.
      r"  \resizebox{\ifdim\width>\linewidth\linewidth\else\width\fi}{!}{%",
      tabular(cells(t)) + "}",
      r"\end{table}",
      "",
    ]
  )


__all__ = [
  "ARROWS",
  "SPECIALS",
  "UNICODE",
  "cells",
  "escape",
  "header",
  "table",
  "tabular",
]
