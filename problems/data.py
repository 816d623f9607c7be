"""The `Dataset` type, and what the dataset loaders (`problems.datasets`)
share: the cache of generated data, splits and subsets, and where real
data is read from.

Nothing here touches the network. Generated data (MNIST-1D, CURVES, upsampled
digits) is cached as `.npz` under the cache directory: the dataset's `cache`
setting, else `$CURVBENCH_CACHE`, else `~/.cache/curvbench`. Real MNIST and
CIFAR-10 are read from a directory the user provides (`data_dir`, else
`$CURVBENCH_DATA`). Images are float32 in [0, 1], NHWC; labels are int32.

Every file read is checked (`problems.datafiles`); a bad one raises
`DataFileError` naming the file and how to get a good copy.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

# DataFileError, SPLIT_KEYS and arrays_sha256 are also read from here.
from problems.datafiles import (
  SPLIT_KEYS,
  DataFileError,
  arrays_sha256,
  file_sha256,
  read_npz,
  save_npz,
)

__all__ = [
  "DataFileError",
  "Dataset",
  "SPLIT_KEYS",
  "arrays_sha256",
  "cache_dir",
  "cached",
  "data_dir",
  "find_file",
  "fingerprint",
  "finished",
  "generated",
  "shuffle_split",
  "subset",
]


@dataclasses.dataclass(frozen=True)
class Dataset:
  """A dataset's train and test splits, held in memory.

  `x_*` holds the inputs, examples along the first axis (the built-in
  loaders give float32: images in [0, 1], NHWC, token sequences as their
  ids). `y_*` holds the targets: int32 class labels, one per example (per
  position for token sequences), or float32 arrays where they are not
  labels. `num_classes` is the number of label values (a language model's
  vocabulary; 0 where the targets are not class labels).
  """

  name: str
  x_train: np.ndarray
  y_train: np.ndarray
  x_test: np.ndarray
  y_test: np.ndarray
  num_classes: int

  @property
  def input_shape(self) -> tuple[int, ...]:
    """The shape of one input example (the inputs' shape without the
    example axis)."""
    return tuple(self.x_train.shape[1:])


def cache_dir(override: str | os.PathLike | None = None) -> Path:
  """Where generated datasets are cached: `override` if given, else
  `$CURVBENCH_CACHE`, else `~/.cache/curvbench` (with `~` expanded)."""
  path = (
    override
    or os.environ.get("CURVBENCH_CACHE")
    or (Path.home() / ".cache" / "curvbench")
  )
  return Path(path).expanduser()


def cached(name: str, spec: dict, build: Callable, cache: str | None) -> dict:
  """`build(**spec)`'s arrays, from the cache when built before: the file
  holds their sha256, and one that is missing, damaged or edited is built
  and cached again."""
  key = hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
  path = cache_dir(cache) / f"{name}-{key}.npz"
  if path.exists():
    try:
      return read_npz(path, SPLIT_KEYS, "", checksum=True)
    except DataFileError:
      pass  # a cache: build it again
  arrays = build(**spec)
  save_npz(path, dict(arrays, sha256=np.array(arrays_sha256(arrays))))
  return arrays


def fingerprint(what: str, spec: dict | None = None, files=()) -> str:
  """What identifies a dataset's examples: `what` (a generator and its
  version, or a source), the settings that shape them (`spec`), and the
  sha256 of each file they are read from, 12 hex digits in all."""
  parts = [what, json.dumps(spec or {}, sort_keys=True, default=str)]
  parts += [f"{Path(f).name}:{_file_sha256(Path(f))}" for f in files]
  digest = hashlib.sha256(chr(0).join(parts).encode()).hexdigest()
  return f"{what}:{digest[:12]}"


@functools.lru_cache(maxsize=64)
def _cached_sha256(path: str, size: int, mtime: int) -> str:
  del size, mtime  # the key: a file rewritten is hashed again
  return file_sha256(Path(path))


def _file_sha256(path: Path) -> str:
  stat = path.stat()
  return _cached_sha256(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


def shuffle_split(x, y, num_test: int, seed: int) -> dict:
  """The split arrays of `(x, y)`: a shuffle fixed by `seed`, its first
  `num_test` examples the test split."""
  order = np.random.default_rng(seed).permutation(len(x))
  test, train = order[:num_test], order[num_test:]
  return dict(
    x_train=x[train], y_train=y[train], x_test=x[test], y_test=y[test]
  )


# Examples a generator makes per seed (`generated`); changing it changes
# every generated dataset that uses it.
CHUNK = 1024


def generated(count: int, make: Callable, seed: int, stream: int) -> tuple:
  """The first `count` examples of a generated stream, as a tuple of
  arrays: each chunk of `CHUNK` examples is made by `make(rng, n)` with its
  own seed `(seed, stream, chunk)`, which draws a whole chunk's numbers and
  returns its first `n` examples; so the first N examples are the same
  whatever `count` is (a run on fewer examples sees a prefix)."""
  parts = [
    make(
      np.random.default_rng([seed, stream, c]), min(CHUNK, count - c * CHUNK)
    )
    for c in range(-(-count // CHUNK))
  ]
  return tuple(np.concatenate(p) for p in zip(*parts))


def subset(
  arrays: dict,
  num_train: int | None,
  num_test: int | None,
  source: str | Path,
) -> dict:
  """The first `num_train` / `num_test` examples of each split (all when
  None), refused where `source` has fewer."""
  out = dict(arrays)
  for split, n in (("train", num_train), ("test", num_test)):
    if n is not None:
      have = len(out[f"x_{split}"])
      if n > have:
        raise ValueError(
          f"problem.data.num_{split}={n} asks for more {split} examples "
          f"than {source} has ({have}); choose at most {have}."
        )
      out[f"x_{split}"] = out[f"x_{split}"][:n]
      out[f"y_{split}"] = out[f"y_{split}"][:n]
  return out


def finished(name: str, arrays: dict, num_classes: int) -> Dataset:
  """The `Dataset` of split arrays, refused when a split is empty."""
  for split in ("train", "test"):
    if len(arrays[f"x_{split}"]) == 0:
      raise ValueError(
        f"The {name} data has no {split} examples; give "
        "problem.data sizes that leave some in each split."
      )
  return Dataset(
    name,
    arrays["x_train"].astype(np.float32),
    arrays["y_train"].astype(np.int32),
    arrays["x_test"].astype(np.float32),
    arrays["y_test"].astype(np.int32),
    num_classes,
  )


def data_dir(
  given: str | None,
  what: str,
  layout: Callable[[Path], str],
  fallback: Path | None = None,
) -> Path:
  """Where real data `what` is read from: `given`, else `$CURVBENCH_DATA`,
  else `fallback`; `layout(root)` says which files to put there."""
  path = given or os.environ.get("CURVBENCH_DATA") or fallback
  if not path:
    raise FileNotFoundError(
      f"{what} is read from disk, never downloaded: set "
      "problem.data.data_dir=/path/to/data or $CURVBENCH_DATA. "
      f"{layout(Path('<data_dir>'))}"
    )
  return Path(path).expanduser()


def find_file(root: Path, name: str) -> Path | None:
  """`root/name`, or its gzipped form, whichever exists."""
  for candidate in (root / name, root / f"{name}.gz"):
    if candidate.exists():
      return candidate
  return None
