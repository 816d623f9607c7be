"""`utils.limit_lapack_threads`: importing `estimators` makes scipy's OpenBLAS
(what jax's CPU LAPACK calls run on) single-threaded, and every curvature
family's LAPACK work runs under that limit.

Each check runs in a fresh interpreter, where the thread count is first
raised to 2 (so the check means something on any machine), and is read from
inside each compiled program, after its LAPACK results (`io_callback`).
"""

import json
import os
import subprocess
import sys

import pytest

from curvbench.approximations import CURVATURES
from tests.conftest import ROOT

# Every registered family, found by the registry.
FAMILIES = tuple(CURVATURES.names())
# Every kind of LAPACK call the library makes, which the families' programs
# (update, refresh, products, eigenvalues) contain together (eigh and
# eigvalsh are `eigh`; `jnp.linalg.solve` and `inv` are `lu`), and those
# some families are known to contain (a family not named here is checked
# all the same).
LAPACK_CALLS = {"eigh", "cholesky", "triangular_solve", "lu"}
KNOWN_CALLS = {
  "kfac": {"eigh"},  # small factors' inverses through eigh; eigenvalues
  "ekfac": {"eigh"},  # the eigenbasis
  "tnt": {"eigh"},
  "full": {"cholesky", "triangular_solve", "eigh"},
  "kfac_tridiagonal": {"cholesky", "triangular_solve", "eigh", "lu"},
  "explicit_exact": {"cholesky", "triangular_solve", "eigh"},
  "implicit_exact": {"eigh"},
  "kl_shampoo": {"cholesky", "triangular_solve", "eigh"},  # fixed point
}


SCRIPT = r"""
import json, os, sys
import threadpoolctl
import scipy.linalg.cython_lapack  # loads scipy's OpenBLAS

def scipy_openblas():
  return [lib for lib in threadpoolctl.ThreadpoolController().lib_controllers
          if lib.internal_api == "openblas"
          and "scipy" in os.path.basename(os.path.dirname(lib.filepath))]

if "OPENBLAS_NUM_THREADS" not in os.environ:
  for lib in scipy_openblas():
    lib.set_num_threads(2)
before = [lib.num_threads for lib in scipy_openblas()]

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

import estimators  # noqa: F401  (applies the limit)
import problems
from curvbench import approximations, config

after_import = [lib.num_threads for lib in scipy_openblas()]

def primitives(jaxpr, found):
  for eqn in jaxpr.eqns:
    found.add(eqn.primitive.name)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      primitives(sub, found)
  return found

def threads(*_):
  return np.int32(min(lib.num_threads for lib in scipy_openblas()))

problem = problems.make(config.compose(
    "problem.width=3", "problem.depth=1", "problem.batch_size=8").problem)
rng = jax.random.PRNGKey(0)
params = problem.init_params(rng, jnp.float32)
batch = problem.fixed_batch(dtype=np.float32)
runs = {}
for family in sys.argv[1:]:
  curvature = approximations.make(
      config.plain(config.compose(f"curvature={family}").curvature),
      problem.loss_fn)

  def program(state):
    state = curvature.update(state, params, batch, rng)
    state = curvature.refresh(state, 1e-3)
    out = (curvature.precondition(state, params, 1e-3),
           curvature.multiply(state, params), curvature.eigenvalues(state))
    # Runs once the LAPACK results above exist.
    seen = io_callback(threads, jax.ShapeDtypeStruct((), np.int32),
                       jax.tree.leaves(out))
    return out, seen

  state = curvature.init(rng, params, batch)
  found = primitives(jax.make_jaxpr(program)(state).jaxpr, set())
  _, seen = jax.jit(program)(state)
  runs[family] = dict(threads=int(seen), primitives=sorted(found))
print(json.dumps(dict(before=before, after_import=after_import, runs=runs)))
"""


def _run(families, **env):
  environ = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
  environ.update(JAX_PLATFORMS="cpu", **env)
  done = subprocess.run(
    [sys.executable, "-c", SCRIPT, *families],
    cwd=ROOT,
    env=environ,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_familys_lapack_calls_run_single_threaded():
  result = _run(FAMILIES)
  if result["before"] != [2]:
    pytest.skip(f"scipy's OpenBLAS took {result['before']} threads, not 2")
  assert result["after_import"] == [1]
  seen = set()
  for family in FAMILIES:
    run = result["runs"][family]
    seen.update(run["primitives"])
    assert KNOWN_CALLS.get(family, set()) <= set(run["primitives"]), (
      family,
      run["primitives"],
    )
    assert run["threads"] == 1, family
  assert LAPACK_CALLS <= seen, seen


def test_openblas_num_threads_keeps_the_users_setting():
  # The same check sees 2 threads once the limit is not applied, so a
  # family whose calls ran unlimited would fail the test above.
  result = _run(["ekfac"], OPENBLAS_NUM_THREADS="2")
  assert result["before"] == result["after_import"] == [2]
  assert result["runs"]["ekfac"]["threads"] == 2
