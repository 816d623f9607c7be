"""State classes that are pytrees, and their (de)serialisation to plain
nested dictionaries (for checkpoints that must not pickle classes)."""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, TypeVar

import jax

StateT = TypeVar("StateT", bound="State")

# Registered state classes by "module.qualname", to rebuild them.
_STATE_CLASSES: dict[str, type] = {}


def _class_key(cls: type) -> str:
  return f"{cls.__module__}.{cls.__qualname__}"


# An ABC, as KFAC-JAX's, though it declares no abstract method: subclasses'
# `abc.abstractmethod`s are enforced.
class State(abc.ABC):  # noqa: B024 - see above
  """Base of state classes: a dataclass whose fields are its pytree
  children (see `register_state_class`)."""

  @classmethod
  def field_names(cls) -> tuple[str, ...]:
    """The names of the fields, in order."""
    return tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]

  @classmethod
  def field_types(cls) -> dict[str, Any]:
    """The annotated type of each field."""
    return {f.name: f.type for f in dataclasses.fields(cls)}  # type: ignore[arg-type]

  @property
  def field_values(self) -> tuple[Any, ...]:
    """The values of the fields, in order."""
    return tuple(getattr(self, name) for name in self.field_names())

  def copy(self: StateT) -> StateT:
    """A new instance holding the same arrays (a shallow copy of the tree)."""
    leaves, tree = jax.tree.flatten(self)
    return jax.tree.unflatten(tree, leaves)

  def tree_flatten(self) -> tuple[tuple[Any, ...], tuple[str, ...]]:
    """The field values as children; the field names as static data."""
    return self.field_values, self.field_names()

  @classmethod
  def tree_unflatten(cls, aux_data: tuple[str, ...], children: Any):
    """Rebuilds an instance from `tree_flatten`'s output."""
    return cls(**dict(zip(aux_data, children)))

  def __repr__(self) -> str:
    fields = ", ".join(
      f"{n}={v!r}" for n, v in zip(self.field_names(), self.field_values)
    )
    return f"{type(self).__name__}({fields})"


def register_state_class(class_type: type) -> type:
  """Makes a `State` subclass a dataclass and a pytree, and registers it
  for `deserialize_state_tree`.

  Raises:
    ValueError: if `class_type` does not derive from `State`.
  """
  if not (isinstance(class_type, type) and issubclass(class_type, State)):
    raise ValueError(
      f"{class_type} is not a subclass of estimators.utils.State: derive "
      "it from State before registering it."
    )
  class_type = dataclasses.dataclass(class_type)
  jax.tree_util.register_pytree_node_class(class_type)
  _STATE_CLASSES[_class_key(class_type)] = class_type
  return class_type


def serialize_state_tree(instance: Any) -> Any:
  """The tree with every `State` replaced by a dictionary of its fields
  plus `"__class__"`, its registered name; containers are recursed into,
  other values kept."""
  if isinstance(instance, State):
    result = {
      name: serialize_state_tree(getattr(instance, name))
      for name in instance.field_names()
    }
    result["__class__"] = _class_key(type(instance))
    return result
  for container in (list, tuple, set):
    if isinstance(instance, container):
      return container(serialize_state_tree(v) for v in instance)
  if isinstance(instance, dict):
    return {k: serialize_state_tree(v) for k, v in instance.items()}
  return instance


def deserialize_state_tree(representation: Any) -> Any:
  """Undoes `serialize_state_tree`: dictionaries with a `"__class__"` entry
  become instances of that registered class (the input is not modified).

  Raises:
    ValueError: for a class name no `register_state_class` call registered.
  """
  for container in (list, tuple, set):
    if isinstance(representation, container):
      return container(deserialize_state_tree(v) for v in representation)
  if not isinstance(representation, dict):
    return representation
  fields = {
    k: deserialize_state_tree(v)
    for k, v in representation.items()
    if k != "__class__"
  }
  if "__class__" not in representation:
    return fields
  name = representation["__class__"]
  if name not in _STATE_CLASSES:
    raise ValueError(
      f"Cannot rebuild class {name}: it was not registered with "
      "register_state_class (import the module defining it first)."
    )
  return _STATE_CLASSES[name](**fields)
