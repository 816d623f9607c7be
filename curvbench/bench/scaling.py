"""How cost grows with the model: time and memory of four kinds of work at
four sizes of each family, and the growth exponent in parameters.

The work, per size (float32, initial parameters, seed 0):

- `kfac_step`: a step of the K-FAC optimizer (`optimizer=kfac`, the
  curvature estimated in `fisher_gradients` mode, K-FAC as it trains at
  scale), averaged over its cycle, and `adam_step` timed beside it;
- `ggn_product`: one exact GGN-vector product over the training split
  (`curvatures.exact('ggn', matrix_free=True)`, chunked as `curvbench.core.data`
  chunks it);
- `lanczos_top20`: the 20 largest GGN eigenvalues over the split by
  Lanczos (`matrix_free.top_k_eigenpairs`, `LANCZOS_ITERS` products);
- `hutchinson_trace`: the GGN's trace over the split from
  `TRACE_PROBES` Rademacher probes (`matrix_free.hutchinson_trace`).

Each is compiled first (`compile_s`, apart), then timed `repeats` times
(the steps by whole cycles, K-FAC's and Adam's in turn). Memory is XLA's
figure for the compiled program (arguments + outputs + temporaries) and,
on devices that keep statistics, the device's peak after the size's work
(sizes run smallest first, so the peak is the size's own). The machine's
load while a size ran (`load.Monitor`) is in its rows. The exponent of
a kind of work is the slope of log seconds (or bytes) against log
parameters, fitted by least squares over the sizes, with its standard
error from the fit's residuals.

Families (`FAMILIES`): `resnet`, ResNet-18's shape (four stages of two
basic blocks, batch norm) at base widths w, 2w, 4w, 8w (w = 64 is
ResNet-18), on synthetic images of CIFAR-10's shape; `gpt`, the GPT-2-style
decoder (`problem=transformer`, pre-norm blocks with an MLP 4x wide) at
(blocks, width, heads) shapes of the GPT-2 family, on synthetic Markov
tokens of a 256-token vocabulary. Each has sizes for a CPU, an accelerator
and a quick test (`SCALES`).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import jax
import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

import problems
from curvbench import approximations, config, optimizers
from curvbench.core import costs, curvatures, data, environment, matrix_free
from curvbench.core.sections import to_markdown
from curvbench.measurements.timing import clock, load

LANCZOS_K = 20
LANCZOS_ITERS = 40
TRACE_PROBES = 10
BUSY_SHARE = 0.1  # others' CPU share above which a size counts as contended
WORK = (
  "kfac_step",
  "adam_step",
  "ggn_product",
  "lanczos_top20",
  "hutchinson_trace",
)


@dataclasses.dataclass(frozen=True)
class Family:
  """A family of models: the overrides every size shares, and each
  scale's sizes (overrides of one size each), smallest first."""

  name: str
  common: tuple[str, ...]
  sizes: dict[str, tuple[tuple[str, ...], ...]]


def _resnet(widths, examples, image):
  return tuple(
    (
      f"problem.widths=[{w},{2 * w},{4 * w},{8 * w}]",
      f"problem.data.num_train={examples}",
      f"problem.data.size={image}",
    )
    for w in widths
  )


def _gpt(shapes, examples, seq_len):
  return tuple(
    (
      f"problem.layers={layers}",
      f"problem.width={width}",
      f"problem.heads={heads}",
      f"problem.data.num_train={examples}",
      f"problem.data.seq_len={seq_len}",
    )
    for layers, width, heads in shapes
  )


FAMILIES = (
  Family(
    "resnet",
    (
      "problem=resnet",
      "problem/data=synthetic_images",
      "problem.blocks=2",
      "problem.norm=batch",
      "problem.batch_size=32",
      "problem.data.num_test=32",
    ),
    dict(
      quick=_resnet((1, 2, 3, 4), 32, 8),
      cpu=_resnet((2, 4, 8, 16), 256, 32),
      accelerator=_resnet((8, 16, 32, 64), 2048, 32),
    ),
  ),
  Family(
    "gpt",
    (
      "problem=transformer",
      "problem/data=markov_tokens",
      "problem.mlp_ratio=4",
      "problem.batch_size=16",
      "problem.data.num_test=16",
    ),
    dict(
      quick=_gpt(((1, 8, 2), (1, 16, 2), (2, 16, 2), (2, 32, 2)), 32, 16),
      cpu=_gpt(((2, 32, 2), (2, 64, 4), (4, 128, 4), (4, 256, 4)), 128, 64),
      accelerator=_gpt(
        ((4, 256, 4), (6, 384, 6), (8, 576, 9), (12, 768, 12)), 512, 256
      ),
    ),
  ),
)
SCALES = ("quick", "cpu", "accelerator")


def default_scale() -> str:
  """'cpu' where JAX runs on the CPU, else 'accelerator'."""
  return "cpu" if jax.default_backend() == "cpu" else "accelerator"


def _timed(program, args, repeats: int) -> list[float]:
  out = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(program(*args))
    out.append(time.perf_counter() - start)
  return out


def _row(work: str, compile_s: float, seconds, programs) -> dict:
  return dict(
    work=work,
    compile_s=compile_s,
    **clock.statistics(seconds),
    **costs.memory_columns(*programs),
  )


def _compiled_call(fn: Callable, args: tuple, repeats: int, work: str) -> dict:
  start = time.perf_counter()
  program = jax.jit(fn).lower(*args).compile()
  compile_s = time.perf_counter() - start
  jax.block_until_ready(program(*args))  # first call off the clock
  return _row(work, compile_s, _timed(program, args, repeats), [program])


def _steps(problem, overrides, params, batch, repeats: int) -> list[dict]:
  """K-FAC's and Adam's steps, timed by whole cycles in turn."""
  cfg = config.compose(
    *overrides,
    "curvature=kfac",
    "curvature.mode=fisher_gradients",
    "optimizer=kfac",
  )
  curvature = approximations.make(config.plain(cfg.curvature), problem.loss_fn)
  kfac = optimizers.make(
    config.plain(cfg.optimizer), problem.loss_fn, curvature
  )
  adam = optimizers.make(
    config.plain(config.compose(*overrides, "optimizer=adam").optimizer),
    problem.loss_fn,
  )
  rng = jax.random.PRNGKey(0)
  steppers = dict(
    kfac_step=clock.Stepper(kfac, params, batch, rng, kfac.cycle),
    adam_step=clock.Stepper(adam, params, batch, rng, kfac.cycle),
  )
  samples: dict[str, list[float]] = {name: [] for name in steppers}
  for _ in range(repeats):
    for name, stepper in steppers.items():
      samples[name].append(stepper.sample())
  return [
    _row(name, s.compile_s, samples[name], s.programs)
    for name, s in steppers.items()
  ]


def measure_size(overrides: tuple[str, ...], repeats: int) -> list[dict]:
  """The rows of every kind of work (`WORK`) for the problem of
  `overrides`, each with its `num_params`."""
  problem = problems.make(config.compose(*overrides).problem)
  params = problem.init_params(jax.random.PRNGKey(0), jnp.float32)
  batch = problem.fixed_batch(dtype=np.float32)
  examples = data.select(problem, "train", dtype=np.float32)
  ggn = curvatures.exact("ggn", problem.loss_fn, matrix_free=True)
  key = jax.random.PRNGKey(1)

  def matvec(v, p, d):
    return ggn.multiply(ggn.estimate(key, p, d), v)

  rows = _steps(problem, overrides, params, batch, repeats)
  rows.append(
    _compiled_call(matvec, (params, params, examples), repeats, "ggn_product")
  )
  # The long ones are timed fewer times: each is dozens of products.
  long = max(1, repeats // 3)
  rows.append(
    _compiled_call(
      lambda p, d, k: matrix_free.top_k_eigenpairs(
        matvec, p, LANCZOS_K, LANCZOS_ITERS, k, p, d
      )[0],
      (params, examples, key),
      long,
      "lanczos_top20",
    )
  )
  rows.append(
    _compiled_call(
      lambda p, d, k: matrix_free.hutchinson_trace(
        matvec, p, TRACE_PROBES, k, p, d
      ),
      (params, examples, key),
      long,
      "hutchinson_trace",
    )
  )
  peak = costs.device_peak_bytes()
  for row in rows:
    row.update(
      num_params=problem.num_params,
      num_examples=examples.num_examples,
      batch_size=problem.batch_size,
      size_peak_bytes=peak,
    )
  return rows


def exponent(num_params, values) -> tuple[float, float]:
  """The least-squares slope of log `values` against log `num_params` and
  its standard error (NaN with fewer than three sizes)."""
  x, y = (
    np.log(np.asarray(num_params, float)),
    np.log(np.asarray(values, float)),
  )
  ok = np.isfinite(y)
  x, y = x[ok], y[ok]
  if len(x) < 2 or np.ptp(x) == 0:
    return float("nan"), float("nan")
  slope, intercept = np.polyfit(x, y, 1)
  if len(x) < 3:
    return float(slope), float("nan")
  residual = y - (slope * x + intercept)
  se = np.sqrt(residual @ residual / (len(x) - 2) / np.sum((x - x.mean()) ** 2))
  return float(slope), float(se)


def exponents(rows: pd.DataFrame) -> pd.DataFrame:
  """Per family and kind of work: the time exponent (of the median
  seconds) and the memory exponent (of XLA's program bytes), each with its
  standard error, over the sizes measured."""
  out = []
  for (family, work), group in rows.groupby(["family", "work"], sort=False):
    group = group.sort_values("num_params")
    time_b, time_se = exponent(group.num_params, group.median_s)
    mem_b, mem_se = exponent(group.num_params, group.program_bytes)
    out.append(
      dict(
        family=family,
        work=work,
        sizes=len(group),
        min_params=int(group.num_params.min()),
        max_params=int(group.num_params.max()),
        time_exponent=time_b,
        time_exponent_se=time_se,
        memory_exponent=mem_b,
        memory_exponent_se=mem_se,
      )
    )
  return pd.DataFrame(out)


def run(
  scale: str | None = None,
  repeats: int = 5,
  families: tuple[str, ...] | None = None,
  log: Callable[[str], None] = print,
) -> pd.DataFrame:
  """Measures every size of every family (or of `families`) at `scale`
  (default: `default_scale()`); a row per family, size and kind of work.
  A size that fails (out of memory, say) is logged and left out, the
  others kept."""
  scale = scale or default_scale()
  if scale not in SCALES:
    raise ValueError(f"scale {scale!r}: choose one of {', '.join(SCALES)}.")
  known = [f.name for f in FAMILIES]
  unknown = sorted(set(families or ()) - set(known))
  if unknown:
    raise ValueError(
      f"no scaling family {', '.join(unknown)}; choose from {', '.join(known)}."
    )
  rows = []
  for family in FAMILIES:
    if families and family.name not in families:
      continue
    for i, size in enumerate(family.sizes[scale]):
      overrides = (*family.common, *size)
      start = time.perf_counter()
      try:
        with load.Monitor() as monitor:
          found = measure_size(overrides, repeats)
      except Exception as e:  # noqa: BLE001 - one size failing is a finding
        log(f"scaling {family.name} size {i}: {type(e).__name__}: {e}")
        continue
      rows += [
        dict(
          family=family.name,
          scale=scale,
          size=i,
          overrides=" ".join(size),
          **row,
          # (set on leaving the block)
          **cast(load.Load, monitor.load).columns(BUSY_SHARE),
        )
        for row in found
      ]
      log(
        f"scaling {family.name} size {i} ({found[0]['num_params']:,} "
        f"parameters): {time.perf_counter() - start:.0f} s"
      )
  return pd.DataFrame(rows)


def figure(rows: pd.DataFrame, path) -> None:
  """Log-log panels, one per family: seconds (left) and XLA's program
  memory (right) against parameters, a line per kind of work, with the
  fitted exponent in the legend."""
  families = list(dict.fromkeys(rows.family))
  fig, axes = plt.subplots(
    len(families), 2, squeeze=False, figsize=(10, 3.6 * len(families))
  )
  for (left, right), family in zip(axes, families):
    for work, group in rows[rows.family == family].groupby("work", sort=False):
      group = group.sort_values("num_params")
      b, se = exponent(group.num_params, group.median_s)
      left.errorbar(
        group.num_params,
        group.median_s,
        yerr=[group.median_s - group.q25_s, group.q75_s - group.median_s],
        marker="o",
        label=f"{work} (P^{b:.2f} ± {se:.2f})",
      )
      b, se = exponent(group.num_params, group.program_bytes)
      right.plot(
        group.num_params,
        group.program_bytes / 2**20,
        marker="o",
        label=f"{work} (P^{b:.2f} ± {se:.2f})",
      )
    for ax, what in (
      (left, "seconds (median, quartiles)"),
      (right, "XLA program memory (MiB)"),
    ):
      ax.set(
        xscale="log",
        yscale="log",
        xlabel="parameters",
        ylabel=what,
        title=f"{family}: {what.split(' (')[0]}",
      )
      ax.legend(fontsize=7)
      ax.grid(True, which="both", alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def write(
  out: Path,
  scale: str | None = None,
  repeats: int = 5,
  families: tuple[str, ...] | None = None,
) -> pd.DataFrame:
  """Runs `run` into the new folder `out`: `scaling.csv` (a row per family,
  size and kind of work), `exponents.csv`, the figure `scaling.png` and
  `summary.md` (both tables, the device and the code); returns the
  exponents.

  Raises:
    ValueError: when `out` holds files (nothing here writes over others').
  """
  out = Path(out)
  if out.exists() and any(out.iterdir()):
    raise ValueError(
      f"{out} holds files already: give a new or empty folder (--out)."
    )
  out.mkdir(parents=True, exist_ok=True)
  start = time.perf_counter()
  rows = run(scale, repeats, families)
  rows.to_csv(out / "scaling.csv", index=False)
  table = exponents(rows)
  table.to_csv(out / "exponents.csv", index=False)
  if not rows.empty:
    figure(rows, out / "scaling.png")
  env = environment.environment("auto", 1)
  code = env.get("code", {})
  lines = [
    f"# Cost against model size ({scale or default_scale()} sizes)",
    "",
    _machine(env, rows),
    f"- code: commit {code.get('commit')}"
    + (" with local changes" if code.get("dirty") else ""),
    f"- {time.perf_counter() - start:.0f} s; raw rows: `scaling.csv`; "
    "figure: `scaling.png` (log-log, seconds and XLA program memory "
    "against parameters, a line per kind of work)",
    "",
    "## Growth exponents (slope of log cost on log parameters, ± its "
    "standard error over the sizes)",
    "",
    to_markdown(table) if not table.empty else "(none)",
    "",
    "## Every size (median seconds and quartiles over the repeats; "
    "compile apart; memory: XLA's program figure, the device's peak "
    "where kept)",
    "",
    to_markdown(
      rows[
        [
          "family",
          "size",
          "num_params",
          "work",
          "median_s",
          "q25_s",
          "q75_s",
          "repeats",
          "compile_s",
          "program_bytes",
          "size_peak_bytes",
          "others_cpu_share",
          "contended",
        ]
      ]
    )
    if not rows.empty
    else "(none)",
    "",
  ]
  (out / "summary.md").write_text("\n".join(lines))
  print(f"scaling report: {out / 'summary.md'}")
  return table


def _machine(env: dict, rows: pd.DataFrame) -> str:
  """The device and the load the sizes ran under, as a summary line."""
  line = (
    f"- device: {env.get('device_kind')} ({env.get('platform')}), "
    f"{len(os.sched_getaffinity(0))} CPU cores usable"
  )
  if rows.empty:
    return line
  per_size = rows.groupby(["family", "size"]).first()
  return (
    f"{line}; other processes took up to "
    f"{100 * per_size.others_cpu_share.max():.0f} % of the CPUs while "
    f"a size ran ({int(per_size.contended.sum())} of {len(per_size)} "
    f"sizes contended: above {100 * BUSY_SHARE:.0f} %)"
  )


def by_family(table: pd.DataFrame) -> dict:
  """The record's form of `exponents`: `{family: {work: {'time', 'memory',
  'time_se', 'memory_se', 'params'}}}`."""
  out: dict[str, dict[str, dict]] = {}
  for row in table.itertuples():
    out.setdefault(row.family, {})[row.work] = dict(
      time=round(row.time_exponent, 3),
      time_se=round(row.time_exponent_se, 3),
      memory=round(row.memory_exponent, 3),
      memory_se=round(row.memory_exponent_se, 3),
      params=[row.min_params, row.max_params],
    )
  return out


__all__ = [
  "FAMILIES",
  "SCALES",
  "WORK",
  "by_family",
  "default_scale",
  "exponent",
  "exponents",
  "figure",
  "measure_size",
  "run",
  "write",
]
