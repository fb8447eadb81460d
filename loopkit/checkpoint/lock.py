"""Who may write a checkpoint directory: a writability probe and a lock, at run start.

:func:`claim` runs in :meth:`loopkit.CheckpointHook.on_run_start`, before
any step and before the hook removes unfinished saves (which would otherwise
delete a live run's save in progress):

* every process creates the directory if missing and writes (then removes) one
  small file in it, so an unwritable directory (read-only, a path under a
  regular file, no permission, a full disk) fails in milliseconds, naming the
  path and the reason, instead of at the first save (where Orbax waits out its
  300 s signal time-outs);
* process 0 takes the lock ``.loopkit-lock.json``: a JSON record of the
  holder's host, pid, process start time, the time it took the lock and a
  heartbeat, created atomically (written to a temporary file, then
  ``os.link``-ed into place, which fails if the lock exists; on non-local
  paths such as ``gs://`` a check and a write, which leaves a small race).
  A lock that exists blocks unless it is stale: on this host, its pid is not
  alive (or is a reused pid: another start time), or it is this very process's
  (an earlier run in the same process that did not get to release it); on
  another host, its heartbeat is older than ``stale_after_s``. A daemon thread
  of the holder refreshes the heartbeat every ``heartbeat_s``.

On several processes the outcome is one ``process_allgather`` of every
process's problem (as JSON bytes): every process gets the same list, so the
run start fails on every process, with the same message, or on none.

The lock is released (the file removed, only if it is still ours) at run end,
at a run error and at interpreter exit; a killed run's lock is stale at once on
its host, and after ``stale_after_s`` seen from another host.

Thread-safety: one :class:`DirectoryLock` per hook; its heartbeat thread and
the caller synchronise on an internal lock.
"""

from __future__ import annotations

import atexit
import datetime
import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

import jax

from loopkit._internal.extras import missing
from loopkit.checkpoint.items import _allgather_json

try:
  from etils import epath
except ImportError as e:
  raise missing(e, "loopkit.checkpoint") from e

log = logging.getLogger("loopkit")

LOCK_FILE = ".loopkit-lock.json"
_PROBE = ".loopkit-write-probe"


def _start_time(pid: int) -> str | None:
  """The process's start time in clock ticks since boot (Linux ``/proc``), else None."""
  try:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
      return f.read().rsplit(")", 1)[1].split()[19]
  except (OSError, IndexError):
    return None


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # alive, another user's
    return True
  return True


def _when(t: float) -> str:
  return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime(
      "%Y-%m-%d %H:%M:%S UTC")


def describe(holder: dict[str, Any], now: float | None = None) -> str:
  """``host H, pid P, since T (heartbeat N s ago)`` of a lock record."""
  now = time.time() if now is None else now
  return (f"host {holder.get('host')}, pid {holder.get('pid')}, since "
          f"{_when(float(holder.get('since', 0)))} (heartbeat "
          f"{now - float(holder.get('heartbeat', 0)):.0f} s ago)")


def stale_reason(holder: dict[str, Any], stale_after_s: float,
                 now: float | None = None) -> str | None:
  """Why a lock record no longer holds the directory, or None if its run is live."""
  now = time.time() if now is None else now
  if holder.get("host") == socket.gethostname():
    pid = int(holder.get("pid", -1))
    if pid == os.getpid():
      return "it is this process's own (an earlier run that did not release it)"
    if not _pid_alive(pid):
      return f"pid {pid} is not alive on this host"
    started = holder.get("start_time")
    if started is not None and _start_time(pid) not in (None, started):
      return f"pid {pid} is another process now (another start time)"
    return None
  age = now - float(holder.get("heartbeat", 0))
  if age > stale_after_s:
    return f"its heartbeat is {age:.0f} s old (> {stale_after_s:g} s)"
  return None


def _read(path: epath.Path) -> dict[str, Any] | None:
  try:
    return json.loads(path.read_text())
  except FileNotFoundError:
    return None
  except (OSError, ValueError) as e:  # a torn or foreign file: name it, treat it as a holder
    return {"host": "?", "pid": -1, "since": 0, "heartbeat": 0, "unreadable": repr(e)}


def holder_of(directory: epath.Path) -> dict[str, Any] | None:
  """The lock record in ``directory`` (live or stale), or None."""
  return _read(directory / LOCK_FILE)


def _local(p: epath.Path) -> bool:
  return "://" not in str(p)


class DirectoryLock:
  """The lock of one checkpoint directory, held by one hook during a run.

  Args:
    directory: the (absolute) checkpoint directory.
    heartbeat_s: seconds between the holder's heartbeats.
    stale_after_s: a lock from another host whose heartbeat is older is stale.
  """

  def __init__(self, directory: epath.Path, *, heartbeat_s: float = 30.0,
               stale_after_s: float = 300.0):
    self.directory = directory
    self.path = directory / LOCK_FILE
    self.heartbeat_s = heartbeat_s
    self.stale_after_s = stale_after_s
    self.token: str | None = None
    self._record: dict[str, Any] = {}
    self._mutex = threading.Lock()
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self._atexit = False

  @property
  def held(self) -> bool:
    return self.token is not None

  def _write_new(self, record: dict[str, Any]) -> bool:
    """Creates the lock file with ``record`` unless it exists; True if created."""
    tmp = self.directory / f"{LOCK_FILE}.{record['token']}.tmp"
    tmp.write_text(json.dumps(record))
    try:
      if _local(self.path):
        try:
          os.link(tmp, self.path)
          return True
        except FileExistsError:
          return False
      if self.path.exists():
        return False
      tmp.rename(self.path)
      return True
    finally:
      tmp.unlink(missing_ok=True)

  def acquire(self) -> str | None:
    """Takes the lock; returns None, or why not (naming the holder).

    Raises:
      OSError: the directory is not writable (the caller reports it).
    """
    if self.held:
      return None
    now = time.time()
    record = {"host": socket.gethostname(), "pid": os.getpid(), "process": jax.process_index(),
              "processes": jax.process_count(), "start_time": _start_time(os.getpid()),
              "since": now, "heartbeat": now, "token": uuid.uuid4().hex}
    for _ in range(3):  # a stale lock is moved aside (atomically: one taker wins), then retried
      if self._write_new(record):
        break
      holder = _read(self.path)
      if holder is None:
        continue
      reason = stale_reason(holder, self.stale_after_s)
      if reason is None:
        return (f"checkpoint directory {self.directory} is in use by another run: "
                f"{describe(holder)} holds {self.path}. Wait for it to end, or use another "
                "directory; a killed run's lock does not block (on its host at once, "
                f"elsewhere after {self.stale_after_s:g} s without heartbeat)")
      own = holder.get("pid") == os.getpid() and holder.get("host") == record["host"]
      log.log(logging.INFO if own else logging.WARNING,
              "taking over the stale checkpoint lock %s of %s: %s", self.path,
              describe(holder), reason)
      aside = self.directory / f"{LOCK_FILE}.{record['token']}.stale"
      try:
        self.path.rename(aside)
        aside.unlink(missing_ok=True)
      except FileNotFoundError:
        pass  # another taker moved it first
    else:
      return f"could not take the checkpoint lock {self.path} (it keeps changing)"
    self.token, self._record = record["token"], record
    self._stop.clear()
    self._thread = threading.Thread(target=self._beat, name="loopkit-checkpoint-lock",
                                    daemon=True)
    self._thread.start()
    if not self._atexit:
      atexit.register(self.release)
      self._atexit = True
    return None

  def _beat(self) -> None:
    while not self._stop.wait(self.heartbeat_s):
      with self._mutex:
        if self.token is None:
          return
        holder = _read(self.path)
        if holder is None or holder.get("token") != self.token:
          log.warning("the checkpoint lock %s is no longer this run's", self.path)
          return
        self._record["heartbeat"] = time.time()
        tmp = self.directory / f"{LOCK_FILE}.{self.token}.tmp"
        try:
          tmp.write_text(json.dumps(self._record))
          tmp.replace(self.path)  # atomically
        except OSError as e:
          log.warning("could not refresh the checkpoint lock %s: %s", self.path, e)

  def release(self) -> None:
    """Removes the lock file if it is still this hook's; stops the heartbeat."""
    self._stop.set()
    with self._mutex:
      token, self.token = self.token, None
      if token is None:
        return
      try:
        holder = _read(self.path)
        if holder is not None and holder.get("token") == token:
          self.path.unlink(missing_ok=True)
      except OSError as e:
        log.warning("could not remove the checkpoint lock %s: %s", self.path, e)
    thread, self._thread = self._thread, None
    if thread is not None and thread is not threading.current_thread():
      thread.join(timeout=5)


def _probe(directory: epath.Path) -> None:
  """Creates ``directory`` if missing and writes and removes one small file in it."""
  directory.mkdir(parents=True, exist_ok=True)
  p = directory / f"{_PROBE}.{socket.gethostname()}.{os.getpid()}"
  p.write_text("loopkit checks that it can write here\n")
  p.unlink()


def claim(directory: epath.Path, lock: DirectoryLock) -> str | None:
  """Checks that ``directory`` is writable on every process and takes its lock on process 0.

  Every process must call it (a collective on several processes).

  Returns:
    None, or the problem (the same text on every process): the directory's
    path and why it is unwritable, or the lock's holder (host, pid, since).
  """
  problem = None
  try:
    _probe(directory)
    if jax.process_index() == 0:
      problem = lock.acquire()
  except OSError as e:
    problem = (f"checkpoint directory {directory} is not writable: {type(e).__name__}: "
               f"{e.strerror or e}" + (f" ({e.filename})" if e.filename else ""))
  if jax.process_count() == 1:
    return problem
  problems = _allgather_json(problem)
  failed = [f"process {i}: {p}" for i, p in enumerate(problems) if p is not None]
  if failed and lock.held:
    lock.release()
  return "; ".join(failed) or None
