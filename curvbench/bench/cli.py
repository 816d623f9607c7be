"""The command line of `python -m curvbench.bench`: `run` (the benchmark
and its report), `compare` (a report against a record), `against` (the
side-by-side check), `scaling` (cost against model size), `table` (the
table from the records) and `window` (everything accelerator-related in one
lent device's time)."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from curvbench.bench import against, record, scaling, suite, window
from curvbench.core import environment
from curvbench.core.sections import to_markdown


def _record_path(key: str, folder: Path) -> Path:
  return Path(folder) / f"{key}.json"


def _compare(today: dict, path: Path, tolerance: float) -> int:
  """Prints today's figures against the record at `path`; 1 when a figure
  is worse by more than `tolerance` or missing, else 0."""
  if not path.exists():
    print(
      f"No performance record for this device kind "
      f"({today['device_kind']}, key {today['key']}): {path} does not "
      "exist, so there is nothing to compare with. `python -m "
      "curvbench.bench run --save-record` writes one."
    )
    return 0
  result = record.compare(today, path, tolerance)
  print(result.text())
  return 0 if result.passed else 1


def _run(args) -> int:
  mode = "quick" if args.quick else "full"
  out = args.out or (
    record.ROOT
    / "reports"
    / "bench"
    / time.strftime(f"%Y-%m-%d_%H-%M-%S_{mode}")
  )
  command = shlex.join(["python", "-m", "curvbench.bench", *sys.argv[1:]])
  today = suite.run(Path(out), mode, args.against, command)
  status = 0
  kept = _record_path(today["key"], args.records)
  if args.compare:
    status = _compare(today, kept, args.tolerance)
  if args.save_record:
    lost = (
      record.compare(today, kept, args.tolerance).missing
      if kept.exists()
      else []
    )
    if lost:  # a sweep that failed must not wipe the figures it would make
      print(
        f"record NOT written: today's run lacks {len(lost)} figures that "
        f"{kept} holds (e.g. {lost[0][0]} [{lost[0][1]}]); see "
        f"{Path(out) / 'summary.md'} for what failed, and rerun. To drop "
        "figures on purpose, remove them from the record first."
      )
      return 1
    path = record.save(today, args.records)
    print(f"record written: {path}")
    if Path(args.records).resolve() == record.RECORD_DIR:
      _table(check=False)
  return status


def _compare_command(args) -> int:
  path = Path(args.report)
  today = record.load(path / "record.json" if path.is_dir() else path)
  return _compare(
    today,
    Path(args.record)
    if args.record
    else _record_path(today["key"], record.RECORD_DIR),
    args.tolerance,
  )


def _against(args) -> int:
  table = against.compare(
    args.ref,
    "quick" if args.quick else "full",
    args.rounds,
    tuple(args.benchmarks.split(",")),
  )
  print(to_markdown(table.drop(columns=["ref_source"])))
  print(f"\n{args.ref} imported from {table.ref_source.iloc[0]}")
  return 0


def _scaling(args) -> int:
  out = args.out or (
    record.ROOT
    / "reports"
    / "bench"
    / time.strftime("%Y-%m-%d_%H-%M-%S_scaling")
  )
  families = tuple(args.families.split(",")) if args.families else None
  table = scaling.write(Path(out), args.scale, args.repeats, families)
  if args.save_record:
    env = environment.environment()
    code = env.get("code", {})
    key = record.device_key(
      env.get("device_kind", "unknown"),
      env.get("platform", "unknown"),
      len(os.sched_getaffinity(0)),
    )
    path = record.save_scaling(
      key,
      dict(
        exponents=scaling.by_family(table),
        scale=args.scale or scaling.default_scale(),
        commit=code.get("commit"),
        dirty=code.get("dirty"),
        date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        command=shlex.join(["python", "-m", "curvbench.bench", *sys.argv[1:]]),
      ),
      args.records,
    )
    print(f"scaling exponents written into {path}")
  return 0


def _table(check: bool) -> int:
  text = record.TABLE_PAGE.read_text()
  new = record.page_with_table(text, record.record_table())
  if check:
    if new != text:
      print(
        f"{record.TABLE_PAGE}'s performance table differs from "
        f"{record.RECORD_DIR}: run `python -m curvbench.bench table`."
      )
      return 1
    print(f"{record.TABLE_PAGE}'s performance table matches the records.")
    return 0
  if new != text:
    record.TABLE_PAGE.write_text(new)
    print(f"{record.TABLE_PAGE}: performance table regenerated.")
  return 0


def _window(args) -> int:
  names = args.parts.split(",") if args.parts else None
  parts = window.select(window.plan(), names)  # unknown names refused now
  if args.dry_run or os.environ.get(window.DRY_ENV, "") not in ("", "0"):
    print(window.dry_run(parts, args.budget))
    return 0
  out = args.out or (
    record.ROOT / "reports" / "window" / time.strftime("%Y-%m-%d_%H-%M-%S")
  )
  summary = window.run(Path(out), args.budget, names=names)
  return (
    1 if any(r["status"].startswith("exit") for r in summary["parts"]) else 0
  )


def main(argv=None) -> int:
  """Runs `python -m curvbench.bench` with `argv` (default the process's
  arguments); returns the exit status of the subcommand it ran."""
  parser = argparse.ArgumentParser(
    prog="python -m curvbench.bench", description=__doc__
  )
  sub = parser.add_subparsers(dest="command", required=True)
  tolerance: dict[str, Any] = dict(
    type=float,
    default=record.TOLERANCE,
    help="name figures worse than the record by more than "
    "this fraction (default %(default)s)",
  )

  p = sub.add_parser("run", help="run the benchmark and write its report")
  p.add_argument(
    "--quick",
    action="store_true",
    help="the MLP only, few repeats (the test's mode)",
  )
  p.add_argument(
    "--out",
    type=Path,
    help="a new folder for the report (default reports/bench/<date>_<mode>)",
  )
  p.add_argument(
    "--against",
    metavar="REF",
    help="also time commit REF side by side with the working tree",
  )
  p.add_argument(
    "--compare",
    action="store_true",
    help="compare with this device kind's record (exit 1 when "
    "a figure is worse)",
  )
  p.add_argument(
    "--save-record",
    action="store_true",
    help="write the figures as this device kind's record and "
    "regenerate the README's table",
  )
  p.add_argument(
    "--records",
    type=Path,
    default=record.RECORD_DIR,
    help="the records' folder (default %(default)s)",
  )
  p.add_argument("--tolerance", **tolerance)
  p.set_defaults(fn=_run)

  p = sub.add_parser("compare", help="compare a report with a record")
  p.add_argument("report", help="a report folder or its record.json")
  p.add_argument(
    "--record",
    help="the record file (default: the device "
    "kind's under benchmarks/record/)",
  )
  p.add_argument("--tolerance", **tolerance)
  p.set_defaults(fn=_compare_command)

  p = sub.add_parser(
    "against",
    help="time an earlier commit side by side "
    "with the working tree, in this process",
  )
  p.add_argument("ref", help="a commit, tag or branch, e.g. HEAD~1")
  p.add_argument("--quick", action="store_true", help="tiny sizes")
  p.add_argument("--rounds", type=int, default=15)
  p.add_argument(
    "--benchmarks",
    default=",".join(against.BENCHMARKS),
    help="comma-separated (default: all)",
  )
  p.set_defaults(fn=_against)

  p = sub.add_parser(
    "scaling",
    help="time and memory of the K-FAC step, "
    "a GGN-vector product, Lanczos and a trace at four "
    "sizes of each family; their growth exponents",
  )
  p.add_argument(
    "--scale",
    choices=scaling.SCALES,
    help="the sizes (default: cpu on the CPU, else accelerator)",
  )
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument(
    "--families",
    help="comma-separated (default: all of "
    f"{', '.join(f.name for f in scaling.FAMILIES)})",
  )
  p.add_argument(
    "--out",
    type=Path,
    help="a new folder for the report (default reports/bench/<date>_scaling)",
  )
  p.add_argument(
    "--save-record",
    action="store_true",
    help="write the exponents into this device kind's record",
  )
  p.add_argument(
    "--records",
    type=Path,
    default=record.RECORD_DIR,
    help="the records' folder (default %(default)s)",
  )
  p.set_defaults(fn=_scaling)

  p = sub.add_parser(
    "table",
    help="regenerate the performance table of the docs' performance page "
    "from benchmarks/record/",
  )
  p.add_argument(
    "--check",
    action="store_true",
    help="only check that it matches (exit 1 if not)",
  )
  p.set_defaults(fn=lambda args: _table(args.check))

  p = sub.add_parser(
    "window",
    help="everything accelerator-related in priority order within one "
    "budget (the benchmark of record, its scaling, paper_scale, the "
    f"gallery's accelerator sizes, the K-FAC paper's); {window.DRY_ENV}=1 "
    "or --dry-run prints the plan",
  )
  p.add_argument(
    "--out",
    type=Path,
    help="a new folder for the parts and the summary "
    "(default reports/window/<date>)",
  )
  p.add_argument(
    "--budget",
    type=float,
    default=window.BUDGET_S,
    help="seconds the whole may take (default %(default)s)",
  )
  p.add_argument(
    "--parts",
    help="comma-separated, in the plan's order (default: all)",
  )
  p.add_argument(
    "--dry-run", action="store_true", help="print the plan, run nothing"
  )
  p.set_defaults(fn=_window)

  args = parser.parse_args(argv)
  try:
    return args.fn(args)
  except ValueError as e:
    parser.exit(2, f"error: {e}\n")
