"""CIFAR-10, read from `cifar10.npz`, the binary-version batches, or the
python-version batches in a directory (never downloaded). The python
version is unpickled admitting numpy arrays and plain values only, so a
file in the data folder cannot run code. With `when_missing=synthetic`,
no files found means generated images of CIFAR-10's shape
(`synthetic_images`), which the source, and so the run's identity, says."""

import dataclasses
import io
import pickle
from pathlib import Path

import numpy as np

from curvbench.components import OneOf, Text, setting
from problems import data
from problems.datafiles import (
  SPLIT_KEYS,
  DataFileError,
  check_splits,
  leading_lengths,
  read_npz,
)
from problems.datasets import DATASETS, DatasetSettings, synthetic_images

SHAPES = ((32, 32, 3),)
TRAIN = [f"data_batch_{i}" for i in range(1, 6)]
TEST = ["test_batch"]
BINARY = "cifar-10-batches-bin"  # records of 1 label byte + 3072 pixel bytes
PYTHON = "cifar-10-batches-py"  # pickled dicts


def layout(root: Path) -> str:
  """Which files to put in `root`."""
  return (
    f"Put {root / 'cifar10.npz'} (arrays x_train, y_train, x_test, "
    f"y_test; images NHWC), or the binary-version batches "
    f"{root / BINARY}/data_batch_1..5.bin and test_batch.bin, or the "
    f"python-version batches {root / PYTHON}/data_batch_1..5 and "
    "test_batch."
  )


def fix(root: Path) -> str:
  """How to get a good copy into `root` (ends every file error)."""
  return (
    f"Replace it with a good copy: CIFAR-10's binary or python "
    f"version (cifar-10-binary.tar.gz or cifar-10-python.tar.gz from "
    f"https://www.cs.toronto.edu/~kriz/cifar.html, unpacked in "
    f"{root}), or {root / 'cifar10.npz'} with x_train, y_train, "
    f"x_test, y_test (uint8 NHWC images, labels 0..9)."
  )


@DATASETS.register
@dataclasses.dataclass
class CIFAR10(DatasetSettings):
  """CIFAR-10's 32x32 colour images, pixels scaled to [0, 1]."""

  name: str = "cifar10"
  data_dir: str | None = setting(
    None, Text(null=True), "the directory of the files (null: $CURVBENCH_DATA)"
  )
  when_missing: str = setting(
    "error",
    OneOf(("error", "synthetic")),
    "no CIFAR-10 files found: "
    "stop with an error saying where to put them, or use synthetic "
    "images of CIFAR-10's shape (the data's source says which)",
  )

  def input_shape(self):
    return (32, 32, 3)

  def source(self):
    if self.stand_in() is None:
      return "CIFAR-10"
    return (
      f"synthetic images of CIFAR-10's shape (no CIFAR-10 files "
      f"found), {synthetic_images.source()}"
    )

  def stand_in(self) -> synthetic_images.SyntheticImages | None:
    """The synthetic images used instead, where `when_missing=synthetic`
    and no CIFAR-10 files are found (damaged ones still raise)."""
    if self.when_missing != "synthetic":
      return None
    try:
      self._found()
    except FileNotFoundError:
      return synthetic_images.SyntheticImages(
        num_train=self.num_train or 50000,
        num_test=self.num_test or 10000,
        size=32,
        channels=3,
        num_classes=10,
      )
    return None

  def _found(self) -> tuple[Path, str, list[Path]]:
    """The folder, the form the files there take and the files to read."""
    root = data.data_dir(self.data_dir, "CIFAR-10", layout)
    if (root / "cifar10.npz").exists():
      return root, "npz", [root / "cifar10.npz"]
    for form, folder, suffix in (
      ("binary", BINARY, ".bin"),
      ("python", PYTHON, ""),
    ):
      if (root / folder).is_dir():
        return (
          root,
          form,
          [root / folder / f"{n}{suffix}" for n in TRAIN + TEST],
        )
    raise FileNotFoundError(f"No CIFAR-10 files in {root}. {layout(root)}")

  def available(self):
    if self.stand_in() is not None:
      return (50000, 10000)  # CIFAR-10's split sizes
    try:
      _, form, files = self._found()
    except FileNotFoundError:
      return None
    if not all(f.exists() for f in files):
      return None
    if form == "npz":
      lengths = leading_lengths(files[0], ("x_train", "x_test"))
      return None if lengths is None else tuple(lengths.values())
    if form == "binary":
      count = [f.stat().st_size // 3073 for f in files]
      return (sum(count[: len(TRAIN)]), sum(count[len(TRAIN) :]))
    return (10000 * len(TRAIN), 10000 * len(TEST))  # the python version's

  def files(self):
    try:
      return [f for f in self._found()[2] if f.exists()]
    except FileNotFoundError:
      return []

  def load(self):
    if (stand_in := self.stand_in()) is not None:
      return dataclasses.replace(stand_in.load(), name="cifar10")
    root, form, files = self._found()
    if form == "npz":
      source = files[0]
      arrays = read_npz(source, SPLIT_KEYS, fix(root))
    else:
      source = files[0].parent
      read = _binary_batch if form == "binary" else _python_batch
      parts = [read(f, fix(root)) for f in files]
      train, test = parts[: len(TRAIN)], parts[len(TRAIN) :]
      arrays = dict(
        x_train=np.concatenate([x for x, _ in train]),
        y_train=np.concatenate([y for _, y in train]),
        x_test=np.concatenate([x for x, _ in test]),
        y_test=np.concatenate([y for _, y in test]),
      )
    arrays = check_splits(arrays, source, SHAPES, 10, fix(root))
    for split in ("train", "test"):
      arrays[f"x_{split}"] = arrays[f"x_{split}"] / np.float32(255)
    return data.finished(
      "cifar10", data.subset(arrays, self.num_train, self.num_test, source), 10
    )


def _present(path: Path, fix_text: str) -> bytes:
  if not path.exists():
    raise FileNotFoundError(f"CIFAR-10 batch {path} is missing. {fix_text}")
  return path.read_bytes()


def _binary_batch(path: Path, fix_text: str):
  """Images (NHWC) and labels of a binary-version batch file."""
  raw = np.frombuffer(_present(path, fix_text), np.uint8)
  if raw.size == 0 or raw.size % 3073:
    raise DataFileError(
      f"{path} holds {raw.size} bytes, not a whole number of CIFAR-10 "
      f"records (1 label byte and 3072 pixel bytes each). {fix_text}"
    )
  records = raw.reshape(-1, 3073)
  return (
    records[:, 1:].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1),
    records[:, 0],
  )


class _ArraysOnly(pickle.Unpickler):
  """Unpickles numpy arrays and plain values; refuses every other global,
  so unpickling runs no code of the file's choosing."""

  ALLOWED = {
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("_codecs", "encode"),
  }  # bytes, as Python 3 pickles them

  def find_class(self, module, name):
    if (module, name) not in self.ALLOWED:
      raise pickle.UnpicklingError(
        f"it asks for {module}.{name}, which a CIFAR-10 batch never holds "
        "(only numpy arrays and plain values are read)"
      )
    return super().find_class(module, name)


def _python_batch(path: Path, fix_text: str):
  """Images (NHWC) and labels of a python-version batch file."""
  raw = _present(path, fix_text)
  try:
    part = _ArraysOnly(io.BytesIO(raw), encoding="bytes").load()
    x = np.asarray(part[b"data"])
    y = np.asarray(part[b"labels"])
  except Exception as e:
    raise DataFileError(
      f"{path} is not a CIFAR-10 batch (a pickled dict "
      f"with b'data' and b'labels'): {e}. "
      f"{fix_text}"
    ) from e
  if x.ndim != 2 or x.shape[1] != 3 * 32 * 32 or len(y) != len(x):
    raise DataFileError(
      f"{path} holds data of shape {x.shape} and {len(y)} labels; a "
      f"CIFAR-10 batch has (N, 3072) and N labels. {fix_text}"
    )
  return x.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1), y
