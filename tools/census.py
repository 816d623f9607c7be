"""The codebase's shape in a few numbers, for comparing two commits.

    python tools/census.py [ROOT]

prints the Python files at the top of `curvbench/`, the largest module and
function, how many functions run over 80 lines, the undocumented public
names (`tools/docstrings.py`'s rule), the ruff rules `make lint` selects,
and the test files with their lines. ROOT (default: this checkout) may be
another commit's tree, e.g. from `git worktree add /tmp/old <commit>`;
the docstring rule is this checkout's either way.
"""

import ast
import sys
import tomllib
from pathlib import Path

from docstrings import PACKAGES, project_sources, undocumented

LONG = 80  # lines: the limit for one function


def main() -> None:
  root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parents[1])
  sources = project_sources(root)
  sizes = {path: len(text.splitlines()) for path, text in sources.items()}
  functions = [
    (node.end_lineno - node.lineno + 1, f"{path}:{node.name}")
    for path, text in sources.items()
    for node in ast.walk(ast.parse(text))
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
  ]
  missing = undocumented(sources)
  lint = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["ruff"]
  tests = list((root / "tests").rglob("test_*.py"))
  print(
    f"top-level curvbench modules: {len(list(root.glob('curvbench/*.py')))}"
  )
  largest = max(sizes, key=sizes.__getitem__)
  print(f"largest module: {largest} ({sizes[largest]} lines)")
  print("largest function: {1} ({0} lines)".format(*max(functions)))
  print(f"functions over {LONG} lines: {sum(n > LONG for n, _ in functions)}")
  for package in PACKAGES:
    count = sum(path.startswith(f"{package}/") for path, _, _ in missing)
    print(f"undocumented public names in {package}: {count}")
  print(f"ruff rules: {', '.join(lint['lint']['select'])}")
  lines = sum(len(p.read_text().splitlines()) for p in tests)
  print(f"test files: {len(tests)} ({lines} lines)")


if __name__ == "__main__":
  main()
