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
from problems.base import PROBLEMS, Problem, ProblemSettings


@PROBLEMS.register
@dataclasses.dataclass
class Autoencoder(ProblemSettings):
  """A CPU-sized autoencoder on the 8x8 digits by default: 64-16-8-4-8-16-64."""

  name: str = "autoencoder"
  encoder: list[int] = setting(
    [16, 8], ListOf(Whole(1)), "the encoder's layer widths (mirrored)"
  )
  code: int = setting(4, Whole(1), "width of the linear code layer")
  activation: str = setting(
    "sigmoid",
    OneOf(tuple(layers.ACTIVATIONS)),
    "nonlinearity of every layer but the code",
  )
  loss: str = setting(
    "sigmoid_cross_entropy",
    OneOf(("sigmoid_cross_entropy", "squared_error")),
    "the reconstruction loss",
  )
  init: str = setting(
    "gaussian",
    OneOf(("gaussian", "sparse")),
    "weight initialisation of every layer: gaussian draws each weight from "
    "N(0, 1/fan_in); sparse (Martens 2010, as in the K-FAC paper) gives "
    "each unit sparse_connections N(0, 1) incoming weights at random "
    "inputs and zeros elsewhere; biases start at zero either way",
  )
  sparse_connections: int = setting(
    15,
    Whole(1),
    "non-zero incoming weights per unit with init=sparse "
    "(all inputs where a layer has fewer)",
  )

  def ignored(self):
    if self.init == "gaussian":
      return {
        "sparse_connections": "init=gaussian draws every weight "
        "(init=sparse uses it)"
      }
    return {}

  def build(self, data):
    act = layers.activation(self.activation)
    out_dim = math.prod(data.input_shape)
    w_init = (
      layers.SparseInit(self.sparse_connections)
      if self.init == "sparse"
      else None
    )

    def dense(size, name):
      return layers.Dense(size, name=name, w_init=w_init)

    def model(x):
      h = x.reshape(x.shape[0], -1)
      for i, size in enumerate(self.encoder):
        h = act(dense(size, f"enc_{i}")(h))
      h = dense(self.code, "code")(h)  # linear code layer
      for i, size in enumerate(reversed(self.encoder)):
        h = act(dense(size, f"dec_{i}")(h))
      return dense(out_dim, "logits")(h)

    return Problem.from_model(
      model, data, self, task="reconstruction", loss_name=self.loss
    )
