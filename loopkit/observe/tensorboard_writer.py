"""TensorBoard event files through ``tensorboardX`` (see :mod:`loopkit.observe.writers`)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from loopkit._internal.extras import require
from loopkit.observe.metric_writer import _hparam_value, _is_writer_process, _to_python

log = logging.getLogger("loopkit")


class TensorBoardWriter:
  """TensorBoard event files via ``tensorboardX``'s protos (no TensorFlow needed).

  Each scalar becomes a ``simple_value`` summary (stored as float32) tagged with
  its name, at the given global step; string values and :meth:`write_texts`
  become text summaries; :meth:`write_images` writes ``[H, W, C]`` or
  ``[N, H, W, C]`` arrays (C = 1, 3 or 4; uint8 in 0..255 or floats in
  [0, 1]; N images are tiled into one, as tensorboardX's ``add_images``);
  :meth:`write_histograms` writes histograms (``num_buckets[name]`` equal-width
  buckets, default 30 as TensorBoard's ``tf.summary.histogram``); :meth:`write_hparams` writes the
  HParams plugin's experiment and session summaries at step 0.

  Events are written synchronously to the file (no tensorboardX queue
  thread), so :meth:`flush` makes everything written so far durable. The
  event file is created at the first write; when ``logdir`` already holds
  event files (a resumed run), it starts with a ``purge_step`` (a
  ``SessionLog.START`` event): TensorBoard then hides the old events at steps
  ``>=`` it, so a kill and a resume show each step once. The purge step is
  ``S + 1`` after :meth:`keep_through` ``(S)`` (the loop's hooks call it with
  the step the run continues from:
  :func:`~loopkit.observe.writers.keep_rows_through`), else the first write's step.

  Args:
    logdir: directory for the ``events.out.tfevents.*`` file (created).
    flush_secs: a write flushes the file when the last flush is at least this
      old (seconds; 0 flushes at every write). :meth:`flush` always flushes.
    clock: monotonic clock in seconds (inject a fake one in tests).

  Raises:
    ImportError: if ``tensorboardX`` is not installed (``pip install 'loopkit[observability]'``).

  Writes only on process 0. Not thread-safe (wrap in :class:`AsyncWriter`).
  """

  _files_opened = 0  # makes event file names unique within a process

  def __init__(self, logdir: str | os.PathLike, *, flush_secs: float = 10.0,
               clock: Callable[[], float] = time.monotonic):
    self.logdir = os.fspath(logdir)
    self.flush_secs = flush_secs
    self.clock = clock
    self._w: Any = None  # tensorboardX's EventsWriter, opened at the first write
    self._enabled = _is_writer_process()
    self._last_flush = clock()
    self._resuming = False
    self._purged = False
    self._purge_step: int | None = None  # keep_through(S): S + 1
    self._wrote = False  # an event with a step was written (in any file of this writer)
    if self._enabled:
      require("tensorboardX", "loopkit.observe.TensorBoardWriter")  # fail early if missing
      os.makedirs(self.logdir, exist_ok=True)
      self._resuming = any("tfevents" in f for f in os.listdir(self.logdir))

  def keep_through(self, step: int) -> None:
    """Declares the run continues from a state at ``step``: old events at steps ``<= step``
    stay visible, later ones are hidden. Also in a later run of the same process (a
    rerun after an error): the next event with a step is preceded by a new purge step."""
    self._purge_step = int(step) + 1
    if self._wrote:  # this writer wrote events already: they may be past ``step``
      self._purged, self._resuming = False, True

  def _write(self, step: int, summary: Any, *, stepped: bool = True) -> None:
    from tensorboardX.proto import event_pb2
    if self._w is None:
      from tensorboardX.event_file_writer import EventsWriter
      TensorBoardWriter._files_opened += 1
      self._w = EventsWriter(os.path.join(self.logdir, "events"),
                             # zero-padded: TensorBoard reads a directory's files in name
                             # order, and files opened within one second differ only here
                             f".{os.getpid():07d}.{TensorBoardWriter._files_opened:06d}")
    if stepped and self._resuming and not self._purged:
      self._purged = True
      purge = int(step) if self._purge_step is None else self._purge_step
      self._w.write_event(event_pb2.Event(
          wall_time=time.time(), step=purge,
          session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)))
      log.info("%s: TensorBoard hides the earlier events at steps >= %d (purge_step)",
               self.logdir, purge)
    self._w.write_event(event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary))
    self._wrote = self._wrote or stepped
    if self.clock() - self._last_flush >= self.flush_secs:
      self.flush()

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    if not self._enabled:
      return
    from tensorboardX import summary
    for name, value in scalars.items():
      value = _to_python(value)
      if isinstance(value, str):
        self._write(step, _text_summary(name, value))
      else:
        self._write(step, summary.scalar(name, float(value)))

  def write_texts(self, step: int, texts: Mapping[str, str]) -> None:
    if not self._enabled:
      return
    for name, text in texts.items():
      self._write(step, _text_summary(name, str(text)))

  def write_images(self, step: int, images: Mapping[str, Any]) -> None:
    if not self._enabled:
      return
    from tensorboardX import summary
    for name, image in images.items():
      image = np.asarray(image)
      if image.ndim not in (3, 4) or image.shape[-1] not in (1, 3, 4):
        raise ValueError(f"image {name!r} must be [H, W, C] or [N, H, W, C] with C in "
                         f"(1, 3, 4), got shape {image.shape}")
      if image.dtype != np.uint8:
        image = np.clip(image.astype(np.float32), 0.0, 1.0)
      self._write(step, summary.image(name, image,
                                      dataformats="HWC" if image.ndim == 3 else "NHWC"))

  def write_histograms(self, step: int, arrays: Mapping[str, Any],
                       num_buckets: Mapping[str, int] | None = None) -> None:
    if not self._enabled:
      return
    from tensorboardX import summary
    for name, values in arrays.items():
      bins = int((num_buckets or {}).get(name, 30))
      self._write(step, summary.histogram(name, np.asarray(values, np.float64).ravel(), bins))

  def write_hparams(self, hparams: Mapping[str, Any]) -> None:
    if not self._enabled:
      return
    from tensorboardX import summary
    exp, ssi, sei = summary.hparams({k: _hparam_value(v) for k, v in hparams.items()}, {})
    for s in (exp, ssi, sei):
      self._write(0, s, stepped=False)

  def flush(self) -> None:
    self._last_flush = self.clock()
    if self._w is not None:
      self._w.flush()

  def close(self) -> None:
    if self._w is not None:
      self._w.close()
      self._w = None


def _text_summary(name: str, text: str) -> Any:
  """A text-plugin summary tagged ``name`` (tensorboardX's own would tag it
  ``name/text_summary``; TensorFlow's ``tf.summary.text`` and CLU use ``name``)."""
  from tensorboardX import summary
  s = summary.text(name, text)
  s.value[0].tag = name
  return s
