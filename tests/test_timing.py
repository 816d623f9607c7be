"""Per-phase timing records: the phases each optimizer gets, the optimizer's
step timed over whole cycles and interleaved with Adam's, and the baseline's
settings taken from the adam config."""

import math

import jax
import numpy as np
import pandas as pd
import pytest

from curvbench import config, costs, timing, training
from curvbench.optimizers import OPTIMIZERS
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
  run = config.load(config.compose(*TINY, *overrides))
  rows = timing.measure(
      problem.loss_fn, run.curvature.make(problem.loss_fn), params, batch,
      config.plain(run.measure.timing), run.optimizer,
      run.measure.timing.baseline, jax.random.PRNGKey(0))
  return pd.DataFrame(rows).set_index("phase")


def test_kfac_step_is_timed_over_whole_cycles_interleaved_with_adam(
    tiny, monkeypatch):
  log, compiled = [], []
  compile_steps = training.compile_steps
  trainers = {}

  for name in ("kfac", "adam"):
    cls = OPTIMIZERS.get(name)

    def counted(settings, loss_fn, curvature=None, mesh=None, make=cls.make):
      trainers[settings.name] = Counted(
          make(settings, loss_fn, curvature, mesh), settings.name, log)
      return trainers[settings.name]

    monkeypatch.setattr(cls, "make", counted)

  def recorded(*args):
    compiled.append(compile_steps(*args))
    return compiled[-1]

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
  # The step's ratio to Adam has a spread over its paired repeats.
  q25, q75 = df.loc["optimizer_step", ["ratio_to_adam_q25",
                                       "ratio_to_adam_q75"]]
  assert 0 < q25 <= q75
  assert df.ratio_to_adam_q25.drop("optimizer_step").isna().all()
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
  run = config.load(cfg)
  assert run.measure.chosen.uses_optimizer(run)
  assert not run.measure.chosen.uses_curvature(run)
  kfac = config.load(config.compose("measure=timing"))
  assert kfac.measure.chosen.uses_curvature(kfac)
  tuned = config.compose("measure.timing.baseline.learning_rate=0.5")
  assert tuned.optimizer.name == "kfac"
  assert tuned.measure.timing.baseline.learning_rate == 0.5


def test_baseline_must_be_adam():
  for overrides, message in (
      (["+optimizer@measure.timing.baseline=sgd"], "SGD is not a subclass of "
       "Adam"),
      (["measure.timing.baseline.name=sgd"], "these are the settings of "
       "optimizer adam")):
    with pytest.raises(config.ConfigError, match=message):
      config.compose(*overrides)
