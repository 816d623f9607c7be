"""The gallery page of a report: for each entry with runs in the sweep, the
paper and what it reproduces, each claim with its verdict and evidence,
what differs from the paper, the runs it rests on (problems and sizes,
seeds, device, code, run time) and the entry's figure."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pandas as pd

from curvbench import html_page, plots, records
from curvbench.sections import Section, Table, to_markdown
from curvbench.gallery import Claim, Entry, Evidence, Verdict, entries
from curvbench.gallery import evidence as evidence_of


@dataclasses.dataclass
class Judged:
  """An entry, its records and its claims' verdicts."""

  entry: Entry
  evidence: Evidence
  verdicts: list[tuple[Claim, Verdict]]


def judge(done: pd.DataFrame, tables: dict[str, pd.DataFrame]) -> list[Judged]:
  """Every entry with runs among `done`, its claims judged."""
  out = []
  for name, entry in entries().items():
    found = evidence_of(done, tables, name)
    if not found.done.empty:
      out.append(
        Judged(entry, found, [(c, c.judge(found)) for c in entry.claims])
      )
  return out


def section(judged: list[Judged]) -> Section:
  """The verdicts of the gallery entries these runs reproduce."""
  verdicts = pd.DataFrame(
    [
      dict(
        entry=j.entry.name,
        claim=c.statement,
        verdict=v.outcome,
        evidence=v.evidence,
      )
      for j in judged
      for c, v in j.verdicts
    ]
  )
  return Section(
    "Gallery",
    "Do the published findings these runs reproduce hold?",
    findings=findings(judged),
    tables=[
      Table(
        "gallery", "Each claim's verdict, computed from the records", verdicts
      )
    ],
    notes=[
      "gallery.md and gallery.html: each entry's paper, claims, what "
      "differs from the paper, runs and figure."
    ],
  )


def findings(judged: list[Judged]) -> list[str]:
  """One line per entry for the report's summary."""
  return [
    f"{j.entry.title} ({j.entry.name}): "
    + "; ".join(
      f"claim {i + 1} {v.outcome}" for i, (_, v) in enumerate(j.verdicts)
    )
    for j in judged
  ]


def _run_seconds(root: Path, runs: pd.DataFrame, tables) -> float:
  """The runs' wall time: from each one's first record's timestamp to
  the time its DONE.json says it finished."""
  started: dict[str, Any] = {}
  for df in tables.values():
    if "timestamp" in df and "run_id" in df:
      for run_id, t in df.groupby("run_id").timestamp.min().items():
        started[run_id] = min(started.get(run_id, t), t)
  total = 0.0
  for run in runs.itertuples():
    done = Path(root) / run.run_dir / "DONE.json"
    if run.run_id in started and done.is_file():
      finished = json.loads(done.read_text()).get("finished")
      if finished is not None:
        total += finished - pd.Timestamp(started[run.run_id]).timestamp()
  return total


def _runs_line(root: Path, found: Evidence) -> str:
  done, tables = found.done, found.tables
  sizes = {}
  for df in tables.values():
    if {"problem", "num_params"} <= set(df):
      sizes.update(df.groupby("problem").num_params.first().to_dict())
  devices = sorted(
    {
      str(v)
      for df in tables.values()
      if "device_kind" in df
      for v in df.device_kind.dropna().unique()
    }
  )
  commits = sorted({str(c)[:12] for c in done.code.dropna().unique()})
  seeds = sorted(found.setting("seed"))
  minutes = _run_seconds(root, done, tables) / 60
  return (
    f"{len(done)} runs: "
    + ", ".join(f"{p} ({n:,} parameters)" for p, n in sizes.items())
    + f"; seeds {', '.join(map(str, seeds))}; device "
    f"{', '.join(devices) or 'unknown'}; code {', '.join(commits)}; "
    f"{minutes:.1f} min of runs."
  )


def _figure(judged: Judged, folder: Path) -> list[Path]:
  """The entry's own figure, one panel, as `gallery_<name>` PNG and PDF."""
  draw = cast(Callable, judged.entry.draw)  # drawn for entries that draw
  fig, (ax,) = plots.grid(1, width=5.0, height=3.6)
  draw(judged.evidence, ax)
  ax.legend(fontsize=7)
  return plots.save(fig, folder / f"gallery_{judged.entry.name}")


def _counts(judged: list[Judged]) -> str:
  outcomes = [v.outcome for j in judged for _, v in j.verdicts]
  return ", ".join(
    f"{outcomes.count(o)} {o}"
    for o in dict.fromkeys(("holds", "does not hold", "not settled"))
    if outcomes.count(o)
  )


def write(root: Path, out: Path, judged: list[Judged]) -> list[Path]:
  """`gallery.md` and `gallery.html` under `out`, the entries' figures
  under `out/figures`; returns the pages and figures written."""
  lines = [
    f"# Gallery: published findings, reproduced ({root})",
    "",
    f"{len(judged)} {'entry' if len(judged) == 1 else 'entries'}, "
    f"their claims: {_counts(judged)}. Each "
    "verdict is computed from the runs' records: a claim holds, does "
    "not hold, or is not settled by these runs (an interval that "
    "holds 0, too few samples).",
    "",
  ]
  blocks: list[html_page.Block] = [html_page.Paragraph(lines[2])]
  written = []
  with plots.style():
    for j in judged:
      e = j.entry
      table = pd.DataFrame(
        [
          dict(
            claim=c.statement,
            paper=c.figure,
            verdict=v.outcome,
            evidence=v.evidence,
          )
          for c, v in j.verdicts
        ]
      )
      figures = _figure(j, out / "figures") if e.draw else []
      written += figures
      pngs = [p for p in figures if p.suffix == ".png"]
      runs = _runs_line(root, j.evidence)
      lines += [
        f"## {e.title}",
        "",
        f"{e.paper}",
        "",
        f"Reproduces {e.reproduces}.",
        "",
        to_markdown(table),
        "",
        "What differs from the paper:",
        "",
        *[f"- {d}" for d in e.differs],
        "",
        f"Runs: {runs}",
        "",
        *[f"![{p.stem}](figures/{p.name})" for p in pngs],
        "",
      ]
      blocks += [
        html_page.Heading(e.title),
        html_page.Paragraph(e.paper),
        html_page.Paragraph(f"Reproduces {e.reproduces}."),
        html_page.Table(table, caption="Claims and verdicts"),
        html_page.Paragraph("What differs from the paper:"),
        html_page.Bullets(list(e.differs)),
        html_page.Paragraph(f"Runs: {runs}"),
        *[html_page.Figure(p, caption=p.stem) for p in pngs],
      ]
  md = out / "gallery.md"
  records.atomic_write(
    md, lambda tmp: Path(tmp).write_text("\n".join(lines) + "\n")
  )
  page = html_page.write(out / "gallery.html", "curvbench gallery", blocks)
  return [md, page, *written]
