"""Headless Chromium for tests of generated HTML pages.

Uses Debian's chromium (`make browser` installs it) through the Python
`playwright` package; Playwright's own browser download is not needed.

  from tests.browser import chromium_page  # noqa: F401 (a fixture)

  def test_page(chromium_page, tmp_path):
    page = chromium_page.open(tmp_path / "page.html")
    ...
    assert chromium_page.errors == []

Without /usr/bin/chromium (or $CURVBENCH_CHROMIUM) the tests using the
fixture skip, unless $CI or $CURVBENCH_REQUIRE_BROWSER is set: then they fail.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("CURVBENCH_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
  "--headless",
  "--no-sandbox",
  "--disable-gpu",
  "--disable-quic",
  "--no-first-run",
  "--disable-background-networking",
  "--disable-component-update",
  "--disable-sync",
  "--disable-dev-shm-usage",
]
INSTALL_HINT = (
  "install it with `make browser` (as root) or `apt-get install chromium`"
)


@dataclasses.dataclass
class BrowserPage:
  """A Playwright page and the errors it reported: console messages of
  type "error" and uncaught page exceptions."""

  page: object
  errors: list[str]

  def open(self, path: str | Path):
    """Loads a local file as a file:// URL and returns the page."""
    path = Path(path).resolve()
    if not path.is_file():
      raise ValueError(f"no page to open at {str(path)!r}")
    self.page.goto(path.as_uri(), wait_until="load")
    return self.page


def _missing(reason: str):
  if os.environ.get("CURVBENCH_REQUIRE_BROWSER") or os.environ.get("CI"):
    pytest.fail(f"{reason} (and a browser is required here)")
  pytest.skip(reason)


@contextlib.contextmanager
def launch_chromium():
  """A fresh headless Chromium page with its error log, closed on exit."""
  try:  # optional: without it the browser tests are skipped
    from playwright.sync_api import sync_playwright  # noqa: PLC0415 - see above
  except ImportError:
    _missing(
      "the `playwright` package is not installed: run "
      "`pip install -c constraints.txt -e '.[test]'`"
    )
  if not os.access(CHROMIUM, os.X_OK):
    _missing(f"no Chromium at {CHROMIUM}: {INSTALL_HINT}")
  with sync_playwright() as playwright:
    browser = playwright.chromium.launch(
      executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS
    )
    try:
      page = browser.new_context().new_page()
      errors: list[str] = []
      page.on(
        "console",
        lambda msg: errors.append(f"console: {msg.text}")
        if msg.type == "error"
        else None,
      )
      page.on("pageerror", lambda exc: errors.append(f"pageerror: {exc}"))
      yield BrowserPage(page, errors)
    finally:
      browser.close()


@pytest.fixture
def chromium_page():
  """A headless Chromium page (a BrowserPage: `.open(path)`, `.page`,
  `.errors`); skips when no Chromium is installed."""
  with launch_chromium() as browser_page:
    yield browser_page
