"""The documentation site and the README: the site builds with warnings as
errors (its tutorials run), every page loads in headless Chromium with its
links, images and search working, every setting is in the generated
reference, and every command or setting the pages name exists."""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import http.server
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import threading
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from curvbench import cli, config, settings_doc
from curvbench.components import (
  Number,
  Settings,
  SettingsError,
  documented,
  setting,
)

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README_LIMIT = 150


def _pages() -> list[Path]:
  """The README and the site's hand-written pages and tutorials."""
  return (
    [ROOT / "README.md"]
    + sorted(p for p in DOCS.rglob("*.md") if "generated" not in p.parts)
    + sorted((DOCS / "tutorials").glob("*.py"))
  )


# --- the generated reference --------------------------------------------------


def _flat(text: str) -> str:
  return " ".join(text.replace("\\", "").split())


def test_every_setting_of_every_component_is_in_the_reference():
  text = _flat(settings_doc.markdown())
  checked = 0
  for registry in config.REGISTRIES:
    for name in registry.names():
      assert f"{registry.group}={name}" in text, (registry.group, name)
      for row in documented(registry.get(name)):
        if row.key == "name":
          continue
        assert f"{row.key}`" in text, (name, row.key)
        assert _flat(row.doc) in text, (name, row.key)
        checked += 1
  groups = {group.split("/")[0] for group in cli.GROUPS}
  for row in documented(config.RunSettings):
    if row.key not in groups:  # each group has its own section
      assert _flat(row.doc) in text, row.key
  assert checked > 200  # every registry was read


def test_a_setting_without_a_doc_is_refused_by_name():
  @dataclasses.dataclass
  class Undocumented(Settings):
    rate: float = setting(0.1, Number(0), "a documented one")
    steps: float = setting(3, Number(0))

  with pytest.raises(SettingsError, match=r"setting steps .* has no doc"):
    documented(Undocumented)


def test_the_settings_page_is_generated_not_written():
  page = (DOCS / "reference" / "settings.md").read_text()
  assert "../generated/settings.md" in page and len(page.splitlines()) < 5


# --- what the pages name ------------------------------------------------------

_FENCE = re.compile(r"```(?:sh|bash|console|shell)\n(.*?)```", re.S)
_SPAN = re.compile(r"`([^`\n]+)`")
# A word to be filled in: NAME, SWEEP_DIR, <run>, ...
_PLACEHOLDER = re.compile(
  r"(?<![A-Za-z])[A-Z][A-Z_]{2,}(?![a-z=])|<[a-z_]+>|\.\.\."
)
_COMMAND = re.compile(r"^(?:\$ )?(?:[A-Z_]+=\S+ )*(?:\.venv/bin/)?curvbench ")


def _commands(text: str) -> list[str]:
  """`curvbench ...` command lines in shell blocks and code spans."""
  found = []
  for block in _FENCE.findall(text):
    for line in block.replace("\\\n", " ").splitlines():
      line = line.split(" #")[0].strip()
      if _COMMAND.match(line):
        found.append(line)
  found += [
    s for s in _SPAN.findall(text) if _COMMAND.match(s) and "->" not in s
  ]
  return found


def _overrides(command: str) -> list[list[str]] | None:
  """The override lists composing `command` checks: one with each sweep's
  first value, then one per further value of each sweep; None for a
  subcommand or help."""
  words = shlex.split(command.split(" | ")[0])
  words = words[words.index(next(w for w in words if "curvbench" in w)) + 1 :]
  if (
    not words
    or words[0] in ("report", "bench")
    or words[0]
    in (
      "-h",
      "--help",
      "--hydra-help",
    )
  ):
    return None
  overrides, skip = [], False
  for word in words:
    if skip:
      skip = False
    elif word in ("--cfg", "-c", "--package", "-p"):
      skip = True
    elif not word.startswith("-"):
      overrides.append(word)
  parsed = OverridesParser.create().parse_overrides(overrides)
  choices = [
    list(o.sweep_string_iterator()) if o.is_sweep_override() else [None]
    for o in parsed
  ]

  def line(o, value):
    return o.input_line if value is None else f"{o.get_key_element()}={value}"

  first = [line(o, c[0]) for o, c in zip(parsed, choices)]
  cases = [first]
  for i, (o, values) in enumerate(zip(parsed, choices)):
    for value in values[1:]:
      cases.append(first[:i] + [line(o, value)] + first[i + 1 :])
  return cases


@pytest.fixture
def plugins_forgotten():
  """Undoes what the pages' plugins register (their components and their
  modules), so later tests in the process see the built-in ones only."""
  names = {registry: set(registry.names()) for registry in config.REGISTRIES}
  modules = set(sys.modules)
  yield
  for registry, before in names.items():
    for name in set(registry.names()) - before:
      registry.unregister(name)
  for module in set(sys.modules) - modules:
    if module.startswith("curvbench_plugin_"):
      del sys.modules[module]


def test_every_command_the_pages_show_composes(plugins_forgotten):
  problems, checked = [], 0
  for page in _pages():
    for command in _commands(page.read_text()):
      if _PLACEHOLDER.search(command):
        continue  # a pattern (curvbench report SWEEP_DIR), not a command
      multirun = " -m " in f" {command} "
      try:
        for overrides in _overrides(command) or []:
          config.compose(*overrides, check=not multirun, with_hydra=True)
          checked += 1
      except Exception as e:  # noqa: BLE001 - reported with the page
        problems.append(f"{page.relative_to(ROOT)}: `{command}`: {e}")
  assert problems == [] and checked >= 10, "\n".join(problems)


def test_every_make_target_and_module_the_pages_name_exists():
  targets = set(
    re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), re.M)
  )
  problems = []
  for page in _pages():
    text = "\n".join(
      _FENCE.findall(page.read_text()) + _SPAN.findall(page.read_text())
    )
    problems += [
      f"{page.relative_to(ROOT)}: make {target}"
      for target in re.findall(r"^(?:\$ )?make ([a-z][a-z-]+)", text, re.M)
      if target not in targets
    ]
    problems += [
      f"{page.relative_to(ROOT)}: python -m {module}"
      for module in re.findall(r"python -m ([a-z_][a-z_.]*[a-z_])", text)
      if importlib.util.find_spec(module) is None
    ]
  assert problems == [], "\n".join(problems)


def _unknown(span: str, keys: set[str], groups: set[str]) -> str | None:
  """Why the code span `span` names no setting or option, if it does not."""
  if m := re.match(r"^\+?([a-z_]+(?:\.[a-z_0-9]+)+)=\S*$", span):
    key = m.group(1)
    if key in keys or any(k.startswith(key + ".") for k in keys):
      return None
    return "names no setting"
  group, _, options = span.lstrip("+").partition("=")
  if group in groups and options and not _PLACEHOLDER.search(options):
    missing = [o for o in options.split(",") if o not in config.options(group)]
    return f"no {group} {missing}" if missing else None
  return None


def test_every_setting_the_pages_name_exists():
  keys = settings_doc.keys()
  groups = set(cli.GROUPS)
  problems = []
  for page in _pages():
    for span in _SPAN.findall(page.read_text()):
      if " " not in span and not span.startswith("hydra."):
        if why := _unknown(span, keys, groups):
          problems.append(f"{page.relative_to(ROOT)}: `{span}`: {why}")
  assert problems == [], "\n".join(problems)


def test_the_readme_is_short_and_links_each_part_of_the_site():
  text = (ROOT / "README.md").read_text()
  assert len(text.splitlines()) <= README_LIMIT
  links = re.findall(r"\]\((docs/[^)#]*)", text)
  for link in links:
    assert (ROOT / link).exists(), f"README links {link}, which is missing"
  for part in ("tutorials", "howto", "reference", "architecture"):
    assert any(part in link for link in links), f"no link to docs' {part}"


def test_the_readmes_library_example_runs():
  blocks = re.findall(
    r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S
  )
  library = [b for b in blocks if "import estimators" in b]
  assert library, "the README shows no library example"
  for block in library:
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)
    loss = float(namespace["stats"]["loss"])
    assert 0 < loss < 2.4  # ten steps down from log(10) on separable data


# --- the site -----------------------------------------------------------------


@pytest.fixture(scope="session")
def site(tmp_path_factory) -> Path:
  """The site built as `make docs` builds it (warnings as errors), once per
  test run: the build takes minutes and writes into docs/generated, so xdist's
  workers share it through their common base folder, the first to ask
  building it while the others wait on the lock."""
  shared = tmp_path_factory.getbasetemp()
  if "PYTEST_XDIST_WORKER" in os.environ:
    shared = shared.parent
  out = shared / "site"
  with open(shared / "site.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not (out / "build.log").exists():
      out.mkdir(exist_ok=True)
      (out / "build.log").write_text(_build_site(out))
  log = (out / "build.log").read_text()
  assert log == "", log
  return out / "html"


def _build_site(out: Path) -> str:
  """Builds the site into `out`: the end of sphinx's errors, or ''."""
  result = subprocess.run(
    [
      sys.executable,
      "-m",
      "sphinx",
      "-W",
      "--keep-going",
      "-q",
      "-b",
      "html",
      "-d",
      str(out / "doctrees"),
      str(DOCS),
      str(out / "html"),
    ],
    capture_output=True,
    text=True,
    cwd=ROOT,
  )
  return "" if result.returncode == 0 else result.stderr[-6000:] or "failed"


class _Anchors(HTMLParser):
  """The ids, links and images of one HTML page."""

  def __init__(self):
    super().__init__()
    self.ids, self.links, self.images = set(), [], []

  def handle_starttag(self, tag, attrs):
    attrs = dict(attrs)
    if "id" in attrs:
      self.ids.add(attrs["id"])
    if tag == "a" and attrs.get("href"):
      self.links.append(attrs["href"])
    if tag == "img" and attrs.get("src"):
      self.images.append(attrs["src"])


def _parsed(path: Path) -> _Anchors:
  parser = _Anchors()
  parser.feed(path.read_text())
  return parser


def _html_pages(site: Path) -> list[Path]:
  return sorted(
    p
    for p in site.rglob("*.html")
    if not {"_static", "_sources", "_images"} & set(p.parts)
  )


def test_the_site_has_no_broken_link_image_or_anchor(site):
  pages = _html_pages(site)
  assert (site / "index.html") in pages and len(pages) >= 15
  parsed = functools.cache(_parsed)  # the API page alone is megabytes
  for page in pages:
    for link in parsed(page).links + parsed(page).images:
      url = urlsplit(link)
      if url.scheme or link.startswith("mailto:"):
        continue  # outside the site (this machine cannot reach it)
      target = (page.parent / unquote(url.path)).resolve() if url.path else page
      assert target.exists(), f"{page.relative_to(site)} -> {link}"
      if url.fragment and target.suffix == ".html":
        assert url.fragment in parsed(target).ids, (
          f"{page.relative_to(site)} -> {link}"
        )


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
  def log_message(self, *args):
    pass  # a line per request would bury the test's output


@pytest.fixture(scope="session")
def served(site):
  """The site's address over HTTP, as a reader gets it (a browser refuses
  the search's page fetches from file:// addresses)."""
  handler = functools.partial(_QuietHandler, directory=str(site))
  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  yield f"http://127.0.0.1:{server.server_address[1]}/"
  server.shutdown()


def test_every_page_loads_in_chromium_with_its_images(
  site, served, chromium_page
):
  page = chromium_page.page
  for path in _html_pages(site):
    page.goto(served + path.relative_to(site).as_posix(), wait_until="load")
    broken = page.evaluate(
      "Array.from(document.images)"
      ".filter(i => !i.complete || i.naturalWidth === 0).map(i => i.src)"
    )
    assert broken == [], f"{path.relative_to(site)}: {broken}"
    assert chromium_page.errors == [], path.relative_to(site)


def test_search_finds_the_estimators(served, chromium_page):
  page = chromium_page.page
  page.goto(served + "search.html?q=EKFAC", wait_until="load")
  page.wait_for_selector("#search-results ul.search li", timeout=20_000)
  titles = page.locator("#search-results ul.search li").all_inner_texts()
  assert any("estimators.EKFAC" in t for t in titles), titles[:5]
  assert chromium_page.errors == []


def test_the_tutorials_ran_and_show_their_output(site):
  sources = sorted((DOCS / "tutorials").glob("*.py"))
  assert len(sources) >= 5
  for source in sources:
    page = site / "generated" / "tutorials" / f"{source.stem}.html"
    assert page.is_file(), source.name
    html = page.read_text()
    assert "sphx-glr-script-out" in html or "sphx-glr-single-img" in html, (
      f"{source.name} rendered no output"
    )
