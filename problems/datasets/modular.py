"""Modular arithmetic sequences `a op b = c (mod p)`, as in Power et al.,
"Grokking: Generalization Beyond Overfitting on Small Algorithmic Datasets"
(2022): every equation over `0 <= a, b < p`, tokenised, split at random
(seeded) into a training and a test fraction."""

import dataclasses

import numpy as np

from curvbench.components import Number, OneOf, Text, Whole, setting
from problems import data
from problems.datasets import DATASETS, DatasetSettings

# Bump when `_build` changes what it makes: caches and runs then differ.
GENERATOR = 1
OPERATIONS = ("+", "-", "*", "/")


def equations(modulus: int, operation: str) -> np.ndarray:
  """All equations `(a, b, c)` with `c = a op b mod modulus`, one a row;
  division runs over `b != 0` (the modulus should be prime)."""
  a, b = (
    g.ravel()
    for g in np.meshgrid(np.arange(modulus), np.arange(modulus), indexing="ij")
  )
  if operation == "/":
    a, b = a[b != 0], b[b != 0]
    c = a * np.array([pow(int(v), -1, modulus) for v in b]) % modulus
  else:
    c = {"+": a + b, "-": a - b, "*": a * b}[operation] % modulus
  return np.stack([a, b, c], axis=1)


def _build(
  modulus: int, operation: str, train_fraction: float, seed: int
) -> dict:
  abc = equations(modulus, operation)
  op, eq = modulus, modulus + 1  # the two symbols after the numbers
  tokens = np.stack(
    [
      abc[:, 0],
      np.full(len(abc), op),
      abc[:, 1],
      np.full(len(abc), eq),
      abc[:, 2],
    ],
    axis=1,
  )
  x, y = tokens[:, :-1], tokens[:, 1:]  # next token at every position
  num_test = len(x) - int(round(train_fraction * len(x)))
  return data.shuffle_split(
    x.astype(np.int32), y.astype(np.int32), num_test, seed
  )


@DATASETS.register
@dataclasses.dataclass
class Modular(DatasetSettings):
  """Sequences `a op b =` of 4 tokens (numbers `0..p-1`, then `op` and `=`:
  a vocabulary of p + 2); the target at each position is the next token, the
  last one being `c`."""

  name: str = "modular"
  tokens = True
  modulus: int = setting(
    23, Whole(2), "p: numbers are taken mod p (prime for division)"
  )
  operation: str = setting("+", OneOf(OPERATIONS), "the operation op")
  train_fraction: float = setting(
    0.5, Number(0, 1, low_in=False), "share of all equations used for training"
  )
  seed: int = setting(0, Whole(0, 2**32 - 1), "the seed of the split")
  cache: str | None = setting(
    None, Text(null=True), "cache directory of generated sequences"
  )

  def source(self):
    return f"curvbench modular arithmetic generator {GENERATOR}"

  def available(self):
    total = self.modulus * (self.modulus - (self.operation == "/"))
    train = int(round(self.train_fraction * total))
    return (train, total - train)

  def disagreements(self, prefix):
    yield from super().disagreements(prefix)
    if 0 in self.available():
      yield (
        f"{prefix}.train_fraction={self.train_fraction} leaves a split "
        f"of the {sum(self.available())} equations empty; choose a "
        "fraction nearer 0.5 or a larger modulus."
      )
    if self.operation == "/" and any(
      self.modulus % k == 0 for k in range(2, int(self.modulus**0.5) + 1)
    ):
      yield (
        f"{prefix}.modulus={self.modulus} is not prime, so division "
        "mod it is not defined for every b != 0; choose a prime."
      )

  def input_shape(self):
    return (4,)

  def load(self):
    spec = dict(
      modulus=self.modulus,
      operation=self.operation,
      train_fraction=float(self.train_fraction),
      seed=self.seed,
    )
    arrays = data.cached("modular", spec, _build, self.cache)
    return data.finished(
      "modular",
      data.subset(
        arrays,
        self.num_train,
        self.num_test,
        f"modular arithmetic mod {self.modulus}",
      ),
      self.modulus + 2,
    )
