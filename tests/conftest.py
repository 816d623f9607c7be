"""Test setup: two host CPU devices (for pmap tests) and float64 ground truth."""

import os
import subprocess
import sys
from pathlib import Path

# Must happen before JAX initialises its backends.
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_enable_x64", True)

# Elapsed time and the time left, at every tenth of the tests.
pytest_plugins = ["tests.time_left"]

# The repository's root, wherever in tests/ a test file lies.
ROOT = Path(__file__).resolve().parents[1]


# --- the harness's tiny problem ----------------------------------------------

import jax.flatten_util  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import problems  # noqa: E402
from curvbench import config, runs  # noqa: E402
from curvbench.core import records  # noqa: E402
from tests.browser import chromium_page  # noqa: E402, F401 (a fixture)

TINY_PROBLEM = ("problem.width=3", "problem.depth=1", "problem.batch_size=8")


@pytest.fixture(scope="session")
def tiny():
  """A 235-parameter MLP from the mlp config, its float64 params and batch."""
  problem = problems.make(config.compose(*TINY_PROBLEM).problem)
  params = problem.init_params(jax.random.PRNGKey(0), jnp.float64)
  return problem, params, problem.fixed_batch(dtype=np.float64)


@pytest.fixture(scope="session")
def tiny_ggn(tiny):
  """The tiny problem's GGN, mean_i J_iᵀ (diag(p_i) - p_i p_iᵀ) J_i, from
  jax.jacobian in float64."""
  problem, params, (x, _) = tiny
  flat, unravel = jax.flatten_util.ravel_pytree(params)
  logits_fn = lambda w: problem.net.apply(unravel(w), x)
  jac = jax.jacobian(logits_fn)(flat)  # (n, C, P)
  prob = jax.nn.softmax(logits_fn(flat))
  hess = jax.vmap(lambda q: jnp.diag(q) - jnp.outer(q, q))(prob)
  return np.asarray(jnp.einsum("ncp,ncd,ndq->pq", jac, hess, jac) / len(x))


TINY = (
  *TINY_PROBLEM,
  "measure.spectra.references=[ggn]",
  "measure.spectra.samples=1",
  "measure.timing.repeats=2",
  "measure.timing.warmup=0",
  "measure.training.num_steps=4",
  "measure.training.eval_every=2",
  "measure.training.eval_size=50",
  "progress=false",
)
# TINY's run settings without its problem's, for models of the tests' own.
SHORT = tuple(s for s in TINY if not s.startswith("problem."))


def two_layer_init(rng, x, outputs=2):
  """A tanh layer of 6 units, then `outputs` logits: a user model's
  parameters for the tests of the Python API."""
  one, two = jax.random.split(rng)
  return dict(
    w1=jax.random.normal(one, (x.shape[1], 6)) / 2,
    b1=jnp.zeros(6),
    w2=jax.random.normal(two, (6, outputs)) / 2,
    b2=jnp.zeros(outputs),
  )


SWEEP = {
  "spectra_kfac": ["measure=spectra", "curvature=kfac"],
  "spectra_diag": [
    "measure=spectra",
    "curvature=diagonal",
    "curvature.mode=fisher_empirical",
  ],
  "timing_kfac": ["measure=timing", "curvature=kfac"],
  "training_kfac": ["measure=training", "curvature=kfac"],
  "training_adam": ["measure=training", "optimizer=adam"],
  "training_exact": [
    "measure=training",
    "optimizer=preconditioned_sgd",
    "curvature=explicit_exact",
    "curvature.mode=ggn_exact",  # exact, not the practical default
  ],
  "spectra_adam": ["measure=spectra", "optimizer=adam"],  # skipped
  "spectra_steps": [
    "measure=spectra",
    "optimizer=sgd",
    "measure.spectra.steps=[0,2]",
    "measure.spectra.save_checkpoints=true",
  ],
  "training_kfac_exact": ["measure=training", "curvature=explicit_exact"],
}
SKIPPED = ("spectra_adam", "training_kfac_exact")


@pytest.fixture(scope="session")
def sweep(tmp_path_factory):
  """The tiny problem's runs of `SWEEP` in one sweep directory, and their
  statuses.

  Under xdist the workers share the directory and split the runs as a
  sweep's processes do: each holds a run's lock while it works, and finds
  the runs the other finished (workers go through the points in opposite
  orders, so neither waits long)."""
  worker = os.environ.get("PYTEST_XDIST_WORKER")
  base = tmp_path_factory.getbasetemp()
  root = (base.parent if worker else base) / "sweep"
  points = list(SWEEP.items())
  if worker and int(worker.removeprefix("gw")) % 2:
    points.reverse()
  for name, o in points:
    runs.run(config.compose(*o, *TINY, "lock_wait_s=inf"), root / name)
  status = {
    name: records.RunDir(root / name).marker()["status"] for name in SWEEP
  }
  return root, status


@pytest.fixture
def forget():
  """Unregisters, after the test, the problems (and their datasets) it
  registers from Python: the test appends their names."""
  names = []
  yield names
  for name in names:
    for registry, key in (
      (problems.PROBLEMS, name),
      (problems.DATASETS, f"{name}_data"),
    ):
      if key in registry:
        registry.unregister(key)


def truncate(path, keep=0.5):
  """Cuts a file to `keep` of its bytes, as a crash mid-write would."""
  data = path.read_bytes()
  path.write_bytes(data[: int(len(data) * keep)])


def run_checked(*args, cwd, env=None):
  """Runs the command `args` in `cwd`; its output, after asserting it
  succeeded (the ends of its output in the failure message)."""
  result = subprocess.run(
    [str(a) for a in args],
    cwd=cwd,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
  return result.stdout


def curvbench_cli(*args, cwd, timeout=900):
  """`python -m curvbench ARGS` in `cwd`, its output captured."""
  return subprocess.run(
    [sys.executable, "-m", "curvbench", *args],
    cwd=cwd,
    capture_output=True,
    text=True,
    timeout=timeout,
  )
