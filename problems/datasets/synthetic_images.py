"""Generated image classification, a stand-in where no real images are at
hand: each class is a smooth random prototype image, and an example is its
class's prototype moved by a few pixels, blended with a smooth random image
of its own (clutter), plus pixel noise, clipped to [0, 1]. Learnable (at
the defaults a ridge-regression linear probe on 10,000 images scores about
80% on held-out ones, chance being 10%) yet not solved by a linear model,
and deterministic given the settings."""

import dataclasses

import numpy as np

from curvbench.components import Number, Whole, dotted, setting
from problems import data
from problems.datasets import DATASETS, DatasetSettings

# Bump when `images` changes what it makes: runs on the old data then differ.
GENERATOR = 1
GRID = 4  # prototype detail: a GRID x GRID random image, smoothly upsampled


def _upsampling(size: int) -> np.ndarray:
  """The `(size, GRID)` matrix of linear interpolation from GRID points."""
  where = np.arange(size) * (GRID - 1) / max(size - 1, 1)
  return np.maximum(0.0, 1.0 - np.abs(where[:, None] - np.arange(GRID)))


def smooth(rng, count: int, size: int, channels: int) -> np.ndarray:
  """`count` smooth random images `(count, size, size, channels)` in [0, 1]."""
  grid = rng.random((count, GRID, GRID, channels), np.float32)
  up = _upsampling(size).astype(np.float32)
  return np.einsum("ia,jb,nabc->nijc", up, up, grid, optimize=True)


def prototypes(
  size: int, channels: int, num_classes: int, seed: int
) -> np.ndarray:
  """Each class's prototype, `(num_classes, size, size, channels)` in [0, 1]."""
  return smooth(np.random.default_rng([seed, 1]), num_classes, size, channels)


def images(
  num_train: int,
  num_test: int,
  *,
  size: int,
  channels: int,
  num_classes: int,
  clutter: float,
  noise: float,
  seed: int,
) -> dict:
  """The split arrays: float32 images `(N, size, size, channels)` in [0, 1]
  and int32 labels; the first N examples of a split do not depend on how
  many are made."""
  protos = prototypes(size, channels, num_classes, seed)
  reach = size // 8  # the largest shift, in pixels
  # Every prototype at every shift: (shift, class, size, size, channels).
  moved = np.stack(
    [
      np.roll(protos, (dy, dx), axis=(1, 2))
      for dy in range(-reach, reach + 1)
      for dx in range(-reach, reach + 1)
    ]
  )

  def make(rng, n):
    n_made = data.CHUNK  # always a whole chunk: the same draws for any n
    y = rng.integers(num_classes, size=n_made).astype(np.int32)
    shift = rng.integers(len(moved), size=n_made)
    x = moved[shift, y]
    x = (1 - clutter) * x + clutter * smooth(rng, n_made, size, channels)
    x += np.float32(noise) * rng.standard_normal(x.shape, np.float32)
    return np.clip(x[:n], 0.0, 1.0), y[:n]

  x_train, y_train = data.generated(num_train, make, seed, 2)
  x_test, y_test = data.generated(num_test, make, seed, 3)
  return dict(x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)


def source() -> str:
  """Names the generator and its version, which identify the images."""
  return f"curvbench synthetic image generator {GENERATOR}"


@DATASETS.register
@dataclasses.dataclass
class SyntheticImages(DatasetSettings):
  """Generated `size x size x channels` images of `num_classes` classes
  (CIFAR-10's shape by default); clutter and pixel noise set how hard
  it is."""

  name: str = "synthetic_images"
  num_train: int = setting(10000, Whole(1), "training images generated")
  num_test: int = setting(2000, Whole(1), "test images generated")
  size: int = setting(32, Whole(1), "image side in pixels")
  channels: int = setting(3, Whole(1), "colour channels")
  num_classes: int = setting(10, Whole(2), "classes (one prototype each)")
  clutter: float = setting(
    0.65,
    Number(0, 1),
    "share of each image that "
    "is a random smooth image of its own (the rest "
    "is its class's prototype): higher is harder",
  )
  noise: float = setting(
    0.2,
    Number(0),
    "standard deviation of the pixel "
    "noise added to each example (before clipping)",
  )
  seed: int = setting(0, Whole(0, 2**32 - 1), "the generator's seed")

  def disagreements(self, prefix):
    yield from super().disagreements(prefix)
    pixels = (self.num_train + self.num_test) * self.size**2 * self.channels
    if pixels > 2**31:  # float32: 8 GiB and more
      yield (
        f"{dotted(prefix, 'num_train')}: {pixels} pixels would take "
        f"{4 * pixels / 2**30:.0f} GiB of memory; generate fewer or "
        "smaller images."
      )

  def source(self):
    return source()

  def available(self):
    return (self.num_train, self.num_test)

  def input_shape(self):
    return (self.size, self.size, self.channels)

  def load(self):
    arrays = images(
      self.num_train,
      self.num_test,
      size=self.size,
      channels=self.channels,
      num_classes=self.num_classes,
      clutter=self.clutter,
      noise=self.noise,
      seed=self.seed,
    )
    return data.finished("synthetic_images", arrays, self.num_classes)
