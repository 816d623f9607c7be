"""Sphinx configuration of curvbench's documentation site.

Sphinx rather than MkDocs: autodoc reads the library's docstrings where they
live, sphinx-gallery runs the tutorials at build time, and `-W` turns every
broken reference into an error.
"""

import os
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path[:0] = [str(DOCS.parent), str(DOCS / "_ext")]
# Tutorials and API pages import JAX: on the CPU, in float32 unless a page
# asks otherwise, without a GPU probe's warnings.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

project = "curvbench"
author = "the curvbench authors"
copyright = "2026, the curvbench authors"

extensions = [
  "myst_parser",
  "sphinx.ext.autodoc",
  "sphinx.ext.napoleon",
  "sphinx_gallery.gen_gallery",
  "settings_reference",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
# generated/settings.md is read by reference/settings.md, not a page itself.
exclude_patterns = ["_build", "tutorials/README.txt", "generated/settings.md"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # dataclass fields are documented once, as members
# Docstrings write `name` for code, as Markdown does.
default_role = "code"

sphinx_gallery_conf = {
  "examples_dirs": "tutorials",
  "gallery_dirs": "generated/tutorials",
  "filename_pattern": r".*\.py$",  # run every tutorial at build time
  "abort_on_example_error": True,
  "download_all_examples": False,
  "show_signature": False,
  "remove_config_comments": True,
  "within_subsection_order": "FileNameSortKey",
  "min_reported_time": 0,
  # Its timing pages load scripts from CDNs; the gallery prints the times.
  "write_computation_times": False,
}

html_theme = "furo"
html_title = "curvbench"
html_favicon = "_static/favicon.svg"
