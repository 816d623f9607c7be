"""MLP classifier, with softmax cross-entropy or a one-hot squared loss."""

import dataclasses

from curvbench.components import ListOf, OneOf, Whole, setting
from problems import layers
from problems.base import (
  CLASSIFIER_LOSSES,
  PROBLEMS,
  Problem,
  ProblemSettings,
  classifier_loss_setting,
)


@PROBLEMS.register
@dataclasses.dataclass
class MLP(ProblemSettings):
  """Fully connected layers, then a linear layer to the class logits."""

  name: str = "mlp"
  width: int = setting(16, Whole(1), "units of each hidden layer")
  depth: int = setting(2, Whole(0), "hidden layers")
  hidden: list[int] | None = setting(
    None,
    ListOf(Whole(1), null=True),
    "the hidden layers' units, one per layer (overrides width x depth)",
  )
  activation: str = setting(
    "tanh",
    OneOf(tuple(layers.ACTIVATIONS)),
    "nonlinearity after each hidden layer",
  )
  loss: str = classifier_loss_setting()

  def hidden_sizes(self) -> list[int]:
    """`hidden` if given, else `depth` layers of `width` units."""
    if self.hidden is not None:
      return list(self.hidden)
    return [self.width] * self.depth

  def build(self, data):
    sizes = self.hidden_sizes()
    act = layers.activation(self.activation)

    def model(x):
      h = x.reshape(x.shape[0], -1)
      return layers.dense_to_logits(h, sizes, act, data.num_classes)

    return Problem.from_model(
      model,
      data,
      self,
      task="classification",
      loss_name=CLASSIFIER_LOSSES[self.loss],
    )
