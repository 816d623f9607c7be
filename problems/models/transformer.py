"""A small decoder-only transformer (Vaswani et al., "Attention Is All You
Need", NeurIPS 2017, with the pre-norm blocks of GPT-2) for next-token
prediction on token sequences: the modular arithmetic of Power et al. (2022)
or the characters or bytes of a text file. Its decoder (`Decoder`) is also
the `gpt` problem's.

No layer is tagged by hand; automatic registration finds them all: the
token and position embeddings (one-hot lookups, `embedding_tag`), every
projection and MLP layer (dense layers shared over positions,
`repeated_dense_tag`: K-FAC-expand under `curvature=kfac`, K-FAC-reduce
under `curvature=kfac_reduce`, Eschenhagen et al., NeurIPS 2023) and the
layer norms (`scale_and_shift_tag`). A tied output layer reuses the token
table, which two layers then share: it gets a generic block, and the
registration report says which layers share it.
"""

import dataclasses

import haiku as hk
import jax
import jax.numpy as jnp

from curvbench.components import Flag, Whole, dotted, setting
from problems.base import PROBLEMS, Problem, ProblemSettings


class Embed(hk.Module):
  """`table[ids]`, written `one_hot(ids) @ table` (a dense layer on one-hot
  inputs; registration finds `table[ids]` alike); table entries
  N(0, stddev^2)."""

  def __init__(self, vocab: int, width: int, stddev: float = 1.0, name=None):
    super().__init__(name=name)
    self.vocab, self.width, self.stddev = vocab, width, stddev

  def table(self, dtype):
    """The `(vocab, width)` embedding parameter, created on first use."""
    return hk.get_parameter(
      "embeddings",
      (self.vocab, self.width),
      dtype,
      init=hk.initializers.RandomNormal(self.stddev),
    )

  def __call__(self, ids, dtype):
    table = self.table(dtype)
    return jax.nn.one_hot(ids, self.vocab, dtype=table.dtype) @ table


def attention(x, heads: int, name: str, w_init=None, out_init=None):
  """Causal multi-head self-attention over the positions of `x: (B, T, D)`;
  the query, key and value weights start from `w_init`, the output's from
  `out_init` (None: Haiku's default)."""
  b, t, d = x.shape
  q, k, v = (
    hk.Linear(d, w_init=w_init, name=f"{name}_{n}")(x).reshape(b, t, heads, -1)
    for n in ("query", "key", "value")
  )
  scores = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(q.shape[-1])
  causal = jnp.tril(jnp.ones((t, t), bool))
  scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
  mixed = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores), v)
  return hk.Linear(d, w_init=out_init, name=f"{name}_out")(
    mixed.reshape(b, t, d)
  )


def layer_norm(name):
  """Layer norm over the last axis, with a learned scale and offset."""
  return hk.LayerNorm(axis=-1, create_scale=True, create_offset=True, name=name)


@dataclasses.dataclass(frozen=True)
class Decoder:
  """A decoder-only transformer's forward pass, called inside a Haiku
  transform: token ids `(B, seq_len)` (any dtype) to next-token logits
  `(B, seq_len, vocab)`.

  Token and learned position embeddings, `layers` pre-norm blocks of causal
  multi-head self-attention and a GELU MLP (each with a residual), a final
  layer norm and the output layer (with `tied`, the token table again).

  Initialisation: by default embeddings N(0, 1), Haiku's dense default
  (truncated normal of std 1/sqrt(fan-in)) and a tied output scaled by
  1/sqrt(width). With `gpt2_init`, GPT-2's (Radford et al., 2019, as
  nanoGPT writes it): every weight N(0, 0.02^2), the two layers of a block
  that write into the residual stream N(0, (0.02 / sqrt(2 layers))^2), a
  tied output unscaled; biases zero, layer norms one and zero either way.
  """

  vocab: int
  seq_len: int
  width: int
  layers: int
  heads: int
  mlp_ratio: int
  tied: bool
  gpt2_init: bool = False

  def __call__(self, x):
    dtype = x.dtype
    ids = x.astype(jnp.int32)
    std = 0.02 if self.gpt2_init else 1.0
    w_init = out_init = None
    if self.gpt2_init:
      w_init = hk.initializers.RandomNormal(0.02)
      out_init = hk.initializers.RandomNormal(0.02 / (2 * self.layers) ** 0.5)
    tokens = Embed(self.vocab, self.width, std, name="token_embed")
    positions = jnp.broadcast_to(
      jnp.arange(self.seq_len, dtype=ids.dtype), ids.shape
    )
    h = tokens(ids, dtype) + Embed(
      self.seq_len, self.width, std, name="position_embed"
    )(positions, dtype)
    for i in range(self.layers):
      h = h + attention(
        layer_norm(f"block{i}_norm1")(h),
        self.heads,
        f"block{i}_attention",
        w_init,
        out_init,
      )
      u = hk.Linear(
        self.mlp_ratio * self.width, w_init=w_init, name=f"block{i}_mlp_in"
      )(layer_norm(f"block{i}_norm2")(h))
      h = h + hk.Linear(self.width, w_init=out_init, name=f"block{i}_mlp_out")(
        jax.nn.gelu(u)
      )
    h = layer_norm("final_norm")(h)
    if self.tied:
      logits = h @ tokens.table(dtype).T
      return logits if self.gpt2_init else logits / jnp.sqrt(self.width)
    return hk.Linear(self.vocab, w_init=w_init, name="logits")(h)


@PROBLEMS.register
@dataclasses.dataclass
class Transformer(ProblemSettings):
  """Token and learned position embeddings, `layers` pre-norm blocks of
  causal multi-head self-attention and a GELU MLP (each with a residual),
  a final layer norm and the output layer to next-token logits; the loss is
  the softmax cross-entropy averaged over every position."""

  name: str = "transformer"
  width: int = setting(64, Whole(1), "model width (embedding size)")
  layers: int = setting(2, Whole(1), "transformer blocks")
  heads: int = setting(4, Whole(1), "attention heads (they split the width)")
  mlp_ratio: int = setting(4, Whole(1), "MLP hidden units per unit of width")
  tied: bool = setting(False, Flag(), "output layer reuses the token table")
  default_data = "modular"
  sequence_model = True
  layer_roles = (("attention", "attention"), ("mlp", "mlp"))

  def disagreements_with(self, data, prefix):
    if self.width % self.heads:
      yield (
        f"{dotted(prefix, 'heads')}={self.heads} does not divide "
        f"{dotted(prefix, 'width')}={self.width}; choose heads that do."
      )

  def build(self, data):
    vocab, (seq_len,) = data.num_classes, data.input_shape
    model = Decoder(
      vocab,
      seq_len,
      self.width,
      self.layers,
      self.heads,
      self.mlp_ratio,
      self.tied,
    )
    return Problem.from_model(
      model,
      data,
      self,
      task="classification",
      loss_name="sequence_softmax_cross_entropy",
    )
