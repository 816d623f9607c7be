"""Problems at the sizes papers report and the data they run on offline:
ResNet-18 and the GPT sizes hold the parameter counts their formulas give;
the synthetic datasets are fixed by their seed, shaped as stated and
learnable; CIFAR-10 and text fall back to them only when asked, and say so;
byte-level text round-trips; the tiny variants give a finite loss and
gradient."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import problems
from curvbench import config
from problems import DATASETS, Dataset
from problems.datasets import cifar10, markov_tokens, synthetic_images, text
from problems.models import gpt


def resnet_cifar_count(widths, blocks, channels=3, classes=10):
  """Parameters of a CIFAR ResNet with batch norm: a 3x3 stem, stages of
  basic blocks (two 3x3 convolutions, each normalised; a normalised 1x1
  projection where the stride or width changes), a dense classifier."""
  count = 9 * channels * widths[0] + 2 * widths[0]
  before = widths[0]
  for stage, width in enumerate(widths):
    for block in range(blocks):
      count += 9 * before * width + 9 * width * width + 4 * width
      if before != width or (stage > 0 and block == 0):
        count += before * width + 2 * width
      before = width
  return count + before * classes + classes


def gpt_count(layers, width, vocab, seq_len, tied=True):
  """Per block: four width x width attention projections and a 4x MLP, all
  with biases, and two layer norms; token and position tables; a final
  layer norm; an output layer with bias unless tied."""
  d = width
  count = layers * (12 * d * d + 13 * d) + (vocab + seq_len) * d + 2 * d
  return count if tied else count + d * vocab + vocab


def tokens_dataset(vocab, seq_len):
  x = np.zeros((2, seq_len), np.float32)
  y = np.zeros((2, seq_len), np.int32)
  return Dataset("shapes only", x, y, x, y, vocab)


@pytest.fixture
def no_cifar(tmp_path, monkeypatch):
  monkeypatch.delenv("CURVBENCH_DATA", raising=False)
  (tmp_path / "empty").mkdir()
  return str(tmp_path / "empty")


def test_resnet18_preset_is_resnet18_for_cifar(no_cifar):
  cfg = config.compose(
    "problem=resnet18",
    f"problem.data.data_dir={no_cifar}",
    "problem.data.num_train=128",
    "problem.data.num_test=8",
  )
  problem = problems.make(cfg.problem)
  assert resnet_cifar_count([64, 128, 256, 512], 2) == 11_173_962
  assert problem.num_params == 11_173_962
  assert problem.batch_size == 128 and problem.has_state  # batch norm
  names = jax.eval_shape(problem.init_params, jax.random.PRNGKey(0))
  projections = sorted(
    n for n in names if "shortcut_norm" not in n and "shortcut" in n
  )
  assert projections == [f"stage{s}_block0_shortcut" for s in (1, 2, 3)]


def test_resnet18_tiny_keeps_resnet18s_structure():
  cfg = config.compose("problem=resnet18_tiny")
  problem = problems.make(cfg.problem)
  assert problem.num_params == resnet_cifar_count([4, 8, 8, 16], 2)
  assert problem.data.input_shape == (8, 8, 3)


@pytest.mark.parametrize("tied", [True, False])
def test_gpt_sizes_hold_their_formulas_parameters(tied):
  for size, (layers, width, heads) in gpt.SIZES.items():
    settings = gpt.GPT(size=size, tied=tied, batch_size=1)
    problem = settings.build(tokens_dataset(256, 256))
    assert width % heads == 0
    assert problem.num_params == gpt_count(layers, width, 256, 256, tied), size
  small = gpt.GPT(size="gpt2-small", batch_size=1).build(
    tokens_dataset(50257, 1024)
  )
  assert small.num_params == 124_439_808  # GPT-2 small's "124M"


def probe_accuracy(d):
  """Held-out accuracy of a ridge-regression linear probe on the pixels."""

  def design(x):
    return np.c_[x.reshape(len(x), -1), np.ones(len(x))]

  a = design(d.x_train)
  w = np.linalg.solve(
    a.T @ a + np.eye(a.shape[1]), a.T @ np.eye(d.num_classes)[d.y_train]
  )
  return np.mean(np.argmax(design(d.x_test) @ w, axis=1) == d.y_test)


def test_synthetic_images_are_fixed_by_seed_shaped_and_learnable():
  settings = synthetic_images.SyntheticImages(
    size=8, num_train=2000, num_test=500
  )
  d = settings.load()
  assert d.x_train.shape == (2000, 8, 8, 3) and d.x_test.shape == (500, 8, 8, 3)
  assert d.x_train.dtype == np.float32 and d.y_train.dtype == np.int32
  assert 0.0 <= d.x_train.min() and d.x_train.max() <= 1.0
  assert set(np.unique(d.y_train)) == set(range(10)) and d.num_classes == 10
  again = dataclasses.replace(settings, num_train=100).load()
  np.testing.assert_array_equal(again.x_train, d.x_train[:100])
  np.testing.assert_array_equal(again.x_test, d.x_test)
  other = dataclasses.replace(settings, seed=1).load()
  assert not np.allclose(other.x_train, d.x_train)
  assert probe_accuracy(d) > 0.35  # chance: 0.1
  assert "synthetic image generator" in settings.source()
  assert synthetic_images.SyntheticImages().input_shape() == (32, 32, 3)


def test_markov_tokens_are_fixed_by_seed_next_tokens_and_learnable():
  settings = markov_tokens.MarkovTokens(seq_len=12, num_train=300, num_test=50)
  d = settings.load()
  assert d.x_train.shape == (300, 12) and d.y_test.shape == (50, 12)
  assert d.num_classes == 256 and settings.tokens
  np.testing.assert_array_equal(d.x_train[:, 1:], d.y_train[:, :-1])
  assert 0 <= d.x_train.min() and d.y_train.max() < 256
  np.testing.assert_array_equal(
    dataclasses.replace(settings, num_train=30).load().x_train, d.x_train[:30]
  )
  other = dataclasses.replace(settings, seed=1).load()
  assert not np.array_equal(other.x_train, d.x_train)
  chain = settings.chain()
  assert all(
    len(set(row)) == chain.successors.shape[1] for row in chain.successors[:500]
  )
  np.testing.assert_allclose(chain.probs.sum(axis=1), 1.0)
  walks = np.concatenate([d.x_train, d.y_train[:, -1:]], axis=1).astype(int)
  # Every step is one of its context's successors...
  context = chain.context(walks[:, 4:6])
  assert np.all(np.any(chain.successors[context] == walks[:, 6:7], axis=1))
  # ...and what is left to learn is far below a uniform guess's log(256).
  assert chain.entropy(walks) < min(np.log(8), 0.4 * np.log(256))
  assert "Markov-chain token generator" in settings.source()


def test_cifar10_falls_back_to_synthetic_images_only_when_asked(
  no_cifar, tmp_path
):
  with pytest.raises(FileNotFoundError, match="No CIFAR-10 files"):
    cifar10.CIFAR10(data_dir=no_cifar).load()
  stand_in = cifar10.CIFAR10(
    data_dir=no_cifar, when_missing="synthetic", num_train=20, num_test=10
  )
  d = stand_in.load()
  assert d.name == "cifar10" and d.num_classes == 10
  assert d.x_train.shape == (20, 32, 32, 3)
  assert d.x_test.shape == (10, 32, 32, 3)
  assert stand_in.source().startswith("synthetic images of CIFAR-10's shape")
  assert stand_in.fingerprint().startswith("synthetic images")
  assert stand_in.sizes() == (20, 10) and stand_in.files() == []
  # No data directory at all is no files too.
  d2 = cifar10.CIFAR10(
    when_missing="synthetic", num_train=20, num_test=10
  ).load()
  np.testing.assert_array_equal(d2.x_train, d.x_train)
  # Real files are read whatever `when_missing` says.
  rng = np.random.default_rng(0)
  np.savez(
    tmp_path / "cifar10.npz",
    x_train=rng.integers(0, 256, (4, 32, 32, 3)),
    y_train=np.arange(4),
    x_test=np.zeros((2, 32, 32, 3)),
    y_test=np.array([1, 2]),
  )
  real = cifar10.CIFAR10(data_dir=str(tmp_path), when_missing="synthetic")
  assert real.source() == "CIFAR-10" and real.load().x_train.shape[0] == 4


def test_byte_level_text_round_trips_and_text_falls_back_when_asked(
  tmp_path, monkeypatch
):
  monkeypatch.delenv("CURVBENCH_DATA", raising=False)
  words = "naïve café — 数据 ✓ " * 30
  path = tmp_path / "book.txt"
  path.write_text(words, encoding="utf-8")
  raw = words.encode("utf-8")
  byte = text.TextFile(
    path=str(path), level="byte", seq_len=10, test_fraction=0.2
  )
  d = byte.load()
  assert d.num_classes == 256 and byte.source() == "byte-level text"
  ids = np.concatenate([d.x_train, d.x_test]).ravel().astype(np.uint8)
  assert ids.tobytes() == raw[: len(ids)]
  np.testing.assert_array_equal(d.x_train[:, 1:], d.y_train[:, :-1])
  assert len(ids) == (len(raw) - 1) // 10 * 10
  chars = text.TextFile(path=str(path), seq_len=10).load()
  assert chars.num_classes == len(set(words))  # level=char, as before
  with pytest.raises(FileNotFoundError, match="when_missing=synthetic"):
    text.TextFile().load()
  stand_in = text.TextFile(
    when_missing="synthetic", seq_len=6, num_train=8, num_test=4
  )
  s = stand_in.load()
  assert s.name == "text" and s.x_train.shape == (8, 6) and s.num_classes == 256
  assert stand_in.source().startswith("synthetic Markov-chain tokens")


def test_gpt_text_preset_is_10m_at_byte_level():
  cfg = config.compose("problem=gpt_text")
  assert cfg.problem.size == "10M" and cfg.problem.data.level == "byte"
  data = DATASETS.load(dict(cfg.problem.data))
  assert data.input_shape() == (256,)


@pytest.mark.parametrize(
  "overrides",
  [
    ("problem=resnet18_tiny", "problem.batch_size=4"),
    (
      "problem=gpt",
      "problem.data.seq_len=6",
      "problem.data.num_train=16",
      "problem.data.num_test=4",
      "problem.batch_size=4",
    ),
  ],
)
def test_tiny_variants_give_a_finite_loss_and_gradient(overrides):
  problem = problems.make(config.compose(*overrides).problem)
  params = problem.init_params(jax.random.PRNGKey(0), jnp.float64)
  batch = problem.fixed_batch(dtype=np.float64)
  loss, grads = jax.jit(jax.value_and_grad(problem.loss_fn))(params, batch)
  assert np.isfinite(loss) and loss > 0
  assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
  assert any(np.any(g != 0) for g in jax.tree.leaves(grads))
