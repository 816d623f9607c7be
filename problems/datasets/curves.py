"""CURVES (Hinton & Salakhutdinov, 2006): smooth curves inked into images,
generated here (the K-FAC paper's 20k / 10k split by default)."""

import dataclasses

import numpy as np

from curvbench.components import Number, Text, Whole, setting
from problems import data
from problems.datasets import DATASETS, DatasetSettings

# Bump when `_build` changes what it draws: caches and runs then differ.
GENERATOR = 1


def ink_curves(
  points: np.ndarray, size: int = 28, width: float = 0.7, samples: int = 128
) -> np.ndarray:
  """Images `(n, size, size)` of natural cubic splines through `points`.

  `points` is `(n, k, 2)` in pixel units; a pixel's ink is
  `exp(-d^2 / (2 width^2))` with `d` its distance to the curve.
  """
  # Loaded when curves are drawn, not with the registry (0.6 s).
  from scipy.interpolate import CubicSpline  # noqa: PLC0415 - see above

  n, k, _ = points.shape
  t = np.linspace(0.0, 1.0, k)
  spline = CubicSpline(t, points, axis=1, bc_type="natural")
  curve = spline(np.linspace(0.0, 1.0, samples))  # (n, samples, 2)
  centres = (
    np.stack(
      np.meshgrid(np.arange(size), np.arange(size), indexing="ij"), -1
    ).reshape(-1, 2)
    + 0.5
  )
  images = np.empty((n, size * size), np.float32)
  for start in range(0, n, 256):
    c = curve[start : start + 256]
    d2 = ((centres[None, :, None, :] - c[:, None, :, :]) ** 2).sum(-1).min(-1)
    images[start : start + 256] = np.exp(-d2 / (2 * width**2))
  return images.reshape(n, size, size)


def _build(
  num_train: int,
  num_test: int,
  seed: int,
  num_points: int,
  size: int,
  width: float,
) -> dict:
  rng = np.random.default_rng(seed)
  margin = 2.0
  n = num_train + num_test
  points = rng.uniform(margin, size - margin, (n, num_points, 2))
  x = ink_curves(points, size, width)[..., None]
  zeros = np.zeros(n, np.int32)  # unlabelled: the task is reconstruction
  return dict(
    x_train=x[:num_train],
    y_train=zeros[:num_train],
    x_test=x[num_train:],
    y_test=zeros[num_train:],
  )


@DATASETS.register
@dataclasses.dataclass
class Curves(DatasetSettings):
  """Each image a natural cubic spline through `num_points` points drawn
  uniformly in the image, inked with a Gaussian pen of std `width` pixels."""

  name: str = "curves"
  num_train: int = setting(20000, Whole(1), "training images generated")
  num_test: int = setting(10000, Whole(1), "test images generated")
  seed: int = setting(0, Whole(0, 2**32 - 1), "the generator's seed")
  num_points: int = setting(3, Whole(2), "points each curve passes through")
  size: int = setting(28, Whole(1), "image side in pixels")
  width: float = setting(0.7, Number(0, low_in=False), "pen width in pixels")
  cache: str | None = setting(
    None, Text(null=True), "cache directory of generated images"
  )

  def source(self):
    return f"curvbench CURVES generator {GENERATOR}"

  def available(self):
    return (self.num_train, self.num_test)

  def input_shape(self):
    return (self.size, self.size, 1)

  def load(self):
    spec = dict(
      num_train=self.num_train,
      num_test=self.num_test,
      seed=self.seed,
      num_points=self.num_points,
      size=self.size,
      width=float(self.width),
    )
    return data.finished(
      "curves", data.cached("curves", spec, _build, self.cache), 1
    )
