"""Faults end in one line and are reported as what they were: a folder that
cannot be written is refused in one line before anything is written; a run
that fills its disk is reported as failed with that cause, however far it
got; a run reached through a symbolic link is named, never left out or
read twice, and a link that loops cannot hold the report up.

Real file-system conditions where this machine allows them (a tmpfs mounted
read-only, or tiny and filled), and the same conditions simulated
in-process, so the behaviour is proven where mounting is refused too."""

import contextlib
import errno
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from curvbench import app, config, report, runs, sweep
from curvbench.core import checkpoints, records
from tests.conftest import ROOT, TINY

ADAM = (
  "measure=training",
  "optimizer=adam",
  *TINY,
  "measure.training.checkpoint_steps=[2]",
)
NO_SPACE = "No space left on device"


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
  """One finished tiny run."""
  path = tmp_path_factory.mktemp("finished") / "run"
  assert runs.run(config.compose(*ADAM), path) == "complete"
  return path


# --- file systems -------------------------------------------------------------


@pytest.fixture
def mount(tmp_path):
  """`mount(options)`: a tmpfs mounted with `options` (e.g. "ro",
  "size=256k") on a new folder, unmounted after the test; skips the test
  where this machine does not permit mounting."""
  mounted = []

  def _mount(options: str) -> Path:
    folder = tmp_path / f"disk{len(mounted)}"
    folder.mkdir()
    try:
      done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
        capture_output=True,
        text=True,
      )
    except OSError as e:
      pytest.skip(
        f"no mount command here ({e}); the simulated tests cover this"
      )
    if done.returncode:
      pytest.skip(
        f"mounting a tmpfs is not permitted here "
        f"({done.stderr.strip()}); the simulated tests cover this"
      )
    mounted.append(folder)
    return folder

  yield _mount
  for folder in reversed(mounted):
    if subprocess.run(["umount", str(folder)]).returncode:
      subprocess.run(["umount", "-l", str(folder)])  # busy: detach it


def fill(disk: Path) -> None:
  """Writes into `disk` until no space is left on it."""
  fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
  try:
    while True:
      os.write(fd, b"\xff" * 4096)
  except OSError as e:
    assert e.errno == errno.ENOSPC, e
  finally:
    os.close(fd)


def full_disk(monkeypatch):
  """Simulates a disk that fills when the returned function is called:
  from then on, every file the harness writes (`records.atomic_write`, the
  one way it writes a file) fails with ENOSPC; bytes a file already has
  can still be overwritten, as on a real full disk."""
  state = dict(full=False)

  def writer(real):
    def write(path, *args, **kwargs):
      if state["full"]:
        raise OSError(errno.ENOSPC, NO_SPACE, str(path))
      return real(path, *args, **kwargs)

    return write

  monkeypatch.setattr(records, "atomic_write", writer(records.atomic_write))
  monkeypatch.setattr(
    checkpoints, "atomic_write", writer(checkpoints.atomic_write)
  )
  return lambda: state.update(full=True)


def simulated(monkeypatch, folder: Path, cause: str) -> None:
  """Makes the system answer for `folder` (and below) as a read-only, full
  or forbidden folder would; root passes permission checks, so this is
  how a forbidden folder is tested here."""
  under = lambda path: Path(os.path.abspath(path)).is_relative_to(folder)
  real_statvfs, real_access = os.statvfs, os.access

  def statvfs(path):
    found = real_statvfs(path)
    if not under(path):
      return found
    # f_bsize f_frsize f_blocks f_bfree f_bavail f_files f_ffree f_favail
    # f_flag f_namemax
    fields = list(found)
    if cause == "read-only":
      fields[8] |= os.ST_RDONLY
    if cause == "full":
      fields[3] = fields[4] = 0  # no block free, for root or anyone
    return os.statvfs_result(fields)

  monkeypatch.setattr(os, "statvfs", statvfs)
  monkeypatch.setattr(
    os,
    "access",
    lambda path, mode, **kw: (cause != "forbidden" or not under(path))
    and real_access(path, mode, **kw),
  )


def listing(folder: Path) -> list[str]:
  return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def one_line(message) -> str:
  message = str(message)
  assert message.strip() and "\n" not in message.strip(), message
  assert "Traceback" not in message, message
  return message


# --- a folder that cannot be written ------------------------------------------


def _unwritable(cause, mount, monkeypatch, tmp_path) -> Path:
  """A folder for `cause`, real or simulated."""
  if cause == "read-only":
    return mount("ro")
  if cause == "full":
    disk = mount("size=64k")
    fill(disk)
    return disk
  if cause == "not a folder":
    (tmp_path / "a_file").write_text("not a folder")
    return tmp_path / "a_file"
  folder = tmp_path / "simulated"
  folder.mkdir()
  simulated(monkeypatch, folder, cause.removesuffix(" (simulated)"))
  return folder


CAUSES = {  # how it is made -> what the system says
  "read-only": "Read-only file system",
  "full": NO_SPACE,
  "not a folder": "Not a directory",
  "read-only (simulated)": "Read-only file system",
  "full (simulated)": NO_SPACE,
  "forbidden (simulated)": "Permission denied",
}


@pytest.mark.parametrize("cause", CAUSES)
def test_an_unwritable_folder_is_refused_in_one_line_before_any_write(
  cause, mount, monkeypatch, tmp_path
):
  folder = _unwritable(cause, mount, monkeypatch, tmp_path)
  before = listing(tmp_path)
  why = CAUSES[cause]
  for out in (folder / "run", folder / "deeper" / "run"):
    with pytest.raises(SystemExit) as refused:  # before Hydra starts
      app.cli([f"hydra.run.dir={out}", *ADAM])
    fix = ("free some space there, or " if why == NO_SPACE else "") + (
      "choose another folder (hydra.run.dir=..., or hydra.sweep.dir=... "
      "for a sweep)"
    )
    assert one_line(refused.value.code) == (
      f"curvbench: cannot write to {out} ({why}): {fix}"
    )
    with pytest.raises(records.UnwritableFolder, match=why):
      runs.run(config.compose(*ADAM), out)  # the Python API alike
  with pytest.raises(
    records.UnwritableFolder,
    match=(f"cannot write to {folder / 'sweep'} .*{why}.*: .*hydra.sweep.dir="),
  ):
    records.check_writable(
      folder / "sweep", "choose another folder with hydra.sweep.dir=..."
    )
  assert listing(tmp_path) == before  # nothing written, not even a folder


def test_a_writable_folder_passes_the_check(tmp_path):
  records.check_writable(tmp_path / "new" / "run", "unused")
  records.check_writable(tmp_path, "unused")
  assert listing(tmp_path) == []


def _script_output(script: str, cwd: Path):
  """What `script`, run in a fresh interpreter, prints last (JSON); it must
  end without a traceback."""
  done = subprocess.run(
    [sys.executable, "-c", script],
    capture_output=True,
    text=True,
    cwd=cwd,
    timeout=300,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  assert "Traceback" not in done.stderr
  return json.loads(done.stdout.strip().splitlines()[-1])


def _cli(*args):
  return subprocess.run(
    [str(ROOT / ".venv" / "bin" / "curvbench"), *args],
    capture_output=True,
    text=True,
    cwd=ROOT,
    timeout=300,
  )


@pytest.mark.slow
def test_the_command_ends_in_one_line_on_a_read_only_disk(mount):
  """The command itself: a sweep and a single run into a read-only disk
  end with one line on stderr, naming the folder and what to do, and a
  non-zero status."""
  disk = mount("ro")
  for args, folder, setting in (
    (
      ["-m", f"hydra.sweep.dir={disk / 'sweep'}", "measure=timing", "seed=0,1"],
      disk / "sweep",
      "hydra.sweep.dir=",
    ),
    (
      [f"hydra.run.dir={disk / 'x'}", "measure=timing"],
      disk / "x",
      "hydra.run.dir=",
    ),
  ):
    done = _cli(*args, *TINY)
    assert done.returncode != 0
    one_line(done.stderr)
    assert done.stderr.startswith(
      f"curvbench: cannot write to {folder} "
      "(Read-only file system): choose another "
      "folder"
    ), done.stderr
    assert setting in done.stderr


@pytest.mark.slow
def test_the_sweeper_ends_in_one_line_on_an_unwritable_disk(tmp_path):
  """Simulated in a process of its own (Hydra's sweeps log to the streams
  they were started with): a sweep folder the system calls read-only or
  forbidden, and one whose disk fills between the checks and the first
  write, end in one line each."""
  script = f"""
import errno, json, os, sys
from pathlib import Path
sys.path.insert(0, {str(ROOT)!r})
from curvbench import app, records
import pytest
from tests.curvbench.test_faults import simulated
out = []
for cause in ("read-only", "forbidden", "fills"):
  folder = Path({str(tmp_path)!r}) / cause
  folder.mkdir()
  with pytest.MonkeyPatch.context() as patch:
    if cause == "fills":  # the checks pass; the first write fails
      claim = records.claim
      def full(path, *args, check_only=False, **kwargs):
        if not check_only:
          raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return claim(path, *args, check_only=check_only, **kwargs)
      patch.setattr(records, "claim", full)
    else:
      simulated(patch, folder, cause)
    try:
      app.cli(["-m", "seed=0,1", *{list(ADAM)!r},
               f"hydra.sweep.dir={{folder / 'sweep'}}"])
      out.append(None)
    except SystemExit as e:
      out.append(str(e.code))
print(json.dumps(out))"""
  messages = _script_output(script, tmp_path)
  for message, cause, why in zip(
    messages,
    ("read-only", "forbidden", "fills"),
    ("Read-only file system", "Permission denied", NO_SPACE),
  ):
    folder = tmp_path / cause / "sweep"
    assert one_line(message).startswith(
      f"curvbench: cannot write to {folder} ({why}): choose another folder "
      "with hydra.sweep.dir=..."
    ), message
  assert not list((tmp_path / "read-only").iterdir())


# --- a disk that fills during a run -------------------------------------------

FILL_POINTS = {  # where the disk fills -> the function that fills it first
  "config": (records.RunDir, "write_table"),  # the first table: config
  "measurement": (runs, "measure"),  # before the measurement's records
  "checkpoint": (checkpoints, "save"),  # a library's write (safetensors)
  "completion marker": (records.RunDir, "mark_done"),
}


def fills_at(monkeypatch, point: str, fill_now) -> None:
  """Calls `fill_now` (which fills the disk) at `point` of the next run."""
  owner, name = FILL_POINTS[point]
  real = getattr(owner, name)

  def filling(*args, **kwargs):
    fill_now()
    return real(*args, **kwargs)

  monkeypatch.setattr(owner, name, filling)


def _reported_as_full(root: Path, run_dir: Path) -> None:
  """The run is reported failed, for want of space, and its folder is the
  harness's alone, its reserve gone."""
  error = json.loads((run_dir / records.ERROR).read_text())
  assert NO_SPACE in error["traceback"].strip().splitlines()[-1], error
  assert error["run_id"]  # the run's identity came along
  assert not (run_dir / records.RESERVE).exists()
  assert records.RunDir(run_dir).foreign() == []
  (run,) = sweep.load_sweep(root).runs.itertuples()
  assert (run.status, run.run_dir) == ("error", run_dir.name)
  assert NO_SPACE in run.reason, run.reason
  listed = sweep.not_in_results(sweep.load_sweep(root).runs)
  assert listed.status.tolist() == ["error"]


@pytest.mark.parametrize("point", FILL_POINTS)
def test_a_run_that_fills_its_disk_is_reported_as_such(
  point, mount, monkeypatch
):
  disk = mount("size=256k")
  run_dir = disk / "sweep" / "run"
  fills_at(monkeypatch, point, lambda: fill(disk))
  with pytest.raises(Exception, match=NO_SPACE):
    runs.run(config.compose(*ADAM), run_dir)
  monkeypatch.undo()
  _reported_as_full(disk / "sweep", run_dir)


@pytest.mark.parametrize("point", FILL_POINTS)
def test_a_run_that_fills_its_disk_is_reported_as_such_simulated(
  point, monkeypatch, tmp_path
):
  run_dir = tmp_path / "sweep" / "run"
  fills_at(monkeypatch, point, full_disk(monkeypatch))
  with pytest.raises(OSError, match=NO_SPACE):
    runs.run(config.compose(*ADAM), run_dir)
  monkeypatch.undo()
  _reported_as_full(tmp_path / "sweep", run_dir)


@pytest.mark.slow
def test_the_command_ends_a_run_that_fills_its_disk_in_one_line(tmp_path):
  """Through the command (in a process of its own, as Hydra runs it): the
  disk filling under the harness's own write, and under a library's (its
  error not an OSError, as safetensors' is not), ends the run in one line
  naming the cause; the traceback is in ERROR.json."""
  script = f"""
import json, sys
from pathlib import Path
sys.path.insert(0, {str(ROOT)!r})
import pytest
from safetensors import SafetensorError
from curvbench import app, runs
from tests.curvbench.test_faults import fills_at, full_disk
out = []
for case in ("harness", "library"):
  with pytest.MonkeyPatch.context() as patch:
    if case == "harness":
      fills_at(patch, "measurement", full_disk(patch))
    else:
      def measure(cfg, run_dir):
        raise SafetensorError("Error while serializing: I/O error: No "
                              "space left on device (os error 28)")
      patch.setattr(runs, "measure", measure)
    try:
      app.cli([f"hydra.run.dir={{Path({str(tmp_path)!r}) / case}}",
               *{list(ADAM)!r}])
      out.append(None)
    except SystemExit as e:
      out.append(str(e.code))
print(json.dumps(out))"""
  harness, library = _script_output(script, tmp_path)
  for message, case in ((harness, "harness"), (library, "library")):
    assert one_line(message).startswith(f"curvbench: {tmp_path / case}: ")
    assert NO_SPACE in message, message
    assert (tmp_path / case / records.ERROR).is_file()
  assert "SafetensorError" in library and (
    f"(its traceback is in {tmp_path / 'library' / records.ERROR})" in library
  ), library


def test_a_run_redone_once_there_is_space_finishes_clean(monkeypatch, tmp_path):
  run_dir = records.RunDir(tmp_path / "run")
  fills_at(monkeypatch, "measurement", full_disk(monkeypatch))
  with pytest.raises(OSError, match=NO_SPACE):
    runs.run(config.compose(*ADAM), run_dir.path)
  monkeypatch.undo()
  assert runs.run(config.compose(*ADAM), run_dir.path) == "complete"
  _finished_clean(run_dir)


def _finished_clean(run_dir: records.RunDir) -> None:
  """No reserve or error left; the marker's checksums, ownership and
  clearing hold."""
  assert not (run_dir.path / records.RESERVE).exists()
  assert not (run_dir.path / records.ERROR).exists()
  assert {records.RESERVE, records.ERROR} <= set(run_dir.written())
  assert records.RESERVE not in run_dir.marker()["files"]
  assert run_dir.done and run_dir.damage() is None
  assert run_dir.foreign() == []
  run_dir.clear()
  assert [p.name for p in run_dir.path.iterdir()] == []


def test_finished_and_skipped_runs_leave_no_reserve(finished, tmp_path):
  done = records.RunDir(tmp_path / "done")
  shutil.copytree(finished, done.path)
  assert runs.run(config.compose(*ADAM), done.path) == "cached"
  skipped = records.RunDir(tmp_path / "skipped")
  assert runs.record_skip(
    config.compose("measure=spectra", "optimizer=adam", *TINY), skipped.path
  )
  for run_dir in (done, skipped):
    _finished_clean(run_dir)


# --- writing the error when the disk is full ----------------------------------

LONG = (
  "Traceback (most recent call last):\n"
  + "  File 'deep.py', line 1, in frame\n" * 5000
  + f"OSError: [Errno 28] {NO_SPACE}: 'metadata.json'\n"
)


def _reserved(path: Path) -> records.RunDir:
  run_dir = records.RunDir(path)
  run_dir.reserve()
  return run_dir


def _status(run_dir: records.RunDir) -> tuple[str, str]:
  (run,) = sweep.load_sweep(run_dir.path.parent).runs.itertuples()
  return run.status, run.reason


# Whether the disk is full, and which `os` calls fail besides -> the status
# and words of the reason the report gives, and the file the error is in.
RECORDING = {
  "disk has space": (
    False,
    (),
    "error",
    f"OSError: [Errno 28] {NO_SPACE}",
    records.ERROR,
  ),
  "disk full": (
    True,
    (),
    "error",
    f"OSError: [Errno 28] {NO_SPACE}",
    records.ERROR,
  ),
  "rename fails too": (
    True,
    ("replace",),
    "error",
    f"OSError: [Errno 28] {NO_SPACE}",
    records.RESERVE,
  ),
  "in-place write fails too": (
    True,
    ("pwrite",),
    "error",
    f"the disk filled ({NO_SPACE})",
    records.RESERVE,
  ),
  "nothing can be written": (
    True,
    ("pwrite", "ftruncate"),
    "killed",
    "no completion marker",
    records.RESERVE,
  ),
}


@pytest.mark.parametrize("case", RECORDING)
def test_an_error_is_recorded_however_little_can_be_written(
  case, monkeypatch, tmp_path
):
  """Each way of writing the error, failing in turn: the report says what
  it can, and calls a failed run killed only where nothing could be
  written at all."""
  full, fails, status, words, where = RECORDING[case]
  run_dir = _reserved(tmp_path / "sweep" / "run")
  if full:
    full_disk(monkeypatch)()

  def fail(*args, **kwargs):
    raise OSError(errno.ENOSPC, NO_SPACE)

  with monkeypatch.context() as patch:
    for name in fails:
      patch.setattr(os, name, fail)
    run_dir.write_error(dict(traceback=LONG, run_id="abc"))
  monkeypatch.undo()
  found, reason = _status(run_dir)
  assert found == status and words in reason, reason
  assert [
    p.name
    for p in run_dir.path.iterdir()
    if p.name in (records.ERROR, records.RESERVE)
  ] == [where]
  assert run_dir.foreign() == []
  if where == records.ERROR:
    record = json.loads((run_dir.path / records.ERROR).read_text())
    assert record["run_id"] == "abc"
    if full:  # cut to the reserve, the error line kept
      assert (run_dir.path / records.ERROR).stat().st_size <= (
        records.RESERVE_BYTES
      )
      assert record["traceback"].startswith("[...]")
      assert record["traceback"].endswith(LONG.splitlines()[-1] + "\n")
    else:
      assert record["traceback"] == LONG
  run_dir.clear()  # the harness's own files, all of them
  assert listing(run_dir.path) == []


def test_the_error_goes_into_its_reserve_on_a_real_full_disk(mount):
  disk = mount("size=128k")
  run_dir = _reserved(disk / "run")
  fill(disk)
  with pytest.raises(OSError, match=NO_SPACE):
    run_dir.write_json("another.json", {})
  assert run_dir.write_error(dict(traceback=LONG)) == run_dir.path / (
    records.ERROR
  )
  assert _status(run_dir)[0] == "error"
  assert NO_SPACE in _status(run_dir)[1]


def test_a_reserve_as_made_is_a_running_or_killed_run(tmp_path):
  run_dir = _reserved(tmp_path / "sweep" / "run")
  with run_dir.lock():
    assert _status(run_dir)[0] == "running"
  assert _status(run_dir)[0] == "killed"


# --- runs reached through symbolic links --------------------------------------


def _load(root: Path, timeout_s: float = 60.0):
  """`sweep.load_sweep(root)`, failing rather than hanging."""
  loaded = []
  worker = threading.Thread(
    target=lambda: loaded.append(sweep.load_sweep(root)), daemon=True
  )
  worker.start()
  worker.join(timeout_s)
  assert not worker.is_alive(), f"the report of {root} hangs"
  return loaded[0]


def test_runs_reached_through_links_are_named_not_read(finished, tmp_path):
  root, elsewhere = tmp_path / "sweep", tmp_path / "elsewhere"
  shutil.copytree(finished, root / "real")
  shutil.copytree(finished, elsewhere / "run")
  shutil.copytree(finished, elsewhere / "other_sweep" / "run")
  (elsewhere / "data").mkdir()
  (elsewhere / "data" / "x.npz").write_bytes(b"data")
  links = {  # link under the sweep -> target
    "to_a_run": elsewhere / "run",  # named
    "to_a_sweep": elsewhere / "other_sweep",  # named
    "nested/to_a_run": elsewhere / "run",  # named
    "to_data": elsewhere / "data",  # not a run: left alone
    "to_itself_inside": root / "real",  # read where it lies, once
    "to_the_sweep": root,  # a loop inside: read once
    "loop_a": root / "loop_b",  # loops that lead nowhere
    "loop_b": root / "loop_a",
    "dangling": tmp_path / "gone",
  }
  for name, target in links.items():
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    (root / name).symlink_to(target)
  loaded = _load(root)
  runs_ = loaded.runs.set_index("run_dir")
  assert runs_.status.to_dict() == {
    "real": "complete",
    "to_a_run": "linked",
    "to_a_sweep": "linked",
    "nested/to_a_run": "linked",
  }
  for name in ("to_a_run", "to_a_sweep", "nested/to_a_run"):
    reason, target = runs_.reason[name], os.path.realpath(links[name])
    assert f"reached through a symbolic link ({name} -> {target})" in reason, (
      reason
    )
    assert f"report the sweep of {target}, or copy the run here" in reason
  assert set(loaded.tables["training"].run_dir) == {"real"}  # read once
  listed = sweep.not_in_results(loaded.runs)
  assert sorted(listed.run_dir) == ["nested/to_a_run", "to_a_run", "to_a_sweep"]
  assert set(listed.status) == {"linked"}


def test_the_report_names_a_linked_run_and_a_loop_cannot_hang_it(
  finished, tmp_path, capsys
):
  root = tmp_path / "reports" / "sweep"
  shutil.copytree(finished, root / "real")
  shutil.copytree(finished, tmp_path / "kept" / "run")
  (root / "linked").symlink_to(tmp_path / "kept" / "run")
  (root / "up").symlink_to(root.parent)  # leads out and back in
  (root / "real" / "loop").symlink_to(root)
  assert report.main([str(root), "--out", str(tmp_path / "out")]) == 0
  assert "not in the results: 2 linked" in capsys.readouterr().out
  listed = (tmp_path / "out" / "not_in_results.csv").read_text()
  assert "reached through a symbolic link (linked -> " in listed
  assert f"(up -> {os.path.realpath(root.parent)})" in listed


def test_a_report_into_an_unwritable_folder_ends_in_one_line(
  finished, mount, monkeypatch, tmp_path
):
  """Already so (`report.main`); kept so: a read-only output folder, real
  and simulated, and a disk that is full."""
  root = tmp_path / "sweep"
  shutil.copytree(finished, root / "run")
  outs = [
    (tmp_path / "simulated", errno.EROFS),
    (tmp_path / "simulated_full", errno.ENOSPC),
  ]
  with contextlib.suppress(pytest.skip.Exception):  # the simulated still run
    outs.append((mount("ro") / "out", None))
  for out, simulate in outs:
    why = os.strerror(simulate or errno.EROFS)
    with monkeypatch.context() as patch:
      if simulate:

        def unwritable(path, write):
          raise OSError(simulate, why, str(path))  # noqa: B023 - used at once

        patch.setattr(records, "atomic_write", unwritable)
      with pytest.raises(SystemExit) as refused:
        report.main([str(root), "--out", str(out)])
    assert one_line(refused.value.code).startswith(
      f"curvbench report: cannot write the report to {out} ({why}); give "
      "another folder with --out"
    ), refused.value.code
