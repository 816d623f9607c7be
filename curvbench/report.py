"""`curvbench report DIR`: merge a sweep's finished runs into tables and figures.

Writes under `DIR/report/` (or `--out`): `report.md`, one CSV per table and
the figures of `curvbench.plots` as PNG and PDF.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from curvbench import curvatures, plots, records

TABLES = ("spectra", "quality", "statistics", "heatmaps", "cost", "timing",
          "training")


def load_sweep(root) -> dict[str, pd.DataFrame]:
  """Each table concatenated over the completed runs under `root`."""
  parts: dict[str, list[pd.DataFrame]] = {t: [] for t in TABLES}
  for run in records.find_runs(root):
    if run.marker().get("status") != "complete":
      continue
    for name, df in run.tables().items():
      if name in parts:
        parts[name].append(df.assign(run_dir=str(run.path.relative_to(root))))
  tables = {name: pd.concat(dfs, ignore_index=True)
            for name, dfs in parts.items() if dfs}
  for name in ("spectra", "quality"):
    if name in tables:
      for column, value in plots.DEFAULTS.items():
        if column != "block" or name == "quality":
          tables[name][column] = tables[name].get(column, value)
          tables[name][column] = tables[name][column].fillna(value)
  return tables


def summaries(tables: dict[str, pd.DataFrame]) -> dict[str, pd.DataFrame]:
  """Small tables for reading: one row per problem and method."""
  out = {}
  if "quality" in tables:
    q = tables["quality"]
    for name, part in (("quality", q[q.block == "all"]),
                       ("quality_blocks", q[q.block != "all"])):
      if not part.empty:
        out[name] = part.pivot_table(
            index=["problem", "data", "step", "reference", "block_type",
                   "method", "block"], columns="metric", values="value",
            aggfunc="mean", dropna=False).dropna(how="all").reset_index()
  if "statistics" in tables:
    out["statistics"] = tables["statistics"].pivot_table(
        index=["problem", "data", "step", "source", "matrix"],
        columns="statistic", values="value", aggfunc="mean").reset_index()
  if "cost" in tables:
    out["cost"] = tables["cost"].pivot_table(
        index=["problem", "method", "data", "phase"],
        values=["compile_s", "run_s", "program_bytes"],
        aggfunc="mean").reset_index()
  if "timing" in tables:
    t = tables["timing"]
    out["timing"] = t.pivot_table(
        index=["problem", "device_kind", "method"], columns="phase",
        values="ratio_to_grad_step", aggfunc="mean").reset_index()
    out["timing_seconds"] = t.pivot_table(
        index=["problem", "device_kind", "method"], columns="phase",
        values=["median_s", "compile_s"], aggfunc="mean")
    out["timing_seconds"].columns = [f"{p}_{v}" for v, p in
                                     out["timing_seconds"].columns]
    out["timing_seconds"] = out["timing_seconds"].reset_index()
  if "training" in tables:
    t = tables["training"].sort_values("step")
    groups = t.groupby(["problem", "method"], dropna=False)
    out["training"] = groups.agg(
        steps=("step", "max"), wall_s=("wall_s", "max"),
        final_train_loss=("train_loss", "last"),
        best_test_loss=("test_loss", "min")).reset_index()
  return out


def legacy_notes(tables: dict[str, pd.DataFrame]) -> list[str]:
  """Notes on records whose label meant another algorithm when written.

  Before `optimizer=preconditioned_sgd` existed, `optimizer=kfac` with a
  curvature that is not block-diagonal trained with SGD-momentum
  preconditioned by that curvature. Such records keep their label.
  """
  training = tables.get("training")
  if training is None or "estimator" not in training:
    return []
  block_diagonal = [name for name, family in curvatures.FAMILIES.items()
                    if family.is_block_diagonal]
  old = training[(training.optimizer == "kfac")
                 & training.estimator.notna()
                 & ~training.estimator.isin(block_diagonal)]
  if old.empty:
    return []
  methods = ", ".join(sorted(old.method.unique()))
  return [f"Training records {methods} come from runs that named "
          "optimizer=kfac with a whole-matrix curvature, which then meant "
          "SGD-momentum preconditioned by that curvature (now "
          "optimizer=preconditioned_sgd); they kept their labels."]


def to_markdown(df: pd.DataFrame, digits: int = 4) -> str:
  """A GitHub markdown table (no extra dependency)."""
  def cell(v):
    if isinstance(v, float):
      return "" if pd.isna(v) else f"{v:.{digits}g}"
    return "" if v is None else str(v)
  head = "| " + " | ".join(map(str, df.columns)) + " |"
  rule = "|" + "|".join("---" for _ in df.columns) + "|"
  rows = ["| " + " | ".join(cell(v) for v in row) + " |"
          for row in df.itertuples(index=False)]
  return "\n".join([head, rule, *rows])


def write(root, out=None) -> dict[str, list[Path]]:
  """Writes the merged tables, summaries and figures; returns the paths."""
  root = Path(root)
  out = Path(out) if out else root / "report"
  tables = load_sweep(root)
  if not tables:
    raise FileNotFoundError(f"No finished runs with records under {root}: run "
                            "a sweep first (curvbench -m +experiment=quick).")
  out.mkdir(parents=True, exist_ok=True)
  written = {"tables": [], "figures": []}
  for name, df in tables.items():
    path = out / f"{name}_all.csv"
    records.atomic_write(path, lambda tmp, df=df: df.to_csv(tmp, index=False))
    written["tables"].append(path)
  lines = [f"# curvbench report: {root}", ""]
  titles = dict(quality="Approximation quality (vs the exact matrix)",
                quality_blocks="Approximation quality per layer block",
                statistics="Spectrum statistics",
                cost="Cost of each measured phase (mean over steps)",
                timing="Time per phase / time of a gradient step",
                timing_seconds="Seconds per phase (median) and compile time",
                training="Training")
  for name, df in summaries(tables).items():
    path = out / f"{name}.csv"
    records.atomic_write(path, lambda tmp, df=df: df.to_csv(tmp, index=False))
    written["tables"].append(path)
    lines += [f"## {titles[name]}", "", to_markdown(df), ""]
  notes = legacy_notes(tables)
  if notes:
    lines += ["## Notes", "", *[f"- {n}" for n in notes], ""]
  figures = plots.all_figures(tables, out / "figures")
  written["figures"] = figures
  lines += ["## Figures", ""] + [f"![{p.stem}](figures/{p.name})"
                                 for p in figures if p.suffix == ".png"]
  md = out / "report.md"
  records.atomic_write(md, lambda tmp: Path(tmp).write_text(
      "\n".join(lines) + "\n"))
  written["tables"].append(md)
  return written


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      prog="curvbench report",
      description="Merge a sweep's runs into tables and figures.")
  parser.add_argument("dir", help="a sweep directory, e.g. reports/quick")
  parser.add_argument("--out", help="output directory (default DIR/report)")
  args = parser.parse_args(argv)
  written = write(args.dir, args.out)
  print(f"[curvbench] wrote {len(written['tables'])} tables and "
        f"{len(written['figures'])} figures under "
        f"{args.out or Path(args.dir) / 'report'}")
  return 0
