"""One interface over every curvature the harness compares.

A `Curvature` has pure, jittable methods (`init`, `update`, `refresh`,
`multiply`, `operator`, `precondition`, `eigenvalues`, `to_dense`);
measurements use only these and never ask which estimator sits behind them.
The families here hold an `estimators` estimator (block-diagonal, explicit
exact) or the matrix-free exact products; the approximations of the
`curvature` config group (`curvbench.approximations`) build them, and
`exact` builds the exact reference matrices, so no other module branches on
an estimator or a matrix.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np

import estimators as kfac
from curvbench.core.data import Data
from estimators import estimation_modes, graph_matcher

# Matrices that have an exact reference: the estimation-mode matrices and the
# Hessian, which only matrix-vector products give.
EXACT_MATRICES = (*estimation_modes.EXACT_MODE_OF_MATRIX, "hessian")
# The products of the matrix-free exact curvature, by matrix name.
IMPLICIT_PRODUCTS = {
  "ggn": kfac.ImplicitExactCurvature.multiply_ggn,
  "fisher": kfac.ImplicitExactCurvature.multiply_fisher,
  "empirical_fisher": kfac.ImplicitExactCurvature.multiply_empirical_fisher,
  "hessian": kfac.ImplicitExactCurvature.multiply_hessian,
}


def num_params(params) -> int:
  """The number of scalars in the pytree `params`."""
  return int(sum(np.size(x) for x in jax.tree.leaves(params)))


def _traced(loss_fn: Callable, params, batch) -> kfac.BlockDiagonalCurvature:
  """A block-diagonal estimator of `loss_fn` with its blocks built."""
  estimator = kfac.BlockDiagonalCurvature(loss_fn)
  # Tracing builds the blocks; eval_shape spares allocating their state.
  jax.eval_shape(lambda: estimator.init(jax.random.PRNGKey(0), (params, batch)))
  return estimator


def _blocks(
  estimator: kfac.BlockDiagonalCurvature,
) -> tuple[kfac.CurvatureBlock, ...]:
  """The blocks of an estimator that has built them (`init`)."""
  blocks = estimator.blocks
  if blocks is None:
    raise RuntimeError("The estimator has not built its blocks: init it.")
  return blocks


def layer_blocks(
  loss_fn: Callable, params, batch
) -> list[tuple[str, np.ndarray]]:
  """The network's layer blocks: for each tagged layer, its name (the
  modules its parameters belong to, e.g. 'dense_0') and the `ravel_pytree`
  indices of its parameters; the blocks of block-diagonal K-FAC, whatever
  curvature is measured."""
  estimator = _traced(loss_fn, params, batch)
  leaves = jax.tree.leaves(params)
  starts = np.cumsum([0, *(int(np.size(x)) for x in leaves)])
  return [
    (name, np.concatenate([np.arange(starts[i], starts[i + 1]) for i in mine]))
    for name, mine in _block_leaves(estimator, params)
  ]


# A layer block's type ("role") by its layer tag, where the problem's
# `layer_roles` do not name it; layers of other tags are "other".
TAG_ROLES = {
  kfac.tags.conv2d: "conv",
  kfac.tags.embedding: "embedding",
  kfac.tags.scale_and_shift: "norm",
  kfac.tags.dense: "dense",
  kfac.tags.repeated_dense: "dense",
}
OTHER_ROLE = "other"


def block_role(name: str, tag, layer_roles=()) -> str:
  """The type ("role") of the layer block `name` of layer tag `tag` (a
  `kfac.tags.LayerTag`): the role of the first `(part of a name, role)` of
  a problem's `layer_roles` whose part is in `name`, else the tag's
  (`TAG_ROLES`), else "other"."""
  for pair in layer_roles:
    if (
      not isinstance(pair, (tuple, list))
      or len(pair) != 2
      or not all(isinstance(x, str) and x for x in pair)
    ):
      raise ValueError(
        f"layer_roles entry {pair!r} is not a (part of a layer's name, "
        "role) pair of non-empty strings: declare e.g. "
        "(('attention', 'attention'), ('mlp', 'mlp'))."
      )
    if pair[1] == "all":
      raise ValueError(
        "layer_roles names a role 'all', which quality records keep for "
        "the whole network: call it something else."
      )
  part_role = next((role for part, role in layer_roles if part in name), None)
  return part_role or TAG_ROLES.get(tag, OTHER_ROLE)


def block_roles(
  loss_fn: Callable, params, batch, layer_roles=()
) -> dict[str, str]:
  """`{name: role}` for each of `layer_blocks`' blocks (`block_role`)."""
  estimator = _traced(loss_fn, params, batch)
  return {
    name: block_role(name, block.layer_tag_primitive, layer_roles)
    for (name, _), block in zip(
      _block_leaves(estimator, params), _blocks(estimator)
    )
  }


def _key_name(key) -> str:
  """One step of a pytree path as the model's code writes it."""
  for field in ("key", "idx", "name"):  # DictKey, SequenceKey, GetAttrKey
    if hasattr(key, field):
      return str(getattr(key, field))
  return str(key)


def parameter_module(path) -> tuple[str, str]:
  """`(module, name)` of a parameter leaf's pytree `path` in its framework's
  own terms: the module's path, its steps joined by '.' ('layers.1.norm'
  for an NNX or Equinox model, 'mlp/~/linear_0' for Haiku's), and the
  parameter's name ('scale'); the module is '' for a top-level leaf. An
  NNX variable's trailing `.value` is its wrapper's, not a step."""
  steps = [_key_name(k) for k in path]
  if len(steps) > 1 and isinstance(path[-1], jax.tree_util.GetAttrKey):
    steps = steps[:-1] if steps[-1] == "value" else steps
  return ".".join(steps[:-1]), steps[-1] if steps else ""


def _block_leaves(estimator, params) -> list[tuple[str, list[int]]]:
  """Per block of a traced block-diagonal `estimator`: its name (the modules
  its parameters belong to, e.g. 'dense_0' or 'layers.1', or the leaves'
  own names where they are top-level) and its parameter leaves."""
  which = jax.tree.leaves(estimator.params_block_index)
  paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  out = []
  for index in range(len(estimator.blocks)):
    mine = [i for i, b in enumerate(which) if b == index]
    modules = dict.fromkeys(
      module or name
      for module, name in map(parameter_module, [paths[i] for i in mine])
    )
    out.append(("+".join(modules), mine))
  return out


def check_dense_fits(
  num: int,
  itemsize: int,
  max_gib: float,
  what: str,
  hint: str = "use curvature=implicit_exact (matrix-free)",
) -> None:
  """Raises a clear error when a dense `num` x `num` matrix is too large."""
  gib = num**2 * itemsize / 2**30
  if gib > max_gib:
    raise MemoryError(
      f"{what} needs a dense {num} x {num} matrix ({gib:.2f} GiB), over the "
      f"limit of {max_gib} GiB: {hint}, or raise max_dense_gib if the "
      "memory is there."
    )


@dataclasses.dataclass(frozen=True)
class Curvature(abc.ABC):
  """A configured curvature estimate; every method is pure and jittable.

  `update` replaces (`ema_old=0`) or averages (`ema_old > 0`) the estimate
  with one batch; `refresh` recomputes the cached damped inverse;
  `precondition` applies it. Vectors are shaped like the parameters.

  Attributes:
    name: the config's name (`kfac`, `explicit_exact`, ...).
    mode: the estimation mode (for matrix-free families, the exact mode of
      their matrix, or 'hessian').
    matrix: the exact matrix this estimates ('ggn', 'fisher',
      'empirical_fisher' or 'hessian').
    cg_iters: conjugate-gradient steps where an inverse is matrix-free.
    max_dense_gib: the largest dense matrix this may form.
    max_state_gib: the largest state (estimate and cache) of a
      block-diagonal family.
  """

  name: str
  mode: str
  matrix: str
  cg_iters: int
  max_dense_gib: float
  max_state_gib: float = np.inf
  block_type = None  # the block type, for block-diagonal families
  is_block_diagonal = False  # whether estimators.Optimizer can use it
  # Whether `precondition` gives `(C + damping I)^-1 v` to round-off (or to
  # CG's tolerance); False where the damping is factored (K-FAC's
  # tridiagonal inverse damps each Kronecker factor).
  damped_inverse_is_exact = True
  # Whether `update`, `refresh` and `precondition` take `axis_name`: run on
  # each device under `jax.shard_map`, they average the statistics over
  # that axis and share the refresh and products out among the devices.
  takes_axis_name = False

  @property
  def label(self) -> str:
    """`name/mode`: the approximation and its estimation mode, as the
    records name it."""
    return f"{self.name}/{self.mode}"

  @abc.abstractmethod
  def init(self, rng, params, batch):
    """An empty estimate; traces the model on `batch`."""

  def check_state_fits(self, rng, params, batch) -> None:
    """Raises a MemoryError, before anything is allocated, where the state
    of `init` would be too large (families with a limit override this)."""
    del rng, params, batch

  @abc.abstractmethod
  def update(self, state, params, batch, rng, ema_old=0.0, ema_new=1.0):
    """`ema_old * state + ema_new * (the estimate on batch)`."""

  @abc.abstractmethod
  def refresh(self, state, damping):
    """The state with its cached `(C + damping I)^-1` recomputed."""

  @abc.abstractmethod
  def multiply(self, state, vector):
    """The undamped estimate times `vector`."""

  def operator(self, state) -> Callable:
    """`v -> C v` at `state`, for many products at one state (Lanczos, CG).

    A `jax.tree_util.Partial`, so that it can be passed to a jitted
    function. Families whose products share work at a fixed state override
    this to do that work once.
    """
    return jax.tree_util.Partial(self.multiply, state)

  @abc.abstractmethod
  def precondition(self, state, vector, damping):
    """`(C + damping I)^-1 vector`."""

  @abc.abstractmethod
  def eigenvalues(self, state) -> jax.Array:
    """Every eigenvalue of the estimate (any order)."""

  @abc.abstractmethod
  def to_dense(self, state) -> jax.Array:
    """The estimate as a dense P x P matrix."""

  def registration(self) -> list[dict]:
    """One row per curvature block (after `init`): name, class and size
    (block-diagonal families add how its parameters were found)."""
    return [dict(block=self.name, block_class=type(self).__name__, dim=None)]

  def estimate(self, rng, params, data: Data, num_samples: int = 1):
    """The estimate over every example of `data`, in one compiled scan.

    Each chunk's estimate enters with its number of examples as weight (the
    estimators keep weighted averages), so the result is the mean over
    examples; sampled modes average `num_samples` draws per chunk.
    """
    return self.accumulate(
      self.init(rng, params, data.first), rng, params, data, num_samples
    )

  def accumulate(self, state, rng, params, data: Data, num_samples: int = 1):
    """`state` averaged with the estimate over `data`; see `estimate`."""

    def add(state, chunk, keys, size):
      for key in keys:
        state = self.update(state, params, chunk, key, 1.0, size / num_samples)
      return state

    def scan(state, rng, params, data):
      keys = jax.random.split(rng, (data.num_chunks + 1, num_samples))
      state, _ = jax.lax.scan(
        lambda s, xs: (add(s, xs[0], xs[1], data.chunk_size), None),
        state,
        (data.chunks, keys[:-1]),
      )
      if data.rest is not None:
        state = add(state, data.rest, keys[-1], data.rest_size)
      return state

    # Params and data as arguments, not constants: so they keep their
    # placement (split over devices, see `Data.split`).
    return jax.jit(scan)(state, rng, params, data)


@dataclasses.dataclass(frozen=True)
class _Estimator(Curvature):
  """A curvature held by an `estimators.CurvatureEstimator`.

  `update`, `refresh` and `precondition` take the `pmap_axis_name` of the
  estimator as `axis_name` (see `Curvature.takes_axis_name`).
  """

  # Always given: the default only follows the base class's defaults. Every
  # estimator here is block-diagonal (the explicit exact one and K-FAC's
  # tridiagonal one too).
  estimator: kfac.BlockDiagonalCurvature = None  # type: ignore[assignment]
  takes_axis_name = True

  def init(self, rng, params, batch):
    return self.estimator.init(
      rng,
      (params, batch),
      exact_powers_to_cache=-1,
      approx_powers_to_cache=None,
      cache_eigenvalues=False,
    )

  def update(
    self, state, params, batch, rng, ema_old=0.0, ema_new=1.0, axis_name=None
  ):
    size = jax.tree.leaves(batch)[0].shape[0]  # this device's, under an axis
    return self.estimator.update_curvature_matrix_estimate(
      state,
      ema_old,
      ema_new,
      size,
      rng,
      (params, batch),
      pmap_axis_name=axis_name,
      estimation_mode=self.mode,
    )

  def refresh(self, state, damping, axis_name=None):
    return self.estimator.update_cache(
      state,
      damping,
      exact_powers=-1,
      approx_powers=None,
      eigenvalues=False,
      pmap_axis_name=axis_name,
    )

  def multiply(self, state, vector):
    return self.estimator.multiply(
      state, vector, identity_weight=0.0, exact_power=True, use_cached=False
    )

  def precondition(self, state, vector, damping, axis_name=None):
    return self.estimator.multiply_inverse(
      state,
      vector,
      identity_weight=damping,
      exact_power=True,
      use_cached=True,
      pmap_axis_name=axis_name,
    )

  def eigenvalues(self, state):
    return self.estimator.eigenvalues(state)

  def to_dense(self, state):
    return self.estimator.to_dense_matrix(state)


def _nbytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _describe(block) -> str:
  """A block's class and the matrices it holds, for messages."""
  if hasattr(block, "input_size"):
    a, g = block.input_size(), block.output_size()
    held = f"input factor {a} x {a}, output factor {g} x {g}"
  else:
    held = f"{block.dim} parameters"
  return f"{type(block).__name__}, {held}"


@dataclasses.dataclass(frozen=True)
class BlockDiagonal(_Estimator):
  """One block per tagged layer, of the configured block type."""

  # A setting here, where `Curvature` has a class attribute (None).
  block_type: str = "kfac"  # type: ignore[assignment]
  # The layer-tag to block-constructor map (empty: the library's defaults).
  block_ctors: Mapping = dataclasses.field(default_factory=dict)
  # The estimator's other arguments from the settings (how it refreshes,
  # its empirical Fisher's scale), for a copy of it built elsewhere.
  estimator_options: Mapping = dataclasses.field(default_factory=dict)
  # A curvature with a smaller state, for the message that refuses this one.
  smaller: str = "curvature=diagonal"
  is_block_diagonal = True

  def registration(self):
    """One row per block: `block` (its parameters and tag), `block_class`,
    `dim`, `layer` (the number of its first layer, in the order the model
    computes them), `module` (the modules its parameters belong to, as the
    model's code names them and the per-layer quality records do: e.g.
    'layers.1.norm') and `source`, how the graph matcher found its
    parameters: a pattern's name, 'manual', or why they got a generic tag,
    e.g. 'shared by 2 layers: embedding (output ...) and dot_general of its
    transpose (output ...)' for a table that a lookup and a tied output
    layer share (the row's class is then the block the family gives a
    generic tag)."""
    estimator = self.estimator
    args = jax.tree.map(
      lambda v: jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype),
      estimator.jaxpr.in_vars,
    )
    report = graph_matcher.registration_report(
      estimator.func, args, estimator.params_index
    )
    leaves = _block_leaves(estimator, args[estimator.params_index])
    return [
      dict(
        block=b.name,
        block_class=type(b).__name__,
        dim=int(b.dim),
        layer=min(report[i]["layer"] for i in mine),
        module=module,
        source="; ".join(dict.fromkeys(report[i]["source"] for i in mine)),
      )
      for b, (module, mine) in zip(_blocks(estimator), leaves)
    ]

  def init(self, rng, params, batch):
    self.check_state_fits(rng, params, batch)
    return self.empty_state(rng, params, batch)

  def empty_state(self, rng, params, batch):
    """The state of `init`, its size unchecked."""
    return super().init(rng, params, batch)

  def check_state_fits(self, rng, params, batch) -> None:
    """Refuses a state over `max_state_gib` by its largest block.

    The state's shapes come from tracing `init` (`jax.eval_shape`), which
    also builds the blocks; nothing is allocated.

    Raises:
      MemoryError: naming the largest block, its size and what to change.
    """
    shapes = jax.eval_shape(self.empty_state, rng, params, batch)
    blocks = _blocks(self.estimator)
    names = [name for name, _ in _block_leaves(self.estimator, params)]
    parts = [
      (f"block {name!r} ({_describe(b)})", _nbytes(s))
      for name, b, s in zip(names, blocks, shapes.blocks_states)
    ]
    parts += [
      (f"the coupling of blocks {names[i]!r} and {names[j]!r}", _nbytes(s))
      for (i, j), s in zip(
        getattr(self.estimator, "links", ()), getattr(shapes, "links", ())
      )
    ]
    # The whole state (its blocks, couplings and the estimator's own
    # fields); the parts name where most of it is.
    total = _nbytes(shapes) / 2**30
    if total <= self.max_state_gib:
      return
    what, size = max(parts, key=lambda part: part[1])
    raise MemoryError(
      f"The state of curvature {self.label} (block_type="
      f"{self.block_type}) needs {total:.3g} GiB, over "
      f"curvature.max_state_gib={self.max_state_gib}; the largest part is "
      f"{what}: {size / 2**30:.3g} GiB. Choose a cheaper curvature "
      f"({self.smaller}), or raise curvature.max_state_gib if the memory "
      "is there."
    )

  def estimate(self, rng, params, data, num_samples=1):
    state = super().estimate(rng, params, data, num_samples)
    if not any(
      block.statistics_in_cached_basis for block in _blocks(self.estimator)
    ):
      return state
    # The basis of the whole-data factors, then the statistics in it (the
    # factors' mean is unchanged by averaging the same data in again).
    state = self.estimator.update_cache(state, 0.0)
    return self.accumulate(
      state, jax.random.fold_in(rng, 1), params, data, num_samples
    )


@dataclasses.dataclass(frozen=True)
class ExplicitExact(_Estimator):
  """The whole matrix of the estimation mode, dense (small models)."""

  def init(self, rng, params, batch):
    itemsize = jnp.result_type(*jax.tree.leaves(params)).itemsize
    check_dense_fits(
      num_params(params), itemsize, self.max_dense_gib, "explicit_exact"
    )
    return super().init(rng, params, batch)


@functools.partial(
  jax.tree_util.register_dataclass,
  data_fields=["residuals"],
  meta_fields=["linear", "sources"],
)
@dataclasses.dataclass(frozen=True)
class _Linearized:
  """One batch's product `v -> C v` with its forward pass done: the arrays
  its linear map needs and how to rebuild the map.

  Parameters and batch leaves among those arrays are not kept but passed
  again at each call, so that stacking over chunks stores only what grows
  with the examples (found by identity: JAX hands its inputs on as they are).
  """

  residuals: tuple
  linear: Any  # the tree structure of `jax.linearize`'s map
  sources: tuple  # per leaf of that map: ('params'|'batch'|'residuals', i)

  @classmethod
  def of(cls, multiply: Callable, params, batch) -> _Linearized:
    """Linearizes `multiply(v)` (linear in `v`) at `params` on `batch`."""
    # As the product is linear, everything not depending on v (the forward
    # pass, and the backward pass for the Hessian) is computed here once.
    _, linear = jax.linearize(multiply, jax.tree.map(jnp.zeros_like, params))
    leaves, structure = jax.tree.flatten(linear)
    known = {id(x): ("batch", i) for i, x in enumerate(jax.tree.leaves(batch))}
    known.update(
      (id(x), ("params", i)) for i, x in enumerate(jax.tree.leaves(params))
    )
    residuals: list[Any] = []
    sources = []
    for leaf in leaves:
      if id(leaf) not in known:
        known[id(leaf)] = ("residuals", len(residuals))
        residuals.append(leaf)
      sources.append(known[id(leaf)])
    return cls(tuple(residuals), structure, tuple(sources))

  def __call__(self, params, batch, vector):
    given = dict(
      params=jax.tree.leaves(params),
      batch=jax.tree.leaves(batch),
      residuals=self.residuals,
    )
    linear = jax.tree.unflatten(
      self.linear, [given[k][i] for k, i in self.sources]
    )
    return linear(vector)


def _linearized_mean(params, linearized: Data, vector):
  """The example-weighted mean of each chunk's linearized product."""
  return linearized.mean(lambda chunk: chunk[1](params, chunk[0], vector))


@dataclasses.dataclass(frozen=True)
class ImplicitExact(Curvature):
  """The exact GGN, Fisher, empirical Fisher or Hessian, through
  matrix-vector products only.

  The state is the point `(params, data)` (a `Data`: a batch or many);
  products are means over its examples, `update` moves the point (no
  average), the inverse is conjugate gradients on the damped products, and
  eigenvalues come from a dense export. `operator` linearizes once for many
  products; `precondition` uses it.
  """

  # Always given: the default only follows the base class's defaults.
  implicit: kfac.ImplicitExactCurvature = None  # type: ignore[assignment]

  @classmethod
  def of_matrix(cls, matrix: str, loss_fn: Callable, **common):
    """The matrix-free exact curvature of `matrix` ('ggn', 'fisher',
    'empirical_fisher' or 'hessian') for `loss_fn`, in that matrix's
    estimation mode; `common` are the other fields. A ValueError names
    the matrices there are for any other."""
    if matrix not in IMPLICIT_PRODUCTS:
      raise ValueError(
        f"The matrix-free exact curvature multiplies by one of "
        f"{', '.join(IMPLICIT_PRODUCTS)}, not {matrix!r}."
      )
    mode = estimation_modes.EXACT_MODE_OF_MATRIX.get(matrix, matrix)
    return cls(
      mode=mode,
      matrix=matrix,
      implicit=kfac.ImplicitExactCurvature(loss_fn),
      **common,
    )

  def init(self, rng, params, batch):
    del rng
    return (params, Data.of(batch))

  def update(self, state, params, batch, rng, ema_old=0.0, ema_new=1.0):
    del state, rng, ema_old, ema_new
    return (params, Data.of(batch))

  def estimate(self, rng, params, data, num_samples=1):
    del rng, num_samples
    return (params, data)

  def refresh(self, state, damping):
    del damping
    return state

  def _product(self, params, batch):
    return functools.partial(
      IMPLICIT_PRODUCTS[self.matrix], self.implicit, (params, batch)
    )

  def multiply(self, state, vector):
    params, data = state
    return data.mean(lambda batch: self._product(params, batch)(vector))

  def operator(self, state):
    """`v -> C v`, each product without the forward pass.

    The forward pass (and the backward pass, for the Hessian) runs here once
    per chunk, which keeps what the products' tangent and cotangent passes
    need: the activations and loss-input derivatives of every example (for
    the Hessian, also those of the backward pass). Memory grows with the
    number of examples, to several times the network's activations over
    all of `data` at once; use `multiply` where that does not fit.
    """
    params, data = state
    linearize = lambda p, batch: _Linearized.of(
      self._product(p, batch), p, batch
    )
    # Params as the carry, so that the body sees them as they are and keeps
    # no copy per chunk.
    _, chunks = jax.lax.scan(
      lambda p, batch: (p, linearize(p, batch)), params, data.chunks
    )
    rest = (
      None if data.rest is None else (data.rest, linearize(params, data.rest))
    )
    # Each chunk's batch leads its pytree, so the mean weighs it by its size.
    return jax.tree_util.Partial(
      _linearized_mean, params, Data((data.chunks, chunks), rest)
    )

  def precondition(self, state, vector, damping):
    flat, unravel = jax.flatten_util.ravel_pytree(vector)
    operator = self.operator(state)

    def matvec(x):
      y = jax.flatten_util.ravel_pytree(operator(unravel(x)))[0]
      return y + damping * x

    solution, _ = jax.scipy.sparse.linalg.cg(
      matvec, flat, maxiter=self.cg_iters
    )
    return unravel(solution)

  def eigenvalues(self, state):
    return jnp.linalg.eigvalsh(self.to_dense(state))

  def to_dense(self, state):
    flat, unravel = jax.flatten_util.ravel_pytree(state[0])
    check_dense_fits(
      flat.size,
      flat.dtype.itemsize,
      self.max_dense_gib,
      f"A dense export of the exact {self.matrix}",
      "use measure.spectra.method=lanczos (matrix-free)",
    )

    def column(e):
      return jax.flatten_util.ravel_pytree(self.multiply(state, unravel(e)))[0]

    # Columns in vmapped groups of 8, each a pass over the data: memory
    # stays that of 8 products whatever the data's size, and on the CPU
    # groups of 8 ran 1.5-1.8x faster than 32 (convnet, MLP) and as fast as
    # products from the linearized `operator`.
    eye = jnp.eye(flat.size, dtype=flat.dtype)
    return jax.lax.map(column, eye, batch_size=min(8, flat.size)).T


# The exact matrices whose dense form is quicker from matrix-vector products
# (P columns, each a pass over the data) than from per-example gradient rows
# (examples x outputs of them): on the CPU, the convnet's GGN over its
# training split took 20 s against 39 s, the MLP's 0.6 s against 1.3 s. The
# empirical Fisher has one row per example, so it keeps its rows.
DENSE_FROM_PRODUCTS = ("ggn", "fisher", "hessian")


def exact(
  matrix: str,
  loss_fn: Callable,
  *,
  matrix_free: bool,
  max_dense_gib: float = np.inf,
  cg_iters: int = 100,
) -> Curvature:
  """The exact `matrix` (one of `EXACT_MATRICES`) as a `Curvature`.

  Dense (`matrix_free=False`) where an estimation mode gives the matrix, else
  through matrix-vector products.
  """
  if matrix not in EXACT_MATRICES:
    raise ValueError(
      f"Unknown exact matrix {matrix!r}; choose from "
      f"{', '.join(EXACT_MATRICES)}."
    )
  common: dict[str, Any] = dict(
    name="exact", cg_iters=cg_iters, max_dense_gib=max_dense_gib
  )
  if matrix_free or matrix not in estimation_modes.EXACT_MODE_OF_MATRIX:
    return ImplicitExact.of_matrix(matrix, loss_fn, **common)
  mode = estimation_modes.exact_mode(matrix)
  return ExplicitExact(
    mode=mode,
    matrix=matrix,
    estimator=kfac.ExplicitExactCurvature(
      loss_fn, default_estimation_mode=mode
    ),
    **common,
  )


def estimate(curvature: Curvature, rng, params, data, num_samples: int = 1):
  """`curvature`'s state over `data` (a batch or a `Data`), averaged over
  `num_samples` draws of a sampled estimation mode."""
  return curvature.estimate(rng, params, Data.of(data), num_samples)
