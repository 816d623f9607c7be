"""The paper-size experiment: one setting sizes it; at its CPU size,
shortened to the GPT decoder (the ResNet's matrix-free programs take
minutes to compile on a CPU), every measurement runs: matrix-free quality
with its standard errors, K-FAC timed against Adam with XLA's flop ratio,
and K-FAC trained beside Adam."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from curvbench import config, records

CURVBENCH = Path(sys.executable).parent / "curvbench"


def test_one_setting_sizes_the_experiment():
  sizes = {}
  for size in ("accelerator", "cpu"):
    cfg = config.compose("+experiment=paper_scale", f"paper_scale={size}",
                         with_hydra=True, check=False)
    sizes[size] = {str(part["problem"]) for part in cfg.hydra.sweeper.sweeps}
    assert cfg.curvature.mode == cfg.canonical.mode == "fisher_gradients"
    assert cfg.measure.spectra.method == "lanczos"
  assert sizes["accelerator"] == {"resnet18", "gpt"}
  assert sizes["cpu"] == {"resnet18_tiny", "gpt", "resnet18_tiny,gpt"}


@pytest.mark.slow
def test_paper_scale_at_cpu_size_measures_the_gpt_every_way(tmp_path):
  sweep = tmp_path / "sweep"
  result = subprocess.run(
      [str(CURVBENCH), "-m", "+experiment=paper_scale", "paper_scale=cpu",
       f"hydra.sweep.dir={sweep}", "progress=false",
       f"compilation_cache={tmp_path / 'jax_cache'}", "seed=0",
       "problem=gpt", "curvature=kfac", "measure.spectra.lanczos_iters=8",
       "measure.spectra.top_k=4", "measure.spectra.trace_probes=4",
       "measure.spectra.diagonal_probes=4", "measure.spectra.slq_probes=2",
       "measure.timing.repeats=2", "measure.training.num_steps=4",
       "measure.training.eval_every=2"],
      capture_output=True, text=True, timeout=1800)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  tables = {}
  for run in records.find_runs(sweep):
    for name, table in run.tables().items():
      tables.setdefault(name, []).append(table)
  tables = {k: pd.concat(v, ignore_index=True) for k, v in tables.items()}
  problems = {"gpt"}
  quality = tables["quality"]
  assert set(quality.problem) == problems
  frobenius = quality[quality.metric == "relative_frobenius"]
  assert "ggn" in set(frobenius.reference)
  assert (np.isfinite(frobenius.stderr) & (frobenius.stderr > 0)).all()
  assert (frobenius.probes_needed >= 1).all()
  timing = tables["timing"]
  assert set(timing.problem) == problems
  steps = timing[timing.phase == "optimizer_step"]
  assert (steps.flop_ratio_to_baseline > 1).all()
  training = tables["training"]
  assert {(p, o) for p, o in zip(training.problem, training.optimizer)} == {
      (p, o) for p in problems for o in ("kfac", "adam")}
