"""`python -m curvbench.bench window` (`make accelerator-window`): the plan
and its dry run on a CPU, the refusal without an accelerator, and the
runner on tiny stand-in parts (no GPU needed)."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from curvbench.bench import cli, record, window

GPU = lambda: dict(platform="gpu", device_kind="Fake GPU", count=1)


def part(name, code, expected_s=5.0, **kw):
  """A stand-in part: python -c `code`, with the part's output folder as
  sys.argv[1]."""
  return window.Part(
    name, name, ("-c", code, "{out}"), expected_s, "test", **kw
  )


WRITES = (
  "import pathlib, sys; p = pathlib.Path(sys.argv[1]); p.mkdir(); "
  "(p / 'result.txt').write_text('{}')"
)


def summary(out):
  return json.loads((out / "summary.json").read_text())


def test_the_dry_run_prints_every_part_and_runs_nothing(
  monkeypatch, capsys, tmp_path
):
  monkeypatch.setenv(window.DRY_ENV, "1")
  monkeypatch.chdir(tmp_path)
  assert cli.main(["window"]) == 0
  text = capsys.readouterr().out
  for p in window.plan():
    assert f". {p.name}: " in text
    assert f"expected {p.expected_s:.0f} s - {p.source}" in text
    assert all(a in text for a in p.args if "{out}" not in a)
  assert "planned: 15 s for the accelerator check" in text
  assert "of 600 s" in text
  assert list(tmp_path.iterdir()) == []


def test_the_plan_fits_the_budget_and_says_where_each_figure_is_from():
  parts = window.plan()
  names = [p.name for p in parts]
  assert names == [
    "bench_of_record",
    "scaling",
    "paper_scale",
    "gallery_accelerator",
    "kfac_paper_window",
  ]
  admitted = window.admit(parts, window.BUDGET_S)
  used = sum(p.expected_s for p, why in admitted if why is None)
  assert window.STARTUP_S + used <= window.BUDGET_S
  assert admitted[0][1] is None  # the benchmark of record always runs
  bench = parts[0]
  assert bench.measured and bench.source.startswith("record: ")
  # The accelerator record's own wall seconds, scaled where it timed K-FAC
  # in one estimation mode and the CPU record says what two cost.
  [gpu] = [r for r in record.records() if r["platform"] == "gpu"]
  [cpu] = [r for r in record.records() if r["platform"] == "cpu"]
  factor = 1.0
  if "estimation_mode" not in gpu and "estimation_mode" in cpu:
    factor = cpu["wall_s"] / window.ONE_MODE_CPU_WALL_S
  estimate = math.ceil(gpu["wall_s"] * factor)
  whole = window.BUDGET_S - window.STARTUP_S
  # More than the window, it still starts first and gets all of it.
  assert bench.expected_s == min(estimate, whole)
  assert bench.partial == (estimate > whole)
  assert f"wall_s {gpu['wall_s']} s" in bench.source
  for p in parts[1:]:
    assert not p.measured and p.source.startswith(("estimate", "cap"))
  for p, why in admitted:
    assert why is None or why.startswith(f"needs {p.expected_s:.0f} s")


def test_the_real_run_refuses_without_an_accelerator(tmp_path, capsys):
  """This machine's JAX runs on the CPU: refused, nothing written."""
  out = tmp_path / "window"
  with pytest.raises(SystemExit) as e:
    cli.main(["window", "--out", str(out)])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "no accelerator: JAX sees only cpu" in err
  assert "make cuda" in err and window.DRY_ENV in err
  assert not out.exists()


def test_parts_run_in_order_each_saved_as_it_finishes(tmp_path, monkeypatch):
  """Each part's folder and the summary are written as it ends: the second
  part reads the summary to find the first done and itself running; a
  failing part is recorded and the next one runs; one past its timeout is
  stopped, its row saying so; one that no longer fits is left out."""
  monkeypatch.setattr(window, "GRACE_S", 0.5)
  out = tmp_path / "w"
  check = (
    "import json, sys; s = json.load(open(sys.argv[2])); "
    "assert [r['status'] for r in s['parts']] == "
    "['done', 'running', 'pending', 'pending', 'pending', 'pending'], s"
  )
  parts = [
    part("first", WRITES, 1),
    window.Part(
      "reads_summary",
      "",
      ("-c", check, "{out}", str(out / "summary.json")),
      1,
      "",
    ),
    part("fails", "raise SystemExit(3)", 1, exits={4: "not this one"}),
    part("too_long", "import time; time.sleep(60)", 1),
    part("never_fits", WRITES, 1000),
    part("last", WRITES, 1),
  ]
  found = window.run(
    out, budget_s=6, parts=parts, device=GPU, say=lambda s: None
  )
  rows = {r["name"]: r for r in found["parts"]}
  assert [r["status"] for r in found["parts"]] == [
    "done",
    "done",
    "exit 3",
    "timed out",
    "left out",
    "done",
  ]
  assert rows["fails"]["note"] == "failed: see log.txt"
  assert rows["too_long"]["wall_s"] < 6
  assert rows["never_fits"]["note"].startswith("needs 1000 s")
  assert found["finished"] and found["wall_s"] < 10
  assert summary(out) == found
  for i, name in enumerate(rows):
    folder = out / f"{i + 1:02d}_{name}"
    if name == "never_fits":
      assert not folder.exists()
      continue
    assert (
      json.loads((folder / "part.json").read_text())["status"]
      == (rows[name]["status"])
    )
    assert (folder / "log.txt").read_text().startswith("python -c ")
  assert (out / "01_first" / "output" / "result.txt").exists()
  text = (out / "summary.md").read_text()
  assert (
    "| 3 | fails | exit 3 |" in text and "| 5 | never_fits | left out |" in text
  )


def test_a_window_stopped_from_outside_keeps_its_summary_and_stops_its_part(
  tmp_path,
):
  """The summary is on disk before the window ends: a window stopped
  (SIGTERM, as a device's time limit does) while a part runs leaves the
  parts before it recorded and the running part stopped with it."""
  out, pid = tmp_path / "w", tmp_path / "pid"
  sleeper = (
    f"import os, time; open({str(pid)!r}, 'w').write(str(os.getpid())); "
    "time.sleep(120)"
  )
  script = f"""
from curvbench.bench import window
p = lambda n, c: window.Part(n, n, ("-c", c, "{{out}}"), 1, "test")
window.run({str(out)!r}, 300, [p("first", {WRITES!r}), p("sleeps", {sleeper!r}),
           p("after", {WRITES!r})], device=lambda: dict(platform="gpu"))
"""
  proc = subprocess.Popen([sys.executable, "-c", script])
  deadline = time.monotonic() + 60
  while not (pid.exists() and pid.read_text()) and time.monotonic() < deadline:
    time.sleep(0.1)
  proc.send_signal(signal.SIGTERM)
  assert proc.wait(timeout=30) == 128 + signal.SIGTERM
  with pytest.raises(ProcessLookupError):
    os.kill(int(pid.read_text()), 0)
  found = summary(out)
  assert not found["finished"]
  assert [r["status"] for r in found["parts"]] == ["done", "running", "pending"]
  assert "in progress (or cut short" in (out / "summary.md").read_text()


def test_a_folder_of_others_files_is_refused_before_anything(tmp_path):
  (tmp_path / "theirs.txt").write_text("mine")
  asked = []

  def device():
    asked.append(1)
    return GPU()

  with pytest.raises(ValueError, match="holds files already"):
    window.run(tmp_path, parts=[part("a", WRITES)], device=device)
  assert asked == []
  assert [p.name for p in tmp_path.iterdir()] == ["theirs.txt"]


def test_unknown_parts_are_refused_and_selection_keeps_the_order():
  parts = window.plan()
  with pytest.raises(ValueError, match="no window part nope; choose from"):
    window.select(parts, ["nope"])
  chosen = window.select(parts, ["kfac_paper_window", "bench_of_record"])
  assert [p.name for p in chosen] == ["bench_of_record", "kfac_paper_window"]
