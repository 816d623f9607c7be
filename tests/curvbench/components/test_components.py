"""How a component declares itself: typed settings whose checks name what is
wrong, and registries that find components by name."""

import dataclasses
import sys
import textwrap
from typing import ClassVar

import pytest

from curvbench.components import (
  Component,
  Flag,
  ListOf,
  Number,
  OneOf,
  Parsed,
  Registry,
  Settings,
  SettingsError,
  Text,
  Whole,
  setting,
)


def complaint(check, value, key="k"):
  return next(check.complaints(key, value), None)


@pytest.mark.parametrize(
  "check,good,bad,words",
  [
    (Whole(1), [1, 7], [0, 1.0, True, "1", None], "a whole number >= 1"),
    (Whole(0, 3), [0, 3], [-1, 4], "between 0 and 3"),
    (Whole(1, null=True), [None, 2], [0], "null or a whole number >= 1"),
    (
      Number(0, low_in=False),
      [1e-9, 3],
      [0, -1, float("nan"), float("inf"), False, "1"],
      "a number > 0",
    ),
    (Number(0, 1), [0, 0.5], [1, -0.1], "in [0, 1)"),
    (Number(0, finite=False), [float("inf")], [-1], "(inf: no limit)"),
    (Flag(), [True, False], [1, "yes", None], "true or false"),
    (Text(), ["a"], ["", "  ", 3], "a non-empty text"),
    (ListOf(Whole(1), 1), [[1], [1, 2]], [[], [0], 3], "at least 1 items"),
  ],
)
def test_checks_accept_what_they_say_and_name_it(check, good, bad, words):
  for value in good:
    assert complaint(check, value) is None, value
  for value in bad:
    message = complaint(check, value, "x.y")
    assert message and "x.y" in message, value
  assert words in check.describe()


def test_choices_and_parsed_values_say_what_is_wrong():
  names = ["a"]
  check = OneOf(lambda: tuple(names))  # names that grow, as a registry's
  assert complaint(check, "b") == "Unknown k 'b'; choose one of a."
  names.append("b")
  assert complaint(check, "b") is None
  assert complaint(ListOf(check), ["a", "c"]) == (
    "Unknown k 'c'; choose one of a, b."
  )

  def parse(value):
    if value != "ok":
      raise ValueError(f"{value!r} is not ok")

  assert complaint(Parsed(parse, "ok"), "no", "x") == "x: 'no' is not ok"


@dataclasses.dataclass
class Inner(Settings):
  rate: float = setting(0.1, Number(0, low_in=False), "a rate")


@dataclasses.dataclass
class Outer(Settings):
  adaptive: bool = setting(True, Flag(), "choose the rate")
  size: int = setting(2, Whole(1), "a size")
  limit: int = setting(10, Whole(1), "at least size")
  inner: Inner = dataclasses.field(default_factory=Inner)
  set_elsewhere: ClassVar = {"mode": "the mode group sets it"}

  def ignored(self):
    return {"inner.rate": "adaptive=true chooses it"} if self.adaptive else {}

  def disagreements(self, prefix):
    if self.size > self.limit:
      yield f"{prefix}.size={self.size} is above {prefix}.limit"


def refusals(values):
  return list(Outer.refusals(values, "o"))


def test_settings_refuse_unknown_ignored_and_disagreeing_keys():
  assert refusals({}) == []
  assert refusals({"sise": 3}) == [
    "Unknown setting o.sise=3: Outer has no setting 'sise' (did you mean "
    "size?). Its settings: adaptive, size, limit, inner."
  ]
  assert refusals({"inner": {"rat": 1}})[0].startswith(
    "Unknown setting o.inner.rat=1: Inner has no setting 'rat' (did you "
    "mean rate?)"
  )
  assert refusals({"mode": 1}) == [
    "o.mode is not a setting of Outer: the mode group sets it."
  ]
  assert refusals({"size": 0, "inner": {"rate": -1}}) == [
    "o.size=0 is not allowed: o.size must be a whole number >= 1.",
    "o.inner.rate=-1 is not allowed: o.inner.rate must be a number > 0.",
  ]
  # Only values of the right kind are compared with each other.
  assert refusals({"size": 20}) == ["o.size=20 is above o.limit"]
  assert refusals({"size": 20, "limit": 0}) == [
    "o.limit=0 is not allowed: o.limit must be a whole number >= 1."
  ]
  # A key the other settings make pointless is refused when given.
  assert refusals({"inner": {"rate": 0.5}}) == [
    "o.inner.rate=0.5 is ignored: adaptive=true chooses it. Leave it out."
  ]
  assert refusals({"inner": {"rate": 0.1}}) == []  # its default: harmless
  assert refusals({"adaptive": False, "inner": {"rate": 0.5}}) == []
  made = Outer.from_values(
    {"size": 3, "inner": {"rate": 0.5}, "adaptive": False}
  )
  assert made == Outer(adaptive=False, size=3, inner=Inner(0.5))
  with pytest.raises(SettingsError, match="o.size=0 is not allowed"):
    Outer.from_values({"size": 0}, "o")


@dataclasses.dataclass
class Thing(Component):
  """A kind of component for the tests."""


@dataclasses.dataclass
class Widget(Thing):
  name: str = "widget"
  size: int = setting(1, Whole(1), "its size")


def test_a_registry_finds_components_by_name_and_refuses_mistakes():
  things = Registry("thing", Thing)
  things.register(Widget)
  things.register(Widget, name="big_widget", size=5)
  assert things.names() == ("big_widget", "widget")
  assert things.defaults("big_widget") == Widget(name="big_widget", size=5)
  assert things.load({"name": "big_widget"}).size == 5
  assert things.load({"name": "widget", "size": 3}) == Widget(size=3)
  with pytest.raises(
    SettingsError,
    match=r"Unknown thing 'widgt' \(did you "
    "mean widget",
  ):
    things.get("widgt")
  with pytest.raises(SettingsError, match="thing.size=0 is not allowed"):
    things.load({"name": "widget", "size": 0}, "thing")
  with pytest.raises(
    SettingsError,
    match="thing.name='gizmo' is not "
    "allowed: these are the settings of thing "
    "widget/big_widget; choose another thing by its config "
    r"group \(thing=gizmo\)",
  ):
    Widget.from_values({"name": "gizmo"}, "thing")

  @dataclasses.dataclass
  class Gadget(Thing):
    name: str = "widget"

  with pytest.raises(ValueError, match="Two things are registered as 'widget'"):
    things.register(Gadget)
  with pytest.raises(TypeError, match="must be a dataclass subclassing"):
    things.register(dict)
  with pytest.raises(TypeError, match="has no settings"):
    things.register(Widget, name="odd", colour="red")
  things.unregister("big_widget")
  assert things.names() == ("widget",)


def test_a_registry_imports_every_module_of_its_package(tmp_path, monkeypatch):
  """Adding a component is adding its module: nothing lists it."""
  package = tmp_path / "toy_things"
  package.mkdir()
  (package / "__init__.py").write_text(
    textwrap.dedent("""
      import dataclasses
      from curvbench.components import Component, Registry
      @dataclasses.dataclass
      class Base(Component):
        pass
      THINGS = Registry("thing", Base, package=__name__)
      """)
  )
  for name in ("alpha", "beta"):
    (package / f"{name}.py").write_text(
      textwrap.dedent(f"""
        import dataclasses
        from toy_things import THINGS, Base
        @THINGS.register
        @dataclasses.dataclass
        class Thing(Base):
          name: str = "{name}"
        """)
    )
  monkeypatch.syspath_prepend(str(tmp_path))
  try:
    import toy_things  # noqa: PLC0415 - the module the test just wrote

    assert set(toy_things.THINGS.names()) == {"alpha", "beta"}
  finally:
    for name in [m for m in sys.modules if m.startswith("toy_things")]:
      del sys.modules[name]
