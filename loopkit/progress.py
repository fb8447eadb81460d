"""Progress display at loop boundaries: a tqdm bar, or plain lines when not a TTY.

At the start of a run one line says the first device call is compiling (it
can take a while, and nothing else would appear meanwhile). The bar advances
once per device call (by the call's steps) and shows, at a fixed width that
fits 80 columns with one metric::

  step 40/100 |████████            |  40%, 20.0 steps/s, ETA 0:00:03, loss=0.123

Rates are measured between boundaries on the host clock, one call late like
every hook that needs no state, so the display never stalls a dispatch; the
metrics are the last call's values. While the bar is open, console log lines
(loopkit's, and those of stdout/stderr handlers of the root logger) print on
their own line above it (:func:`loopkit.logs.console_lines_above_bar`). When
the stream is not a terminal (CI logs, ``nohup``, a batch scheduler) a bar
would write carriage returns into the log, so the hook writes one plain line
every ``log_every_secs`` instead (and one at the end). Processes other than 0
show nothing.
"""

from __future__ import annotations

import datetime
import logging
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

import jax

from loopkit import logs
from loopkit.extras import require
from loopkit.hooks import Hook, LoopInfo

__all__ = ["ProgressHook", "format_eta"]

# Fixed bar width: tqdm's default gives the bar whatever the text leaves, one character at
# 80 columns once a postfix is shown.
BAR_FORMAT = "step {n_fmt}/{total_fmt} |{bar:20}| {percentage:3.0f}%{postfix}"


def format_eta(secs: float) -> str:
  """Formats seconds as ``H:MM:SS`` (``"?"`` when unknown or infinite).

  Example:
    >>> format_eta(3725.4), format_eta(float("inf"))
    ('1:02:05', '?')
  """
  if secs is None or not math.isfinite(secs) or secs < 0:
    return "?"
  return str(datetime.timedelta(seconds=int(round(secs))))


class ProgressHook(Hook):
  """Shows training progress at boundaries.

  Args:
    total_steps: the step the bar ends at (default: the loop's target step of
      the current ``run``).
    stream: where the bar or lines go (default ``sys.stdout``).
    use_bar: True for a tqdm bar, False for plain lines; None (default) picks the
      bar when ``stream.isatty()``.
    log_every_secs: plain mode: the shortest wall time between two lines
      (the last call of a run always gets a line).
    logger: plain mode: send lines to this logger at INFO instead of ``stream``.
    metric_names: bar mode: the metrics shown after the ETA (default: all of
      the call's metrics, in name order; ``()`` for none).
    clock: monotonic clock in seconds (inject a fake one in tests).

  Plain line format (rates since the previous line; ETA = steps left / rate)::

    step 0/100: compiling the first device call
    step 40/100 (40.0%): 20.0 steps/s, 640.0 examples/s, ETA 0:00:03

  Not thread-safe. Multi-host-safe: only process 0 displays.
  """

  needs_state = False

  def __init__(self, total_steps: int | None = None, *, stream: IO[str] | None = None,
               use_bar: bool | None = None, log_every_secs: float = 10.0,
               logger: logging.Logger | None = None,
               metric_names: Sequence[str] | None = None,
               clock: Callable[[], float] = time.perf_counter):
    super().__init__()
    self.total_steps = total_steps
    self.stream = stream
    self.use_bar = use_bar
    self.log_every_secs = log_every_secs
    self.logger = logger
    self.metric_names = metric_names
    self.clock = clock
    self.lines: list[str] = []
    self._bar: Any = None  # tqdm bar on a TTY (process 0 only)
    self._lines_above: Any = None  # the console_lines_above_bar context while the bar is open
    self._enabled = False

  def on_run_start(self, loop: Any, state: Any) -> None:
    del state
    self._close_bar()  # a previous run that ended by an exception
    self._enabled = jax.process_index() == 0
    self._total = self.total_steps if self.total_steps is not None else loop.target_step
    self._stream = self.stream if self.stream is not None else sys.stdout
    use_bar = self.use_bar
    if use_bar is None:
      isatty = getattr(self._stream, "isatty", None)
      use_bar = bool(isatty and isatty())
    self._use_bar = use_bar
    self._mark: tuple[float, int, int] | None = None  # (time, step, examples) of last output
    self._t_start = self.clock()
    self._last_step: int | None = None
    self._last_examples = 0
    self._logged_step: int | None = None
    if self._enabled and loop.ledger is not None and (
        self._total is None or loop.ledger.step < self._total):
      self._emit(f"step {loop.ledger.step}/{self._total}: compiling the first device call"
                 if self._total else f"step {loop.ledger.step}: compiling the first device call")

  def observe(self, info: LoopInfo) -> None:
    if not self._enabled:
      return
    now = self.clock()
    if self._mark is None:  # first call of the run: rates count from the run's start
      self._mark = (self._t_start, info.start_step,
                    info.examples_seen - info.num_steps * self._batch_size(info))
      if self._use_bar:
        self._open_bar(info.start_step)
    self._last_step = info.end_step
    self._last_examples = info.examples_seen
    if self._use_bar:
      self._update_bar(info, now)
    elif info.is_last or now - self._mark[0] >= self.log_every_secs:
      self._line(info.end_step, info.examples_seen, now)

  def on_run_end(self, loop: Any, state: Any) -> None:
    del loop, state
    if not self._enabled:
      return
    if self._bar is not None:
      self._close_bar()
    elif (not self._use_bar and self._last_step is not None
          and self._logged_step != self._last_step):  # stopped early: say where
      self._line(self._last_step, self._last_examples, self.clock())

  # -- internals ---------------------------------------------------------------

  @staticmethod
  def _batch_size(info: LoopInfo) -> int:
    return info.examples_seen // info.end_step if info.end_step else 0

  def _rates(self, step: int, examples: int, now: float) -> tuple[float, float]:
    assert self._mark is not None  # set at the first boundary
    t0, s0, e0 = self._mark
    dt = now - t0
    if dt <= 0:
      return math.nan, math.nan
    return (step - s0) / dt, (examples - e0) / dt

  def _line(self, step: int, examples: int, now: float) -> None:
    steps_s, examples_s = self._rates(step, examples, now)
    total = self._total
    if total:
      left = max(total - step, 0)
      eta = left / steps_s if steps_s and steps_s > 0 else math.inf
      head = f"step {step}/{total} ({100.0 * step / total:.1f}%)"
    else:
      eta, head = math.inf, f"step {step}"
    line = (f"{head}: {steps_s:.1f} steps/s, {examples_s:.1f} examples/s, "
            f"ETA {format_eta(eta)}")
    self.lines.append(line)
    self._emit(line)
    self._mark = (now, step, examples)
    self._logged_step = step

  def _emit(self, line: str) -> None:
    if self.logger is not None:
      self.logger.info("%s", line)
    else:
      self._stream.write(line + "\n")
      self._stream.flush()

  def _open_bar(self, initial: int) -> None:
    tqdm = require("tqdm.auto", "loopkit.ProgressHook's bar").tqdm  # lazy: only for a bar
    self._bar = tqdm(total=self._total, initial=initial, unit="step", file=self._stream,
                     dynamic_ncols=True, bar_format=BAR_FORMAT)
    self._lines_above = logs.console_lines_above_bar(tqdm)
    self._lines_above.__enter__()

  def _close_bar(self) -> None:
    if self._bar is not None:
      self._bar.close()
      self._bar = None
    if self._lines_above is not None:
      self._lines_above.__exit__(None, None, None)
      self._lines_above = None

  def _update_bar(self, info: LoopInfo, now: float) -> None:
    steps_s, _ = self._rates(info.end_step, info.examples_seen, now)
    left = max(self._total - info.end_step, 0) if self._total else None
    eta = (left / steps_s if left is not None and steps_s and steps_s > 0
           else 0.0 if left == 0 else math.inf)
    rate = f"{steps_s:.0f}" if steps_s >= 1000 else f"{steps_s:.1f}"
    parts = [f"{rate} steps/s", f"ETA {format_eta(eta)}"]
    names = sorted(info.metrics) if self.metric_names is None else self.metric_names
    for k in names:
      if k in info.metrics:
        parts.append(f"{k}={info.metrics[k]:.4g}")
    self._bar.update(info.num_steps)
    self._bar.set_postfix_str(", ".join(parts), refresh=True)
    self._mark = (now, info.end_step, info.examples_seen)
