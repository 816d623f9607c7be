"""The deep autoencoders of the K-FAC paper (after Hinton & Salakhutdinov).

Encoder layers with a nonlinearity, a linear code layer, the mirrored decoder,
and output logits scored against the input pixels. The paper's sizes: MNIST
784-1000-500-250-30-250-500-1000-784 and CURVES
784-400-200-100-50-25-6-25-50-100-200-400-784 (the presets in conf/problem/).
"""

import dataclasses
import math

from curvbench.components import ListOf, OneOf, Whole, setting
from problems import layers
from problems.base import LOSSES, PROBLEMS, Problem, ProblemSettings


@PROBLEMS.register
@dataclasses.dataclass
class Autoencoder(ProblemSettings):
  """A CPU-sized autoencoder on the 8x8 digits by default: 64-16-8-4-8-16-64."""

  name: str = "autoencoder"
  encoder: list[int] = setting([16, 8], ListOf(Whole(1)),
                               "the encoder's layer widths (mirrored)")
  code: int = setting(4, Whole(1), "width of the linear code layer")
  activation: str = setting("sigmoid", OneOf(tuple(layers.ACTIVATIONS)),
                            "nonlinearity of every layer but the code")
  loss: str = setting("sigmoid_cross_entropy", OneOf(tuple(LOSSES)),
                      "the reconstruction loss")

  def build(self, data):
    act = layers.activation(self.activation)
    out_dim = math.prod(data.input_shape)

    def model(x):
      h = x.reshape(x.shape[0], -1)
      for i, size in enumerate(self.encoder):
        h = act(layers.Dense(size, name=f"enc_{i}")(h))
      h = layers.Dense(self.code, name="code")(h)  # linear code layer
      for i, size in enumerate(reversed(self.encoder)):
        h = act(layers.Dense(size, name=f"dec_{i}")(h))
      return layers.Dense(out_dim, name="logits")(h)

    return Problem.from_model(model, data, self, task="reconstruction",
                              loss_name=self.loss)
