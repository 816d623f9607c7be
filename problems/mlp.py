"""MLP classifier with softmax cross-entropy."""

from problems import layers
from problems.base import Problem


def hidden_sizes(cfg) -> list[int]:
  """`cfg["hidden"]` if given, else `depth` layers of `width` units."""
  if cfg["hidden"] is not None:
    return [int(h) for h in cfg["hidden"]]
  return [int(cfg["width"])] * int(cfg["depth"])


def build(data, cfg) -> Problem:
  sizes = hidden_sizes(cfg)
  act = layers.activation(cfg["activation"])

  def model(x):
    h = x.reshape(x.shape[0], -1)
    for i, size in enumerate(sizes):
      h = act(layers.Dense(size, name=f"dense_{i}")(h))
    return layers.Dense(data.num_classes, name="logits")(h)

  return Problem.from_model(model, data, cfg, task="classification",
                            loss_name="softmax_cross_entropy")
