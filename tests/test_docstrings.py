"""The docstring check `make lint` runs (tools/docstrings.py): what it
reports and what it lets pass, on planted modules."""

import textwrap

from tools import docstrings

PLANTED = textwrap.dedent('''
  """A planted module."""

  from typing import overload


  def bare(x):
    return x


  def documented(x):
    """Returns x."""
    return x


  def _private(x):
    return x


  @overload
  def stub(x: int) -> int: ...


  class Base:
    """A base class."""

    def update(self):
      """Updates the state."""

    def bare_in_base(self):
      pass


  class Child(Base):
    """Overrides the base's methods."""

    def update(self):
      pass

    def bare_in_base(self):
      pass

    @property
    def size(self):
      return 1

    def _helper(self):
      pass


  class Grandchild(Child):
    """An override two levels down."""

    def update(self):
      pass


  class _Hidden:
    def shown(self):
      pass


  class Undocumented:
    pass
''')


def test_reports_public_names_without_a_docstring():
  found = docstrings.undocumented({"pkg/mod.py": PLANTED})
  assert [name for _, _, name in found] == [
    "bare",
    "Base.bare_in_base",
    "Child.bare_in_base",
    "Child.size",
    "Undocumented",
  ]
  assert {path for path, _, _ in found} == {"pkg/mod.py"}
  lines = PLANTED.splitlines()
  assert all(
    lines[line - 1].lstrip().startswith(("def", "class"))
    for _, line, _ in found
  )


def test_private_modules_are_not_checked():
  sources = {"pkg/_private.py": PLANTED, "_pkg/mod.py": PLANTED}
  assert docstrings.undocumented(sources) == []
  assert docstrings.undocumented({"pkg/__init__.py": PLANTED})


def test_a_base_in_another_module_documents_an_override():
  sources = {
    "pkg/base.py": 'class Base:\n  """B."""\n  def update(self):\n    """U."""\n',
    "pkg/child.py": 'class Child(base.Base):\n  """C."""\n  def update(self):\n    pass\n',
  }
  assert docstrings.undocumented(sources) == []
