"""Reading and checking the data files the loaders use.

Every read is checked (format, keys, shapes, dtypes, value ranges, counts,
and the checksum `problems.fetch` records); a bad file raises
`DataFileError` naming it and how to get a good copy (`fix`, which ends
every message).
"""

from __future__ import annotations

import gzip
import hashlib
import os
import uuid
import zipfile
import zlib
from pathlib import Path

import numpy as np


class DataFileError(ValueError):
  """A data file that cannot be read or holds the wrong content."""


def save_npz(path: Path, arrays: dict, compressed: bool = False) -> None:
  """Writes `arrays` to `path` through a temporary file, so `path` is absent
  or whole; the file gets the mode a plain `open` gives (the umask's)."""
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
  try:
    with open(tmp, "xb") as f:
      (np.savez_compressed if compressed else np.savez)(f, **arrays)
    os.replace(tmp, path)
  finally:
    tmp.unlink(missing_ok=True)


# The arrays of a dataset file.
SPLIT_KEYS = ("x_train", "y_train", "x_test", "y_test")


def file_sha256(path: Path) -> str:
  """The sha256 of a file's bytes."""
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      digest.update(block)
  return digest.hexdigest()


def arrays_sha256(arrays: dict) -> str:
  """A digest of named arrays: names, dtypes, shapes and contents."""
  digest = hashlib.sha256()
  for key in sorted(arrays):
    a = np.ascontiguousarray(arrays[key])
    digest.update(f"{key}:{a.dtype.str}:{a.shape};".encode())
    digest.update(a.tobytes())
  return digest.hexdigest()


def read_npz(path: Path, keys, fix: str, checksum: bool = False) -> dict:
  """The arrays `keys` of the `.npz` archive `path`, checked against the
  `sha256` entry where the archive has one (`problems.fetch` and the caches
  of generated data write it; `checksum` requires it). `fix` says how to
  get a good file; it ends every error message."""
  with open(path, "rb") as f:
    start = f.read(4)
  if start != b"PK\x03\x04":
    raise DataFileError(
      f"{path} is not an .npz archive (a zip of .npy arrays): it starts "
      f"with the bytes {start!r}. {fix}".rstrip()
    )
  try:
    with np.load(path, allow_pickle=False) as f:
      missing = [k for k in keys if k not in f.files]
      if missing:
        raise DataFileError(
          f"{path} lacks the arrays {', '.join(missing)} (it holds "
          f"{', '.join(f.files) or 'none'}; expected {', '.join(keys)}). "
          f"{fix}".rstrip()
        )
      arrays = {k: f[k] for k in keys}
      recorded = str(f["sha256"]) if "sha256" in f.files else None
  except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as e:
    if isinstance(e, DataFileError):
      raise
    raise DataFileError(
      f"{path} is a damaged .npz archive ({e}). {fix}".rstrip()
    ) from e
  if recorded is None and checksum:
    raise DataFileError(
      f"{path} holds no sha256 of its arrays, so they "
      f"cannot be checked. {fix}".rstrip()
    )
  if recorded is not None and arrays_sha256(arrays) != recorded:
    raise DataFileError(
      f"{path}'s arrays do not match the sha256 recorded when it was "
      f"written ({recorded[:12]}...): the file was damaged or edited. "
      f"{fix}".rstrip()
    )
  return arrays


def leading_lengths(path: Path, keys) -> dict[str, int] | None:
  """The length of each array `keys` of an .npz archive, from the arrays'
  headers (nothing else is read); None where the file cannot tell."""
  try:
    with zipfile.ZipFile(path) as archive:
      out = {}
      for key in keys:
        with archive.open(f"{key}.npy") as f:
          read = {
            (1, 0): np.lib.format.read_array_header_1_0,
            (2, 0): np.lib.format.read_array_header_2_0,
          }.get(np.lib.format.read_magic(f))
          if read is None:
            return None
          shape = read(f)[0]
          out[key] = int(shape[0]) if shape else 0
      return out
  except (OSError, KeyError, ValueError, zipfile.BadZipFile):
    return None


def idx_length(path: Path) -> int | None:
  """The length (first dimension) an IDX file's header gives; None where
  it cannot be read."""
  opener = gzip.open if path.suffix == ".gz" else open
  try:
    with opener(path, "rb") as f:
      header = f.read(8)
  except (OSError, EOFError, zlib.error):
    return None
  return int.from_bytes(header[4:8], "big") if len(header) == 8 else None


def read_idx(path: Path, ndim: int, fix: str) -> np.ndarray:
  """An IDX file of unsigned bytes with `ndim` dimensions, checked."""
  opener = gzip.open if path.suffix == ".gz" else open
  try:
    with opener(path, "rb") as f:
      data = f.read()
  except (OSError, EOFError, zlib.error) as e:
    raise DataFileError(f"{path} cannot be read ({e}). {fix}") from e
  header = 4 + 4 * ndim
  if len(data) < header or data[:4] != bytes([0, 0, 8, ndim]):
    raise DataFileError(
      f"{path} is not an IDX file of unsigned bytes with {ndim} "
      f"dimension(s): its header is {data[:4].hex() or 'empty'}, expected "
      f"{bytes([0, 0, 8, ndim]).hex()}. {fix}"
    )
  shape = tuple(
    int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)
  )
  size = int(np.prod(shape))
  if len(data) - header != size:
    raise DataFileError(
      f"{path} is {'truncated' if len(data) - header < size else 'too long'}"
      f": its header promises {size} bytes of data for shape {shape}, it "
      f"holds {len(data) - header}. {fix}"
    )
  return np.frombuffer(data, np.uint8, offset=header).reshape(shape)


def _check_images(x, path, split: str, shapes, fix: str) -> np.ndarray:
  """`x` (pixel values 0..255) reshaped to `shapes[0]` per example, or an
  error naming the file; `shapes` lists the accepted per-example shapes."""
  name = f"{path}: x_{split}"
  if not (
    np.issubdtype(x.dtype, np.integer) or np.issubdtype(x.dtype, np.floating)
  ):
    raise DataFileError(
      f"{name} has dtype {x.dtype}; images must be "
      f"numbers (uint8 pixel values 0..255). {fix}"
    )
  if x.ndim < 1 or len(x) == 0:
    raise DataFileError(f"{name} holds no images (shape {x.shape}). {fix}")
  if tuple(x.shape[1:]) not in shapes:
    h, w, c = (shapes[0] + (0, 0, 0))[:3]
    hint = (
      " (channels first: transpose it to NHWC)"
      if x.shape[1:] == (c, h, w)
      else ""
    )
    raise DataFileError(
      f"{name} has shape {x.shape}; each image must have shape "
      f"{' or '.join(map(str, shapes))}{hint}. {fix}"
    )
  if not np.issubdtype(x.dtype, np.uint8):
    lo, hi = float(np.min(x)), float(np.max(x))
    if not (np.isfinite(lo) and np.isfinite(hi) and 0 <= lo and hi <= 255):
      raise DataFileError(
        f"{name} has values in [{lo:g}, {hi:g}]; pixel "
        f"values must lie in 0..255. {fix}"
      )
    if np.issubdtype(x.dtype, np.floating) and np.any(x != np.round(x)):
      raise DataFileError(
        f"{name} holds fractional values in [{lo:g}, {hi:g}]; store the "
        f"pixel values 0..255 (uint8), not values already scaled. {fix}"
      )
  return x.reshape((len(x),) + shapes[0])


def _check_labels(
  y, num_images: int, num_classes: int, path, split: str, fix: str
) -> np.ndarray:
  """`y` as a vector of `num_images` class indices, or an error."""
  name = f"{path}: y_{split}"
  if y.ndim == 2 and y.shape[1] == 1:
    y = y[:, 0]
  if y.ndim != 1 or len(y) != num_images:
    raise DataFileError(
      f"{name} has shape {y.shape}; expected one label per "
      f"image, ({num_images},). {fix}"
    )
  if not (
    np.issubdtype(y.dtype, np.integer)
    or (np.issubdtype(y.dtype, np.floating) and np.all(y == np.round(y)))
  ):
    raise DataFileError(
      f"{name} has dtype {y.dtype}; labels must be whole numbers. {fix}"
    )
  if y.min() < 0 or y.max() >= num_classes:
    raise DataFileError(
      f"{name} has labels in [{y.min()}, {y.max()}]; "
      f"expected 0..{num_classes - 1}. {fix}"
    )
  return y


def check_splits(arrays: dict, path, shapes, num_classes, fix) -> dict:
  """The four split arrays of an image file, checked, or a DataFileError.

  Args:
    arrays: the file's arrays, at least those named in `SPLIT_KEYS`.
    path: the file, named in the errors.
    shapes: the accepted shapes of one image; the images are reshaped to
      the first (pixel values are kept, 0..255, not scaled).
    num_classes: labels must lie in `0..num_classes - 1`.
    fix: what an error adds to say how to get a good copy.

  Returns:
    `x_train`, `y_train`, `x_test` and `y_test`, the labels as vectors of
    one class index per image.
  """
  out = {}
  for split in ("train", "test"):
    x = _check_images(arrays[f"x_{split}"], path, split, shapes, fix)
    out[f"x_{split}"] = x
    out[f"y_{split}"] = _check_labels(
      arrays[f"y_{split}"], len(x), num_classes, path, split, fix
    )
  return out
