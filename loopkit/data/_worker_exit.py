"""Worker processes that exit with the process that started them, however it died.

:func:`exit_with_parent` is the ``worker_init_fn`` loopkit gives Grain's ``mp_prefetch``
(:class:`loopkit.data.GrainSource`): it runs first thing in each worker process and starts a
daemon thread there that ends the worker (``os._exit``) as soon as its parent is gone. A
worker's own loop only stops when the parent asks (Grain's stop event), so without it a
parent killed with ``SIGKILL`` (or by the OOM killer) leaves its workers running, and with
them multiprocessing's resource tracker, which exits only when every process holding its
pipe (the workers hold it) has exited. With this watch the workers exit within a moment of
the parent's death, the tracker then reads the end of its pipe, unlinks the shared memory
and semaphores the dead processes left, and exits too.

How the worker notices (multiprocessing's own parent-death signal, on every OS):
``multiprocessing.parent_process().sentinel`` is the read end of a pipe whose write end only
the parent holds, so it becomes readable when the parent's process ends, whatever ended it.
As a second check the watch compares ``os.getppid()`` with the pid it started under once a
second (for a dead parent whose write end a process it forked still holds).

Why not Linux's ``prctl(PR_SET_PDEATHSIG)``: it fires when the *thread* that created the child
ends, not when the process does, and Grain starts its worker processes from one of its own
prefetch threads (seen with grain 0.2.18), whose lifetime is Grain's to choose: a worker could be
killed under a live run.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from multiprocessing import connection

# How often the watch also compares the parent pid (s); the sentinel wakes it at once.
_PPID_CHECK_SECS = 1.0


def exit_with_parent(worker_index: int = 0, worker_count: int = 1) -> None:
  """Ends this process as soon as the process that started it has ended.

  Grain's ``worker_init_fn`` signature (``mp_prefetch(options, worker_init_fn=...)``); the
  arguments are not used. Does nothing in a process that multiprocessing did not start
  (``multiprocessing.parent_process()`` is None). Returns at once; a daemon thread named
  ``loopkit-parent-watch`` waits.

  Args:
    worker_index: Grain's index of this worker (unused).
    worker_count: Grain's number of workers (unused).
  """
  del worker_index, worker_count
  parent = multiprocessing.parent_process()
  if parent is None:
    return
  threading.Thread(target=_watch, args=(parent.sentinel, os.getppid()),
                   name="loopkit-parent-watch", daemon=True).start()


def _watch(sentinel: int, parent_pid: int) -> None:
  """Returns never: ``os._exit`` once ``sentinel`` is readable or the parent pid changed."""
  while not connection.wait([sentinel], timeout=_PPID_CHECK_SECS):
    if os.getppid() != parent_pid:
      break
  # No one waits for this status; no cleanup: the resource tracker unlinks what this leaves.
  os._exit(1)
