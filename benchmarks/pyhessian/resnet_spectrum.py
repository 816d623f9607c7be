"""The Hessian's top eigenvalues, trace and spectral density of a batch-norm
ResNet: ours (`curvbench.core.matrix_free` over the exact Hessian's products)
against PyHessian's `hessian(...).eigenvalues()`, `.trace()` and
`.density()`, on the same weights and batch.

The problem is the harness's `problem=resnet` (problems/models/resnet.py)
at ResNet-8 (one block per stage, widths 16, 32, 64, batch norm) on
`synthetic_images` of CIFAR-10's channels and classes, `--image-size`
pixels a side (16 by default; 32 is CIFAR's), its `--examples` training
images (128) taken as one batch. It is rebuilt as a torch module in NCHW
holding the harness's initial params. The loss is the harness's: batch
norm in training mode, normalising by the batch's statistics. PyHessian
puts the model in evaluation mode (`model.eval()` in its constructor), in
which torch's batch norm would normalise by its running averages instead,
a different function; the torch copy's batch norms keep no running
averages (`track_running_stats=False`), so that they normalise by the
batch in either mode, as ours does.

What must agree before anything is timed (the script stops otherwise):

1. at the initial params and at a perturbed point (every weight, scale
   and shift moved): the logits and the loss (relative 1e-12 in float64,
   1e-5 in float32), the gradient, and the Hessian-vector products with the
   gradient and a random vector, PyHessian's (its `hessian_vector_product`
   on its own graph) against ours (1e-10 / 1e-2: in float32 the batch
   norms' derivatives lose digits to rounding, so each side's float32
   error against the float64 result is printed beside);
2. the same probes fed to both: PyHessian's Rademacher probes, replayed
   from torch's seed, give each of its `.trace()` terms `v^T H v` (ours from
   our products: 1e-10 / 1e-2) and, probe by probe, its `.density()`
   moments `sum_l w_l t_l^j` for j = 1, 2, 3, which a Gauss rule of at
   least two nodes makes `v^T H^j v / v^T v` (float64: 1e-7 for j = 1, 2
   and 1e-3 for j = 3, as PyHessian divides its Lanczos vectors by their
   norm plus 1e-6, see TOLERANCE; float32: 1e-2);
3. in float32, each side with its own random numbers: the top eigenvalue
   (relative 1e-2: PyHessian's power iteration stops once an estimate
   moves by less than 1e-3; both sides' eigenpair residuals
   `|H v - t v| / |t|` are printed; with `--top-k` above 1 the others are
   printed, not compared: PyHessian's deflated power iteration finds the
   eigenvalues of largest magnitude, negative ones included, ours the
   largest), the trace and the density's first two
   moments (`dim * sum w t^j`, estimates of `tr H^j`), within three
   combined standard errors.

Then both sides are timed in interleaved rounds in one process (our
compile excluded), each call building its operator anew (PyHessian's
constructor: a forward and a backward pass with the graph kept; ours:
`ImplicitExact.operator`, the linearisation) and then running: the top
`--top-k` eigenvalues (PyHessian's defaults: power iteration, at most 100
products each, `tol=1e-3`; ours: Lanczos of `--lanczos-iters` products),
a trace from `--trace-probes` probes (PyHessian with `tol=-inf`, so that
it never stops early: its rule divides the change of the running mean by
the mean itself, not its magnitude, so that with its default `tol=1e-3` a
negative trace, as this Hessian's is, stops it after two probes) and a
density from `--slq-probes` probes of `--slq-iters` Lanczos steps.
PyHessian's random numbers come from `torch.manual_seed(0)` before each
call, ours from a fixed key, so every round does the same work. Torch runs
on as many threads as there are cores, as XLA does; with `--one-thread`
both run on one (`torch.set_num_threads(1)`,
`--xla_cpu_multi_thread_eigen=false`): where others' work holds a core,
torch's threads wait on each other at every operation, which slows it far
more than XLA. The load average before and after the rounds is printed.

PyHessian 0.1 (its latest release) calls `torch.eig`, which torch
deprecated in 1.9 and has since removed; `.density()` runs here with a
stand-in of our own for that call (`torch.linalg.eigh`, the tridiagonal
matrix being symmetric), installed only where `torch.eig` fails.

Run from the repository root (set-up: README.md here):

  CURVLINOPS_SITE_PACKAGES=/path/to/venv/lib/python3.11/site-packages \\
      .venv/bin/python benchmarks/pyhessian/resnet_spectrum.py [ROUNDS]  # 3
"""

import argparse
import contextlib
import operator
import os
import sys
import types
import warnings
from pathlib import Path

# First: puts this checkout and the torch venv on the path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "curvlinops"))
import jax
import numpy as np
import side_by_side
from side_by_side import torch

try:
  import pyhessian
except ImportError as error:
  raise SystemExit(
    f"{error}: install PyHessian (pip's `pyhessian`) in the "
    "torch venv (see benchmarks/pyhessian/README.md)."
  ) from None

import problems
from curvbench import config
from curvbench.core import curvatures, matrix_free
from curvbench.core.data import Data

# PyHessian keeps the gradient's graph in `.grad` (backward with
# create_graph), which torch warns about on every call.
warnings.filterwarnings("ignore", message="Using backward.. with create_graph")

PEER = "PyHessian"
PROBLEM = (
  "problem=resnet",
  "problem/data=synthetic_images",
  "problem.widths=[16,32,64]",
  "problem.blocks=1",
  "problem.norm=batch",
)
TORCH_DTYPE = {np.float64: torch.float64, np.float32: torch.float32}
# Relative tolerances: logits and loss; gradients and products; the
# density's moments j = 1, 2, 3 from the same probes. PyHessian divides
# each Lanczos vector by its norm plus 1e-6, leaving it short by a relative
# 1e-6 / norm: the first (norm sqrt(dim)) by 4e-9, which moves the first
# two moments by twice that; the second (norm beta_1, about 0.05 here) by
# 2e-5, which moves the third moment by 4e-5.
TOLERANCE = {
  np.float64: (1e-12, 1e-10, (1e-7, 1e-7, 1e-3)),
  np.float32: (1e-5, 1e-2, (1e-2, 1e-2, 1e-2)),
}
EIGENVALUE_TOLERANCE = 1e-2
STANDARD_ERRORS = 3.0
SEED = 0


def _has_eig() -> bool:
  """Whether `torch.eig`, which PyHessian's `.density()` calls, still works
  (deprecated in torch 1.9, it has since become a stub that raises)."""
  try:
    torch.eig(torch.eye(1), eigenvectors=True)
    return True
  except (AttributeError, RuntimeError):
    return False


if not _has_eig():

  def _symmetric_eig(matrix, eigenvectors=False):
    """Old `torch.eig`'s `(values as (n, 2) real and imaginary parts,
    eigenvectors as columns)`, for a symmetric matrix."""
    del eigenvectors
    values, vectors = torch.linalg.eigh(matrix)
    return torch.stack([values, torch.zeros_like(values)], 1), vectors

  torch.eig = _symmetric_eig


def _same_padding(x, kernel: int, stride: int):
  """`x` (NCHW) padded as XLA's 'SAME' convolutions pad: the output has
  `ceil(size / stride)` positions, an odd pad going after, not before."""
  pads = []
  for size in reversed(x.shape[2:]):  # F.pad lists the last axis first
    total = max((-(-size // stride) - 1) * stride + kernel - size, 0)
    pads += [total // 2, total - total // 2]
  return torch.nn.functional.pad(x, pads)


class TorchResNet(torch.nn.Module):
  """The harness's batch-norm ResNet as a torch module on NCHW images.

  Modules are named as the haiku modules (`conv_in`, `stage0_block0_norm1`,
  `logits`, ...); `layout` and `tree` map haiku-shaped trees onto their
  parameters and back.
  """

  def __init__(self, settings, channels: int, num_classes: int, dtype):
    super().__init__()
    if settings.norm != "batch":
      raise SystemExit(
        f"norm={settings.norm}: this torch copy has batch "
        "norm only; extend TorchResNet."
      )
    self.dtype, self.plan = dtype, []
    layers = {}

    def conv_norm(name, norm, c_in, c_out, kernel, stride):
      layers[name] = torch.nn.Conv2d(
        c_in, c_out, kernel, stride, bias=False, dtype=dtype
      )
      # No running averages: the batch's statistics in train and eval mode.
      layers[norm] = torch.nn.BatchNorm2d(
        c_out, eps=1e-5, dtype=dtype, track_running_stats=False
      )
      return (name, norm)

    self.stem = conv_norm(
      "conv_in", "norm_in", channels, settings.widths[0], 3, 1
    )
    c = settings.widths[0]
    for s, width in enumerate(settings.widths):
      for b in range(settings.blocks):
        name = f"stage{s}_block{b}"
        stride = 2 if s > 0 and b == 0 else 1
        shortcut = (
          conv_norm(
            f"{name}_shortcut", f"{name}_shortcut_norm", c, width, 1, stride
          )
          if stride != 1 or c != width
          else None
        )
        self.plan.append(
          (
            conv_norm(f"{name}_conv1", f"{name}_norm1", c, width, 3, stride),
            conv_norm(f"{name}_conv2", f"{name}_norm2", width, width, 3, 1),
            shortcut,
          )
        )
        c = width
    layers["logits"] = torch.nn.Linear(c, num_classes, dtype=dtype)
    self.layers = torch.nn.ModuleDict(layers)

  def _conv_norm(self, names, x):
    conv, norm = (self.layers[n] for n in names)
    return norm(conv(_same_padding(x, conv.kernel_size[0], conv.stride[0])))

  def forward(self, x):
    relu = torch.nn.functional.relu
    h = relu(self._conv_norm(self.stem, x))
    for first, second, shortcut in self.plan:
      u = self._conv_norm(second, relu(self._conv_norm(first, h)))
      if shortcut:
        h = self._conv_norm(shortcut, h)
      h = relu(h + u)
    return self.layers["logits"](h.mean((2, 3)))

  def _leaves(self):
    """`(module name, haiku leaf, transpose or None)` per torch parameter."""
    for full, _ in self.named_parameters():
      _, module, leaf = full.split(".")
      kind = type(self.layers[module])
      if kind is torch.nn.Conv2d:
        yield module, "w", (3, 2, 0, 1)  # HWIO -> OIHW
      elif kind is torch.nn.BatchNorm2d:
        yield module, {"weight": "scale", "bias": "shift"}[leaf], None
      else:
        yield (
          module,
          {"weight": "w", "bias": "b"}[leaf],
          ((1, 0) if leaf == "weight" else None),
        )

  def layout(self, tree) -> list:
    """A tree shaped like our params as arrays laid out as this module's
    parameters, in their order."""
    return [
      np.asarray(tree[m][leaf]).transpose(t) if t else np.asarray(tree[m][leaf])
      for m, leaf, t in self._leaves()
    ]

  def tree(self, tensors) -> dict:
    """`layout`'s inverse: tensors laid out as the parameters, as a tree."""
    tree = {}
    for (m, leaf, t), x in zip(self._leaves(), tensors):
      x = x.detach().numpy()
      tree.setdefault(m, {})[leaf] = x.transpose(np.argsort(t)) if t else x
    return tree

  def tensors(self, tree) -> list:
    return side_by_side.torch_tensors(self.layout(tree), self.dtype)

  def load(self, params):
    with torch.no_grad():
      for p, a in zip(self.parameters(), self.tensors(params)):
        p.copy_(a)


def _apply(v, operator):
  """The matvec `matrix_free` takes: `operator(v)`."""
  return operator(v)


def sides(dtype, args):
  """Both sides in `dtype` (float64 needs x64 on), at the initial params."""
  settings = config.compose(
    *PROBLEM,
    f"problem.data.size={args.image_size}",
    f"problem.data.num_train={args.examples}",
    "problem.data.num_test=16",
    f"problem.batch_size={args.examples}",
  ).problem
  problem = problems.make(settings)
  params = problem.init_params(jax.random.PRNGKey(SEED), dtype)
  x, y = problem.data.x_train.astype(dtype), problem.data.y_train
  model = TorchResNet(
    settings, x.shape[-1], problem.data.num_classes, TORCH_DTYPE[dtype]
  )
  model.load(params)
  hessian = curvatures.exact("hessian", problem.loss_fn, matrix_free=True)
  operator = lambda p, b: hessian.operator(
    hessian.estimate(None, p, Data.of(b))
  )
  return types.SimpleNamespace(
    dtype=dtype,
    problem=problem,
    params=params,
    batch=(x, y),
    model=model,
    torch_batch=(
      torch.tensor(x.transpose(0, 3, 1, 2), dtype=model.dtype),
      torch.tensor(y, dtype=torch.int64),
    ),
    dim=sum(x.size for x in jax.tree.leaves(params)),
    loss_and_gradient=jax.jit(jax.value_and_grad(problem.loss_fn)),
    product=jax.jit(lambda p, b, v: operator(p, b)(v)),
    operator=jax.jit(operator),
    apply=jax.jit(_apply),
    top=jax.jit(
      lambda p, b, k: matrix_free.top_k_eigenpairs(
        _apply, p, args.top_k, args.lanczos_iters, k, operator(p, b)
      )
    ),
    trace=jax.jit(
      lambda p, b, k: matrix_free.hutchinson_trace(
        _apply, p, args.trace_probes, k, operator(p, b)
      )
    ),
    density=jax.jit(
      lambda p, b, k: matrix_free.slq_density(
        _apply, p, args.slq_iters, args.slq_probes, k, operator(p, b)
      )
    ),
  )


def theirs(s):
  """PyHessian's `hessian` of the model as it now is, on the batch (its
  gradients first cleared: its constructor adds to them)."""
  s.model.zero_grad(set_to_none=True)
  return pyhessian.hessian(
    s.model, torch.nn.CrossEntropyLoss(), data=s.torch_batch, cuda=False
  )


def rademacher_replay(s, count: int) -> list:
  """The Rademacher probes PyHessian's `.trace()` and `.density()` draw
  after `torch.manual_seed(SEED)` (one `randint_like` per parameter, zeros
  made -1), as our trees."""
  torch.manual_seed(SEED)
  probes = []
  for _ in range(count):
    v = [torch.randint_like(p, high=2) for p in s.model.parameters()]
    probes.append(s.model.tree([2 * x - 1 for x in v]))
  return probes


def _vdot(a, b) -> float:
  return float(
    sum(
      np.vdot(np.asarray(x, np.float64), np.asarray(y, np.float64))
      for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )
  )


def _float64(tree):
  return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


def check_point(s, params, where: str, reference=None):
  """Stops unless both sides' logits, loss, gradients and Hessian-vector
  products agree at `params` (loaded into the model). With `reference`
  (the float64 sides), also prints each side's error against our float64
  gradient and products (which equal PyHessian's in float64)."""
  s.model.load(params)
  close, products, _ = TOLERANCE[s.dtype]
  name = lambda what: f"{what}, {where}, {np.dtype(s.dtype).name}"
  check = lambda what, ours, peer, tol: side_by_side.check(
    name(what), side_by_side.relative_error(ours, peer), tol, peer=PEER
  )
  x, y = s.batch
  with torch.no_grad():
    logits = s.model.train()(s.torch_batch[0])
  check("logits", [s.problem.outputs(params, x)], [logits], close)
  loss, gradient = s.loss_and_gradient(params, s.batch)
  h = theirs(s)
  check(
    "loss",
    [loss],
    [torch.nn.functional.cross_entropy(logits, s.torch_batch[1])],
    close,
  )
  detached = lambda tensors: [t.detach() for t in tensors]
  rng = np.random.default_rng(1)
  random = jax.tree.map(
    lambda a: rng.normal(size=a.shape).astype(s.dtype), params
  )
  pairs = {"gradients": (gradient, detached(h.gradsH))}
  for what, v in (("gradient", gradient), ("random vector", random)):
    pairs[f"Hessian products with the {what}"] = (
      s.product(params, s.batch, v),
      detached(
        pyhessian.utils.hessian_vector_product(
          h.gradsH, h.params, s.model.tensors(v)
        )
      ),
    )
  exact = {}
  if reference is not None:
    with jax.enable_x64(True):
      p, b = _float64(params), reference.batch
      exact = {"gradients": reference.loss_and_gradient(p, b)[1]}
      for what, v in (("gradient", gradient), ("random vector", random)):
        exact[f"Hessian products with the {what}"] = reference.product(
          p, b, _float64(v)
        )
  for what, (ours, peer) in pairs.items():
    check(what, s.model.layout(ours), peer, products)
    if what in exact:
      truth = s.model.layout(exact[what])
      print(
        f"    against float64: ours "
        f"{side_by_side.relative_error(s.model.layout(ours), truth):.1e}"
        f", {PEER} {side_by_side.relative_error(peer, truth):.1e}"
      )


def check_probes(s, num: int = 2, iters: int = 4):
  """Stops unless PyHessian's trace terms and density moments equal ours
  for the same probes (replayed from its seed)."""
  _, products, moments = TOLERANCE[s.dtype]
  kind = np.dtype(s.dtype).name
  h = theirs(s)
  torch.manual_seed(SEED)
  peer_terms = h.trace(maxIter=num, tol=-np.inf)
  torch.manual_seed(SEED)
  nodes, weights = h.density(iter=iters, n_v=num)
  probes = rademacher_replay(s, num)
  hv = [s.product(s.params, s.batch, v) for v in probes]
  hhv = [s.product(s.params, s.batch, v) for v in hv]
  side_by_side.check(
    f"trace terms v^T H v of {num} shared probes, {kind}",
    side_by_side.relative_error(
      [[_vdot(v, x) for v, x in zip(probes, hv)]], [peer_terms]
    ),
    products,
    peer=PEER,
  )
  ours = [
    [_vdot(v, x) / s.dim, _vdot(x, x) / s.dim, _vdot(x, y) / s.dim]
    for v, x, y in zip(probes, hv, hhv)
  ]
  peer = [
    [np.sum(np.asarray(w) * np.asarray(t) ** j) for j in (1, 2, 3)]
    for t, w in zip(nodes, weights)
  ]
  for j, tolerance in enumerate(moments):
    side_by_side.check(
      f"density moment j={j + 1} of {num} shared probes ({iters} Lanczos "
      f"steps), {kind}",
      side_by_side.relative_error(
        [[m[j] for m in ours]], [[m[j] for m in peer]]
      ),
      tolerance,
      peer=PEER,
    )


def check_sides(s, reference=None):
  """`check_point` at the initial params and at a perturbed point, then
  `check_probes` at the initial params."""
  check_point(s, s.params, "initial params", reference)
  rng = np.random.default_rng(0)
  check_point(
    s,
    jax.tree.map(
      lambda a: a + 0.1 * rng.normal(size=a.shape).astype(s.dtype), s.params
    ),
    "perturbed params",
    reference,
  )
  s.model.load(s.params)
  check_probes(s)


@contextlib.contextmanager
def counting_products(counter: list):
  """Counts PyHessian's Hessian-vector products (single-batch path)."""
  module = sys.modules["pyhessian.hessian"]
  original = module.hessian_vector_product

  def counted(*args):
    counter.append(1)
    return original(*args)

  module.hessian_vector_product = counted
  try:
    yield
  finally:
    module.hessian_vector_product = original


def _z(a, se_a, b, se_b) -> float:
  return abs(a - b) / np.hypot(se_a, se_b)


def compare_estimates(s, args, key):
  """Prints, and checks, the float32 estimates of both sides, each with
  its own random numbers (PyHessian's as timed)."""
  print("  estimates, float32, each side's own random numbers:")
  h, counter = theirs(s), []
  torch.manual_seed(SEED)
  with counting_products(counter):
    peer_values, peer_vectors = h.eigenvalues(top_n=args.top_k)
  values, vectors = s.top(s.params, s.batch, key)
  values = np.asarray(values, np.float64)
  vectors = [
    jax.tree.map(operator.itemgetter(i), vectors) for i in range(args.top_k)
  ]
  peer_vectors = [s.model.tree(v) for v in peer_vectors]

  def residual(t, v):  # |H v - t v| / (|t| |v|)
    hv = s.product(s.params, s.batch, v)
    r = jax.tree.map(lambda a, b: a - t * b, hv, v)
    return np.sqrt(_vdot(r, r) / _vdot(v, v)) / abs(t)

  for i in range(args.top_k):
    print(
      f"    eigenvalue {i + 1}: ours {values[i]:.6g} (residual "
      f"{residual(values[i], vectors[i]):.1e}), {PEER} "
      f"{peer_values[i]:.6g} (residual "
      f"{residual(peer_values[i], peer_vectors[i]):.1e})"
    )
  print(
    f"    products: ours {args.lanczos_iters} (Lanczos), {PEER} "
    f"{len(counter)} (power iteration)"
  )
  if args.top_k > 1:
    print(
      f"    {PEER}'s power iteration (deflated) finds the eigenvalues of "
      "largest magnitude, ours (Lanczos) the largest: only the first is "
      "compared"
    )
  side_by_side.check(
    "top eigenvalue",
    side_by_side.relative_error([values[:1]], [peer_values[:1]]),
    EIGENVALUE_TOLERANCE,
    peer=PEER,
  )
  torch.manual_seed(SEED)
  early = h.trace(maxIter=args.trace_probes)  # its default tol=1e-3
  print(
    f"    {PEER}'s trace with its default stopping rule (tol=1e-3) "
    f"stopped after {len(early)} of at most {args.trace_probes} probes "
    f"at {np.mean(early):.6g}; timed and compared: tol=-inf, all "
    f"{args.trace_probes}"
  )
  torch.manual_seed(SEED)
  terms = np.array(h.trace(maxIter=args.trace_probes, tol=-np.inf))
  estimates = {
    "trace (Hutchinson)": (
      tuple(map(float, s.trace(s.params, s.batch, key))),
      (terms.mean(), terms.std(ddof=1) / np.sqrt(len(terms))),
    )
  }
  torch.manual_seed(SEED)
  peer_nodes, peer_weights = (
    np.array(a, np.float64)
    for a in h.density(iter=args.slq_iters, n_v=args.slq_probes)
  )
  nodes, weights = (
    np.asarray(a, np.float64).reshape(args.slq_probes, -1)
    for a in s.density(s.params, s.batch, key)
  )
  weights *= args.slq_probes  # ours sum to one over all probes
  for j in (1, 2):
    per_probe = [
      s.dim * np.sum(w * t**j, 1)
      for t, w in ((nodes, weights), (peer_nodes, peer_weights))
    ]
    estimates[f"density moment {j}: dim * sum w t^{j} (tr H^{j})"] = tuple(
      (p.mean(), p.std(ddof=1) / np.sqrt(len(p))) for p in per_probe
    )
  print(
    f"    density nodes: ours {nodes.min():.4g} to {nodes.max():.4g}, "
    f"{PEER} {peer_nodes.min():.4g} to {peer_nodes.max():.4g}"
  )
  for what, ((a, se_a), (b, se_b)) in estimates.items():
    z = _z(a, se_a, b, se_b)
    print(
      f"    {what}: ours {a:.6g} +- {se_a:.2g}, {PEER} {b:.6g} +- "
      f"{se_b:.2g}: {z:.2f} combined standard errors apart"
    )
    if not z <= STANDARD_ERRORS:
      raise SystemExit(
        f"{what}: ours and {PEER} differ by more than "
        f"{STANDARD_ERRORS} combined standard errors; no "
        "timings taken."
      )


def main(args):
  if args.one_thread:  # before jax starts its CPU client
    os.environ["XLA_FLAGS"] = " ".join(
      filter(
        None,
        (os.environ.get("XLA_FLAGS"), "--xla_cpu_multi_thread_eigen=false"),
      )
    )
    torch.set_num_threads(1)
  with jax.enable_x64(True):
    torch.set_default_dtype(torch.float64)  # PyHessian's own vectors
    try:
      reference = sides(np.float64, args)
      check_sides(reference)
    finally:
      torch.set_default_dtype(torch.float32)
  s = sides(np.float32, args)
  check_sides(s, reference)
  key = jax.random.PRNGKey(SEED)
  print(
    f"  {s.problem.name} (ResNet-8, widths 16-32-64, batch norm in "
    f"training mode): one batch of {len(s.batch[1])} {args.image_size}x"
    f"{args.image_size} synthetic images; {s.dim} parameters"
  )
  compare_estimates(s, args, key)

  def ours(fn):
    return lambda: side_by_side.timed(
      lambda: jax.block_until_ready(fn(s.params, s.batch, key))
    )

  def peer(method, **kwargs):
    def call():
      torch.manual_seed(SEED)
      getattr(theirs(s), method)(**kwargs)

    return lambda: side_by_side.timed(call)

  operator = s.operator(s.params, s.batch)
  h = theirs(s)
  vector, peer_vector = s.params, s.model.tensors(s.params)
  runs = {
    "our Hessian-vector product": lambda: side_by_side.timed(
      lambda: jax.block_until_ready(s.apply(vector, operator))
    ),
    f"{PEER} Hessian-vector product": lambda: side_by_side.timed(
      pyhessian.utils.hessian_vector_product, h.gradsH, h.params, peer_vector
    ),
    f"our top-{args.top_k}": ours(s.top),
    f"{PEER} top-{args.top_k}": peer("eigenvalues", top_n=args.top_k),
    "our trace": ours(s.trace),
    f"{PEER} trace": peer("trace", maxIter=args.trace_probes, tol=-np.inf),
    "our density": ours(s.density),
    f"{PEER} density": peer(
      "density", iter=args.slq_iters, n_v=args.slq_probes
    ),
  }
  load = os.getloadavg()[0]
  seconds = side_by_side.interleaved(runs, args.rounds, warmup=1)
  side_by_side.describe_machine(args.rounds, peers=("pyhessian",))
  print(
    f"  load average (1 min) {load:.2f} before the rounds, "
    f"{os.getloadavg()[0]:.2f} after"
    + ("; one thread each (--one-thread)" if args.one_thread else "")
  )
  print(
    f"  per call: one product with the params as the vector (operator "
    f"built beforehand); top-{args.top_k} (ours: {args.lanczos_iters} "
    f"Lanczos steps), trace from {args.trace_probes} probes, density "
    f"from {args.slq_probes} probes x {args.slq_iters} Lanczos steps, "
    "each with its operator built anew"
  )
  names = list(runs)
  side_by_side.report(seconds, list(zip(names[::2], names[1::2])))


def parse(argv):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("rounds", nargs="?", type=int, default=3)
  parser.add_argument("--image-size", type=int, default=16)
  parser.add_argument("--examples", type=int, default=128)
  parser.add_argument("--top-k", type=int, default=1)
  parser.add_argument("--lanczos-iters", type=int, default=15)
  parser.add_argument("--trace-probes", type=int, default=10)
  parser.add_argument("--slq-probes", type=int, default=3)
  parser.add_argument("--slq-iters", type=int, default=10)
  parser.add_argument(
    "--one-thread",
    action="store_true",
    help="torch and XLA on one thread each (default: "
    "every core), steadier where others load the machine",
  )
  return parser.parse_args(argv)


if __name__ == "__main__":
  main(parse(sys.argv[1:]))
