"""Where the Hydra presets are: `conf/` installed inside the package (a
wheel, a non-editable install) or beside it (a source checkout). Imports
nothing heavy: the command's help reads it before JAX is loaded."""

from pathlib import Path


def _find() -> Path:
  installed = Path(__file__).resolve().parent / "conf"
  if installed.is_dir():
    return installed
  return Path(__file__).resolve().parent.parent / "conf"


CONF_DIR = _find()
