"""Methods compiled once per object: `jax.jit` on one device, `jax.pmap`
over the local devices, or run eagerly in debug mode.

A staged method called from inside another staged method of the same
object runs as plain Python, so nested calls are compiled only once, as
part of the outer one.
"""

from __future__ import annotations

import functools
import inspect
import operator
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from estimators.utils import devices, pytree
from estimators.utils.misc import Finalizable


class WithStagedMethods(Finalizable):
  """A mixin for classes whose methods are decorated with `staged`."""

  class StagingContext:
    """Marks its object as being staged for the duration of a `with`."""

    def __init__(self, wsm_instance: WithStagedMethods):
      self._wsm_instance = wsm_instance

    def __enter__(self) -> None:
      if self._wsm_instance._in_staging:
        raise RuntimeError("Already inside this object's staging context.")
      self._wsm_instance._in_staging = True

    def __exit__(self, *_: Any) -> None:
      self._wsm_instance._in_staging = False

  def __init__(
    self,
    multi_device: bool = False,
    pmap_axis_name: str | None = None,
    debug: bool = False,
    **parent_kwargs: Any,
  ):
    """
    Args:
      multi_device: stage with `jax.pmap` (over `pmap_axis_name`) rather
        than `jax.jit`.
      pmap_axis_name: the mapped axis name; required with `multi_device`.
      debug: run staged methods eagerly (under `jax.disable_jit`), once per
        device when `multi_device`.
      **parent_kwargs: passed on to `Finalizable` (`_in_staging` is always
        settable after finalization).

    Raises:
      ValueError: if `multi_device` is set without a string axis name.
    """
    parent_kwargs["excluded_attribute_names"] = (
      "_in_staging",
      *parent_kwargs.get("excluded_attribute_names", ()),
    )
    super().__init__(**parent_kwargs)
    if multi_device and not isinstance(pmap_axis_name, str):
      raise ValueError(
        "multi_device=True needs pmap_axis_name, the name of the pmap axis "
        "(a string)."
      )
    self._multi_device = multi_device
    self._pmap_axis_name = pmap_axis_name
    self._debug = debug
    self._in_staging = False

  @property
  def multi_device(self) -> bool:
    """Whether staged methods run under `jax.pmap`."""
    return self._multi_device

  @property
  def pmap_axis_name(self) -> str | None:
    """The mapped axis name (None in debug mode, where nothing is mapped)."""
    return None if self.debug else self._pmap_axis_name

  @property
  def debug(self) -> bool:
    """Whether staged methods run eagerly."""
    return self._debug

  @property
  def in_staging(self) -> bool:
    """Whether a staged method of this object is being run or traced."""
    return self._in_staging

  def staging_context(self) -> WithStagedMethods.StagingContext:
    """A context manager marking this object as being staged."""
    return self.StagingContext(self)

  def get_first(self, obj: Any) -> Any:
    """The first device's entries of `obj` when `multi_device`, else `obj`."""
    return devices.get_first(obj) if self.multi_device else obj

  def copy_obj(self, obj: Any) -> Any:
    """A copy of `obj` in new buffers (per device when `multi_device`)."""
    if self.multi_device:
      return devices.pmap_copy_obj(obj)
    return devices.copy_obj(obj)

  def replicate(self, obj: Any) -> Any:
    """`obj` replicated on the local devices when `multi_device`."""
    if self.multi_device:
      return devices.replicate_all_local_devices(obj)
    return obj

  def pmean_if_pmap_wrapper(
    self, func: Callable[..., Any]
  ) -> Callable[..., Any]:
    """`func` followed by a mean over the mapped axis when `multi_device`
    (and not `debug`)."""
    if not self.multi_device or self.debug:
      return func
    return lambda *args, **kwargs: jax.lax.pmean(
      func(*args, **kwargs), self.pmap_axis_name
    )


def _as_tuple(argnums: int | Sequence[int] | None) -> tuple[int, ...]:
  if argnums is None:
    return ()
  return (argnums,) if isinstance(argnums, int) else tuple(argnums)


def staged(
  method: Callable[..., Any],
  static_argnums: int | Sequence[int] | None = None,
  donate_argnums: int | Sequence[int] | None = None,
) -> Callable[..., Any]:
  """Makes a method of a `WithStagedMethods` subclass compiled.

  `instance.method(*args)` becomes `jax.jit(method)(instance, *args)`, or
  `jax.pmap` over the instance's axis when `multi_device` (scalar
  arguments broadcast, the others split on their leading axis). Argument
  numbers do not count `self`. Use as `@staged` or
  `@functools.partial(staged, static_argnums=...)`.

  Args:
    method: the method.
    static_argnums: arguments that are static (hashable), as in `jax.jit`.
    donate_argnums: arguments whose buffers may be reused, as in `jax.jit`.

  Returns:
    The staged method.
  """
  static = _as_tuple(static_argnums)
  shifted_static = (0, *(i + 1 for i in static))
  shifted_donate = tuple(i + 1 for i in _as_tuple(donate_argnums))
  signature = inspect.signature(method)
  jitted = jax.jit(
    method, static_argnums=shifted_static, donate_argnums=shifted_donate
  )
  pmapped: dict[tuple, Callable] = {}

  def per_device(instance, args, kwargs):
    # Debug on many devices: call the method eagerly for each device's
    # slice of the arguments, and stack the results.
    keep = [i in static or pytree.is_scalar(a) for i, a in enumerate(args)]
    outs = []
    for d in range(jax.local_device_count()):
      args_d = [
        a if k else jax.tree.map(operator.itemgetter(d), a)
        for a, k in zip(args, keep)
      ]
      kwargs_d = jax.tree.map(operator.itemgetter(d), kwargs)
      with jax.disable_jit():
        outs.append(method(instance, *args_d, **kwargs_d))
    return jax.tree.map(lambda *xs: jnp.stack(xs), *outs)

  @functools.wraps(method)
  def decorated(instance: WithStagedMethods, *args: Any, **kwargs: Any) -> Any:
    bound = signature.bind(instance, *args, **kwargs)
    bound.apply_defaults()
    args, kwargs = bound.args[1:], bound.kwargs
    if instance.in_staging:
      return method(instance, *args, **kwargs)
    with instance.staging_context():
      if instance.debug and instance.multi_device:
        return per_device(instance, args, kwargs)
      if instance.debug:
        with jax.disable_jit():
          return method(instance, *args, **kwargs)
      if not instance.multi_device:
        return jitted(instance, *args, **kwargs)
      in_axes = (None, *(None if pytree.is_scalar(a) else 0 for a in args))
      key = (instance.pmap_axis_name, in_axes)
      if key not in pmapped:
        pmapped[key] = jax.pmap(
          method,
          axis_name=instance.pmap_axis_name,
          in_axes=in_axes,
          static_broadcasted_argnums=shifted_static,
          donate_argnums=shifted_donate,
        )
      return pmapped[key](instance, *args, **kwargs)

  return decorated
