"""The gallery page of a report: for each entry with runs in the sweep, the
paper and what it reproduces, the size that ran, each claim (its kind, the
paper's statement and where the paper makes it) with its verdict, its
evidence and the conditions it depends on, met or not; what differs from
the paper, the runs it rests on (problems and sizes, seeds, device, code,
run time) and the entry's figure. The tallies count findings, extensions
and checks apart: only findings are claims of the papers."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import matplotlib.pyplot as plt
import pandas as pd

from curvbench.core import html_page, plots, records
from curvbench.core.sections import Section, Table, to_markdown
from curvbench.gallery import (
  KINDS,
  OUTCOMES,
  Claim,
  Entry,
  Evidence,
  Verdict,
  entries,
  lacking,
)
from curvbench.gallery import evidence as evidence_of

# How the page names each kind of claim, in the tally.
KIND_WORDS = {
  "finding": "findings (the papers' own claims)",
  "extension": "extensions (claims of ours in a paper's setting)",
  "check": "checks (true by construction: tests of our code, not findings)",
}


@dataclasses.dataclass
class Judged:
  """An entry, its records and its claims' verdicts."""

  entry: Entry
  evidence: Evidence
  verdicts: list[tuple[Claim, Verdict]]

  def sizes(self) -> list[str]:
    """The entry's sizes these runs ran at (as `repro_size` says)."""
    return sorted(self.evidence.setting("repro_size"), key=str)


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


def tally(judged: list[Judged]) -> dict[str, dict[str, int]]:
  """`{kind: {outcome: count}}` over every judged claim, each kind's
  outcomes in their order (zero counts left out)."""
  out = {}
  for kind in KINDS:
    found = [v.outcome for j in judged for c, v in j.verdicts if c.kind == kind]
    out[kind] = {o: found.count(o) for o in OUTCOMES[kind] if found.count(o)}
  return out


def tally_words(judged: list[Judged]) -> str:
  """The tally in words, a sentence per kind of claim."""
  return " ".join(
    f"{sum(counts.values())} {KIND_WORDS[kind]}: "
    + ", ".join(f"{n} {o}" for o, n in counts.items())
    + "."
    for kind, counts in tally(judged).items()
    if counts
  )


def _claims_table(j: Judged) -> pd.DataFrame:
  return pd.DataFrame(
    [
      dict(
        entry=j.entry.name,
        kind=c.kind,
        claim=c.statement,
        paper=c.where,
        verdict=v.outcome,
        evidence=v.evidence,
        conditions_differing="; ".join(m.condition.name for m in v.differing),
      )
      for c, v in j.verdicts
    ]
  )


def section(judged: list[Judged]) -> Section:
  """The verdicts of the gallery entries these runs reproduce."""
  verdicts = pd.concat([_claims_table(j) for j in judged], ignore_index=True)
  return Section(
    "Gallery",
    "Do the published findings these runs reproduce hold?",
    findings=[tally_words(judged), *findings(judged)],
    tables=[
      Table(
        "gallery",
        "Each claim's kind, verdict and the conditions of the paper's that "
        "these runs do not meet, computed from the records",
        verdicts,
      )
    ],
    notes=[
      "gallery.md and gallery.html: each entry's paper, claims and the "
      "conditions each depends on, what differs from the paper, runs and "
      "figure."
    ],
  )


def findings(judged: list[Judged]) -> list[str]:
  """One line per entry for the report's summary."""
  return [
    f"{j.entry.title} ({j.entry.name}, size {', '.join(j.sizes()) or 'unknown'}): "
    + "; ".join(
      f"{c.kind} {i + 1} {v.outcome}" for i, (c, v) in enumerate(j.verdicts)
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


def _figure(judged: Judged, folder: Path) -> tuple[list[Path], str | None]:
  """The entry's own figure, one panel, as `gallery_<name>` PNG and PDF; or
  none and why, where its records cannot be drawn."""
  draw = cast(Callable, judged.entry.draw)  # drawn for entries that draw
  fig, (ax,) = plots.grid(1, width=5.0, height=3.6)
  try:
    draw(judged.evidence, ax)
  except Exception as e:  # noqa: BLE001 - records not as expected: said
    plt.close(fig)
    return [], f"Figure not drawn: {lacking(e)}."
  ax.legend(fontsize=7)
  return plots.save(fig, folder / f"gallery_{judged.entry.name}"), None


def _claim_lines(claim: Claim, verdict: Verdict) -> list[str]:
  """A claim's conditions, met or not, and what could not be verified."""
  lines = [
    f"- **{claim.kind}: {claim.statement}** ({claim.where}) — {verdict.outcome}"
  ]
  lines += [f"  - {m.words()}" for m in verdict.conditions]
  if claim.unverified:
    lines.append(f"  - not verified in the paper's text: {claim.unverified}")
  return lines


def write(root: Path, out: Path, judged: list[Judged]) -> list[Path]:
  """`gallery.md` and `gallery.html` under `out`, the entries' figures
  under `out/figures`; returns the pages and figures written."""
  summary = (
    f"{len(judged)} {'entry' if len(judged) == 1 else 'entries'}. "
    + tally_words(judged)
    + " Each verdict is computed from the runs' records: a finding or an "
    "extension is reproduced, contradicted (only where the runs meet every "
    "condition the paper's claim depends on), not reproduced at this scale "
    "(the runs differ from the paper's in a condition it depends on) or "
    "inconclusive (the interval holds the threshold); with fewer samples "
    "than an exact 95 % interval needs, there is no verdict."
  )
  lines = [
    f"# Gallery: published findings, reproduced ({root})",
    "",
    summary,
    "",
  ]
  blocks: list[html_page.Block] = [html_page.Paragraph(summary)]
  written = []
  with plots.style():
    for j in judged:
      e = j.entry
      table = _claims_table(j).drop(columns=["entry"])
      figures, not_drawn = _figure(j, out / "figures") if e.draw else ([], None)
      written += figures
      pngs = [p for p in figures if p.suffix == ".png"]
      runs = _runs_line(root, j.evidence)
      ran = [
        f"At its {size} size: {e.sizes[size].runs}."
        for size in j.sizes()
        if size in e.sizes
      ]
      conditions = [line for c, v in j.verdicts for line in _claim_lines(c, v)]
      lines += [
        f"## {e.title}",
        "",
        f"{e.paper}",
        "",
        f"Reproduces {e.reproduces}.",
        "",
        *ran,
        "",
        to_markdown(table),
        "",
        "Each claim's conditions, as the paper has them, against these runs:",
        "",
        *conditions,
        "",
        "What differs from the paper:",
        "",
        *[f"- {d}" for d in e.differs],
        "",
        f"Runs: {runs}",
        "",
        *[f"![{p.stem}](figures/{p.name})" for p in pngs],
        *([not_drawn, ""] if not_drawn else []),
        "",
      ]
      blocks += [
        html_page.Heading(e.title),
        html_page.Paragraph(e.paper),
        html_page.Paragraph(f"Reproduces {e.reproduces}."),
        *[html_page.Paragraph(r) for r in ran],
        html_page.Table(table, caption="Claims and verdicts"),
        html_page.Paragraph(
          "Each claim's conditions, as the paper has them, against these runs:"
        ),
        html_page.Bullets(
          [line.strip().removeprefix("- ") for line in conditions]
        ),
        html_page.Paragraph("What differs from the paper:"),
        html_page.Bullets(list(e.differs)),
        html_page.Paragraph(f"Runs: {runs}"),
        *[html_page.Figure(p, caption=p.stem) for p in pngs],
        *([html_page.Paragraph(not_drawn)] if not_drawn else []),
      ]
  md = out / "gallery.md"
  records.atomic_write(
    md, lambda tmp: Path(tmp).write_text("\n".join(lines) + "\n")
  )
  page = html_page.write(out / "gallery.html", "curvbench gallery", blocks)
  return [md, page, *written]
