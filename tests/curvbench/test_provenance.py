"""Run identity: ids from the resolved config, provenance on every row,
resume only for the same config, code and data, seeds for init and data order."""

import logging
import time
from pathlib import Path

import jax
import numpy as np
import pandas as pd
import pytest

import problems
from curvbench import config, provenance, report, runs
from curvbench.core import records, training
from tests.conftest import TINY, TINY_PROBLEM

TRAIN = ("measure=training", "optimizer=adam", *TINY)


def test_run_id_follows_the_resolved_config():
  base = config.compose(*TRAIN)
  assert provenance.run_id(base) == provenance.run_id(config.compose(*TRAIN))
  for override in (
    "optimizer.learning_rate=0.5",
    "seed=1",
    "data_seed=3",
    "measure.training.eval_every=1",
    "problem.width=4",
  ):
    other = config.compose(*TRAIN, override)
    assert provenance.run_id(other) != provenance.run_id(base), override
  # Keys that do not change the results do not change the id.
  for override in (
    "name=elsewhere",
    "progress=true",
    "force=true",
    "continue_on_error=true",
  ):
    assert provenance.run_id(
      config.compose(*TRAIN, override)
    ) == provenance.run_id(base), override
  diff = provenance.differences(
    provenance.identity_config(base),
    provenance.identity_config(config.compose(*TRAIN, "seed=1")),
  )
  assert "seed: 0 -> 1" in diff and "init_seed: 0 -> 1" in diff


def test_every_row_carries_the_run_id_and_provenance(sweep):
  root, _ = sweep
  run = records.RunDir(root / "training_adam")
  cfg = config.compose(*TRAIN)
  table = run.tables()["training"]
  ids = set(table.run_id)
  assert ids == {provenance.run_id(cfg)}
  for column in (
    "init_seed",
    "data_seed",
    "precision",
    "device_kind",
    "num_devices",
    "devices_used",
    "platform_version",
    "versions",
    "commit",
    "dirty",
    "timestamp",
  ):
    assert table[column].notna().all(), column
  assert table.precision.iloc[0] == "float32"
  assert "jax=" + jax.__version__ in table.versions.iloc[0]
  joined = table.merge(run.tables()["config"], on="run_id")
  assert len(joined) == len(table)
  assert (
    joined["optimizer.learning_rate"] == cfg.optimizer.learning_rate
  ).all()
  assert run.marker()["run_id"] == provenance.run_id(cfg)


@pytest.mark.slow
def test_resume_reruns_when_the_config_or_code_changed(
  tmp_path, capsys, monkeypatch
):
  out = tmp_path / "run"
  cfg = config.compose(*TRAIN)
  assert runs.run(cfg, out) == "complete"
  assert runs.run(cfg, out) == "cached"
  # A setting that is not part of the directory name.
  changed = config.compose(*TRAIN, "measure.training.eval_every=1")
  assert runs.run(changed, out) == "complete"
  assert "measure.training.eval_every: 2 -> 1" in capsys.readouterr().out
  assert records.RunDir(out).tables()["training"].test_loss.notna().sum() == 5
  assert runs.run(changed, out) == "cached"
  # Other code.
  here = provenance.run_id(changed)
  version = dict(provenance.code_version(), code="elsewhere")
  monkeypatch.setattr(provenance, "code_version", lambda: version)
  assert provenance.run_id(changed) != here
  assert runs.run(changed, out) == "complete"
  assert "this is elsewhere" in capsys.readouterr().out
  monkeypatch.undo()
  assert runs.run(changed, out) == "complete"
  assert "it was measured with code elsewhere" in capsys.readouterr().out


def _mnist_file(folder: Path, seed: int) -> None:
  """A valid mnist.npz of 16 training and 8 test images."""
  rng = np.random.default_rng(seed)
  folder.mkdir(parents=True, exist_ok=True)
  np.savez(
    folder / "mnist.npz",
    x_train=rng.integers(0, 256, (16, 28, 28), np.uint8),
    y_train=rng.integers(0, 10, 16, np.uint8),
    x_test=rng.integers(0, 256, (8, 28, 28), np.uint8),
    y_test=rng.integers(0, 10, 8, np.uint8),
  )


def test_other_data_makes_another_run_and_the_report_keeps_them_apart(
  tmp_path, capsys
):
  """A data file replaced by another valid one is not taken for the one a
  run measured; runs of one config on two datasets are two rows."""

  def mnist(folder):
    return config.compose(
      "problem=mlp_mnist",
      f"problem.data.data_dir={folder}",
      "problem.width=3",
      "problem.depth=1",
      "problem.batch_size=4",
      "measure=training",
      "optimizer=adam",
      "measure.training.num_steps=2",
      "measure.training.eval_every=1",
      "progress=false",
    )

  _mnist_file(tmp_path / "data", seed=0)
  cfg, out = mnist(tmp_path / "data"), tmp_path / "sweep" / "first"
  assert runs.run(cfg, out) == "complete"
  assert runs.run(cfg, out) == "cached"
  before = provenance.run_id(cfg)
  _mnist_file(tmp_path / "data", seed=1)
  assert provenance.run_id(cfg) != before
  assert runs.run(cfg, out) == "complete"
  assert "it was measured with data MNIST:" in capsys.readouterr().out
  _mnist_file(tmp_path / "other", seed=2)
  assert (
    runs.run(mnist(tmp_path / "other"), tmp_path / "sweep" / "second")
    == "complete"
  )
  report.write(tmp_path / "sweep")
  summary = pd.read_csv(tmp_path / "sweep" / "report" / "training.csv")
  assert summary.label.nunique() == 2 and set(summary.n) == {1}
  assert all("dataset=MNIST:" in label for label in summary.label)
  text = (tmp_path / "sweep" / "report" / "report.md").read_text()
  assert "The mlp_mnist runs come from 2 datasets" in text


def test_data_seed_orders_batches_and_init_seed_initialises():
  problem = problems.make(config.compose(*TINY_PROBLEM).problem)
  first = lambda seed: next(problem.batches(seed=seed))[0]
  assert not np.array_equal(first(0), first(1))
  cfg = lambda *o: config.compose(*TRAIN, *o)
  assert cfg("seed=4").data_seed == 4 and cfg("seed=4").init_seed == 4
  assert cfg("data_seed=1").init_seed == 0


def test_seeds_in_the_records(tmp_path):
  """The data-order seed changes the batches (so the minibatch losses) but
  not the initialisation; the init seed changes the initial losses only."""

  def curve(name, *overrides):
    runs.run(config.compose(*TRAIN, *overrides), tmp_path / name)
    return records.RunDir(tmp_path / name).tables()["training"]

  base, data, init = (
    curve("base"),
    curve("data", "data_seed=1"),
    curve("init", "init_seed=1"),
  )
  at_init = lambda t: t[t.step == 0].train_loss.item()
  assert at_init(base) == at_init(data) != at_init(init)
  assert not np.allclose(base.batch_loss.dropna(), data.batch_loss.dropna())
  assert set(data.data_seed) == {1} and set(data.init_seed) == {0}


class SlowFirstCall:
  """A trainer whose first call of each kind of step takes 0.3 s, as a
  compilation would; its steps recur every 2 calls."""

  cycle = 2

  def __init__(self, inner):
    self.inner, self.seen = inner, set()

  def init(self, params, batch, rng):
    return self.inner.init(params, batch, rng), 0

  def step(self, params, state, batch, rng):
    inner, count = state
    if count % self.cycle not in self.seen:
      self.seen.add(count % self.cycle)
      time.sleep(0.3)
    params, inner, loss = self.inner.step(params, inner, batch, rng)
    return params, (inner, count + 1), loss


def _train(problem, opt, params, run, **kwargs):
  """`training.run` of `opt` with `run`'s training settings, seed 0."""
  return training.run(
    problem,
    opt,
    params,
    run.measure.training,
    jax.random.PRNGKey(0),
    0,
    progress=False,
    **kwargs,
  )


def test_first_logged_step_excludes_compile_time(tiny):
  problem, params, _ = tiny
  run = config.load(config.compose(*TRAIN, "measure.training.log_every=1"))
  opt = SlowFirstCall(run.optimizer.make(problem.loss_fn))
  rows = _train(problem, opt, params, run)
  df = pd.DataFrame(rows)
  assert (df.compile_s >= 0.6).all()  # both kinds of step, before the clock
  assert df.wall_s.iloc[-1] < 0.3 and df.wall_s.is_monotonic_increasing


def test_kfac_compiles_every_kind_of_step_before_the_clock(tiny):
  """K-FAC's step has kinds (burn-in, inverse refresh, damping adaptation);
  all are compiled within `compile_s`, none inside the timed steps."""
  problem, params, _ = tiny
  run = config.load(
    config.compose(*TRAIN, "optimizer=kfac", "measure.training.num_steps=12")
  )
  opt = run.optimizer.make(problem.loss_fn, run.curvature.make(problem.loss_fn))
  assert opt.cycle == 5
  compiled = []
  with jax.log_compiles():
    logger = logging.getLogger("jax")
    handler = _Collect(compiled)
    logger.addHandler(handler)
    try:
      rows = _train(
        problem,
        opt,
        params,
        run,
        at_steps=[0],
        on_step=lambda *_: compiled.append("clock started"),
      )
    finally:
      logger.removeHandler(handler)
  assert rows[-1]["step"] == 12 and rows[0]["compile_s"] > 0
  clock = compiled.index("clock started")
  before = [m for m in compiled[:clock] if m.startswith("Compiling")]
  after = [m for m in compiled[clock:] if m.startswith("Compiling")]
  assert len(before) >= 3  # burn-in, refresh step, plain step
  # Only the evaluation (off the clock) compiles once training has begun.
  assert all(m.startswith("Compiling jit(losses)") for m in after), after


class _Collect(logging.Handler):
  def __init__(self, out):
    super().__init__()
    self.out = out

  def emit(self, record):
    self.out.append(record.getMessage())


def test_a_diverging_run_is_recorded_as_diverged(tmp_path):
  out = tmp_path / "run"
  cfg = config.compose(
    "measure=training",
    "optimizer=sgd",
    *TINY,
    "optimizer.learning_rate=1e38",
    "measure.training.num_steps=20",
  )
  assert runs.run(cfg, out) == "diverged"
  marker = records.RunDir(out).marker()
  table = records.RunDir(out).tables()["training"]
  assert marker["status"] == "diverged"
  assert marker["step"] == table.step.max() < 20
  assert table.diverged.iloc[-1] and not table.diverged.iloc[:-1].any()
