"""Side by side: the working tree against an earlier commit, in one process.

A slowdown and a loaded machine look alike when two versions are timed
apart. Here the earlier commit's top-level packages, whatever its layout
(`packages`: e.g. a top-level `components` before it moved inside
curvbench), are extracted (`git archive`) into a temporary folder and
imported from there, under their own names, while the working tree's
modules of those names are set aside in `sys.modules`; then the working
tree's are put back. Each version's modules
keep references to their own siblings, so both run in the same process.

Each benchmark builds its work from one version's modules (its own loss
registration, blocks and optimizer, or its own `Data.mean`) on the same
arrays (`kfac_step_<problem>`: each version's own build of a problem at
its defaults, so a changed model or dataset shows in `max_rel_diff`), compiles it and runs it once off the clock; then rounds time one
call of each version, the order flipping every round, so that load on the
machine hits both alike. The ratio is the median over rounds of the
working tree's time over the earlier commit's (> 1: the working tree is
slower), with its quartiles; `max_rel_diff` is how far the two versions'
results differ (a faster version that computes something else shows).
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import math
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd

from curvbench.bench import record

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("estimators", "curvbench", "problems")  # what a version is
# Top-level folders that are not a version's library code.
NOT_CODE = ("tests", "docs", "examples", "benchmarks", "reports", "conf")
PERIOD = 5  # K-FAC steps per round: one inverse refresh each


@dataclasses.dataclass(frozen=True)
class Version:
  """One version of the code: a name, its `estimators` and `problems`
  packages and its data module (`curvbench.core.data`)."""

  name: str
  estimators: ModuleType
  data: ModuleType
  problems: ModuleType


@dataclasses.dataclass(frozen=True)
class Size:
  """The benchmarks' sizes: the dense network's layer widths and batch; the
  convnet's examples per chunk and chunks; the least seconds of one round
  (`interleaved`); the problems' batch size (None: each one's default)."""

  widths: tuple[int, ...]
  batch: int
  chunk: int
  chunks: int
  round_s: float
  problem_batch: int | None = None


SIZES = dict(
  full=Size((100, 50, 50, 50, 10), 128, 128, 4, round_s=0.05),
  quick=Size((12, 8, 4), 16, 8, 2, round_s=0.0, problem_batch=8),
)


def _git(*args) -> bytes:
  result = subprocess.run(
    ["git", *args], cwd=ROOT, capture_output=True, timeout=120
  )
  if result.returncode != 0:
    raise ValueError(
      f"git {' '.join(args)} failed in {ROOT}: {result.stderr.decode().strip()}"
    )
  return result.stdout


def resolve(ref: str) -> str:
  """The commit `ref` names.

  Raises:
    ValueError: when `ref` names no commit of this checkout.
  """
  try:
    return _git("rev-parse", "--verify", f"{ref}^{{commit}}").decode().strip()
  except (OSError, ValueError) as e:
    raise ValueError(
      f"{ref!r} names no commit here ({e}); give a commit, "
      "tag or branch of this repository, e.g. HEAD~1."
    ) from e


def packages(commit: str) -> tuple[str, ...]:
  """The top-level packages of `commit` (folders holding an `__init__.py`,
  tests, docs and the like aside): what that version's code is, in
  whatever layout it had."""
  files = _git("ls-tree", "-r", "--name-only", commit).decode().splitlines()
  found = {
    path.split("/")[0]
    for path in files
    if path.count("/") == 1 and path.endswith("/__init__.py")
  }
  return tuple(sorted(found - set(NOT_CODE)))


def _import_from(
  root: Path, names: tuple[str, ...], tops: tuple[str, ...] = PACKAGES
) -> dict[str, ModuleType]:
  """Imports `names` from the source tree at `root`, leaving `sys.modules`
  as it was: the working tree's modules of the top-level packages `tops`
  (and `PACKAGES`) are set aside while the others import, then put back.

  Raises:
    ValueError: when a module came from somewhere other than `root`.
  """
  shadowed = set(PACKAGES) | set(tops)

  def ours():
    return {k: m for k, m in sys.modules.items() if k.split(".")[0] in shadowed}

  saved = ours()
  for name in saved:
    del sys.modules[name]
  sys.path.insert(0, str(root))
  importlib.invalidate_caches()
  try:
    modules = {n: importlib.import_module(n) for n in names}
    # Registries import their components' modules when first asked: here,
    # while the extracted tree is the one on the path.
    for module in modules.values():
      for registry in ("PROBLEMS", "DATASETS"):
        if hasattr(module, registry):
          getattr(module, registry).names()
  finally:
    sys.path.remove(str(root))
    for name in ours():
      del sys.modules[name]
    sys.modules.update(saved)
  for name, module in modules.items():
    file = cast(str, module.__file__)  # imported from a file
    if not Path(file).resolve().is_relative_to(root.resolve()):
      raise ValueError(
        f"{name} was imported from {module.__file__}, not "
        f"from the extracted commit in {root}."
      )
  return modules


def load(ref: str, folder: Path) -> Version:
  """The version at commit `ref`, extracted into `folder`."""
  commit = resolve(ref)
  tops = packages(commit)
  tar = _git("archive", "--format=tar", commit, "--", *tops)
  with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
    archive.extractall(folder, filter="data")
  # Commits before the toolkit moved to curvbench.core have curvbench.data.
  data = (
    "curvbench.core.data"
    if (folder / "curvbench" / "core" / "data.py").exists()
    else "curvbench.data"
  )
  modules = _import_from(folder, ("estimators", data, "problems"), tops)
  return Version(
    f"{ref} ({commit[:10]})",
    modules["estimators"],
    modules[data],
    modules["problems"],
  )


def working_tree() -> Version:
  """The code this process imports: the working tree's `estimators`,
  `problems` and `curvbench.core.data`."""
  # Imported here, not at the top: the modules `sys.modules` holds when
  # called, the working tree's once an earlier commit's are set aside.
  import estimators  # noqa: PLC0415 - see above
  import problems  # noqa: PLC0415 - see above
  from curvbench.core import data  # noqa: PLC0415 - see above

  return Version("working tree", estimators, data, problems)


# --- the benchmarks: each builds, from one version, a call that does one
# round of work and returns its result -----------------------------------


def _mlp(kfac, size: Size):
  """A tanh MLP with a registered softmax cross-entropy, its parameters
  and a batch (the same arrays for every version)."""
  rng = jax.random.PRNGKey(0)
  widths = size.widths
  params = {}
  for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
    params[f"w{i}"] = jax.random.normal(
      jax.random.fold_in(rng, i), (a, b), jnp.float32
    ) / np.sqrt(a)
    params[f"b{i}"] = jnp.zeros((b,), jnp.float32)
  x = jax.random.normal(jax.random.fold_in(rng, 100), (size.batch, widths[0]))
  y = jax.random.randint(
    jax.random.fold_in(rng, 101), (size.batch,), 0, widths[-1]
  )

  def loss_fn(params, batch):
    h, labels = batch
    for i in range(len(widths) - 1):
      h = h @ params[f"w{i}"] + params[f"b{i}"]
      if i < len(widths) - 2:
        h = jnp.tanh(h)
    kfac.register_softmax_cross_entropy_loss(h, labels)
    log_p = jax.nn.log_softmax(h)
    return -jnp.mean(jnp.take_along_axis(log_p, labels[:, None], 1))

  return loss_fn, params, (x, y)


def _kfac_steps(kfac, loss_fn, params, batch, **options) -> Callable:
  """`PERIOD` steps of the version's K-FAC optimizer (adaptive learning
  rate, momentum and damping; one inverse refresh) from `params`, carried
  on from call to call."""
  opt = kfac.Optimizer(
    jax.value_and_grad(loss_fn),
    l2_reg=0.0,
    use_adaptive_learning_rate=True,
    use_adaptive_momentum=True,
    use_adaptive_damping=True,
    initial_damping=1.0,
    num_burnin_steps=0,
    inverse_update_period=PERIOD,
    **options,
  )
  rng = jax.random.PRNGKey(0)
  carry = [params, opt.init(params, rng, batch), 0]

  def run():
    p, s, i = carry
    for _ in range(PERIOD):
      p, s, _ = opt.step(p, s, rng, batch=batch, global_step_int=i)
      i += 1
    carry[:] = [p, s, i]
    return p

  return run


def kfac_step(version: Version, size: Size) -> Callable:
  """`PERIOD` K-FAC steps on a tanh MLP (`_mlp`)."""
  return _kfac_steps(version.estimators, *_mlp(version.estimators, size))


def problem_kfac_step(name: str) -> Callable:
  """The benchmark `kfac_step_<name>`: `PERIOD` K-FAC steps on problem
  `name` at its defaults as the version builds it (its model, registered
  loss and first batch; float32), in the estimation mode of the harness's
  `curvature=kfac` (the record's `kfac_step/adam_step`)."""

  def benchmark(version: Version, size: Size) -> Callable:
    settings: dict[str, Any] = {"name": name}
    if size.problem_batch is not None:
      settings["batch_size"] = size.problem_batch
    problem = version.problems.make(settings)
    params = problem.init_params(jax.random.PRNGKey(0), np.float32)
    return _kfac_steps(
      version.estimators,
      problem.loss_fn,
      params,
      problem.fixed_batch(),
      estimation_mode="ggn_exact",
    )

  benchmark.__name__ = f"kfac_step_{name}"
  benchmark.__doc__ = f"K-FAC steps on the {name} problem."
  return benchmark


def _estimator(version: Version, size: Size, block_ctors: dict):
  """A block-diagonal estimator with `block_ctors` (names of the version's
  block classes by tag), fitted to one batch and refreshed."""
  kfac = version.estimators
  loss_fn, params, batch = _mlp(kfac, size)
  ctors = {tag: getattr(kfac, name) for tag, name in block_ctors.items()}
  est = kfac.BlockDiagonalCurvature(loss_fn, layer_tag_to_block_ctor=ctors)
  rng = jax.random.PRNGKey(1)
  args = (params, batch)
  update = jax.jit(
    lambda s: est.update_curvature_matrix_estimate(
      s,
      ema_old=0.0,
      ema_new=1.0,
      batch_size=size.batch,
      rng=rng,
      func_args=args,
    )
  )
  refresh = jax.jit(
    lambda s: est.update_cache(
      s,
      identity_weight=1e-3,
      exact_powers=None,
      approx_powers=-1,
      eigenvalues=False,
    )
  )
  state = refresh(update(est.init(rng, args, approx_powers_to_cache=-1)))
  return update, refresh, state


def kfac_update(version: Version, size: Size) -> Callable:
  """One batch of K-FAC statistics."""
  update, _, state = _estimator(version, size, {})
  return lambda: update(state)


def kfac_refresh(version: Version, size: Size) -> Callable:
  """K-FAC's inverse refresh (approximate inverses, damped)."""
  _, refresh, state = _estimator(version, size, {})
  return lambda: refresh(state)


def ekfac_update(version: Version, size: Size) -> Callable:
  """One batch of EKFAC statistics (scalings in the cached eigenbasis)."""
  update, _, state = _estimator(version, size, {"dense_tag": "DenseEKFAC"})
  return lambda: update(state)


def ekfac_refresh(version: Version, size: Size) -> Callable:
  """EKFAC's refresh: the eigenbases and the inverse scalings."""
  _, refresh, state = _estimator(version, size, {"dense_tag": "DenseEKFAC"})
  return lambda: refresh(state)


def dataset_gradient(version: Version, size: Size) -> Callable:
  """A convnet's mean gradient over `size.chunks` chunks of examples
  (8x8x2 inputs, two 3x3 convolutions) by the version's `Data.mean`."""
  rng = jax.random.PRNGKey(2)
  shapes = dict(k0=(3, 3, 2, 8), k1=(3, 3, 8, 16), w=(8 * 8 * 16, 10))
  params = {
    n: 0.1 * jax.random.normal(jax.random.fold_in(rng, i), s)
    for i, (n, s) in enumerate(shapes.items())
  }
  x = jax.random.normal(rng, (size.chunks, size.chunk, 8, 8, 2))
  y = jax.random.randint(rng, (size.chunks, size.chunk), 0, 10)

  def loss_fn(params, batch):
    h, labels = batch
    for k in ("k0", "k1"):
      h = jax.nn.relu(
        jax.lax.conv_general_dilated(
          h,
          params[k],
          (1, 1),
          "SAME",
          dimension_numbers=("NHWC", "HWIO", "NHWC"),
        )
      )
    log_p = jax.nn.log_softmax(h.reshape(h.shape[0], -1) @ params["w"])
    return -jnp.mean(jnp.take_along_axis(log_p, labels[:, None], 1))

  examples = version.data.Data((x, y))
  gradient = jax.jit(lambda p, d: d.mean(lambda b: jax.grad(loss_fn)(p, b)))
  return lambda: gradient(params, examples)


BENCHMARKS = {
  fn.__name__: fn
  for fn in (
    kfac_step,
    kfac_update,
    kfac_refresh,
    ekfac_update,
    ekfac_refresh,
    dataset_gradient,
    *map(problem_kfac_step, record.cpu_problems()),
  )
}


# --- timing --------------------------------------------------------------


def _leaves(result) -> np.ndarray:
  return np.concatenate(
    [np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(result)]
  )


def interleaved(
  new: Callable,
  old: Callable,
  rounds: int,
  warmup: int = 1,
  round_s: float = 0.0,
) -> dict:
  """Times two calls in alternating rounds (the order flipping every
  round). A round makes `calls` calls of one, each ended by
  `block_until_ready`, as many as take the slower of the two at least
  `round_s` seconds, so that short calls are not timed one by one.

  Returns:
    `new_s` and `old_s` (medians of the seconds per call), `ratio` (the
    median of the rounds' own ratios, new over old: each round's pair saw
    the same load), its quartiles `ratio_q25` and `ratio_q75`, `rounds`
    and `calls`.
  """

  def seconds(fn, calls):
    start = time.perf_counter()
    for _ in range(calls):
      jax.block_until_ready(fn())
    return (time.perf_counter() - start) / calls

  slower = max(seconds(new, 1), seconds(old, 1))
  calls = max(1, math.ceil(round_s / slower))
  times: dict[str, list[float]] = {"new": [], "old": []}
  for i in range(warmup + rounds):
    order = (("new", new), ("old", old))
    for which, fn in order if i % 2 == 0 else order[::-1]:
      t = seconds(fn, calls)
      if i >= warmup:
        times[which].append(t)
  ratios = np.divide(times["new"], times["old"])
  q25, median, q75 = np.quantile(ratios, [0.25, 0.5, 0.75])
  return dict(
    new_s=float(np.median(times["new"])),
    old_s=float(np.median(times["old"])),
    ratio=float(median),
    ratio_q25=float(q25),
    ratio_q75=float(q75),
    rounds=rounds,
    calls=calls,
  )


def compare(
  ref: str,
  mode: str = "full",
  rounds: int = 15,
  benchmarks: tuple[str, ...] = tuple(BENCHMARKS),
) -> pd.DataFrame:
  """The working tree against commit `ref`, one row per benchmark (see the
  module docstring). A benchmark the earlier commit cannot build (an API
  it lacks) gets a row saying why, without timings.

  Args:
    ref: a commit, tag or branch (e.g. `HEAD~1`).
    mode: 'full' or 'quick' (`SIZES`).
    rounds: timed rounds per benchmark.
    benchmarks: names from `BENCHMARKS`.
  """
  size = SIZES[mode]
  unknown = sorted(set(benchmarks) - set(BENCHMARKS))
  if unknown:
    raise ValueError(
      f"no side-by-side benchmark {', '.join(unknown)}; "
      f"choose from {', '.join(BENCHMARKS)}."
    )
  new = working_tree()
  rows = []
  with tempfile.TemporaryDirectory(prefix="curvbench-against-") as folder:
    old = load(ref, Path(folder))
    for name in benchmarks:
      row: dict[str, Any] = dict(
        benchmark=name,
        working_tree=new.name,
        ref=old.name,
        ref_source=old.estimators.__file__,
      )
      calls = {}
      for version in (new, old):
        try:
          calls[version.name] = BENCHMARKS[name](version, size)
          first = jax.block_until_ready(calls[version.name]())  # compiles
        except Exception as e:  # noqa: BLE001 - an old API: say which
          row.update(error=f"{version.name}: {type(e).__name__}: {e}")
          break
        row.setdefault("results", []).append(_leaves(first))
      if "error" not in row:
        a, b = row.pop("results")
        if a.shape != b.shape:  # e.g. a state that gained a field
          row["max_rel_diff"] = float("nan")
          row["note"] = (
            f"not compared: the versions return {a.size} and {b.size} values"
          )
        else:
          row["max_rel_diff"] = float(
            np.max(np.abs(a - b))
            / max(np.max(np.abs(b)), np.finfo(np.float32).tiny)
          )
        row.update(
          interleaved(
            calls[new.name], calls[old.name], rounds, round_s=size.round_s
          )
        )
      row.pop("results", None)
      rows.append(row)
  return pd.DataFrame(rows)
