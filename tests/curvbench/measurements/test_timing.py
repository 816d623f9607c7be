"""Per-phase timing records: the phases each optimizer gets, every phase
timed round by round beside the baseline step (the steps by whole
cycles), ratios paired within a round, the baseline an optimizer of the
registry, and the machine's load in every record."""

import math
import subprocess
import sys

import jax
import numpy as np
import pandas as pd
import pytest

from curvbench import config, report, runs
from curvbench.core import costs, stats, training
from curvbench.measurements.timing import clock, load
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
    self.programs = self.trainer.compiled_programs(*args)
    self.program_bytes = [costs.program_bytes(p) for p in self.programs]
    return self.programs

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
  tables = clock.measure(
    problem.loss_fn,
    run.curvature.make(problem.loss_fn),
    params,
    batch,
    run.measure.timing,
    run.optimizer,
    jax.random.PRNGKey(0),
  )
  return (
    pd.DataFrame(tables["timing"]).set_index("phase"),
    pd.DataFrame(tables["timing_samples"]),
  )


def test_every_phase_is_timed_round_by_round_beside_the_baseline(
  tiny, monkeypatch
):
  log, compiled = [], []
  compile_steps = training.compile_steps
  trainers = {}

  for name in ("kfac", "adam"):
    cls = OPTIMIZERS.get(name)

    def counted(settings, loss_fn, curvature=None, mesh=None, make=cls.make):
      trainers[settings.name] = Counted(
        make(settings, loss_fn, curvature, mesh), settings.name, log
      )
      return trainers[settings.name]

    monkeypatch.setattr(cls, "make", counted)

  def recorded(*args):
    compiled.append(compile_steps(*args))
    return compiled[-1]

  sample = clock.Call.sample

  def single(self):
    log.append("call")
    return sample(self)

  monkeypatch.setattr(training, "compile_steps", recorded)
  monkeypatch.setattr(clock.Call, "sample", single)
  df, samples = run_timing(
    tiny,
    "measure.timing.warmup=1",
    "measure.timing.repeats=2",
    "optimizer.inverse_update_period=3",
    "optimizer.damping_adaptation_interval=5",
  )

  assert list(df.index) == [*clock.PHASES, "baseline_step"]
  assert (df[STATS] > 0).all().all() and (df.repeats == 2).all()
  assert set(df.baseline) == {"adam"}
  cycle = math.lcm(3, 5)
  assert list(df.steps_per_sample) == [1, 1, 1, 1, cycle, cycle]
  # Stepped phases: compile time from compile_steps, no clean first call.
  assert list(df.compile_s[["optimizer_step", "baseline_step"]]) == compiled
  assert df.compile_s["optimizer_step"] > df.median_s["optimizer_step"]
  assert df.first_call_s[["optimizer_step", "baseline_step"]].isna().all()
  assert (df.first_call_s.iloc[:4] > 0).all()
  # Set-up: compile_steps (cycle + 1 steps), then the first (burn-in) step,
  # for kfac and then adam (its own cycle is 1); then 1 + 2 rounds, each
  # one call of every single-call phase and one whole cycle of each step.
  setup = ["kfac"] * (cycle + 2) + ["adam"] * 3
  assert log[: len(setup)] == setup
  assert (
    log[len(setup) :]
    == (["call"] * 4 + ["kfac"] * cycle + ["adam"] * cycle) * 3
  )
  # Every ratio is paired within its round: the median and quartiles of
  # the same per-round ratios, which the samples table holds.
  assert len(samples) == 2 * len(df)
  for phase, rows in samples.groupby("phase"):
    base = samples[samples.phase == "baseline_step"].seconds.to_numpy()
    ratios = rows.seconds.to_numpy() / base
    np.testing.assert_allclose(rows.ratio_to_baseline, ratios)
    median, q25, q75 = stats.quartiles(ratios)
    assert df.ratio_to_baseline[phase] == pytest.approx(median)
    assert (df.ratio_q25[phase], df.ratio_q75[phase]) == pytest.approx(
      (q25, q75)
    )
    assert q25 <= median <= q75
  assert (
    df.ratio_to_baseline["baseline_step"] == 1.0
    and df.ratio_to_grad_step["grad_step"] == 1.0
  )
  # The machine's load over the timed rounds, in every row.
  assert (df.load_window_s > 0).all() and (df.cpu_count >= 1).all()
  assert df.others_cpu_share.between(0, 1).all()
  assert (df.contended == (df.others_cpu_share > 0.1)).all()
  # Memory: the optimizer's step is the largest of its four kinds of step
  # (refresh or not, damping adaptation or not), and holds the curvature.
  check_memory(df)
  kfac_bytes = trainers["kfac"].program_bytes
  assert len(kfac_bytes) == cycle  # a program per step of the cycle,
  assert len({id(p) for p in trainers["kfac"].programs}) == 4  # 4 kinds
  assert df.program_bytes["optimizer_step"] == max(kfac_bytes)
  assert df.program_bytes["baseline_step"] == trainers["adam"].program_bytes[0]
  assert df.program_bytes["optimizer_step"] > df.program_bytes["baseline_step"]
  # XLA's flops: the step's the mean over its cycle's programs; every
  # ratio the phase's count over the baseline step's.
  assert (df.flops > 0).all()
  assert df.flops["optimizer_step"] == pytest.approx(
    np.mean([costs.flops(p) for p in trainers["kfac"].programs])
  )
  np.testing.assert_allclose(
    df.flop_ratio_to_baseline, df.flops / df.flops["baseline_step"]
  )
  assert df.flops["optimizer_step"] > df.flops["grad_step"]


def test_first_order_optimizer_has_no_curvature_phases(tiny):
  df, _ = run_timing(tiny, "optimizer=adam")
  assert list(df.index) == ["grad_step", "optimizer_step", "baseline_step"]
  assert (df[STATS] > 0).all().all()
  assert (df.steps_per_sample == 1).all()
  check_memory(df)


def test_the_baseline_is_any_first_order_optimizer_of_the_registry(tiny):
  cfg = config.compose("measure=timing", "optimizer=sgd")
  run = config.load(cfg)
  assert run.measure.timing.baseline == OPTIMIZERS.defaults("adam")
  assert run.measure.chosen.uses_optimizer(run)
  assert not run.measure.chosen.uses_curvature(run)
  tuned = config.load(
    config.compose("measure.timing.baseline.learning_rate=0.5")
  )
  assert tuned.optimizer.name == "kfac"
  assert tuned.measure.timing.baseline.learning_rate == 0.5
  sgd = config.load(
    config.compose(
      *TINY,
      "measure=timing",
      "measure/timing/baseline=sgd",
      "measure.timing.baseline.momentum=0.5",
    )
  )
  assert sgd.measure.timing.baseline == OPTIMIZERS.load(
    {"name": "sgd", "momentum": 0.5}
  )
  df, _ = run_timing(tiny, "optimizer=adam", "measure/timing/baseline=sgd")
  assert set(df.baseline) == {"sgd"}
  with pytest.raises(
    config.ConfigError,
    match="kfac uses a curvature; the baseline is a first-order optimizer",
  ):
    config.compose("measure/timing/baseline=kfac")
  with pytest.raises(config.ConfigError, match="did you mean learning_rate"):
    config.compose("measure.timing.baseline.learnig_rate=3")


# --- the machine's load -------------------------------------------------------


@pytest.fixture
def hog():
  """Two processes that keep a core busy each, for the test's length."""
  procs = [
    subprocess.Popen([sys.executable, "-c", "while True: pass"])
    for _ in range(2)
  ]
  try:
    yield
  finally:
    for proc in procs:
      proc.kill()
      proc.wait()


def test_load_counts_what_other_processes_use(hog):
  busy = load.sample(1.0)
  assert busy.others_share > 0.3  # two cores of whatever the machine has
  assert busy.seconds == pytest.approx(1.0, abs=0.5)
  with pytest.raises(
    load.MachineBusy,
    match=r"the machine is busy: other "
    r"processes used \d+ % of the \d+ CPUs .*"
    "when_busy=wait",
  ):
    load.settle("refuse", 0.1, 0.0)
  waited = load.settle("wait", 0.1, 0.5)  # gives up, then measures
  assert waited.others_share > 0.1
  assert load.settle("measure", 0.1, 0.0) is None  # the timing records it
  with load.Monitor(min_seconds=0.0) as own:
    sum(i * i for i in range(2 * 10**6))
  # CPU seconds the loop spent (its share of the cores falls on a busy
  # machine; its CPU time does not).
  assert own.load.process_cores * own.load.seconds > 0.05
  # A block far shorter than the kernel's 10 ms tick is read over a
  # stretched window, so the processes beside it still show.
  with load.Monitor(min_seconds=0.5) as short:
    pass
  assert short.load.seconds >= 0.5 and short.load.others_share > 0.3


@pytest.mark.slow
def test_a_timing_beside_a_cpu_hog_is_flagged_in_the_report(hog, tmp_path):
  """Timed while two other processes keep cores busy: the records carry
  the load, and the report flags the figures and says by how much."""
  cfg = config.compose(
    *TINY, "measure=timing", "measure.timing.repeats=4", "optimizer=adam"
  )
  assert runs.run(cfg, tmp_path / "busy") == "complete"
  written = report.write(tmp_path)
  rows = pd.read_csv(tmp_path / "report" / "timing_all.csv")
  assert rows.contended.all() and (rows.others_cpu_share > 0.1).all()
  text = (tmp_path / "report" / "report.md").read_text()
  assert "(1 runs x 4 rounds, contended in 1 of 1 runs)" in text
  assert (
    "1 of 1 timing runs ran while other processes used more of the "
    "CPUs than busy_share allows (up to"
  ) in text
  assert written["self_check"] == []
  refused = config.compose(
    *TINY, "measure=timing", "optimizer=adam", "measure.timing.when_busy=refuse"
  )
  with pytest.raises(load.MachineBusy, match="the machine is busy"):
    runs.run(refused, tmp_path / "refused")
