"""Conv-relu-pool blocks then a dense classifier; optionally normalised."""

import haiku as hk

from problems import layers
from problems.base import Problem


def build(data, cfg) -> Problem:
  if len(data.input_shape) != 3:
    raise ValueError(f"The convnet needs images (H, W, C) but dataset "
                     f"{data.name!r} has inputs of shape {data.input_shape}.")
  channels = [int(c) for c in cfg["channels"]]
  kernel = int(cfg["kernel"])
  dense = [int(d) for d in cfg["dense"]]
  normalize = bool(cfg["normalize"])
  act = layers.activation(cfg["activation"])

  def model(x):
    h = x
    for i, c in enumerate(channels):
      h = layers.Conv2D(c, kernel, name=f"conv_{i}")(h)
      if normalize:
        h = layers.Normalize(name=f"norm_{i}")(h)
      h = act(h)
      h = hk.max_pool(h, window_shape=(2, 2, 1), strides=(2, 2, 1),
                      padding="VALID")
    h = h.reshape(h.shape[0], -1)
    for i, size in enumerate(dense):
      h = act(layers.Dense(size, name=f"dense_{i}")(h))
    return layers.Dense(data.num_classes, name="logits")(h)

  return Problem.from_model(model, data, cfg, task="classification",
                            loss_name="softmax_cross_entropy")
