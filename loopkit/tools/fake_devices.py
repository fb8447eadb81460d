"""Fake CPU devices for tests: N CPU devices in this process (see :mod:`loopkit.tools.testing`).

Not thread-safe: call before JAX starts, from the main thread.
"""

from __future__ import annotations

import os
import re
import sys

_COUNT_FLAG = "--xla_force_host_platform_device_count"


def _backends_initialized() -> bool:
  """Whether JAX has created its backends (after which the device count is fixed)."""
  if "jax" not in sys.modules:
    return False
  from loopkit._internal import compat  # pylint: disable=g-import-not-at-top  (imports jax)
  return compat.backends_initialized()


def _with_count_flag(xla_flags: str, n: int) -> str:
  """``xla_flags`` with the host device count flag set to ``n`` (replaced if present)."""
  kept = [f for f in xla_flags.split() if not f.startswith(_COUNT_FLAG)]
  return " ".join(kept + [f"{_COUNT_FLAG}={n}"])


def set_cpu_device_count(n: int) -> None:
  """Makes JAX start with ``n`` CPU devices; call before any JAX computation.

  Sets ``--xla_force_host_platform_device_count=n`` in ``XLA_FLAGS`` (replacing
  a previous count) and, if JAX is imported, the ``jax_num_cpu_devices``
  option. Importing JAX is fine; creating an array or listing devices is not.
  Put it at the top of ``conftest.py``.

  Args:
    n: the number of CPU devices (>= 1).

  Raises:
    ValueError: ``n < 1``.
    RuntimeError: JAX's backends are already initialised with a different
      number of CPU devices (the message says where to call this instead).
  """
  n = int(n)
  if n < 1:
    raise ValueError(f"the CPU device count must be >= 1, got {n}")
  if _backends_initialized():
    import jax  # pylint: disable=g-import-not-at-top
    have = len(jax.devices("cpu"))
    if have != n:
      raise RuntimeError(_too_late(have, n))
    return
  os.environ["XLA_FLAGS"] = _with_count_flag(os.environ.get("XLA_FLAGS", ""), n)
  if "jax" in sys.modules:
    import jax  # pylint: disable=g-import-not-at-top
    jax.config.update("jax_num_cpu_devices", n)


def _too_late(have: int, want: int) -> str:
  return (f"JAX is already initialised with {have} CPU device(s); {want} are needed. The "
          "device count is fixed when JAX first runs something, so call "
          f"loopkit.tools.testing.set_cpu_device_count({want}) at the top of conftest.py (or set "
          f"XLA_FLAGS={_COUNT_FLAG}={want}) before any JAX computation")


def fake_cpu_devices(n: int) -> list:
  """``n`` CPU devices, configuring them first if JAX has not started yet.

  Args:
    n: the number of devices wanted (>= 1).

  Returns:
    ``jax.devices("cpu")[:n]``, a list of ``n`` ``jax.Device``; build meshes
    from it, e.g. ``jax.make_mesh((n,), ("data",), devices=...)``.

  Raises:
    ValueError: ``n < 1``.
    RuntimeError: JAX already started with fewer than ``n`` CPU devices.
  """
  n = int(n)
  if n < 1:
    raise ValueError(f"the CPU device count must be >= 1, got {n}")
  if not _backends_initialized():
    set_cpu_device_count(max(n, _configured_count()))
  import jax  # pylint: disable=g-import-not-at-top
  devices = jax.devices("cpu")
  if len(devices) < n:
    raise RuntimeError(_too_late(len(devices), n))
  return devices[:n]


def _configured_count() -> int:
  """The device count already asked for in ``XLA_FLAGS`` (1 if none)."""
  m = re.search(_COUNT_FLAG + r"=(\d+)", os.environ.get("XLA_FLAGS", ""))
  return int(m.group(1)) if m else 1


try:  # the fixture exists only where pytest does
  import pytest as _pytest
except ImportError:  # pragma: no cover
  _pytest = None  # type: ignore[assignment]

if _pytest is not None:

  @_pytest.fixture
  def cpu_devices(request):
    """Pytest fixture: a list of fake CPU devices (8, or ``request.param``).

    Use it by importing it into a test module or conftest
    (``from loopkit.tools.testing import cpu_devices``) or with
    ``pytest_plugins = ["loopkit.tools.testing"]``. Choose the count with indirect
    parametrisation: ``@pytest.mark.parametrize("cpu_devices", [2], indirect=True)``.
    Raises RuntimeError (see :func:`fake_cpu_devices`) when JAX started with too
    few devices.
    """
    return fake_cpu_devices(getattr(request, "param", 8))
else:  # pragma: no cover
  cpu_devices = None
