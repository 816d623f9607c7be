"""Loss and layer tags: JAX primitives that mark what the curvature code needs.

A tag is an identity at run time (it returns some of its operands unchanged),
so a tagged model computes exactly what the untagged one does, under `jit`,
`vmap`, `grad` and `jvp`. In a traced jaxpr, though, a tag equation names a
loss (and the distribution it stands for) or a layer (and which variables are
its inputs, outputs and parameters). The tracer reads these equations.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir


def _register_identity_rules(primitive, num_returned, returned_start):
  """Makes `primitive` an identity on `operands[returned_start:][:num_returned]`.

  Its derivative is that of the identity on those operands, so under `grad` the
  tag vanishes from the linearised graph while the primal graph keeps it.
  """

  def impl(*operands, **params):
    del params
    return list(
      operands[returned_start : returned_start + num_returned(operands)]
    )

  def abstract_eval(*operands, **params):
    return impl(*operands, **params)

  def jvp(primals, tangents, **params):
    out = primitive.bind(*primals, **params)
    sel = slice(returned_start, returned_start + len(out))
    out_tangents = [ad.instantiate_zeros(t) for t in tangents[sel]]
    return out, out_tangents

  def batch(args, dims, **params):
    out = primitive.bind(*args, **params)
    return out, list(dims[returned_start : returned_start + len(out)])

  primitive.multiple_results = True
  primitive.def_impl(impl)
  primitive.def_abstract_eval(abstract_eval)
  ad.primitive_jvps[primitive] = jvp
  batching.primitive_batchers[primitive] = batch
  mlir.register_lowering(primitive, mlir.lower_fun(impl, multiple_results=True))


class LossTag(jex_core.Primitive):
  """Marks a loss: `bind(*args, args_names=...)` returns the parameter dependants.

  `args` are the loss constructor's array arguments that are present, named by
  `args_names`; the parameter-dependent ones (e.g. `logits`) come first.
  """

  def __init__(
    self,
    cls: type,
    parameter_dependants: Sequence[str],
    parameter_independants: Sequence[str],
  ):
    """Makes the tag of one loss class.

    Args:
      cls: the `LossFunction` class the tag stands for; its constructor takes
        the named arguments.
      parameter_dependants: names of the arguments that depend on the
        parameters (the network outputs), in order.
      parameter_independants: names of the other arguments (e.g. targets).
    """
    super().__init__(f"{cls.__name__}_tag")
    self._cls = cls
    self._parameter_dependants = tuple(parameter_dependants)
    self._parameter_independants = tuple(parameter_independants)
    _register_identity_rules(
      self, lambda ops: len(self._parameter_dependants), 0
    )

  @property
  def parameter_dependants_names(self) -> tuple[str, ...]:
    """Names of the arguments that depend on the parameters."""
    return self._parameter_dependants

  @property
  def parameter_independants_names(self) -> tuple[str, ...]:
    """Names of the arguments that do not (e.g. targets)."""
    return self._parameter_independants

  @property
  def arguments_names(self) -> tuple[str, ...]:
    """All argument names: the parameter dependants first."""
    return self._parameter_dependants + self._parameter_independants

  def get_outputs(self, *args: Any, args_names: Sequence[str]) -> tuple:
    """What binding the tag returns.

    Args:
      *args: the tag's operands.
      args_names: their names (unused: the dependants always come first).

    Returns:
      The parameter-dependent operands.
    """
    del args_names
    return args[: len(self._parameter_dependants)]

  def loss(self, *args: Any, args_names: Sequence[str]) -> Any:
    """Builds the `LossFunction` this tag stands for from its operand values.

    Args:
      *args: the tag's operand values.
      args_names: their names, as bound.

    Returns:
      An instance of the tag's loss class.

    Raises:
      ValueError: if there are not as many names as values.
    """
    if len(args) != len(args_names):
      raise ValueError(
        f"{self.name}: got {len(args)} arguments but {len(args_names)} names."
      )
    return self._cls(**dict(zip(args_names, args)))

  def bind_loss(self, **kwargs: Any) -> list[jax.Array]:
    """Binds the tag on the given named arguments, skipping None ones.

    Args:
      **kwargs: the loss's arguments by name (arrays or None).

    Returns:
      The parameter-dependent arguments, unchanged.

    Raises:
      TypeError: for a name the loss does not take.
    """
    names = tuple(n for n in self.arguments_names if kwargs.get(n) is not None)
    unknown = set(kwargs) - set(self.arguments_names)
    if unknown:
      raise TypeError(f"{self.name} does not take {sorted(unknown)}.")
    args = [jnp.asarray(kwargs[n]) for n in names]
    return self.bind(*args, args_names=names)


class LayerTag(jex_core.Primitive):
  """Marks a layer: `bind(*outputs, *inputs, *parameters, **meta)`.

  Returns the outputs unchanged (a layer with no outputs, such as the generic
  tag, returns its parameters). `meta` must be hashable constants.
  """

  def __init__(self, name: str, num_inputs: int, num_outputs: int):
    """Makes a layer tag.

    Args:
      name: the primitive's name (e.g. "dense_tag").
      num_inputs: how many operands are layer inputs.
      num_outputs: how many operands are layer outputs (0 for a tag that
        only marks parameters).
    """
    super().__init__(name)
    self._num_inputs = num_inputs
    self._num_outputs = num_outputs
    if num_outputs:
      _register_identity_rules(self, lambda ops: num_outputs, 0)
    else:
      _register_identity_rules(
        self, lambda ops: len(ops) - num_inputs, num_inputs
      )

  @property
  def num_inputs(self) -> int:
    """How many of the operands are layer inputs."""
    return self._num_inputs

  @property
  def num_outputs(self) -> int:
    """How many of the operands are layer outputs."""
    return self._num_outputs

  def split_operands(self, operands: Sequence[Any]) -> tuple[tuple, ...]:
    """Splits a tag's operands by their role.

    Args:
      operands: the tag's operands, as values or jaxpr variables.

    Returns:
      `(outputs, inputs, params)`, three tuples.
    """
    n_out, n_in = self._num_outputs, self._num_inputs
    return (
      tuple(operands[:n_out]),
      tuple(operands[n_out : n_out + n_in]),
      tuple(operands[n_out + n_in :]),
    )


generic = LayerTag("generic_tag", num_inputs=0, num_outputs=0)
dense = LayerTag("dense_tag", num_inputs=1, num_outputs=1)
repeated_dense = LayerTag("repeated_dense_tag", num_inputs=1, num_outputs=1)
conv2d = LayerTag("conv2d_tag", num_inputs=1, num_outputs=1)
scale_and_shift = LayerTag("scale_and_shift_tag", num_inputs=1, num_outputs=1)
embedding = LayerTag("embedding_tag", num_inputs=1, num_outputs=1)


def is_loss_tag_eqn(eqn: Any) -> bool:
  """Whether a jaxpr equation binds a `LossTag`.

  Args:
    eqn: a jaxpr equation.

  Returns:
    True for a loss tag equation.
  """
  return isinstance(eqn.primitive, LossTag)


def is_layer_tag_eqn(eqn: Any) -> bool:
  """Whether a jaxpr equation binds a `LayerTag`.

  Args:
    eqn: a jaxpr equation.

  Returns:
    True for a layer tag equation.
  """
  return isinstance(eqn.primitive, LayerTag)


def layer_eqn_parts(eqn: Any) -> tuple[tuple, ...]:
  """The jaxpr variables of a layer tag equation, by role.

  Args:
    eqn: a layer tag equation.

  Returns:
    `(outputs, inputs, params)`, three tuples of variables.
  """
  return eqn.primitive.split_operands(eqn.invars)


def _single(tag_out):
  return tag_out[0]


def register_generic(
  *parameters: jax.Array,
) -> jax.Array | tuple[jax.Array, ...]:
  """Tags parameters that no structured block knows.

  Args:
    *parameters: one or more parameter arrays.

  Returns:
    The parameters unchanged: one array for one parameter, else a tuple.

  Raises:
    ValueError: if no parameter is given.
  """
  if not parameters:
    raise ValueError("register_generic needs at least one parameter array.")
  out = generic.bind(*parameters)
  return out[0] if len(parameters) == 1 else tuple(out)


def register_dense(
  y: jax.Array,
  x: jax.Array,
  w: jax.Array,
  b: jax.Array | None = None,
  *,
  transposed_weight: bool = False,
  **kwargs: Any,
) -> jax.Array:
  """Tags a dense layer `y = x @ w + b`.

  The weight may have more than two axes (Flax's `DenseGeneral` kernels):
  its leading axes then flatten to `d_in` and its trailing ones to `d_out`,
  row-major, as `x`'s and `y`'s features do.

  Args:
    y: the layer's output, `(batch, d_out)`.
    x: its input, `(batch, d_in)`.
    w: the weight, `(d_in, d_out)`, or `(d_out, d_in)` with
      `transposed_weight` (`y = x @ w.T + b`, the output-major layout of
      Equinox and PyTorch).
    b: the bias, `d_out` entries (any shape), if any.
    transposed_weight: whether `w` is stored output-major.
    **kwargs: hashable constants kept on the tag.

  Returns:
    `y`, unchanged.

  Raises:
    ValueError: if the shapes do not fit a dense layer.
  """
  _check_dense(y, x, w, b, "register_dense", False, transposed_weight)
  return _single(
    dense.bind(
      *_dense_operands(y, x, w, b), **_dense_meta(transposed_weight, kwargs)
    )
  )


def register_repeated_dense(
  y: jax.Array,
  x: jax.Array,
  w: jax.Array,
  b: jax.Array | None = None,
  *,
  transposed_weight: bool = False,
  **kwargs: Any,
) -> jax.Array:
  """Tags a dense layer applied over extra leading axes.

  Every axis but the last acts as a batch axis for the curvature statistics.

  Args:
    y: the layer's output, `(batch, ..., d_out)`.
    x: its input, `(batch, ..., d_in)`.
    w: the weight, as for `register_dense`.
    b: the bias, `d_out` entries, if any.
    transposed_weight: whether `w` is stored output-major, `(d_out, d_in)`.
    **kwargs: hashable constants kept on the tag.

  Returns:
    `y`, unchanged.

  Raises:
    ValueError: if the shapes do not fit a dense layer.
  """
  _check_dense(y, x, w, b, "register_repeated_dense", True, transposed_weight)
  return _single(
    repeated_dense.bind(
      *_dense_operands(y, x, w, b), **_dense_meta(transposed_weight, kwargs)
    )
  )


def _dense_operands(y, x, w, b):
  return (y, x, w) if b is None else (y, x, w, b)


def _dense_meta(transposed_weight, kwargs):
  # Only recorded when set, so tags in the usual layout carry no extra key.
  return dict(kwargs, transposed_weight=True) if transposed_weight else kwargs


def register_embedding(
  y: jax.Array, ids: jax.Array, w: jax.Array, **kwargs: Any
) -> jax.Array:
  """Tags an embedding lookup `y = one_hot(ids) @ w`, i.e. `w[ids]`.

  It is a dense layer on one-hot inputs, applied at every position; its
  curvature block keeps the (diagonal) input factor as a vector.

  Args:
    y: the layer's output, `ids.shape + (d_out,)`.
    ids: the integer token ids (any float holding integers is accepted),
      batch axis first.
    w: the table, `(vocab, d_out)`.
    **kwargs: hashable constants kept on the tag.

  Returns:
    `y`, unchanged.

  Raises:
    ValueError: if the shapes do not fit an embedding lookup.
  """
  if (
    jnp.ndim(w) != 2
    or jnp.ndim(ids) < 1
    or jnp.shape(y) != jnp.shape(ids) + (jnp.shape(w)[1],)
  ):
    raise ValueError(
      "register_embedding: needs ids (batch, ...), a table (vocab, d_out) "
      f"and outputs ids.shape + (d_out,); got ids {jnp.shape(ids)}, table "
      f"{jnp.shape(w)}, outputs {jnp.shape(y)}."
    )
  return _single(embedding.bind(y, ids, w, **kwargs))


def dense_weight_split(
  w_shape: Sequence[int], d_in: int, transposed_weight: bool = False
) -> int | None:
  """Where a dense weight's axes split into input and output features.

  Args:
    w_shape: the weight's shape.
    d_in: the number of input features.
    transposed_weight: whether the output axes come first.

  Returns:
    The number of leading axes that flatten to `d_in` (or, transposed, to
    `d_out`), at least one and fewer than all; None if no split gives
    `d_in` input features.
  """
  w_shape = tuple(int(d) for d in w_shape)
  for k in range(1, len(w_shape)):
    inputs = w_shape[k:] if transposed_weight else w_shape[:k]
    if int(np.prod(inputs)) == d_in:
      return k
  return None


def _check_dense(y, x, w, b, fn, repeated, transposed):
  layout = "(d_out, d_in)" if transposed else "(d_in, d_out)"
  if jnp.ndim(w) < 2:
    raise ValueError(
      f"{fn}: the weight must have at least 2 axes, {layout}, "
      f"got shape {jnp.shape(w)}."
    )
  if repeated and jnp.ndim(x) < 2 or not repeated and jnp.ndim(x) != 2:
    hint = (
      "use register_repeated_dense for inputs with extra leading axes"
      if not repeated
      else "inputs need a batch axis and a feature axis"
    )
    raise ValueError(
      f"{fn}: inputs of shape {jnp.shape(x)} are not supported; {hint}."
    )
  d_in = jnp.shape(x)[-1]
  if dense_weight_split(jnp.shape(w), d_in, transposed) is None:
    raise ValueError(
      f"{fn}: inputs have {d_in} features but the weight of "
      f"shape {jnp.shape(w)} ({layout}) does not take {d_in}"
      + (
        "; pass transposed_weight=True for an output-major weight"
        if not transposed
        else ""
      )
      + "."
    )
  d_out = int(np.prod(jnp.shape(w))) // d_in
  if jnp.shape(y) != jnp.shape(x)[:-1] + (d_out,):
    raise ValueError(
      f"{fn}: outputs must have shape "
      f"{jnp.shape(x)[:-1] + (d_out,)} for inputs {jnp.shape(x)}"
      f" and a weight {jnp.shape(w)}, got {jnp.shape(y)}."
    )
  if b is not None and (jnp.ndim(b) < 1 or np.prod(jnp.shape(b)) != d_out):
    raise ValueError(
      f"{fn}: the bias must have {d_out} entries, e.g. shape "
      f"({d_out},), got {jnp.shape(b)}."
    )


def _normalize_pairs(value, n: int, name: str) -> tuple[int, ...]:
  if value is None:
    return (1,) * n
  if isinstance(value, int):
    return (value,) * n
  return tuple(int(v) for v in value)


def register_conv2d(
  y: jax.Array,
  x: jax.Array,
  w: jax.Array,
  b: jax.Array | None = None,
  *,
  window_strides: int | Sequence[int] = 1,
  padding: str | Sequence[tuple[int, int]] = "VALID",
  data_format: str | None = "NHWC",
  dimension_numbers: Any = None,
  lhs_dilation: int | Sequence[int] | None = None,
  rhs_dilation: int | Sequence[int] | None = None,
  feature_group_count: int = 1,
  batch_group_count: int = 1,
  **kwargs: Any,
) -> jax.Array:
  """Tags a 2-D convolution `y = conv(x, w) + b`.

  The convolution arguments mean what they mean for
  `jax.lax.conv_general_dilated`; they are stored on the tag in a normalised
  form (pairs of ints, explicit padding).

  Args:
    y: the layer's output.
    x: its input, 4-D.
    w: the kernel, 4-D.
    b: the bias, one entry per output channel (any shape, e.g. `(C,)` or
      Equinox's `(C, 1, 1)`), if any.
    window_strides: the strides, an int or a pair.
    padding: "SAME", "VALID" or explicit `(low, high)` pairs.
    data_format: "NHWC" (kernel "HWIO") or "NCHW" (kernel "OIHW"), used when
      `dimension_numbers` is None.
    dimension_numbers: as for `lax.conv_general_dilated`.
    lhs_dilation: input dilation, an int or a pair.
    rhs_dilation: kernel dilation, an int or a pair.
    feature_group_count: as for `lax.conv_general_dilated`.
    batch_group_count: as for `lax.conv_general_dilated`.
    **kwargs: hashable constants kept on the tag.

  Returns:
    `y`, unchanged.

  Raises:
    ValueError: for inputs or kernels that are not 4-D, or an unknown
      `data_format`.
  """
  if jnp.ndim(x) != 4 or jnp.ndim(w) != 4:
    raise ValueError(
      "register_conv2d: inputs and kernel must be 4-D, got "
      f"{jnp.shape(x)} and {jnp.shape(w)}."
    )
  if dimension_numbers is None:
    if data_format not in ("NHWC", "NCHW"):
      raise ValueError(
        f"register_conv2d: unknown data_format {data_format!r};"
        " use 'NHWC' or 'NCHW' or pass dimension_numbers."
      )
    kernel = "HWIO" if data_format == "NHWC" else "OIHW"
    dimension_numbers = (data_format, kernel, data_format)
  dn = lax.conv_dimension_numbers(jnp.shape(x), jnp.shape(w), dimension_numbers)
  channels = jnp.shape(w)[dn.rhs_spec[0]]
  if b is not None and np.prod(jnp.shape(b)) != channels:
    raise ValueError(
      f"register_conv2d: the bias must have one entry per "
      f"output channel ({channels}), got shape {jnp.shape(b)}."
    )
  strides = _normalize_pairs(window_strides, 2, "window_strides")
  lhs_dilation = _normalize_pairs(lhs_dilation, 2, "lhs_dilation")
  rhs_dilation = _normalize_pairs(rhs_dilation, 2, "rhs_dilation")
  if isinstance(padding, str):
    spatial_in = [jnp.shape(x)[d] for d in dn.lhs_spec[2:]]
    spatial_k = [jnp.shape(w)[d] for d in dn.rhs_spec[2:]]
    dilated_k = [(k - 1) * r + 1 for k, r in zip(spatial_k, rhs_dilation)]
    padding = lax.padtype_to_pads(spatial_in, dilated_k, strides, padding)
  padding = tuple((int(lo), int(hi)) for lo, hi in padding)
  operands = (y, x, w) if b is None else (y, x, w, b)
  return _single(
    conv2d.bind(
      *operands,
      window_strides=strides,
      padding=padding,
      dimension_numbers=dn,
      lhs_dilation=lhs_dilation,
      rhs_dilation=rhs_dilation,
      feature_group_count=int(feature_group_count),
      batch_group_count=int(batch_group_count),
      **kwargs,
    )
  )


def register_scale_and_shift(
  y: jax.Array,
  x: jax.Array,
  scale: jax.Array | None = None,
  shift: jax.Array | None = None,
  **kwargs: Any,
) -> jax.Array:
  """Tags `y = x * scale + shift`, where either term may be absent.

  Args:
    y: the layer's output.
    x: its input; the leading axis is the batch.
    scale: broadcasts against the trailing axes of `x`, or None.
    shift: broadcasts against the trailing axes of `x`, or None.
    **kwargs: hashable constants kept on the tag.

  Returns:
    `y`, unchanged.

  Raises:
    ValueError: if both terms are absent, or one would vary over the batch.
  """
  if scale is None and shift is None:
    raise ValueError("register_scale_and_shift needs a scale, a shift or both.")
  for name, p in (("scale", scale), ("shift", shift)):
    if (
      p is not None
      and jnp.ndim(p) >= jnp.ndim(x)
      and jnp.ndim(p) > 0
      and np.prod(jnp.shape(p)[: jnp.ndim(p) - jnp.ndim(x) + 1]) != 1
    ):
      raise ValueError(
        f"register_scale_and_shift: the {name} of shape "
        f"{jnp.shape(p)} would vary over the batch axis of x "
        f"{jnp.shape(x)}."
      )
  params = tuple(p for p in (scale, shift) if p is not None)
  return _single(
    scale_and_shift.bind(
      y,
      x,
      *params,
      has_scale=scale is not None,
      has_shift=shift is not None,
      **kwargs,
    )
  )
