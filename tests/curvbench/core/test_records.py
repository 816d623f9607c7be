"""Run directories: atomic tables and the completion marker."""

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from curvbench.core import records
from tests.conftest import truncate


def test_records_atomic_tables_and_marker(tmp_path):
  run = records.RunDir(tmp_path / "run")
  df = records.tidy([dict(a=1.0), dict(a=2.0)], problem="mlp", seed=0)
  assert list(df.columns) == ["problem", "seed", "a"]
  run.write_table("t", df)
  assert not run.done and records.find_runs(tmp_path) == []
  run.mark_done()
  assert run.done and run.marker()["status"] == "complete"
  pd.testing.assert_frame_equal(run.tables()["t"], df)
  assert [r.path for r in records.find_runs(tmp_path)] == [run.path]
  assert not list(run.path.glob("*.tmp"))


# --- damaged records ---------------------------------------------------------


def finished_run(path) -> records.RunDir:
  """A run directory as `curvbench.app` leaves a finished run."""
  run = records.RunDir(path)
  run.write_table("config", pd.DataFrame([dict(run_id="r1", seed=0)]))
  run.write_json("metadata.json", dict(method="adam"))
  run.write_table(
    "training", records.tidy([dict(step=1, loss=2.0)], run_id="r1")
  )
  run.mark_done(run_id="r1")
  return run


@pytest.mark.parametrize(
  "harm, reason",
  [
    (
      lambda run: truncate(run.path / "training.parquet"),
      "training.parquet is unreadable",
    ),
    (
      lambda run: (run.path / "training.parquet").write_bytes(b""),
      "training.parquet is unreadable",
    ),
    (
      lambda run: truncate(run.path / records.MARKER),
      "DONE.json is unreadable",
    ),
    (
      lambda run: (run.path / records.MARKER).write_text("[]"),
      "not a completion marker",
    ),
    (
      lambda run: (run.path / "training.parquet").unlink(),
      "tables training listed in DONE.json are missing",
    ),
    (
      lambda run: truncate(run.path / "metadata.json"),
      "metadata.json is unreadable",
    ),
  ],
)
def test_damaged_records_are_named_and_not_done(tmp_path, harm, reason):
  run = finished_run(tmp_path / "run")
  assert run.done and run.damage() is None
  assert run.marker()["tables"] == ["config", "training"]
  harm(run)
  assert reason in run.damage()
  assert not run.done and run.has_marker
  assert [r.path for r in records.find_runs(tmp_path)] == [run.path]


def test_reading_damaged_records_names_the_file(tmp_path):
  run = finished_run(tmp_path / "run")
  truncate(run.path / "training.parquet")
  with pytest.raises(records.DamagedRun, match="training.parquet"):
    run.tables()
  truncate(run.path / records.MARKER)
  with pytest.raises(records.DamagedRun, match="DONE.json"):
    run.marker()


def test_markers_written_before_table_lists_still_count(tmp_path):
  run = finished_run(tmp_path / "run")
  marker = run.marker()
  del marker["tables"]
  run.write_json(records.MARKER, marker)
  assert run.done
  truncate(run.path / "training.parquet")
  assert not run.done


# --- file modes --------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_files_get_the_mode_of_the_umask(tmp_path, umask):
  old = os.umask(umask)
  try:
    run = finished_run(tmp_path / "run")
    path = records.atomic_write(
      tmp_path / "plain.txt", lambda tmp: Path(tmp).write_text("x")
    )
  finally:
    os.umask(old)
  expected = 0o666 & ~umask
  for written in [path, *run.path.iterdir()]:
    assert stat.S_IMODE(written.stat().st_mode) == expected, written.name


# --- one process per run directory -------------------------------------------


def test_a_held_lock_refuses_a_second_holder(tmp_path):
  run = records.RunDir(tmp_path / "run")
  with run.lock() as info:
    assert info["pid"] == os.getpid()
    assert run.running()["pid"] == os.getpid()
    with pytest.raises(
      records.RunLocked, match=f"already being run by process {os.getpid()}"
    ):
      with records.RunDir(tmp_path / "run").lock():
        pass
  assert run.running() is None and not (run.path / records.LOCK).exists()
  with run.lock():  # free again
    pass


HOLD = """
import sys, time
from curvbench import records
with records.RunDir(sys.argv[1]).lock():
  print("locked", flush=True)
  time.sleep(float(sys.argv[2]))
"""


def _holder(path, seconds):
  child = subprocess.Popen(
    [sys.executable, "-c", HOLD, str(path), str(seconds)],
    stdout=subprocess.PIPE,
    text=True,
    cwd=Path(records.__file__).parents[1],
  )
  assert child.stdout.readline().strip() == "locked"
  return child


def test_the_lock_holds_across_processes_and_dies_with_its_holder(tmp_path):
  run = records.RunDir(tmp_path / "run")
  child = _holder(run.path, 60)
  try:
    with pytest.raises(records.RunLocked) as refused:
      with run.lock(wait_s=0.2):
        pass
    assert refused.value.holder["pid"] == child.pid
    assert str(child.pid) in str(refused.value)
    assert run.running()["pid"] == child.pid
  finally:
    child.kill()  # SIGKILL: no clean-up; the kernel drops the lock
    child.wait()
  assert (run.path / records.LOCK).exists() and run.running() is None
  with run.lock():
    pass


def test_a_waiting_lock_gets_the_run_when_its_holder_finishes(tmp_path):
  run = records.RunDir(tmp_path / "run")
  child = _holder(run.path, 0.5)
  start = time.monotonic()
  try:
    with run.lock(wait_s=30) as info:
      assert info["pid"] == os.getpid()
      assert time.monotonic() - start > 0.3  # it waited for the holder
    assert child.wait(timeout=30) == 0
  finally:
    child.kill()
    child.wait()
