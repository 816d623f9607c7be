"""Runs KFAC-JAX's own test suite against `estimators`, through an alias.

KFAC-JAX's tests import `kfac_jax`; here that name (and each of its public
submodules) is `estimators`, set up by a conftest.py written beside a copy of
their `tests/` folder, which is otherwise run unmodified. Prints, per test
file, how many tests passed, failed or errored, the share passed, and the
failures grouped by their error, and writes the per-test outcomes as JSON.

  python benchmarks/kfac_jax/their_tests.py ../kfac-jax-0.0.8 \
      [--release] [--out reports/kfac_jax_tests.json] [-- pytest args]

With --release the same copy runs against the installed `kfac_jax` instead
(no alias), to tell a failure of ours from one of the release on today's jax.
Their tests need absl-py, and the release needs its own dependencies: see
this folder's README for the venv.
"""

import argparse
import collections
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

from api_facts import SUBMODULES  # this folder: the public submodules

PROJECT = pathlib.Path(__file__).resolve().parents[2]
ALIAS = """\
# Written by benchmarks/kfac_jax/their_tests.py: `kfac_jax` is `estimators`.
import sys

import estimators

sys.modules["kfac_jax"] = estimators
for name in {submodules!r}:
  sys.modules["kfac_jax." + name] = getattr(estimators, name)
"""


def outcomes(junit_xml):
  """(file, test, outcome, message) for every test case in a JUnit report."""
  rows = []
  for case in ET.parse(junit_xml).getroot().iter("testcase"):
    outcome, message = "passed", ""
    for tag in ("failure", "error", "skipped"):
      found = case.find(tag)
      if found is not None:
        outcome = {"failure": "failed", "error": "error"}.get(tag, tag)
        message = (found.get("message") or "").splitlines()[0][:160]
        break
    module = case.get("classname", "")
    if not module:  # the file failed to import: pytest names it as the test
      module, outcome = case.get("name"), "collection error"
    rows.append((module.split(".")[1], case.get("name"), outcome, message))
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "checkout", type=pathlib.Path, help="KFAC-JAX source tree"
  )
  parser.add_argument(
    "--release", action="store_true", help="run against the installed kfac_jax"
  )
  parser.add_argument("--out", type=pathlib.Path)
  parser.add_argument("pytest_args", nargs="*")
  args = parser.parse_args()
  source = args.checkout / "tests"
  if not (source / "models.py").is_file():
    parser.error(
      f"{source} is not KFAC-JAX's tests folder (no models.py): pass the root "
      "of a KFAC-JAX source checkout, e.g. `git clone --branch v0.0.8 "
      "https://github.com/google-deepmind/kfac-jax`"
    )
  with tempfile.TemporaryDirectory() as work:
    root = pathlib.Path(work)
    shutil.copytree(source, root / "tests")
    (root / "tests" / "__init__.py").touch()
    if not args.release:
      (root / "conftest.py").write_text(ALIAS.format(submodules=SUBMODULES))
    junit = root / "junit.xml"
    paths = [str(root)] + ([] if args.release else [str(PROJECT)])
    env = {"PYTHONPATH": ":".join(paths)}
    command = [
      sys.executable,
      "-m",
      "pytest",
      "-q",
      "-p",
      "no:cacheprovider",
      "--continue-on-collection-errors",
      f"--junitxml={junit}",
      "tests",
      *args.pytest_args,
    ]
    print("running:", " ".join(command), flush=True)
    subprocess.run(command, cwd=root, env={**os.environ, **env}, check=False)
    rows = outcomes(junit)
  by_file = collections.defaultdict(collections.Counter)
  for file, _, outcome, _ in rows:
    by_file[file][outcome] += 1
  print(
    f"\n{'file':32} {'passed':>7} {'failed':>7} {'error':>6} {'skipped':>8}"
  )
  total = collections.Counter()
  for file, counts in sorted(by_file.items()):
    total.update(counts)
    print(
      f"{file:32} {counts['passed']:7} {counts['failed']:7} {counts['error']:6} {counts['skipped']:8}"
    )
  ran = sum(total.values()) - total["skipped"]
  share = 100 * total["passed"] / max(ran, 1)
  print(
    f"{'all':32} {total['passed']:7} {total['failed']:7} {total['error']:6} {total['skipped']:8}"
  )
  print(f"\npassed {total['passed']} of {ran} that ran: {share:.1f} %")
  if total["collection error"]:
    print(
      f"not comparable: {total['collection error']} file(s) failed to import, "
      "and their tests are not counted"
    )
  failures = collections.Counter(
    m for _, _, o, m in rows if o != "passed" and o != "skipped"
  )
  for message, count in failures.most_common():
    print(f"{count:5}  {message}")
  if args.out:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
      json.dumps(
        [dict(zip(("file", "test", "outcome", "message"), r)) for r in rows],
        indent=1,
      )
    )


if __name__ == "__main__":
  main()
