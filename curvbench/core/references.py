"""Exact reference matrices computed once and shared by the runs of a sweep.

A sweep over approximations measures each of them against the same exact
GGN, Fisher or Hessian at the same points. The `ReferenceStore` of a sweep
folder (`<sweep>/.references`) keeps each dense reference with its
eigendecompositions (of the whole and of its layer blocks and block
types), and what else every approximation at a point needs alike (the
mean gradient, the parameters a fixed trainer reaches), so only the first
run computes them.

An entry's key is the content it was computed from, not the config that led
there: a hash of the parameters and the examples (their bytes), the
problem's settings (the model and loss), the matrix, the precision and the
code. Runs whose trajectories differ (another optimizer, seed or step) hold
other parameters and never share; runs that reach identical parameters do,
whatever else their configs say. Entries are written atomically (a
temporary file, then a rename) and checked against their key when read, so
runs launched in parallel at worst compute an entry twice. Each entry also
holds the sha256 of its arrays (`problems.datafiles.arrays_sha256`),
written with them and checked on every read: an entry whose arrays were
damaged or replaced (or that holds no digest) is not used but computed and
written anew, and a line says so.

A dense reference of a few thousand parameters is a hundred MB or more,
and a sweep measures many points, so the store keeps the most recent
`KEEP_BYTES` only: the runs that share an entry come one after another
when a sweep varies the curvature fastest (seeds swept before it), and an
entry gone is computed again, never read wrong.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from curvbench.core import environment, records
from problems import datafiles

MARKER = ".curvbench-references"  # the store folder is curvbench's
FOLDER = ".references"
KEEP_BYTES = 2 * 2**30
# The names an entry holds besides its arrays: its key and its digest.
RESERVED = ("key", "digest")


def content_hash(*trees) -> str:
  """sha256 over the shapes, dtypes and bytes of every leaf of `trees`."""
  digest = hashlib.sha256()
  for leaf in jax.tree.leaves(trees):
    leaf = np.asarray(leaf)
    digest.update(f"{leaf.shape}{leaf.dtype}".encode())
    digest.update(np.ascontiguousarray(leaf).tobytes())
  return digest.hexdigest()


class ReferenceStore:
  """Dense references keyed by content, in `folder` (None: keeps nothing,
  every reference is computed)."""

  def __init__(self, folder: Path | None):
    self.folder = None if folder is None else Path(folder)

  @classmethod
  def of_run(cls, run_dir: Path) -> ReferenceStore:
    """The store of the sweep that `run_dir` belongs to; one that keeps
    nothing for a run on its own."""
    sweep = Path(run_dir).parent
    if not (sweep / records.SWEEP_MARKER).exists():
      return cls(None)
    return cls(sweep / FOLDER)

  @property
  def keeps(self) -> bool:
    """Whether entries are kept (else every `get` computes)."""
    return self.folder is not None

  def get(
    self, key: dict, compute: Callable[[], dict[str, np.ndarray]]
  ) -> tuple[dict[str, np.ndarray], bool]:
    """`(arrays, shared)`: the entry for `key`, read from the store where an
    earlier run wrote it (`shared` True), else `compute()`d and stored; an
    entry found but not usable (damaged, or its arrays not those its digest
    was written for) is reported in one line and replaced."""
    if self.folder is None:  # keeps nothing
      return compute(), False
    text = json.dumps(
      dict(key, code=environment.code_version()["code"]),
      sort_keys=True,
      default=str,
    )
    path = self.folder / (
      hashlib.sha256(text.encode()).hexdigest()[:24] + ".npz"
    )
    found, why = self._read(path, text)
    if found is not None:
      return found, True
    if why is not None:
      print(
        f"[curvbench] recomputing the reference store entry {path} "
        f"({_key_summary(key)}): {why}",
        flush=True,
      )
    arrays = compute()
    clash = sorted(set(RESERVED) & set(arrays))
    if clash:
      raise ValueError(
        f"The arrays computed for the reference store entry {path} are "
        f"named {', '.join(clash)}, which the store keeps for itself: "
        "rename them in the compute function."
      )
    records.claim(self.folder, MARKER, "a reference store")
    records.atomic_write(path, lambda tmp: _save(tmp, text, arrays))
    self.prune(keep=path)
    return arrays, False

  def prune(self, keep: Path | None = None) -> None:
    """Removes the oldest entries until the store holds at most
    `KEEP_BYTES` (`keep`, the entry just written, stays)."""
    if self.folder is None:  # keeps nothing
      return
    entries = []
    for path in self.folder.glob("*.npz"):
      try:
        found = path.stat()
      except FileNotFoundError:  # removed by another run meanwhile
        continue
      entries.append((found.st_mtime, found.st_size, path))
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries, key=lambda e: e[0]):
      if total <= KEEP_BYTES:
        break
      if path != keep:
        path.unlink(missing_ok=True)
        total -= size

  @staticmethod
  def _read(
    path: Path, text: str
  ) -> tuple[dict[str, np.ndarray] | None, str | None]:
    """`(arrays, None)` if the entry at `path` is whole, made for `text` and
    its arrays match its digest; else `(None, why not)` (`why` None when
    there is no entry): then it is computed anew."""
    if not path.exists():
      return None, None
    try:
      with np.load(path, allow_pickle=False) as entry:
        if "key" not in entry.files:
          return None, "it holds no key"
        if str(entry["key"]) != text:
          return None, "it was written for another key"
        if "digest" not in entry.files:
          return None, "it holds no digest of its arrays"
        written = str(entry["digest"])
        arrays = {
          name: entry[name] for name in entry.files if name not in RESERVED
        }
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
      return None, f"it cannot be read ({type(e).__name__}: {e})"
    if datafiles.arrays_sha256(arrays) != written:
      return None, "its arrays do not match the digest written with them"
    return arrays, None


def _key_summary(key: dict) -> str:
  """A short reading of a store key: its top-level entries that are plain
  strings or numbers (what the entry is of, not the content hashes)."""
  shown = [
    f"{name}={value}"
    for name, value in key.items()
    if isinstance(value, str | int | float) and len(str(value)) <= 40
  ]
  return ", ".join(shown) or "no plain fields"


def _save(tmp: str, text: str, arrays: dict[str, Any]) -> None:
  with open(tmp, "wb") as f:
    np.savez(
      f,
      key=np.array(text),
      digest=np.array(datafiles.arrays_sha256(arrays)),
      **arrays,
    )
