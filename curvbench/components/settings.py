"""Typed settings: each setting is declared once, as a dataclass field.

`setting(default, check, doc)` makes a field whose metadata holds the check
of the values it may hold (`Whole`, `Number`, `Flag`, `Text`, `OneOf`,
`ListOf`, `Parsed`, `Choice`) and a line saying what it does. A `Settings`
dataclass then answers `refusals(values)`: a message for every key it does
not have (naming the nearest ones it has, or where that value is set
instead), every value a check refuses, and, once every value is of the
right kind, the settings that disagree (`disagreements`) and the keys that
the others make pointless (`ignored`) given other than their default.

The annotations are real types (Hydra's ConfigStore and OmegaConf enforce
them when a config is composed); the checks say the rest (ranges, choices)
in words a user can act on, and hold for plain dicts too.
"""

import abc
import dataclasses
import difflib
import math
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar


class SettingsError(ValueError):
  """A setting whose value is not allowed, alone or with another one."""


def dotted(prefix: str, key: str) -> str:
  """`key`'s full name under `prefix` (`prefix.key`; `key` alone where
  the prefix is empty)."""
  return f"{prefix}.{key}" if prefix else key


# --- what one setting may hold ------------------------------------------------


class Check(abc.ABC):
  """What one key may hold: `accepts(value)`, and `describe()` in words.
  Subclasses say what a value may be (`_accepts`, `_describe`); None is
  allowed where `null` is True (the field's doc says what it means)."""

  null = False

  def accepts(self, value) -> bool:
    """Whether `value` is allowed: None where `null`, else what the
    subclass allows."""
    return self.null if value is None else self._accepts(value)

  def describe(self) -> str:
    """What is allowed, in words, for an error message or the settings'
    documentation (`null or ...` where None is allowed)."""
    return ("null or " if self.null else "") + self._describe()

  @abc.abstractmethod
  def _accepts(self, value) -> bool:
    """Whether a value other than None is allowed."""

  @abc.abstractmethod
  def _describe(self) -> str:
    """What is allowed, in words (null aside)."""

  def complaints(self, key: str, value) -> Iterator[str]:
    """Why `value` is not allowed at `key` (nothing when it is)."""
    if not self.accepts(value):
      yield f"{key}={value!r} is not allowed: {key} must be {self.describe()}."

  def build(self, value, key: str):
    """The value a settings object holds for `value` (checked already)."""
    return list(value) if isinstance(value, tuple) else value


@dataclasses.dataclass(frozen=True)
class Whole(Check):
  """A whole number (an int, not a bool) in `[low, high]`."""

  low: int = 0
  high: int | None = None
  null: bool = False

  def _accepts(self, value) -> bool:
    return (
      isinstance(value, int)
      and not isinstance(value, bool)
      and value >= self.low
      and (self.high is None or value <= self.high)
    )

  def _describe(self) -> str:
    span = (
      f">= {self.low}"
      if self.high is None
      else f"between {self.low} and {self.high}"
    )
    return f"a whole number {span}"


@dataclasses.dataclass(frozen=True)
class Number(Check):
  """A real number (int or float) above `low` (or at it, with `low_in`) and
  below `high`; infinite only where `finite` is False."""

  low: float | None = None
  high: float | None = None
  low_in: bool = True
  finite: bool = True
  null: bool = False

  def _accepts(self, value) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      return False
    if math.isnan(value) or (self.finite and math.isinf(value)):
      return False
    if self.low is not None and (
      value < self.low or (value == self.low and not self.low_in)
    ):
      return False
    return self.high is None or value < self.high

  def _describe(self) -> str:
    if self.low is None:
      span = "" if self.high is None else f"below {self.high:g}"
    elif self.high is not None:
      span = f"in {'[' if self.low_in else '('}{self.low:g}, {self.high:g})"
    else:
      span = f"{'>=' if self.low_in else '>'} {self.low:g}"
    return f"a number {span}".rstrip() + (
      "" if self.finite else " (inf: no limit)"
    )


@dataclasses.dataclass(frozen=True)
class Flag(Check):
  """A boolean: true or false."""

  def _accepts(self, value) -> bool:
    return isinstance(value, bool)

  def _describe(self) -> str:
    return "true or false"


@dataclasses.dataclass(frozen=True)
class Text(Check):
  """A string with something besides whitespace in it."""

  null: bool = False

  def _accepts(self, value) -> bool:
    return isinstance(value, str) and bool(value.strip())

  def _describe(self) -> str:
    return "a non-empty text"


@dataclasses.dataclass(frozen=True)
class OneOf(Check):
  """One of a set of names; `options` may be a function giving them (e.g.
  a registry's names, which grow as components register)."""

  options: tuple | Callable[[], tuple]
  null: bool = False

  @property
  def names(self) -> tuple:
    """The allowed names now (a function's are read each time)."""
    return tuple(self.options() if callable(self.options) else self.options)

  def _accepts(self, value) -> bool:
    return isinstance(value, str) and value in self.names

  def _describe(self) -> str:
    return f"one of {', '.join(map(str, self.names))}"

  def complaints(self, key: str, value) -> Iterator[str]:
    if not self.accepts(value):
      yield (f"Unknown {key} {value!r}; choose one of {', '.join(self.names)}.")


@dataclasses.dataclass(frozen=True)
class ListOf(Check):
  """A list whose every item `item` accepts, at least `min_len` long."""

  item: Check
  min_len: int = 0
  null: bool = False

  def _accepts(self, value) -> bool:
    return (
      isinstance(value, (list, tuple))
      and len(value) >= self.min_len
      and all(self.item.accepts(v) for v in value)
    )

  def _describe(self) -> str:
    size = f"at least {self.min_len} " if self.min_len else ""
    return f"a list of {size}items, each {self.item.describe()}"

  def complaints(self, key: str, value) -> Iterator[str]:
    if self.accepts(value):
      return
    if isinstance(value, (list, tuple)) and len(value) >= self.min_len:
      bad = next(item for item in value if not self.item.accepts(item))
      if isinstance(self.item, OneOf):
        yield from self.item.complaints(key, bad)
      else:
        yield (
          f"{key}={list(value)!r} is not allowed: its item {bad!r} must "
          f"be {self.item.describe()}."
        )
    else:
      yield from super().complaints(key, value)


@dataclasses.dataclass(frozen=True)
class Parsed(Check):
  """Whatever `parse` takes without a ValueError, whose message says what
  is wrong; `words` says what is allowed."""

  parse: Callable
  words: str
  null: bool = False

  def _accepts(self, value) -> bool:
    return next(self.complaints("", value), None) is None

  def _describe(self) -> str:
    return self.words

  def complaints(self, key: str, value) -> Iterator[str]:
    if value is None and self.null:
      return
    try:
      self.parse(value)
    except (TypeError, ValueError) as e:
      yield str(e) if key in str(e) else f"{key}: {e}"


@dataclasses.dataclass(frozen=True)
class Choice(Check):
  """The settings of one component of a `registry` (see
  `components.Registry`), chosen by their `name`; a field left null takes
  the `default` component's settings (`Settings.completed`), or stays
  null where there is no default; in Hydra a config group of its own
  chooses it (`curvbench.config.store`)."""

  registry: Any
  default: str | None = None

  def _accepts(self, value) -> bool:
    return next(self.complaints("", value), None) is None

  def _describe(self) -> str:
    return f"the settings of a {self.registry.kind}"

  def complaints(self, key: str, value) -> Iterator[str]:
    if value is None and self.default is None:
      return
    yield from self.registry.refusals(value, key)

  def build(self, value, key: str):
    if value is None:
      return None
    return self.registry.load(value, key, checked=True)


def setting(
  default=dataclasses.MISSING, check: Check | None = None, doc: str = ""
) -> Any:
  """A dataclass field with its check and documentation; a list or dict
  default is copied for each instance."""
  metadata = dict(check=check, doc=doc)
  if isinstance(default, (list, dict)):
    value = default
    return dataclasses.field(
      default_factory=lambda: type(value)(value), metadata=metadata
    )
  return dataclasses.field(default=default, metadata=metadata)


# --- a group of settings ------------------------------------------------------

_MISSING = object()


def _plain(value):
  """Dataclass instances as dicts (so defaults and values compare alike)."""
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return {
      f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)
    }
  return value


def _nearest(key: str, names) -> str:
  close = difflib.get_close_matches(key, list(names), n=3, cutoff=0.6)
  return f" (did you mean {' or '.join(close)}?)" if close else ""


def _all_keys(cls) -> list[str]:
  """Every dotted key of `cls`, nested settings' too, and the keys it says
  are set elsewhere: the names a misspelt key is matched against."""
  keys = list(cls.set_elsewhere)
  for name in cls.keys():
    keys.append(name)
    if name in cls.nested():
      keys += [f"{name}.{k}" for k in _all_keys(cls.nested()[name])]
  return keys


@dataclasses.dataclass
class Settings:
  """A dataclass of settings, each a `setting(...)` field (or a nested
  `Settings`).

  Subclasses may add

  - `set_elsewhere`: keys that are not settings here because another
    setting decides them, each with where (refused with that reason);
  - `disagreements(prefix)`: messages for settings that do not agree;
  - `ignored()`: the keys the other settings make pointless, each with
    why; such a key given other than its default is refused.
  """

  set_elsewhere: ClassVar[Mapping[str, str]] = {}

  def disagreements(self, prefix: str) -> Iterator[str]:
    """Messages for settings of this group that do not agree."""
    return iter(())

  def ignored(self) -> Mapping[str, str]:
    """`{dotted key: why}` of keys the other settings make pointless."""
    return {}

  @classmethod
  def completed(cls, values: Mapping) -> Mapping:
    """`values` with what a missing key means filled in, where that is more
    than the field's default: a `Choice` with a default component left
    null takes that component's settings (subclasses add their own, e.g.
    a problem's own dataset)."""
    filled = {
      f.name: dataclasses.asdict(check.registry.defaults(check.default))
      for f in dataclasses.fields(cls)
      if isinstance(check := f.metadata.get("check"), Choice)
      and check.default is not None
      and values.get(f.name) is None
    }
    return {**values, **filled} if filled else values

  @classmethod
  def what(cls) -> str:
    """What these settings are of, for messages."""
    return cls.__name__

  @classmethod
  def unknown(cls, key: str, prefix: str, value=_MISSING) -> str:
    """The message for `key`, which is not a setting here (given `value`,
    where known): where it is set instead, or the nearest settings."""
    if key in cls.set_elsewhere:
      return (
        f"{dotted(prefix, key)} is not a setting of {cls.what()}: "
        f"{cls.set_elsewhere[key]}."
      )
    given = "" if value is _MISSING else f"={value!r}"
    return (
      f"Unknown setting {dotted(prefix, key)}{given}: {cls.what()} has "
      f"no setting {key!r}{_nearest(key, _all_keys(cls))}. Its "
      f"settings: {', '.join(cls.keys())}."
    )

  @classmethod
  def keys(cls) -> tuple[str, ...]:
    """The settings' names, in their declaration order."""
    return tuple(f.name for f in dataclasses.fields(cls))

  @classmethod
  def nested(cls) -> dict[str, type["Settings"]]:
    """Fields whose type is itself a `Settings` class."""
    hints = typing.get_type_hints(cls)
    return {
      f.name: hints[f.name]
      for f in dataclasses.fields(cls)
      if isinstance(hints.get(f.name), type)
      and issubclass(hints[f.name], Settings)
    }

  @classmethod
  def refusals(cls, values, prefix: str = "") -> Iterator[str]:
    """A message for every key of `values` (a mapping; missing keys take
    their defaults) that is not allowed: unknown keys and bad values first,
    then settings that disagree and ignored keys given a value."""
    if not isinstance(values, Mapping):
      yield (
        f"{prefix or 'the settings'}={values!r} is not allowed: give "
        f"the settings of {cls.what()} as a mapping."
      )
      return
    values = cls.completed(values)
    bad = False
    known = cls.keys()
    for key in values:
      if key not in known:
        bad = True
        yield cls.unknown(key, prefix, values[key])
    nested = cls.nested()
    for f in dataclasses.fields(cls):
      if f.name not in values:
        continue
      key, value = dotted(prefix, f.name), values[f.name]
      if f.name in nested:
        found = list(nested[f.name].refusals(value, key))
      elif f.metadata.get("check") is not None:
        found = list(f.metadata["check"].complaints(key, value))
      else:
        found = []
      bad = bad or bool(found)
      yield from found
    if bad:
      return  # the rest reads values of the right kind
    made = cls.from_values(values, prefix, checked=True)
    yield from made.disagreements(prefix)
    defaults = _plain(cls())
    for key, why in made.ignored().items():
      value = _lookup(_plain(values), key)
      if value is not _MISSING and value != _lookup(defaults, key):
        yield (
          f"{dotted(prefix, key)}={value!r} is ignored: {why}. Leave it out."
        )

  @classmethod
  def from_values(cls, values, prefix: str = "", checked: bool = False):
    """An instance from `values` (a mapping, or an instance), nested
    settings and `Choice` fields built too; missing keys take their
    defaults.

    Raises:
      SettingsError: naming the first setting that is not allowed (unless
        `checked`: the caller has asked `refusals` already).
    """
    if isinstance(values, cls):
      values = _plain(values)
    values = cls.completed(values)
    if not checked:
      for message in cls.refusals(values, prefix):
        raise SettingsError(message)
    nested = cls.nested()
    kwargs = {}
    for f in dataclasses.fields(cls):
      if f.name not in values:
        continue
      value, check = values[f.name], f.metadata.get("check")
      if f.name in nested:
        value = nested[f.name].from_values(
          value, dotted(prefix, f.name), checked=True
        )
      elif check is not None and value is not None:
        value = check.build(value, dotted(prefix, f.name))
      kwargs[f.name] = value
    return cls(**kwargs)


def _lookup(tree, dotted_key: str):
  for part in dotted_key.split("."):
    if not isinstance(tree, Mapping) or part not in tree:
      return _MISSING
    tree = tree[part]
  return tree


# --- documentation ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SettingDoc:
  """One setting as a user reads it: its dotted key, default, what it
  accepts and what it means."""

  key: str
  default: Any
  accepts: str
  doc: str


def _default(field: dataclasses.Field) -> Any:
  if field.default is not dataclasses.MISSING:
    return field.default
  if field.default_factory is not dataclasses.MISSING:
    return field.default_factory()
  return "(required)"


def documented(cls: type[Settings], prefix: str = "") -> list[SettingDoc]:
  """Every setting of `cls`, nested ones under their dotted key, in
  declaration order; fields holding another section (no check) are left
  to that section's own documentation.

  Raises:
    SettingsError: naming a setting declared without a doc, and how to
      give it one.
  """
  found = []
  nested = cls.nested()
  for field in dataclasses.fields(cls):
    key = f"{prefix}{field.name}"
    if field.name in nested:
      found += documented(nested[field.name], f"{key}.")
      continue
    check = field.metadata.get("check")
    if check is None:
      continue
    if not field.metadata.get("doc"):
      raise SettingsError(
        f"setting {key} of {cls.what()} has no doc: declare it as "
        f"setting(default, check, doc='what it means') in {cls.__module__}."
      )
    found.append(
      SettingDoc(key, _default(field), check.describe(), field.metadata["doc"])
    )
  return found
