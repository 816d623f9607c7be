"""A language model's data from a text file the user supplies (never
downloaded), at character level (every character a token, the vocabulary
the characters the file holds) or byte level (every byte a token, a
vocabulary of 256: any file, UTF-8 text as its bytes); each example is
`seq_len` tokens whose targets are the next token at every position. With
`when_missing=synthetic`, no file means Markov-chain tokens
(`markov_tokens`), which the source, and so the run's identity, says."""

import dataclasses
import os
from pathlib import Path
from typing import cast

import numpy as np

from curvbench.components import Number, OneOf, Text, Whole, setting
from problems import data
from problems.datafiles import DataFileError
from problems.datasets import DATASETS, DatasetSettings, markov_tokens

FORMAT = (
  "a plain text file (any text, e.g. a book as .txt; UTF-8 for "
  "level=char; a few thousand characters or more)"
)


def _where(path: str | None) -> Path | None:
  """The file `path` names: relative paths are read from $CURVBENCH_DATA
  when it is set (else from the working directory)."""
  if path is None:
    return None
  p = Path(path).expanduser()
  root = os.environ.get("CURVBENCH_DATA")
  return Path(root).expanduser() / p if root and not p.is_absolute() else p


def _missing(path: str | None) -> str | None:
  """Why `path` names no file to read (None where it does)."""
  where = _where(path)
  if where is None:
    return "problem.data.path is not set"
  if not where.is_file():
    return f"problem.data.path={path} names no file ({where} not found)"
  return None


def _file(path: str | None) -> Path:
  """The file `path` names; a clear error when it is not set or missing."""
  why = _missing(path)
  if why is not None:
    raise FileNotFoundError(
      f"The text dataset reads a file you supply: {why}. Put {FORMAT} "
      "where you like and set problem.data.path=/path/to/file.txt (a "
      "relative path is read from $CURVBENCH_DATA when set, else from the "
      "working directory), or set problem.data.when_missing=synthetic "
      "for generated tokens."
    )
  return cast(Path, _where(path))  # a file there: `_missing` found it


def read_text(path: str | None) -> str:
  """The file's text; a clear error when it is not set, missing or not
  UTF-8."""
  where = _file(path)
  try:
    return where.read_text(encoding="utf-8")
  except UnicodeDecodeError as e:
    raise DataFileError(
      f"{where} is not UTF-8 text ({e}); level=char needs "
      f"{FORMAT}, level=byte reads any file."
    ) from e


def token_ids(path: str | None, level: str) -> tuple[np.ndarray, int]:
  """The file's tokens as ids, and the vocabulary's size: its distinct
  characters in code-point order (`char`), or its bytes (`byte`, 256)."""
  if level == "byte":
    raw = np.frombuffer(_file(path).read_bytes(), np.uint8)
    return raw.astype(np.int32), 256
  text = read_text(path)
  vocab = sorted(set(text))
  return np.searchsorted(np.array(vocab), np.array(list(text))).astype(
    np.int32
  ), len(vocab)


def windows(ids: np.ndarray, seq_len: int, test_fraction: float) -> dict:
  """`ids` cut into windows of `seq_len + 1` tokens (inputs: the first
  `seq_len`, targets: the last `seq_len`), the last `test_fraction` of the
  windows the test split."""
  count = (len(ids) - 1) // seq_len
  starts = np.arange(count) * seq_len
  w = ids[starts[:, None] + np.arange(seq_len + 1)]
  num_test = int(round(test_fraction * count))
  cut = count - num_test
  return dict(
    x_train=w[:cut, :-1],
    y_train=w[:cut, 1:],
    x_test=w[cut:, :-1],
    y_test=w[cut:, 1:],
  )


@DATASETS.register
@dataclasses.dataclass
class TextFile(DatasetSettings):
  """Windows of `seq_len` tokens of the file at `path`, one after the
  other; the last `test_fraction` of them are the test split."""

  name: str = "text"
  tokens = True
  path: str | None = setting(
    None, Text(null=True), "the text file to model (required)"
  )
  level: str = setting(
    "char",
    OneOf(("char", "byte")),
    "what a token is: "
    "a character (the vocabulary: those in the file) or "
    "a byte (vocabulary 256)",
  )
  seq_len: int = setting(16, Whole(1), "tokens per example")
  test_fraction: float = setting(
    0.1,
    Number(0, 1, low_in=False),
    "share of the windows (the last ones) held out for testing",
  )
  when_missing: str = setting(
    "error",
    OneOf(("error", "synthetic")),
    "no file at path: stop with "
    "an error saying what to supply, or use synthetic Markov-chain tokens "
    "(markov_tokens, vocabulary 256; the data's source says which)",
  )

  def stand_in(self) -> markov_tokens.MarkovTokens | None:
    """The generated tokens used instead, where `when_missing=synthetic`
    and there is no file."""
    if self.when_missing != "synthetic" or _missing(self.path) is None:
      return None
    defaults = markov_tokens.MarkovTokens()
    return markov_tokens.MarkovTokens(
      num_train=self.num_train or defaults.num_train,
      num_test=self.num_test or defaults.num_test,
      seq_len=self.seq_len,
    )

  def source(self):
    if (stand_in := self.stand_in()) is not None:
      return (
        f"synthetic Markov-chain tokens (no text file found), "
        f"{stand_in.source()}"
      )
    return f"{'character' if self.level == 'char' else 'byte'}-level text"

  def files(self):
    return [] if _missing(self.path) else [_where(self.path)]

  def available(self):
    if (stand_in := self.stand_in()) is not None:
      return stand_in.available()
    if not self.files():
      return None
    arrays = windows(
      token_ids(self.path, self.level)[0], self.seq_len, self.test_fraction
    )
    return (len(arrays["x_train"]), len(arrays["x_test"]))

  def input_shape(self):
    return (self.seq_len,)

  def load(self):
    if (stand_in := self.stand_in()) is not None:
      return dataclasses.replace(stand_in.load(), name="text")
    ids, vocab = token_ids(self.path, self.level)
    arrays = windows(ids, self.seq_len, self.test_fraction)
    return data.finished(
      "text",
      data.subset(
        arrays, self.num_train, self.num_test, f"the text in {self.path}"
      ),
      vocab,
    )
