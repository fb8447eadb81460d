"""Real multi-process JAX runs on one machine (see :mod:`loopkit.tools.testing`).

:func:`run_processes` starts P processes with D CPU devices each, connected by
``jax.distributed`` on localhost (gloo), runs an importable function in each and
returns their results; :class:`ProcessGroup` is the same launcher with the
processes in the caller's hands. For the test's main thread only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import pickle
import re
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from loopkit.tools.fake_devices import _with_count_flag

_SPEC_ENV = "LOOPKIT_TESTING_SPEC"
_ID_ENV = "LOOPKIT_TESTING_PROCESS_ID"
_CHILD = "from loopkit.tools.processes import _child_main; _child_main()"
_STDERR_TAIL_LINES = 40
# Dropped from failure messages: what every healthy gloo process prints, and the
# addresses of an abort's native stack trace.
_NOISE = re.compile(r"^\[Gloo\] Rank \d+ is connected to|^\s+@\s+0x[0-9a-f]+ ")
# What process 0 raises when the coordinator's port was taken after free_port().
_PORT_IN_USE = re.compile(r"Failed to start RPC server|address already in use", re.IGNORECASE)


def free_port() -> int:
  """A TCP port that is free on localhost now (the kernel picks it).

  Another program may take it before it is used; :func:`run_processes` retries
  with a new port when the coordinator cannot bind.
  """
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class MultiProcessError(RuntimeError):
  """A process of a :func:`run_processes` group failed.

  Attributes:
    results: one :class:`ProcessResult` per process, in process order.
  """

  def __init__(self, message: str, results: Sequence[ProcessResult]):
    super().__init__(message)
    self.results = list(results)


class MultiProcessTimeout(MultiProcessError, TimeoutError):
  """The processes did not all finish within ``timeout_s``; all were killed."""


@dataclasses.dataclass
class ProcessResult:
  """How one process ended.

  Attributes:
    process_id: ``jax.process_index()`` of the process.
    returncode: exit status; negative for a signal (``-6`` SIGABRT: JAX's
      coordination service terminated it; ``-9``: killed by the harness).
    value: the function's return value (unpickled), None on failure.
    error: the traceback the function raised, or None.
    stdout, stderr: everything the process printed (str).
    wall_s: seconds from the group's start to the process's end.
    killed: True if the harness killed it (timeout or another process failed).
  """

  process_id: int
  returncode: int | None
  value: Any = None
  error: str | None = None
  stdout: str = ""
  stderr: str = ""
  wall_s: float = 0.0
  killed: bool = False

  @property
  def ok(self) -> bool:
    """Exited with status 0 after the function returned."""
    return self.returncode == 0 and self.error is None and not self.killed

  def describe(self) -> str:
    """One line: how it ended, e.g. ``exit 1 after 3.2 s: ValueError: ...``."""
    if self.killed:
      how = "killed by loopkit.tools.testing"
    elif self.returncode is not None and self.returncode < 0:
      try:
        how = f"died of {signal.Signals(-self.returncode).name}"
      except ValueError:
        how = f"died of signal {-self.returncode}"
    else:
      how = f"exit {self.returncode}"
    line = f"process {self.process_id}: {how} after {self.wall_s:.1f} s"
    if self.error:
      line += ": " + self.error.strip().splitlines()[-1]
    return line


def _target_name(target: Callable | str) -> str:
  """``"module:qualname"`` for a function, or the string as given."""
  if isinstance(target, str):
    return target
  module = getattr(target, "__module__", None)
  qualname = getattr(target, "__qualname__", None)
  if not module or not qualname or "<locals>" in qualname or "<lambda>" in qualname:
    raise ValueError(f"{target!r} cannot be imported by a child process: pass a function "
                     "defined at module level, or a 'package.module:function' string")
  if module == "__main__":
    main_file = getattr(sys.modules["__main__"], "__file__", None)
    if not main_file:
      raise ValueError(f"{qualname} is defined in an interactive __main__; move it into an "
                       "importable module")
    module = "__file__:" + os.path.abspath(main_file)
  return f"{module}:{qualname}"


def _resolve(name: str) -> tuple[Callable | None, str | None]:
  """(function, None) for ``module:qualname``, (None, module) for a bare module."""
  if name.startswith("__file__:"):
    path, qualname = name[len("__file__:"):].rsplit(":", 1)
    namespace = runpy.run_path(path, run_name="__loopkit_target__")
    obj = namespace[qualname.split(".")[0]]
    for part in qualname.split(".")[1:]:
      obj = getattr(obj, part)
    return obj, None
  if ":" not in name:
    return None, name
  module, qualname = name.split(":", 1)
  obj = importlib.import_module(module)
  for part in qualname.split("."):
    obj = getattr(obj, part)
  return obj, None


class ProcessGroup:
  """P local processes running one function under ``jax.distributed``.

  The building block of :func:`run_processes`, for tests that need the
  processes while they run (e.g. to send one SIGTERM). Use it as a context
  manager: leaving the block kills any process still running.

  Args:
    target: the function every process runs, ``fn(*args, **kwargs)``: a
      module-level function, a ``"package.module:function"`` string, or a
      ``"package.module"`` string (run as ``__main__`` with
      ``sys.argv = [module, *args]``; ``SystemExit(0)`` counts as success).
      Its return value must be picklable.
    num_processes: P >= 1.
    devices_per_process: D >= 1 CPU devices in each process (the global mesh
      has P * D devices; process i owns ``jax.devices()[i*D:(i+1)*D]``).
    args, kwargs: passed to ``target`` (pickled; the same for every process).
    env: extra environment variables for the children.
    cwd: the children's working directory (default: this one).
    heartbeat_timeout_s: JAX's heartbeat timeout: after this long without a
      heartbeat from a process, the others are terminated by JAX (seconds).
    init_timeout_s: how long ``jax.distributed.initialize`` waits for all
      processes to connect (seconds).

  A target that calls ``jax.distributed.initialize()`` itself (a ``main`` meant
  for pods) should skip it when ``jax.distributed.is_initialized()``.

  Attributes:
    port: the coordinator's port; ``coordinator_address`` is ``localhost:<port>``.
    pids: the processes' OS ids once started.
    timed_out: whether the last :meth:`wait` hit its timeout.

  Not thread-safe.
  """

  def __init__(self, target: Callable | str, *, num_processes: int = 2,
               devices_per_process: int = 1, args: Sequence[Any] = (),
               kwargs: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None,
               cwd: str | None = None, heartbeat_timeout_s: int = 20,
               init_timeout_s: int = 60):
    if num_processes < 1 or devices_per_process < 1:
      raise ValueError(f"need num_processes >= 1 and devices_per_process >= 1, got "
                       f"{num_processes} and {devices_per_process}")
    self.target = _target_name(target)
    self.num_processes = int(num_processes)
    self.devices_per_process = int(devices_per_process)
    self.args = tuple(args)
    self.kwargs = dict(kwargs or {})
    self.env = dict(env or {})
    self.cwd = cwd
    self.heartbeat_timeout_s = int(heartbeat_timeout_s)
    self.init_timeout_s = int(init_timeout_s)
    self.port: int | None = None
    self._procs: list[subprocess.Popen] = []
    self._dir: str | None = None
    self._t0 = 0.0
    self._ended: dict[int, float] = {}
    self.timed_out = False
    self._timeout_s = 0.0

  @property
  def coordinator_address(self) -> str:
    return f"localhost:{self.port}"

  @property
  def pids(self) -> list[int]:
    return [p.pid for p in self._procs]

  def start(self) -> ProcessGroup:
    """Launches the processes (returns at once).

    Raises:
      RuntimeError: already started.
      pickle.PicklingError (or TypeError): ``args``/``kwargs`` cannot be pickled.
    """
    if self._procs:
      raise RuntimeError("this ProcessGroup was already started")
    self._dir = tempfile.mkdtemp(prefix="loopkit-processes-")
    self.port = free_port()
    spec = {"target": self.target, "args": self.args, "kwargs": self.kwargs,
            "num_processes": self.num_processes, "devices": self.devices_per_process,
            "coordinator": self.coordinator_address,
            "heartbeat_timeout_s": self.heartbeat_timeout_s,
            "init_timeout_s": self.init_timeout_s,
            "dir": self._dir}
    spec_path = os.path.join(self._dir, "spec.pkl")
    with open(spec_path, "wb") as f:
      pickle.dump(spec, f)
    self._t0 = time.monotonic()
    for i in range(self.num_processes):
      env = self._child_env(i, spec_path)
      out = open(os.path.join(self._dir, f"stdout_{i}.txt"), "wb")
      err = open(os.path.join(self._dir, f"stderr_{i}.txt"), "wb")
      with out, err:  # the child keeps its own descriptors
        self._procs.append(subprocess.Popen(
            [sys.executable, "-c", _CHILD], env=env, cwd=self.cwd, stdout=out, stderr=err,
            stdin=subprocess.DEVNULL, start_new_session=True))
    return self

  def _child_env(self, i: int, spec_path: str) -> dict[str, str]:
    env = dict(os.environ)
    path = [os.path.abspath(p or os.getcwd()) for p in sys.path]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(path))
    env["XLA_FLAGS"] = _with_count_flag(env.get("XLA_FLAGS", ""), self.devices_per_process)
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("JAX_NUM_CPU_DEVICES", None)
    env["PYTHONUNBUFFERED"] = "1"  # output reaches the files before an abort
    if any(k.lower() in ("http_proxy", "https_proxy", "grpc_proxy") for k in env):
      # gRPC would send the coordinator's local traffic through the proxy.
      for var in ("no_proxy", "NO_PROXY", "no_grpc_proxy"):
        env[var] = ",".join(filter(None, [env.get(var), "localhost", "127.0.0.1", "::1"]))
    env[_SPEC_ENV] = spec_path
    env[_ID_ENV] = str(i)
    env.update(self.env)
    return env

  def poll(self) -> list[int | None]:
    """Each process's exit status, None while it runs."""
    codes = [p.poll() for p in self._procs]
    now = time.monotonic()
    for i, c in enumerate(codes):
      if c is not None and i not in self._ended:
        self._ended[i] = now - self._t0
    return codes

  def send_signal(self, process_id: int, signum: int = signal.SIGTERM) -> None:
    """Sends ``signum`` to one process (e.g. SIGTERM, as a scheduler does)."""
    self._procs[process_id].send_signal(signum)

  def kill(self) -> list[int]:
    """Kills (SIGKILL, whole process group) every process still running.

    Returns:
      The process ids that were killed.
    """
    killed = []
    for i, p in enumerate(self._procs):
      if p.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
          os.killpg(p.pid, signal.SIGKILL)
        killed.append(i)
    for p in self._procs:
      with contextlib.suppress(subprocess.TimeoutExpired):
        p.wait(timeout=10)
    self.poll()
    return killed

  def wait(self, timeout_s: float = 120.0, *, stop_on_failure: bool = True,
           failure_grace_s: float = 1.0) -> list[ProcessResult]:
    """Waits for the processes and collects their results (never raises for them).

    Args:
      timeout_s: seconds from :meth:`start` after which all still running are
        killed (their results then have ``killed=True``).
      stop_on_failure: kill the others once one has failed (after
        ``failure_grace_s``, to let them print). False waits for each to end
        by itself (e.g. to test that JAX terminates the survivors).
      failure_grace_s: see ``stop_on_failure`` (seconds).

    Returns:
      One :class:`ProcessResult` per process, in process order.
    """
    deadline = self._t0 + timeout_s
    self._timeout_s = timeout_s
    self.timed_out = False
    failed_at = None
    killed: list[int] = []
    while True:
      codes = self.poll()
      if all(c is not None for c in codes):
        break
      now = time.monotonic()
      if failed_at is None and stop_on_failure and any(c not in (None, 0) for c in codes):
        failed_at = now
      if now >= deadline or (failed_at is not None and now - failed_at >= failure_grace_s):
        self.timed_out = failed_at is None
        killed = self.kill()
        break
      time.sleep(0.05)
    return [self._result(i, i in killed) for i in range(len(self._procs))]

  def _result(self, i: int, killed: bool) -> ProcessResult:
    directory = self._dir
    assert directory is not None  # started

    def read(name: str) -> str:
      try:
        with open(os.path.join(directory, name), "rb") as f:
          return f.read().decode("utf-8", "replace")
      except FileNotFoundError:
        return ""

    value, error = None, None
    try:
      with open(os.path.join(directory, f"result_{i}.pkl"), "rb") as f:
        status, payload = pickle.load(f)
      value, error = (payload, None) if status == "ok" else (None, payload)
    except FileNotFoundError:
      pass
    except Exception as e:  # pylint: disable=broad-except
      error = f"the result could not be unpickled: {type(e).__name__}: {e}"
    return ProcessResult(process_id=i, returncode=self._procs[i].returncode, value=value,
                         error=error, stdout=read(f"stdout_{i}.txt"),
                         stderr=read(f"stderr_{i}.txt"), wall_s=self._ended.get(i, 0.0),
                         killed=killed)

  def check(self, results: Sequence[ProcessResult]) -> list[Any]:
    """The values of ``results`` if all processes succeeded.

    Raises:
      MultiProcessTimeout: the last :meth:`wait` timed out.
      MultiProcessError: a process failed (message as in :func:`run_processes`).
    """
    if all(r.ok for r in results):
      return [r.value for r in results]
    what = (f"{self.num_processes} local process(es) x {self.devices_per_process} CPU "
            f"device(s) running {self.target}")
    if self.timed_out:
      raise MultiProcessTimeout(
          _failure_message(results, what=f"{what}: timed out after {self._timeout_s:g} s"),
          results)
    raise MultiProcessError(_failure_message(results, what=f"{what}: failed"), results)

  def cleanup(self) -> None:
    """Kills what still runs and deletes the group's temporary files."""
    self.kill()
    if self._dir is not None:
      shutil.rmtree(self._dir, ignore_errors=True)
      self._dir = None

  def __enter__(self) -> ProcessGroup:
    return self.start()

  def __exit__(self, *exc) -> None:
    self.cleanup()


def _failure_message(results: Sequence[ProcessResult], *, what: str,
                    tail_lines: int = _STDERR_TAIL_LINES) -> str:
  """The text of a :class:`MultiProcessError`: every process's fate and stderr tail."""
  lines = [what]
  lines += ["  " + r.describe() for r in results]
  # The processes that failed by themselves hold the cause; after a timeout,
  # every killed one's output shows where it was stuck.
  failed = [r for r in results if not r.ok and not r.killed] or [r for r in results if not r.ok]
  for r in failed:
    for name, text, n in (("stdout", r.stdout, 10), ("stderr", r.stderr, tail_lines)):
      kept = [ln for ln in text.splitlines() if not _NOISE.match(ln)]
      if kept or name == "stderr":
        lines.append(f"--- process {r.process_id} {name} (last {n} lines) ---")
        lines += kept[-n:] or ["<empty>"]
  return "\n".join(lines)


def run_processes(target: Callable | str, *, num_processes: int = 2,
                  devices_per_process: int = 1, args: Sequence[Any] = (),
                  kwargs: Mapping[str, Any] | None = None, timeout_s: float = 120.0,
                  env: Mapping[str, str] | None = None, cwd: str | None = None,
                  heartbeat_timeout_s: int = 20, init_timeout_s: int = 60,
                  port_retries: int = 2) -> list[Any]:
  """Runs ``target`` in P local processes under ``jax.distributed``; returns their values.

  Each process i: gets ``devices_per_process`` CPU devices
  (``XLA_FLAGS=--xla_force_host_platform_device_count=D``), sets
  ``jax_cpu_collectives_implementation="gloo"``, calls
  ``jax.distributed.initialize(coordinator_address="localhost:<free port>",
  num_processes=P, process_id=i, ...)``, then ``target(*args, **kwargs)``, then
  ``jax.distributed.shutdown()`` (a barrier: all end together).

  Args:
    target: a module-level function, ``"package.module:function"``, or
      ``"package.module"`` (run as ``__main__``); see :class:`ProcessGroup`.
    num_processes: P >= 1.
    devices_per_process: D >= 1 CPU devices per process.
    args: positional arguments of ``target`` (picklable).
    kwargs: keyword arguments of ``target`` (picklable).
    timeout_s: wall-clock limit for the whole group (seconds, from launch).
    env: extra environment variables for the children.
    cwd: the children's working directory.
    heartbeat_timeout_s: JAX's heartbeat timeout (seconds): a process silent
      that long is declared dead and JAX terminates the others.
    init_timeout_s: how long ``jax.distributed.initialize`` waits for all
      processes to connect (seconds).
    port_retries: relaunches with a new port when the coordinator's port was
      taken in the meantime.

  Returns:
    The return values, in process order (``[value of process 0, ...]``).

  Raises:
    MultiProcessTimeout: not all finished within ``timeout_s`` (all killed).
    MultiProcessError: a process raised, exited non-zero or died; the others
      were killed. The message names each process's fate (exit status,
      signal, exception) and quotes the end of each failed one's stderr.
    ValueError: ``target`` is not importable by a child (a lambda, a local
      function), or bad counts.
  """
  for attempt in range(port_retries + 1):
    group = ProcessGroup(target, num_processes=num_processes,
                         devices_per_process=devices_per_process, args=args, kwargs=kwargs,
                         env=env, cwd=cwd, heartbeat_timeout_s=heartbeat_timeout_s,
                         init_timeout_s=init_timeout_s)
    with group:
      results = group.wait(timeout_s)
    port_taken = bool(results[0].error and _PORT_IN_USE.search(results[0].error))
    if port_taken and not group.timed_out and attempt < port_retries:
      continue
    return group.check(results)
  raise AssertionError("unreachable")  # pragma: no cover


# -- the child side ------------------------------------------------------------------


def _child_main() -> None:
  """Entry point of a child process (``python -c``); not for direct use."""
  with open(os.environ[_SPEC_ENV], "rb") as f:
    spec = pickle.load(f)
  i = int(os.environ[_ID_ENV])
  result_path = os.path.join(spec["dir"], f"result_{i}.pkl")

  def write(status: str, payload: Any) -> None:
    tmp = result_path + ".tmp"
    with open(tmp, "wb") as f:
      pickle.dump((status, payload), f)
    os.replace(tmp, result_path)

  try:
    import jax  # pylint: disable=g-import-not-at-top
    jax.config.update("jax_num_cpu_devices", spec["devices"])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=spec["coordinator"], num_processes=spec["num_processes"],
        process_id=i, initialization_timeout=spec["init_timeout_s"],
        heartbeat_timeout_seconds=spec["heartbeat_timeout_s"],
        shutdown_timeout_seconds=max(spec["heartbeat_timeout_s"], 10))
    if (jax.process_count(), jax.local_device_count()) != (spec["num_processes"],
                                                           spec["devices"]):
      raise RuntimeError(
          f"jax.distributed started with {jax.process_count()} processes x "
          f"{jax.local_device_count()} devices, expected {spec['num_processes']} x "
          f"{spec['devices']}")
    fn, module = _resolve(spec["target"])
    if fn is not None:
      value = fn(*spec["args"], **spec["kwargs"])
    else:
      assert module is not None  # _resolve gives one of the two
      sys.argv = [module] + [str(a) for a in spec["args"]]
      try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
      except SystemExit as e:
        if e.code not in (None, 0):
          raise
      value = None
    payload = pickle.dumps(value)  # fail here, not in the parent, if unpicklable
    del payload
    write("ok", value)
    jax.distributed.shutdown()  # a barrier: no process leaves while others compute
  except BaseException:  # pylint: disable=broad-except
    tb = traceback.format_exc()
    sys.stderr.write(tb)
    with contextlib.suppress(Exception):
      write("error", tb)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)  # no atexit: a shutdown barrier would wait for the others
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(0)  # skip atexit handlers that could wait on threads the target left running
