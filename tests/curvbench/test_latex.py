"""Summary tables as booktabs LaTeX (`curvbench report DIR --latex`):
escaped, well formed, and compiled by pdflatex where it is installed."""

import re
import shutil
import subprocess

import pandas as pd
import pytest

from curvbench import latex
from curvbench.core import metrics
from curvbench.core.sections import Table, wide

NAMES = [
  "kfac/ggn_exact",
  "shampoo² 50% & more #1",
  "a~b^c {d} $e$ \\f <g> |h|",
]
# A character LaTeX reads as markup where it is not escaped.
BARE = re.compile(r"(?<!\\)[_#%&~^$]")


def parsed(text: str) -> list[list[str]]:
  """The rows of the tabular in `text`, each a list of cells, after
  checking its form: braces balanced, booktabs rules in order, and every
  row of as many cells as the column spec and ending its line."""
  unescaped = re.sub(r"\\[{}]", "", text)
  depth = 0
  for char in unescaped:
    depth += {"{": 1, "}": -1}.get(char, 0)
    assert depth >= 0, "a } closes no {"
  assert depth == 0, "a { is not closed"
  spec = re.search(r"\\begin\{tabular\}\{([lrc]+)\}", text)
  assert spec, "no tabular with a column spec"
  body = text[spec.end() : text.index(r"\end{tabular}")]
  lines = [line.strip() for line in body.strip().splitlines()]
  assert lines[0] == r"\toprule" and lines[2] == r"\midrule", lines[:3]
  assert lines[-1] == r"\bottomrule", lines[-1]
  rows = [lines[1], *lines[3:-1]]
  out = []
  for row in rows:
    assert row.endswith(r" \\"), row
    cells = re.split(r"(?<!\\)&", row.removesuffix(r" \\"))
    assert len(cells) == len(spec.group(1)), row
    out.append([c.strip() for c in cells])
  return out


def bare_specials(cell: str) -> list[str]:
  """A cell's characters LaTeX would read as markup: any special not
  escaped, once the math the escaping writes (`$\\times$`) is taken out."""
  return BARE.findall(re.sub(r"\$\\?[a-z]*-?\$", "", cell))


def _table():
  long = pd.DataFrame(
    dict(
      problem="mlp",
      label=[n for n in NAMES for _ in range(2)],
      metric=["relative_frobenius", "cosine (rho=0.01)"] * 3,
      median=[0.5, 0.9, -1.25, 0.8, 2e-7, 0.7],
      q25=[0.4, 0.85, -2.0, 0.8, 1e-7, 0.6],
      q75=[0.6, 0.95, -0.5, 0.8, 3e-7, 0.8],
      n=[5, 5, 3, 4, 1, 1],
    )
  )
  view = wide(long, ["problem", "label"], "metric")
  return Table(
    "quality_demo", "Quality: median [quartiles] over seeds", long, view
  )


def test_a_table_is_booktabs_with_its_intervals_and_n_escaped():
  text = latex.table(_table())
  rows = parsed(text)
  # Headers in words, with the way that is better and the damping said.
  assert rows[0] == [
    "Problem",
    "Label",
    r"Relative Frobenius error $\downarrow$",
    r"Cosine ($\rho$ = 0.01)",
    "$n$",
  ]
  assert [r[1] for r in rows[1:]] == [
    r"kfac/ggn\_exact",
    r"shampoo\textsuperscript{2} 50\% \& more \#1",
    r"a\textasciitilde{}b\textasciicircum{}c \{d\} \$e\$ \textbackslash{}f "
    r"\textless{}g\textgreater{} \textbar{}h\textbar{}",
  ]
  # Intervals and counts as the view has them: a minus sign is math, a
  # range of counts an en dash, a spread of one value the value alone.
  assert rows[1][2:] == ["0.5 [0.4, 0.6]", "0.9 [0.85, 0.95]", "5"]
  assert rows[2][2:] == ["$-$1.25 [$-$2, $-$0.5]", "0.8", "3--4"]
  assert rows[3][2] == "2e-07 [1e-07, 3e-07]"
  assert re.search(r"\\begin\{tabular\}\{llrrr\}", text)
  assert r"\caption[{Quality}]{Quality: median [quartiles] over seeds}" in text
  assert r"\label{tab:quality_demo}" in text
  assert not [c for row in rows for cell in row for c in bare_specials(cell)]


def test_a_table_without_a_view_joins_each_statistic_with_its_spread():
  data = pd.DataFrame(
    dict(
      method=["a_b", "c"],
      median=[1.0, 2.0],
      q25=[0.5, 2.0],
      q75=[1.5, 2.0],
      mean=[1.0, float("nan")],
      ci_low=[0.0, float("nan")],
      ci_high=[2.0, float("nan")],
      n=[6, 1],
    )
  )
  rows = parsed(latex.table(Table("plain", "Plain", data)))
  assert rows == [
    ["Method", "Median [q25, q75]", "Mean [interval]", "$n$"],
    [r"a\_b", "1 [0.5, 1.5]", "1 [0, 2]", "6"],
    ["c", "2", "", "1"],
  ]


def test_headers_say_the_quantity_in_words_and_which_way_is_better():
  assert latex.header("final_train_error") == (
    r"Final training error $\downarrow$"
  )
  assert latex.header("cosine_similarity") == r"Cosine similarity $\uparrow$"
  assert latex.header("trace_ratio") == "Trace ratio (1 best)"
  assert latex.header("natural_gradient_cosine (rho=0.001)") == (
    r"Natural-gradient cosine ($\rho$ = 0.001) $\uparrow$"
  )
  assert latex.header("compile_seconds") == "Compile seconds"
  # Every declared quantity's header is plain text pdflatex reads as is.
  for name in [*metrics.QUALITY, *metrics.STATISTICS, *metrics.TRAINING]:
    assert latex.header(name).isascii(), name


def test_the_parser_catches_what_it_checks():
  text = latex.table(_table())
  with pytest.raises(AssertionError):
    parsed(
      text.replace(r" \\" + "\n    \\bottomrule", " & x \\\\\n    \\bottomrule")
    )
  with pytest.raises(AssertionError):
    parsed(text.replace(r"\midrule", ""))
  assert bare_specials("kfac/ggn_exact 5%") == ["_", "%"]


@pytest.mark.skipif(not shutil.which("pdflatex"), reason="no pdflatex here")
def test_the_table_compiles_with_pdflatex(tmp_path):
  (tmp_path / "table.tex").write_text(latex.table(_table()), encoding="utf-8")
  (tmp_path / "paper.tex").write_text(
    "\\documentclass{article}\n\\usepackage{booktabs}\n"
    "\\usepackage{graphicx}\n\\begin{document}\n\\input{table}\n"
    "See Table~\\ref{tab:quality_demo}.\n\\end{document}\n"
  )
  done = subprocess.run(
    ["pdflatex", "-interaction=nonstopmode", "-halt-on-error", "paper.tex"],
    cwd=tmp_path,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert done.returncode == 0, done.stdout[-2000:]
  assert (tmp_path / "paper.pdf").stat().st_size > 1000
