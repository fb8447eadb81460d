"""Testing helpers: fake CPU devices and real multi-process JAX runs on one machine.

Two things every multi-device or multi-host test needs, which JAX leaves to
each project:

* **Fake devices.** :func:`set_cpu_device_count` (call it in ``conftest.py``,
  before any JAX computation) gives the process N CPU devices;
  :func:`fake_cpu_devices` returns them and raises a clear error when JAX has
  already started with fewer. The :func:`cpu_devices` pytest fixture does the
  same inside a test.
* **Real processes.** :func:`run_processes` starts P Python processes on this
  machine. Each gets D CPU devices, calls ``jax.distributed.initialize``
  against a coordinator on a free ``localhost`` port (cross-process
  collectives via gloo), runs the given importable function and sends back
  its return value. That is the runtime of a TPU pod slice or a GPU cluster
  (one controller process per host), so a test exercises the same paths:
  process-local input (``jax.make_array_from_process_local_data``),
  collectives between processes, Orbax's multi-process saves, agreement
  between processes. :class:`ProcessGroup` is the same launcher with the
  processes in your hands (send one a signal, wait for them yourself).

Example (the function must be importable by the children: defined at module
level in an importable module, or given as ``"package.module:function"``)::

    # tests/workers.py
    def train(num_steps):
      ...                                  # a TrainLoop on the global mesh
      return {"loss": float(loss), "process": jax.process_index()}

    # tests/test_two_hosts.py
    from loopkit.tools import testing
    from tests import workers

    def test_two_hosts_agree():
      out = testing.run_processes(workers.train, num_processes=2,
                                  devices_per_process=4, args=(10,))
      assert out[0]["loss"] == out[1]["loss"]

Failure handling: when a process raises, exits non-zero or dies, the
remaining ones are killed and :class:`MultiProcessError` is raised, naming
every process's fate and quoting the end of its stderr; past ``timeout_s``
all are killed and :class:`MultiProcessTimeout` is raised the same way.
Independently of the harness, the processes themselves do not wait forever
for a dead peer: JAX's coordination service notices missing heartbeats
within ``heartbeat_timeout_s`` and terminates the survivors with "the JAX
distributed service detected fatal errors ... another task died".

Cost: each process imports JAX and compiles its own programs (2-4 s of start-up
per process on a laptop-class CPU before your function runs).

Thread-safety: the helpers are for the test's main thread. The children run
with ``JAX_PLATFORMS=cpu``; nothing here touches accelerators.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

from loopkit.tools.fake_devices import cpu_devices, fake_cpu_devices, set_cpu_device_count
from loopkit.tools.processes import (
  _NOISE,
  MultiProcessError,
  MultiProcessTimeout,
  ProcessGroup,
  ProcessResult,
  free_port,
  run_processes,
)

__all__ = [
    "MultiProcessError", "MultiProcessTimeout", "ProcessGroup", "ProcessResult",
    "cpu_devices", "fake_cpu_devices", "free_port", "run_processes", "set_cpu_device_count",
]


# -- command line ------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
  """``python -m loopkit.tools.testing -n 2 -d 4 [--timeout_s S] -- MODULE [ARGS...]``.

  Runs ``python -m MODULE ARGS...`` as P local processes under
  ``jax.distributed`` (as :func:`run_processes` with a module target) and
  echoes their output as it comes, each line prefixed with ``[i]``.

  Returns:
    0 if every process succeeded, else 1 (after printing the failure report).
  """

  parser = argparse.ArgumentParser(
      prog="python -m loopkit.tools.testing",
      description="Run a Python module as P local JAX processes (CPU devices, gloo).")
  parser.add_argument("-n", "--num_processes", type=int, default=2)
  parser.add_argument("-d", "--devices_per_process", type=int, default=1)
  parser.add_argument("--timeout_s", type=float, default=3600.0)
  parser.add_argument("--heartbeat_timeout_s", type=int, default=100)
  parser.add_argument("module", help="the module to run as __main__, e.g. examples.resnet50.main")
  parser.add_argument("args", nargs=argparse.REMAINDER, help="the module's arguments")
  a = parser.parse_args(argv)
  group = ProcessGroup(a.module, num_processes=a.num_processes,
                       devices_per_process=a.devices_per_process, args=a.args,
                       heartbeat_timeout_s=a.heartbeat_timeout_s)
  with group:
    offsets: dict[tuple[int, str], int] = {}

    def echo() -> None:
      for i in range(group.num_processes):
        for name, stream in (("stdout", sys.stdout), ("stderr", sys.stderr)):
          path = os.path.join(group._dir or "", f"{name}_{i}.txt")  # pylint: disable=protected-access
          with open(path, "rb") as f:
            f.seek(offsets.get((i, name), 0))
            data = f.read()
          end = data.rfind(b"\n") + 1  # whole lines only
          offsets[(i, name)] = offsets.get((i, name), 0) + end
          for line in data[:end].decode("utf-8", "replace").splitlines():
            if not _NOISE.match(line):
              stream.write(f"[{i}] {line}\n")
          stream.flush()

    deadline = time.monotonic() + a.timeout_s
    while time.monotonic() < deadline:
      codes = group.poll()
      if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
        break
      echo()
      time.sleep(0.2)
    results = group.wait(a.timeout_s)  # kills the rest after a failure or at the deadline
    echo()
    try:
      group.check(results)
    except MultiProcessError as e:
      print(e, file=sys.stderr)
      return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
