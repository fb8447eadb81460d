"""Prefetch threads left inside a source's ``next`` after ``ChunkFeeder.close``, waited for
(bounded) at interpreter exit so none is inside JAX's C++ code while the interpreter
finalizes (see :mod:`loopkit.data.feeding`'s docstring, "Stopping").

The registry is shared with :mod:`loopkit.data.feeding`, which re-exports it.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time

log = logging.getLogger("loopkit")


# Producer threads still inside a source's ``next`` after ``close``:
# (thread, source name, seconds to wait for it at interpreter exit).
_STRANDED: list[tuple[threading.Thread, str, float]] = []


_STRANDED_LOCK = threading.Lock()


def _join_stranded_at_exit() -> None:
  """At interpreter exit, waits (bounded) for producers stuck in a source.

  A producer that leaves the source finds its stop event set and returns
  without touching JAX, so after this wait no producer is inside JAX's C++ code
  while the interpreter finalizes (which would abort the process, see the
  module docstring). One still inside the source after the wait is named in a
  warning; it is killed at a Python or C frame of the source.
  """
  with _STRANDED_LOCK:
    stranded = [s for s in _STRANDED if s[0].is_alive()]
    _STRANDED.clear()
  if not stranded:
    return
  deadline = time.monotonic() + max(wait for _, _, wait in stranded)
  for thread, name, wait in stranded:
    thread.join(timeout=max(0.0, min(wait, deadline - time.monotonic())))
    if thread.is_alive():
      log.warning("at exit, the prefetch thread is still inside next() of the data "
                  "source %s; the interpreter exits with it there", name)


atexit.register(_join_stranded_at_exit)
