"""`python -m curvbench.bench`: see `curvbench.bench.cli`."""

import sys

from curvbench.bench import cli

sys.exit(cli.main())
