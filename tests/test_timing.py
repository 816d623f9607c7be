"""Per-phase timing records: the phases each optimizer gets, the optimizer's
step timed over whole cycles and interleaved with Adam's, and the baseline's
settings taken from the adam config."""

import math

import jax
import numpy as np
import pandas as pd
import pytest

from curvbench import config, costs, curvatures, measurements, timing
from curvbench import training
from tests.conftest import TINY

STATS = ["compile_s", "median_s", "min_s", "q25_s", "q75_s"]


class Counted:
  """A trainer that logs its name at every step, and the memory of the
  programs it hands timing."""

  def __init__(self, trainer, name, log):
    self.trainer, self.name, self.log = trainer, name, log
    self.cycle = trainer.cycle
    self.program_bytes = None

  def compiled_programs(self, *args):
    programs = self.trainer.compiled_programs(*args)
    self.program_bytes = [costs.program_bytes(p) for p in programs]
    return programs

  def init(self, params, batch, rng):
    return self.trainer.init(params, batch, rng)

  def step(self, params, state, batch, rng):
    self.log.append(self.name)
    return self.trainer.step(params, state, batch, rng)


def check_memory(df):
  """Every phase has XLA's memory figure; the device peak where measured."""
  assert np.isfinite(df.program_bytes).all()
  assert (df.program_bytes > 0).all()
  source = costs.memory_source()
  assert (df.memory_source == source).all()
  if source == "xla_analysis":  # the CPU keeps no device statistics
    assert df.device_peak_bytes.isna().all()
  else:
    assert (df.device_peak_bytes >= df.program_bytes).all()
  # A gradient step takes the parameters and returns them.
  params_bytes = 235 * 8
  assert df.program_bytes["grad_step"] >= 2 * params_bytes


def run_timing(tiny, *overrides):
  problem, params, batch = tiny
  cfg = config.compose(*TINY, *overrides)
  curvature = curvatures.make(measurements.section(cfg.curvature),
                              problem.loss_fn)
  rows = timing.measure(
      problem.loss_fn, curvature, params, batch,
      measurements.section(cfg.measure.timing),
      measurements.section(cfg.optimizer),
      measurements.section(cfg.measure.timing.baseline),
      jax.random.PRNGKey(0))
  return pd.DataFrame(rows).set_index("phase")


def test_kfac_step_is_timed_over_whole_cycles_interleaved_with_adam(
    tiny, monkeypatch):
  log, compiled = [], []
  make = training.make_optimizer
  compile_steps = training.compile_steps

  trainers = {}

  def counted(loss_fn, cfg, curvature=None, mesh=None):
    trainers[cfg["name"]] = Counted(make(loss_fn, cfg, curvature, mesh),
                                    cfg["name"], log)
    return trainers[cfg["name"]]

  def recorded(*args):
    compiled.append(compile_steps(*args))
    return compiled[-1]

  monkeypatch.setattr(training, "make_optimizer", counted)
  monkeypatch.setattr(training, "compile_steps", recorded)
  df = run_timing(tiny, "measure.timing.warmup=1", "measure.timing.repeats=2",
                  "optimizer.inverse_update_period=3",
                  "optimizer.damping_adaptation_interval=5")

  assert list(df.index) == [*timing.PHASES, "adam_step"]
  assert (df[STATS] > 0).all().all() and (df.repeats == 2).all()
  assert df.ratio_to_grad_step["grad_step"] == 1.0
  assert df.ratio_to_adam_step["adam_step"] == 1.0
  assert (df.ratio_to_adam_step == df.median_s / df.median_s["adam_step"]).all()
  cycle = math.lcm(3, 5)
  assert list(df.steps_per_sample) == [1, 1, 1, 1, cycle, cycle]
  # Stepped phases: compile time from compile_steps, no clean first call.
  assert list(df.compile_s[["optimizer_step", "adam_step"]]) == compiled
  assert df.compile_s["optimizer_step"] > df.median_s["optimizer_step"]
  assert df.first_call_s[["optimizer_step", "adam_step"]].isna().all()
  assert (df.first_call_s.iloc[:4] > 0).all()
  # Set-up: compile_steps (cycle + 1 steps), then the first (burn-in) step,
  # for kfac and then adam (its own cycle is 1); then 1 + 2 repeats of one
  # whole cycle of each, in turn.
  setup = ["kfac"] * (cycle + 2) + ["adam"] * 3
  assert log[:len(setup)] == setup
  assert log[len(setup):] == (["kfac"] * cycle + ["adam"] * cycle) * 3
  # Memory: the optimizer's step is the largest of its four kinds of step
  # (refresh or not, damping adaptation or not), and holds the curvature.
  check_memory(df)
  kfac_bytes = trainers["kfac"].program_bytes
  assert len(kfac_bytes) == 4
  assert df.program_bytes["optimizer_step"] == max(kfac_bytes)
  assert df.program_bytes["adam_step"] == trainers["adam"].program_bytes[0]
  assert df.program_bytes["optimizer_step"] > df.program_bytes["adam_step"]


def test_first_order_optimizer_has_no_curvature_phases(tiny):
  df = run_timing(tiny, "optimizer=adam")
  assert list(df.index) == ["grad_step", "optimizer_step", "adam_step"]
  assert (df[STATS] > 0).all().all()
  assert df.ratio_to_adam_step["adam_step"] == 1.0
  assert (df.steps_per_sample == 1).all()
  check_memory(df)


def test_baseline_is_the_adam_config_whatever_the_optimizer():
  adam = config.compose("optimizer=adam").optimizer
  cfg = config.compose("measure=timing", "optimizer=sgd")
  assert cfg.optimizer.name == "sgd" and cfg.measure.timing.baseline == adam
  assert measurements.uses_optimizer(cfg)
  assert not measurements.uses_curvature(cfg)
  assert measurements.uses_curvature(config.compose("measure=timing"))
  tuned = config.compose("measure.timing.baseline.learning_rate=0.5")
  assert tuned.optimizer.name == "kfac"
  assert tuned.measure.timing.baseline.learning_rate == 0.5


def test_baseline_must_be_adam(tiny):
  with pytest.raises(ValueError, match="measure.timing.baseline is optimizer "
                     "'sgd'"):
    run_timing(tiny, "optimizer@measure.timing.baseline=sgd")
