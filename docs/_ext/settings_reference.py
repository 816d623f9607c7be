"""Sphinx extension: writes the settings reference (`generated/settings.md`,
included by `reference/settings.md`) from the components' declarations
before the site is read, so it cannot drift from the code."""

from pathlib import Path

from curvbench import settings_doc


def _write(app) -> None:
  out = Path(app.srcdir) / "generated" / "settings.md"
  out.parent.mkdir(parents=True, exist_ok=True)
  text = settings_doc.markdown()
  if not out.is_file() or out.read_text() != text:
    out.write_text(text)


def setup(app):
  app.connect("builder-inited", _write)
  return {"parallel_read_safe": True, "parallel_write_safe": True}
