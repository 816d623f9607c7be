"""`curvbench report DIR`: merge a sweep's runs into tables and figures.

The report respects the design of the experiment:

- Runs that differ in any config key are told apart. Within each problem,
  measurement and method, the keys whose values differ between runs (seeds
  aside) form the run's `setting` (e.g. `learning_rate=0.001`), and every
  table and figure groups by method and setting.
- Seeds are aggregated: curves and numbers are medians over the seeds of a
  setting, with the interquartile range and the count of seeds (`n`).
- Each measurement (`curvbench.measurements`) summarises and draws the
  tables it declares; e.g. the training measurement, for a sweep that
  declares `tuning.grid`, picks each optimizer's best setting, draws only
  those curves in the main training figure and the score against each
  tuned hyperparameter in a second one.
- Runs that are not in the results are listed with the reason: skipped,
  failed (`ERROR.json`), diverged, damaged (records that cannot be read or
  are missing: see `records.RunDir.damage`), killed (records but no
  completion marker) or still running. One bad run never stops the report.

Writes under `DIR/report/` (or `--out`): `report.md`, `report.html` (one
self-contained page, sortable tables), one CSV per table, and the
measurements' figures as PNG and PDF.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pandas as pd
from omegaconf import OmegaConf

from curvbench import html_page, plots, provenance, records
from curvbench.measurements import MEASUREMENTS

# Any of these marks a run directory (`.hydra/config.yaml`: Hydra started
# the run, which may have been stopped before writing a record of its own).
RUN_FILES = (records.MARKER, records.OWNED, "ERROR.json", "config.yaml",
             "metadata.json", "*.parquet", ".hydra/config.yaml")
# What `not_in_results` lists, one row per run; skipped runs are grouped.
NOT_IN_RESULTS = ("error", "diverged", "damaged", "killed", "running")
# In a report folder: it is curvbench's (see `records.claim`).
REPORT_MARKER = ".curvbench-report"
# What a run is, before its settings: rows with the same values here and the
# same setting are seeds of one configuration.
GROUP = ("problem", "measure", "method")
# What a run measured with besides its config (`provenance.inputs`): runs
# that differ here are told apart like runs of different settings.
INPUTS = ("code", "data")


@dataclasses.dataclass
class Sweep:
  """A sweep's runs (one row per run directory) and its merged tables."""
  root: Path
  runs: pd.DataFrame
  tables: dict[str, pd.DataFrame]


@dataclasses.dataclass
class Report:
  """What the measurements summarise and draw: the sweep's `root`, its
  `runs`, the complete and diverged ones with their setting and label
  (`done`), the merged tables with those labels, and one colour per
  method for every figure."""
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


def _run_config(run: records.RunDir) -> dict:
  """The run's flattened config from the first of its config records that
  can be read (`{}` when none can)."""
  readers = ((run.path / "config.parquet",
              lambda p: pd.read_parquet(p).iloc[0].to_dict()),
             (run.path / "config.yaml",
              lambda p: provenance.flatten(OmegaConf.load(p))),
             (run.path / ".hydra" / "config.yaml",
              lambda p: provenance.flatten(OmegaConf.load(p))))
  for path, read in readers:
    if path.exists():
      try:
        return dict(read(path))
      except Exception:  # noqa: BLE001 - a damaged record: try the next one
        continue
  return {}


def _json_field(path: Path, key: str):
  """`key` of the JSON object in `path`, None when absent or unreadable."""
  try:
    return json.loads(path.read_text()).get(key)
  except (OSError, ValueError, AttributeError):
    return None


def _status(run: records.RunDir) -> tuple[str, str, dict | None]:
  """The run's status, the reason it is not in the results (or its
  marker's), and its marker (None unless it is intact)."""
  if run.has_marker:
    damage = run.damage()
    if damage:
      return "damaged", f"{damage}; a rerun of the sweep redoes it", None
    marker = run.marker()
    return marker["status"], marker.get("reason", ""), marker
  error = run.path / "ERROR.json"
  if error.exists():
    trace = _json_field(error, "traceback")
    if not isinstance(trace, str):
      return "error", "the run failed; its ERROR.json is unreadable", None
    lines = trace.strip().splitlines()
    return "error", lines[-1] if lines else "see ERROR.json", None
  holder = run.running()
  if holder is not None:
    return "running", (f"no completion marker yet: running in process "
                       f"{holder.get('pid')} on {holder.get('host')} since "
                       f"{holder.get('since')}"), None
  return "killed", ("no completion marker: the run was stopped before it "
                    "finished; a rerun of the sweep redoes it"), None


def _run_dirs(root: Path) -> list[Path]:
  """Every run directory under `root` (see `RUN_FILES`)."""
  found = set()
  for pattern in RUN_FILES:
    for path in root.rglob(pattern):
      parts = path.relative_to(root).parts
      if pattern.startswith(".hydra/"):
        found.add(path.parent.parent)
      elif ".hydra" not in parts:
        found.add(path.parent)
  return sorted(found)


def load_sweep(root) -> Sweep:
  """Every run directory under `root`, and each table concatenated over the
  complete and diverged runs (with `run_id` and `run_dir` columns)."""
  root = Path(root)
  declared = [t for name in MEASUREMENTS for t in MEASUREMENTS.get(name).tables]
  runs, parts = [], {t: [] for t in declared}
  for path in _run_dirs(root):
    run = records.RunDir(path)
    status, reason, marker = _status(run)
    cfg = _run_config(run)
    run_dir = str(path.relative_to(root))
    run_id = cfg.pop("run_id", None) or (marker or {}).get("run_id", run_dir)
    row = dict(run_dir=run_dir, run_id=run_id, status=status, reason=reason,
               # A problem's name in the records: its label, else its kind.
               problem=cfg.get("problem.label") or cfg.get("problem.name"),
               measure=cfg.get("measure.kind"),
               **{key: (marker or {}).get(key) for key in INPUTS}, **{
                   f"config:{k}": v for k, v in cfg.items()})
    run_tables = {}
    if status in ("complete", "diverged"):
      try:
        run_tables = run.tables()
      except records.DamagedRun as e:  # damaged since `damage` looked
        row.update(status="damaged", reason=str(e))
    for name, df in run_tables.items():
      if name in parts:
        df = df.assign(run_dir=run_dir)
        if "run_id" not in df:  # written before run ids
          df["run_id"] = run_id
        parts[name].append(df)
        if "device_kind" in df and len(df):
          row["device_kind"] = df.device_kind.iloc[0]
    row["method"] = _json_field(path / "metadata.json", "method")
    runs.append(row)
  tables = {name: pd.concat(dfs, ignore_index=True)
            for name, dfs in parts.items() if dfs}
  return Sweep(root, pd.DataFrame(runs), tables)


def _short_names(keys: list[str]) -> dict[str, str]:
  """Each dotted key's last part, or more of it where two would collide."""
  names = {}
  for key in keys:
    parts = key.split(".")
    depth = 1
    while depth < len(parts) and sum(
        k.split(".")[-depth:] == parts[-depth:] for k in keys) > 1:
      depth += 1
    names[key] = ".".join(parts[-depth:])
  return names


def _value(v) -> str:
  return f"{v:.4g}" if isinstance(v, float) else str(v)


# Keys of what a run measured rather than of how it trained: a training
# curve recorded along a spectra run is labelled without them.
MEASURED = ("curvature.", "measure.spectra.", "measure.timing.")


def settings(runs: pd.DataFrame) -> pd.DataFrame:
  """`runs` (complete and diverged) with the columns `setting` (the config
  keys that vary within the run's problem, measurement and method, seeds
  aside, as `key=value, ...`), `label` (method and setting) and
  `trained_setting` (the setting less the keys of what was measured)."""
  done = runs[runs.status.isin(["complete", "diverged"])].copy()
  if done.empty:
    return done.assign(setting="", label="", trained_setting="")
  keys = {c: c.removeprefix("config:") for c in done.columns
          if c.startswith("config:")}
  candidates = [c for c, key in keys.items()
                if key.split(".")[0] not in provenance.NOT_IDENTITY
                and key not in provenance.SEED_KEYS]
  candidates += [c for c in ("device_kind", *INPUTS) if c in done]
  done["setting"], done["trained_setting"] = "", ""
  for _, group in done.groupby(list(GROUP), dropna=False):
    varying = [c for c in candidates
               if group[c].astype(str).nunique(dropna=False) > 1]
    keys = [c.removeprefix("config:") for c in varying]
    short = _short_names(keys)
    for index, run in group.iterrows():
      items = [(k, f"{short[k]}={_value(run[c])}")
               for k, c in zip(keys, varying)]
      done.at[index, "setting"] = ", ".join(text for _, text in items)
      done.at[index, "trained_setting"] = ", ".join(
          text for k, text in items if not k.startswith(MEASURED))
  done["label"] = [f"{m} ({s})" if s else str(m)
                   for m, s in zip(done.method, done.setting)]
  return done


def mixed_inputs(done: pd.DataFrame) -> list[str]:
  """Notes naming the code or data versions a report mixes (their runs
  carry `code=` or `data=` in their setting)."""
  notes = []
  for key, what in (("code", "code versions"), ("data", "datasets")):
    versions = sorted(done[key].dropna().astype(str).unique()) if (
        key in done) else []
    if len(versions) > 1:
      notes.append(f"These runs come from {len(versions)} {what} "
                   f"({', '.join(versions)}); runs that differ in them are "
                   f"kept apart ({key}= in their setting), never taken for "
                   "seeds of one another.")
  return notes


def with_labels(df: pd.DataFrame, done: pd.DataFrame) -> pd.DataFrame:
  """`df` with each row's setting and label: its run's, or where the row
  records another method than its run (the optimizer's curve along a
  spectra run), that method with the run's trained setting."""
  labels = done[["run_id", "method", "setting", "label",
                 "trained_setting"]].drop_duplicates("run_id").rename(
                     columns={"method": "run_method"})
  out = df.drop(columns=["setting", "label"], errors="ignore").merge(
      labels, on="run_id", how="left")
  if "method" in out:
    other = out.method.notna() & (out.method != out.run_method)
    out.loc[other, "setting"] = out.trained_setting[other]
    out.loc[other, "label"] = [f"{m} ({s})" if s else str(m) for m, s in
                               zip(out.method[other], out.setting[other])]
  return out.drop(columns=["run_method", "trained_setting"])


def not_in_results(runs: pd.DataFrame) -> pd.DataFrame:
  """Runs whose records are missing or partial, with the reason; skipped
  runs are counted per reason."""
  shown = runs[runs.status.isin(NOT_IN_RESULTS)]
  rows = [dict(status=r.status, runs=1, run_dir=r.run_dir, reason=r.reason)
          for r in shown.itertuples()]
  skipped = runs[runs.status == "skipped"]
  for reason, group in skipped.groupby("reason"):
    dirs = sorted(group.run_dir)
    rows.append(dict(status="skipped", runs=len(dirs),
                     run_dir=", ".join(dirs[:3]) + (", ..." if len(dirs) > 3
                                                    else ""),
                     reason=reason))
  return pd.DataFrame(rows, columns=["status", "runs", "run_dir", "reason"])


def to_markdown(df: pd.DataFrame, digits: int = 4) -> str:
  """A GitHub markdown table (no extra dependency)."""
  def cell(v):
    if isinstance(v, float):
      return "" if pd.isna(v) else f"{v:.{digits}g}"
    return "" if v is None else str(v).replace("|", "\\|")
  head = "| " + " | ".join(map(str, df.columns)) + " |"
  rule = "|" + "|".join("---" for _ in df.columns) + "|"
  rows = ["| " + " | ".join(cell(v) for v in row) + " |"
          for row in df.itertuples(index=False)]
  return "\n".join([head, rule, *rows])


TITLES = dict(run_counts="Runs", not_in_results="Runs not in the results")


def write(root, out=None) -> dict:
  """Writes the merged tables, summaries, figures, `report.md` and
  `report.html`; returns their paths (`tables`, `figures`) and how many
  runs of each status in `NOT_IN_RESULTS` there are (`not_in_results`)."""
  root = Path(root)
  out = Path(out) if out else root / "report"
  if not root.is_dir():
    raise FileNotFoundError(f"No sweep directory at {root}: give the folder "
                            "of a sweep (e.g. reports/quick).")
  sweep = load_sweep(root)
  if sweep.runs.empty:
    raise FileNotFoundError(f"No runs under {root}: run a sweep first "
                            "(curvbench -m +experiment=quick).")
  done = settings(sweep.runs)
  tables = {name: with_labels(df, done) for name, df in sweep.tables.items()}
  records.claim(out, REPORT_MARKER, "a report folder (give another with "
                "--out)", legacy=lambda folder: (folder / "report.md").exists())
  counts = sweep.runs.status.value_counts()
  written = {"tables": [], "figures": [], "not_in_results": {
      status: int(n) for status, n in counts.items()
      if status in NOT_IN_RESULTS}}

  def save_csv(name, df):
    path = out / f"{name}.csv"
    records.atomic_write(path, lambda tmp: df.to_csv(tmp, index=False))
    written["tables"].append(path)

  for name, df in tables.items():
    save_csv(f"{name}_all", df)
  save_csv("runs", sweep.runs)

  methods = {m for df in tables.values() if "method" in df
             for m in df.method.dropna()}
  report = Report(root, sweep.runs, done, tables, plots.palette(methods))
  sections = [("run_counts", TITLES["run_counts"],
               _runs_summary(sweep.runs))]
  missing = not_in_results(sweep.runs)
  if not missing.empty:
    sections.append(("not_in_results", TITLES["not_in_results"], missing))
  notes, figures = mixed_inputs(done), []
  measured = [MEASUREMENTS.get(name)() for name in MEASUREMENTS]
  with plots.style():
    for measurement in measured:
      sections += measurement.summaries(report)
      notes += measurement.notes(report)
      figures += measurement.figures(report, out / "figures")
  for name, _, df in sections:
    save_csv(name, df)
  written["figures"] = figures
  pngs = [p for p in figures if p.suffix == ".png"]
  written["tables"] += _write_pages(root, out, sections, notes, pngs,
                                    _provenance_line(tables))
  return written


def _runs_summary(runs: pd.DataFrame) -> pd.DataFrame:
  counts = runs.groupby("status").run_dir.count()
  return counts.rename("runs").reset_index()


def _provenance_line(tables) -> str:
  """The devices and code versions the records come from."""
  found = {"device_kind": set(), "commit": set()}
  for df in tables.values():
    for column, values in found.items():
      if column in df:
        values.update(str(v) for v in df[column].dropna().unique())
    if "dirty" in df and df.dirty.fillna(False).astype(bool).any():
      found["commit"].add("uncommitted changes")
  return (f"Devices: {', '.join(sorted(found['device_kind'])) or 'unknown'}."
          f" Code: {', '.join(sorted(found['commit'])) or 'unknown'}.")


def _write_pages(root, out, sections, notes, pngs, header) -> list[Path]:
  lines = [f"# curvbench report: {root}", "", header, ""]
  blocks = [html_page.Paragraph(header)]
  for _, heading, df in sections:
    lines += [f"## {heading}", "", to_markdown(df), ""]
    blocks += [html_page.Heading(heading), html_page.Table(df)]
  if notes:
    lines += ["## Notes", "", *[f"- {n}" for n in notes], ""]
    blocks += [html_page.Heading("Notes"), html_page.Bullets(notes)]
  lines += ["## Figures", ""] + [f"![{p.stem}](figures/{p.name})"
                                 for p in pngs]
  blocks += [html_page.Heading("Figures")] + [
      html_page.Figure(p, caption=p.stem) for p in pngs]
  md = out / "report.md"
  records.atomic_write(md, lambda tmp: Path(tmp).write_text(
      "\n".join(lines) + "\n"))
  page = html_page.write(out / "report.html", f"curvbench report: {root}",
                         blocks)
  return [md, page]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      prog="curvbench report",
      description="Merge a sweep's runs into tables and figures.")
  parser.add_argument("dir", help="a sweep directory, e.g. reports/quick")
  parser.add_argument("--out", help="output directory (default DIR/report)")
  args = parser.parse_args(argv)
  try:
    written = write(args.dir, args.out)
  except (FileNotFoundError, records.ForeignFolder) as e:
    raise SystemExit(f"curvbench report: {e}") from None
  except OSError as e:  # a read-only or full disk
    raise SystemExit(f"curvbench report: cannot write the report to "
                     f"{args.out or Path(args.dir) / 'report'} ({e}); give "
                     "another folder with --out.") from None
  out = Path(args.out or Path(args.dir) / "report")
  print(f"[curvbench] wrote {len(written['tables'])} tables and "
        f"{len(written['figures'])} figures under {out}")
  missing = written["not_in_results"]
  if missing:
    print("[curvbench] not in the results: " + ", ".join(
        f"{n} {status}" for status, n in missing.items())
          + f" (see '{TITLES['not_in_results']}' in {out / 'report.md'})")
  return 0
