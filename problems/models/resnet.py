"""A small residual network (He et al., "Deep Residual Learning for Image
Recognition", CVPR 2016, its CIFAR-10 family ResNet-(6n+2)) with batch
normalisation (Ioffe & Szegedy, ICML 2015), or group / layer normalisation
(Wu & He, ECCV 2018), for image classification.

No layer is tagged by hand; automatic registration finds the convolutions,
the classifier and every normalisation's scale and shift
(`scale_and_shift_tag`).

Batch norm keeps running averages of each channel's mean and variance as
model state (PyTorch's convention: momentum 0.1, the variance's running
average unbiased). Training mode normalises by the batch's own statistics,
which couples the examples of a batch; the loss, and every curvature of it,
is taken in training mode, as Hessian-spectrum studies of batch-norm
networks do (Ghorbani et al., ICML 2019; Yao et al., PyHessian, 2020).
Evaluation normalises by the running averages. Group and layer norm keep
each example to itself and no state.
"""

import dataclasses

import haiku as hk
import jax
import jax.numpy as jnp

from curvbench.components import ListOf, Number, OneOf, Whole, dotted, setting
from problems.base import PROBLEMS, Problem, ProblemSettings

NORMS = ("batch", "group", "layer", "none")


def _scale_and_shift(z):
  """`z * scale + shift` per channel, in the calling module's scope."""
  c = z.shape[-1]
  scale = hk.get_parameter("scale", (c,), z.dtype, jnp.ones)
  shift = hk.get_parameter("shift", (c,), z.dtype, jnp.zeros)
  return z * scale + shift


class BatchNorm(hk.Module):
  """Per-channel normalisation over the batch and positions, then a
  learned scale and shift; running averages as state."""

  def __init__(self, momentum: float, eps: float = 1e-5, name=None):
    super().__init__(name=name)
    self.momentum, self.eps = momentum, eps

  def __call__(self, x, is_training: bool):
    c = x.shape[-1]
    mean_avg = hk.get_state("mean", (c,), x.dtype, jnp.zeros)
    var_avg = hk.get_state("var", (c,), x.dtype, jnp.ones)
    if is_training:
      axes = tuple(range(x.ndim - 1))
      mean, var = jnp.mean(x, axes), jnp.var(x, axes)
      count = x.size // c
      m = self.momentum
      hk.set_state("mean", (1 - m) * mean_avg + m * mean)
      # PyTorch's running variance is the unbiased one.
      hk.set_state(
        "var", (1 - m) * var_avg + m * var * count / max(count - 1, 1)
      )
    else:
      mean, var = mean_avg, var_avg
    return _scale_and_shift((x - mean) * jax.lax.rsqrt(var + self.eps))


class GroupNorm(hk.Module):
  """Per-example normalisation over the positions and each group of
  channels, then a learned scale and shift (one group: layer norm)."""

  def __init__(self, groups: int, eps: float = 1e-5, name=None):
    super().__init__(name=name)
    self.groups, self.eps = groups, eps

  def __call__(self, x, is_training: bool):
    del is_training
    *lead, c = x.shape
    g = x.reshape(*lead, self.groups, c // self.groups)
    axes = (*range(1, g.ndim - 2), g.ndim - 1)
    mean = jnp.mean(g, axes, keepdims=True)
    var = jnp.var(g, axes, keepdims=True)
    z = ((g - mean) * jax.lax.rsqrt(var + self.eps)).reshape(x.shape)
    return _scale_and_shift(z)


@PROBLEMS.register
@dataclasses.dataclass
class ResNet(ProblemSettings):
  """A 3x3 convolution, then stages of residual blocks (two 3x3
  convolutions, each normalised, the first stride 2 from the second stage
  on, a 1x1 projection where the shape changes: He et al.'s option B),
  global average pooling and a dense classifier."""

  name: str = "resnet"
  widths: list[int] = setting(
    [4, 8, 16],
    ListOf(Whole(1)),
    "channels of each stage (He et al.: 16, 32, 64)",
  )
  blocks: int = setting(
    1,
    Whole(1),
    "residual blocks per stage: depth "
    "6 * blocks + 2 with three stages (1: ResNet-8, 3: "
    "ResNet-20)",
  )
  norm: str = setting(
    "batch", OneOf(NORMS), "the normalisation after each convolution"
  )
  groups: int = setting(2, Whole(1), "channel groups of norm=group")
  momentum: float = setting(
    0.1,
    Number(0, 1, low_in=False),
    "batch norm: the batch statistics' weight in the running averages",
  )

  @property
  def couples_examples(self):
    return self.norm == "batch"

  def disagreements_with(self, data, prefix):
    refusal = self.not_images(data, prefix)
    if refusal:
      yield refusal
    if self.norm == "group":
      odd = [w for w in self.widths if w % self.groups]
      if odd:
        yield (
          f"{dotted(prefix, 'groups')}={self.groups} does not divide "
          f"the widths {odd} of {dotted(prefix, 'widths')}; choose "
          "groups that divide every width."
        )

  def norm_layer(self, name):
    """The normalisation layer `norm` names, called as
    `layer(x, is_training)`: batch norm, group norm, layer norm (one
    group), or the identity for `norm="none"`."""
    if self.norm == "batch":
      return BatchNorm(self.momentum, name=name)
    if self.norm in ("group", "layer"):
      return GroupNorm(self.groups if self.norm == "group" else 1, name=name)
    return lambda x, is_training: x

  def build(self, data):
    bias = self.norm == "none"  # a normalisation's shift replaces the bias

    def conv(channels, kernel, stride, name):
      return hk.Conv2D(
        channels,
        kernel,
        stride,
        with_bias=bias,
        w_init=hk.initializers.VarianceScaling(2.0),
        name=name,
      )

    def model(x, is_training=True):
      h = conv(self.widths[0], 3, 1, "conv_in")(x)
      h = jax.nn.relu(self.norm_layer("norm_in")(h, is_training))
      for s, width in enumerate(self.widths):
        for b in range(self.blocks):
          name = f"stage{s}_block{b}"
          stride = 2 if s > 0 and b == 0 else 1
          u = conv(width, 3, stride, f"{name}_conv1")(h)
          u = jax.nn.relu(self.norm_layer(f"{name}_norm1")(u, is_training))
          u = conv(width, 3, 1, f"{name}_conv2")(u)
          u = self.norm_layer(f"{name}_norm2")(u, is_training)
          if stride != 1 or h.shape[-1] != width:
            h = conv(width, 1, stride, f"{name}_shortcut")(h)
            h = self.norm_layer(f"{name}_shortcut_norm")(h, is_training)
          h = jax.nn.relu(h + u)
      h = jnp.mean(h, axis=(1, 2))
      return hk.Linear(data.num_classes, name="logits")(h)

    return Problem.from_model(
      model,
      data,
      self,
      task="classification",
      loss_name="softmax_cross_entropy",
      with_state=self.couples_examples,
    )
