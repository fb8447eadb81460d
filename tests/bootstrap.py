"""The one start of every Python subprocess the tests run: workers, generated scripts, ``-c`` code.

A child started here runs on CPU, imports this repository's loopkit, and has its fake device
count set by :func:`loopkit.tools.testing.set_cpu_device_count` before its own code runs (no
hand-written ``XLA_FLAGS`` line; the count flag inherited from conftest.py is replaced).

Parent side (in a test)::

    out = subprocess.run(bootstrap.command("-c", CODE, str(tmp_path), devices=1),
                         env=bootstrap.env(), capture_output=True, text=True)
    out = subprocess.run(bootstrap.command(script_path, "--flag", devices=2), env=bootstrap.env())

Child side: ``python tests/bootstrap.py --devices N (-c CODE | SCRIPT) [ARGS...]`` sets the
count, then runs CODE or SCRIPT as ``__main__`` with ``sys.argv`` and ``sys.path[0]`` as
``python -c CODE ARGS`` or ``python SCRIPT ARGS`` would have them. A worker that parses its own
device count calls :func:`start` in its ``__main__`` block instead, before importing JAX.

The one exception is tests/test_fake_devices.py, which tests set_cpu_device_count itself in a
fresh process whose ``XLA_FLAGS`` name another count. Fresh interpreters whose import state is
the subject (tests/test_extras.py blocks packages before loopkit is imported,
tests/test_compat.py asks whether JAX's backends exist before the first device query) and
tools run as subprocesses (mypy, Sphinx, pytest) start directly.
"""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Mapping

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SELF = os.path.abspath(__file__)


def start(devices: int) -> None:
  """In a child, before any JAX computation: CPU only, the repository importable, ``devices``
  fake CPU devices (``loopkit.tools.testing.set_cpu_device_count``)."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if ROOT not in sys.path:
    sys.path.insert(1, ROOT)  # where PYTHONPATH puts it: after the script's directory
  from loopkit.tools.testing import set_cpu_device_count  # pylint: disable=g-import-not-at-top
  set_cpu_device_count(devices)


def env(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
  """A child's environment: ``base`` (default: this process's) with ``PYTHONPATH`` the
  repository, ``JAX_PLATFORMS=cpu`` unless set, then ``extra``."""
  out = dict(os.environ if base is None else base)
  out["PYTHONPATH"] = ROOT
  out.setdefault("JAX_PLATFORMS", "cpu")
  out.update(extra)
  return out


def command(*argv: str | os.PathLike, devices: int) -> list[str]:
  """The command line running ``python *argv`` (``"-c", CODE, ...`` or ``SCRIPT, ...``)
  through :func:`start` with ``devices`` fake CPU devices."""
  return [sys.executable, _SELF, "--devices", str(int(devices)), *map(str, argv)]


def main(argv: list[str]) -> None:
  """``--devices N (-c CODE | SCRIPT) [ARGS...]``: see the module docstring."""
  if len(argv) < 3 or argv[0] != "--devices" or (argv[2] == "-c" and len(argv) < 4):
    raise SystemExit("usage: bootstrap.py --devices N (-c CODE | SCRIPT) [ARGS...]")
  devices, target, rest = int(argv[1]), argv[2], argv[3:]
  if target == "-c":
    code, rest = rest[0], rest[1:]
    sys.argv, sys.path[0] = ["-c", *rest], ""
  else:
    sys.argv, sys.path[0] = [target, *rest], os.path.dirname(os.path.abspath(target))
  start(devices)
  module, filename = types.ModuleType("__main__"), "<string>"
  if target != "-c":
    with open(target, encoding="utf-8") as f:
      code = f.read()
    module.__file__ = filename = target
  # A __main__ that lives until the interpreter exits, as the script's own would (runpy would
  # drop its globals when the script returns, finalizing what they hold before exit).
  sys.modules["__main__"] = module
  exec(compile(code, filename, "exec"), module.__dict__)  # noqa: S102  (python -c / SCRIPT)


if __name__ == "__main__":
  main(sys.argv[1:])
