"""Our K-FAC optimizer step against KFAC-JAX's, in one process.

Both libraries get the same model (the harness's own, from `problems`),
the same parameters, batch, loss registration and optimizer settings (those
of KFAC-JAX's MNIST examples: adaptive learning rate, momentum and damping,
an inverse refresh and a damping adaptation every 5 steps), in float32.
The model code registers its layers and loss through a module-level name;
while a library traces the model that name is pointed at that library, so
each sees its own tags in the same model.

A round is whole cycles of `inverse_update_period` steps of one library
(as many as fill `--round-s`; `block_until_ready` at its end), each round
from the same saved state; rounds alternate ABAB (the order flips every
pair), so load from other processes hits both alike. Compile time
(the first cycle, burn-in included) is reported apart. The ratio is the
median over pairs of ours / theirs, with the sign test's 95 % interval
(`curvbench.core.stats.paired_difference` of the logarithms).

  /tmp/kvenv-head/bin/python benchmarks/kfac_jax/side_by_side.py \
      [--problems mlp autoencoder_mnist convnet] [--rounds 15] \
      [--mode ggn_curvature_prop]

KFAC-JAX must be importable (see this folder's README for the venv).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import os
import platform
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import kfac_jax  # noqa: E402

import estimators  # noqa: E402
import problems  # noqa: E402
import problems.base  # noqa: E402
import problems.layers  # noqa: E402
from curvbench.core import stats  # noqa: E402
from curvbench.measurements.timing import load  # noqa: E402
from curvbench.optimizers.kfac import MNIST_EXAMPLES  # noqa: E402

# The models timed: the harness's problems, by settings for `problems.make`.
# The MNIST autoencoder is the preset `autoencoder_mnist`'s network and
# batch on generated 28x28 images (the same shapes; no data files needed).
PROBLEMS = {
  "mlp": {"name": "mlp"},
  "autoencoder_mnist": {
    "name": "autoencoder",
    "encoder": [1000, 500, 250],
    "code": 30,
    "batch_size": 1000,
    "data": {
      "name": "synthetic_images",
      "size": 28,
      "channels": 1,
      "num_train": 1000,
      "num_test": 10,
    },
  },
  "convnet": {"name": "convnet"},
}

# KFAC-JAX's MNIST examples' options, on one device.
SETTINGS = dict(MNIST_EXAMPLES, multi_device=False)
PERIOD = SETTINGS["inverse_update_period"]  # = the damping's interval


class _Registering:
  """A library seen through the names the model code calls: loss
  registrations hand back their logits (KFAC-JAX's return None)."""

  def __init__(self, library):
    self._library = library

  def register_conv2d(self, y, x, w, b=None, data_format="NHWC", **kwargs):
    """KFAC-JAX's conv blocks read the layer's dimension numbers from the
    tag's parameters (those `lax.conv_general_dilated` takes)."""
    if self._library is not estimators:
      spec = (data_format, "HWIO", data_format)
      kwargs["dimension_numbers"] = jax.lax.conv_dimension_numbers(
        x.shape, w.shape, spec
      )
      kwargs.setdefault("precision", None)
      return self._library.register_conv2d(y, x, w, b, **kwargs)
    return self._library.register_conv2d(
      y, x, w, b, data_format=data_format, **kwargs
    )

  def __getattr__(self, name):
    fn = getattr(self._library, name)
    if not (name.startswith("register_") and name.endswith("_loss")):
      return fn

    def register(x, *args, **kwargs):
      out = fn(x, *args, **kwargs)
      return x if out is None else out

    return register


@contextlib.contextmanager
def _registering_with(library):
  modules = (problems.layers, problems.base)
  saved = [m.kfac for m in modules]
  for m in modules:
    m.kfac = _Registering(library)
  try:
    yield
  finally:
    for m, old in zip(modules, saved):
      m.kfac = old


def _loss_for(library, loss_fn):
  def traced(params, batch):
    with _registering_with(library):
      return loss_fn(params, batch)

  return traced


class Side:
  """One library's optimizer on the problem, its parameters and state
  carried from call to call."""

  def __init__(self, name, library, problem, params, batch, mode, steps):
    self.name, self.library = name, library
    self.loss_fn = _loss_for(library, problem.loss_fn)
    self.opt = library.Optimizer(
      jax.value_and_grad(self.loss_fn), estimation_mode=mode, **SETTINGS
    )
    self.batch = batch
    self.key = jax.random.PRNGKey(42)
    # KFAC-JAX donates its parameters and state: each side its own copy.
    self.params = jax.tree.map(jnp.array, params)
    self.state = self.opt.init(self.params, self.key, batch)
    self.step = 0
    # Each step's key, made here: off the clock, and the same for both.
    self.keys = list(jax.random.split(jax.random.PRNGKey(1), steps))

  def checkpoint(self) -> None:
    """Keeps the parameters, state and step to start every round from, so
    that the rounds time the same steps (a fixed batch trained on for long
    ends in NaNs, whose arithmetic runs at another speed)."""
    self.saved = (self.params, self.state, self.step)
    self.restore()

  def restore(self) -> None:
    params, state, self.step = self.saved
    # Copies: KFAC-JAX's step donates (and so deletes) its inputs.
    self.params, self.state = jax.tree.map(jnp.array, (params, state))
    jax.block_until_ready((self.params, self.state))

  def cycle(self) -> float:
    """Seconds for `PERIOD` steps, to the last one's results."""
    start = time.perf_counter()
    data = itertools.repeat(self.batch)
    for _ in range(PERIOD):
      self.params, self.state, stats = self.opt.step(
        self.params,
        self.state,
        self.keys[self.step],
        data_iterator=data,
        global_step_int=self.step,
      )
      self.step += 1
    jax.block_until_ready((self.params, self.state))
    self.loss = stats["loss"]  # the last step's, read after the clock
    return time.perf_counter() - start


def _program_facts(compiled) -> dict:
  cost = compiled.cost_analysis()
  if isinstance(cost, list):  # older jax: one dict per program
    cost = cost[0]
  text = compiled.as_text()
  return dict(
    flops=float(cost.get("flops", math.nan)),
    bytes=float(cost.get("bytes accessed", math.nan)),
    ops=sum(1 for line in text.splitlines() if " = " in line),
    fusions=len(re.findall(r"^\s*(?:ROOT )?\S+ = \S+ fusion\(", text, re.M)),
    custom_calls=text.count("custom-call("),
  )


def _closure(fn, name):
  """The value of the free variable `name` of the function `fn`."""
  cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
  return cells[name].cell_contents


def ours_programs(side: Side) -> dict:
  """XLA's facts of each of our step's programs, by its static flags: the
  programs `Optimizer.step` runs (`utils.staging.stage`'s, pass-through
  outputs left out), lowered for the CPU."""
  opt, out = side.opt, {}
  for label, refresh, damping in (
    ("plain", False, False),
    ("refresh", True, False),
    ("damping", False, True),
  ):
    staged = opt._compiled_refresh_step if refresh else opt._compiled_step
    jitted = _closure(staged, "compiled_for")("cpu")
    args = (side.params, side.state, side.key, side.batch, None)
    lowered = jitted.lower(
      *args, None, None, None, None, True, refresh, damping
    )
    out[label] = _program_facts(lowered.compile())
  # One cycle: a refresh step, three plain ones and a damping step.
  out["cycle"] = {
    k: out["refresh"][k] + 3 * out["plain"][k] + out["damping"][k]
    for k in out["plain"]
  }
  return out


def _their_jitted_step():
  """The `jax.jit` object inside KFAC-JAX's staged `Optimizer._step`."""
  for cell in kfac_jax.Optimizer._step.__closure__ or ():
    if hasattr(cell.cell_contents, "lower"):
      return cell.cell_contents
  raise RuntimeError("KFAC-JAX's Optimizer._step holds no jitted function")


def their_programs(side: Side) -> dict:
  """XLA's facts of KFAC-JAX's step programs (the inverse refresh is a
  `lax.cond` inside both: XLA's count takes it in)."""
  jitted, out = _their_jitted_step(), {}
  for label, damping in (("plain", False), ("damping", True)):
    with side.opt.staging_context():
      lowered = jitted.lower(
        side.opt,
        side.params,
        side.state,
        side.key,
        side.batch,
        None,
        None,
        None,
        None,
        True,
        damping,
      )
    out[label] = _program_facts(lowered.compile())
  out["cycle"] = {
    k: 4 * out["plain"][k] + out["damping"][k] for k in out["plain"]
  }
  return out


def compare(
  name: str, settings: dict, rounds: int, mode: str, round_s: float
) -> dict:
  problem = problems.make(settings)
  params = problem.init_params(jax.random.PRNGKey(0), np.float32)
  batch = jax.tree.map(jnp.asarray, problem.fixed_batch())
  steps = 2 * PERIOD
  sides = [
    Side("ours", estimators, problem, params, batch, mode, steps),
    Side("theirs", kfac_jax, problem, params, batch, mode, steps),
  ]
  first = {s.name: s.cycle() for s in sides}  # compile + burn-in + cycle
  # One more untimed cycle each; it sets how many cycles make a round.
  warm = max(s.cycle() for s in sides)
  cycles = max(1, math.ceil(round_s / warm))
  for s in sides:
    s.keys += list(jax.random.split(jax.random.PRNGKey(2), cycles * PERIOD))
    s.checkpoint()
  times = {s.name: [] for s in sides}
  before = os.getloadavg()
  with load.Monitor() as monitor:
    for r in range(rounds):
      order = sides if r % 2 == 0 else sides[::-1]
      for s in order:
        s.restore()
        spent = sum(s.cycle() for _ in range(cycles))
        times[s.name].append(spent / (cycles * PERIOD))
  after = os.getloadavg()
  ours, theirs = np.array(times["ours"]), np.array(times["theirs"])
  log_ratio = stats.paired_difference(np.log(ours), np.log(theirs))
  centre, low, high = (math.exp(v) for v in log_ratio)
  return dict(
    problem=name,
    params=problem.num_params,
    batch=problem.batch_size,
    ours_ms=1e3 * float(np.median(ours)),
    theirs_ms=1e3 * float(np.median(theirs)),
    ratio=(centre, low, high),
    rounds=rounds,
    cycles=cycles,
    compile_s={
      k: v - PERIOD * float(np.median(times[k])) for k, v in first.items()
    },
    loss={s.name: (s.step, float(s.loss)) for s in sides},
    load_before=before[0],
    load_after=after[0],
    monitor=monitor.load,
    programs=dict(
      ours=ours_programs(sides[0]), theirs=their_programs(sides[1])
    ),
  )


def _print(result: dict) -> None:
  c, lo, hi = result["ratio"]
  print(
    f"\n## {result['problem']} ({result['params']} parameters, "
    f"batch {result['batch']})"
  )
  print(
    f"step: ours {result['ours_ms']:.3f} ms, KFAC-JAX {result['theirs_ms']:.3f} "
    f"ms; ours/theirs {c:.3f} [95 % {lo:.3f}, {hi:.3f}] "
    f"(median of {result['rounds']} paired rounds of {result['cycles']} x "
    f"{PERIOD} steps, sign test)"
  )
  print(
    "compile + burn-in (first cycle less a timed one): "
    + ", ".join(f"{k} {v:.1f} s" for k, v in result["compile_s"].items())
  )
  print(
    "loss at the last step (a check that both train the same model): "
    + ", ".join(
      f"{k} {v:.5g} (step {n})" for k, (n, v) in result["loss"].items()
    )
  )
  print(
    f"load average {result['load_before']:.2f} before, "
    f"{result['load_after']:.2f} after; {result['monitor'].describe()}"
  )
  for side, progs in result["programs"].items():
    for label, f in progs.items():
      print(
        f"  {side:6s} {label:8s} flops {f['flops']:.4g}  bytes "
        f"{f['bytes']:.4g}  HLO ops {f['ops']}  fusions {f['fusions']}  "
        f"custom calls {f['custom_calls']}"
      )
  ours, theirs = (result["programs"][k]["cycle"] for k in ("ours", "theirs"))
  print(f"  flops per cycle ours/theirs: {ours['flops'] / theirs['flops']:.3f}")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument(
    "--problems", nargs="+", default=list(PROBLEMS), choices=list(PROBLEMS)
  )
  parser.add_argument("--rounds", type=int, default=15)
  parser.add_argument("--mode", default="ggn_curvature_prop")
  parser.add_argument(
    "--round-s",
    type=float,
    default=0.25,
    help="least seconds of a round: whole cycles of steps, as many as fit",
  )
  args = parser.parse_args(argv)
  print(
    f"jax {jax.__version__}, {jax.devices()[0].device_kind}, "
    f"{os.cpu_count()} CPUs, python {platform.python_version()}; "
    f"KFAC-JAX from {Path(kfac_jax.__file__).parent}; mode {args.mode}"
  )
  results = [
    compare(name, PROBLEMS[name], args.rounds, args.mode, args.round_s)
    for name in args.problems
  ]
  for result in results:
    _print(result)
  print(
    "\n| problem | ours ms | KFAC-JAX ms | ours/theirs [95 %] | rounds | "
    "load avg | others' CPU | flops/cycle ours/theirs |"
  )
  print("|---|---|---|---|---|---|---|---|")
  for r in results:
    c, lo, hi = r["ratio"]
    o, t = (r["programs"][k]["cycle"]["flops"] for k in ("ours", "theirs"))
    print(
      f"| {r['problem']} | {r['ours_ms']:.3f} | {r['theirs_ms']:.3f} | "
      f"{c:.3f} [{lo:.3f}, {hi:.3f}] | {r['rounds']} | "
      f"{r['load_before']:.2f}-{r['load_after']:.2f} | "
      f"{100 * r['monitor'].others_share:.0f} % | {o:.3g}/{t:.3g} |"
    )


if __name__ == "__main__":
  main()
