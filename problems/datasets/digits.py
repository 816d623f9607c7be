"""scikit-learn's bundled 8x8 digits (1,797 of them), optionally upsampled."""

import dataclasses
import importlib.metadata

import numpy as np

from curvbench.components import Text, Whole, dotted, setting
from problems import data
from problems.datasets import DATASETS, DatasetSettings

NUM_DIGITS = 1797


def _build(size: int, num_test: int, seed: int) -> dict:
  # Loaded when the digits are built, not with the registry (1.5 s).
  from sklearn.datasets import load_digits  # noqa: PLC0415 - see above

  raw = load_digits()
  x = (raw.images / 16.0).astype(np.float32)
  if size != 8:
    from scipy.ndimage import zoom  # noqa: PLC0415 - as load_digits

    x = np.clip(zoom(x, (1, size / 8, size / 8), order=1), 0.0, 1.0)
  return data.shuffle_split(x[..., None], raw.target, num_test, seed)


@DATASETS.register
@dataclasses.dataclass
class Digits(DatasetSettings):
  """The 8x8 digits, bilinearly upsampled to `size` x `size`; `num_test`
  of them (a shuffle fixed by `seed`) are the test split."""

  name: str = "digits"
  size: int = setting(8, Whole(1), "image side in pixels (8: as bundled)")
  num_test: int = setting(297, Whole(1), "examples held out for testing")
  seed: int = setting(0, Whole(0, 2**32 - 1), "the shuffle before the split")
  cache: str | None = setting(
    None, Text(null=True), "cache directory of upsampled images"
  )

  def disagreements(self, prefix):
    yield from super().disagreements(prefix)
    if self.num_test >= NUM_DIGITS:
      yield (
        f"{dotted(prefix, 'num_test')}={self.num_test} leaves no "
        "training "
        f"examples: the digits set has {NUM_DIGITS} in all; choose "
        f"num_test between 1 and {NUM_DIGITS - 1}."
      )

  def source(self):
    return f"scikit-learn {importlib.metadata.version('scikit-learn')} digits"

  def available(self):
    return (NUM_DIGITS - self.num_test, self.num_test)

  def input_shape(self):
    return (self.size, self.size, 1)

  def load(self):
    spec = dict(size=self.size, num_test=self.num_test, seed=self.seed)
    if self.size == 8:
      arrays = _build(**spec)
    else:
      arrays = data.cached("digits", spec, _build, self.cache)
    return data.finished(
      f"digits{self.size}",
      data.subset(arrays, self.num_train, None, "the digits split"),
      10,
    )
