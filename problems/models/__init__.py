"""The problems, one module each (see `problems.base.PROBLEMS`)."""
