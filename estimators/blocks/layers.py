"""Layer knowledge shared by the block families: tag checks, properties and
per-example parameter gradients.

`_per_example_gradients(estimation_data)` returns, for each parameter, an
array of shape `(N, *param_shape)` whose rows are the gradients `g_si` of
every (sample, example) pair, so a batch contributes `(1/B) sum_rows g gᵀ`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax import lax

from estimators import tags, utils
from estimators.blocks import base

if TYPE_CHECKING:
  # A layer mixin's methods run on the block it is mixed into: the type
  # checker sees that block (at run time the mixin is a plain class,
  # placed before the family's class among a block's bases).
  _Block = base.CurvatureBlock
else:
  _Block = object


class DenseMixin(_Block):
  """Dense tags: `y = x @ w (+ b)`, parameters `(w, [b])`.

  Repeated dense tags (`x: (B, ..., d_in)`) are accepted too: an example's
  gradient then sums over its extra axes. The block works on the weight as
  a `(d_in, d_out)` matrix (`weight_to_matrix`): a weight with more axes
  (Flax's `DenseGeneral`) is flattened, an output-major one
  (`transposed_weight`, as Equinox stores it) transposed; products and
  gradients come back in the weight's own shape.
  """

  _TAG_PRIMITIVES = (tags.dense, tags.repeated_dense)
  _REQUIRED_DATA = ("inputs", "outputs_tangent")

  def _check_layer(self):
    n = self.number_of_parameters
    (x_shape,) = self.inputs_shapes
    d_in, d_out = self.weight_matrix_shape
    shapes = self.parameters_shapes
    if (
      n not in (1, 2)
      or len(shapes[0]) < 2
      or tags.dense_weight_split(shapes[0], d_in, self.transposed_weight)
      is None
      or utils.product(shapes[0]) != d_in * d_out
      or n == 2
      and utils.product(shapes[1]) != d_out
    ):
      raise ValueError(
        f"Block {self.name!r}: a dense tag with {d_in} input and {d_out} "
        "output features needs a weight of d_in * d_out entries (at least "
        "2 axes) and an optional bias of d_out entries, got shapes "
        f"{shapes}."
      )
    if self.layer_tag_primitive is tags.dense and len(x_shape) != 2:
      raise ValueError(
        f"Block {self.name!r}: dense inputs must be (batch, d_in),"
        f" got {x_shape}; tag the layer with "
        "register_repeated_dense instead."
      )

  @property
  def has_bias(self) -> bool:
    """Whether the tag has a bias (a second parameter)."""
    return self.number_of_parameters == 2

  @property
  def transposed_weight(self) -> bool:
    """Whether the weight is stored output-major, `(d_out, d_in)`."""
    return bool(self.layer_tag_extra_params.get("transposed_weight", False))

  @property
  def weight_matrix_shape(self) -> tuple[int, int]:
    """`(d_in, d_out)`, the features of the layer's inputs and outputs."""
    return self.inputs_shapes[0][-1], self.outputs_shapes[0][-1]

  def weight_to_matrix(self, w: jax.Array) -> jax.Array:
    """A weight-shaped array (with any leading axes) as `(..., d_in, d_out)`.

    Args:
      w: `(..., *parameters_shapes[0])`.

    Returns:
      The same entries as `(d_in, d_out)` matrices, in the layer's `x @ W`
      orientation.
    """
    d_in, d_out = self.weight_matrix_shape
    lead = w.shape[: w.ndim - len(self.parameters_shapes[0])]
    if self.transposed_weight:
      return jnp.swapaxes(w.reshape(lead + (d_out, d_in)), -1, -2)
    return w.reshape(lead + (d_in, d_out))

  def weight_from_matrix(self, m: jax.Array) -> jax.Array:
    """Inverts `weight_to_matrix`.

    Args:
      m: `(..., d_in, d_out)`.

    Returns:
      `(..., *parameters_shapes[0])`.
    """
    if self.transposed_weight:
      m = jnp.swapaxes(m, -1, -2)
    return m.reshape(m.shape[:-2] + self.parameters_shapes[0])

  def _per_example_gradients(self, data):
    (x,), (dy,) = data["inputs"], data["outputs_tangent"]
    d_in, d_out = self.weight_matrix_shape
    s, b = dy.shape[:2]
    grads = [
      self.weight_from_matrix(
        jnp.einsum("b...i,sb...o->sbio", x, dy).reshape(s * b, d_in, d_out)
      )
    ]
    if self.has_bias:
      grads.append(
        dy.reshape(s * b, -1, d_out)
        .sum(axis=1)
        .reshape((s * b,) + self.parameters_shapes[1])
      )
    return tuple(grads)


class ScaleAndShiftMixin(_Block):
  """Scale-and-shift tags: `y = x * scale + shift`, broadcast on the right."""

  _TAG_PRIMITIVES = (tags.scale_and_shift,)
  _REQUIRED_DATA = ("inputs", "outputs_tangent")

  @property
  def has_scale(self) -> bool:
    """Whether the layer multiplies its input by a parameter."""
    return bool(self.layer_tag_extra_params["has_scale"])

  @property
  def has_shift(self) -> bool:
    """Whether the layer adds a parameter to its (scaled) input."""
    return bool(self.layer_tag_extra_params["has_shift"])

  def _check_layer(self):
    if self.number_of_parameters != self.has_scale + self.has_shift:
      raise ValueError(
        f"Block {self.name!r}: has_scale={self.has_scale} and "
        f"has_shift={self.has_shift} do not match the "
        f"{self.number_of_parameters} parameters of the tag."
      )

  def _reduce_to(self, values, param_shape):
    """Sums `(N, *x_shape[1:])` over the axes a parameter broadcasts along."""
    features = values.shape[1:]
    core = tuple(param_shape)
    if len(core) == len(features) + 1:  # a leading 1 aligned with the batch
      core = core[1:]
    core = (1,) * (len(features) - len(core)) + core
    axes = tuple(
      i + 1 for i, (c, f) in enumerate(zip(core, features)) if c == 1 and f != 1
    )
    summed = jnp.sum(values, axis=axes, keepdims=True)
    return summed.reshape((values.shape[0],) + tuple(param_shape))

  def _per_example_gradients(self, data):
    (x,), (dy,) = data["inputs"], data["outputs_tangent"]
    rows = lambda v: v.reshape((-1,) + v.shape[2:])  # (S, B, ...) -> (S*B, ...)
    shapes = list(self.parameters_shapes)
    grads = []
    if self.has_scale:
      grads.append(self._reduce_to(rows(dy * x), shapes.pop(0)))
    if self.has_shift:
      grads.append(self._reduce_to(rows(dy), shapes.pop(0)))
    return tuple(grads)


class Conv2DMixin(_Block):
  """2-D convolution tags: parameters `(kernel, [bias])`, batch axis first."""

  _TAG_PRIMITIVES = (tags.conv2d,)
  _REQUIRED_DATA = ("inputs", "outputs_tangent")

  def _check_layer(self):
    dn = self.dimension_numbers
    if self.number_of_parameters not in (1, 2):
      raise ValueError(
        f"Block {self.name!r}: a conv2d tag has a kernel and an "
        f"optional bias, got {self.number_of_parameters} params."
      )
    if dn.lhs_spec[0] != 0 or dn.out_spec[0] != 0:
      raise ValueError(
        f"Block {self.name!r}: the batch must be the leading axis "
        "of the convolution's inputs and outputs."
      )
    if (
      self.has_bias
      and utils.product(self.parameters_shapes[1]) != self.num_outputs_channels
    ):
      raise ValueError(
        f"Block {self.name!r}: the bias must have one entry per "
        f"output channel ({self.num_outputs_channels}), got "
        f"shape {self.parameters_shapes[1]}."
      )

  @property
  def dimension_numbers(self) -> lax.ConvDimensionNumbers:
    """The convolution's dimension numbers (axis layouts)."""
    return self.layer_tag_extra_params["dimension_numbers"]

  @property
  def has_bias(self) -> bool:
    """Whether the tag has a bias (a second parameter)."""
    return self.number_of_parameters == 2

  @property
  def outputs_channel_index(self) -> int:
    """The channel axis of the outputs."""
    return self.dimension_numbers.out_spec[1]

  @property
  def inputs_channel_index(self) -> int:
    """The channel axis of the inputs."""
    return self.dimension_numbers.lhs_spec[1]

  @property
  def weights_output_channel_index(self) -> int:
    """The output-channel axis of the kernel."""
    return self.dimension_numbers.rhs_spec[0]

  @property
  def kernel_output_axis(self) -> int:
    """KFAC-JAX's name for `weights_output_channel_index`."""
    return self.weights_output_channel_index

  @property
  def inputs_spatial_shape(self) -> tuple[int, ...]:
    """The inputs' spatial extent."""
    x = self.inputs_shapes[0]
    return tuple(x[i] for i in self.dimension_numbers.lhs_spec[2:])

  @property
  def weights_input_channel_index(self) -> int:
    """The input-channel axis of the kernel."""
    return self.dimension_numbers.rhs_spec[1]

  @property
  def weights_spatial_shape(self) -> tuple[int, ...]:
    """The kernel's spatial extent, in the kernel's axis order."""
    kernel = self.parameters_shapes[0]
    return tuple(kernel[i] for i in self.dimension_numbers.rhs_spec[2:])

  @property
  def weights_spatial_size(self) -> int:
    """The number of kernel positions (product of the spatial shape)."""
    return utils.product(self.weights_spatial_shape)

  @property
  def outputs_spatial_shape(self) -> tuple[int, ...]:
    """The outputs' spatial extent."""
    out = self.outputs_shapes[0]
    return tuple(out[i] for i in self.dimension_numbers.out_spec[2:])

  @property
  def num_locations(self) -> int:
    """The number of output positions each filter is applied at."""
    return utils.product(self.outputs_spatial_shape)

  @property
  def num_inputs_channels(self) -> int:
    """The number of input channels."""
    return self.inputs_shapes[0][self.inputs_channel_index]

  @property
  def num_outputs_channels(self) -> int:
    """The number of output channels."""
    return self.outputs_shapes[0][self.outputs_channel_index]

  def _conv(self, x, kernel):
    p = self.layer_tag_extra_params
    return lax.conv_general_dilated(
      x,
      kernel,
      p["window_strides"],
      p["padding"],
      p["lhs_dilation"],
      p["rhs_dilation"],
      p["dimension_numbers"],
      p["feature_group_count"],
      p["batch_group_count"],
    )


class PerExampleConv2DMixin(Conv2DMixin):
  """Per-example kernel gradients via the convolution's VJP, in chunks."""

  def __init__(
    self,
    layer_tag_eq: Any,
    name: str | None = None,
    max_elements_for_vmap: int | None = None,
    **kwargs,
  ):
    """Builds the block.

    Args:
      layer_tag_eq: the conv2d tag's jaxpr equation.
      name: the block's name in messages.
      max_elements_for_vmap: how many examples to vmap over at once (the
        rest are looped over); None uses `get_max_parallel_elements()`.
      **kwargs: passed on to the block family's constructor.
    """
    self._max_elements_for_vmap = max_elements_for_vmap
    super().__init__(layer_tag_eq, name, **kwargs)

  def _check_layer(self):
    super()._check_layer()
    if self.layer_tag_extra_params["batch_group_count"] != 1:
      raise ValueError(
        f"Block {self.name!r}: batch_group_count > 1 mixes "
        "examples, so per-example gradients are undefined."
      )

  @property
  def max_elements_for_vmap(self) -> int:
    """Examples processed in parallel; the rest are looped over."""
    return self._max_elements_for_vmap or base.get_max_parallel_elements()

  def _conv_example_gradients(self, xi, dyi, kernel):
    """The parameter gradients of one example, one row per output tangent.

    Args:
      xi: one example's input, without the batch axis.
      dyi: `(S, *output_shape[1:])`, S tangents of that example's output
        (S sits where the batch axis was).
      kernel: the kernel; the gradient does not depend on its value (the
        convolution is linear in it), only its shape and dtype matter.

    Returns:
      `(S, *kernel_shape)` and, with a bias, `(S, *bias_shape)`.
    """
    spatial_axes = tuple(self.dimension_numbers.out_spec[2:])
    _, vjp = jax.vjp(lambda k: self._conv(xi[None], k), kernel)
    grads = [jax.vmap(lambda d: vjp(d[None])[0])(dyi)]
    if self.has_bias:  # in the bias's own shape, e.g. (C,) or (C, 1, 1)
      grads.append(
        jnp.sum(dyi, axis=spatial_axes).reshape(
          (dyi.shape[0],) + self.parameters_shapes[1]
        )
      )
    return tuple(grads)

  def _single_example_gradients(self, inputs, tangent_of_outputs):
    """`_conv_example_gradients` of one example for one tangent, unbatched."""
    kernel = jnp.zeros(
      self.parameters_shapes[0],
      jnp.result_type(inputs.dtype, tangent_of_outputs.dtype),
    )
    grads = self._conv_example_gradients(
      inputs, tangent_of_outputs[None], kernel
    )
    return tuple(g[0] for g in grads)

  def _per_example_gradients(self, data):
    (x,), (dy,), kernel = (
      data["inputs"],
      data["outputs_tangent"],
      data["params"][0],
    )

    def one_example(args):
      xi, dyi = args
      return self._conv_example_gradients(xi, dyi, kernel)

    chunk = max(1, min(x.shape[0], self.max_elements_for_vmap))
    grads = lax.map(one_example, (x, jnp.swapaxes(dy, 0, 1)), batch_size=chunk)
    return tuple(g.reshape((-1,) + g.shape[2:]) for g in grads)
