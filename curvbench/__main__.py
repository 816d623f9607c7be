"""`python -m curvbench ...` is the `curvbench` command."""

from curvbench.cli import main

main()
