"""The accelerator window: everything accelerator-related, in priority
order, within one lent device's time (`python -m curvbench.bench window`,
`make accelerator-window`).

`plan()` lists the parts, most wanted first, each with its command, the
seconds it is expected to take and where that figure comes from: a
performance record (`benchmarks/record/`) where the part has run on an
accelerator, else an estimate or a cap it runs under, said as such.
`admit` walks the plan against a budget (600 s by default): a part whose
expected seconds no longer fit is left out, saying why, and the next is
tried. `run` does the same against the clock, each part a subprocess with
a hard timeout that keeps the whole within the budget; each part's log
and outputs land in its own folder as it runs, and `summary.md` /
`summary.json` are rewritten after every part, so a window cut short
keeps a summary of what finished. `ACCELERATOR_WINDOW_DRY=1` prints the
plan and runs nothing (on any machine).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from curvbench.bench import record

BUDGET_S = 600.0  # ten minutes of a 15-minute loan; the rest starts it
DRY_ENV = "ACCELERATOR_WINDOW_DRY"
# A part measured before may overrun its record by this share (it comes
# before the parts whose time it takes).
MARGIN = 1.25
# What the accelerator check takes (JAX's start in a subprocess) before a
# part can run: the plan keeps it free.
STARTUP_S = 15.0
# A part starts where its expected seconds pass what is left by no more
# than this (what starting and stopping the parts before took); its
# timeout still ends with the window.
SLACK_S = 2.0
GRACE_S = 5.0  # between asking a timed-out part to stop and killing it
ACCELERATORS = ("gpu", "tpu")
SCALING_CPU = record.ROOT / "benchmarks" / "scaling" / "cpu-2-cores"
# The CPU benchmark's wall seconds when it timed K-FAC in one estimation
# mode (benchmarks/record/cpu-2-cores.json at 1879a61, the last such run):
# what an accelerator record made then is scaled against.
ONE_MODE_CPU_WALL_S = 202.9


@dataclasses.dataclass(frozen=True)
class Part:
  """One part of the window: `args` to python (`{out}` stands for the
  part's output folder), the seconds it is expected to take and `source`,
  where that figure comes from. `measured`: the figure is a record (the
  part may overrun it by `MARGIN`); `partial`: cut short, the part keeps
  what finished (a sweep's finished runs); `exits`: what an exit status
  other than 0 means, where it is not a failure."""

  name: str
  title: str
  args: tuple[str, ...]
  expected_s: float
  source: str
  measured: bool = False
  partial: bool = False
  exits: Mapping[int, str] = dataclasses.field(default_factory=dict)

  def command(self, out: str) -> str:
    """The shell command that runs this part, its outputs under `out`."""
    return shlex.join(["python", *(a.replace("{out}", out) for a in self.args)])


def _accelerator_record(folder: Path, key: str | None) -> dict | None:
  """This device kind's record, else the first of another accelerator's."""
  found = [
    r for r in record.records(folder) if r.get("platform") in ACCELERATORS
  ]
  own = [r for r in found if r["key"] == key]
  return (own or found)[0] if found else None


def _cpu_record(folder: Path) -> dict | None:
  found = [r for r in record.records(folder) if r.get("platform") == "cpu"]
  return found[0] if found else None


def _one_mode_wall(rec: dict) -> float:
  """A record's wall seconds as if it had timed K-FAC in one estimation
  mode, as records before `estimation_mode` did (the full run now times
  two: a CPU record's own wall says by how much)."""
  if "estimation_mode" not in rec or rec.get("platform") != "cpu":
    return rec["wall_s"]
  return ONE_MODE_CPU_WALL_S


def _bench(folder: Path, key: str | None) -> tuple[float, str, bool]:
  rec = _accelerator_record(folder, key)
  if rec is None:
    return (
      300.0,
      "cap: no accelerator record in benchmarks/record/ - half the window",
      False,
    )
  other = "" if key in (None, rec["key"]) else f"; no record of {key}"
  source = (
    f"record: benchmarks/record/{rec['key']}.json wall_s {rec['wall_s']} s "
    f"({rec['device_kind']}, {rec['date'][:10]}){other}"
  )
  cpu = _cpu_record(folder)
  if "estimation_mode" in rec or cpu is None or "estimation_mode" not in cpu:
    return float(math.ceil(rec["wall_s"])), source, True
  # That record timed K-FAC in one mode, today's run times two (and the
  # timing measurement does more since: the CPU run says how much).
  factor = cpu["wall_s"] / ONE_MODE_CPU_WALL_S
  return (
    float(math.ceil(rec["wall_s"] * factor)),
    f"{source}, made when the benchmark timed K-FAC in one estimation "
    f"mode, x {factor:.2f}: the CPU benchmark's growth since (its record's "
    f"{cpu['wall_s']} s in two modes over {ONE_MODE_CPU_WALL_S} s in one)",
    True,
  )


def _scaling(folder: Path, key: str | None) -> tuple[float, str, bool]:
  """The scaling run's seconds: its record's where it has one; else the
  CPU run's compile seconds scaled by the benchmark's accelerator / CPU
  wall ratio (compiling, not computing, dominates on an accelerator)."""
  rec = _accelerator_record(folder, key)
  if rec is not None and "wall_s" in rec.get("scaling", {}):
    wall = rec["scaling"]["wall_s"]
    return (
      float(math.ceil(wall)),
      f"record: benchmarks/record/{rec['key']}.json scaling.wall_s {wall} s",
      True,
    )
  cpu = _cpu_record(folder)
  rows = SCALING_CPU / "scaling.csv"
  if rec is None or cpu is None or not rows.exists():
    return 600.0, "cap: no record to estimate from - the whole window", False
  with open(rows) as f:
    compile_s = sum(float(r["compile_s"]) for r in csv.DictReader(f))
  cpu_wall = cpu["wall_s"] if "estimation_mode" in rec else _one_mode_wall(cpu)
  ratio = rec["wall_s"] / cpu_wall
  return (
    float(math.ceil(compile_s * ratio)),
    f"estimate (no accelerator run): the CPU run's compile seconds, "
    f"{compile_s:.0f} s at its sizes ({rows.relative_to(record.ROOT)}), x "
    f"{ratio:.2f}, the benchmark's {rec['key']} / {cpu['key']} wall ratio "
    f"({rec['wall_s']} / {cpu_wall} s, both timing K-FAC in as many "
    "modes); cut short it keeps only its log (it writes its report at the "
    "end)",
    False,
  )


def plan(
  platform: str = "gpu",
  key: str | None = None,
  records: Path = record.RECORD_DIR,
) -> list[Part]:
  """The window's parts, most wanted first, for a device of `platform`
  whose record would be `records/<key>.json`."""
  sweep = lambda *overrides: (
    "-m",
    "curvbench",
    "-m",
    "hydra.sweep.dir={out}",
    "progress=false",
    "continue_on_error=true",
    f"device={platform}",
    *overrides,
  )
  capped = (
    "cap (never run on an accelerator): {sized}; runs for at most this "
    "long and keeps the runs that finished"
  )
  bench_s, bench_from, bench_measured = _bench(records, key)
  whole = BUDGET_S - STARTUP_S
  if bench_s > whole:
    # First in priority, it starts whatever its estimate: the window is
    # its, and its timing sweep keeps each run that finishes.
    bench_from += (
      f"; {bench_s:.0f} s is more than the window: it gets the whole "
      "window, and cut short keeps the timing runs that finished "
      "(output/runs/timing) but writes no record"
    )
    bench_s = whole
  scaling_s, scaling_from, scaling_measured = _scaling(records, key)
  return [
    Part(
      "bench_of_record",
      "the benchmark of record, compared with its record",
      ("-m", "curvbench.bench", "run", "--compare", "--out", "{out}"),
      bench_s,
      bench_from,
      measured=bench_measured,
      partial=bench_s == whole,
      exits={1: "a figure more than 25 % worse than the record (see log)"},
    ),
    Part(
      "scaling",
      "cost against model size at the accelerator's sizes",
      ("-m", "curvbench.bench", "scaling", "--out", "{out}"),
      scaling_s,
      scaling_from,
      measured=scaling_measured,
    ),
    Part(
      "paper_scale",
      "ResNet-18 and gpt 10M: spectra, timing, training",
      sweep("+experiment=paper_scale"),
      110.0,
      capped.format(
        sized="the preset is sized by arithmetic for 600 s on one H100 "
        "(conf/experiment/paper_scale.yaml)"
      ),
      partial=True,
    ),
    Part(
      "gallery_accelerator",
      "every gallery entry at its accelerator size",
      sweep("+experiment=gallery_accelerator"),
      110.0,
      capped.format(
        sized="each entry is sized by arithmetic for 60 s "
        "(curvbench/gallery/), in alphabetical order"
      ),
      partial=True,
    ),
    Part(
      "kfac_paper_window",
      "the K-FAC paper's window variant: the gallery's Martens & Grosse "
      "entry at its accelerator size (the paper's CURVES autoencoder, "
      "K-FAC against tuned SGD-Nesterov and Adam, 2 s runs, 4 seeds)",
      sweep("+experiment=repro_martens2015_kfac_accelerator"),
      60.0,
      capped.format(
        sized="sized by arithmetic for one minute of a 10-minute window "
        "(curvbench/gallery/martens2015_kfac.py)"
      ),
      partial=True,
    ),
  ]


def select(parts: list[Part], names: Iterable[str] | None) -> list[Part]:
  """The parts named (all where `names` is None), in the plan's order."""
  if names is None:
    return parts
  wanted = set(names)
  unknown = sorted(wanted - {p.name for p in parts})
  if unknown:
    raise ValueError(
      f"no window part {', '.join(unknown)}; choose from "
      f"{', '.join(p.name for p in parts)}."
    )
  return [p for p in parts if p.name in wanted]


def admit(parts: list[Part], budget_s: float) -> list[tuple[Part, str | None]]:
  """Each part with why it is left out (None where it fits): in order, a
  part is admitted where its expected seconds fit in what is left of
  `budget_s` after `STARTUP_S`."""
  return _fits(parts, budget_s - STARTUP_S, 0.0)


def _fits(
  parts: list[Part], seconds: float, slack: float = SLACK_S
) -> list[tuple[Part, str | None]]:
  left, out = seconds, list[tuple[Part, str | None]]()
  for part in parts:
    if part.expected_s > left + slack:
      out.append((part, _no_room(part, left)))
    else:
      left -= part.expected_s
      out.append((part, None))
  return out


def _no_room(part: Part, left: float) -> str:
  return f"needs {part.expected_s:.0f} s, {max(left, 0):.0f} s left"


def folder_name(index: int, part: Part) -> str:
  """The folder of the `index`-th part (from 0) in the window's output:
  `01_<name>`, numbered from 1 in the order the parts ran."""
  return f"{index + 1:02d}_{part.name}"


def dry_run(parts: list[Part], budget_s: float) -> str:
  """The plan in words: each part, its command, expected seconds and their
  source, and the total against `budget_s`."""
  lines = [
    f"Accelerator window plan (dry run, nothing runs): budget {budget_s:.0f} "
    "s, parts in priority order",
    "",
  ]
  admitted = admit(parts, budget_s)
  for i, (part, why) in enumerate(admitted):
    out = f"<window>/{folder_name(i, part)}/output"
    lines += [
      f"{i + 1}. {part.name}: {part.title}",
      f"   expected {part.expected_s:.0f} s - {part.source}",
      f"   $ {part.command(out)}",
      f"   {'LEFT OUT: ' + why if why else 'planned'}",
      "",
    ]
  used = sum(p.expected_s for p, why in admitted if why is None)
  left_out = [f"{p.name} ({why})" for p, why in admitted if why]
  lines.append(
    f"planned: {STARTUP_S:.0f} s for the accelerator check + {used:.0f} s "
    f"of parts = {STARTUP_S + used:.0f} s of {budget_s:.0f} s"
    + (f"; left out: {'; '.join(left_out)}" if left_out else "")
  )
  lines.append(
    "(the runner decides again against the clock: a part that ends early "
    "leaves its time to the next)"
  )
  return "\n".join(lines)


# --- the run -------------------------------------------------------------------


def probe() -> dict:
  """What JAX sees, asked in a subprocess (this process must not hold the
  device while the parts run): `platform`, `device_kind`, `count`."""
  script = (
    "import json, jax; d = jax.devices(); print(json.dumps(dict("
    "platform=d[0].platform, device_kind=d[0].device_kind, count=len(d))))"
  )
  try:
    found = subprocess.run(
      [sys.executable, "-c", script],
      capture_output=True,
      text=True,
      timeout=120,
      cwd=record.ROOT,
    )
  except subprocess.TimeoutExpired:
    return dict(platform="none", error="JAX took over 120 s to start")
  if found.returncode != 0:
    last = (found.stderr.strip().splitlines() or ["no output"])[-1]
    return dict(platform="none", error=f"JAX failed to start: {last}")
  return json.loads(found.stdout.strip().splitlines()[-1])


def refuse_without_accelerator(device: dict) -> None:
  """Raises a ValueError, saying how to install the CUDA build of jax
  and how to see the plan without one, unless `device` (what `probe`
  found) is a GPU or TPU."""
  if device.get("platform") not in ACCELERATORS:
    seen = device.get("error") or f"JAX sees only {device.get('platform')}"
    raise ValueError(
      f"no accelerator: {seen}. The window measures a GPU or TPU; on an "
      "NVIDIA machine install the CUDA build of jax (`make cuda`, which "
      "`make accelerator-window` runs where nvidia-smi sees a GPU) and check "
      "`python -c 'import jax; print(jax.devices())'`. To see the plan "
      f"without one: {DRY_ENV}=1."
    )


def _run_part(part: Part, folder: Path, timeout_s: float) -> dict:
  """Runs `part` into `folder` (its log `log.txt`, its outputs `output/`)
  for at most `timeout_s`; its row of the summary."""
  folder.mkdir(parents=True)
  out = str(folder / "output")
  argv = [sys.executable, *(a.replace("{out}", out) for a in part.args)]
  start = time.perf_counter()
  with open(folder / "log.txt", "w") as log:
    log.write(part.command(out) + "\n")
    log.flush()
    proc = subprocess.Popen(
      argv,
      cwd=record.ROOT,
      stdout=log,
      stderr=subprocess.STDOUT,
      start_new_session=True,  # its own group: a timeout ends its children too
    )
    code = _wait(proc, timeout_s)
  wall = round(time.perf_counter() - start, 1)
  if code is None:
    status = "timed out"
    note = f"stopped at its timeout, {timeout_s:.0f} s" + (
      "; its finished runs are kept" if part.partial else ""
    )
  elif code == 0:
    status, note = "done", ""
  else:
    status = f"exit {code}"
    note = part.exits.get(code, "failed: see log.txt")
  return dict(status=status, wall_s=wall, returncode=code, note=note)


def _wait(proc: subprocess.Popen, timeout_s: float) -> int | None:
  """The exit status, or None where `proc` (and its group) had to be
  stopped at `timeout_s`. Where the window itself is interrupted, the
  part is stopped too (it runs in a session of its own)."""
  grace = min(GRACE_S, timeout_s / 5)
  try:
    return proc.wait(timeout=timeout_s - grace)
  except subprocess.TimeoutExpired:
    pass
  except BaseException:
    _stop(proc, GRACE_S)
    raise
  _stop(proc, grace)
  return None


def _stop(proc: subprocess.Popen, grace: float) -> None:
  """Asks `proc`'s group to stop, then kills it after `grace` seconds."""
  for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, None)):
    try:
      os.killpg(proc.pid, sig)
    except ProcessLookupError:
      return
    try:
      proc.wait(timeout=wait)
      return
    except subprocess.TimeoutExpired:
      continue


def _terminated(signum, frame):
  raise SystemExit(128 + signum)


def _timeout(part: Part, left: float, later: list[Part]) -> float:
  """A part's hard timeout: its expected seconds (a record's with
  `MARGIN`), or more where the parts before left time that the later
  parts that still fit do not need; never past the window's end."""
  own = part.expected_s * (MARGIN if part.measured else 1.0)
  reserve = sum(p.expected_s for p, why in _fits(later, left - own) if not why)
  return min(left, max(own, left - reserve))


def run(
  out: Path,
  budget_s: float = BUDGET_S,
  parts: list[Part] | None = None,
  names: Iterable[str] | None = None,
  device: Callable[[], dict] = probe,
  say: Callable[[str], None] = print,
) -> dict:
  """Runs the window into the new folder `out`: `parts` (default: `plan()`
  for the device found), those of `names` only where given; returns the
  summary (`summary.json`'s content).

  Raises:
    ValueError: where `out` holds files or JAX sees no accelerator.
  """
  start = time.perf_counter()
  out = Path(out).resolve()
  if out.exists() and any(out.iterdir()):
    raise ValueError(
      f"{out} holds files already: give a new or empty folder (--out); the "
      "window never writes over others' files."
    )
  found = device()
  refuse_without_accelerator(found)
  if parts is None:
    parts = plan(
      found["platform"],
      record.device_key(found["device_kind"], found["platform"], 0),
    )
  parts = select(parts, names)
  rows: list[dict[str, Any]] = [
    dict(
      name=p.name,
      title=p.title,
      folder=folder_name(i, p),
      command=p.command(str(out / folder_name(i, p) / "output")),
      expected_s=p.expected_s,
      source=p.source,
      status="pending",
      wall_s=None,
      timeout_s=None,
      note="",
    )
    for i, p in enumerate(parts)
  ]
  summary = dict(
    out=str(out),
    budget_s=budget_s,
    device=found,
    started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    finished=False,
    wall_s=None,
    parts=rows,
  )
  out.mkdir(parents=True, exist_ok=True)
  # A window stopped from outside (SIGTERM) stops its running part too.
  main = threading.current_thread() is threading.main_thread()
  before = signal.signal(signal.SIGTERM, _terminated) if main else None
  try:
    _parts(out, summary, parts, budget_s, start, say)
  finally:
    if main:
      signal.signal(signal.SIGTERM, before)
  summary.update(finished=True, wall_s=round(time.perf_counter() - start, 1))
  write_summary(out, summary)
  say(f"window summary: {out / 'summary.md'}")
  return summary


def _parts(out, summary, parts, budget_s, start, say) -> None:
  """Runs `parts` in order against the clock, each row of `summary`
  updated and the summary rewritten as each starts and ends."""
  rows = summary["parts"]
  for i, (part, row) in enumerate(zip(parts, rows)):
    left = budget_s - (time.perf_counter() - start)
    if part.expected_s > left + SLACK_S:
      row.update(status="left out", note=_no_room(part, left))
      say(f"{part.name}: left out, {row['note']}")
      continue
    timeout = round(_timeout(part, left, parts[i + 1 :]), 1)
    row.update(status="running", timeout_s=timeout)
    write_summary(out, summary)
    say(f"{part.name}: {row['command']} (at most {timeout} s)")
    folder = out / row["folder"]
    row.update(_run_part(part, folder, timeout))
    (folder / "part.json").write_text(json.dumps(row, indent=2) + "\n")
    say(f"{part.name}: {row['status']} in {row['wall_s']} s {row['note']}")
    write_summary(out, summary)


def write_summary(out: Path, summary: dict[str, Any]) -> None:
  """`summary.json` and `summary.md` of the window so far."""
  (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
  device = summary["device"]
  state = (
    f"finished in {summary['wall_s']} s"
    if summary["finished"]
    else "in progress (or cut short: the parts below marked running or "
    "pending did not finish)"
  )
  lines = [
    f"# Accelerator window: {Path(summary['out']).name}",
    "",
    f"- device: {device.get('count')} x {device.get('device_kind')} "
    f"({device.get('platform')}); budget {summary['budget_s']:.0f} s; "
    f"started {summary['started']}; {state}",
    "- each part's folder: `log.txt` (its output), `part.json` (its row "
    "below) and `output/` (what its command wrote); a sweep's runs are "
    "reported with `curvbench report <folder>/output`",
    "",
    "| # | part | status | wall s | expected s | timeout s | folder | note |",
    "|---|---|---|---|---|---|---|---|",
  ]
  for i, r in enumerate(summary["parts"]):
    lines.append(
      f"| {i + 1} | {r['name']} | {r['status']} | "
      f"{'' if r['wall_s'] is None else r['wall_s']} | "
      f"{r['expected_s']:.0f} | "
      f"{'' if r['timeout_s'] is None else r['timeout_s']} | "
      f"`{r['folder']}` | {r['note']} |"
    )
  lines += ["", "## Commands and where each expected figure comes from", ""]
  for r in summary["parts"]:
    lines += [f"- {r['name']}: `{r['command']}`", f"  - {r['source']}"]
  (out / "summary.md").write_text("\n".join(lines) + "\n")


__all__ = [
  "BUDGET_S",
  "DRY_ENV",
  "Part",
  "admit",
  "dry_run",
  "plan",
  "probe",
  "refuse_without_accelerator",
  "run",
  "select",
  "write_summary",
]
