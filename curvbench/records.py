"""Measurements -> tidy DataFrames -> files in a run directory.

Every file is written atomically (temporary file in the same directory, then
`os.replace`), so an interrupted run never leaves a half-written table, and
with the mode a plain `open` gives (the user's umask). The completion marker
`DONE.json` is written last and lists the run's tables: a run directory
without it is unfinished and gets redone, one with it is skipped by a rerun
of its sweep unless its records are damaged (`RunDir.damage`). A lock per run
directory (`RunDir.lock`) keeps two processes from running it at once.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import stat
import time
import uuid
from pathlib import Path

import pandas as pd
import pyarrow
import pyarrow.parquet as pq

MARKER = "DONE.json"
LOCK = ".lock"


class DamagedRun(ValueError):
  """A run directory whose records cannot be read."""


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


def tidy(rows, **columns) -> pd.DataFrame:
  """A DataFrame of `rows` (dicts) with constant `columns` put first."""
  df = pd.DataFrame(list(rows))
  for i, (key, value) in enumerate(columns.items()):
    if key not in df:
      df.insert(min(i, len(df.columns)), key, value)
  return df


def _unreadable(path: Path, error: Exception) -> str:
  lines = str(error).strip().splitlines()
  return (f"{path.name} is unreadable "
          f"({lines[0] if lines else type(error).__name__})")


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

  def write_table(self, name: str, df: pd.DataFrame) -> Path:
    return atomic_write(self.path / f"{name}.parquet",
                         lambda tmp: df.to_parquet(tmp, index=False))

  def write_json(self, name: str, obj) -> Path:
    text = json.dumps(obj, indent=2, sort_keys=True, default=str)
    return atomic_write(self.path / name,
                         lambda tmp: Path(tmp).write_text(text + "\n"))

  def write_text(self, name: str, text: str) -> Path:
    return atomic_write(self.path / name, lambda tmp: Path(tmp).write_text(text))

  def clear(self) -> None:
    """Removes the records of an earlier run here (tables, markers, config,
    checkpoints) before the directory is used again."""
    for pattern in ("*.parquet", "*.json", "config.yaml"):
      for path in self.path.glob(pattern):
        path.unlink()
    shutil.rmtree(self.path / "checkpoints", ignore_errors=True)

  def table_names(self) -> list[str]:
    return [p.stem for p in sorted(self.path.glob("*.parquet"))]

  def mark_done(self, status: str = "complete", **info) -> Path:
    """Writes the completion marker, listing the tables written so far;
    call it after every other file."""
    return self.write_json(MARKER, dict(status=status, finished=time.time(),
                                        tables=self.table_names(), **info))

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
    if not isinstance(marker, dict) or not isinstance(marker.get("status"),
                                                      str):
      raise DamagedRun(f"{path} is not a completion marker (no status)")
    return marker

  def damage(self) -> str | None:
    """Why this run's records cannot be trusted, or None when they can: an
    unreadable marker, table or JSON record, or a table the marker lists
    that is missing."""
    try:
      marker = self.marker() or {}
    except DamagedRun as e:
      return str(e).removeprefix(f"{self.path / MARKER}: ")
    missing = [name for name in marker.get("tables", [])
               if not (self.path / f"{name}.parquet").exists()]
    if missing:
      return (f"tables {', '.join(missing)} listed in {MARKER} are missing")
    for path in sorted(self.path.glob("*.parquet")):
      try:
        pq.read_table(path)
      except (OSError, ValueError, pyarrow.ArrowException) as e:
        return _unreadable(path, e)
    for path in sorted(self.path.glob("*.json")):
      if path.name != MARKER:
        try:
          json.loads(path.read_text())
        except (OSError, ValueError) as e:
          return _unreadable(path, e)
    return None

  def tables(self) -> dict[str, pd.DataFrame]:
    """Every table of the run; `DamagedRun` names one that cannot be read."""
    out = {}
    for path in sorted(self.path.glob("*.parquet")):
      try:
        out[path.stem] = pd.read_parquet(path)
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
              "or stop that process.", holder) from None
        time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        continue
      if _same_file(fd, path):
        break
      os.close(fd)  # the file we locked was removed by its last holder
    try:
      info = dict(pid=os.getpid(), host=socket.gethostname(),
                  since=time.strftime("%Y-%m-%d %H:%M:%S"))
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
    """The lock holder when a live process on this host holds the lock (or
    one on another host may), None when no process runs this directory."""
    holder = self.lock_holder()
    if holder is None:
      return None
    if not holder:  # unreadable: a holder may be writing it right now
      return dict(pid="?", host="?", since="?")
    if holder.get("host") != socket.gethostname():
      return holder  # another machine: cannot tell, so assume it runs
    try:
      os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
      return None  # killed: the kernel dropped its lock, the file remains
    except (PermissionError, KeyError, TypeError, ValueError):
      pass
    return holder


def _same_file(fd: int, path: Path) -> bool:
  """Whether `fd` is still the file at `path` (not one since removed)."""
  try:
    return os.fstat(fd).st_ino == os.stat(path).st_ino
  except FileNotFoundError:
    return False


def find_runs(root) -> list[RunDir]:
  """Finished run directories under `root` (those with a completion marker,
  damaged ones included: see `RunDir.damage`)."""
  return [RunDir(p.parent) for p in sorted(Path(root).rglob(MARKER))]
