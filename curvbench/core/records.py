"""Measurements -> tidy DataFrames -> files in a run directory.

The harness owns only what it writes: a run directory's `.curvbench` file
lists every file the harness wrote there (recorded before each is written),
clearing a run removes exactly those, and a folder holding anything else
(Hydra's own `.hydra/` and `*.log` aside) is refused as a run directory
(`ForeignFolder`). Every file is written atomically (temporary file in the
same directory, then `os.replace`), so an interrupted run never leaves a
half-written one, and with the mode a plain `open` gives (the user's umask).
The completion marker `DONE.json` is written last and holds the sha256 of
every other file the run wrote: a run directory without it is unfinished
and gets redone, one with it is skipped by a rerun of its sweep unless a
file is missing or changed (`RunDir.damage`). A lock per run directory
(`RunDir.lock`) keeps two processes from running it at once.

A run that fails records why in `ERROR.json`, even when it failed because
the disk filled: it sets space aside for that record when it starts
(`RunDir.reserve`), and writes into that space where no new file can be
written (`RunDir.write_error`). A folder that cannot be written at all
(read-only, not permitted, full) is refused before a run or sweep starts
(`check_writable`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import time
import uuid
from pathlib import Path

import pandas as pd
import pyarrow
import pyarrow.parquet as pq

from problems.datafiles import file_sha256

# The columns that name a seed: runs that differ only in these are repeats.
SEED_KEYS = ("seed", "init_seed", "data_seed")

MARKER = "DONE.json"
LOCK = ".lock"
OWNED = ".curvbench"  # the files the harness wrote in a run directory
SWEEP_MARKER = ".curvbench-sweep"  # a sweep folder is curvbench's
ERROR = "ERROR.json"  # why a run failed (its traceback and identity)
RESERVE = ".ERROR.json.reserve"  # space kept for it while the run runs
RESERVE_BYTES = 32 * 1024  # the end of a traceback, where it names the error
# Files of runs written before `OWNED` existed, which the harness took as its
# own when it found them beside a completion marker.
LEGACY = (
  "DONE.json",
  "ERROR.json",
  "metadata.json",
  "environment.json",
  "registration.json",
  "config.yaml",
  "*.parquet",
  "checkpoints/params_step*.safetensors",
)


class DamagedRun(ValueError):
  """A run directory whose records cannot be read."""


class ForeignFolder(ValueError):
  """A folder holding files the harness did not write, named as a run's."""


class UnwritableFolder(ValueError):
  """A folder the harness cannot write into: read-only, not permitted, or
  on a full disk."""


class RunLocked(RuntimeError):
  """Another process holds a run directory's lock; `holder` says which."""

  def __init__(self, message: str, holder: dict):
    super().__init__(message)
    self.holder = holder


def atomic_write(path: Path, write) -> Path:
  """Calls `write(tmp)` on a temporary file beside `path`, then renames it to
  `path`, so `path` is either absent or whole. The file is created as a
  plain `open` would create it, so its mode follows the umask."""
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:12]}.tmp"
  # Created here with 0o666, the kernel applying the umask: the mode a
  # plain `open` gives. Some writers (safetensors) recreate the file with
  # 0o600, so the mode is set again before the rename.
  fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
  mode = stat.S_IMODE(os.fstat(fd).st_mode)
  os.close(fd)
  try:
    write(str(tmp))
    if stat.S_IMODE(os.stat(tmp).st_mode) != mode:
      os.chmod(tmp, mode)
    os.replace(tmp, path)
  finally:
    tmp.unlink(missing_ok=True)
  return path


def check_writable(folder, fix: str) -> None:
  """Raises `UnwritableFolder` where `folder`, or the folder it would be
  created in, cannot be written: on a read-only file system, without
  permission, or on a full disk; the message names `folder`, why, and
  `fix` (what to do, e.g. "choose another folder with hydra.sweep.dir=...").
  Asks the system without writing anything, so it can run before any
  folder is made."""
  absolute = Path(os.path.abspath(folder))
  # The nearest folder that exists (os.path.exists, unlike Path.exists,
  # answers False where a parent may not be searched).
  existing = next(p for p in (absolute, *absolute.parents) if os.path.exists(p))
  code: int | None
  if not existing.is_dir():
    code = errno.ENOTDIR
  else:
    disk = os.statvfs(existing)
    free = disk.f_bfree if os.geteuid() == 0 else disk.f_bavail
    code = (
      errno.EROFS
      if disk.f_flag & os.ST_RDONLY
      else errno.EACCES
      if not os.access(existing, os.W_OK | os.X_OK)
      # f_blocks 0: a file system that does not count its blocks
      else errno.ENOSPC
      if disk.f_blocks and not free
      else None
    )
  if code == errno.ENOSPC:
    fix = f"free some space there, or {fix}"
  if code is not None:
    raise UnwritableFolder(
      f"cannot write to {folder} ({os.strerror(code)}): {fix}"
    )


def tidy(rows, **columns) -> pd.DataFrame:
  """A DataFrame of `rows` (dicts) with constant `columns` put first."""
  df = pd.DataFrame(list(rows))
  for i, (key, value) in enumerate(columns.items()):
    if key not in df:
      df.insert(min(i, len(df.columns)), key, value)
  return df


def _unreadable(path: Path, error: Exception) -> str:
  lines = str(error).strip().splitlines()
  return (
    f"{path.name} is unreadable ({lines[0] if lines else type(error).__name__})"
  )


class RunDir:
  """The directory of one run: tables, metadata and the completion marker."""

  def __init__(self, path):
    self.path = Path(path)

  @property
  def has_marker(self) -> bool:
    """Whether the completion marker exists (readable or not)."""
    return (self.path / MARKER).exists()

  @property
  def done(self) -> bool:
    """Whether the run finished and its records are intact; a damaged run
    counts as not done, so a rerun of its sweep redoes it."""
    return self.has_marker and self.damage() is None

  # --- what is the harness's here -------------------------------------------

  def written(self) -> list[str]:
    """The files (relative paths) the harness wrote here, as its `.curvbench`
    file lists them; for a run directory from before that file, those of
    `LEGACY` present beside a completion or error marker."""
    try:
      listed = json.loads((self.path / OWNED).read_text())
    except FileNotFoundError:
      if not any((self.path / n).exists() for n in (MARKER, ERROR)):
        return []
      return sorted(
        {
          str(p.relative_to(self.path))
          for pattern in LEGACY
          for p in self.path.glob(pattern)
        }
      )
    except (OSError, ValueError):
      return []  # damaged: nothing is taken as the harness's
    return [n for n in listed if isinstance(n, str)]

  def foreign(self) -> list[str]:
    """The entries here the harness did not write, less Hydra's own
    (`.hydra/`, `*.log`): what makes this folder not a run directory."""
    if not self.path.is_dir():
      return []
    ours = {Path(n).parts[0] for n in self.written()} | {OWNED, LOCK}
    return sorted(
      p.name
      for p in self.path.iterdir()
      if p.name not in ours
      and p.name != ".hydra"
      and p.suffix != ".log"
      and not _temporary(p)
    )

  def check_ours(self) -> None:
    """Raises `ForeignFolder` when this folder holds files the harness did
    not write: a run goes only into an empty folder or a run's."""
    found = self.foreign()
    if found:
      shown = ", ".join(found[:5]) + (", ..." if len(found) > 5 else "")
      raise ForeignFolder(
        f"{self.path} holds files curvbench did not write ({shown}), so "
        "it is not a run directory and nothing is written there. Choose "
        "another folder (hydra.run.dir=..., or hydra.sweep.dir=... for a "
        "sweep) or move those files away."
      )

  def own(self, relative: str) -> Path:
    """Records `relative` (a path in this directory) as the harness's,
    before it is written; returns its full path."""
    written = self.written()
    if relative not in written:
      text = json.dumps(sorted([*written, relative]), indent=1) + "\n"
      self.path.mkdir(parents=True, exist_ok=True)
      atomic_write(self.path / OWNED, lambda tmp: Path(tmp).write_text(text))
    return self.path / relative

  # --- writing ---------------------------------------------------------------

  def write_table(self, name: str, df: pd.DataFrame) -> Path:
    """Writes `df` as `<name>.parquet` here, whole or not at all; returns
    its path."""
    return atomic_write(
      self.own(f"{name}.parquet"), lambda tmp: df.to_parquet(tmp, index=False)
    )

  def write_json(self, name: str, obj) -> Path:
    """Writes `obj` as indented JSON with sorted keys to the file `name`
    here (values JSON lacks as their `str`), whole or not at all;
    returns its path."""
    text = json.dumps(obj, indent=2, sort_keys=True, default=str)
    return atomic_write(
      self.own(name), lambda tmp: Path(tmp).write_text(text + "\n")
    )

  def write_text(self, name: str, text: str) -> Path:
    """Writes `text` to the file `name` here, whole or not at all; returns
    its path."""
    return atomic_write(self.own(name), lambda tmp: Path(tmp).write_text(text))

  def reserve(self, size: int = RESERVE_BYTES) -> Path:
    """Sets `size` bytes aside here for the run's error record, while there
    is still space (`write_error` uses them once the disk has filled);
    `mark_done` removes them. Both the reserve and `ERROR.json` are
    recorded as the harness's now: recording them later needs space."""
    self.own(ERROR)
    note = (
      b'{"reserved": "space curvbench keeps for this run\'s error '
      b'record, in case the disk fills"}'
    )
    return atomic_write(
      self.own(RESERVE), lambda tmp: Path(tmp).write_bytes(note.ljust(size))
    )  # real bytes: a sparse file would hold no blocks

  def write_error(self, record: dict) -> Path | None:
    """Writes `record` (the traceback, the run's identity) as `ERROR.json`;
    returns where it went, None where nowhere.

    Where the file cannot be written (a full disk), the record goes into
    the run's reserve in place, the start of its traceback cut to fit, and
    the reserve is renamed `ERROR.json`: overwriting bytes a file already
    has needs no new blocks (on file systems that write in place: ext4,
    xfs, tmpfs). Where even that fails, the reserve is emptied, which
    frees space rather than needing it, and an empty reserve is what tells
    the report that the run failed when its disk filled.
    """
    reserve = self.path / RESERVE
    try:
      written = self.write_json(ERROR, record)
    except OSError:
      pass
    else:
      reserve.unlink(missing_ok=True)  # the record is whole without it
      return written
    try:
      fd = os.open(reserve, os.O_WRONLY)
    except OSError:
      return None  # it failed before it made its reserve
    try:
      size = os.fstat(fd).st_size
      data = _fitted(record, size)
      padded = data.ljust(size)  # over every byte of the note it was made with
      if os.pwrite(fd, padded, 0) != len(padded):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
      with contextlib.suppress(OSError):  # the padding: shrinking is free
        os.ftruncate(fd, len(data))
    except OSError:
      with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
      return None
    finally:
      os.close(fd)
    try:
      os.replace(reserve, self.path / ERROR)
    except OSError:
      return reserve  # whole, and read there by the report
    return self.path / ERROR

  def clear(self) -> None:
    """Removes the files the harness wrote here (tables, markers, config,
    checkpoints) before the directory is used again; nothing else."""
    for name in self.written():
      (self.path / name).unlink(missing_ok=True)
    checkpoints = self.path / "checkpoints"
    if checkpoints.is_dir() and not any(checkpoints.iterdir()):
      checkpoints.rmdir()
    (self.path / OWNED).unlink(missing_ok=True)

  def table_names(self) -> list[str]:
    """The names of the tables written here (`write_table`), sorted."""
    return sorted(
      Path(n).stem
      for n in self.written()
      if n.endswith(".parquet") and "/" not in n
    )

  def mark_done(self, status: str = "complete", **info) -> Path:
    """Writes the completion marker, listing the tables and the sha256 of
    every file written so far; call it after every other file."""
    files = {
      n: file_sha256(self.path / n)
      for n in self.written()
      if n not in (MARKER, RESERVE) and (self.path / n).is_file()
    }
    marker = self.write_json(
      MARKER,
      dict(
        status=status,
        finished=time.time(),
        tables=self.table_names(),
        files=files,
        **info,
      ),
    )
    (self.path / RESERVE).unlink(missing_ok=True)  # no error to record now
    return marker

  def marker(self) -> dict | None:
    """The completion marker, None when there is none; `DamagedRun` when it
    cannot be read."""
    path = self.path / MARKER
    if not path.exists():
      return None
    try:
      marker = json.loads(path.read_text())
    except (OSError, ValueError) as e:
      raise DamagedRun(f"{path}: {_unreadable(path, e)}") from e
    if not isinstance(marker, dict) or not isinstance(
      marker.get("status"), str
    ):
      raise DamagedRun(f"{path} is not a completion marker (no status)")
    tables, files = marker.get("tables", []), marker.get("files", {})
    if not (
      isinstance(tables, list)
      and all(isinstance(t, str) for t in tables)
      and isinstance(files, dict)
    ):
      raise DamagedRun(
        f"{path} is not a completion marker (its tables or "
        "files are not lists of names)"
      )
    return marker

  def damage(self) -> str | None:
    """Why this run's records cannot be trusted, or None when they can: an
    unreadable marker, or a file the run wrote that is missing, changed
    since (its sha256) or unreadable."""
    try:
      marker = self.marker() or {}
    except DamagedRun as e:
      return str(e).removeprefix(f"{self.path / MARKER}: ")
    missing = [
      name
      for name in marker.get("tables", [])
      if not (self.path / f"{name}.parquet").exists()
    ]
    if missing:
      return f"tables {', '.join(missing)} listed in {MARKER} are missing"
    digests = marker.get("files")
    if digests is None:  # a marker from before checksums, or none yet
      return next(
        filter(
          None,
          map(
            _unreadable_record,
            sorted(
              self.path / n
              for n in self.written()
              if n not in (MARKER, ERROR, RESERVE)
            ),
          ),
        ),
        None,
      )  # not records
    for name, digest in digests.items():
      path = self.path / name
      if not path.is_file():
        return f"{name}, written by the run, is missing"
      if file_sha256(path) != digest:
        return _unreadable_record(path) or (
          f"{name} changed since the run wrote it (its sha256 differs)"
        )
    return None

  def tables(self) -> dict[str, pd.DataFrame]:
    """Every table of the run; `DamagedRun` names one that cannot be read."""
    out = {}
    for name in self.table_names():
      path = self.path / f"{name}.parquet"
      try:
        out[name] = pd.read_parquet(path)
      except (OSError, ValueError, pyarrow.ArrowException) as e:
        raise DamagedRun(f"{self.path}: {_unreadable(path, e)}") from e
    return out

  @contextlib.contextmanager
  def lock(self, wait_s: float = 0.0):
    """Holds this run directory's lock for the block: an exclusive `flock`
    on its `.lock` file, which names the holder (pid, host, start time).

    Raises `RunLocked` when another process holds it for longer than
    `wait_s` seconds. The kernel drops the lock when its holder dies, so a
    killed run never blocks the next one; the file is removed on release.
    (Not the `filelock` package: its flock lock keeps no record of who
    holds it, which `running` and `RunLocked` report.)
    """
    path = self.path / LOCK
    self.path.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + wait_s
    while True:
      fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError as e:
        os.close(fd)
        if e.errno not in (errno.EAGAIN, errno.EACCES):
          raise
        if time.monotonic() >= deadline:
          holder = self.lock_holder() or {}
          raise RunLocked(
            f"{self.path} is already being run by process "
            f"{holder.get('pid', '?')} on {holder.get('host', '?')} "
            f"(since {holder.get('since', '?')}); wait for it to finish "
            "or stop that process.",
            holder,
          ) from None
        time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        continue
      if _same_file(fd, path):
        break
      os.close(fd)  # the file we locked was removed by its last holder
    try:
      info = dict(
        pid=os.getpid(),
        host=socket.gethostname(),
        since=time.strftime("%Y-%m-%d %H:%M:%S"),
      )
      os.ftruncate(fd, 0)
      os.write(fd, json.dumps(info).encode())
      yield info
    finally:
      path.unlink(missing_ok=True)  # while still held: no one else has it
      os.close(fd)

  def lock_holder(self) -> dict | None:
    """Who holds the lock, as its file says (pid, host, since), or None
    when no lock file is there. It does not take the lock, so asking
    never gets in a starting run's way; see `running`."""
    try:
      return json.loads((self.path / LOCK).read_text())
    except FileNotFoundError:
      return None
    except (OSError, ValueError):
      return {}  # being written, or its writer was killed while writing

  def running(self) -> dict | None:
    """Who runs this directory (pid, host, since) while a process holds its
    lock, None when none does. Whether the lock is held is asked of the
    kernel where it says (Linux); elsewhere, a live process of the pid the
    lock file names counts; a holder on another host is assumed to run."""
    holder = self.lock_holder()
    if holder is None:
      return None
    unknown = dict(pid="?", host="?", since="?")
    if holder and holder.get("host") != socket.gethostname():
      return holder  # another machine: cannot tell, so assume it runs
    held = _held(self.path / LOCK)
    if held is not None:
      return (holder or unknown) if held else None
    if not holder:  # unreadable: a holder may be writing it right now
      return unknown
    try:
      os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
      return None  # killed: the kernel dropped its lock, the file remains
    except (PermissionError, KeyError, TypeError, ValueError):
      pass
    return holder


def _held(path: Path) -> bool | None:
  """Whether some process holds a lock on `path`, as Linux lists them in
  /proc/locks (without taking it); None where the system does not say."""
  try:
    listed = Path("/proc/locks").read_text()
  except OSError:
    return None
  try:
    stat_ = os.stat(path)
  except FileNotFoundError:
    return False
  # Lines read "1: FLOCK ADVISORY WRITE <pid> <major>:<minor>:<inode> ...",
  # major and minor in hex.
  device = f"{os.major(stat_.st_dev):02x}:{os.minor(stat_.st_dev):02x}"
  wanted = f"{device}:{stat_.st_ino}"
  return any(
    len(fields) > 5 and fields[5] == wanted
    for fields in map(str.split, listed.splitlines())
  )


def _fitted(record: dict, size: int) -> bytes:
  """`record` as JSON in at most `size` bytes, the start of its traceback
  cut where the whole would not fit (its end names the error); longer only
  where its other fields alone are."""
  trace, cut = str(record.get("traceback", "")), 0
  while True:
    shown = "[...]" + trace[cut:] if cut else trace
    data = json.dumps(
      dict(record, traceback=shown), indent=2, sort_keys=True, default=str
    ).encode()
    if len(data) <= size or cut >= len(trace):
      return data
    cut += len(data) - size + len("[...]")


def _unreadable_record(path: Path) -> str | None:
  """Why a table or JSON record cannot be read (None when it can, or when
  it is another kind of file)."""
  try:
    if path.suffix == ".parquet":
      pq.read_table(path)
    elif path.suffix == ".json":
      json.loads(path.read_text())
  except (OSError, ValueError, pyarrow.ArrowException) as e:
    return _unreadable(path, e)
  return None


def _temporary(path: Path) -> bool:
  """Whether `path` is a temporary file of `atomic_write` (left by a kill)."""
  return path.name.startswith(".") and path.name.endswith(".tmp")


def _same_file(fd: int, path: Path) -> bool:
  """Whether `fd` is still the file at `path` (not one since removed)."""
  try:
    return os.fstat(fd).st_ino == os.stat(path).st_ino
  except FileNotFoundError:
    return False


def claim(
  folder,
  marker: str,
  what: str,
  legacy=lambda path: False,
  check_only: bool = False,
) -> Path:
  """Takes `folder` for the harness (a sweep's or a report's), writing its
  `marker` there (unless `check_only`), unless it holds files the harness
  did not write: an empty or new folder, one with the marker, or one
  `legacy(folder)` says an earlier version wrote. Returns the folder.

  Raises:
    ForeignFolder: naming the folder, what it holds and what to do.
  """
  folder = Path(folder)
  found = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
  if found and marker not in found and not legacy(folder):
    shown = ", ".join(found[:5]) + (", ..." if len(found) > 5 else "")
    raise ForeignFolder(
      f"{folder} holds files curvbench did not write ({shown}), so it is "
      f"not {what} and nothing is written there. Choose another folder or "
      "move those files away."
    )
  if not check_only:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / marker).touch()
  return folder


def find_runs(root) -> list[RunDir]:
  """Finished run directories under `root` (those with a completion marker,
  damaged ones included: see `RunDir.damage`)."""
  return [RunDir(p.parent) for p in sorted(Path(root).rglob(MARKER))]
