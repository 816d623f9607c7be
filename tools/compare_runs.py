"""Compares two sweeps' records table by table: what a change to the code
must leave as it was.

    python tools/compare_runs.py BEFORE AFTER

BEFORE and AFTER are sweep folders (e.g. `reports/quick` written by
`make run` at two commits). Every run folder of either, and every table in
it (`*.parquet`) and in its report (`report/*.csv`), is compared row by
row, exactly. Left out is what no two runs share: the columns that name
the code or the moment (`run_id`, `commit`, `timestamp`, ...), those read
off a clock or the machine's load (seconds, ratios of seconds, load
averages), the rows that hold such a quantity (a report row whose `cost`
or `quantity` is seconds) or that a clock placed (a training curve's
`time_point_s` rows), and the values of the report's timing tables, whose
rows are still compared. Numbers count as equal to round-off (relative
`ROUNDOFF`): a statistic over seeds adds them in the order of their run
ids, which hash the code, so two commits may sum them in another order.
Exits 1 naming each table that differs, else 0.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np
import pandas as pd

# The code and the moment of a run: different at two commits by design.
IDENTITY = {
  "run_id",
  "code",
  "commit",
  "dirty",
  "timestamp",
  "versions",
  "run",
}
# Read off a clock or the load: seconds, ratios of seconds, load averages.
CLOCK = re.compile(
  r"(?:_s$|seconds|^ratio_|_ratio_to|load_average|cpu_share|^contended$"
  r"|^busy|^steps_per_sample$|^process_cores$)"
)
# Relative difference of two numbers that are the same but for the order
# of a sum: a few units in the last place of a float64.
ROUNDOFF = 1e-12
# The report's tables of timings: every value in them is read off a clock.
TIMED = {"report/timing.csv", "report/step_ratio.csv"}
# The columns of a report table that name the quantity in its row.
QUANTITY = ("cost", "quantity")


def comparable(frame: pd.DataFrame, timed: bool = False) -> pd.DataFrame:
  """`frame` less its identity and clock columns (all its numbers where
  it is `timed`), less the rows a clock placed or that hold a clock's
  reading, in a fixed row order."""
  if "time_point_s" in frame:
    frame = frame[frame["time_point_s"].isna()]
  for column in QUANTITY:
    if column in frame:
      frame = frame[~frame[column].astype(str).str.contains(CLOCK)]
  kept = [
    c
    for c in frame.columns
    if c not in IDENTITY
    and not CLOCK.search(c)
    and not (timed and pd.api.types.is_float_dtype(frame[c]))
  ]
  frame = frame[kept].reset_index(drop=True)
  return frame.sort_values(kept, kind="stable").reset_index(drop=True)


def differences(
  a: pd.DataFrame, b: pd.DataFrame, rounded: list[int]
) -> list[str]:
  """What differs between two comparable tables, one line each; the count
  of numbers equal only to round-off is added to `rounded`."""
  if list(a.columns) != list(b.columns):
    gone = sorted(set(a.columns) - set(b.columns))
    new = sorted(set(b.columns) - set(a.columns))
    return [f"columns differ: only before {gone}, only after {new}"]
  if len(a) != len(b):
    return [f"{len(a)} rows before, {len(b)} after"]
  out = []
  for column in a.columns:
    x, y = a[column], b[column]
    same = (x == y) | (x.isna() & y.isna())
    if pd.api.types.is_float_dtype(x) and pd.api.types.is_float_dtype(y):
      close = np.isclose(x, y, rtol=ROUNDOFF, atol=0.0)
      rounded.append(int((close & ~same).sum()))
      same |= close
    if not same.all():
      first = int(np.flatnonzero(~same.to_numpy())[0])
      out.append(
        f"{column}: {int((~same).sum())} of {len(a)} rows differ "
        f"(first at row {first}: {x.iloc[first]!r} vs {y.iloc[first]!r})"
      )
  return out


def tables(sweep: Path) -> dict[str, Path]:
  """Every table of `sweep` by its path inside it."""
  found = [*sweep.glob("*/*.parquet"), *sweep.glob("report/*.csv")]
  return {str(p.relative_to(sweep)): p for p in sorted(found)}


def read(path: Path) -> pd.DataFrame:
  if path.suffix == ".csv":
    return pd.read_csv(path)
  return pd.read_parquet(path)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("before", type=Path)
  parser.add_argument("after", type=Path)
  args = parser.parse_args(argv)
  before, after = tables(args.before), tables(args.after)
  if not before:
    parser.error(f"{args.before} holds no tables (a sweep folder?)")
  rounded: list[int] = []
  problems = [f"{name}: only before" for name in sorted(before.keys() - after)]
  problems += [f"{name}: only after" for name in sorted(after.keys() - before)]
  for name in sorted(before.keys() & after.keys()):
    a, b = read(before[name]), read(after[name])
    problems += [
      f"{name}: {line}"
      for line in differences(
        comparable(a, name in TIMED), comparable(b, name in TIMED), rounded
      )
    ]
  shared = len(before.keys() & after.keys())
  print(
    f"{shared} tables compared; {len(problems)} differences; "
    f"{sum(rounded)} numbers equal only to round-off (relative {ROUNDOFF:g})"
  )
  print("\n".join(problems))
  return 1 if problems else 0


if __name__ == "__main__":
  sys.exit(main())
