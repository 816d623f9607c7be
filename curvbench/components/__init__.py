"""How a component of curvbench declares itself: its settings as a typed
dataclass (`settings`), and the registry of its kind that finds it by name
(`registry`). Problems, datasets, curvature approximations, optimizers and
measurements are all components; nothing here knows any of them."""

from curvbench.components.registry import Component, Registry
from curvbench.components.settings import (
  Check,
  Choice,
  Flag,
  ListOf,
  Number,
  OneOf,
  Parsed,
  SettingDoc,
  Settings,
  SettingsError,
  Text,
  Whole,
  documented,
  dotted,
  setting,
)

__all__ = [
  "Check",
  "Choice",
  "Component",
  "Flag",
  "ListOf",
  "Number",
  "OneOf",
  "Parsed",
  "Registry",
  "SettingDoc",
  "Settings",
  "SettingsError",
  "Text",
  "Whole",
  "documented",
  "dotted",
  "setting",
]
