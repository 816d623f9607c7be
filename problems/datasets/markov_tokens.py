"""Generated token sequences for language models, a stand-in where no text
is at hand: each sequence is a walk of a random Markov chain over `vocab`
tokens, whose next token depends on the last `order` ones. Each context
has `branching` possible next tokens with Dirichlet(1)-random weights, so
the chain's entropy rate (at most log(branching) nats per token) lies far
below a guess's log(vocab), and what is left to learn is known exactly
(`Chain.entropy`)."""

import dataclasses

import numpy as np

from curvbench.components import Whole, dotted, setting
from problems import data
from problems.datasets import DATASETS, DatasetSettings

# Bump when `Chain` or `sequences` change what they make.
GENERATOR = 1


@dataclasses.dataclass(frozen=True)
class Chain:
  """A Markov chain of order `order` over `vocab` tokens: context `c` (the
  last `order` tokens read as a number in base `vocab`) is followed by
  `successors[c, j]` with probability `probs[c, j]`."""

  vocab: int
  order: int
  successors: np.ndarray  # (vocab**order, branching) int32
  probs: np.ndarray  # (vocab**order, branching), rows sum to 1

  @classmethod
  def random(cls, vocab: int, order: int, branching: int, seed: int):
    """A chain drawn from `seed`: for every context, `branching` distinct
    next tokens chosen uniformly and Dirichlet(1) weights over them."""
    rng = np.random.default_rng([seed, 1])
    contexts = vocab**order
    # `branching` distinct next tokens per context, a uniformly random
    # subset by Floyd's algorithm (memory `contexts * branching`, where a
    # permutation per context would take `contexts * vocab`).
    successors = np.empty((contexts, branching), np.int32)
    for i, top in enumerate(range(vocab - branching, vocab)):
      t = rng.integers(top + 1, size=contexts)
      taken = np.any(successors[:, :i] == t[:, None], axis=1)
      successors[:, i] = np.where(taken, top, t)
    probs = rng.dirichlet(np.ones(branching), size=contexts)
    return cls(vocab, order, successors, probs)

  def context(self, tokens: np.ndarray) -> np.ndarray:
    """The context index of each row's last `order` tokens."""
    c = np.zeros(len(tokens), np.int64)
    for t in tokens[:, -self.order :].T:
      c = c * self.vocab + t
    return c

  def entropy(self, tokens: np.ndarray) -> float:
    """The mean, over every position after the first `order`, of the
    chain's next-token entropy in nats: the loss a perfect model reaches."""
    p = self.probs
    h = -np.sum(p * np.log(np.maximum(p, 1e-300)), axis=1)
    windows = np.lib.stride_tricks.sliding_window_view(
      tokens, self.order, axis=1
    )[:, :-1]
    return float(np.mean(h[self.context(windows.reshape(-1, self.order))]))

  def walks(self, rng, count: int, length: int) -> np.ndarray:
    """`count` walks of `length` tokens, each from uniform first tokens."""
    out = np.empty((count, length), np.int32)
    out[:, : self.order] = rng.integers(self.vocab, size=(count, self.order))
    cumulative = np.cumsum(self.probs, axis=1)
    for t in range(self.order, length):
      c = self.context(out[:, :t])
      pick = np.sum(rng.random(count)[:, None] > cumulative[c], axis=1)
      out[:, t] = self.successors[c, np.minimum(pick, self.probs.shape[1] - 1)]
    return out


def sequences(
  chain: Chain, num_train: int, num_test: int, seq_len: int, seed: int
) -> dict:
  """Split arrays of walks: inputs the first `seq_len` tokens, targets the
  next token at every position; the first N walks of a split do not depend
  on how many are made."""

  def make(rng, n):
    walks = chain.walks(rng, data.CHUNK, seq_len + 1)[:n]  # whole chunks
    return walks[:, :-1], walks[:, 1:]

  x_train, y_train = data.generated(num_train, make, seed, 2)
  x_test, y_test = data.generated(num_test, make, seed, 3)
  return dict(x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)


@DATASETS.register
@dataclasses.dataclass
class MarkovTokens(DatasetSettings):
  """Walks of a random Markov chain: `seq_len` tokens an example, targets
  the next token at every position (vocabulary `vocab`)."""

  name: str = "markov_tokens"
  tokens = True
  num_train: int = setting(10000, Whole(1), "training sequences generated")
  num_test: int = setting(1000, Whole(1), "test sequences generated")
  vocab: int = setting(256, Whole(2), "tokens (256: as many as bytes)")
  order: int = setting(
    2, Whole(1, 2), "tokens the next one depends on (1 or 2)"
  )
  branching: int = setting(
    8,
    Whole(1),
    "possible next tokens of each context (entropy at most log(branching))",
  )
  seq_len: int = setting(
    16, Whole(1), "tokens per example (256: nanoGPT's context for characters)"
  )
  seed: int = setting(0, Whole(0, 2**32 - 1), "the generator's seed")

  def disagreements(self, prefix):
    yield from super().disagreements(prefix)
    if self.branching > self.vocab:
      yield (
        f"{dotted(prefix, 'branching')}={self.branching} is more "
        f"than the vocab={self.vocab} tokens; choose at most "
        f"{self.vocab}."
      )
    entries = self.vocab**self.order * self.branching
    if entries > 2**26:  # about 800 MB of transition table
      yield (
        f"{dotted(prefix, 'vocab')}={self.vocab} with order "
        f"{self.order} and branching {self.branching} makes a "
        f"transition table of {entries} entries, too many to keep; "
        "lower the vocab, the order or the branching."
      )

  def source(self):
    return f"curvbench Markov-chain token generator {GENERATOR}"

  def available(self):
    return (self.num_train, self.num_test)

  def input_shape(self):
    return (self.seq_len,)

  def chain(self) -> Chain:
    """The Markov chain these settings generate the sequences from."""
    return Chain.random(self.vocab, self.order, self.branching, self.seed)

  def load(self):
    arrays = sequences(
      self.chain(), self.num_train, self.num_test, self.seq_len, self.seed
    )
    return data.finished("markov_tokens", arrays, self.vocab)
