"""K-FAC trains at its defaults on every CPU-sized problem and example
model, and a diverged run says what to change, from its own records."""

import dataclasses

import jax
import numpy as np
import pandas as pd
import pytest

import curvbench
import problems
from curvbench import config
from curvbench.measurements.training import divergence
from curvbench.optimizers.kfac import KFAC
from tests.conftest import ROOT, TINY

EXAMPLES = ROOT / "examples"
MODE = "curvature.mode=ggn_curvature_prop"  # KFAC-JAX 0.0.8's default
# The built-in problems a CPU trains in seconds, and the steps each gets;
# the sweep behind the defaults ran five seeds of 300 (100 for resnet and
# transformer), the test one seed of fewer to stay within minutes.
CPU_PROBLEMS = {
  "mlp": 150,
  "autoencoder": 150,
  "convnet": 150,
  "convnet_norm": 150,
  "resnet_small_groupnorm": 30,
  "transformer_small": 30,
}
EXAMPLE_MODELS = {
  "haiku_mlp": "haiku_model.py",
  "nnx_mlp": "flax_nnx_model.py",
  "equinox_mlp": "equinox_model.py",
}


def _train(tmp_path, problem, steps, *settings, plugins=()):
  return curvbench.measure(
    problem,
    measurements=["training"],
    optimizers=["kfac"],
    out=tmp_path / problem,
    settings=[
      MODE,
      f"measure.training.num_steps={steps}",
      "measure.training.eval_every=50",
      "progress=false",
      *settings,
    ],
    plugins=list(plugins),
  )


@pytest.mark.slow
@pytest.mark.parametrize("problem", [*CPU_PROBLEMS, *EXAMPLE_MODELS], ids=str)
def test_kfac_trains_at_its_defaults(problem, tmp_path):
  plugins = (
    [str(EXAMPLES / EXAMPLE_MODELS[problem])]
    if problem in EXAMPLE_MODELS
    else []
  )
  steps = CPU_PROBLEMS.get(problem, 150)
  results = _train(tmp_path, problem, steps, plugins=plugins)
  assert list(results.runs.status) == ["complete"], list(results.runs.reason)
  rows = results.tables["training"]
  losses = rows.dropna(subset=["train_loss"]).sort_values("step").train_loss
  assert np.isfinite(losses).all()
  assert losses.iloc[-1] < losses.iloc[0], problem
  # The damping stays within its bounds along the run.
  damping = rows.damping.dropna()
  assert damping.between(KFAC().min_damping, KFAC().max_damping).all()


def test_a_diverged_run_names_the_setting_from_its_records(tmp_path):
  """A learning rate of 1e38 with the adaptive rules off overflows at
  once: the reason names step.learning_rate, with the values recorded."""
  results = _train(
    tmp_path,
    "mlp",
    10,
    "optimizer.use_adaptive_learning_rate=false",
    "optimizer.use_adaptive_momentum=false",
    "optimizer.use_adaptive_damping=false",
    "optimizer.step.learning_rate=1e38",
    "optimizer.step.damping=0.3",
    "optimizer.include_norms_in_stats=true",  # the step's own update norm
  )
  run = results.runs.iloc[0]
  assert run.status == "diverged"
  rows = results.tables["training"]
  recorded = rows.dropna(subset=["damping"])
  assert set(recorded.damping) == {float(np.float32(0.3))}
  assert set(recorded.learning_rate) == {float(np.float32(1e38))}
  assert "optimizer.step.learning_rate (now 1e+38" in run.reason
  assert "the damping stayed at 0.3" in run.reason
  assert "optimizer.norm_constraint" in run.reason
  assert "min_damping" not in run.reason  # the damping is not adapted
  first = int(recorded.step[~np.isfinite(recorded.update_norm)].min())
  assert f"the update norm was not finite from step {first}" in run.reason


# The floor of the synthetic runs below, which fall to it.
LOW_FLOOR = KFAC(min_damping=1e-8)


def _fallen_rows():
  """A run whose damping halves every 5 steps down to 1e-8 while the
  update norm grows from 0.5 to 20 (40x) at step 120, then overflows."""
  steps = np.arange(0, 131)
  damping = np.maximum(0.1 * 0.5 ** (steps // 5), 1e-8)
  norm = np.where(steps < 100, 0.5, 0.5 * 40 ** ((steps - 100) / 20))
  rows = pd.DataFrame(
    dict(
      step=steps,
      damping=damping,
      learning_rate=0.2,
      update_norm=np.minimum(norm, 20.0),
      diverged=steps == 130,
    )
  )
  rows.loc[0, ["damping", "learning_rate", "update_norm"]] = np.nan
  rows.loc[130, "update_norm"] = np.inf
  return rows


def test_the_advice_follows_the_damping_and_the_update_norm():
  rows = _fallen_rows()
  adaptive = LOW_FLOOR.divergence_knobs()
  reason = divergence.diagnose(rows, adaptive)
  assert reason.startswith("non-finite loss at step 130")
  assert "the damping fell from 0.1 to 1e-08 at step" in reason
  assert "the update norm grew 40x (from 0.5" in reason
  assert "to 20 at step 120" in reason
  # The suggested floor is the damping held when the norm began to grow
  # (more than 3x its start; at least 100x the lowest), rounded up to a
  # power of ten.
  grew = int(rows.step[rows.update_norm > 1.5].min())
  held = rows.damping[rows.step == grew].iloc[0]
  wanted = 10 ** np.ceil(np.log10(max(held, 100 * 1e-8)))
  floor = LOW_FLOOR.min_damping
  assert (
    f"raise optimizer.min_damping (now {floor:.3g}; e.g. to {wanted:.3g}"
    in (reason)
  )
  # The adaptive learning rate refuses a norm constraint: not offered.
  assert "norm_constraint" not in reason
  fixed = dataclasses.replace(LOW_FLOOR, use_adaptive_learning_rate=False)
  fixed = fixed.divergence_knobs()
  assert "set optimizer.norm_constraint" in divergence.diagnose(rows, fixed)


def test_without_update_norms_the_advice_says_how_to_record_them():
  rows = _fallen_rows().drop(columns="update_norm")
  reason = divergence.diagnose(rows, LOW_FLOOR.divergence_knobs())
  assert "the damping fell from 0.1 to 1e-08" in reason
  assert "optimizer.include_norms_in_stats=true records them" in reason
  assert "e.g. to 1e-06, 100x the lowest damping it reached" in reason


def test_an_optimizer_without_a_trace_gets_the_bare_step():
  rows = [dict(step=s, diverged=s == 3) for s in range(4)]
  assert divergence.diagnose(rows, {}) == "non-finite loss at step 3."


def test_only_a_traced_run_keeps_its_step_statistics():
  """Timing steps keep nothing; training asks (`start_trace`) and gets
  each update's damping, learning rate, momentum and reduction ratio."""
  run = config.load(config.compose("optimizer=kfac", *TINY))
  problem = problems.make(run.problem)
  trainer = run.optimizer.make(
    problem.loss_fn, run.curvature.make(problem.loss_fn)
  )
  rng = jax.random.PRNGKey(0)
  params = problem.init_params(rng)
  batch = next(problem.batches(seed=0))

  def steps(n):
    state = trainer.init(params, batch, rng)
    p = params
    for _ in range(n):
      p, state, _ = trainer.step(p, state, batch, rng)

  steps(2)
  assert trainer.trace() == {}
  trainer.start_trace()
  steps(3)
  trace = trainer.trace()
  assert sorted(trace) == [1, 2, 3]
  adapted = ("damping", "learning_rate", "momentum")
  assert np.isfinite([trace[3][k] for k in adapted]).all()
