"""Components of one kind, found by name: problems, datasets, curvature
approximations, optimizers, measurements.

A component is a `Settings` dataclass (most are `Component`s, whose `name`
is a setting): its settings are its fields, its behaviour its methods. It
joins its kind's `Registry` with a decorator,

    @PROBLEMS.register
    @dataclasses.dataclass
    class MLP(ProblemSettings):
      name: str = "mlp"
      width: int = setting(16, Whole(1), "units per hidden layer")
      def build(self, data): ...

and a registry made with `package=` imports every module of that package
the first time it is read, so adding a component is adding its module:
nothing else lists it.
"""

import dataclasses
import difflib
import importlib
import pkgutil
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar, Generic, TypeVar

from curvbench.components.settings import Settings, SettingsError, Text, setting


@dataclasses.dataclass
class Component(Settings):
  """Settings that name the component they belong to (`name`)."""

  name: str = setting("", Text(), "which component these settings are of")
  # The colour and marker figures draw it in (`curvbench.core.palette`), the
  # same in every report; None: one of the palette's left over.
  colour: ClassVar[str | None] = None
  marker: ClassVar[str | None] = None
  # The names this class is registered under, and the registry's kind.
  registered_names: ClassVar[tuple[str, ...]] = ()
  kind: ClassVar[str] = "component"
  group: ClassVar[str] = "component"

  @classmethod
  def what(cls) -> str:
    return f"{cls.kind} {'/'.join(cls.registered_names) or cls.__name__}"

  def disagreements(self, prefix: str) -> Iterator[str]:
    if self.name not in self.registered_names:
      key = f"{prefix}.name" if prefix else "name"
      yield (
        f"{key}={self.name!r} is not allowed: these are the settings of "
        f"{self.what()}; choose another {self.kind} by its config group "
        f"({self.group}={self.name}), not by {key}."
      )


# The class a registry's components subclass (its `base`).
S = TypeVar("S", bound=Settings)


class Registry(Generic[S]):
  """The components of one `kind` (e.g. 'optimizer'), by name."""

  _instances: ClassVar[list] = []

  def __init__(
    self,
    kind: str,
    base: type[S],
    package: str | None = None,
    group: str | None = None,
  ):
    self.kind = kind
    self.group = group or kind  # the config group that chooses one
    self.base = base
    self.package = package
    self._entries: dict[str, tuple[type[S], dict]] = {}
    self._discovered = package is None
    Registry._instances.append(self)

  @classmethod
  def instances(cls) -> tuple["Registry", ...]:
    """Every registry made so far."""
    return tuple(cls._instances)

  def register(
    self, cls: type | None = None, /, *, name: str | None = None, **defaults
  ):
    """Registers `cls`, a dataclass subclassing `base`, under its `name`
    (the default of its `name` field, or a class attribute):
    `@REGISTRY.register` above the class. Called
    as `REGISTRY.register(cls, name=..., **defaults)`, it registers the
    class again under another name, its settings taking `defaults` (so
    one class may serve several names). Returns `cls`."""
    if cls is None:
      return lambda c: self.register(c, name=name, **defaults)
    if not (
      isinstance(cls, type)
      and issubclass(cls, self.base)
      and dataclasses.is_dataclass(cls)
    ):
      raise TypeError(
        f"A {self.kind} must be a dataclass subclassing "
        f"{self.base.__name__}; got {cls!r}."
      )
    name = name or getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
      raise TypeError(
        f"{cls.__qualname__} needs a `name` (the default of "
        "its `name` field, or a class attribute): the name it "
        "is registered and chosen by."
      )
    if name in self._entries and self._entries[name][0] is not cls:
      first = self._entries[name][0]
      raise ValueError(
        f"Two {self.kind}s are registered as {name!r}: "
        f"{first.__module__}.{first.__qualname__} and "
        f"{cls.__module__}.{cls.__qualname__}; give one another name."
      )
    unknown = set(defaults) - set(cls.keys())
    if unknown:
      raise TypeError(
        f"{cls.__qualname__} has no settings "
        f"{sorted(unknown)} to register {name!r} with."
      )
    self._entries[name] = (cls, defaults)
    # Stamped on every registered class: a `Component` declares them,
    # another `Settings` (a measurement) does not.
    stamped: Any = cls
    stamped.registered_names = (*cls.__dict__.get("registered_names", ()), name)
    stamped.kind, stamped.group = self.kind, self.group
    return cls

  def unregister(self, name: str) -> None:
    """Removes `name` (a component a test registered for its own use)."""
    cls: Any  # stamped by `register`
    cls, _ = self._entries.pop(name)
    cls.registered_names = tuple(n for n in cls.registered_names if n != name)

  def _discover(self) -> None:
    if self._discovered or self.package is None:
      return
    self._discovered = True
    package = importlib.import_module(self.package)
    for module in pkgutil.iter_modules(package.__path__):
      importlib.import_module(f"{self.package}.{module.name}")

  def names(self) -> tuple[str, ...]:
    """The registered names, sorted (whatever order modules import in)."""
    self._discover()
    return tuple(sorted(self._entries))

  def __iter__(self) -> Iterator[str]:
    return iter(self.names())

  def __contains__(self, name) -> bool:
    return name in self.names()

  def get(self, name: str) -> type[S]:
    """The class registered as `name`.

    Raises:
      SettingsError: for an unknown name, naming the nearest ones.
    """
    if name not in self.names():
      raise SettingsError(
        f"Unknown {self.kind} {name!r}{self._nearest(name)}; {self._choices()}"
      )
    return self._entries[name][0]

  def _nearest(self, name) -> str:
    close = difflib.get_close_matches(str(name), self.names(), n=3)
    return f" (did you mean {' or '.join(close)}?)" if close else ""

  def _choices(self) -> str:
    return f"choose one of {', '.join(self.names())}."

  def defaults(self, name: str) -> S:
    """The settings of `name` as registered: its class's defaults, with
    the registration's own."""
    cls = self.get(name)
    named = {"name": name} if "name" in cls.keys() else {}
    return cls(**self._entries[name][1], **named)

  def refusals(self, values, prefix: str = "") -> Iterator[str]:
    """Messages for what is not allowed in `values`, the settings of one
    of these components (chosen by `values['name']`; missing keys take
    that component's defaults)."""
    key = f"{prefix}.name" if prefix else "name"
    name = values.get("name") if isinstance(values, Mapping) else None
    if name not in self.names():
      yield f"Unknown {key} {name!r}{self._nearest(name)}; {self._choices()}"
      return
    yield from self.get(name).refusals(self._complete(values), prefix)

  def load(self, values, prefix: str = "", checked: bool = False) -> S:
    """The component's settings from `values` (a mapping with `name`;
    missing keys take its defaults).

    Raises:
      SettingsError: naming the first setting that is not allowed.
    """
    if isinstance(values, self.base):
      values = dataclasses.asdict(values)
    if not checked:
      for message in self.refusals(values, prefix):
        raise SettingsError(message)
    return self.get(values["name"]).from_values(
      self._complete(values), prefix, checked=True
    )

  def _complete(self, values) -> dict:
    registered = self._entries[values["name"]][1]
    return {**registered, **values}
