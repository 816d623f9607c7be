"""Loss and layer tags: JAX primitives that mark what the curvature code needs.

A tag is an identity at run time (it returns some of its operands unchanged),
so a tagged model computes exactly what the untagged one does, under `jit`,
`vmap`, `grad` and `jvp`. In a traced jaxpr, though, a tag equation names a
loss (and the distribution it stands for) or a layer (and which variables are
its inputs, outputs and parameters). The tracer reads these equations.

Every tag equation carries a `meta` parameter, as KFAC-JAX 0.0.8's do: a
`LossMetaData` (the loss class and its argument names) or a `LayerMetaData`
(the layer's variant and which operands are outputs, inputs and parameters).
Each loss class and layer kind keeps its own primitive (`dense_tag`, ...);
0.0.8's single `loss_tag` and `layer_tag` bind through them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Generic, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir

T = TypeVar("T")
Arrays = tuple[jax.Array, ...]


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, kw_only=True, unsafe_hash=True)
class LayerData(Generic[T]):
  """A layer's operands by role: its inputs, outputs and parameters."""

  inputs: tuple[T, ...]
  outputs: tuple[T, ...]
  params: tuple[T, ...]

  def tree_flatten(self) -> tuple[tuple[tuple[T, ...], ...], None]:
    """The three tuples as children (no static data)."""
    return (self.inputs, self.outputs, self.params), None

  @classmethod
  def tree_unflatten(cls, aux_data: None, children: Sequence[Any]) -> LayerData:
    """Rebuilds from `tree_flatten`'s children."""
    del aux_data
    inputs, outputs, params = children
    return cls(inputs=inputs, outputs=outputs, params=params)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerMetaData:
  """What a layer tag equation says about its operands (hashable, static).

  Attributes:
    variant: the layer kind, e.g. "dense", "conv2d", "generic"; it picks the
      tag primitive (`<variant>_tag`) and so the default curvature block.
    outputs_index: positions of the layer's outputs among the operands.
    inputs_index: positions of its inputs.
    params_index: positions of its parameters.
    name: the layer's name, set when a curvature block is built for it.
    nesting: the names of the modules the layer sits in, outermost first.
  """

  variant: str
  outputs_index: tuple[int, ...]
  inputs_index: tuple[int, ...]
  params_index: tuple[int, ...]
  name: str | None = None
  nesting: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossMetaData(Generic[T]):
  """What a loss tag equation says about its operands (hashable, static).

  Attributes:
    loss_class: the `LossFunction` class the operands construct.
    parameter_dependants: names of the operands that depend on the
      parameters (the network outputs), which binding the tag returns.
    parameter_independants: names of the others (targets, weights).
    argument_names: the name of each operand, in operand order.
  """

  loss_class: type[T]
  parameter_dependants: tuple[str, ...]
  parameter_independants: tuple[str, ...]
  argument_names: tuple[str, ...]


def get_and_verify_loss_meta(
  args: Sequence[Any], params: dict[str, Any], err_suffix: str = ""
) -> LossMetaData:
  """The `LossMetaData` of a loss tag's parameters, checked against its operands.

  Args:
    args: the tag's operands (values or jaxpr variables).
    params: the tag's parameters.
    err_suffix: what to name in an error, e.g. the equation.

  Returns:
    `params["meta"]`.

  Raises:
    ValueError: if there is no `LossMetaData`, or not one name per operand.
  """
  meta = params.get("meta")
  where = f" ({err_suffix})" if err_suffix else ""
  if not isinstance(meta, LossMetaData):
    raise ValueError(
      f"A loss tag needs meta=LossMetaData(...), got meta={meta!r}{where}."
    )
  if len(args) != len(meta.argument_names):
    raise ValueError(
      f"A loss tag got {len(args)} operands but its meta names "
      f"{len(meta.argument_names)}: {meta.argument_names}{where}."
    )
  unknown = set(meta.parameter_dependants) - set(meta.argument_names)
  if unknown:
    raise ValueError(
      f"The loss tag's parameter dependants {sorted(unknown)} are not among "
      f"its argument names {meta.argument_names}{where}."
    )
  return meta


def get_loss_outputs(
  args: Sequence[T], params: dict[str, Any], err_suffix: str = ""
) -> tuple[T, ...]:
  """The operands a loss tag returns: its parameter dependants, in order.

  Args:
    args: the tag's operands.
    params: the tag's parameters, holding its `LossMetaData`.
    err_suffix: what to name in an error.

  Returns:
    The parameter-dependent operands.
  """
  meta = get_and_verify_loss_meta(args, params, err_suffix)
  by_name = dict(zip(meta.argument_names, args))
  return tuple(by_name[n] for n in meta.parameter_dependants)


def get_and_verify_layer_meta(
  args: Sequence[Any], params: dict[str, Any], err_suffix: str = ""
) -> LayerMetaData:
  """The `LayerMetaData` of a layer tag's parameters, checked against its operands.

  Args:
    args: the tag's operands.
    params: the tag's parameters.
    err_suffix: what to name in an error.

  Returns:
    `params["meta"]`.

  Raises:
    ValueError: if there is no `LayerMetaData`, or an index points past the
      operands.
  """
  meta = params.get("meta")
  where = f" ({err_suffix})" if err_suffix else ""
  if not isinstance(meta, LayerMetaData):
    raise ValueError(
      f"A layer tag needs meta=LayerMetaData(...), got meta={meta!r}{where}."
    )
  for role in ("outputs_index", "inputs_index", "params_index"):
    bad = [i for i in getattr(meta, role) if not 0 <= i < len(args)]
    if bad:
      raise ValueError(
        f"The layer tag's {role} {getattr(meta, role)} points past its "
        f"{len(args)} operands{where}."
      )
  return meta


def _register_identity_rules(
  primitive: jex_core.Primitive,
  returned: Callable[[Sequence[Any], dict[str, Any]], Sequence[int]],
) -> None:
  """Makes `primitive` an identity on the operands at `returned(operands, params)`.

  Its derivative is that of the identity on those operands, so under `grad` the
  tag vanishes from the linearised graph while the primal graph keeps it.
  """

  def impl(*operands, **params):
    return [operands[i] for i in returned(operands, params)]

  def abstract_eval(*operands, **params):
    return impl(*operands, **params)

  def jvp(primals, tangents, **params):
    out = primitive.bind(*primals, **params)
    out_tangents = [
      ad.instantiate_zeros(tangents[i]) for i in returned(primals, params)
    ]
    return out, out_tangents

  def batch(args, dims, **params):
    out = primitive.bind(*args, **params)
    return out, [dims[i] for i in returned(args, params)]

  primitive.multiple_results = True
  primitive.def_impl(impl)
  primitive.def_abstract_eval(abstract_eval)
  ad.primitive_jvps[primitive] = jvp
  batching.primitive_batchers[primitive] = batch
  mlir.register_lowering(primitive, mlir.lower_fun(impl, multiple_results=True))


def _loss_outputs_index(operands, params) -> list[int]:
  meta = get_and_verify_loss_meta(operands, params)
  return [meta.argument_names.index(n) for n in meta.parameter_dependants]


class LossTag(jex_core.Primitive):
  """Marks a loss: `bind(*args, meta=LossMetaData(...))` returns the
  parameter-dependent operands.

  `LossTag(cls, parameter_dependants, parameter_independants)` is the tag of
  one loss class (the documented API); binding it with `args_names=...`
  builds the `meta` from them. `LossTag()` (KFAC-JAX 0.0.8's `loss_tag`)
  takes the class from each binding's `meta`.
  """

  def __init__(
    self,
    cls: type | None = None,
    parameter_dependants: Sequence[str] = (),
    parameter_independants: Sequence[str] = (),
  ):
    """Makes the tag of one loss class, or 0.0.8's class-agnostic tag.

    Args:
      cls: the `LossFunction` class the tag stands for; its constructor takes
        the named arguments. None for a tag whose bindings carry the class
        in their `meta`.
      parameter_dependants: names of the arguments that depend on the
        parameters (the network outputs), in order.
      parameter_independants: names of the other arguments (e.g. targets).
    """
    super().__init__("loss_tag" if cls is None else f"{cls.__name__}_tag")
    self._cls = cls
    self._parameter_dependants = tuple(parameter_dependants)
    self._parameter_independants = tuple(parameter_independants)
    _register_identity_rules(self, _loss_outputs_index)

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

  def meta_for(self, args_names: Sequence[str]) -> LossMetaData:
    """The `LossMetaData` of a binding of this class's tag on `args_names`.

    Args:
      args_names: the names of the operands present, in operand order.

    Returns:
      The metadata naming this tag's loss class.

    Raises:
      ValueError: for the class-agnostic tag, which has no class of its own.
    """
    if self._cls is None:
      raise ValueError(
        f"{self.name} stands for no loss class: bind it with "
        "meta=LossMetaData(loss_class=..., ...)."
      )
    names = tuple(args_names)
    return LossMetaData(
      loss_class=self._cls,
      parameter_dependants=tuple(
        n for n in names if n in self._parameter_dependants
      ),
      parameter_independants=tuple(
        n for n in names if n not in self._parameter_dependants
      ),
      argument_names=names,
    )

  def bind(self, *args: Any, **params: Any) -> Any:
    """Binds the tag; `args_names=` is turned into the equivalent `meta`."""
    if "args_names" in params:
      params["meta"] = self.meta_for(params.pop("args_names"))
    get_and_verify_loss_meta(args, params, self.name)
    return super().bind(*args, **params)

  def _meta(self, args, args_names, meta) -> LossMetaData:
    if meta is None:
      if args_names is None:
        raise TypeError(f"{self.name}: pass meta= or args_names=.")
      meta = self.meta_for(args_names)
    return get_and_verify_loss_meta(args, {"meta": meta}, self.name)

  def get_outputs(
    self,
    *args: Any,
    args_names: Sequence[str] | None = None,
    meta: LossMetaData | None = None,
  ) -> tuple:
    """What binding the tag returns.

    Args:
      *args: the tag's operands.
      args_names: their names (the documented API), or
      meta: the binding's metadata.

    Returns:
      The parameter-dependent operands.
    """
    return get_loss_outputs(args, {"meta": self._meta(args, args_names, meta)})

  def loss(
    self,
    *args: Any,
    args_names: Sequence[str] | None = None,
    meta: LossMetaData | None = None,
  ) -> Any:
    """Builds the `LossFunction` this tag stands for from its operand values.

    Args:
      *args: the tag's operand values.
      args_names: their names, as bound (the documented API), or
      meta: the binding's metadata.

    Returns:
      An instance of the loss class.

    Raises:
      ValueError: if there is not one name per value.
    """
    meta = self._meta(args, args_names, meta)
    return meta.loss_class(**dict(zip(meta.argument_names, args)))

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
    return self.bind(*args, meta=self.meta_for(names))


class LayerTag(jex_core.Primitive):
  """Marks a layer: `bind(*outputs, *inputs, *parameters, **params)`.

  Returns the outputs unchanged (a layer with no outputs, such as the generic
  tag, returns its parameters). `params` must be hashable constants; `meta`
  among them is the binding's `LayerMetaData`, filled in when left out.

  `LayerTag(name, num_inputs, num_outputs)` is the tag of one layer kind,
  whose variant is its name without "_tag". `LayerTag()` (KFAC-JAX 0.0.8's
  `layer_tag`) binds through the kind that each binding's `meta.variant`
  names, its operands in any order that `meta` gives, and returns the first
  result.
  """

  _by_variant: ClassVar[dict[str, LayerTag]] = {}

  def __init__(
    self,
    name: str = "layer_tag",
    num_inputs: int | None = None,
    num_outputs: int | None = None,
    description: str | None = None,
  ):
    """Makes a layer tag.

    Args:
      name: the primitive's name (e.g. "dense_tag").
      num_inputs: how many operands are layer inputs; None (with
        `num_outputs` None) for 0.0.8's variant-dispatching tag.
      num_outputs: how many operands are layer outputs (0 for a tag that
        only marks parameters).
      description: the layer kind in words, for reports (e.g.
        "2-D convolution"); by default the variant with spaces.

    Raises:
      ValueError: if only one of the counts is given.
    """
    super().__init__(name)
    self.description = description or self.variant.replace("_", " ")
    if (num_inputs is None) != (num_outputs is None):
      raise ValueError(
        f"LayerTag({name!r}): give both num_inputs and num_outputs, or "
        "neither (the tag that dispatches on meta.variant)."
      )
    self._num_inputs = num_inputs
    self._num_outputs = num_outputs
    if num_inputs is None:
      return
    LayerTag._by_variant.setdefault(self.variant, self)
    # `bind` has checked (or filled in) every binding's meta.
    _register_identity_rules(
      self, lambda ops, params: params["meta"].outputs_index
    )

  @classmethod
  def of_variant(cls, variant: str) -> LayerTag:
    """The layer kind's tag primitive for a variant name.

    Args:
      variant: e.g. "dense", "repeated_dense", "conv2d", "scale_and_shift",
        "embedding", "generic", or the variant of a tag made by the user.

    Returns:
      The tag primitive `<variant>_tag`.

    Raises:
      ValueError: for a variant no tag was made for.
    """
    if variant not in cls._by_variant:
      raise ValueError(
        f"No layer tag has the variant {variant!r}; known: "
        f"{sorted(cls._by_variant)}. Make one with LayerTag('{variant}_tag', "
        "num_inputs, num_outputs)."
      )
    return cls._by_variant[variant]

  @property
  def variant(self) -> str:
    """The layer kind's name, e.g. "dense" for `dense_tag`."""
    return self.name.removesuffix("_tag")

  @property
  def num_inputs(self) -> int:
    """How many of the operands are layer inputs."""
    return self._kind_count(self._num_inputs)

  @property
  def num_outputs(self) -> int:
    """How many of the operands are layer outputs."""
    return self._kind_count(self._num_outputs)

  def _kind_count(self, count: int | None) -> int:
    if count is None:
      raise TypeError(
        f"{self.name} dispatches on meta.variant; its counts are those of "
        "the kind it binds."
      )
    return count

  def canonical_meta(
    self, num_operands: int, name: str | None = None, nesting=()
  ) -> LayerMetaData:
    """The metadata of this kind's binding on `num_operands` operands, laid
    out as outputs, inputs, then parameters.

    Args:
      num_operands: how many operands the binding has.
      name: the layer's name, if known.
      nesting: the modules the layer sits in.

    Returns:
      The `LayerMetaData`; a tag without outputs returns its parameters.
    """
    n_out, n_in = self.num_outputs, self.num_inputs
    params = tuple(range(n_out + n_in, num_operands))
    return LayerMetaData(
      variant=self.variant,
      outputs_index=tuple(range(n_out)) if n_out else params,
      inputs_index=tuple(range(n_out, n_out + n_in)),
      params_index=params,
      name=name,
      nesting=tuple(nesting),
    )

  def bind(self, *args: Any, **params: Any) -> Any:
    """Binds the tag, checking (or filling in) its `meta`."""
    meta = params.get("meta")
    if self._num_inputs is None:
      return self._bind_variant(args, params)
    if meta is None:
      params["meta"] = self.canonical_meta(len(args))
      return super().bind(*args, **params)
    get_and_verify_layer_meta(args, params, self.name)
    want = self.canonical_meta(len(args), meta.name, meta.nesting)
    if meta != want:
      raise ValueError(
        f"{self.name} takes its operands as outputs, inputs, parameters "
        f"({want}); got meta={meta}. Bind 0.0.8's layer_tag for other orders."
      )
    return super().bind(*args, **params)

  def _bind_variant(self, args, params):
    meta = get_and_verify_layer_meta(args, params, self.name)
    tag = LayerTag.of_variant(meta.variant)
    # A kind without outputs (generic) returns its parameters instead.
    outputs = meta.outputs_index if tag.num_outputs else ()
    roles = (outputs, meta.inputs_index, meta.params_index)
    operands = [args[i] for role in roles for i in role]
    if len(meta.inputs_index) != tag.num_inputs or (
      tag.num_outputs and len(meta.outputs_index) != tag.num_outputs
    ):
      raise ValueError(
        f"The {meta.variant} layer takes {tag.num_outputs} output(s) and "
        f"{tag.num_inputs} input(s); meta={meta} gives "
        f"{len(meta.outputs_index)} and {len(meta.inputs_index)}."
      )
    rest = {k: v for k, v in params.items() if k != "meta"}
    meta = tag.canonical_meta(len(operands), meta.name, meta.nesting)
    return tag.bind(*operands, meta=meta, **rest)[0]

  def layer_data(
    self,
    args: Sequence[T],
    params: dict[str, Any],
    err_suffix: str = "",
    exclude_inputs: bool = False,
  ) -> LayerData[T]:
    """Splits a binding's operands by role, as its `meta` says.

    Args:
      args: the operands (values or jaxpr variables).
      params: the binding's parameters, holding its `LayerMetaData`.
      err_suffix: what to name in an error.
      exclude_inputs: leave the inputs out (an empty tuple).

    Returns:
      The `LayerData`.
    """
    meta = get_and_verify_layer_meta(args, params, err_suffix)
    return LayerData(
      inputs=()
      if exclude_inputs
      else tuple(args[i] for i in meta.inputs_index),
      outputs=tuple(args[i] for i in meta.outputs_index),
      params=tuple(args[i] for i in meta.params_index),
    )

  def split_operands(self, operands: Sequence[Any]) -> tuple[tuple, ...]:
    """Splits a tag's operands by their role.

    Args:
      operands: the tag's operands, as values or jaxpr variables.

    Returns:
      `(outputs, inputs, params)`, three tuples.
    """
    n_out, n_in = self.num_outputs, self.num_inputs
    return (
      tuple(operands[:n_out]),
      tuple(operands[n_out : n_out + n_in]),
      tuple(operands[n_out + n_in :]),
    )


generic = LayerTag("generic_tag", num_inputs=0, num_outputs=0)
dense = LayerTag("dense_tag", num_inputs=1, num_outputs=1)
repeated_dense = LayerTag(
  "repeated_dense_tag",
  num_inputs=1,
  num_outputs=1,
  description="dense (repeated)",
)
conv2d = LayerTag(
  "conv2d_tag", num_inputs=1, num_outputs=1, description="2-D convolution"
)
scale_and_shift = LayerTag("scale_and_shift_tag", num_inputs=1, num_outputs=1)
embedding = LayerTag(
  "embedding_tag", num_inputs=1, num_outputs=1, description="embedding lookup"
)
# KFAC-JAX 0.0.8's two tags, which carry the kind in their bindings' meta.
loss_tag = LossTag()
layer_tag = LayerTag()


class LossTagEqn(jex_core.JaxprEqn):
  """The type of a loss tag's jaxpr equation, for annotations only."""

  primitive: LossTag


class LayerTagEqn(jex_core.JaxprEqn):
  """The type of a layer tag's jaxpr equation, for annotations only."""

  primitive: LayerTag


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


def layer_eqn_data(eqn: Any, raise_an_error: bool = True) -> LayerData:
  """The variables of a layer tag equation by role, as its `meta` says.

  Args:
    eqn: a jaxpr equation.
    raise_an_error: raise for an equation that is not a layer tag; else
      return an empty `LayerData` for it.

  Returns:
    The equation's `LayerData` of jaxpr variables.

  Raises:
    ValueError: if `eqn` is not a layer tag equation and `raise_an_error`.
  """
  if is_layer_tag_eqn(eqn):
    return eqn.primitive.layer_data(eqn.invars, eqn.params, str(eqn))
  if raise_an_error:
    raise ValueError(f"Not a layer tag equation: {eqn.primitive}.")
  return LayerData(inputs=(), outputs=(), params=())


def layer_eqn_name(eqn: Any) -> str:
  """The name in a layer tag equation's `meta`.

  Args:
    eqn: a layer tag equation.

  Returns:
    Its name; a curvature block names the equation it is built on.

  Raises:
    ValueError: if the equation has not been named yet.
  """
  meta = get_and_verify_layer_meta(eqn.invars, eqn.params, str(eqn))
  if meta.name is None:
    raise ValueError(
      f"The {eqn.primitive.name} equation has no name yet: names are given "
      "when a curvature block is built for it (see the block's layer_tag_eq)."
    )
  return meta.name


def named_layer_eqn(eqn: Any, name: str) -> Any:
  """`eqn` with `name` in its `meta` (a stand-in without `replace` as is).

  Args:
    eqn: a layer tag equation.
    name: the layer's name.

  Returns:
    A copy of the equation whose `meta.name` is `name`.
  """
  meta = eqn.params.get("meta")
  if not isinstance(meta, LayerMetaData) or not hasattr(eqn, "replace"):
    return eqn
  params = dict(eqn.params, meta=dataclasses.replace(meta, name=name))
  return eqn.replace(params=params)


def _loss_meta(eqn: Any) -> LossMetaData:
  if not is_loss_tag_eqn(eqn):
    raise ValueError(f"Not a loss tag equation: {eqn.primitive}.")
  return get_and_verify_loss_meta(eqn.invars, eqn.params, str(eqn))


def loss_eqn_parameter_dependants(
  eqn: Any, raise_an_error: bool = True
) -> list[Any]:
  """The variables of a loss tag equation that depend on the parameters.

  Args:
    eqn: a jaxpr equation.
    raise_an_error: raise for an equation that is not a loss tag; else
      return an empty list for it.

  Returns:
    The parameter-dependent variables, in order.

  Raises:
    ValueError: if `eqn` is not a loss tag equation and `raise_an_error`.
  """
  if not is_loss_tag_eqn(eqn) and not raise_an_error:
    return []
  _loss_meta(eqn)
  return list(get_loss_outputs(eqn.invars, eqn.params))


def loss_eqn_construct_loss(eqn: Any, *args: Any) -> Any:
  """Builds the loss a loss tag equation stands for, on operand values.

  Args:
    eqn: a loss tag equation.
    *args: values for its operands.

  Returns:
    The `LossFunction` instance.

  Raises:
    ValueError: if `eqn` is not a loss tag equation, or the values do not
      match its operands.
  """
  meta = _loss_meta(eqn)
  return eqn.primitive.loss(*args, meta=meta)


def loss_eqn_class_name(eqn: Any) -> str:
  """The name of the loss class a loss tag equation stands for.

  Args:
    eqn: a loss tag equation.

  Returns:
    E.g. "CategoricalLogitsNegativeLogProbLoss".
  """
  return _loss_meta(eqn).loss_class.__name__


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
  variant: str = "dense",
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
    variant: the layer kind, which picks the tag (`<variant>_tag`) and so
      the default block: "dense", "repeated_dense" (extra leading axes, as
      `register_repeated_dense`) or one of the user's own dense-like tags.
    transposed_weight: whether `w` is stored output-major.
    **kwargs: hashable constants kept on the tag.

  Returns:
    `y`, unchanged.

  Raises:
    ValueError: if the shapes do not fit a dense layer, or no tag has the
      variant.
  """
  tag = LayerTag.of_variant(variant)
  fn = "register_dense" if variant == "dense" else f"register_{variant}"
  _check_dense(y, x, w, b, fn, tag is not dense, transposed_weight)
  return _single(
    tag.bind(
      *_dense_operands(y, x, w, b), **_dense_meta(transposed_weight, kwargs)
    )
  )


def register_repeated_dense(
  y: jax.Array,
  x: jax.Array,
  w: jax.Array,
  b: jax.Array | None = None,
  variant: str = "repeated_dense",
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
    variant: the layer kind, as for `register_dense`.
    transposed_weight: whether `w` is stored output-major, `(d_out, d_in)`.
    **kwargs: hashable constants kept on the tag.

  Returns:
    `y`, unchanged.

  Raises:
    ValueError: if the shapes do not fit a dense layer.
  """
  return register_dense(
    y, x, w, b, variant, transposed_weight=transposed_weight, **kwargs
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
  variant: str = "conv2d",
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
    variant: the layer kind, which picks the tag (`<variant>_tag`) and so the
      default block; "conv2d" unless the user made a conv-like tag.
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
    LayerTag.of_variant(variant).bind(
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
  variant: str = "scale_and_shift",
  **kwargs: Any,
) -> jax.Array:
  """Tags `y = x * scale + shift`, where either term may be absent.

  Args:
    y: the layer's output.
    x: its input; the leading axis is the batch.
    scale: broadcasts against the trailing axes of `x`, or None.
    shift: broadcasts against the trailing axes of `x`, or None.
    variant: the layer kind, which picks the tag (`<variant>_tag`) and so the
      default block.
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
    LayerTag.of_variant(variant).bind(
      y,
      x,
      *params,
      has_scale=scale is not None,
      has_shift=shift is not None,
      **kwargs,
    )
  )
