"""What produced a number: the code (commit and uncommitted changes), the
library versions, the device and the machine. Every record and timing
carries these (`curvbench.provenance.columns`, `environment.json`)."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import platform
import subprocess
import sys
from pathlib import Path

from curvbench.core import devices

LIBRARIES = (
  "jax",
  "jaxlib",
  "dm-haiku",
  "optax",
  "numpy",
  "pandas",
  "hydra-core",
  "matfree",
)


@functools.cache
def code_version() -> dict:
  """The curvbench commit and whether the checkout had local changes.

  `code` names the code exactly: the commit, plus a hash of the uncommitted
  diff when the tree is dirty; outside a git checkout, the package version.
  """
  root = Path(__file__).resolve().parents[2]

  def git(*args):
    return subprocess.run(
      ["git", *args],
      cwd=root,
      capture_output=True,
      text=True,
      check=True,
      timeout=30,
    ).stdout

  try:
    commit = git("rev-parse", "HEAD").strip()
    diff = git("diff", "HEAD", "--no-ext-diff", "--", ".")
  except (OSError, subprocess.SubprocessError):
    version = importlib.metadata.version("curvbench")
    return dict(commit=None, dirty=None, code=f"curvbench {version}")
  dirty = bool(diff)
  code = commit
  if dirty:
    code += "+" + hashlib.sha256(diff.encode()).hexdigest()[:8]
  return dict(commit=commit, dirty=dirty, code=code)


def versions() -> dict:
  """The installed version of each library a record names
  (`LIBRARIES`), None for one that is not installed."""
  out: dict[str, str | None] = {}
  for pkg in LIBRARIES:
    try:
      out[pkg] = importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
      out[pkg] = None
  return out


def device(platform_name: str = "auto", count: int = 1) -> dict:
  """The record columns of the device the `device` setting selects, used
  `count` times (the `devices` setting)."""
  return devices.describe(devices.select(platform_name), count)


def environment(platform_name: str = "auto", count: int = 1) -> dict:
  """The machine and software of a run, for its `environment.json`."""
  return dict(
    device(platform_name, count),
    python=platform.python_version(),
    host=platform.node(),
    versions=versions(),
    code=code_version(),
    argv=list(sys.argv),
  )
