"""Runs and restarts: one process at a time per run directory (the lock),
and a sweep killed at any moment loses no finished run when started again."""

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from curvbench import config, runs
from curvbench.core import records
from tests.conftest import TINY

ADAM = ("measure=training", "optimizer=adam", *TINY)
CURVBENCH = Path(sys.executable).parent / "curvbench"


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
  """A finished tiny training run."""
  path = tmp_path_factory.mktemp("finished") / "run"
  assert runs.run(config.compose(*ADAM), path) == "complete"
  return records.RunDir(path)


def files(run_dir):
  return {p.name: p.read_bytes() for p in run_dir.path.iterdir() if p.is_file()}


def test_a_run_held_by_another_process_is_skipped_by_name(tmp_path, capsys):
  run_dir = records.RunDir(tmp_path / "run")
  with run_dir.lock():  # as another process would hold it
    assert runs.run(config.compose(*ADAM), run_dir.path) == "locked"
  out = capsys.readouterr().out
  assert f"is already being run by process {os.getpid()}" in out
  assert not list(run_dir.path.iterdir())  # nothing written, lock released


def test_a_waiting_run_sees_the_run_its_holder_finished(finished, tmp_path):
  """The holder finishes while the second run waits for the lock; the
  second then finds the run done instead of doing it again."""
  run_dir = records.RunDir(tmp_path / "run")
  shutil.copytree(finished.path, run_dir.path)
  marker = (run_dir.path / records.MARKER).read_bytes()
  (run_dir.path / records.MARKER).unlink()  # not finished yet
  before = files(run_dir)
  held = threading.Event()

  def holder():
    with run_dir.lock():
      held.set()
      time.sleep(0.5)
      (run_dir.path / records.MARKER).write_bytes(marker)  # it finishes

  thread = threading.Thread(target=holder)
  thread.start()
  held.wait()
  try:
    status = runs.run(config.compose(*ADAM, "lock_wait_s=30"), run_dir.path)
  finally:
    thread.join()
  assert status == "cached"
  assert files(run_dir) == dict(before, **{records.MARKER: marker})


def _finished_markers(root: Path) -> dict:
  return {p.parent.name: p.read_bytes() for p in root.glob("*/DONE.json")}


def _start_sweep(root: Path, cache: Path):
  return subprocess.Popen(
    [
      str(CURVBENCH),
      "-m",
      f"hydra.sweep.dir={root}",
      f"compilation_cache={cache}",
      *ADAM,
      "seed=0,1,2",
    ],
    cwd=root.parent,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )


def _kill_when(sweep, moment, timeout=300):
  """SIGKILLs `sweep` as soon as `moment(started)` holds."""
  started, deadline = time.time(), time.monotonic() + timeout
  while not moment(started):
    assert sweep.poll() is None, "the sweep ended before the moment"
    assert time.monotonic() < deadline, "the moment never came"
    time.sleep(0.005)
  sweep.send_signal(signal.SIGKILL)
  sweep.wait()


@pytest.mark.slow
def test_a_sweep_killed_at_three_moments_loses_no_finished_run(tmp_path):
  """SIGKILL before the first launch, in the middle of a run, and right
  after a run finished; each restart keeps every finished run byte for
  byte, leaves no damaged one, and the last completes the sweep."""
  root, cache = tmp_path / "sweep", tmp_path / "jax_cache"

  def newer(pattern, started):
    return [p for p in root.glob(pattern) if p.stat().st_mtime > started]

  def before_launch(started):  # the sweeper has composed every point
    return (root / "multirun.yaml").exists()

  def mid_run(started):  # a run has written its config, not its marker
    return any(
      not (p.parent / records.MARKER).exists()
      for p in newer("*/config.parquet", started)
    )

  def run_finished(started):
    return bool(newer(f"*/{records.MARKER}", started))

  kept = {}
  for moment in (before_launch, mid_run, run_finished):
    _kill_when(_start_sweep(root, cache), moment)
    markers = _finished_markers(root)
    assert {k: markers[k] for k in kept} == kept  # none lost or redone
    for path in root.glob("*/"):
      assert records.RunDir(path).damage() is None, path
    kept = markers
  assert kept, "no run finished before the last kill"
  last = _start_sweep(root, cache)
  out, _ = last.communicate(timeout=300)
  assert last.returncode == 0, out[-3000:]
  assert f"{len(kept)} of 3 sweep points finished earlier" in out
  markers = _finished_markers(root)
  assert len(markers) == 3 and {k: markers[k] for k in kept} == kept
  for name in markers:
    assert records.RunDir(root / name).marker()["status"] == "complete"
  assert list(cache.iterdir())  # compiled programs kept for the restarts


def test_a_run_keeps_its_programs_in_its_own_cache_folder_after_another(
  tmp_path,
):
  """A process whose earlier runs (or a notebook) kept programs in one
  folder keeps the next run's in that run's folder."""
  code = (
    "import jax, jax.numpy as jnp, os, sys; from curvbench import runs; "
    "runs.use_compilation_cache(sys.argv[1]); "
    "jax.jit(lambda x: x + 1)(jnp.ones(3)).block_until_ready(); "
    "runs.use_compilation_cache(sys.argv[2]); "
    "jax.jit(lambda x: x * 3 + 2)(jnp.ones(5)).block_until_ready(); "
    "print(len(os.listdir(sys.argv[2])))"
  )
  done = subprocess.run(
    [sys.executable, "-c", code, tmp_path / "first", tmp_path / "second"],
    capture_output=True,
    text=True,
    check=False,
    timeout=300,
  )
  assert done.returncode == 0, done.stderr[-2000:]
  assert int(done.stdout.split()[-1]) >= 1
