"""CIFAR-10, read from `cifar10.npz` or the python-version batches in a
directory (never downloaded)."""

import dataclasses
import pickle
from pathlib import Path

import numpy as np

from components import Text, setting
from problems import data
from problems.datafiles import (SPLIT_KEYS, DataFileError, check_splits,
                                read_npz)
from problems.datasets import DATASETS, DatasetSettings

SHAPES = ((32, 32, 3),)


def layout(root: Path) -> str:
  """Which files to put in `root`."""
  return (f"Put either {root / 'cifar10.npz'} (arrays x_train, y_train, "
          f"x_test, y_test; images NHWC) or the python-version batches "
          f"{root / 'cifar-10-batches-py'}/data_batch_1..5 and test_batch.")


def fix(root: Path) -> str:
  """How to get a good copy into `root` (ends every file error)."""
  return (f"Replace it with a good copy: the python version of CIFAR-10 "
          f"(cifar-10-python.tar.gz from https://www.cs.toronto.edu/~kriz/"
          f"cifar.html, unpacked in {root}), or {root / 'cifar10.npz'} with "
          f"x_train, y_train, x_test, y_test (uint8 NHWC images, labels "
          f"0..9).")


@DATASETS.register
@dataclasses.dataclass
class CIFAR10(DatasetSettings):
  """CIFAR-10's 32x32 colour images, pixels scaled to [0, 1]."""

  name: str = "cifar10"
  data_dir: str | None = setting(None, Text(null=True),
                                 "the directory of the files (null: "
                                 "$CURVBENCH_DATA)")

  def input_shape(self):
    return (32, 32, 3)

  def load(self):
    root = data.data_dir(self.data_dir, "CIFAR-10", layout)
    batches = root / "cifar-10-batches-py"
    if (root / "cifar10.npz").exists():
      source = root / "cifar10.npz"
      arrays = read_npz(source, SPLIT_KEYS, fix(root))
    elif batches.is_dir():
      source = batches
      x_tr, y_tr = _batches(batches, [f"data_batch_{i}" for i in range(1, 6)],
                            fix(root))
      x_te, y_te = _batches(batches, ["test_batch"], fix(root))
      arrays = dict(x_train=x_tr, y_train=y_tr, x_test=x_te, y_test=y_te)
    else:
      raise FileNotFoundError(f"No CIFAR-10 files in {root}. {layout(root)}")
    arrays = check_splits(arrays, source, SHAPES, 10, fix(root))
    for split in ("train", "test"):
      arrays[f"x_{split}"] = arrays[f"x_{split}"] / np.float32(255)
    return data.finished("cifar10", data.subset(
        arrays, self.num_train, self.num_test, source), 10)


def _batches(batches: Path, names, fix_text: str):
  """Images (NHWC) and labels of the python-version batch files `names`."""
  xs, ys = [], []
  for name in names:
    path = batches / name
    if not path.exists():
      raise FileNotFoundError(f"CIFAR-10 batch {path} is missing. {fix_text}")
    try:
      with open(path, "rb") as f:
        part = pickle.load(f, encoding="bytes")
      x = np.asarray(part[b"data"])
      y = np.asarray(part[b"labels"])
    except Exception as e:  # noqa: BLE001 - a damaged pickle fails many ways
      raise DataFileError(f"{path} is not a CIFAR-10 batch (a pickled dict "
                          f"with b'data' and b'labels'): {e!r}. "
                          f"{fix_text}") from e
    if x.ndim != 2 or x.shape[1] != 3 * 32 * 32 or len(y) != len(x):
      raise DataFileError(
          f"{path} holds data of shape {x.shape} and {len(y)} labels; a "
          f"CIFAR-10 batch has (N, 3072) and N labels. {fix_text}")
    xs.append(x.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
    ys.append(y)
  return np.concatenate(xs), np.concatenate(ys)
