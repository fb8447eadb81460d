"""Every private JAX, Orbax and CLU API loopkit uses, each behind a feature probe with a fallback.

loopkit runs on the JAX, Flax and Orbax releases from its pyproject floors to the newest (CI runs
both ends). Where a public API does the job it is used directly; the few private ones that remain
live here, each looked up once (the probe) with a fallback that keeps loopkit correct when a
release removes or renames it, and each probed by ``tests/test_compat.py`` so that a release that
changes one fails a named test instead of silently taking the fallback:

=============================  ===================================  ==============================
what                           private API (why no public one)      fallback
=============================  ===================================  ==============================
:data:`batched_device_put`     ``pxla.batched_device_put``: the     ``None``: the feeder calls
                               transfer under ``jax.device_put``    ``jax.device_put`` (about
                               without its ~35 us per leaf of       35 us more per leaf per chunk)
                               Python checks
:func:`source_info_context`    ``source_info_util.user_context``:   a null context: rewritten
                               keeps each equation's source line    equations lose their source
                               and name stack when conv_layout      line and name (metadata only,
                               re-binds a jaxpr                     same numbers)
:func:`backends_initialized`   ``xla_bridge.backends_are_           "initialized" once JAX is
                               initialized``: JAX has no public     imported: the device count is
                               "are backends up" query              then checked, not set
:func:`orbax_commit_futures`   Orbax's ``_async_manager.            ``manager.wait_until_
                               _commit_futures``: waits for a       finished()`` with its error
                               failed save's other writers          swallowed
:func:`coordination_client`    ``distributed.global_state``'s       None: the processes agree
                               ``client``: the key-value store of   through a device all-gather,
                               the coordination service that        which waits for the program
                               ``jax.distributed`` runs (JAX's      in flight
                               preemption sync point uses it too)
:func:`clu_wrapped_writers`    CLU's ``MultiWriter._writers``,      None: a CLU writer counts as
                               ``AsyncWriter._writer``: the         not printing, and the hooks
                               writers a CLU writer wraps (is a     log their rows themselves
                               ``LoggingWriter`` among them?)       (printed twice under absl)
=============================  ===================================  ==============================

Public replacements (no private use left): :func:`addressable_devices` (was
``NamedSharding._addressable_device_assignment``), :func:`lowering_count` (JAX's public
``jax.monitoring`` events; was ``jit._cache_size()`` for the evaluator).

Thread-safe (module constants; :func:`lowering_count` is a counter bumped by JAX's listener).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Callable
from typing import Any

import jax


def _probe(module: str, attr: str) -> Any:
  """``module.attr`` if importable, else None."""
  try:
    return getattr(importlib.import_module(module), attr, None)
  except ImportError:
    return None


# -- device transfer --------------------------------------------------------------

batched_device_put: Callable[..., jax.Array] | None = _probe(
    "jax._src.interpreters.pxla", "batched_device_put")
"""``batched_device_put(aval, sharding, shards, devices)``: one array from per-device shards, the
transfer ``jax.device_put`` ends in; None when this JAX has none (callers use ``jax.device_put``).
Its result is checked against ``jax.device_put`` by the caller (``loopkit.data.feeding``)."""


def addressable_devices(sharding: jax.sharding.NamedSharding) -> list[Any]:
  """This process's devices of ``sharding`` in the order of its device assignment.

  The order ``batched_device_put`` takes the shards in (JAX's private
  ``_addressable_device_assignment``): the mesh's devices in row-major order, those of this
  process kept. Public API only.
  """
  me = jax.process_index()
  return [d for d in sharding.mesh.devices.flat if d.process_index == me]


# -- jaxpr re-binding (loopkit.conv_layout) -----------------------------------------

_source_info_util = _probe("jax._src", "source_info_util")
_user_context = getattr(_source_info_util, "user_context", None)
_current_name_stack = getattr(_source_info_util, "current_name_stack", None)


def source_info_context(eqn: Any) -> contextlib.AbstractContextManager:
  """A context in which binding ``eqn``'s primitive again keeps its source line and name stack.

  Args:
    eqn: a jaxpr equation (``jax.extend.core.JaxprEqn``).

  Returns:
    JAX's ``source_info_util.user_context`` for the equation where this JAX has it, else a null
    context (the equations then carry the caller's source info: metadata only).
  """
  if _user_context is None or _current_name_stack is None:
    return contextlib.nullcontext()
  info = eqn.source_info
  return _user_context(info.traceback, name_stack=_current_name_stack() + info.name_stack)


# -- backends (loopkit.tools.testing) --------------------------------------------------------

_backends_are_initialized = _probe("jax._src.xla_bridge", "backends_are_initialized")


def backends_initialized() -> bool:
  """Whether JAX has created its backends (after which the CPU device count is fixed).

  False while JAX is not imported. Without JAX's private query, True once JAX is imported: the
  caller then checks the device count it gets instead of setting it.
  """
  if "jax" not in sys.modules:  # pragma: no cover  (this module imports jax)
    return False
  if _backends_are_initialized is None:
    return True
  return bool(_backends_are_initialized())


# -- compile counting (public) -------------------------------------------------------------

LOWERING_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
"""The ``jax.monitoring`` duration event JAX records once per lowering (jaxpr to an XLA module,
the first stage of every compile, also when the persistent compilation cache then supplies the
executable)."""
_lowerings = [0]


def _count_lowering(event: str, duration_secs: float, **kwargs: Any) -> None:
  del duration_secs, kwargs
  if event == LOWERING_EVENT:
    _lowerings[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_lowering)


def lowering_count() -> int:
  """JAX lowerings so far in this process (see :data:`LOWERING_EVENT`).

  The difference around one call tells whether that call compiled. Public API
  (``jax.monitoring``); ``tests/test_compat.py`` checks that JAX still records the event.
  """
  return _lowerings[0]


# -- Orbax (loopkit.checkpoint) -------------------------------------------------------------


def orbax_commit_futures(manager: Any) -> list[Any] | None:
  """The futures of the item writes of ``manager``'s save in flight, or None where not found.

  Orbax's private ``CheckpointManager._checkpointer._async_manager._commit_futures``.
  """
  async_manager = getattr(getattr(manager, "_checkpointer", None), "_async_manager", None)
  if async_manager is None or not hasattr(async_manager, "_commit_futures"):
    return None
  return list(async_manager._commit_futures or ())  # None between saves


def wait_for_orbax_writers(manager: Any, timeout_s: float = 60.0) -> None:
  """After a failed save, waits (best effort) for that save's other writers.

  Orbax raises the first failing item's error while the other items' writes may still run;
  waiting for them keeps them from writing into a directory that is about to be removed or
  reused. Waits on each write's future (:func:`orbax_commit_futures`); where this Orbax has none,
  on ``manager.wait_until_finished()`` (public), whose error (the failure already raised) is
  dropped.
  """
  futures = orbax_commit_futures(manager)
  if futures is None:
    with contextlib.suppress(Exception):
      manager.wait_until_finished()
    return
  for f in futures:
    with contextlib.suppress(Exception):  # the first error was raised already
      f.result(timeout=timeout_s)


# -- the transfer guard ----------------------------------------------------------

_config = _probe("jax._src", "config")
_host_to_device_guard = getattr(_config, "transfer_guard_host_to_device", None)


def host_to_device_guard() -> str | None:
  """This thread's host-to-device transfer guard: ``jax.transfer_guard(...)`` or
  ``jax_transfer_guard*`` (None or ``"allow"``: implicit transfers allowed).

  Returns ``"unknown"`` where this JAX keeps the setting elsewhere (callers then
  place explicitly, which every guard allows).
  """
  value = getattr(_host_to_device_guard, "value", "unknown")
  return value if value is None or isinstance(value, str) else "unknown"


# -- the coordination service -------------------------------------------------------

_distributed = _probe("jax._src", "distributed")
_CLIENT_METHODS = ("key_value_set", "blocking_key_value_get", "key_value_delete")


def coordination_client() -> Any | None:
  """The client of the coordination service that ``jax.distributed.initialize`` started.

  A key-value store on the coordinator process, reached over the network by the host alone
  (no device work, so nothing waits for a program in flight); JAX's preemption sync point
  and Orbax's multi-process barriers use the same service. Methods used:
  ``key_value_set(key, value)``, ``blocking_key_value_get(key, timeout_in_ms)``,
  ``key_value_delete(key)``.

  Returns:
    The client, or None when ``jax.distributed`` is not initialised or this JAX keeps it
    elsewhere (callers then use a device collective).
  """
  client = getattr(getattr(_distributed, "global_state", None), "client", None)
  if client is None or not all(callable(getattr(client, m, None)) for m in _CLIENT_METHODS):
    return None
  return client


# -- CLU's writers (loopkit.observe.writers.prints_to_console) ------------------------------


def clu_wrapped_writers(writer: Any) -> list[Any] | None:
  """The writers a CLU writer wraps, or None when ``writer`` is not a CLU wrapper or they are
  not found.

  CLU's ``MultiWriter`` and ``AsyncMultiWriter`` (what ``metric_writers.create_default_writer``
  returns) keep theirs in the private ``_writers``, ``AsyncWriter`` its one in ``_writer``.
  CLU is never imported here: a CLU writer's modules are loaded when one exists.
  """
  multi = getattr(sys.modules.get("clu.metric_writers.multi_writer"), "MultiWriter", None)
  if isinstance(multi, type) and isinstance(writer, multi):
    inner = getattr(writer, "_writers", None)
    return list(inner) if isinstance(inner, (list, tuple)) else None
  single = getattr(sys.modules.get("clu.metric_writers.async_writer"), "AsyncWriter", None)
  if isinstance(single, type) and isinstance(writer, single):
    inner = getattr(writer, "_writer", None)
    return None if inner is None else [inner]
  return None
