"""`python -m curvbench ...` is the `curvbench` command."""

from curvbench.app import cli

cli()
