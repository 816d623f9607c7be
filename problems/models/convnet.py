"""Conv-relu-pool blocks then a dense classifier; optionally normalised."""

import dataclasses

import haiku as hk

from curvbench.components import Flag, ListOf, OneOf, Whole, dotted, setting
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
class ConvNet(ProblemSettings):
  """Blocks of a 'SAME' convolution, an optional per-example normalisation
  with scale and shift, the nonlinearity and 2x2 max-pooling; then dense
  layers to the class logits."""

  name: str = "convnet"
  channels: list[int] = setting(
    [4, 8], ListOf(Whole(1)), "output channels of each conv block"
  )
  kernel: int = setting(3, Whole(1), "side of the square conv kernels")
  dense: list[int] = setting(
    [16], ListOf(Whole(1)), "widths of the dense layers after the blocks"
  )
  normalize: bool = setting(False, Flag(), "normalise after each conv")
  activation: str = setting(
    "relu",
    OneOf(tuple(layers.ACTIVATIONS)),
    "nonlinearity of every block and dense layer",
  )
  loss: str = classifier_loss_setting()

  def disagreements_with(self, data, prefix):
    refusal = self.not_images(data, prefix)
    if refusal:
      yield refusal
      return
    shape = data.input_shape()
    side, blocks = min(shape[:2]), len(self.channels)
    if side >> blocks < 1:  # each block halves the side (2x2 max-pooling)
      yield (
        f"{dotted(prefix, 'channels')}={self.channels}: {blocks} conv "
        f"blocks halve the {shape[0]}x{shape[1]} images of dataset "
        f"{data.name!r} to nothing; use at most "
        f"{side.bit_length() - 1} blocks, or larger images."
      )

  def build(self, data):
    act = layers.activation(self.activation)

    def model(x):
      h = x
      for i, c in enumerate(self.channels):
        h = layers.Conv2D(c, self.kernel, name=f"conv_{i}")(h)
        if self.normalize:
          h = layers.Normalize(name=f"norm_{i}")(h)
        h = act(h)
        h = hk.max_pool(
          h, window_shape=(2, 2, 1), strides=(2, 2, 1), padding="VALID"
        )
      h = h.reshape(h.shape[0], -1)
      return layers.dense_to_logits(h, self.dense, act, data.num_classes)

    return Problem.from_model(
      model,
      data,
      self,
      task="classification",
      loss_name=CLASSIFIER_LOSSES[self.loss],
    )
