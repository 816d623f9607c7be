"""What the Shampoo and SOAP comparisons share: the peers' packages from
an environment of their own, the gradient sequences both sides are fed,
the agreement table, interleaved timing and the report.

Importing this module puts the repository first on `sys.path` (so a script
here imports this checkout's `curvbench`) and `$SHAMPOO_SITE_PACKAGES`
last (so the peers and torch come from there while numpy, jax and optax
stay the project's).
"""

import importlib
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
if os.environ.get("SHAMPOO_SITE_PACKAGES"):
  sys.path.append(os.environ["SHAMPOO_SITE_PACKAGES"])

SETUP = "see benchmarks/shampoo/README.md"
DTYPES = ("float32", "float64")


def require(module: str, what: str):
  """`module` imported, or a stop that says how to install `what`."""
  try:
    return importlib.import_module(module)
  except ImportError as error:
    raise SystemExit(
      f"{error}. This comparison needs {what}, which is not a project "
      f"dependency: install it in a separate venv and set "
      f"SHAMPOO_SITE_PACKAGES to its site-packages ({SETUP})."
    ) from None


def source_path(variable: str, marker: str) -> Path:
  """The folder named by `$variable` (a peer's fetched source, imported
  from there at run time and never committed), checked to hold `marker`."""
  folder = os.environ.get(variable)
  if not folder or not (Path(folder) / marker).exists():
    raise SystemExit(
      f"${variable} must name a folder holding {marker} (a checkout of "
      f"the peer's repository; {SETUP}); it is {folder!r}."
    )
  return Path(folder)


def x64(dtype: str):
  """A context in which JAX has float64 exactly when `dtype` asks for it."""
  return jax.enable_x64(dtype == "float64")


def draw(shapes: dict, steps: int, seed: int = 0) -> list:
  """`steps` dicts of standard normal float64 arrays of `shapes`; the
  same seed gives the same sequence on both sides."""
  rng = np.random.default_rng(seed)
  return [
    {name: rng.standard_normal(shape) for name, shape in shapes.items()}
    for _ in range(steps)
  ]


def relative_error(ours: dict, theirs: dict) -> float:
  """`|ours - theirs| / |theirs|` over the concatenated entries of two dicts
  of arrays of equal shapes (0 where both are zero)."""
  names = sorted(theirs)
  a = np.concatenate([np.ravel(np.asarray(ours[n], np.float64)) for n in names])
  b = np.concatenate(
    [np.ravel(np.asarray(theirs[n], np.float64)) for n in names]
  )
  scale = np.linalg.norm(b)
  diff = np.linalg.norm(a - b)
  return float(diff / scale) if scale else float(diff)


def run_optax(transform, params: dict, grads: list, dtype: str) -> list:
  """The updates (numpy, per step) of an optax transformation fed `grads`
  from `params`, jit-compiled, in `dtype` (call inside `x64(dtype)`)."""
  cast = lambda tree: {k: jnp.asarray(v, dtype) for k, v in tree.items()}
  params = cast(params)
  state = transform.init(params)
  update = jax.jit(transform.update)
  out = []
  for g in grads:
    u, state = update(cast(g), state, params)
    out.append({k: np.asarray(v) for k, v in u.items()})
  return out


class Agreement:
  """Rows of (case, dtype, per-step relative errors, tolerance); prints
  each as it comes and remembers whether any exceeded its tolerance."""

  def __init__(self, title: str):
    self.failed = []
    print(title)
    print(
      f"  {'case':44s} {'dtype':7s} {'max rel. err.':>13s} {'(step)':>6s}"
      f" {'tolerance':>9s}"
    )

  def add(
    self, case: str, dtype: str, errors: list, tolerance: float, note: str = ""
  ):
    worst = int(np.argmax(errors))
    ok = errors[worst] <= tolerance  # NaN fails
    if not ok:
      self.failed.append((case, dtype, errors))
    flag = "" if ok else "  FAIL"
    note = f"  {note}" if note else ""
    print(
      f"  {case:44s} {dtype:7s} {errors[worst]:13.1e} {worst + 1:6d} "
      f"{tolerance:9.0e}{flag}{note}"
    )

  def finish(self) -> bool:
    """Prints the failures' per-step errors; True if there were none."""
    for case, dtype, errors in self.failed:
      print(
        f"  {case} ({dtype}), per step: " + " ".join(f"{e:.1e}" for e in errors)
      )
    return not self.failed


def timed(fn, *args) -> float:
  """Seconds of `fn(*args)`, which must return only once its work is done."""
  start = time.perf_counter()
  fn(*args)
  return time.perf_counter() - start


def interleaved(runs: dict, rounds: int, warmup: int = 3) -> dict:
  """Seconds of each run in each round, as `{name: array of rounds}`.

  Each run is a callable returning its own seconds. After `warmup` untimed
  rounds every round runs each once, in an order rotating by one each
  round, so that a load on the machine falls on all runs alike.
  """
  names = list(runs)
  for _ in range(warmup):
    for name in names:
      runs[name]()
  seconds = {name: [] for name in names}
  for r in range(rounds):
    shift = r % len(names)
    for name in names[shift:] + names[:shift]:
      seconds[name].append(runs[name]())
  return {name: np.array(s) for name, s in seconds.items()}


def commit() -> str:
  """The checkout's commit, marked `-dirty` with uncommitted changes."""
  git = lambda *a: subprocess.run(
    ("git", "-C", str(REPO)) + a, text=True, capture_output=True, check=False
  ).stdout.strip()
  head = git("rev-parse", "--short", "HEAD") or "unknown"
  return head + (
    "-dirty" if git("status", "--porcelain", "--untracked-files=no") else ""
  )


def describe_machine(versions: dict, rounds: int):
  """Prints where, with what and under which load the timings ran."""
  listed = ", ".join(f"{k} {v}" for k, v in versions.items())
  print(
    f"{os.cpu_count()}-core CPU ({platform.machine()}), commit "
    f"{commit()}; jax {jax.__version__} on {jax.devices()[0].platform}, "
    f"{listed}; {rounds} interleaved rounds, compile and warm-up "
    "excluded"
  )
  load()


def load():
  """Prints the 1-, 5- and 15-minute load averages."""
  print("  load average: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))


def report(seconds: dict, ratios: list):
  """Prints each run's median (ms) and the median per-round ratios
  `(numerator, denominator)`, with quartiles."""
  quartiles = lambda x: (
    f"IQR {np.quantile(x, 0.25):.2f}-{np.quantile(x, 0.75):.2f}"
  )
  width = max(map(len, seconds))
  for name, s in seconds.items():
    print(
      f"  {name:{width}s}  median {1e3 * np.median(s):9.2f} ms "
      f"({quartiles(1e3 * s)})"
    )
  for num, den in ratios:
    r = seconds[num] / seconds[den]
    print(f"  {num} / {den}: median {np.median(r):.2f} ({quartiles(r)})")
