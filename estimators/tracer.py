"""Tracing a tagged model function and differentiating through its tags.

`ProcessedJaxpr` traces the model once and finds its loss and layer tags. The
transforms below (`loss_tags_vjp`, `loss_tags_jvp`, `loss_tags_linearize`,
`loss_tags_hvp`, `layer_tags_vjp`) re-evaluate that jaxpr equation by
equation, which lets them read every tag's operands and add a zero
"perturbation" to each layer's outputs: the cotangent of that perturbation
is the derivative of the loss w.r.t. the layer's outputs, which JAX cannot
otherwise give for intermediates.

Layer tags inside a `scan` whose parameters are slices of stacked parameter
leaves (as `hk.experimental.layer_stack` makes) stay inside the scan: they
become `StackedLayerTag`s, whose values and perturbations carry a leading
axis over the scan's iterations.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar, cast

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core

from estimators import graph_matcher, jaxpr_utils, tags
from estimators.jaxpr_utils import TracingError


def _holds_tag(jaxpr, kinds=(tags.LossTag, tags.LayerTag)) -> bool:
  for eqn in jaxpr.eqns:
    if isinstance(eqn.primitive, kinds):
      return True
    if any(_holds_tag(sub, kinds) for sub, _ in jaxpr_utils.sub_jaxprs(eqn)):
      return True
  return False


def _eval_inlined(jaxpr, consts, *args):
  """Evaluates `jaxpr`, inlining call primitives whose bodies hold tags.

  A call (`jaxpr_utils.INLINABLE_PRIMITIVES`) whose body holds a tag is
  inlined, so that the tag shows up in the flat top-level jaxpr. A scan keeps
  its layer tags (see `StackedLayerTag`); any other tag inside scan, while or
  cond is an error.
  """
  env: dict[Any, Any] = {}

  def read(v):
    return v.val if isinstance(v, jex_core.Literal) else env[v]

  for var, val in zip(jaxpr.constvars, consts):
    env[var] = val
  for var, val in zip(jaxpr.invars, args):
    env[var] = val
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    subs = list(jaxpr_utils.sub_jaxprs(eqn))
    if subs and any(_holds_tag(s) for s, _ in subs):
      if eqn.primitive.name == "scan" and not _holds_tag(
        subs[0][0], tags.LossTag
      ):
        outvals = _eval_scan_inlined(eqn, invals)
      elif (
        eqn.primitive.name not in jaxpr_utils.INLINABLE_PRIMITIVES
        or len(subs) != 1
      ):
        raise TracingError(
          f"A loss or layer tag sits inside a `{eqn.primitive.name}`, which "
          "the tracer cannot flatten. Register losses outside of any "
          "scan/while/cond, and layers outside of while/cond (layers inside "
          "a scan over stacked parameters are supported)."
        )
      else:
        outvals = _eval_call_inlined(subs[0], invals)
    else:
      outvals = jaxpr_utils.bind_equation(eqn, invals)
    for var, val in zip(eqn.outvars, outvals):
      env[var] = val
  return [read(v) for v in jaxpr.outvars]


def _eval_call_inlined(sub_and_consts, invals):
  sub, sub_consts = sub_and_consts
  # custom_jvp/vjp calls carry their consts as leading operands.
  n_extra = len(invals) - len(sub.invars)
  return _eval_inlined(sub, sub_consts, *invals[n_extra:])


def _eval_scan_inlined(eqn, invals):
  """Re-stages a scan whose body holds layer tags, with that body flattened."""
  body = eqn.params["jaxpr"]

  def body_fn(consts, carry, xs, _):
    outs = _eval_inlined(body.jaxpr, body.consts, *consts, *carry, *xs)
    return outs[: len(carry)], outs[len(carry) :], None

  return jaxpr_utils.rebind_scan(eqn, invals, body_fn)[0]


T = TypeVar("T")


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerVjpData(Mapping, Generic[T]):
  """One layer's values and cotangents, as `layer_tags_vjp` gives them.

  `primals` holds the layer's inputs, outputs and parameters; `tangents` the
  cotangents of its outputs and parameters (no inputs). It also reads as the
  mapping the blocks take: `inputs`, `outputs`, `params`, `outputs_tangent`
  and `params_tangent`, each a tuple.
  """

  primals: tags.LayerData[T]
  tangents: tags.LayerData[T]

  _KEYS = {
    "inputs": ("primals", "inputs"),
    "outputs": ("primals", "outputs"),
    "params": ("primals", "params"),
    "outputs_tangent": ("tangents", "outputs"),
    "params_tangent": ("tangents", "params"),
  }

  def __getitem__(self, key: str) -> tuple[T, ...]:
    part, role = self._KEYS[key]
    return getattr(getattr(self, part), role)

  def __iter__(self) -> Iterator[str]:
    return iter(self._KEYS)

  def __len__(self) -> int:
    return len(self._KEYS)

  def tree_flatten(self) -> tuple[tuple[tags.LayerData[T], ...], None]:
    """`primals` and `tangents` as children."""
    return (self.primals, self.tangents), None

  @classmethod
  def tree_unflatten(cls, aux_data: None, children: Sequence[Any]):
    """Rebuilds from `tree_flatten`'s children."""
    del aux_data
    primals, tangents = children
    return cls(primals=primals, tangents=tangents)


@dataclasses.dataclass(frozen=True)
class _GenericParamsTag:
  """A stand-in generic tag equation for parameters that no tag claims."""

  invars: tuple
  primitive: tags.LayerTag = tags.generic

  @property
  def params(self) -> dict:
    return {"meta": self.primitive.canonical_meta(len(self.invars))}

  @property
  def outvars(self):
    return self.invars


@dataclasses.dataclass(frozen=True, eq=False)
class StackedLayerTag:
  """A layer tag inside a top-level scan, applied once per iteration.

  `inner` is the tag equation in the scan's body; its parameters are the
  per-iteration slices of the stacked parameter leaves `params_vars`. Values
  of the layer (inputs, outputs, params) have a leading axis of size
  `length`, one entry per iteration.
  """

  inner: Any
  scan: Any
  params_vars: tuple

  @property
  def primitive(self) -> tags.LayerTag:
    """The inner tag's primitive."""
    return self.inner.primitive

  @property
  def params(self) -> dict:
    """The inner tag's static parameters."""
    return self.inner.params

  @property
  def length(self) -> int:
    """The number of iterations of the scan."""
    return self.scan.params["length"]


def _param_vars(tag) -> tuple:
  if isinstance(tag, StackedLayerTag):
    return tag.params_vars
  return tags.layer_eqn_parts(tag)[2]


def _outputs_avals(tag) -> list:
  if isinstance(tag, StackedLayerTag):
    return [
      jax.ShapeDtypeStruct((tag.length,) + tuple(v.aval.shape), v.aval.dtype)
      for v in tags.layer_eqn_parts(tag.inner)[0]
    ]
  return [v.aval for v in tags.layer_eqn_parts(tag)[0]]


class ProcessedJaxpr:
  """The flattened jaxpr of a model function, with its tags located.

  Attributes:
    jaxpr: the flat jaxpr (tag-holding calls inlined).
    consts: the values of its constants.
    in_tree: the tree structure of the function's positional arguments.
    params_index: which argument holds the parameters.
    loss_tags: the loss tag equations, in order.
    layer_tags: the layer tags (equations, `StackedLayerTag` objects or stand-in
      generic tags), ordered by the position of their parameters.
    layer_indices: per layer tag, the positions of its parameters among the
      leaves of the params argument.
  """

  def __init__(
    self,
    jaxpr: jex_core.Jaxpr,
    consts: Sequence[Any],
    in_tree: Any,
    params_index: int = 0,
    allow_left_out_params: bool = False,
    register_left_out_as_generic: bool = False,
  ):
    """Locates the tags of an already flattened jaxpr.

    Args:
      jaxpr: the flat jaxpr of the function, taking flattened arguments.
      consts: the values of its constants.
      in_tree: the tree structure of the function's positional arguments.
      params_index: which argument holds the parameters.
      allow_left_out_params: accept parameters that no layer tag claims (they
        get no block).
      register_left_out_as_generic: give every such parameter a generic tag
        of its own.

    Raises:
      TracingError: if no loss is registered, a parameter is registered
        twice or not as a leaf of the params argument, or one is left out
        when that is not allowed.
    """
    self.jaxpr = jaxpr
    self.consts = tuple(consts)
    self.in_tree = in_tree
    self.params_index = params_index
    in_vars = jax.tree.unflatten(in_tree, jaxpr.invars)
    if not 0 <= params_index < len(in_vars):
      raise TracingError(
        f"params_index={params_index} but the function takes "
        f"{len(in_vars)} positional arguments."
      )
    self._in_vars = in_vars
    self._param_position = {
      v: i for i, v in enumerate(jax.tree.leaves(in_vars[params_index]))
    }

    self.loss_tags = tuple(e for e in jaxpr.eqns if tags.is_loss_tag_eqn(e))
    if not self.loss_tags:
      raise TracingError(
        "No loss was registered in the model function: call e.g. "
        "estimators.register_softmax_cross_entropy_loss(logits, targets) "
        "(or another estimators.register_*_loss) on the model's output."
      )
    # Equations, and stand-ins for them (`StackedLayerTag`, generic tags).
    layer_tags: list[Any] = [e for e in jaxpr.eqns if tags.is_layer_tag_eqn(e)]
    # id(scan eqn) -> [(layer, inner tag eqn)]
    self._stacked_in: dict[int, list[tuple[int, Any]]] = {}
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "scan" and _holds_tag(
        eqn.params["jaxpr"].jaxpr, tags.LayerTag
      ):
        layer_tags.extend(self._stacked_tags(eqn))
    claimed: dict[Any, Any] = {}  # parameter variable -> its tag
    for eqn in layer_tags:
      for var in _param_vars(eqn):
        if var not in self._param_position:
          raise TracingError(
            f"A {eqn.primitive.name} was given a parameter that is not a "
            "leaf of the params argument (e.g. a reshaped or cast copy). "
            "Pass the parameter arrays to the register_* call unchanged."
          )
        if var in claimed:
          raise TracingError(
            f"Parameter #{self._param_position[var]} is registered in two "
            f"layer tags ({claimed[var].primitive.name} and "
            f"{eqn.primitive.name}); register each parameter once."
          )
        claimed[var] = eqn
    left_out = [v for v in self.params_vars_flat if v not in claimed]
    if left_out and register_left_out_as_generic:
      layer_tags.extend(_GenericParamsTag((v,)) for v in left_out)
    elif left_out and not allow_left_out_params:
      shapes = [tuple(v.aval.shape) for v in left_out]
      raise TracingError(
        f"{len(left_out)} parameter(s) with shapes {shapes} are not in any "
        "layer tag. Register them (e.g. estimators.register_generic) or let "
        "the estimator register them (auto_register_tags=True)."
      )
    indices = [self._layer_param_indices(e) for e in layer_tags]
    order = sorted(range(len(layer_tags)), key=lambda i: indices[i])
    self.layer_tags = tuple(layer_tags[i] for i in order)
    self.layer_indices = tuple(indices[i] for i in order)
    for j, tag in enumerate(self.layer_tags):
      if isinstance(tag, StackedLayerTag):
        self._stacked_in.setdefault(id(tag.scan), []).append((j, tag.inner))
    self._last_loss_position = max(
      i for i, e in enumerate(jaxpr.eqns) if tags.is_loss_tag_eqn(e)
    )

  def _layer_param_indices(self, eqn) -> tuple[int, ...]:
    return tuple(self._param_position[v] for v in _param_vars(eqn))

  def _stacked_tags(self, scan) -> list[StackedLayerTag]:
    """The layer tags in `scan`'s body, with their stacked parameter leaves."""
    body = scan.params["jaxpr"].jaxpr
    _, _, xs = jaxpr_utils.scan_parts(scan, scan.invars)
    scanned = dict(zip(jaxpr_utils.scan_parts(scan, body.invars)[2], xs))
    found = []
    for eqn in body.eqns:
      if any(_holds_tag(sub) for sub, _ in jaxpr_utils.sub_jaxprs(eqn)):
        raise TracingError(
          "A layer tag sits in a scan nested inside another scan; only one "
          "level of stacked layers is supported."
        )
      if not tags.is_layer_tag_eqn(eqn):
        continue
      params = tags.layer_eqn_parts(eqn)[2]
      outer = [scanned.get(v) for v in params]
      if any(v is None or v not in self._param_position for v in outer):
        raise TracingError(
          f"A {eqn.primitive.name} inside a scan takes a parameter that is "
          "not a slice of a stacked leaf of the params argument. Inside a "
          "scan, register layers whose parameters are the scanned slices of "
          "params leaves (as hk.experimental.layer_stack does)."
        )
      found.append(StackedLayerTag(eqn, scan, tuple(outer)))
    return found

  @property
  def in_vars_flat(self) -> list:
    """The jaxpr's input variables, one per leaf of the arguments."""
    return list(self.jaxpr.invars)

  @property
  def in_vars(self) -> Any:
    """The input variables, structured like the positional arguments."""
    return self._in_vars

  @property
  def params_vars(self) -> Any:
    """The input variables of the params argument, structured like it."""
    return self._in_vars[self.params_index]

  @property
  def params_vars_flat(self) -> list:
    """The input variables of the params argument's leaves, in order."""
    return jax.tree.leaves(self.params_vars)

  @property
  def params_tree(self) -> Any:
    """The tree structure of the params argument."""
    return jax.tree.structure(self.params_vars)

  @classmethod
  def make_from_func(
    cls,
    func: Callable,
    func_args: Sequence[Any],
    params_index: int = 0,
    auto_register_tags: bool = True,
    allow_left_out_params: bool = False,
    **auto_registration_kwargs,
  ) -> ProcessedJaxpr:
    """Traces `func(*func_args)` and builds the processed jaxpr.

    Args:
      func: the model function; it must register at least one loss.
      func_args: example positional arguments (arrays or shape structs).
      params_index: which argument holds the parameters.
      auto_register_tags: first pass `func` through
        `graph_matcher.auto_register_tags`, which tags the layers it
        recognises and gives every other parameter a generic tag.
      allow_left_out_params: accept parameters that no layer tag claims.
      **auto_registration_kwargs: passed on to `auto_register_tags`.

    Returns:
      The processed jaxpr.

    Raises:
      TracingError: if the function cannot be used as written (see
        `ProcessedJaxpr.__init__`).
    """
    func_args = tuple(func_args)
    if auto_register_tags:
      func = graph_matcher.auto_register_tags(
        func, func_args, params_index, **auto_registration_kwargs
      )
    flat_args, in_tree = jax.tree.flatten(func_args)

    def flat_func(*flat):
      return func(*jax.tree.unflatten(in_tree, flat))

    abstract_args = jaxpr_utils.shape_dtype_structs(flat_args)
    closed = jax.make_jaxpr(flat_func)(*abstract_args)
    flat = jax.make_jaxpr(
      functools.partial(_eval_inlined, closed.jaxpr, closed.consts)
    )(*abstract_args)
    return cls(
      flat.jaxpr,
      flat.consts,
      in_tree,
      params_index,
      allow_left_out_params=allow_left_out_params,
      register_left_out_as_generic=auto_register_tags,
    )

  def evaluate_tags(
    self, flat_args: Sequence[Any], perturbations: Sequence[tuple] | None = None
  ) -> tuple[list[tuple], list[dict]]:
    """Runs the model up to its last loss tag.

    Args:
      flat_args: values of the flattened arguments.
      perturbations: one tuple per layer tag, added to that layer's outputs;
        None adds nothing.

    Returns:
      `(losses_args, layer_values)`: the operand values of each loss tag,
      and per layer tag a dict of its `inputs`, `outputs` and `params`.
    """
    _, losses_args, layer_values = self._evaluate(
      flat_args, perturbations, self.jaxpr.eqns[: self._last_loss_position + 1]
    )
    return losses_args, layer_values

  def evaluate_outputs(
    self, flat_args: Sequence[Any], perturbations: Sequence[tuple] | None = None
  ) -> tuple[list, list[dict]]:
    """Runs only what the function's outputs need.

    Args:
      flat_args: values of the flattened arguments.
      perturbations: as for `evaluate_tags`.

    Returns:
      `(outputs, layer_values)`: the flat outputs, and the layer values as
      `evaluate_tags` gives them, for the layers that were run.
    """
    outputs, _, layer_values = self._evaluate(
      flat_args, perturbations, self._output_eqns, self.jaxpr.outvars
    )
    return outputs, layer_values

  @functools.cached_property
  def _output_eqns(self) -> tuple:
    """The equations the outputs depend on, in order: a value-and-grad
    function also holds its backward pass, which would only slow down
    compiling."""
    needed = {
      v for v in self.jaxpr.outvars if not isinstance(v, jex_core.Literal)
    }
    kept = []
    for eqn in reversed(self.jaxpr.eqns):
      if any(v in needed for v in eqn.outvars):
        kept.append(eqn)
        needed.update(
          v for v in eqn.invars if not isinstance(v, jex_core.Literal)
        )
    return tuple(reversed(kept))

  def _evaluate(self, flat_args, perturbations, eqns, outvars=()):
    """Runs `eqns`: (the values of `outvars`, loss operands, layer values)."""
    env: dict[Any, Any] = {}

    def read(v):
      return v.val if isinstance(v, jex_core.Literal) else env[v]

    for var, val in zip(self.jaxpr.constvars, self.consts):
      env[var] = val
    for var, val in zip(self.jaxpr.invars, flat_args):
      env[var] = val
    layer_position = {id(e): i for i, e in enumerate(self.layer_tags)}
    layer_values: list[dict[str, Any] | None] = [None] * len(self.layer_tags)
    losses_args = []
    for eqn in eqns:
      invals = [read(v) for v in eqn.invars]
      stacked = self._stacked_in.get(id(eqn))
      if stacked:
        outvals, stacked_values = _eval_stacked_scan(
          eqn,
          invals,
          [inner for _, inner in stacked],
          None
          if perturbations is None
          else [perturbations[j] for j, _ in stacked],
        )
        for (j, _), (ins, outs) in zip(stacked, stacked_values):
          params = tuple(read(v) for v in _param_vars(self.layer_tags[j]))
          layer_values[j] = dict(inputs=ins, outputs=outs, params=params)
      else:
        outvals = jaxpr_utils.bind_equation(eqn, invals)
      if tags.is_loss_tag_eqn(eqn):
        losses_args.append(tuple(invals))
      elif id(eqn) in layer_position:
        j = layer_position[id(eqn)]
        ins, outs, outvals = _read_layer_tag(
          eqn, invals, outvals, perturbations, j
        )
        params = eqn.primitive.split_operands(invals)[2]
        layer_values[j] = dict(inputs=ins, outputs=outs, params=params)
      for var, val in zip(eqn.outvars, outvals):
        env[var] = val
    for j, eqn in enumerate(self.layer_tags):
      if layer_values[j] is None:  # a parameters-only (generic) tag
        params = tuple(read(v) for v in _param_vars(eqn))
        layer_values[j] = dict(inputs=(), outputs=(), params=params)
    return [read(v) for v in outvars], losses_args, layer_values

  def params_reach_outputs_only_through_layer(self, index: int) -> bool:
    """Whether a layer's parameters reach the outputs only through the layer.

    If so (no other use, e.g. an L2 term), the parameters' gradient is the
    layer's own: for a dense layer, the sum over rows of input times
    output-cotangent outer products.

    Args:
      index: the position of the layer in `layer_tags`.

    Returns:
      True when the outputs see the parameters only through that layer tag's
      outputs; False for stacked and generic tags.
    """
    tag = self.layer_tags[index]
    if isinstance(tag, (StackedLayerTag, _GenericParamsTag)) or not any(
      eqn is tag for eqn in self._output_eqns
    ):
      return False
    tainted = set(_param_vars(tag))
    for eqn in self.jaxpr.eqns:
      if eqn is tag:
        continue
      if any(
        not isinstance(v, jex_core.Literal) and v in tainted for v in eqn.invars
      ):
        tainted.update(eqn.outvars)
    return not any(
      v in tainted
      for v in self.jaxpr.outvars
      if not isinstance(v, jex_core.Literal)
    )

  def perturbation_zeros(self) -> tuple[tuple[jax.Array, ...], ...]:
    """Zero perturbations for every layer.

    Returns:
      One tuple per layer tag of zeros shaped like its outputs (stacked
      layers with their leading iteration axis).
    """
    return tuple(
      tuple(jnp.zeros(a.shape, a.dtype) for a in _outputs_avals(t))
      for t in self.layer_tags
    )

  def make_losses(self, losses_args: Sequence[tuple]) -> tuple:
    """Builds the loss objects from loss tag operands.

    Args:
      losses_args: the operand values of each loss tag.

    Returns:
      One `LossFunction` per loss tag.
    """
    return tuple(
      cast(tags.LossTag, eqn.primitive).loss(*args, **eqn.params)
      for eqn, args in zip(self.loss_tags, losses_args)
    )


def _read_layer_tag(eqn, invals, outvals, perturbations, index):
  """(inputs, outputs) of a layer tag, and its results with
  `perturbations[index]` added (when `perturbations` is not None)."""
  outs, ins, _ = eqn.primitive.split_operands(invals)
  if perturbations is not None and outs:
    outvals = [o + p for o, p in zip(outvals, perturbations[index])]
  return tuple(ins), tuple(outs), outvals


def _eval_stacked_scan(scan, invals, inner_tags, perturbations):
  """Runs `scan`, reading the operands of `inner_tags` in each iteration.

  Returns the scan's outputs and, per tag, its (inputs, outputs) stacked over
  iterations; `perturbations` (one tuple per tag, stacked) are added to the
  tags' outputs.
  """
  body = scan.params["jaxpr"]
  position = {id(e): k for k, e in enumerate(inner_tags)}

  def body_fn(consts, carry, xs, perturbation):
    env = dict(zip(body.jaxpr.constvars, body.consts))
    env.update(zip(body.jaxpr.invars, consts + carry + xs))

    def read(v):
      return v.val if isinstance(v, jex_core.Literal) else env[v]

    recorded: list[tuple[Any, Any] | None] = [None] * len(inner_tags)
    for eqn in body.jaxpr.eqns:
      vals = [read(v) for v in eqn.invars]
      outvals = jaxpr_utils.bind_equation(eqn, vals)
      k = position.get(id(eqn))
      if k is not None:
        ins, outs, outvals = _read_layer_tag(
          eqn, vals, outvals, perturbation, k
        )
        recorded[k] = (ins, outs)
      env.update(zip(eqn.outvars, outvals))
    outs = [read(v) for v in body.jaxpr.outvars]
    return outs[: len(carry)], outs[len(carry) :], recorded

  return jaxpr_utils.rebind_scan(scan, invals, body_fn, perturbations)


class TracedFunction:
  """A model function with one `ProcessedJaxpr` cached per argument signature.

  The signature is the arguments' tree structure, shapes and dtypes.
  """

  def __init__(
    self,
    func: Callable,
    params_index: int,
    auto_register_tags: bool = True,
    raise_error_on_diff_jaxpr: bool = True,
    **auto_registration_kwargs,
  ):
    """Wraps `func`; nothing is traced yet.

    Args:
      func: the model function.
      params_index: which argument holds the parameters.
      auto_register_tags: as for `ProcessedJaxpr.make_from_func`.
      raise_error_on_diff_jaxpr: raise when a new signature finds tags that
        differ from the first one's.
      **auto_registration_kwargs: passed on to `auto_register_tags`.
    """
    self.func = func
    self.params_index = params_index
    self.auto_register_tags = auto_register_tags
    self.raise_error_on_diff_jaxpr = raise_error_on_diff_jaxpr
    self.kwargs = auto_registration_kwargs
    self._cache: dict[Any, ProcessedJaxpr] = {}

  def processed(self, func_args: Sequence[Any]) -> ProcessedJaxpr:
    """The processed jaxpr for these arguments, traced on first use.

    Args:
      func_args: the function's positional arguments.

    Returns:
      The cached or newly built `ProcessedJaxpr`.

    Raises:
      TracingError: if `raise_error_on_diff_jaxpr` and the tags differ from
        those found for an earlier signature.
    """
    leaves, tree = jax.tree.flatten(tuple(func_args))
    key = (tree, tuple((jnp.shape(x), jnp.result_type(x)) for x in leaves))
    if key not in self._cache:
      proc = ProcessedJaxpr.make_from_func(
        self.func,
        func_args,
        self.params_index,
        auto_register_tags=self.auto_register_tags,
        **self.kwargs,
      )
      if self._cache and self.raise_error_on_diff_jaxpr:
        first = next(iter(self._cache.values()))
        if first.layer_indices != proc.layer_indices or len(
          first.loss_tags
        ) != len(proc.loss_tags):
          raise TracingError(
            "Tracing the model with new argument shapes found different "
            "loss or layer tags than before; the curvature blocks no longer "
            "match the model."
          )
      self._cache[key] = proc
    return self._cache[key]

  def split(
    self, func_args: Sequence[Any]
  ) -> tuple[ProcessedJaxpr, list, list[int]]:
    """The processed jaxpr, the flat argument values and where the params are.

    Args:
      func_args: the function's positional arguments.

    Returns:
      `(proc, flat_args, positions)`: `positions` are the indices in
      `flat_args` of the params argument's leaves.
    """
    proc = self.processed(func_args)
    flat_args = jax.tree.leaves(tuple(func_args))
    positions = [
      i for i, v in enumerate(proc.jaxpr.invars) if v in proc._param_position
    ]
    return proc, flat_args, positions


def _with_params(flat_args, positions, params_flat):
  flat = list(flat_args)
  for i, p in zip(positions, params_flat):
    flat[i] = p
  return flat


# func -> {params_index: its TracedFunction}
_SHARED_TRACES: weakref.WeakKeyDictionary[
  Callable, dict[int, TracedFunction]
] = weakref.WeakKeyDictionary()


def traced_function(
  func: Callable, params_index: int = 0, **kwargs
) -> TracedFunction:
  """The trace cache of `func`, shared when no options are given.

  Every transform of the same model function then reuses one
  `ProcessedJaxpr` instead of tracing and matching again.

  Args:
    func: the model function.
    params_index: which argument holds the parameters.
    **kwargs: options of `TracedFunction`; with any, a private cache is made.

  Returns:
    The `TracedFunction` of `func`.
  """
  if kwargs:
    return TracedFunction(func, params_index, **kwargs)
  try:
    per_func = _SHARED_TRACES.setdefault(func, {})
  except TypeError:  # not weak-referenceable
    return TracedFunction(func, params_index)
  if params_index not in per_func:
    per_func[params_index] = TracedFunction(func, params_index)
  return per_func[params_index]


def _deps(proc, losses_args):
  return tuple(
    tags.get_loss_outputs(args, e.params)
    for e, args in zip(proc.loss_tags, losses_args)
  )


def _loss_inputs_fn(traced: TracedFunction, func_args):
  """(proc, params_flat, f); f(params_flat) -> (dependants, all loss args)."""
  proc, flat_args, positions = traced.split(func_args)

  def f(params_flat):
    losses_args, _ = proc.evaluate_tags(
      _with_params(flat_args, positions, params_flat)
    )
    return _deps(proc, losses_args), losses_args

  return proc, [flat_args[i] for i in positions], f


class TransformedFunction:
  """A transformation of a model function (what `loss_tags_vjp` and its
  siblings return), called as a function.

  KFAC-JAX 0.0.8 returns the transformation together with a jaxpr
  extractor, `(transformed, extractor)`; unpacking this object into two
  names gives that pair, so code written for either form works. The
  extractor maps `func_args` to the model's `ProcessedJaxpr`.
  """

  def __init__(self, transformed: Callable, traced: TracedFunction):
    self._transformed = transformed
    self._traced = traced

  def __call__(self, *args, **kwargs):
    return self._transformed(*args, **kwargs)

  def jaxpr_extractor(self, func_args: Sequence[Any]) -> ProcessedJaxpr:
    """The processed jaxpr of the model for these arguments."""
    return self._traced.processed(func_args)

  def __iter__(self):
    return iter((self, self.jaxpr_extractor))


def loss_tags_vjp(func: Callable, params_index: int = 0) -> Callable:
  """The VJP from the registered losses' inputs back to the parameters.

  Args:
    func: the model function; it must register at least one loss.
    params_index: which argument holds the parameters.

  Returns:
    `f(func_args) -> (losses, vjp)`. `vjp(tangents)` maps one tuple of
    tangents per loss (shaped like that loss's parameter-dependent inputs)
    to the parameter gradient, structured like the params.
  """
  traced = traced_function(func, params_index)

  def transformed(func_args):
    proc, params_flat, f = _loss_inputs_fn(traced, func_args)
    _, vjp, losses_args = jax.vjp(f, params_flat, has_aux=True)

    def vjp_func(tangents):
      tangents = tuple(tuple(t) for t in tangents)
      return jax.tree.unflatten(proc.params_tree, vjp(tangents)[0])

    return proc.make_losses(losses_args), vjp_func

  return TransformedFunction(transformed, traced)


def loss_tags_jvp(func: Callable, params_index: int = 0) -> Callable:
  """The JVP from the parameters to the registered losses' inputs.

  Args:
    func: the model function; it must register at least one loss.
    params_index: which argument holds the parameters.

  Returns:
    `f(func_args, params_tangents) -> (losses, loss input tangents)`, with
    one tuple of tangents per loss.
  """
  traced = traced_function(func, params_index)

  def transformed(func_args, params_tangents):
    proc, params_flat, f = _loss_inputs_fn(traced, func_args)
    (_, losses_args), (tangents, _) = jax.jvp(
      f, (params_flat,), (jax.tree.leaves(params_tangents),)
    )
    return proc.make_losses(losses_args), tangents

  return TransformedFunction(transformed, traced)


def loss_tags_linearize(func: Callable, params_index: int = 0) -> Callable:
  """Like `loss_tags_jvp`, with one forward pass for any number of tangents.

  Args:
    func: the model function; it must register at least one loss.
    params_index: which argument holds the parameters.

  Returns:
    `f(func_args) -> (losses, jvp)`, where `jvp(params_tangents)` gives the
    loss input tangents as `loss_tags_jvp` does.
  """
  traced = traced_function(func, params_index)

  def transformed(func_args):
    proc, params_flat, f = _loss_inputs_fn(traced, func_args)
    _, linear, losses_args = jax.linearize(f, params_flat, has_aux=True)

    def jvp_func(params_tangents):
      return linear(jax.tree.leaves(params_tangents))

    return proc.make_losses(losses_args), jvp_func

  return TransformedFunction(transformed, traced)


def loss_tags_hvp(func: Callable, params_index: int = 0) -> Callable:
  """Hessian-vector products of the registered losses w.r.t. the parameters.

  The Hessian is that of the sum over losses of `sum(loss.evaluate())`, i.e.
  of the loss summed (not averaged) over the batch.

  Args:
    func: the model function; it must register at least one loss.
    params_index: which argument holds the parameters.

  Returns:
    `f(func_args, params_tangents) -> (hvp, losses)`, `hvp` structured like
    the params.
  """
  traced = traced_function(func, params_index)

  def transformed(func_args, params_tangents):
    proc, params_flat, f = _loss_inputs_fn(traced, func_args)

    def total_loss(p_flat):
      _, losses_args = f(p_flat)
      losses = proc.make_losses(losses_args)
      return sum(jnp.sum(loss.evaluate()) for loss in losses), losses_args

    _, hvp, losses_args = jax.jvp(
      lambda p: jax.grad(total_loss, has_aux=True)(p),
      (params_flat,),
      (jax.tree.leaves(params_tangents),),
      has_aux=True,
    )
    return jax.tree.unflatten(proc.params_tree, hvp), proc.make_losses(
      losses_args
    )

  return TransformedFunction(transformed, traced)


def layer_tags_vjp_parts(
  traced: TracedFunction, func_args: Sequence[Any]
) -> tuple[ProcessedJaxpr, tuple, list[dict], Callable]:
  """The pieces of `layer_tags_vjp`, kept apart so the estimators can vmap.

  Args:
    traced: the model's trace cache.
    func_args: the function's positional arguments.

  Returns:
    `(proc, losses, layer_values, tangents_fn)`: `layer_values` as
    `ProcessedJaxpr.evaluate_tags` gives them, and `tangents_fn` mapping one
    tuple of tangents per loss to `(outputs_tangent, params_tangent)` per
    layer.
  """
  proc, flat_args, positions = traced.split(func_args)
  params_flat = [flat_args[i] for i in positions]
  zeros = proc.perturbation_zeros()

  def f(p_flat, perturbations):
    losses_args, layer_values = proc.evaluate_tags(
      _with_params(flat_args, positions, p_flat), perturbations
    )
    return _deps(proc, losses_args), (losses_args, layer_values)

  _, vjp, (losses_args, layer_values) = jax.vjp(
    f, params_flat, zeros, has_aux=True
  )

  def tangents_fn(loss_tangents):
    loss_tangents = tuple(tuple(t) for t in loss_tangents)
    params_grads, outputs_grads = vjp(loss_tangents)
    return tuple(
      (outputs_grads[j], tuple(params_grads[i] for i in idx))
      for j, idx in enumerate(proc.layer_indices)
    )

  return proc, proc.make_losses(losses_args), layer_values, tangents_fn


def layer_tags_value_vjp(
  traced: TracedFunction, func_args: Sequence[Any], layers: Sequence[int]
) -> list[tuple[tuple, tuple]]:
  """Layer inputs and output cotangents of a scalar function, in one pass.

  Args:
    traced: the trace cache of a function returning one scalar (the loss).
    func_args: its positional arguments.
    layers: positions in `layer_tags` of the layers wanted.

  Returns:
    Per layer in `layers`: (its inputs, the cotangent of the function's
    output at the layer's outputs), from one forward and one backward pass.

  Raises:
    TracingError: if the function does not return one scalar.
  """
  proc, flat_args, _ = traced.split(func_args)
  out_aval = cast(jax.core.ShapedArray, proc.jaxpr.outvars[0].aval)
  if len(proc.jaxpr.outvars) != 1 or out_aval.shape != ():
    raise TracingError(
      "The function must return one scalar (the loss) to "
      "differentiate it at the layer outputs."
    )
  zeros = proc.perturbation_zeros()

  def value(perturbations):
    outputs, layer_values = proc.evaluate_outputs(
      flat_args, [perturbations.get(j, zeros[j]) for j in range(len(zeros))]
    )
    return outputs[0], [layer_values[j]["inputs"] for j in layers]

  _, vjp, inputs = jax.vjp(value, {j: zeros[j] for j in layers}, has_aux=True)
  (cotangents,) = vjp(jnp.ones((), out_aval.dtype))
  return [(ins, cotangents[j]) for ins, j in zip(inputs, layers)]


def layer_tags_vjp(
  func: Callable,
  params_index: int = 0,
  auto_register_tags: bool = True,
  raise_error_on_diff_jaxpr: bool = True,
  **auto_registration_kwargs,
) -> Callable:
  """Per-layer values and cotangents, for the curvature statistics.

  Args:
    func: the model function; it must register at least one loss.
    params_index: which argument holds the parameters.
    auto_register_tags: as for `ProcessedJaxpr.make_from_func`.
    raise_error_on_diff_jaxpr: as for `TracedFunction`.
    **auto_registration_kwargs: passed on to `auto_register_tags`.

  Returns:
    `f(func_args) -> (losses, vjp)`. `vjp(tangents)` takes one tuple of
    tangents per loss and returns, for every layer tag, a `LayerVjpData`
    (also a mapping with the keys `inputs`, `outputs`, `params`,
    `outputs_tangent` and `params_tangent`).
  """
  traced = TracedFunction(
    func,
    params_index,
    auto_register_tags=auto_register_tags,
    raise_error_on_diff_jaxpr=raise_error_on_diff_jaxpr,
    **auto_registration_kwargs,
  )

  def transformed(func_args):
    _, losses, values, tangents_fn = layer_tags_vjp_parts(traced, func_args)

    def vjp_func(tangents):
      return [
        LayerVjpData(
          primals=tags.LayerData(
            inputs=v["inputs"], outputs=v["outputs"], params=v["params"]
          ),
          tangents=tags.LayerData(inputs=(), outputs=o, params=p),
        )
        for v, (o, p) in zip(values, tangents_fn(tangents))
      ]

    return losses, vjp_func

  return TransformedFunction(transformed, traced)
