"""GPT-2-style language models at the sizes papers train (Radford et al.,
"Language Models are Unsupervised Multitask Learners", 2019; the shapes of
nanoGPT, Karpathy, 2022): the transformer problem's decoder
(`transformer.Decoder`) with GPT-2's initialisation and a tied output
layer, its shape picked by name from `SIZES`.

Parameters, with vocabulary V, sequence length T, L blocks of width d:
`L (12 d^2 + 13 d) + (V + T) d + 2 d` tied (each block: four d x d
attention projections and a d x 4d and 4d x d MLP, with biases, and two
layer norms; then the token and position tables and the final layer norm),
`+ d V + V` untied. At V = 256 (bytes) and T = 256 (the `gpt_text`
preset's windows) the sizes hold 14,784 (tiny), 10,844,160 (10M),
32,206,464 (30M) and 85,449,216 (gpt2-small) parameters; gpt2-small at
GPT-2's V = 50,257 and T = 1,024 holds 124,439,808, GPT-2 small's
published 124M.

The default is `tiny` on short Markov-chain sequences, small enough to
train on a CPU (as every problem's defaults must); the sizes papers train
come from presets (`gpt_text`) or `problem.size`. At those sizes choose a
sampled estimation mode (e.g. `curvature.mode=fisher_gradients`): an exact
one (`ggn_exact`, `fisher_exact`) propagates one vector per output, which is
seq_len x vocab per example.
"""

import dataclasses

from curvbench.components import Flag, OneOf, setting
from problems.base import PROBLEMS, Problem, ProblemSettings
from problems.models.transformer import Decoder, Transformer

# name: (blocks, width, heads); every head 64 wide except tiny's.
SIZES = {
  "tiny": (2, 16, 2),  # for tests
  "10M": (6, 384, 6),  # nanoGPT's character-level Shakespeare model
  "30M": (8, 576, 9),
  "gpt2-small": (12, 768, 12),  # GPT-2 small (124M at its vocabulary)
}


@PROBLEMS.register
@dataclasses.dataclass
class GPT(ProblemSettings):
  """A GPT-2-style decoder of a named size (`SIZES`) for next-token
  prediction; the loss is the softmax cross-entropy averaged over every
  position."""

  name: str = "gpt"
  size: str = setting(
    "tiny",
    OneOf(tuple(SIZES)),
    "the model's shape, "
    "(blocks, width, heads): tiny (2, 16, 2), 10M (6, 384, "
    "6), 30M (8, 576, 9), gpt2-small (12, 768, 12); "
    "parameters at 256 tokens of a 256-token vocabulary: "
    "14,784, 10.8M, 32.2M, 85.4M",
  )
  tied: bool = setting(
    True, Flag(), "output layer reuses the token table (as GPT-2)"
  )
  default_data = "markov_tokens"
  sequence_model = True
  accelerator_sized = True  # its sizes are papers'; the default for tests
  layer_roles = Transformer.layer_roles  # the same layer names

  def build(self, data):
    layers, width, heads = SIZES[self.size]
    model = Decoder(
      data.num_classes,
      data.input_shape[0],
      width,
      layers,
      heads,
      mlp_ratio=4,
      tied=self.tied,
      gpt2_init=True,
    )
    return Problem.from_model(
      model,
      data,
      self,
      task="classification",
      loss_name="sequence_softmax_cross_entropy",
    )
