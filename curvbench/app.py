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
import time
import traceback
from pathlib import Path
from typing import cast

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.plugins import Plugins
from hydra.errors import HydraException
from hydra.types import RunMode

from curvbench import config, plugins, report, runs
from curvbench.core import records

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


def _register_sweeper() -> None:
  """Puts curvbench's sweeper in Hydra's plugin table. Hydra finds plugins
  by listing the `hydra_plugins` package, which setuptools' editable
  install hides from it; the class is named by its config node's target,
  so the app depends on the node, not on the adapter's code."""
  target = config.SweeperSettings._target_
  Plugins.instance().register(hydra.utils.get_class(target))


def _hydra_main():
  _register_sweeper()
  config.register_resolvers()
  config.store()

  @hydra.main(
    version_base=None, config_path=str(config.CONF_DIR), config_name="config"
  )
  def main(cfg):
    # A sweep's point never exits the process: it returns how it ended, and
    # the sweeper runs the others, then says which failed.
    sweeping = HydraConfig.get().mode == RunMode.MULTIRUN
    out_dir = HydraConfig.get().runtime.output_dir
    start = time.perf_counter()
    try:
      ended = _run(cfg, out_dir, start)
    except _Failed as failed:
      if not sweeping:
        raise SystemExit(str(failed)) from None
      print(str(failed), file=sys.stderr, flush=True)
      return failed.ended
    if ended.failed and not sweeping:  # its records are written
      raise SystemExit(ended.line())
    print(ended.line(), flush=True)
    return ended

  return main()


class _Failed(Exception):
  """A run that ended in an error: its one-line message, and its end."""

  def __init__(self, message: str, ended: runs.Ending):
    super().__init__(message)
    self.ended = ended


def _run(cfg, out_dir: str, start: float) -> runs.Ending:
  """One run into `out_dir` and how it ended; `_Failed` with the message
  for one that raised."""

  def failed(message: str, reason: str) -> _Failed:
    seconds = time.perf_counter() - start
    return _Failed(message, runs.Ending(out_dir, "error", seconds, "", reason))

  try:
    plugins.load(cfg.plugins)  # a launcher's own process imports them too
    config.validate(cfg)
  except ValueError as e:  # ConfigError, PluginError: the message alone
    raise failed(f"curvbench: {e}", str(e)) from None
  runs.use_compilation_cache(cfg.compilation_cache)
  try:
    status = runs.run(cfg, out_dir)
  except Exception as e:  # noqa: BLE001 - one line, or re-raised
    # One line: the traceback is the run's ERROR.json, where it could be
    # written. An error of another kind (a library's own, e.g.
    # safetensors' on a full disk) is named with its kind and where its
    # traceback is; where none was written, it is printed here.
    if isinstance(e, (ValueError, OSError, MemoryError, FloatingPointError)):
      raise failed(f"curvbench: {out_dir}: {e}", str(e)) from None
    error = Path(out_dir) / records.ERROR
    if error.is_file():
      why = f"{type(e).__name__}: {e} (its traceback is in {error})"
      raise failed(f"curvbench: {out_dir}: {why}", why) from None
    traceback.print_exc()
    why = f"{type(e).__name__}: {e} (its traceback is above)"
    raise failed(f"curvbench: {out_dir}: {why}", why) from None
  return runs.ending(cfg, out_dir, status, time.perf_counter() - start)


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
    failed = None
    try:
      _hydra_main()
    except runs.PointsFailed as e:  # the others ran: report them, then say so
      failed = e
    except SystemExit as exit_:
      if exit_.code not in (None, 0):
        raise
    made = report.main(["reports/quick"])
    if failed is not None:
      raise failed
    return made
  check_command_line(argv)
  sys.argv = [sys.argv[0]] + argv
  return _hydra_main()


if __name__ == "__main__":
  cli()
