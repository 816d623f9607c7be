"""Measurements -> tidy DataFrames -> files in a run directory.

Every file is written atomically (temporary file in the same directory, then
`os.replace`), so an interrupted run never leaves a half-written table. The
completion marker `DONE.json` is written last: a run directory without it is
unfinished and gets redone; one with it is skipped by a rerun of its sweep.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import pandas as pd

MARKER = "DONE.json"


def atomic_write(path: Path, write) -> Path:
  """Calls `write(tmp)` on a temporary file beside `path`, then renames it to
  `path`, so `path` is either absent or whole."""
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.",
                             suffix=".tmp")
  os.close(fd)
  try:
    write(tmp)
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
  return path


def tidy(rows, **columns) -> pd.DataFrame:
  """A DataFrame of `rows` (dicts) with constant `columns` put first."""
  df = pd.DataFrame(list(rows))
  for i, (key, value) in enumerate(columns.items()):
    if key not in df:
      df.insert(min(i, len(df.columns)), key, value)
  return df


class RunDir:
  """The directory of one run: tables, metadata and the completion marker."""

  def __init__(self, path):
    self.path = Path(path)

  @property
  def done(self) -> bool:
    return (self.path / MARKER).exists()

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

  def mark_done(self, status: str = "complete", **info) -> Path:
    """Writes the completion marker; call it after every other file."""
    return self.write_json(MARKER, dict(status=status, finished=time.time(),
                                        **info))

  def marker(self) -> dict | None:
    if not self.done:
      return None
    return json.loads((self.path / MARKER).read_text())

  def tables(self) -> dict[str, pd.DataFrame]:
    return {p.stem: pd.read_parquet(p)
            for p in sorted(self.path.glob("*.parquet"))}


def find_runs(root) -> list[RunDir]:
  """Finished run directories under `root` (those with a completion marker)."""
  return [RunDir(p.parent) for p in sorted(Path(root).rglob(MARKER))]
