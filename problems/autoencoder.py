"""The deep autoencoders of the K-FAC paper (after Hinton & Salakhutdinov).

Encoder layers with a nonlinearity, a linear code layer, the mirrored decoder,
and output logits scored by sigmoid cross-entropy against the input pixels.
The paper's sizes: MNIST 784-1000-500-250-30-250-500-1000-784 and CURVES
784-400-200-100-50-25-6-25-50-100-200-400-784 (see conf/problem/).
"""

from problems import layers
from problems.base import Problem


def build(data, cfg) -> Problem:
  encoder = [int(s) for s in cfg["encoder"]]
  code = int(cfg["code"])
  act = layers.activation(cfg["activation"])
  out_dim = 1
  for d in data.input_shape:
    out_dim *= d

  def model(x):
    h = x.reshape(x.shape[0], -1)
    for i, size in enumerate(encoder):
      h = act(layers.Dense(size, name=f"enc_{i}")(h))
    h = layers.Dense(code, name="code")(h)  # linear code layer
    for i, size in enumerate(reversed(encoder)):
      h = act(layers.Dense(size, name=f"dec_{i}")(h))
    return layers.Dense(out_dim, name="logits")(h)

  return Problem.from_model(model, data, cfg, task="autoencoder",
                            loss_name=cfg["loss"])
