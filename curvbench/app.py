"""The `curvbench` command: one Hydra run per problem x curvature x
optimizer x measurement, or a sweep of them (`-m`); `curvbench report DIR`
merges a sweep's runs into tables and figures.

The command line is checked before Hydra starts: a value of the wrong type,
an unknown key, or (for a single run) any setting the config refuses ends
the command with the message alone, before anything is written. The
command keeps JAX's compiled programs in the `compilation_cache` directory.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import cast

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException

from curvbench import config, plugins, records, report, runs
from hydra_plugins.curvbench_sweeper import tuning_sweeper

# Hydra's options that take a value, and those after which the command does
# something other than run (help, completion, another config tree).
_VALUED = ("--cfg", "-c", "--package", "-p", "--info", "-i")
_NOT_A_RUN = (
  "-h",
  "--help",
  "--hydra-help",
  "--version",
  "-i",
  "--info",
  "-sc",
  "--shell-completion",
  "-cp",
  "--config-path",
  "-cn",
  "--config-name",
  "-cd",
  "--config-dir",
  "--experimental-rerun",
)


def check_command_line(argv: list[str]) -> None:
  """Composes the config of `argv` as Hydra will and exits with the
  message alone where it is refused: the whole check for a single run
  (its settings, and its folder: `runs.refuse`), the parts without sweeps
  (values and keys) for `-m` (the sweeper checks every point and folder
  before it launches any)."""
  if any(arg.split("=")[0] in _NOT_A_RUN for arg in argv):
    return
  multirun = any(arg in ("-m", "--multirun") for arg in argv)
  overrides, skip = [], False
  for arg in argv:
    if skip:
      skip = False
    elif arg in _VALUED:
      skip = True
    elif not arg.startswith("-"):
      overrides.append(arg)
  parsed = OverridesParser.create().parse_overrides(overrides)
  # (Overrides parsed from lines keep them.)
  fixed = [cast(str, o.input_line) for o in parsed if not o.is_sweep_override()]
  try:
    cfg = config.compose(*fixed, check=not multirun, with_hydra=True)
    if not multirun:
      runs.refuse(cfg, cfg.hydra.run.dir)
  except (ValueError, HydraException) as e:  # ConfigError, ForeignFolder
    raise SystemExit(f"curvbench: {e}") from None


def _hydra_main():
  tuning_sweeper.register()
  config.register_resolvers()
  config.store()

  @hydra.main(
    version_base=None, config_path=str(config.CONF_DIR), config_name="config"
  )
  def main(cfg):
    try:
      plugins.load(cfg.plugins)  # a launcher's own process imports them too
      config.validate(cfg)
    except ValueError as e:  # ConfigError, PluginError: the message alone
      raise SystemExit(f"curvbench: {e}") from None
    runs.use_compilation_cache(cfg.compilation_cache)
    out_dir = HydraConfig.get().runtime.output_dir
    try:
      return runs.run(cfg, out_dir)
    except Exception as e:  # noqa: BLE001 - one line, or re-raised
      # One line: the traceback is the run's ERROR.json, where it could be
      # written. An error of another kind (a library's own, e.g.
      # safetensors' on a full disk) is named with its kind and where its
      # traceback is; where none was written, Hydra prints the traceback.
      if isinstance(e, (ValueError, OSError, MemoryError, FloatingPointError)):
        raise SystemExit(f"curvbench: {out_dir}: {e}") from None
      error = Path(out_dir) / records.ERROR
      if error.is_file():
        raise SystemExit(
          f"curvbench: {out_dir}: {type(e).__name__}: {e} "
          f"(its traceback is in {error})"
        ) from None
      raise

  return main()


def cli(argv=None):
  """Console entry point: `curvbench report DIR` or a Hydra run/sweep."""
  argv = sys.argv[1:] if argv is None else list(argv)
  if argv and argv[0] == "report":
    return report.main(argv[1:])
  if not argv:
    print(
      "curvbench: no arguments, so running the default benchmark "
      "(-m +experiment=quick) and then its report.",
      flush=True,
    )
    sys.argv = [sys.argv[0], "-m", "+experiment=quick"]
    try:
      _hydra_main()
    except SystemExit as exit_:
      if exit_.code not in (None, 0):
        raise
    return report.main(["reports/quick"])
  check_command_line(argv)
  sys.argv = [sys.argv[0]] + argv
  return _hydra_main()


if __name__ == "__main__":
  cli()
