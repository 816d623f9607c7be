"""`curvbench report DIR`: a sweep's runs as a report that answers first.

The report opens with a summary: each measurement's question and its
findings, every figure in them with the interval or spread it rests on
and its count. Then one section per measurement (`Measurement.section`):
its main tables (a row per method, a column per metric), its figures and
its notes; the detailed tables are collapsed in the HTML page and listed
with their CSV in `report.md`. Last come the runs (and those not in the
results, with why) and a self-check: every median within its quartiles,
every mean within its interval, and no figure resting on one sample where
the sweep ran several seeds (`stats.inconsistencies`).

Runs are read by `curvbench.sweep`: settings and seeds told apart, runs
that did not finish listed with the reason. Every method keeps one colour
in every figure (`plots.colours`).

Writes under `DIR/report/` (or `--out`): `report.md`, `report.html` (one
page, sortable tables, its figures linked from `figures/`), one CSV per
table (the long form, with every statistic and count), `<table>_all.csv`
with every record, and the figures as PNG and PDF; with `--latex`, each
summary table (those whose rows carry their count n) as a booktabs table
to `\\input`, under `latex/` (`curvbench.latex`).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import pandas as pd

from curvbench import latex, sweep
from curvbench.approximations import CURVATURES
from curvbench.core import html_page, plots, records, registration_report, stats
from curvbench.core.sections import Section, Table, to_markdown, unreadable
from curvbench.gallery import page as gallery_page
from curvbench.measurements import MEASUREMENTS
from curvbench.optimizers import OPTIMIZERS

# In a report folder: it is curvbench's (see `records.claim`).
REPORT_MARKER = ".curvbench-report"


@dataclasses.dataclass
class Report:
  """What the measurements summarise and draw: the sweep's `root`, its
  `runs`, the complete and diverged ones with their setting and label
  (`done`), the merged tables with those labels, and one colour per label
  and method for every figure (`colour`)."""

  root: Path
  runs: pd.DataFrame
  done: pd.DataFrame
  tables: dict[str, pd.DataFrame]
  colour: dict[str, str]
  _derived: dict = dataclasses.field(default_factory=dict)

  def once(self, key: str, derive):
    """`derive(self)`, computed once however many hooks ask for it."""
    if key not in self._derived:
      self._derived[key] = derive(self)
    return self._derived[key]


def colour_map(tables: dict[str, pd.DataFrame]) -> plots.Looks:
  """A colour and marker for every label and method of `tables`: those
  each curvature and optimizer declares (`Component.colour` and
  `Component.marker`; `plots.colours`)."""
  names: set[str] = set()
  for df in tables.values():
    for column in ("label", "method"):
      if column in df:
        names.update(str(v) for v in df[column].dropna().unique())
  components = [
    (name, registry.get(name))
    for registry in (CURVATURES, OPTIMIZERS)
    for name in registry
  ]
  return plots.colours(
    names,
    {name: c.colour for name, c in components if c.colour is not None},
    {name: c.marker for name, c in components if c.marker is not None},
  )


def runs_section(runs: pd.DataFrame) -> Section:
  """The runs: how many of each status, and those not in the results."""
  counts = runs.groupby("status").run_dir.count().rename("runs").reset_index()
  found = Section("Runs", "Which runs do these results rest on?")
  found.tables.append(Table("run_counts", "Runs by status", counts))
  missing = sweep.not_in_results(runs)
  if not missing.empty:
    found.tables.append(
      Table("not_in_results", "Runs not in the results, with why", missing)
    )
    found.findings.append(
      f"{len(missing)} run folders are not in the results: "
      + ", ".join(
        f"{n} {s}" for s, n in missing.groupby("status").runs.sum().items()
      )
      + " (see Runs)."
    )
  return found


# The columns a summary row shares with the runs it summarises.
ROW_IDENTITY = ("problem", "measure", "method")


def _seeds_behind(row: pd.Series, done: pd.DataFrame) -> int:
  """How many seeds the runs a summary row speaks of ran: those of its
  problem, measurement and method (as far as the row names them)."""
  if "config:seed" not in done:
    return 1
  mask = pd.Series(True, index=done.index)
  for column in ROW_IDENTITY:
    if column in row.index and column in done and pd.notna(row[column]):
      mask &= done[column] == row[column]
  return done.loc[mask, "config:seed"].nunique()


def self_check(sections: list[Section], done: pd.DataFrame) -> list[str]:
  """What is wrong with the report's own tables: a centre outside its
  spread, or a count of one where the runs it speaks of ran several seeds
  (a sweep's parts may run different seeds, as the gallery's do)."""
  found = []
  for section in sections:
    for table in section.tables:
      found += stats.inconsistencies(table.name, table.data)
      if "n" not in table.data or section.title == "Runs":
        continue
      ones = table.data[pd.to_numeric(table.data.n, errors="coerce") == 1]
      for i, row in ones.iterrows():
        if row.get("seeds", 1) > 1:
          continue  # the row says so: defined on one of its seeds only
        seeds = _seeds_behind(row, done)
        if seeds > 1:
          found.append(
            f"{table.name} row {i}: n=1 although its runs ran {seeds} seeds"
          )
  return found


def not_rendered_section(rows: list[dict]) -> Section:
  """What the records hold that the report could not show, and why."""
  found = Section("Not rendered", "What could not be shown, and why?")
  found.tables.append(
    Table("not_rendered", "Parts not rendered, with why", pd.DataFrame(rows))
  )
  found.findings.append(
    f"{len(rows)} part{'s' * (len(rows) > 1)} of the records not rendered: "
    + "; ".join(f"{r['part']}: {r['why']}" for r in rows[:3])
    + ("; ..." if len(rows) > 3 else "")
    + " (see Not rendered)."
  )
  return found


def unregistered(runs: pd.DataFrame) -> list[dict]:
  """The measurements runs finished with that no registered measurement
  draws: a plugin's, not imported (its runs say why)."""
  if "measure" not in runs:
    return []
  done = runs[runs.status.isin(["complete", "diverged"])]
  done = done[done.measure.notna() & ~done.measure.isin(list(MEASUREMENTS))]
  out = []
  for kind, group in done.groupby("measure"):
    why = sorted(set(group.get("plugins_not_imported", pd.Series()).dropna()))
    out.append(
      dict(
        part=f"the section of measurement {kind!r}",
        runs=len(group),
        why="; ".join(why)
        or f"no measurement {kind!r} is registered here: neither curvbench "
        "nor the plugins its runs name declare it",
      )
    )
  return out


def _guarded(part: str, not_rendered: list[dict], make, *args):
  """`make(*args)`, or None where the records are not what it expects (the
  part and why are added to `not_rendered`: the rest of the report stands)."""
  try:
    return make(*args)
  except Exception as e:  # noqa: BLE001 - any record it did not expect: said
    not_rendered.append(dict(part=part, runs=None, why=unreadable(e)))
    return None


def write(root, out=None, trust=(), latex_tables=False, style="screen") -> dict:
  """Writes the summary, the sections' tables and figures, `report.md`
  and `report.html` (with `latex_tables`, each summary table as LaTeX
  too); returns their paths (`tables`, `figures`, `latex`), how many
  runs of each status in `sweep.NOT_IN_RESULTS` there are
  (`not_in_results`), what the self-check found (`self_check`) and what
  could not be rendered, with why (`not_rendered`). Of the plugins the
  runs name, only those in `trust` whose code is the code the runs
  recorded are imported (`sweep.load_sweep`). Figures take `style`
  (`plots.STYLES`: screen, or a paper's one-column or two-column width)."""
  root = Path(root)
  out = Path(out) if out else root / "report"
  if not root.is_dir():
    raise FileNotFoundError(
      f"No sweep directory at {root}: give the folder "
      "of a sweep (e.g. reports/quick)."
    )
  loaded = sweep.load_sweep(root, trust)
  if loaded.runs.empty:
    raise FileNotFoundError(
      f"No runs under {root}: run a sweep first "
      "(curvbench -m +experiment=quick)."
    )
  done = sweep.settings(loaded.runs)
  tables = {
    name: sweep.with_labels(df, done) for name, df in loaded.tables.items()
  }
  records.claim(
    out,
    REPORT_MARKER,
    "a report folder (give another with --out)",
    legacy=lambda folder: (folder / "report.md").exists(),
  )
  report = Report(root, loaded.runs, done, tables, colour_map(tables))
  not_rendered = unregistered(loaded.runs)
  sections = []
  with plots.style(style):
    for name in MEASUREMENTS:
      section = _guarded(
        f"the section of measurement {name!r}",
        not_rendered,
        MEASUREMENTS.get(name)().section,
        report,
        out / "figures",
      )
      if section is not None:
        sections.append(section)
    registered = _guarded(
      "the registration section",
      not_rendered,
      registration_report.section,
      report,
    )
    sections += [registered] if registered is not None else []
    judged = _guarded(
      "the gallery", not_rendered, gallery_page.judge, done, tables
    )
    gallery = judged and _guarded(
      "the gallery", not_rendered, gallery_page.section, judged
    )
    pages = gallery and _guarded(
      "the gallery's page", not_rendered, gallery_page.write, root, out, judged
    )
  if gallery:
    sections.append(gallery)
  if not_rendered:
    sections.append(not_rendered_section(not_rendered))
  sections.append(runs_section(loaded.runs))
  notes = sweep.mixed_inputs(done)
  if notes:
    sections[-1].notes += notes
  checked = self_check(sections, done)

  written: dict[str, Any] = {
    "tables": [],
    "figures": [],
    "latex": [],
    "self_check": checked,
    "not_in_results": {
      status: int(n)
      for status, n in loaded.runs.status.value_counts().items()
      if status in sweep.NOT_IN_RESULTS
    },
    "not_rendered": not_rendered,
  }

  def save_csv(name, df):
    path = out / f"{name}.csv"
    records.atomic_write(path, lambda tmp: df.to_csv(tmp, index=False))
    written["tables"].append(path)

  for name, df in tables.items():
    save_csv(f"{name}_all", df)
  save_csv("runs", loaded.runs)
  for section in sections:
    for table in section.tables:
      save_csv(table.name, table.data)
      if latex_tables and "n" in table.data and not table.data.empty:
        written["latex"].append(_save_latex(out / "latex", table))
    written["figures"] += section.figures
  written["tables"] += _write_pages(
    root, out, sections, checked, _provenance_line(tables, loaded.runs)
  )
  if pages:
    written["tables"] += pages[:2]
    written["figures"] += pages[2:]
  return written


def _save_latex(folder: Path, table: Table) -> Path:
  path = folder / f"{table.name}.tex"
  text = latex.table(table)
  return records.atomic_write(
    path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8")
  )


def _provenance_line(tables, runs: pd.DataFrame) -> str:
  """The devices, code versions and runs the records come from."""
  found: dict[str, set[str]] = {"device_kind": set(), "commit": set()}
  for df in tables.values():
    for column, values in found.items():
      if column in df:
        values.update(str(v)[:12] for v in df[column].dropna().unique())
    if "dirty" in df and df.dirty.fillna(False).astype(bool).any():
      found["commit"].add("uncommitted changes")
  counts = runs.status.value_counts()
  return (
    f"Devices: {', '.join(sorted(found['device_kind'])) or 'unknown'}."
    f" Code: {', '.join(sorted(found['commit'])) or 'unknown'}. Runs: "
    + ", ".join(f"{n} {status}" for status, n in counts.items())
    + "."
  )


def _check_line(checked: list[str]) -> str:
  if not checked:
    return (
      "Self-check: every median lies within its quartiles and every "
      "mean within its interval, and no figure rests on one sample "
      "where the sweep ran several seeds."
    )
  return (
    f"Self-check: {len(checked)} figures are inconsistent (this is a "
    "defect of curvbench; please report it): "
    + "; ".join(checked[:5])
    + ("; ..." if len(checked) > 5 else "")
  )


def _write_pages(root, out, sections, checked, header) -> list[Path]:
  """`report.md` (answers first, detailed tables as links to their CSV)
  and `report.html` (the same, detailed tables collapsed)."""
  lines = [f"# curvbench report: {root}", "", header, "", "## Summary", ""]
  blocks: list[html_page.Block] = [
    html_page.Paragraph(header),
    html_page.Heading("Summary"),
  ]
  for section in sections:
    if section.findings:
      lines += [
        f"**{section.title}**: {section.question}",
        "",
        *[f"- {f}" for f in section.findings],
        "",
      ]
      blocks += [
        html_page.Paragraph(f"{section.title}: {section.question}"),
        html_page.Bullets(section.findings),
      ]
  lines += [_check_line(checked), ""]
  blocks.append(html_page.Paragraph(_check_line(checked)))
  for section in sections:
    lines += [f"## {section.title}", ""]
    blocks.append(html_page.Heading(section.title))
    details = [t for t in section.tables if t.detail]
    for table in section.tables:
      if not table.detail:
        lines += [
          f"{table.title} ([{table.name}.csv]({table.name}.csv)):",
          "",
          to_markdown(table.shown),
          "",
        ]
        blocks.append(html_page.Table(table.shown, caption=table.title))
    pngs = [p for p in section.figures if p.suffix == ".png"]
    lines += [f"![{p.stem}](figures/{p.name})" for p in pngs]
    lines += [""] if pngs else []
    blocks += [html_page.Figure(p, caption=p.stem) for p in pngs]
    if details:
      lines += [
        "More tables: "
        + "; ".join(
          f"[{t.name}.csv]({t.name}.csv) ({t.title.split(':')[0]})"
          for t in details
        )
        + ".",
        "",
      ]
      blocks += [
        html_page.Details(t.title, [html_page.Table(t.shown)]) for t in details
      ]
    if section.notes:
      lines += ["Notes:", "", *[f"- {n}" for n in section.notes], ""]
      blocks += [html_page.Bullets(section.notes)]
  md = out / "report.md"
  records.atomic_write(
    md, lambda tmp: Path(tmp).write_text("\n".join(lines) + "\n")
  )
  page = html_page.write(
    out / "report.html", f"curvbench report: {root}", blocks
  )
  return [md, page]


def main(argv=None) -> int:
  """`curvbench report DIR` with `argv` (default the process's
  arguments): writes the report and prints what it wrote and what
  it left out; returns the exit status."""
  parser = argparse.ArgumentParser(
    prog="curvbench report",
    description="Merge a sweep's runs into a report: a summary of "
    "findings with their intervals, then each measurement's tables and "
    "figures.",
  )
  parser.add_argument("dir", help="a sweep directory, e.g. reports/quick")
  parser.add_argument("--out", help="output directory (default DIR/report)")
  parser.add_argument(
    "--trust",
    action="append",
    default=[],
    metavar="PLUGIN",
    help="import plugin PLUGIN (as the runs name it: a module or a .py "
    "path) to render its sections, where its code is the code the runs "
    "recorded; reading a folder imports no code it names otherwise "
    "(repeat for several)",
  )
  parser.add_argument(
    "--latex",
    action="store_true",
    help="also write each summary table as a booktabs LaTeX table (its "
    "intervals and counts n, caption and label) to \\input into a paper, "
    "under OUT/latex/",
  )
  parser.add_argument(
    "--style",
    choices=list(plots.STYLES),
    default="screen",
    help="figure sizes and fonts: screen (default), or a paper's "
    "one-column (3.25 in) or two-column (6.75 in) width",
  )
  args = parser.parse_args(argv)
  out = Path(args.out or Path(args.dir) / "report")
  try:
    written = write(args.dir, args.out, args.trust, args.latex, args.style)
  except (FileNotFoundError, records.ForeignFolder) as e:
    raise SystemExit(f"curvbench report: {e}") from None
  except OSError as e:  # a read-only or full disk
    raise SystemExit(
      f"curvbench report: cannot write the report to {out} "
      f"({e.strerror or e}); give another folder with --out."
    ) from None
  print(
    f"[curvbench] wrote {len(written['tables'])} tables and "
    f"{len(written['figures'])} figures under {out}; start with "
    f"{out / 'report.md'}"
  )
  if written["latex"]:
    print(
      f"[curvbench] wrote {len(written['latex'])} LaTeX tables under "
      f"{out / 'latex'} (\\input them; they need booktabs and graphicx): "
      + ", ".join(p.name for p in written["latex"])
    )
  missing = written["not_in_results"]
  if missing:
    print(
      "[curvbench] not in the results: "
      + ", ".join(f"{n} {status}" for status, n in missing.items())
      + f" (see 'Runs' in {out / 'report.md'})"
    )
  if written["not_rendered"]:
    count = len(written["not_rendered"])
    print(
      f"[curvbench] {count} part{'s' * (count > 1)} not rendered "
      f"(see 'Not rendered' in {out / 'report.md'}): "
      + "; ".join(r["part"] for r in written["not_rendered"])
    )
  if written["self_check"]:
    print(f"[curvbench] {_check_line(written['self_check'])}")
  return 0
