"""A character-level language model's data, from a UTF-8 text file the user
supplies (never downloaded): every character is a token, the vocabulary is
the characters the file holds, and each example is `seq_len` characters
whose targets are the next character at every position."""

import dataclasses
import os
from pathlib import Path

import numpy as np

from curvbench.components import Number, Text, Whole, setting
from problems import data
from problems.datafiles import DataFileError
from problems.datasets import DATASETS, DatasetSettings

FORMAT = ("a plain UTF-8 text file (any text, e.g. a book as .txt; each "
          "character is a token, so a few thousand characters or more)")


def _where(path: str | None) -> Path | None:
  """The file `path` names: relative paths are read from $CURVBENCH_DATA
  when it is set (else from the working directory)."""
  if path is None:
    return None
  p = Path(path).expanduser()
  root = os.environ.get("CURVBENCH_DATA")
  return Path(root).expanduser() / p if root and not p.is_absolute() else p


def read_text(path: str | None) -> str:
  """The file's text; a clear error when it is not set, missing or not
  UTF-8."""
  where = _where(path)
  if where is None or not where.is_file():
    said = ("problem.data.path is not set" if where is None else
            f"problem.data.path={path} names no file ({where} not found)")
    raise FileNotFoundError(
        f"The text dataset reads a file you supply: {said}. Put {FORMAT} "
        "where you like and set problem.data.path=/path/to/file.txt (a relative "
        "path is read from $CURVBENCH_DATA when set, else from the working "
        "directory).")
  try:
    return where.read_text(encoding="utf-8")
  except UnicodeDecodeError as e:
    raise DataFileError(f"{where} is not UTF-8 text ({e}); the text dataset "
                        f"needs {FORMAT}.") from e


def windows(text: str, seq_len: int, test_fraction: float) -> dict:
  """The text cut into windows of `seq_len + 1` characters (inputs: the
  first `seq_len`, targets: the last `seq_len`), the last `test_fraction`
  of the windows the test split; also the vocabulary."""
  vocab = sorted(set(text))
  ids = np.searchsorted(np.array(vocab), np.array(list(text))).astype(
      np.int32)
  count = (len(ids) - 1) // seq_len
  starts = np.arange(count) * seq_len
  w = ids[starts[:, None] + np.arange(seq_len + 1)]
  num_test = int(round(test_fraction * count))
  cut = count - num_test
  return dict(x_train=w[:cut, :-1], y_train=w[:cut, 1:],
              x_test=w[cut:, :-1], y_test=w[cut:, 1:], vocab=vocab)


@DATASETS.register
@dataclasses.dataclass
class CharText(DatasetSettings):
  """Windows of `seq_len` characters of the file at `path`, one after the
  other; the last `test_fraction` of them are the test split."""

  name: str = "text"
  tokens = True
  path: str | None = setting(None, Text(null=True),
                             "the UTF-8 text file to model (required)")
  seq_len: int = setting(16, Whole(1), "characters per example")
  test_fraction: float = setting(0.1, Number(0, 1, low_in=False),
                                 "share of the windows (the last ones) "
                                 "held out for testing")

  def source(self):
    return "character-level text"

  def files(self):
    where = _where(self.path)
    return [where] if where is not None and where.is_file() else []

  def available(self):
    if not self.files():
      return None
    arrays = windows(read_text(self.path), self.seq_len, self.test_fraction)
    return (len(arrays["x_train"]), len(arrays["x_test"]))

  def input_shape(self):
    return (self.seq_len,)

  def load(self):
    arrays = windows(read_text(self.path), self.seq_len, self.test_fraction)
    vocab = arrays.pop("vocab")
    return data.finished("text", data.subset(
        arrays, self.num_train, self.num_test, f"the text in {self.path}"),
        len(vocab))
