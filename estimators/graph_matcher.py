"""Automatic layer registration: finds the layers of a model in its jaxpr.

`auto_register_tags(func, func_args)` returns `func` with a layer tag after
every dense, convolution, scale-and-shift and embedding layer it computes
and a generic tag on every other parameter. The model's jaxpr is flattened
into one graph (`_Graph`: jit, custom_jvp/vjp and remat bodies inlined;
while and cond opaque; a scan stays one node, and its body joins the graph
in a context of its own, where the slices of stacked parameter leaves that
the scan iterates over count as parameters, so
`hk.experimental.layer_stack` layers are found and tagged inside the scan).
Each `GraphPattern` is traced to a small graph of the same kind, and from
every model equation with the primitive of a pattern's output, `_Matcher`
walks backwards through both graphs in lock step: equations must be
equivalent (`GraphMatcherComparator`), pattern inputs bind to model values and
pattern parameters to leaves of the params argument. Layout equations
(reshape, broadcast, casts) are looked through. Matches whose parameters or
intermediates feed anything else on the way to a loss, or whose shapes the
tag rejects, are dropped (a parameter that several computations use, such
as a table tied to an output layer, gets a generic tag and the report says
what shares it, and one no pattern claims says which use no pattern fits,
or which pattern fits its computation but not its shapes); hand-written
tags claim their parameters first and patterns claim greedily, in order.
`TaggedFunction` then re-evaluates the jaxpr, binding each tag right after
the equation making the layer's output. Weights keep the layout the model
stores them in: an output-major dense weight (Equinox's, `x @ w.T`) is
tagged with `transposed_weight=True`, and a dense weight with several axes
(Flax's `DenseGeneral`) gets the layer's input and output features
flattened on the tag, so the blocks see one `(d_in, d_out)` layer.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core

from estimators import jaxpr_utils, tags
from estimators.jaxpr_utils import TracingError

logger = logging.getLogger(__name__)
Literal = jex_core.Literal


@dataclasses.dataclass(frozen=True)
class GraphMatcherComparator:
  """Decides when a pattern equation and a model equation do the same thing.

  They must have the same primitive and arity, and equal static parameters
  except for `ignored_params`; primitives in `params_free_primitives` match
  whatever their parameters (a convolution's strides, padding etc. are read
  from the match instead), and `dot_general` axes are counted from the last
  axis, so a matmul over extra leading axes matches the 2-D one; one that
  contracts trailing axes of its first operand with leading axes of its
  second, with no batch axes, matches any other such (Flax's `DenseGeneral`
  contracts one or two axes). A `transpose` that moves the first axis to the
  end matches any other such, whatever the rank (as `jax.vmap` of `w @ x`
  gives, one or two batch axes deep). An `iota`, as in `jax.nn.one_hot`,
  matches whatever its size and rank when it counts along the same axis
  from the end, integers matching any integer type. A `gather` matches one that takes the same kind of slice
  (its dimension numbers, output axes counted from the end, and which
  slice sizes span their whole axis), whatever the sizes, its mode and
  fill value (which only say what out-of-range indices give) and its
  sortedness hints: `table[ids]` and `jnp.take(table, ids, axis=0)` are
  one row lookup for any table and ids shapes. Equations
  of `layout_primitives` are looked through, and `commutative_primitives`
  may have their two operands matched in either order.
  """

  ignored_params: frozenset[str] = frozenset(
    {
      "precision",
      "preferred_element_type",
      "accumulation_type",
      "out_sharding",
      "sharding",
    }
  )
  params_free_primitives: frozenset[str] = frozenset({"conv_general_dilated"})
  layout_primitives: frozenset[str] = frozenset(
    {
      "broadcast_in_dim",
      "reshape",
      "squeeze",
      "expand_dims",
      "convert_element_type",
      "copy",
      "copy_p",
    }
  )
  commutative_primitives: frozenset[str] = frozenset(
    {"add", "add_any", "mul", "max", "min"}
  )

  def is_layout(self, eqn: Any) -> bool:
    """Whether the matcher looks through this equation.

    Args:
      eqn: a jaxpr equation.

    Returns:
      True for a layout equation (reshape, broadcast, cast...).
    """
    return eqn.primitive.name in self.layout_primitives

  def is_commutative(self, eqn: Any) -> bool:
    """Whether this equation's two operands may be matched in either order.

    Args:
      eqn: a jaxpr equation.

    Returns:
      True for a binary equation of a commutative primitive.
    """
    return (
      eqn.primitive.name in self.commutative_primitives and len(eqn.invars) == 2
    )

  def equivalent(self, pattern_eqn: Any, graph_eqn: Any) -> bool:
    """Whether a pattern equation and a model equation do the same thing.

    Args:
      pattern_eqn: an equation of a pattern's jaxpr.
      graph_eqn: an equation of the model's jaxpr.

    Returns:
      True when they are equivalent under the rules of the class docstring.
    """
    name = pattern_eqn.primitive.name
    if name == "iota" == graph_eqn.primitive.name:  # as `dot_general`
      return _iota_axis(graph_eqn) == _iota_axis(
        pattern_eqn
      ) and jnp.issubdtype(
        graph_eqn.params["dtype"], jnp.integer
      ) == jnp.issubdtype(pattern_eqn.params["dtype"], jnp.integer)
    if name == "gather" == graph_eqn.primitive.name:
      return _gather_form(graph_eqn) == _gather_form(pattern_eqn)
    if name == "transpose" == graph_eqn.primitive.name:
      return _transpose_form(graph_eqn) == _transpose_form(pattern_eqn)
    if (
      name != graph_eqn.primitive.name
      or len(pattern_eqn.invars) != len(graph_eqn.invars)
      or len(pattern_eqn.outvars) != len(graph_eqn.outvars)
    ):
      return False
    if name in self.params_free_primitives:
      return True
    for key in (
      set(pattern_eqn.params) | set(graph_eqn.params)
    ) - self.ignored_params:
      a, b = pattern_eqn.params.get(key), graph_eqn.params.get(key)
      if name == "dot_general" and key == "dimension_numbers":
        a, b = _dot_form(pattern_eqn), _dot_form(graph_eqn)
      try:
        if not bool(a == b):
          return False
      except Exception:  # noqa: BLE001 - arrays, jaxprs: compared by identity
        if a is not b:
          return False
    return True


# `auto_register_tags`' default rules: the class is frozen, so one instance
# serves every call.
_DEFAULT_COMPARATOR = GraphMatcherComparator()


def _dot_axes_from_end(eqn):
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  lhs, rhs = (v.aval.ndim for v in eqn.invars)
  return tuple(
    tuple(a - n for a in axes)
    for axes, n in ((lc, lhs), (rc, rhs), (lb, lhs), (rb, rhs))
  )


def _dot_form(eqn):
  """A `dot_general`'s axes as the comparator sees them: "trailing_leading"
  when it contracts the first operand's trailing axes with the second's
  leading ones (in order, no batch axes), else counted from the end."""
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  lhs = eqn.invars[0].aval.ndim
  k = len(lc)
  if (
    k
    and not lb
    and not rb
    and tuple(lc) == tuple(range(lhs - k, lhs))
    and tuple(rc) == tuple(range(k))
  ):
    return "trailing_leading"
  return _dot_axes_from_end(eqn)


def _transpose_form(eqn):
  """A `transpose`'s permutation, or "first_to_last" for one that moves the
  first axis to the end and keeps the others in order."""
  perm = tuple(int(a) for a in eqn.params["permutation"])
  if len(perm) >= 2 and perm == tuple(range(1, len(perm))) + (0,):
    return "first_to_last"
  return perm


def _iota_axis(eqn):
  """The axis an `iota` counts along, from the last axis."""
  return eqn.params["dimension"] - len(eqn.params["shape"])


def _gather_form(eqn):
  """What slice a `gather` takes, whatever the sizes: its dimension numbers
  (output axes counted from the end), the operand's rank and, per operand
  axis, whether the slice spans it (else its size)."""
  dn, operand = eqn.params["dimension_numbers"], eqn.invars[0].aval.shape
  out_ndim = eqn.outvars[0].aval.ndim
  sizes = tuple(
    "all" if s == n else s for s, n in zip(eqn.params["slice_sizes"], operand)
  )
  return (
    tuple(a - out_ndim for a in dn.offset_dims),
    tuple(dn.collapsed_slice_dims),
    tuple(dn.start_index_map),
    tuple(dn.operand_batching_dims),
    tuple(dn.start_indices_batching_dims),
    len(operand),
    sizes,
  )


def _call_body(eqn):
  """(jaxpr, consts) of a call-like equation whose body can be inlined."""
  if eqn.primitive.name not in jaxpr_utils.INLINABLE_PRIMITIVES:
    return None
  subs = list(jaxpr_utils.sub_jaxprs(eqn))
  return subs[0] if len(subs) == 1 else None


# `path`: ids of the enclosing call equations, then id(eqn); `inputs` and
# `outputs`: canonical keys (or Literals) of eqn.invars and eqn.outvars.
_Node = collections.namedtuple("_Node", "eqn path inputs outputs")


class _Graph:
  """A jaxpr with every inlinable call flattened away.

  A variable is named by a key `(ctx, var)`, `ctx` being the path of call
  equations around it. A call body's inputs and outputs are aliased to the
  keys they stand for, so each value has one canonical key, made by one node.
  """

  # Set on a pattern's graph only (`_pattern_graph`): its arguments, their
  # roles by key, the producer of its output and whether params broadcast.
  num_inputs: int
  num_params: int
  roles: dict[Any, tuple[str, int]]
  root: tuple[int, int]
  broadcasts: bool

  def __init__(self, jaxpr, consts=()):
    self.jaxpr = jaxpr  # keeps the equations, whose ids name paths, alive
    self.nodes: list[_Node] = []
    self.producer = {}  # key -> (node index, output index)
    self.node_at, self.alias, self.consts, self.call_outputs = {}, {}, {}, {}
    self.scan_body = {}  # scan path -> its body's jaxpr
    self._flatten(jaxpr, consts, (), None)
    self.invars = [self.canon((), v) for v in jaxpr.invars]
    self.outvars = [self.canon((), v) for v in jaxpr.outvars]

  def canon(self, ctx, var):
    if isinstance(var, Literal):
      return var
    return self.alias.get((ctx, var), (ctx, var))

  def _flatten(self, jaxpr, consts, ctx, inputs):
    if inputs is not None:
      self.alias.update(((ctx, v), k) for v, k in zip(jaxpr.invars, inputs))
    self.consts.update(((ctx, v), c) for v, c in zip(jaxpr.constvars, consts))
    for eqn in jaxpr.eqns:
      path = ctx + (id(eqn),)
      ins = [self.canon(ctx, v) for v in eqn.invars]
      body = _call_body(eqn)
      if body is None:
        node = _Node(eqn, path, ins, [(ctx, v) for v in eqn.outvars])
        self.node_at[path] = len(self.nodes)
        self.producer.update(
          (k, (len(self.nodes), i)) for i, k in enumerate(node.outputs)
        )
        self.nodes.append(node)
        if eqn.primitive.name == "scan":
          closed = eqn.params["jaxpr"]
          self.scan_body[path] = closed.jaxpr
          self._flatten(closed.jaxpr, closed.consts, path, None)
        continue
      sub, sub_consts = body
      # custom_jvp/custom_vjp calls pass their consts as leading operands.
      self._flatten(sub, sub_consts, path, ins[len(ins) - len(sub.invars) :])
      outs = [self.canon(path, v) for v in sub.outvars]
      self.alias.update(((ctx, v), k) for v, k in zip(eqn.outvars, outs))
      self.call_outputs[path] = frozenset(
        k for k in outs if not isinstance(k, Literal)
      )

  def back_through_layout(self, key, rules, stop=()):
    """(key reached, layout nodes crossed) walking back from `key` over
    layout equations, stopping early at a key in `stop`."""
    chain = []
    while not isinstance(key, Literal) and key not in stop:
      prod = self.producer.get(key)
      if prod is None or not rules.is_layout(self.nodes[prod[0]].eqn):
        break
      chain.append(prod[0])
      key = self.nodes[prod[0]].inputs[0]
    return key, chain[::-1]

  def ancestors(self, starts) -> set[int]:
    """The nodes `starts` depend on; a scan depends on its whole body."""
    seen, stack = set(starts), list(starts)
    while stack:
      node = self.nodes[stack.pop()]
      keys = list(node.inputs)
      if node.path in self.scan_body:
        keys += [
          self.canon(node.path, v) for v in self.scan_body[node.path].outvars
        ]
      for k in keys:
        prod = None if isinstance(k, Literal) else self.producer.get(k)
        if prod is not None and prod[0] not in seen:
          seen.add(prod[0])
          stack.append(prod[0])
    return seen

  def stacked_slices(self, leaves) -> dict:
    """Scan-body keys of the slices of `leaves` that a scan iterates over:
    slice key -> (leaf key, scan node index, number of iterations)."""
    found = {}
    for path, body in self.scan_body.items():
      n = self.node_at[path]
      eqn = self.nodes[n].eqn
      xs = jaxpr_utils.scan_parts(eqn, self.nodes[n].inputs)[2]
      for var, k in zip(jaxpr_utils.scan_parts(eqn, body.invars)[2], xs):
        if not isinstance(k, Literal) and k in leaves:
          found[(path, var)] = (k, n, eqn.params["length"])
    return found


def _shape(key):
  return tuple(key[1].aval.shape)


@dataclasses.dataclass(eq=False)
class GraphPattern:
  """A layer computation to look for, and the tag to bind where it is found.

  Attributes:
    name: names the pattern in reports and in `patterns_to_skip`.
    tag_primitive: the `LayerTag` bound as `(output, *inputs, *params)`; a
      dense match with extra leading input axes binds `repeated_dense`.
    compute_func: `compute_func(inputs, params) -> output`, the layer alone.
    parameters_extractor_func: maps the matched model equations (in pattern
      order) to the tag's static keyword arguments.
    example_args: `[inputs, params]` to trace `compute_func` on (any
      shapes, but for a scale-and-shift tag: where the example broadcasts a
      parameter, i.e. gives it another shape than the output, the pattern
      matches only layers that broadcast one, and vice versa).
    in_values_preprocessor: optional map from the matched input values to the
      tag's inputs (e.g. centred input and inverse std -> normalized input).
    precedence: higher precedence is tried first; ties keep the given order.
  """

  name: str
  tag_primitive: tags.LayerTag
  compute_func: Callable[..., Any]
  parameters_extractor_func: Callable[[Sequence[Any]], Mapping[str, Any]]
  example_args: Sequence[Any]
  in_values_preprocessor: Callable[[list], list] | None = None
  precedence: int = 0
  _graph: _Graph | None = dataclasses.field(default=None, repr=False)

  @property
  def graph(self) -> _Graph:
    """The traced pattern, with `roles`, `root`, `num_inputs`, `num_params`."""
    if self._graph is None:
      self._graph = self._trace()
    return self._graph

  def _trace(self) -> _Graph:
    def fail(why):
      return ValueError(f"GraphPattern {self.name!r}: {why}")

    if len(self.example_args) != 2:
      raise fail("example_args must be [inputs, params].")
    (ins, in_tree), (ps, p_tree) = map(jax.tree.flatten, self.example_args)
    n = len(ins)

    def flat(*leaves):
      return self.compute_func(
        jax.tree.unflatten(in_tree, leaves[:n]),
        jax.tree.unflatten(p_tree, leaves[n:]),
      )

    try:
      closed, out = jax.make_jaxpr(flat, return_shape=True)(*ins, *ps)
    except Exception as e:  # pylint: disable=broad-except
      raise fail(
        "its compute_func could not be traced on its example_args "
        f"({type(e).__name__}: {e})."
      ) from e
    if len(jax.tree.leaves(out)) != 1:
      raise fail("compute_func must return one array, the layer's output.")
    g = _Graph(closed.jaxpr, closed.consts)
    g.num_inputs, g.num_params = n, len(ps)
    g.roles = {k: ("input", i) for i, k in enumerate(g.invars[:n])}
    g.roles.update((k, ("param", i)) for i, k in enumerate(g.invars[n:]))
    key, _ = g.back_through_layout(g.outvars[0], GraphMatcherComparator())
    if isinstance(key, Literal) or key not in g.producer:
      raise fail("compute_func computes nothing from its arguments.")
    g.root = g.producer[key]
    used = {
      k
      for i in g.ancestors([g.root[0]])
      for k in g.nodes[i].inputs
      if not isinstance(k, Literal)
    }
    unused = [
      f"{kind} {pos}" for k, (kind, pos) in g.roles.items() if k not in used
    ]
    if unused:
      raise fail(f"compute_func does not use its {', '.join(unused)}.")
    g.broadcasts = _broadcasts(_shape(key), [_shape(k) for k in g.invars[n:]])
    return g


def _broadcasts(out_shape, param_shapes) -> bool:
  """Whether an elementwise layer broadcasts some parameter: one whose shape
  is not the output's (`_broadcast_1` patterns) or none (`_broadcast_0`)."""
  return any(tuple(p) != tuple(out_shape) for p in param_shapes)


# The layer computations of the default patterns; custom patterns may reuse
# them as their `compute_func`.


def dense_layer(x: jax.Array, params: Sequence[jax.Array]) -> jax.Array:
  """A dense layer, `x @ w (+ b)`.

  Args:
    x: the inputs, features on the last axis.
    params: `[w]` or `[w, b]`.

  Returns:
    The layer's output.
  """
  w, *b = params
  y = jnp.matmul(x, w)
  return y + b[0] if b else y


def dense_transposed_layer(
  x: jax.Array, params: Sequence[jax.Array]
) -> jax.Array:
  """A dense layer on an output-major weight, `x @ w.T (+ b)`, written as
  one `dot_general` over the last axes of both (`jnp.einsum("bi,oi->bo")`).

  Args:
    x: the inputs, features on the last axis.
    params: `[w]` or `[w, b]`, `w` of shape `(d_out, d_in)`.

  Returns:
    The layer's output.
  """
  w, *b = params
  y = lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())))
  return y + b[0] if b else y


def dense_weight_first_layer(
  x: jax.Array, params: Sequence[jax.Array]
) -> jax.Array:
  """`w @ x (+ b)` on every example, as `jax.vmap` computes it for a batch
  (Equinox's `Linear`): the output-major weight times the inputs, then the
  output axis moved last.

  Args:
    x: the inputs, `(batch, d_in)`.
    params: `[w]` or `[w, b]`, `w` of shape `(d_out, d_in)`.

  Returns:
    The layer's output, `(batch, d_out)`.
  """
  w, *b = params
  y = jnp.transpose(lax.dot_general(w, x, (((1,), (1,)), ((), ()))))
  return y + b[0] if b else y


def embedding_layer(ids: jax.Array, params: Sequence[jax.Array]) -> jax.Array:
  """An embedding lookup as a dense layer on one-hot inputs,
  `jax.nn.one_hot(ids, vocab) @ table`.

  Args:
    ids: integer token ids.
    params: `[table]`, `(vocab, d_out)`.

  Returns:
    The layer's output, `ids.shape + (d_out,)`.
  """
  (w,) = params
  return jnp.matmul(jax.nn.one_hot(ids, w.shape[0], dtype=w.dtype), w)


def embedding_gather_layer(
  indices: jax.Array, params: Sequence[jax.Array]
) -> jax.Array:
  """An embedding lookup as the `gather` that `table[ids]` and
  `jnp.take(table, ids, axis=0)` make (after wrapping negative ids).

  Args:
    indices: the ids with a trailing unit axis, `ids.shape + (1,)`.
    params: `[table]`, `(vocab, d_out)`.

  Returns:
    The table's rows at the ids, `ids.shape + (d_out,)`.
  """
  (w,) = params
  rows = lax.GatherDimensionNumbers(
    offset_dims=(indices.ndim - 1,),
    collapsed_slice_dims=(0,),
    start_index_map=(0,),
  )
  return lax.gather(
    w,
    indices,
    rows,
    slice_sizes=(1, w.shape[1]),
    mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS,
  )


def embedding_row_gather_layer(
  indices: jax.Array, params: Sequence[jax.Array]
) -> jax.Array:
  """An embedding lookup as the `gather` that `jax.vmap(lambda i: table[i])`
  makes (Equinox's `Embedding`): a `(1, d_out)` slice at each `(id, 0)`.

  The slice spans the table's width, so its column start is clamped to 0
  whatever it holds.

  Args:
    indices: `ids.shape + (2,)`: the (wrapped) id, then a column start.
    params: `[table]`, `(vocab, d_out)`.

  Returns:
    `ids.shape + (1, d_out)`.
  """
  (w,) = params
  n = indices.ndim - 1
  rows = lax.GatherDimensionNumbers(
    offset_dims=(n, n + 1), collapsed_slice_dims=(), start_index_map=(0, 1)
  )
  return lax.gather(
    w,
    indices,
    rows,
    slice_sizes=(1, w.shape[1]),
    mode=lax.GatherScatterMode.CLIP,
  )


def _first_column(ins):
  """The ids of `(id, column)` index pairs."""
  return [ins[0][..., 0]]


def _squeeze_last(ins):
  """The ids before `one_hot` gave them a trailing unit axis."""
  return [jnp.reshape(ins[0], jnp.shape(ins[0])[:-1])]


def conv2d_layer(x: jax.Array, params: Sequence[jax.Array]) -> jax.Array:
  """An unstrided, unpadded NHWC/HWIO 2-D convolution (plus a bias).

  Args:
    x: NHWC inputs.
    params: `[kernel]` or `[kernel, bias]`, the kernel in HWIO layout.

  Returns:
    The layer's output.
  """
  w, *b = params
  y = lax.conv_general_dilated(
    x, w, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")
  )
  return y + b[0] if b else y


def scale_and_shift_layer(
  x: jax.Array, params: Sequence[jax.Array], has_scale: bool, has_shift: bool
) -> jax.Array:
  """`x * scale + shift`, with either term left out.

  Args:
    x: the inputs.
    params: the scale (if `has_scale`), then the shift (if `has_shift`).
    has_scale: whether `params` holds a scale.
    has_shift: whether `params` holds a shift.

  Returns:
    The layer's output.
  """
  params = list(params)
  if has_scale:
    x = x * params.pop(0)
  return x + params.pop(0) if has_shift else x


def normalization_layer(
  inputs: Sequence[jax.Array], params: Sequence[jax.Array], has_shift: bool
) -> jax.Array:
  """The affine end of Haiku's LayerNorm/BatchNorm.

  Args:
    inputs: `[centred, inv]`: the centred inputs and their inverse standard
      deviation.
    params: `[scale]` or `[scale, offset]`.
    has_shift: whether `params` holds an offset.

  Returns:
    `centred * (scale * inv) (+ offset)`.
  """
  centred, inv = inputs
  y = centred * (params[0] * inv)
  return y + params[1] if has_shift else y


_CONV_META = (
  "window_strides",
  "padding",
  "dimension_numbers",
  "lhs_dilation",
  "rhs_dilation",
  "feature_group_count",
  "batch_group_count",
)


def _conv2d_extractor(eqns):
  eqn = next(e for e in eqns if e.primitive.name == "conv_general_dilated")
  return {k: eqn.params[k] for k in _CONV_META}


def _default_patterns():
  """KFAC-JAX's documented patterns, in its order, plus: dense layers on
  output-major weights (`transposed_weight`), as `jnp.einsum("bi,oi->bo")`
  or `jax.vmap` of `w @ x` (Equinox) computes them; a scale-only Haiku
  normalization (Haiku's norms with `create_offset=False`); and embedding
  lookups, written `jax.nn.one_hot(ids, vocab) @ table` (tried first),
  `table[ids]` / `jnp.take(table, ids, axis=0)` (a gather) or
  `jax.vmap(lambda i: table[i])(ids)` (Equinox's gather): the same
  `embedding_tag` on the same ids and table, whichever is written.

  `_broadcast_1` patterns match layers that broadcast a parameter against
  the input (the usual case: a batch axis in front), `_broadcast_0` ones
  whose parameters all have the output's shape.
  """
  z = np.zeros
  x, s, norm_in = z((2, 5)), z((5,)), [z((2, 5)), z((2, 1))]
  img, kernel, kb = z((2, 6, 6, 3)), z((3, 3, 3, 4)), z((4,))

  def flags(has_scale, has_shift):
    return lambda eqns: dict(has_scale=has_scale, has_shift=has_shift)

  def ss(name, has_scale, has_shift, broadcast):
    inputs = x if broadcast else s
    return GraphPattern(
      f"{name}_broadcast_{int(broadcast)}",
      tags.scale_and_shift,
      functools.partial(
        scale_and_shift_layer, has_scale=has_scale, has_shift=has_shift
      ),
      flags(has_scale=has_scale, has_shift=has_shift),
      [inputs, [s] * (has_scale + has_shift)],
    )

  def norm(name, has_shift, broadcast):
    inputs = norm_in if broadcast else [s, s]
    return GraphPattern(
      f"{name}_broadcast_{int(broadcast)}",
      tags.scale_and_shift,
      functools.partial(normalization_layer, has_shift=has_shift),
      flags(has_scale=True, has_shift=has_shift),
      [inputs, [s] * (1 + has_shift)],
      in_values_preprocessor=lambda ins: [ins[0] * ins[1]],
    )  # normalized

  dense = functools.partial(
    GraphPattern,
    tag_primitive=tags.dense,
    compute_func=dense_layer,
    parameters_extractor_func=lambda eqns: {},
  )
  transposed = functools.partial(
    GraphPattern,
    tag_primitive=tags.dense,
    parameters_extractor_func=lambda eqns: {"transposed_weight": True},
  )
  w_t, b_t = z((3, 5)), z((3,))
  conv = functools.partial(
    GraphPattern,
    tag_primitive=tags.conv2d,
    compute_func=conv2d_layer,
    parameters_extractor_func=_conv2d_extractor,
  )
  embedding = GraphPattern(
    "embedding",
    tags.embedding,
    embedding_layer,
    lambda eqns: {},
    [z((2,), np.int32), [z((5, 3))]],
    in_values_preprocessor=_squeeze_last,
    precedence=1,
  )  # before the dense patterns, which match its matmul
  # `table[ids]` and `jnp.take`: the gather's indices are the ids (negative
  # ones already wrapped) with a trailing unit axis, as in the one-hot. The
  # same precedence, so layers are numbered alike whichever is written.
  gather = GraphPattern(
    "embedding_gather",
    tags.embedding,
    embedding_gather_layer,
    lambda eqns: {},
    [z((2, 1), np.int32), [z((5, 3))]],
    in_values_preprocessor=_squeeze_last,
    precedence=1,
  )
  rows = GraphPattern(
    "embedding_row_gather",
    tags.embedding,
    embedding_row_gather_layer,
    lambda eqns: {},
    [z((2, 2), np.int32), [z((5, 3))]],
    in_values_preprocessor=_first_column,
    precedence=1,
  )
  return (
    dense("dense_with_bias", example_args=[x, [z((5, 3)), z((3,))]]),
    dense("dense_no_bias", example_args=[x, [z((5, 3))]]),
    transposed(
      "dense_transposed_with_bias",
      compute_func=dense_transposed_layer,
      example_args=[x, [w_t, b_t]],
    ),
    transposed(
      "dense_transposed_no_bias",
      compute_func=dense_transposed_layer,
      example_args=[x, [w_t]],
    ),
    transposed(
      "dense_weight_first_with_bias",
      compute_func=dense_weight_first_layer,
      example_args=[x, [w_t, b_t]],
    ),
    transposed(
      "dense_weight_first_no_bias",
      compute_func=dense_weight_first_layer,
      example_args=[x, [w_t]],
    ),
    conv("conv2d_with_bias", example_args=[img, [kernel, kb]]),
    conv("conv2d_no_bias", example_args=[img, [kernel]]),
    *(ss("scale_and_shift", True, True, b) for b in (True, False)),
    *(norm("normalization_haiku", True, b) for b in (True, False)),
    *(norm("normalization_haiku_scale_only", False, b) for b in (True, False)),
    *(ss("scale_only", True, False, b) for b in (True, False)),
    *(ss("shift_only", False, True, b) for b in (True, False)),
    embedding,
    gather,
    rows,
  )


DEFAULT_GRAPH_PATTERNS: tuple[GraphPattern, ...] = _default_patterns()


@dataclasses.dataclass
class _State:
  """A partial match: pattern keys and nodes bound to model keys and nodes."""

  keys: dict = dataclasses.field(default_factory=dict)
  nodes: dict = dataclasses.field(default_factory=dict)
  inputs: dict = dataclasses.field(default_factory=dict)  # position -> key
  params: dict = dataclasses.field(default_factory=dict)  # position -> leaf
  chains: list = dataclasses.field(default_factory=list)  # (position, nodes)
  layout: list = dataclasses.field(default_factory=list)  # nodes looked past

  def copy(self):
    return _State(
      dict(self.keys),
      dict(self.nodes),
      dict(self.inputs),
      dict(self.params),
      list(self.chains),
      list(self.layout),
    )


class _Matcher:
  """Finds one pattern at given model nodes (step 3 of the module docstring)."""

  def __init__(self, pattern, graph, rules, leaves, free):
    self.p, self.g = pattern.graph, graph
    self.rules, self.leaves, self.free = rules, leaves, free

  def match_at(self, node) -> _State | None:
    p = self.p
    st = self._unify(
      p.nodes[p.root[0]].outputs[p.root[1]],
      self.g.nodes[node].outputs[p.root[1]],
      _State(),
    )
    if (
      st is None
      or len(st.inputs) != p.num_inputs
      or len(set(st.params.values())) != p.num_params
    ):
      return None
    return st

  def _unify(self, pk, gk, st):
    """Extends `st` so that pattern key `pk` stands for model key `gk`."""
    if isinstance(pk, Literal) or isinstance(gk, Literal):
      same = (
        isinstance(pk, Literal)
        and isinstance(gk, Literal)
        and np.array_equal(pk.val, gk.val)
      )
      return st if same else None
    if pk in st.keys:
      return st if st.keys[pk] == gk else None
    if pk in self.p.roles:
      kind, pos = self.p.roles[pk]
      leaf, chain = self.g.back_through_layout(gk, self.rules, self.leaves)
      is_leaf = not isinstance(leaf, Literal) and leaf in self.leaves
      if (kind == "param") != is_leaf:
        return None  # a parameter must come from a leaf, an input must not
      st = st.copy()
      st.keys[pk] = gk
      if kind == "param":
        st.params[pos] = leaf
        st.chains.append((pos, chain))
      else:
        st.inputs[pos] = gk
      return st
    if pk not in self.p.producer:
      return None  # a constant of the pattern
    pi, out = self.p.producer[pk]
    pnode = self.p.nodes[pi]
    if self.rules.is_layout(pnode.eqn):
      return self._unify(pnode.inputs[0], gk, st)
    gk, layout = self.g.back_through_layout(gk, self.rules)
    if isinstance(gk, Literal):
      return None
    gi, gout = self.g.producer.get(gk, (None, None))
    if (
      gi not in self.free
      or gout != out
      or not self.rules.equivalent(pnode.eqn, self.g.nodes[gi].eqn)
    ):
      return None
    if pi in st.nodes:
      return st if st.nodes[pi] == gi else None
    st = st.copy()
    st.keys[pk] = gk
    st.nodes[pi] = gi
    st.layout.extend(layout)
    g_inputs = self.g.nodes[gi].inputs
    orders = [g_inputs]
    if self.rules.is_commutative(pnode.eqn):
      orders.append(g_inputs[::-1])
    for operands in orders:
      new = st
      for a, b in zip(pnode.inputs, operands):
        new = self._unify(a, b, new)
        if new is None:
          break
      if new is not None:
        return new
    return None


def _param_axes(graph, chain, shape):
  """Where a parameter's non-unit axes sit after its layout chain.

  Returns ({parameter axis: axis at the use}, shape at the use), or None if
  the chain does more than cast, broadcast or add/remove unit axes.
  """
  axes, cur = {i: i for i, d in enumerate(shape) if d != 1}, tuple(shape)
  for n in chain:
    eqn = graph.nodes[n].eqn
    out, name = tuple(eqn.outvars[0].aval.shape), eqn.primitive.name
    if name == "broadcast_in_dim":
      dims = eqn.params["broadcast_dimensions"]
      axes = {a: dims[u] for a, u in axes.items()}
    elif name in ("reshape", "squeeze", "expand_dims"):
      src = [i for i, d in enumerate(cur) if d != 1]
      dst = [i for i, d in enumerate(out) if d != 1]
      if [cur[i] for i in src] != [out[i] for i in dst]:
        return None
      axes = {a: dict(zip(src, dst))[u] for a, u in axes.items()}
    elif name not in ("convert_element_type", "copy", "copy_p"):
      return None
    cur = out
  return axes, cur


def _check_tag(tag, y, xs, ps, uses, meta):
  """The tag to bind for a match, or None when the shapes (of output, inputs
  and parameters; `uses[i]` is `_param_axes` of parameter i) do not fit it."""

  def unchanged(i):  # a weight used as it is stored
    return (
      uses[i] is not None
      and uses[i][1] == ps[i]
      and all(a == u for a, u in uses[i][0].items())
    )

  def aligned_right(i, ndim):  # broadcast against the trailing axes
    return (
      uses[i] is not None
      and len(uses[i][1]) == ndim
      and all(u == ndim - len(ps[i]) + a for a, u in uses[i][0].items())
    )

  if tag in (tags.dense, tags.repeated_dense):
    if (
      len(xs) != 1
      or len(ps) not in (1, 2)
      or len(ps[0]) < 2
      or not unchanged(0)
    ):
      return None
    (x,), w = xs, ps[0]
    k = _dense_input_axes(len(y), len(x), len(w), meta)
    if k is None:
      return None
    ins, outs = (
      (w[1:], w[:1]) if meta.get("transposed_weight") else (w[:k], w[k:])
    )
    if len(x) <= k or x[-k:] != ins or y != x[:-k] + outs:
      return None
    if len(ps) == 2 and (ps[1] != outs or not aligned_right(1, len(y))):
      return None
    return tags.dense if len(x) == k + 1 else tags.repeated_dense
  if tag is tags.embedding:
    if len(xs) != 1 or len(ps) != 1 or len(ps[0]) != 2 or not unchanged(0):
      return None
    # The rows may come with a unit axis (Equinox's gather); the tag gets
    # them reshaped to `ids.shape + (d_out,)`.
    want = xs[0] + (ps[0][1],)
    fits = y[-1:] == want[-1:] and _drop_units(y) == _drop_units(want)
    return tag if fits and len(xs[0]) >= 1 else None
  if tag is tags.conv2d:
    dn = meta.get("dimension_numbers")
    if (
      len(xs) != 1
      or len(ps) not in (1, 2)
      or len(xs[0]) != 4
      or len(ps[0]) != 4
      or not unchanged(0)
      or meta.get("batch_group_count", 1) != 1
    ):
      return None
    if isinstance(dn, lax.ConvDimensionNumbers):
      if dn.lhs_spec[0] != 0 or dn.out_spec[0] != 0:
        return None  # the blocks need the batch axis first
      # A bias of one entry per output channel, e.g. (C,) or Equinox's
      # (C, 1, 1), added along the outputs' channel axis.
      if len(ps) == 2 and (
        _drop_units(ps[1]) != _drop_units((ps[0][dn.rhs_spec[0]],))
        or uses[1] is None
        or len(uses[1][1]) != 4
        or any(u != dn.out_spec[1] for u in uses[1][0].values())
      ):
        return None
    return tag
  if tag is tags.scale_and_shift:
    flags = meta.get("has_scale", True) + meta.get("has_shift", len(ps) == 2)
    if len(xs) != 1 or xs[0] != y or len(ps) != flags:
      return None
    for i, p in enumerate(ps):
      lead = len(p) - len(y) + 1  # these axes would meet the batch axis
      if (
        np.prod(p) == 1  # a scalar (e.g. a temperature) stays generic
        or not aligned_right(i, len(y))
        or lead > 0
        and np.prod(p[:lead]) != 1
      ):
        return None
  return tag


def _dense_input_axes(y_ndim, x_ndim, w_ndim, meta):
  """How many trailing input axes a dense match contracts with its weight
  (one for an output-major weight), or None if the ranks do not add up."""
  if meta.get("transposed_weight"):
    return 1 if w_ndim == 2 else None
  twice = x_ndim + w_ndim - y_ndim
  k = twice // 2
  return k if twice % 2 == 0 and 1 <= k < w_ndim else None


def _drop_units(shape):
  return tuple(d for d in shape if d != 1)


def _bind_tag(tag, meta, y, xs, ps):
  """Binds a layer tag through the same `register_*` call a user would make.

  A dense layer whose weight has more than two axes gets its inputs' and
  outputs' feature axes flattened, and an embedding's rows are reshaped to
  `ids.shape + (d_out,)`; the tag's output is reshaped back.
  """
  meta = dict(meta)
  if tag in (tags.dense, tags.repeated_dense):
    (x,) = xs
    k = _dense_input_axes(y.ndim, x.ndim, ps[0].ndim, meta)
    lead = x.shape[: x.ndim - k]
    register = (
      tags.register_dense if tag is tags.dense else tags.register_repeated_dense
    )
    out = register(
      y.reshape(lead + (-1,)), x.reshape(lead + (-1,)), *ps, **meta
    )
    return out.reshape(y.shape)
  if tag is tags.embedding:
    (ids,), (table,) = xs, ps
    rows = y.reshape(ids.shape + table.shape[1:])
    return tags.register_embedding(rows, ids, table, **meta).reshape(y.shape)
  if tag is tags.conv2d:
    return tags.register_conv2d(y, *xs, *ps, **meta)
  if tag is tags.scale_and_shift:
    ps = list(ps)
    scale = ps.pop(0) if meta.pop("has_scale", True) else None
    shift = ps.pop(0) if meta.pop("has_shift", bool(ps)) else None
    return tags.register_scale_and_shift(y, xs[0], scale, shift, **meta)
  return tag.bind(y, *xs, *ps, **meta)[0]


_Match = collections.namedtuple(
  "_Match", "pattern tag out_key in_keys leaves nodes meta"
)


class _Registration:
  """Where every tag goes, for one shape signature of the arguments."""

  def __init__(
    self,
    func,
    func_args,
    params_index,
    register_only_generic,
    compute_only_loss_tags,
    patterns_to_skip,
    allow_multiple_registrations,
    graph_matcher_rules,
    graph_patterns,
  ):
    func_args = tuple(func_args)
    if not 0 <= params_index < len(func_args):
      raise TracingError(
        f"params_index={params_index} but the function "
        f"takes {len(func_args)} arguments."
      )
    flat_args, in_tree = jax.tree.flatten(func_args)
    closed, out_shape = jax.make_jaxpr(
      lambda *flat: func(*jax.tree.unflatten(in_tree, flat)), return_shape=True
    )(*jaxpr_utils.shape_dtype_structs(flat_args))
    self.out_tree = jax.tree.structure(out_shape)
    self.only_loss = compute_only_loss_tags
    g = self.graph = _Graph(closed.jaxpr, closed.consts)
    start = sum(len(jax.tree.leaves(a)) for a in func_args[:params_index])
    paths = jax.tree_util.tree_flatten_with_path(func_args[params_index])[0]
    self.paths = [jax.tree_util.keystr(path) for path, _ in paths]
    leaves = g.invars[start : start + len(paths)]
    self.leaf_index = {k: i for i, k in enumerate(leaves)}
    # A slice of a stacked leaf inside a scan body stands for that leaf.
    self.slices = g.stacked_slices(self.leaf_index)
    self.leaf_index.update(
      (k, self.leaf_index[leaf]) for k, (leaf, _, _) in self.slices.items()
    )

    self.loss_nodes = [
      i for i, n in enumerate(g.nodes) if tags.is_loss_tag_eqn(n.eqn)
    ]
    if not self.loss_nodes:
      raise TracingError(
        "auto_register_tags: the model function registers no loss. Call e.g."
        " estimators.register_softmax_cross_entropy_loss(logits, targets) on "
        "the model's output (outside of any scan/while/cond)."
      )
    manual = [i for i, n in enumerate(g.nodes) if tags.is_layer_tag_eqn(n.eqn)]
    self.relevant = g.ancestors(self.loss_nodes + manual)
    self.consumers: dict[Any, set[int]] = {}
    for i in sorted(self.relevant):
      for k in g.nodes[i].inputs:
        if not isinstance(k, Literal):
          self.consumers.setdefault(k, set()).add(i)

    # leaf index -> (tag name, source, layer number, stack)
    self.owner: dict[int, tuple[Any, ...]] = {}
    # layer number (in claim order) -> where the model computes it
    self.computed_at: dict[int, float] = {}
    self.matches, self.dropped = {}, set()  # root node -> _Match
    # leaf index -> matches left unclaimed because they share that leaf
    self.sharing = {}
    # leaf index -> a pattern whose computation it fits but whose shapes not
    self.misfits = {}
    self.rules = graph_matcher_rules
    self._claim_manual(manual, allow_multiple=allow_multiple_registrations)
    if not register_only_generic:
      patterns = [p for p in graph_patterns if p.name not in patterns_to_skip]
      free = self.relevant - set(manual)
      for pattern in sorted(patterns, key=lambda p: -p.precedence):
        self._find(
          pattern,
          graph_matcher_rules,
          free,
          allow_multiple=allow_multiple_registrations,
        )
    self.generic = [k for i, k in enumerate(leaves) if i not in self.owner]
    for k in self.generic:
      # An unused parameter's layer comes after the rest.
      at = min(self.consumers.get(k, ()), default=math.inf)
      self._own([k], tags.generic.name, self._why_generic(k), at)
    self._number_in_forward_order()
    self.inline = self._calls_to_inline(manual)
    self.needed = {k for i in self.relevant for k in g.nodes[i].outputs}
    self.report = [
      dict(
        path=self.paths[i],
        tag=self.owner[i][0],
        shape=_shape(k),
        source=self.owner[i][1],
        layer=self.owner[i][2],
        stacked=self.owner[i][3],
      )
      for i, k in enumerate(leaves)
    ]
    logger.info(
      "Graph parameter registrations:\n%s",
      "\n".join(
        f"  {r['path']} -> {r['tag']} ({r['source']}, layer {r['layer']}"
        + (f", stacked x{r['stacked']})" if r["stacked"] else ")")
        for r in self.report
      ),
    )

  def _own(self, keys, tag_name, source, at):
    """Gives the leaves behind `keys` (leaves or their scanned slices) a tag,
    as a layer the model computes at node `at`."""
    layer = len({o[2] for o in self.owner.values()})
    self.computed_at[layer] = at
    stack = max(
      (self.slices[k][2] for k in keys if k in self.slices), default=None
    )
    self.owner.update(
      (self.leaf_index[k], (tag_name, source, layer, stack)) for k in keys
    )

  def _number_in_forward_order(self):
    """Renumbers the layers in the order the model computes them (the
    graph's nodes are in the jaxpr's order), not the order they were
    claimed in (manual tags, then pattern by pattern, then generic)."""
    order = sorted(self.computed_at, key=lambda n: (self.computed_at[n], n))
    number = {old: new for new, old in enumerate(order)}
    self.owner = {
      i: (tag, source, number[layer], stack)
      for i, (tag, source, layer, stack) in self.owner.items()
    }

  def _claim_manual(self, manual, allow_multiple):
    for n in manual:
      eqn = self.graph.nodes[n].eqn
      params = eqn.primitive.split_operands(self.graph.nodes[n].inputs)[2]
      keys = [k for k in params if k in self.leaf_index]
      taken = [
        self.leaf_index[k] for k in keys if self.leaf_index[k] in self.owner
      ]
      if taken and not allow_multiple:
        raise TracingError(
          f"Parameter {self.paths[taken[0]]} is registered in two layer tags"
          f" ({self.owner[taken[0]][0]} and {eqn.primitive.name}). Register "
          "each parameter once, or pass allow_multiple_registrations=True to "
          "keep only its first registration."
        )
      if taken:
        self.dropped.add(n)  # evaluated as an identity
      else:
        self._own(keys, eqn.primitive.name, "manual", n)

  def _find(self, pattern, rules, free, allow_multiple):
    """Claims every match of `pattern` among the `free` nodes (updated)."""
    g, p = self.graph, pattern.graph
    root_name = p.nodes[p.root[0]].eqn.primitive.name
    matcher = _Matcher(pattern, g, rules, self.leaf_index, free)
    for n in sorted(free):
      if n not in free or g.nodes[n].eqn.primitive.name != root_name:
        continue
      st = matcher.match_at(n)
      if st is None or any(
        self.leaf_index[k] in self.owner for k in st.params.values()
      ):
        continue
      m = self._checked_match(
        pattern,
        g.nodes[n].outputs[p.root[1]],
        st,
        allow_multiple=allow_multiple,
      )
      if m is not None:
        self.matches[n] = m
        free -= m.nodes
        self._own(m.leaves, m.tag.name, pattern.name, n)

  def _checked_match(self, pattern, out_key, st, allow_multiple):
    g, p = self.graph, pattern.graph
    nodes = set(st.nodes.values()) | set(st.layout)
    nodes |= {n for _, chain in st.chains for n in chain}
    inner = {k for n in nodes for k in g.nodes[n].outputs} - {out_key}
    leaves = [st.params[i] for i in range(p.num_params)]
    if any(not self.consumers.get(k, set()) <= nodes for k in inner):
      return None  # an intermediate value is used elsewhere
    in_keys = [st.inputs[i] for i in range(p.num_inputs)]
    if inner & set(in_keys):
      return None
    meta = dict(
      pattern.parameters_extractor_func(
        [g.nodes[st.nodes[i]].eqn for i in sorted(st.nodes)]
      )
    )
    xs = [_shape(k) for k in in_keys]
    if pattern.in_values_preprocessor is not None:
      xs = [
        tuple(o.shape)
        for o in jax.tree.leaves(
          jax.eval_shape(
            pattern.in_values_preprocessor,
            [jax.ShapeDtypeStruct(_shape(k), k[1].aval.dtype) for k in in_keys],
          )
        )
      ]
    ps = [_shape(k) for k in leaves]
    uses = [None] * len(ps)
    for pos, chain in st.chains:
      uses[pos] = _param_axes(g, chain, ps[pos])
    tag = _check_tag(pattern.tag_primitive, _shape(out_key), xs, ps, uses, meta)
    if tag is None:
      for k in leaves:  # kept to say why the parameter stays generic
        self.misfits.setdefault(
          self.leaf_index[k],
          (
            f"{pattern.name} fits its computation but not its shapes (output "
            f"{_shape(out_key)}, inputs {', '.join(map(str, xs))}, "
            f"parameters {', '.join(map(str, ps))})"
          ),
        )
    if tag is None or (
      tag is tags.scale_and_shift
      and _broadcasts(_shape(out_key), ps) != p.broadcasts
    ):
      return None
    match = _Match(pattern, tag, out_key, in_keys, leaves, nodes, meta)
    # Parameters something else uses too (a stacked leaf: outside its scan)
    # leave the match unclaimed; it is kept for the report, once per layer
    # (a smaller pattern on the same layer adds nothing).
    shared = [
      k
      for k in leaves
      if (
        k in self.slices
        and self.consumers.get(self.slices[k][0], set()) != {self.slices[k][1]}
        or not allow_multiple
        and not self.consumers.get(k, set()) <= nodes
      )
    ]
    for k in shared:
      found = self.sharing.setdefault(self.leaf_index[k], [])
      if not any(m.nodes & nodes for m in found):
        found.append(match)
    return None if shared else match

  def _why_generic(self, leaf):
    uses = self._uses(leaf)
    if len(uses) > 1:
      return (
        f"shared by {len(uses)} layers: {', '.join(uses[:-1])} and {uses[-1]}"
      )
    users = sorted(
      {
        self.graph.nodes[n].eqn.primitive.name
        for n in self.consumers.get(leaf, ())
        if any(jaxpr_utils.sub_jaxprs(self.graph.nodes[n].eqn))
      }
    )
    if users:
      return f"unmatched: used inside {', '.join(users)}"
    if leaf not in self.consumers:
      return "unmatched: unused (no registered loss depends on it)"
    misfit = self.misfits.get(self.leaf_index[leaf])
    if misfit is not None:
      return f"unmatched: {misfit}"
    use = f"its use by {uses[0]}" if uses else "how it is used"
    return f"unmatched: no layer pattern fits {use}"

  def _uses(self, leaf) -> list[str]:
    """What each computation a parameter leaf feeds is: the matches it kept
    from being claimed (their pattern, other parameters and output shape),
    then its other uses (their primitive, whether they take its transpose,
    and their output shape). Layout equations are looked through."""
    g = self.graph
    found = self.sharing.get(self.leaf_index[leaf], [])
    uses = []
    for m in found:
      others = [
        self.paths[self.leaf_index[k]]
        for k in m.leaves
        if self.leaf_index[k] != self.leaf_index[leaf]
      ]
      uses.append(
        m.pattern.name
        + (f" with {', '.join(others)}" if others else "")
        + f" (output {_shape(m.out_key)})"
      )
    stack = [(leaf, False)]
    while stack:
      key, transposed = stack.pop()
      for n in sorted(self.consumers.get(key, ())):
        node = g.nodes[n]
        name = node.eqn.primitive.name
        if self.rules.is_layout(node.eqn) or name == "transpose":
          stack.append((node.outputs[0], transposed or name == "transpose"))
        elif not any(
          g.nodes[i].path[: len(node.path)] == node.path
          for m in found
          for i in m.nodes
        ):  # not a match's
          uses.append(
            f"{name}{' of its transpose' if transposed else ''} "
            f"(output {_shape(node.outputs[0])})"
          )
    return uses

  def _calls_to_inline(self, manual):
    """Paths of the calls to evaluate equation by equation, not as a call."""
    g = self.graph
    inline: set[tuple[int, ...]] = set()
    for n in list(self.matches) + self.loss_nodes + manual:
      ctx = g.nodes[n].path[:-1]
      inline.update(ctx[:i] for i in range(1, len(ctx) + 1))
    wanted = {k for m in self.matches.values() for k in m.in_keys}
    changed = True
    while changed:  # an input made inside a call must be readable outside it
      changed = False
      for k in wanted:
        ctx = g.nodes[g.producer[k][0]].path[:-1] if k in g.producer else ()
        for i in range(1, len(ctx) + 1):
          if ctx[:i] not in inline:
            if k in g.call_outputs[ctx[:i]]:
              break
            inline.add(ctx[:i])
            changed = True
    return inline

  def evaluate(self, flat_args):
    g = self.graph
    env = dict(g.consts)
    env.update(zip(g.invars, flat_args))
    for k in self.generic:
      tags.register_generic(env[k])
    self._run(g.jaxpr, (), env)
    if self.only_loss:
      return tuple(
        tuple(env[k] for k in g.nodes[n].outputs) for n in self.loss_nodes
      )
    return jax.tree.unflatten(
      self.out_tree,
      [k.val if isinstance(k, Literal) else env[k] for k in g.outvars],
    )

  def _run(self, jaxpr, ctx, env):
    g = self.graph
    for eqn in jaxpr.eqns:
      path = ctx + (id(eqn),)
      if path in self.inline and path not in g.scan_body:
        self._run(_call_body(eqn)[0], path, env)
        continue
      n = g.node_at.get(path)
      if self.only_loss and (
        n not in self.relevant
        if n is not None
        else self.needed.isdisjoint(g.call_outputs[path])
      ):
        continue
      invals = [
        k.val if isinstance(k, Literal) else env[k]
        for k in (g.canon(ctx, v) for v in eqn.invars)
      ]
      if n in self.dropped:  # a repeated registration: evaluate as identity
        outs, _, params = eqn.primitive.split_operands(invals)
        outvals = list(outs) if eqn.primitive.num_outputs else list(params)
      elif path in self.inline:  # a scan with tags to bind in its body
        outvals = self._run_scan(eqn, path, invals, env)
      else:
        outvals = jaxpr_utils.bind_equation(eqn, invals)
      for v, val in zip(eqn.outvars, outvals):
        k = g.canon(ctx, v)
        if not isinstance(k, Literal):
          env[k] = val
      m = self.matches.get(n)
      if m is not None:
        xs = [env[k] for k in m.in_keys]
        if m.pattern.in_values_preprocessor is not None:
          xs = list(m.pattern.in_values_preprocessor(xs))
        env[m.out_key] = _bind_tag(
          m.tag, m.meta, env[m.out_key], xs, [env[k] for k in m.leaves]
        )

  def _run_scan(self, eqn, path, invals, env):
    g, body = self.graph, self.graph.scan_body[path]

    def body_fn(consts, carry, xs, _):
      env.update(
        (g.canon(path, v), x) for v, x in zip(body.invars, consts + carry + xs)
      )
      self._run(body, path, env)
      outs = [
        k.val if isinstance(k, Literal) else env[k]
        for k in (g.canon(path, v) for v in body.outvars)
      ]
      return outs[: len(carry)], outs[len(carry) :], None

    return jaxpr_utils.rebind_scan(eqn, invals, body_fn)[0]


class TaggedFunction:
  """The model function with its layer tags bound; see `auto_register_tags`.

  With `compute_only_loss_tags` it skips what no loss needs and returns one
  tuple of loss-tag outputs per loss, otherwise what the model returns.
  Matching is redone for each new shape signature of the arguments.
  """

  def __init__(self, func: Callable, params_index: int = 0, **options: Any):
    """Wraps `func`; matching happens on the first call per signature.

    Args:
      func: the model function.
      params_index: which argument holds the parameters.
      **options: the matching options of `auto_register_tags`.
    """
    self.func = func
    self.params_index = params_index
    self._options = options
    self._cache: dict[Any, _Registration] = {}
    functools.update_wrapper(self, func, updated=())

  def _registration(self, func_args) -> _Registration:
    leaves, tree = jax.tree.flatten(tuple(func_args))
    key = (tree, tuple((jnp.shape(x), jnp.result_type(x)) for x in leaves))
    if key not in self._cache:
      self._cache[key] = _Registration(
        self.func, func_args, self.params_index, **self._options
      )
    return self._cache[key]

  def __call__(self, *func_args: Any) -> Any:
    """Runs the model with its layer tags bound.

    Args:
      *func_args: the model's positional arguments.

    Returns:
      One tuple of loss-tag outputs per loss with `compute_only_loss_tags`,
      otherwise what the model returns.
    """
    return self._registration(func_args).evaluate(jax.tree.leaves(func_args))

  def registrations(self, *func_args: Any) -> list[dict[str, Any]]:
    """Which tag each parameter gets for arguments like these.

    Args:
      *func_args: the model's positional arguments (or shape structs).

    Returns:
      One dict per parameter leaf: `path` (`jax.tree_util.keystr`), `tag`,
      `shape`, `source` ("manual", a pattern's name, or why it is generic:
      "unmatched: ..." saying which use no pattern fits (its primitive and
      output shape), which pattern fits its computation but not its shapes,
      or that it is unused or used inside a while/cond; or "shared by N
      layers: ..." naming each use of a parameter that several computations
      use, by the pattern that found it or its primitive, with its output
      shape), `layer` (a number shared
      by the parameters of one tag, counting layers in the order the
      model computes them) and `stacked` (the number of scan
      iterations for a stacked leaf, else None).
    """
    return [dict(r) for r in self._registration(func_args).report]


def matcher_options(
  auto_register_kwargs: Mapping[str, Any] | None = None,
  register_only_generic: bool = False,
  patterns_to_skip: Sequence[str] = (),
) -> dict[str, Any]:
  """The keyword arguments of `auto_register_tags` that an optimizer's
  separate `register_only_generic` and `patterns_to_skip` arguments and its
  `auto_register_kwargs` add up to."""
  options = dict(auto_register_kwargs or {})
  if register_only_generic:
    options["register_only_generic"] = True
  if patterns_to_skip:
    options["patterns_to_skip"] = tuple(patterns_to_skip)
  return options


def check_patterns_to_skip(
  patterns_to_skip: Sequence[str],
  graph_patterns: Sequence[GraphPattern] = DEFAULT_GRAPH_PATTERNS,
) -> None:
  """Checks that every name to skip is the name of a pattern in use.

  Args:
    patterns_to_skip: the names of patterns not to look for.
    graph_patterns: the patterns in use.

  Raises:
    ValueError: naming the unknown names and listing the valid ones.
  """
  if isinstance(patterns_to_skip, str):
    raise ValueError(
      "patterns_to_skip must be a sequence of pattern names, "
      f"got the string {patterns_to_skip!r}; write "
      f"({patterns_to_skip!r},)."
    )
  valid = [p.name for p in graph_patterns]
  unknown = [n for n in patterns_to_skip if n not in valid]
  if unknown:
    raise ValueError(
      f"patterns_to_skip names unknown graph patterns {unknown}; the "
      f"patterns in use are {sorted(set(valid))}."
    )


def auto_register_tags(
  func: Callable,
  func_args: Sequence[Any],
  params_index: int = 0,
  register_only_generic: bool = False,
  compute_only_loss_tags: bool = True,
  patterns_to_skip: Sequence[str] = (),
  allow_multiple_registrations: bool = False,
  graph_matcher_rules: GraphMatcherComparator = _DEFAULT_COMPARATOR,
  graph_patterns: Sequence[GraphPattern] = DEFAULT_GRAPH_PATTERNS,
) -> TaggedFunction:
  """Finds the layers of `func` and returns it with layer tags bound.

  Args:
    func: the model function; it must register at least one loss.
    func_args: example arguments (arrays or `jax.ShapeDtypeStruct` values).
    params_index: which argument of `func` holds the parameters.
    register_only_generic: match no patterns; parameters outside hand-written
      tags all get generic tags.
    compute_only_loss_tags: compute only what the loss tags need, and return
      their outputs instead of `func`'s.
    patterns_to_skip: names of patterns not to look for.
    allow_multiple_registrations: rather than raising for a parameter in two
      hand-written tags, keep its first tag (the others act as identities);
      a parameter shared by several layers goes to the first one matched
      instead of getting a generic tag.
    graph_matcher_rules: decides which equations are equivalent.
    graph_patterns: all the patterns to look for (to add one, pass it
      with `DEFAULT_GRAPH_PATTERNS`). Higher `precedence` first, then the
      given order.

  Returns:
    A `TaggedFunction` with the signature of `func`. Its registrations are
    logged at INFO ("Graph parameter registrations:") and returned by
    `TaggedFunction.registrations(*func_args)`.

  Raises:
    ValueError: if `patterns_to_skip` names a pattern not in
      `graph_patterns`.
  """
  check_patterns_to_skip(patterns_to_skip, graph_patterns)
  tagged = TaggedFunction(
    func,
    params_index,
    register_only_generic=register_only_generic,
    compute_only_loss_tags=compute_only_loss_tags,
    patterns_to_skip=frozenset(patterns_to_skip),
    allow_multiple_registrations=allow_multiple_registrations,
    graph_matcher_rules=graph_matcher_rules,
    graph_patterns=tuple(graph_patterns),
  )
  tagged._registration(func_args)  # pylint: disable=protected-access
  return tagged


def registration_report(
  func: Callable,
  func_args: Sequence[Any],
  params_index: int = 0,
  **auto_register_kwargs: Any,
) -> list[dict[str, Any]]:
  """Which tag each parameter of a model gets.

  Args:
    func: the model function.
    func_args: example arguments (arrays or `jax.ShapeDtypeStruct` values).
    params_index: which argument of `func` holds the parameters.
    **auto_register_kwargs: other options of `auto_register_tags`.

  Returns:
    The list of `TaggedFunction.registrations`.
  """
  return auto_register_tags(
    func, func_args, params_index, **auto_register_kwargs
  ).registrations(*func_args)
