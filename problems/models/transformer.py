"""A small decoder-only transformer (Vaswani et al., "Attention Is All You
Need", NeurIPS 2017, with the pre-norm blocks of GPT-2) for next-token
prediction on token sequences: the modular arithmetic of Power et al. (2022)
or characters of a text file.

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
  inputs; registration finds `table[ids]` alike); table entries N(0, 1)."""

  def __init__(self, vocab: int, width: int, name=None):
    super().__init__(name=name)
    self.vocab, self.width = vocab, width

  def table(self, dtype):
    return hk.get_parameter("embeddings", (self.vocab, self.width), dtype,
                            init=hk.initializers.RandomNormal(1.0))

  def __call__(self, ids, dtype):
    table = self.table(dtype)
    return jax.nn.one_hot(ids, self.vocab, dtype=table.dtype) @ table


def attention(x, heads: int, name: str):
  """Causal multi-head self-attention over the positions of `x: (B, T, D)`."""
  b, t, d = x.shape
  q, k, v = (hk.Linear(d, name=f"{name}_{n}")(x).reshape(b, t, heads, -1)
             for n in ("query", "key", "value"))
  scores = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(q.shape[-1])
  causal = jnp.tril(jnp.ones((t, t), bool))
  scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
  mixed = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores), v)
  return hk.Linear(d, name=f"{name}_out")(mixed.reshape(b, t, d))


def layer_norm(name):
  return hk.LayerNorm(axis=-1, create_scale=True, create_offset=True,
                      name=name)


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
      yield (f"{dotted(prefix, 'heads')}={self.heads} does not divide "
             f"{dotted(prefix, 'width')}={self.width}; choose heads that do.")

  def build(self, data):
    vocab, (seq_len,) = data.num_classes, data.input_shape

    def model(x):
      dtype = x.dtype
      ids = x.astype(jnp.int32)
      tokens = Embed(vocab, self.width, name="token_embed")
      positions = jnp.broadcast_to(jnp.arange(seq_len, dtype=ids.dtype),
                                   ids.shape)
      h = tokens(ids, dtype) + Embed(seq_len, self.width,
                                     name="position_embed")(positions, dtype)
      for i in range(self.layers):
        h = h + attention(layer_norm(f"block{i}_norm1")(h), self.heads,
                          f"block{i}_attention")
        u = hk.Linear(self.mlp_ratio * self.width, name=f"block{i}_mlp_in")(
            layer_norm(f"block{i}_norm2")(h))
        h = h + hk.Linear(self.width, name=f"block{i}_mlp_out")(
            jax.nn.gelu(u))
      h = layer_norm("final_norm")(h)
      if self.tied:
        return h @ tokens.table(dtype).T / jnp.sqrt(self.width)
      return hk.Linear(vocab, name="logits")(h)

    return Problem.from_model(model, data, self, task="classification",
                              loss_name="sequence_softmax_cross_entropy")

