"""The benchmark run: harness sweeps, the dataset products, one report.

`run(out, mode)` runs, in order:

1. a timing sweep (`curvbench -m measure=timing curvature=kfac
   optimizer=kfac problem=<every registered problem>`), a subprocess, in
   the estimation mode people train K-FAC in (the timing measurement's
   default) and, in the full run, in `ggn_exact` as well;
2. spectra runs of the MLP at its defaults (`problem=mlp measure=spectra
   measure.spectra.references=[ggn] seed=0,1,2`), a subprocess, for the
   seconds of its exact GGN and that matrix's eigendecomposition;
3. the dataset GGN-vector product per gradient of every problem
   (`curvbench.bench.products`), in this process once the sweeps are
   done (so no two processes hold the accelerator at once);
4. optionally the side-by-side check against an earlier commit
   (`curvbench.bench.against`).

Both sweeps run without JAX's compilation cache, so compile times are
cold, and with `continue_on_error`, so one failing problem leaves the
others' figures. The report folder holds `summary.md` (everything below,
as tables), CSVs of the same tables, `record.json` (the figures in the
record's format) and `runs/` (the harness's raw records). `mode='quick'`
runs the MLP only, with few repeats: the test `make test` runs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

from curvbench.bench import against, products, record
from curvbench.core import records
from curvbench.core.sections import to_markdown
from curvbench.measurements import MEASUREMENTS
from curvbench.measurements.timing import clock

SPECTRA_PROBLEM = "mlp"  # the README's MLP, at the config's defaults


@dataclasses.dataclass(frozen=True)
class Plan:
  """What one mode runs: the problems, the timing sweep's repeats, the
  estimation modes it times K-FAC in besides the default one, the
  spectra runs' seeds and samples (each sample times the exact GGN's
  phases once), the product rounds and the side-by-side rounds."""

  problems: tuple[str, ...]
  timing: tuple[str, ...]
  other_modes: tuple[str, ...]
  spectra: tuple[str, ...]
  product_rounds: int
  against_rounds: int


def plans() -> dict[str, Plan]:
  """The two modes of `run` by name: `full` (every CPU problem, 30
  timing repeats, three spectra seeds) and `quick` (the MLP, a few
  repeats, one seed and sample: the test's mode)."""
  return dict(
    full=Plan(
      record.cpu_problems(),
      ("measure.timing.repeats=30", "measure.timing.warmup=2"),
      ("ggn_exact",),
      ("seed=0,1,2",),
      product_rounds=10,
      against_rounds=15,
    ),
    quick=Plan(
      (SPECTRA_PROBLEM,),
      ("measure.timing.repeats=3", "measure.timing.warmup=1"),
      (),
      ("seed=0", "measure.spectra.samples=1"),
      product_rounds=3,
      against_rounds=3,
    ),
  )


COMMON = (
  "compilation_cache=null",
  "progress=false",
  "continue_on_error=true",
  "force=true",
)


def _sweep(folder: Path, overrides: list[str], log: Path) -> int:
  """`curvbench -m` with `overrides` into `folder`, its output in `log`;
  returns its exit status."""
  cmd = [
    sys.executable,
    "-m",
    "curvbench",
    "-m",
    f"hydra.sweep.dir={folder}",
    *COMMON,
    *overrides,
  ]
  with open(log, "w") as out:
    out.write(shlex.join(cmd) + "\n")
    out.flush()
    return subprocess.run(
      cmd, cwd=record.ROOT, stdout=out, stderr=subprocess.STDOUT
    ).returncode


def _tables(folder: Path, name: str) -> pd.DataFrame:
  frames = [
    run.tables()[name]
    for run in records.find_runs(folder)
    if name in run.table_names()
  ]
  return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _failures(folder: Path) -> list[str]:
  out = []
  for path in sorted(folder.rglob("ERROR.json")):
    last = json.loads(path.read_text()).get("traceback", "").strip()
    out.append(
      f"{path.parent.relative_to(folder.parent)}: "
      f"{last.splitlines()[-1] if last else 'failed'}"
    )
  return out


def _environment(folder: Path) -> dict:
  """The device, versions and code of the sweeps' runs
  (`environment.json`), with the cores this process may use."""
  found = sorted((folder / "timing").rglob("environment.json")) or sorted(
    folder.rglob("environment.json")
  )
  env = json.loads(found[0].read_text()) if found else {}
  env.pop("argv", None)
  return dict(env, cpu_count=len(os.sched_getaffinity(0)))


def _mib(values: pd.Series) -> pd.Series:
  return values / 2**20


def _phases(timing: pd.DataFrame) -> pd.DataFrame:
  if timing.empty:
    return timing
  return pd.DataFrame(
    dict(
      problem=timing.problem,
      mode=timing["mode"],
      num_params=timing.num_params,
      batch_size=timing.batch_size,
      phase=timing.phase,
      run_ms=1e3 * timing.median_s,
      compile_s=timing.compile_s,
      per_grad_step=timing.ratio_to_grad_step,
      per_adam_step=timing.ratio_to_baseline,
      program_mib=_mib(timing.program_bytes),
      device_peak_mib=_mib(timing.device_peak_bytes),
    )
  )


def _beyond_flops(rows: pd.DataFrame, step) -> str:
  """Where the K-FAC step costs more time than arithmetic (its time ratio
  to Adam's above its flop ratio): the curvature phase whose time ratio
  exceeds its own flop ratio the most, with both; '' where it does not."""
  flops = step.get("flop_ratio_to_baseline", math.nan)
  if math.isnan(flops) or step.ratio_to_baseline <= flops:
    return ""
  phases = rows[rows.phase.isin(clock.CURVATURE_PHASES)].dropna(
    subset=["flop_ratio_to_baseline"]
  )
  if phases.empty:
    return "no curvature phase timed"
  excess = phases.ratio_to_baseline / phases.flop_ratio_to_baseline
  worst = phases.loc[excess.idxmax()]
  return (
    f"{worst.phase}: {worst.ratio_to_baseline:.3g}x Adam's time, "
    f"{worst.flop_ratio_to_baseline:.3g}x its flops"
  )


def _steps(timing: pd.DataFrame) -> pd.DataFrame:
  """A row per problem and estimation mode: K-FAC's step against Adam's,
  in time and in XLA flops, and the phase that takes more time than its
  arithmetic explains where the step does."""
  if timing.empty:
    return timing
  out = []
  for (problem, mode), rows in timing.groupby(
    ["problem", "mode"], sort=True, dropna=False
  ):
    steps = rows[rows.phase == "optimizer_step"]
    adam = rows[rows.phase == "baseline_step"]
    if steps.empty or adam.empty:
      continue
    step, base = steps.iloc[0], adam.iloc[0]
    out.append(
      dict(
        problem=problem,
        mode=mode,
        kfac_step_ms=1e3 * step.median_s,
        adam_step_ms=1e3 * base.median_s,
        ratio=step.ratio_to_baseline,
        q25=step.ratio_q25,
        q75=step.ratio_q75,
        flop_ratio=step.get("flop_ratio_to_baseline", math.nan),
        beyond_flops=_beyond_flops(rows, step),
        kfac_compile_s=step.compile_s,
        adam_compile_s=base.compile_s,
        repeats=step.repeats,
        others_cpu_share=step.get("others_cpu_share", math.nan),
      )
    )
  return pd.DataFrame(out)


def _spectrum(cost: pd.DataFrame) -> pd.DataFrame:
  if cost.empty:
    return cost
  rows = cost[cost.phase.isin(["exact ggn", "eigh exact ggn"])]
  return pd.DataFrame(
    dict(
      problem=rows.problem,
      num_params=rows.num_params,
      batch_size=rows.batch_size,
      precision=rows.precision,
      phase=rows.phase,
      run_s=rows.run_s,
      compile_s=rows.compile_s,
      program_mib=_mib(rows.program_bytes),
      device_peak_mib=_mib(rows.device_peak_bytes),
    )
  )


def _products(rows: pd.DataFrame) -> pd.DataFrame:
  if rows.empty:
    return rows
  return pd.DataFrame(
    dict(
      problem=rows.problem,
      num_params=rows.num_params,
      num_examples=rows.num_examples,
      chunk_size=rows.chunk_size,
      phase=rows.phase,
      run_ms=1e3 * rows.median_s,
      compile_s=rows.compile_s,
      per_gradient=rows.ratio_to_gradient,
      q25=rows.get("ratio_q25"),
      q75=rows.get("ratio_q75"),
      rounds=rows.repeats,
      program_mib=_mib(rows.program_bytes),
      device_peak_mib=_mib(rows.device_peak_bytes),
    )
  )


def _figures_table(figures: dict) -> pd.DataFrame:
  return pd.DataFrame(
    [
      dict(figure=f, problem=p, value=v)
      for f, values in figures.items()
      for p, v in values.items()
    ]
  )


def run(
  out: Path, mode: str = "full", ref: str | None = None, command: str = ""
) -> dict:
  """Runs the benchmark into the new folder `out`; returns the record
  (`record.json`'s content).

  Args:
    out: a folder that does not exist yet, or is empty.
    mode: 'full' or 'quick' (`plans()`).
    ref: an earlier commit to time side by side with the working tree.
    command: the command line, kept in the record.

  Raises:
    ValueError: when `out` holds files, or `mode` is unknown.
  """
  if mode not in plans():
    raise ValueError(f"mode {mode!r}: choose one of {', '.join(plans())}.")
  plan = plans()[mode]
  if ref is not None:
    against.resolve(ref)  # refused now, not after the sweeps
  out = Path(out).resolve()
  if out.exists() and any(out.iterdir()):
    raise ValueError(
      f"{out} holds files already: give a new or empty folder "
      "(--out), the report never writes over others' files."
    )
  runs = out / "runs"
  runs.mkdir(parents=True)
  start = time.perf_counter()
  say = lambda text: print(
    f"[{time.perf_counter() - start:6.0f} s] {text}", flush=True
  )
  sweeps = dict(
    timing=[
      "measure=timing",
      "curvature=kfac",
      "optimizer=kfac",
      f"problem={','.join(plan.problems)}",
      "curvature.mode=" + ",".join(("null", *plan.other_modes)),
      *plan.timing,
    ],
    spectra=[
      f"problem={SPECTRA_PROBLEM}",
      "measure=spectra",
      "curvature=kfac",
      "measure.spectra.references=[ggn]",
      *plan.spectra,
    ],
  )
  failures = []
  for name, overrides in sweeps.items():
    say(f"{name} sweep: {' '.join(overrides)} (log: runs/{name}.log)")
    status = _sweep(runs / name, overrides, runs / f"{name}.log")
    if status != 0:
      failures.append(
        f"the {name} sweep exited with status {status}: see runs/{name}.log"
      )
  failures += _failures(runs)
  product_rows = []
  for name in plan.problems:
    say(f"dataset GGN-vector product / gradient: {name}")
    try:
      product_rows += products.measure(name, rounds=plan.product_rounds)
    except Exception as e:  # noqa: BLE001 - one problem failing is a finding
      failures.append(f"dataset products of {name}: {type(e).__name__}: {e}")
  side = None
  if ref is not None:
    say(f"side by side: the working tree against {ref}")
    side = against.compare(ref, mode, plan.against_rounds)

  timing = _tables(runs / "timing", "timing")
  cost = _tables(runs / "spectra", "cost")
  product_table = pd.DataFrame(product_rows)
  product_table.to_csv(runs / "products.csv", index=False)
  estimation_mode = MEASUREMENTS.get("timing").default_mode
  figures = record.figures(timing, cost, product_table, estimation_mode)
  env = _environment(runs)
  code = env.get("code", {})
  rec = dict(
    key=record.device_key(
      env.get("device_kind", "unknown"),
      env.get("platform", "unknown"),
      env["cpu_count"],
    ),
    device_kind=env.get("device_kind"),
    platform=env.get("platform"),
    platform_version=env.get("platform_version"),
    cpu_count=env["cpu_count"],
    host=env.get("host"),
    python=env.get("python"),
    versions=env.get("versions", {}),
    commit=code.get("commit"),
    dirty=code.get("dirty"),
    mode=mode,
    estimation_mode=estimation_mode,
    date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    command=command,
    wall_s=round(time.perf_counter() - start, 1),
    figures=figures,
  )
  if side is not None and "ratio" in side:
    ok = side.dropna(subset=["ratio"])
    rec["side_by_side"] = dict(
      ref=ref,
      ref_name=str(side.ref.iloc[0]),
      ratios=dict(zip(ok.benchmark, ok.ratio)),
    )
  tables = dict(
    figures=_figures_table(figures),
    steps=_steps(timing),
    phases=_phases(timing),
    spectrum=_spectrum(cost),
    products=_products(product_table),
  )
  if side is not None:
    tables["side_by_side"] = side.drop(columns="ref_source")
  _write(out, rec, tables, failures)
  say(f"report: {out / 'summary.md'}")
  return rec


TITLES = dict(
  figures="Figures (the performance record's; lower is better)",
  steps="K-FAC step / Adam step per estimation mode (interleaved, same "
  "parameters and batch; flop_ratio: the same in XLA's operation counts; "
  "beyond_flops: where the time ratio exceeds the flop ratio, the "
  "curvature phase that exceeds its own flop ratio the most; "
  "others_cpu_share: other processes' share of the CPUs while timed)",
  phases="Per-phase costs (median run, cold compile; memory: XLA's "
  "program figure and the device's peak since the run started, "
  "NaN on the CPU)",
  spectrum=f"Exact GGN spectrum of the {SPECTRA_PROBLEM} (one batch; "
  "a row per phase and run)",
  products="Dataset GGN-vector product / gradient over the training split",
  side_by_side="Side by side with an earlier commit (ratio > 1: the "
  "working tree is slower)",
)


def _write(out: Path, rec: dict, tables: dict, failures: list[str]) -> None:
  (out / "record.json").write_text(
    json.dumps(rec, indent=2, sort_keys=True) + "\n"
  )
  lines = [
    f"# Benchmark: {rec['device_kind']} ({rec['key']})",
    "",
    f"- device: {rec['device_kind']}, platform {rec['platform']} "
    f"({rec['platform_version']}), {rec['cpu_count']} CPU cores "
    f"usable, host {rec['host']}",
    f"- versions: python {rec['python']}, "
    + ", ".join(f"{k} {v}" for k, v in sorted(rec["versions"].items())),
    f"- code: commit {rec['commit']}"
    + (" with local changes" if rec["dirty"] else ""),
    f"- command: `{rec['command']}` ({rec['mode']} mode), "
    f"{rec['date']}, {rec['wall_s']} s",
    f"- K-FAC timed in estimation mode {rec['estimation_mode']} (plain "
    "figures: the mode people train in, KFAC-JAX 0.0.8's optimizer's); "
    "figures FIGURE@MODE time it in another mode",
    "- raw records: `runs/` (the harness's sweeps and "
    "`runs/products.csv`); the tables below as CSVs beside this file",
    "",
  ]
  if failures:
    lines += ["## Failed", "", *(f"- {f}" for f in failures), ""]
  for name, table in tables.items():
    table.to_csv(out / f"{name}.csv", index=False)
    lines += [
      f"## {TITLES[name]}",
      "",
      to_markdown(table) if not table.empty else "(none)",
      "",
    ]
  (out / "summary.md").write_text("\n".join(lines))
