"""What the comparisons with curvlinops share: torch and curvlinops from
their own environment, interleaved timing, agreement checks, the report.

Importing this module puts the repository first on `sys.path` (so a script
here imports this checkout's `curvbench`, not an installed one) and
`$CURVLINOPS_SITE_PACKAGES` last (so torch and curvlinops come from there
while numpy, scipy and jax stay the project's).
"""

import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import jax
import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
if os.environ.get("CURVLINOPS_SITE_PACKAGES"):
  sys.path.append(os.environ["CURVLINOPS_SITE_PACKAGES"])

try:  # curvlinops imported here only to refuse early, with set-up help
  import curvlinops  # noqa: F401
  import threadpoolctl
  import torch
except ImportError as error:
  raise SystemExit(
    f"{error}. These comparisons need torch (CPU), curvlinops-for-pytorch "
    "and threadpoolctl, which are not project dependencies: install them "
    "in a separate venv and set CURVLINOPS_SITE_PACKAGES to its "
    "site-packages (see benchmarks/curvlinops/README.md)."
  ) from None

# Torch on every core, as XLA's CPU client is.
torch.set_num_threads(os.cpu_count())


def torch_tensors(arrays, dtype) -> list:
  """numpy-convertible arrays as torch tensors of `dtype` (own copies)."""
  return [torch.tensor(np.array(a), dtype=dtype) for a in arrays]


def relative_error(ours, theirs) -> float:
  """`|ours - theirs| / |theirs|` over the concatenated entries of two lists
  of arrays (or tensors) of equal shapes."""
  ours = np.concatenate([np.ravel(np.asarray(a, np.float64)) for a in ours])
  theirs = np.concatenate([np.ravel(np.asarray(a, np.float64)) for a in theirs])
  return float(np.linalg.norm(ours - theirs) / np.linalg.norm(theirs))


def check(what: str, error: float, tolerance: float, peer: str = "curvlinops"):
  """Prints `error`; stops the comparison if it exceeds `tolerance`."""
  print(f"  {what}: relative error {error:.1e} (tolerance {tolerance:.0e})")
  if not error <= tolerance:
    raise SystemExit(
      f"{what}: ours and {peer} disagree (relative error {error:.1e} > "
      f"{tolerance:.0e}); the timings would not compare the same work, so "
      "none were taken."
    )


def timed(fn, *args) -> float:
  """Seconds of `fn(*args)`, which must return only once its work is done."""
  start = time.perf_counter()
  fn(*args)
  return time.perf_counter() - start


def interleaved(runs: dict, rounds: int, warmup: int = 3) -> dict:
  """Seconds of each run in each round, as `{name: array of rounds}`.

  Each run is a callable returning its own seconds (so it can leave set-up
  out). After `warmup` untimed rounds, every round runs each once, in an
  order that rotates so that no run always follows the same one; a load on
  the machine then falls on every run alike, and per-round ratios stay fair.
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


def _commit() -> str:
  """The checkout's commit, marked `-dirty` with uncommitted changes."""
  git = lambda *a: subprocess.run(
    ("git", "-C", str(REPO)) + a, text=True, capture_output=True, check=False
  ).stdout.strip()
  commit = git("rev-parse", "--short", "HEAD") or "unknown"
  return commit + (
    "-dirty" if git("status", "--porcelain", "--untracked-files=no") else ""
  )


def describe_machine(rounds: int, peers=("curvlinops-for-pytorch",)):
  """Prints where and with what the timings ran; `peers`: the distributions
  whose versions to name."""
  blas = [
    (c.internal_api, os.path.basename(c.filepath), c.num_threads)
    for c in threadpoolctl.ThreadpoolController().lib_controllers
  ]
  versions = ", ".join(f"{p} {metadata.version(p)}" for p in peers)
  print(
    f"{os.cpu_count()}-core CPU ({platform.machine()}), commit "
    f"{_commit()}; jax {jax.__version__} on {jax.devices()[0].platform}, "
    f"torch {torch.__version__} ({torch.get_num_threads()} threads), "
    f"{versions}; "
    f"{rounds} interleaved rounds, compile and warm-up excluded"
  )
  print(f"  thread pools: {blas}")


def report(seconds: dict, ratios: list):
  """Prints each run's median (ms) and the median per-round ratios
  `(numerator, denominator)`, with quartiles."""
  quartiles = lambda x: (
    f"IQR {np.quantile(x, 0.25):.2f}-{np.quantile(x, 0.75):.2f}"
  )
  width = max(map(len, seconds))
  for name, s in seconds.items():
    print(
      f"  {name:{width}s}  median {1e3 * np.median(s):8.2f} ms "
      f"({quartiles(1e3 * s)})"
    )
  for num, den in ratios:
    r = seconds[num] / seconds[den]
    print(f"  {num} / {den}: median {np.median(r):.2f} ({quartiles(r)})")
