"""The GGN-vector product over the convnet's training split: ours against
curvlinops' `GGNLinearOperator`, with both sides' gradient as a reference.

The problem is the harness's `problem=convnet` (problems/models/convnet.py:
'SAME' convs, ReLU and 2x2 max-pooling per block, then dense layers),
rebuilt as a torch module in NCHW that holds the same weights as the
harness's initial params, and its whole training split in the harness's
chunks (`curvbench.core.data.select(problem, "train")`: equal chunks of the
problem's batch size and the remainder), float32. Timed in interleaved
rounds in one process, compile and warm-up excluded:

- ours, as the harness computes it (`ImplicitExact.multiply`): the jitted
  `Data.mean` over the chunks of `IMPLICIT_PRODUCTS["ggn"]` of
  `ImplicitExactCurvature(problem.loss_fn)`, up to `block_until_ready`;
- curvlinops: `op @ v` with `op` a `GGNLinearOperator` over the same
  batches, its loss `CrossEntropyLoss()` (a mean, which curvlinops
  reweighs by batch so that the operator is the GGN of the mean over the
  split, as ours is); building it is not timed;
- the split's gradient on each side (`Data.mean` of `jax.grad`;
  curvlinops' `gradient_and_loss`).
The vector is the split's gradient, as in tests/benchmarks/
test_bench_dataset.py. Torch runs on as many threads as there are cores.

Before timing, at the initial params and at a perturbed point (every
weight and bias moved, so that a wrong layout cannot hide behind zero
biases), the logits, the gradients and the GGN products (with the gradient
and with a random vector) must agree, to 1e-12 / 1e-10 (relative) in
float64 and 1e-5 / 1e-4 in float32, or the script stops.

Run from the repository root (set-up: README.md here):

  CURVLINOPS_SITE_PACKAGES=/path/to/venv/lib/python3.11/site-packages \\
      .venv/bin/python benchmarks/curvlinops/convnet_ggn.py [ROUNDS]  # 15
"""

import collections
import sys
import types

import jax
import numpy as np

# First: puts this checkout and the torch venv on the path.
import side_by_side
from curvlinops import GGNLinearOperator
from side_by_side import torch

import estimators as kfac
import problems
from curvbench import config
from curvbench.core import curvatures, data

PROBLEM = "problem=convnet"
TORCH_DTYPE = {np.float64: torch.float64, np.float32: torch.float32}
# Relative tolerances of the logits and of the products (gradients, GGN).
TOLERANCE = {np.float64: (1e-12, 1e-10), np.float32: (1e-5, 1e-4)}


class TorchConvNet(torch.nn.Sequential):
  """The harness's convnet as a torch module on NCHW images.

  Modules holding parameters are named as the haiku modules (`conv_i`,
  `dense_i`, `logits`); `layout` maps haiku-shaped trees onto them.
  """

  def __init__(self, settings, image_shape, num_classes: int, dtype):
    if settings.normalize or settings.activation != "relu":
      raise SystemExit(
        f"{PROBLEM} now has normalize={settings.normalize}, activation="
        f"{settings.activation!r}; this torch copy has no normalisation "
        "and ReLU: extend TorchConvNet to match problems/models/convnet.py."
      )
    height, width, channels = image_shape
    layers = collections.OrderedDict()
    for i, c in enumerate(settings.channels):
      layers[f"conv_{i}"] = torch.nn.Conv2d(
        channels, c, settings.kernel, padding="same", dtype=dtype
      )
      layers[f"relu_{i}"] = torch.nn.ReLU()
      layers[f"pool_{i}"] = torch.nn.MaxPool2d(2)  # floors, as 'VALID' does
      height, width, channels = height // 2, width // 2, c
    self.pooled_shape = (height, width, channels)
    layers["flatten"] = torch.nn.Flatten()
    size = height * width * channels
    for i, out in enumerate(settings.dense):
      layers[f"dense_{i}"] = torch.nn.Linear(size, out, dtype=dtype)
      layers[f"dense_relu_{i}"] = torch.nn.ReLU()
      size = out
    layers["logits"] = torch.nn.Linear(size, num_classes, dtype=dtype)
    super().__init__(layers)
    self.dtype = dtype

  def layout(self, tree) -> list:
    """A tree shaped like our params (weights or a vector) as arrays in the
    order and layouts of this module's parameters."""
    arrays, flattened = [], False
    for name, module in self.named_children():
      if not isinstance(module, (torch.nn.Conv2d, torch.nn.Linear)):
        continue
      w = np.asarray(tree[name]["w"])
      if w.ndim == 4:
        w = w.transpose(3, 2, 0, 1)  # HWIO -> OIHW
      else:
        if not flattened:  # rows: haiku's (h, w, c) order -> torch's (c, h, w)
          w = w.reshape(*self.pooled_shape, -1).transpose(2, 0, 1, 3)
          w, flattened = w.reshape(-1, w.shape[-1]), True
        w = w.T  # (in, out) -> (out, in)
      arrays += [w, np.asarray(tree[name]["b"])]
    return arrays

  def load(self, params):
    """Copies our params into this module."""
    with torch.no_grad():
      for p, a in zip(
        self.parameters(),
        side_by_side.torch_tensors(self.layout(params), self.dtype),
      ):
        p.copy_(a)

  def tensors(self, tree) -> list:
    return side_by_side.torch_tensors(self.layout(tree), self.dtype)


def torch_batches(examples: data.Data, dtype) -> list:
  """The chunks and the remainder of `examples` as curvlinops' data: a list
  of `(NCHW images, int64 labels)`."""
  x, y = examples.chunks
  batches = [(x[i], y[i]) for i in range(examples.num_chunks)]
  if examples.rest is not None:
    batches.append(examples.rest)
  return [
    (
      torch.tensor(np.asarray(x).transpose(0, 3, 1, 2), dtype=dtype),
      torch.tensor(np.asarray(y), dtype=torch.int64),
    )
    for x, y in batches
  ]


def sides(dtype):
  """Both sides in `dtype` (float64 needs x64 on), at the initial params."""
  settings = config.compose(PROBLEM).problem
  problem = problems.make(settings)
  params = problem.init_params(jax.random.PRNGKey(0), dtype)
  examples = data.select(problem, "train", dtype=dtype)
  model = TorchConvNet(
    settings,
    problem.data.x_train.shape[1:],
    problem.data.num_classes,
    TORCH_DTYPE[dtype],
  )
  model.load(params)
  implicit = kfac.ImplicitExactCurvature(problem.loss_fn)
  product = curvatures.IMPLICIT_PRODUCTS["ggn"]
  return types.SimpleNamespace(
    dtype=dtype,
    problem=problem,
    params=params,
    examples=examples,
    model=model,
    ggn=jax.jit(lambda p, v, d: d.mean(lambda b: product(implicit, (p, b), v))),
    gradient=jax.jit(
      lambda p, d: d.mean(lambda b: jax.grad(problem.loss_fn)(p, b))
    ),
    op=GGNLinearOperator(
      model,
      torch.nn.CrossEntropyLoss(),
      list(model.parameters()),
      torch_batches(examples, TORCH_DTYPE[dtype]),
    ),
  )


def check_point(s, params, where: str):
  """Stops unless both sides agree at `params` (loaded into the model)."""
  s.model.load(params)
  logits, products = TOLERANCE[s.dtype]
  name = lambda what: f"{what}, {where}, {np.dtype(s.dtype).name}"
  x = s.examples.concatenated()[0]
  with torch.no_grad():
    theirs = s.model(
      torch.tensor(np.asarray(x).transpose(0, 3, 1, 2), dtype=s.model.dtype)
    )
  side_by_side.check(
    name("logits over the split"),
    side_by_side.relative_error([s.problem.outputs(params, x)], [theirs]),
    logits,
  )
  gradient = s.gradient(params, s.examples)
  side_by_side.check(
    name("gradients"),
    side_by_side.relative_error(
      s.model.layout(gradient), s.op.gradient_and_loss()[0]
    ),
    products,
  )
  rng = np.random.default_rng(1)
  for what, v in (
    ("gradient", gradient),
    (
      "random vector",
      jax.tree.map(lambda a: rng.normal(size=a.shape).astype(s.dtype), params),
    ),
  ):
    side_by_side.check(
      name(f"GGN products with the {what}"),
      side_by_side.relative_error(
        s.model.layout(s.ggn(params, v, s.examples)), s.op @ s.model.tensors(v)
      ),
      products,
    )


def check_sides(s):
  """`check_point` at the initial params and at a perturbed point; leaves the
  model at the initial params."""
  check_point(s, s.params, "initial params")
  rng = np.random.default_rng(0)
  check_point(
    s,
    jax.tree.map(
      lambda a: a + 0.1 * rng.normal(size=a.shape).astype(s.dtype), s.params
    ),
    "perturbed params",
  )
  s.model.load(s.params)


def main(rounds: int):
  with jax.enable_x64(True):
    check_sides(sides(np.float64))
  s = sides(np.float32)
  check_sides(s)
  print(
    f"  {s.problem.name}: {s.examples.num_examples} training examples in "
    f"{s.examples.num_chunks} chunks of {s.examples.chunk_size} + "
    f"{s.examples.rest_size}; "
    f"{sum(a.size for a in jax.tree.leaves(s.params))} parameters"
  )
  vector = s.gradient(s.params, s.examples)
  vector_torch = s.model.tensors(vector)
  block = lambda fn: lambda: side_by_side.timed(
    lambda: jax.block_until_ready(fn())
  )
  seconds = side_by_side.interleaved(
    {
      "our GGN-vector product": block(
        lambda: s.ggn(s.params, vector, s.examples)
      ),
      "curvlinops GGN-vector product": lambda: side_by_side.timed(
        lambda: s.op @ vector_torch
      ),
      "our gradient": block(lambda: s.gradient(s.params, s.examples)),
      "curvlinops gradient": lambda: side_by_side.timed(s.op.gradient_and_loss),
    },
    rounds,
  )
  side_by_side.describe_machine(rounds)
  side_by_side.report(
    seconds,
    [
      ("our GGN-vector product", "curvlinops GGN-vector product"),
      ("our gradient", "curvlinops gradient"),
    ],
  )


if __name__ == "__main__":
  main(int(sys.argv[1]) if len(sys.argv) > 1 else 15)
