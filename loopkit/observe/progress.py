"""Progress display at loop boundaries: a tqdm bar, or plain lines when not a terminal.

At the start of a run one line says what the first device call waits for: its
batches (a data pipeline's first batches can take seconds: worker processes
starting, buffers filling) and its compilation (seconds to minutes), when
nothing else would appear meanwhile. The bar appears at
the first boundary and is drawn once per boundary (one frame per device call)
at a fixed width that fits 80 columns with one metric::

  step 40/100 |████████            |  40%, 20.0 steps/s, ETA 0:00:03, loss=0.123

Rates are measured between boundaries on the host clock, one call late like
every hook that needs no state, so the display never stalls a dispatch, and
smoothed over boundaries as tqdm smooths its own (:class:`RateMeter`). The
time of a call that compiled (the ledger's ``Bucket.COMPILE`` grew during it:
the first call of a loop) is left out of the rate and the ETA; until a call
without compiling has been measured both show ``?``. The metrics are the last
call's values. While the bar is open, console lines (loopkit's rows whichever
logging handler shows them, other libraries' log lines, ``print``, warnings)
print on their own line above it
(:func:`loopkit._internal.logs.console_lines_above_bar`); a run that raises
closes the bar first. When the stream is not a
terminal (CI logs, ``nohup``, a batch scheduler), or is a terminal with no
width (0 columns: some job consoles and container ttys), a bar would write
carriage returns into the log or nothing at all, so the hook writes one plain
line every ``log_every_secs`` instead (and one at the end). Processes other
than 0 show nothing.
"""

from __future__ import annotations

import datetime
import io
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

import jax

from loopkit._internal import logs
from loopkit._internal.extras import require
from loopkit.core.hooks import Hook, LoopInfo
from loopkit.core.ledger import Bucket

__all__ = ["ProgressHook", "RateMeter", "format_eta", "format_rate"]

# What a run's first device call waits for (ProgressHook's first line, after "step 0/N: ").
FIRST_CALL = "waiting for the first batches, then compiling the first device call"
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


class RateMeter:
  """Steps and examples per second, smoothed over boundaries.

  Each boundary adds one interval: ``steps`` and ``examples`` done in
  ``secs`` of host time. The rate is the exponential moving average (EMA) of
  the steps over the EMA of the seconds, ``rate = EMA(steps) / EMA(secs)``
  with ``EMA_i = a * x_i + (1 - a) * EMA_{i-1}`` (the first interval starts
  it), which is how tqdm smooths its own rate (its ``smoothing`` argument,
  default 0.3): each interval weighs by its length in time, so a short
  interval between two long ones barely moves the rate, and a change of
  speed shows within a few boundaries. ``a = 0`` gives the average over all
  intervals (total steps / total seconds), ``a = 1`` the last interval's.

  Args:
    smoothing: ``a`` in [0, 1].

  Raises:
    ValueError: ``smoothing`` outside [0, 1].

  Not thread-safe.
  """

  def __init__(self, smoothing: float = 0.3):
    if not 0.0 <= smoothing <= 1.0:
      raise ValueError(f"smoothing must be in [0, 1], got {smoothing}")
    self.smoothing = smoothing
    self._ema: tuple[float, float, float] | None = None  # (steps, examples, secs)

  def add(self, steps: int, examples: int, secs: float) -> None:
    """Adds one interval (``secs`` > 0; shorter ones are ignored)."""
    if secs <= 0:
      return
    x = (float(steps), float(examples), float(secs))
    if self._ema is None:
      self._ema = x
      return
    a = self.smoothing
    e = self._ema
    if a == 0:  # running totals: the average over all intervals
      self._ema = (x[0] + e[0], x[1] + e[1], x[2] + e[2])
    else:
      b = 1.0 - a
      self._ema = (a * x[0] + b * e[0], a * x[1] + b * e[1], a * x[2] + b * e[2])

  def rates(self) -> tuple[float, float]:
    """``(steps/s, examples/s)``; NaN before the first interval."""
    if self._ema is None:
      return math.nan, math.nan
    steps, examples, secs = self._ema
    return steps / secs, examples / secs


def _terminal_columns(stream: Any) -> int | None:
  """The width of the terminal ``stream`` writes to; None when it cannot be asked
  (no file descriptor, e.g. an in-memory stream)."""
  try:
    return os.get_terminal_size(stream.fileno()).columns
  except (AttributeError, ValueError, OSError, io.UnsupportedOperation):
    return None


class ProgressHook(Hook):
  """Shows training progress at boundaries.

  Args:
    total_steps: the step the bar ends at (default: the loop's target step of
      the current ``run``).
    stream: where the bar or lines go (default ``sys.stdout``).
    use_bar: True for a tqdm bar, False for plain lines; None (default) picks the
      bar when ``stream.isatty()`` and the terminal is wider than 0 columns.
    log_every_secs: plain mode: the shortest wall time between two lines
      (the last call of a run always gets a line).
    logger: plain mode: send lines to this logger at INFO instead of ``stream``.
    metric_names: bar mode: the metrics shown after the ETA (default: all of
      the call's metrics, in name order; ``()`` for none).
    smoothing: the rates' EMA factor (:class:`RateMeter`; tqdm's default 0.3).
    clock: monotonic clock in seconds (inject a fake one in tests).

  Plain line format (smoothed rates; ETA = steps left / rate; ``?`` while only
  a compiling call has been measured)::

    step 0/100: waiting for the first batches, then compiling the first device call
    step 10/100 (10.0%): ? steps/s, ? examples/s, ETA ?
    step 40/100 (40.0%): 20.0 steps/s, 640.0 examples/s, ETA 0:00:03

  Raises:
    ValueError: ``smoothing`` outside [0, 1].

  Not thread-safe. Multi-host-safe: only process 0 displays.
  """

  needs_state = False

  def __init__(self, total_steps: int | None = None, *, stream: IO[str] | None = None,
               use_bar: bool | None = None, log_every_secs: float = 10.0,
               logger: logging.Logger | None = None,
               metric_names: Sequence[str] | None = None, smoothing: float = 0.3,
               clock: Callable[[], float] = time.perf_counter):
    super().__init__()
    RateMeter(smoothing)  # checks it now, not at the first run
    self.total_steps = total_steps
    self.stream = stream
    self.use_bar = use_bar
    self.log_every_secs = log_every_secs
    self.logger = logger
    self.metric_names = metric_names
    self.smoothing = smoothing
    self.clock = clock
    self.lines: list[str] = []
    self._bar: Any = None  # tqdm bar on a TTY (process 0 only)
    self._lines_above: Any = None  # the console_lines_above_bar context while the bar is open
    self._enabled = False

  def on_run_start(self, loop: Any, state: Any) -> None:
    del state
    self._close_bar()  # a previous run that ended by an exception
    self._enabled = jax.process_index() == 0
    self._ctx = loop
    self._total = self.total_steps if self.total_steps is not None else loop.target_step
    self._stream = self.stream if self.stream is not None else sys.stdout
    use_bar = self.use_bar
    if use_bar is None:
      isatty = getattr(self._stream, "isatty", None)
      use_bar = bool(isatty and isatty()) and _terminal_columns(self._stream) != 0
    self._use_bar = use_bar
    self._meter = RateMeter(self.smoothing)
    # (time, compile seconds) at the last boundary
    self._prev = (self.clock(), self._compile_secs())
    self._line_time = self._prev[0]  # plain mode: the time of the last line (or the run's start)
    self._last_step: int | None = None
    self._last_examples = 0
    self._logged_step: int | None = None
    if self._enabled and loop.ledger is not None and (
        self._total is None or loop.ledger.step < self._total):
      head = (f"step {loop.ledger.step}/{self._total}" if self._total
              else f"step {loop.ledger.step}")
      self._emit(f"{head}: {FIRST_CALL}")

  def adjust_ledger(self, ctx: Any) -> None:
    """Says so when the run went back (a rewind, :mod:`loopkit.core.skips`): one line
    ``step S/N: rewound from step E to step S (skip_steps [...])`` (plain mode: among the
    lines; bar mode: above the bar, which then shows step ``S`` and ``rewound from step E``
    until the next boundary); the rates leave the restore's time out. At a run's start it
    does nothing."""
    if not self._enabled or self._last_step is None or ctx.ledger.step >= self._last_step:
      return None
    step, ledger = ctx.ledger.step, ctx.ledger
    head = f"step {step}/{self._total}" if self._total else f"step {step}"
    line = (f"{head}: rewound from step {self._last_step} to step {step} "
            f"(skip_steps {list(ledger.skip_steps)})")
    self.lines.append(line)
    if self._bar is not None:
      self._bar.write(line, file=self._stream)  # above the bar, which stays open
      self._bar.n = step
      self._bar.set_postfix_str(f"rewound from step {self._last_step}", refresh=True)
    else:
      self._emit(line)
    now = self.clock()  # the next interval starts here: the restore says nothing of the speed
    self._prev, self._line_time = (now, self._compile_secs()), now
    self._last_step = self._logged_step = step
    return None

  def after_each_call(self, info: LoopInfo) -> None:
    if not self._enabled:
      return
    now, compiled = self.clock(), self._compile_secs()
    (then, compiled_then), self._prev = self._prev, (now, compiled)
    if compiled == compiled_then:  # a call that compiled says nothing about the speed
      self._meter.add(info.num_steps, info.num_steps * self._batch_size(info), now - then)
    self._last_step = info.end_step
    self._last_examples = info.examples_seen
    if self._use_bar:
      self._draw_bar(info)
    elif info.is_last or now - self._line_time >= self.log_every_secs:
      self._line(info.end_step, now)

  def on_run_end(self, loop: Any, state: Any) -> None:
    del loop, state
    if not self._enabled:
      return
    if self._bar is not None:
      self._close_bar()
    elif (not self._use_bar and self._last_step is not None
          and self._logged_step != self._last_step):  # stopped early: say where
      self._line(self._last_step, self.clock())

  def on_run_error(self, ctx: Any, error: BaseException) -> None:
    """The run raises: the bar is closed (its last frame kept, the line ended), so the
    traceback starts on a line of its own and console lines no longer wait for a bar."""
    del ctx, error
    self._close_bar()

  # -- internals ---------------------------------------------------------------

  def _compile_secs(self) -> float:
    ledger = getattr(self._ctx, "ledger", None)
    return ledger.seconds.get(Bucket.COMPILE, 0.0) if ledger is not None else 0.0

  @staticmethod
  def _batch_size(info: LoopInfo) -> int:
    return info.examples_seen // info.end_step if info.end_step else 0

  def _eta(self, step: int, steps_s: float) -> float:
    if not self._total:
      return math.inf
    left = max(self._total - step, 0)
    return 0.0 if left == 0 else left / steps_s if steps_s > 0 else math.inf

  def _line(self, step: int, now: float) -> None:
    steps_s, examples_s = self._meter.rates()
    total = self._total
    head = f"step {step}/{total} ({100.0 * step / total:.1f}%)" if total else f"step {step}"
    line = (f"{head}: {format_rate(steps_s)} steps/s, {format_rate(examples_s)} examples/s, "
            f"ETA {format_eta(self._eta(step, steps_s))}")
    self.lines.append(line)
    self._emit(line)
    self._line_time = now
    self._logged_step = step

  def _emit(self, line: str) -> None:
    if self.logger is not None:
      self.logger.info("%s", line)
    else:
      self._stream.write(line + "\n")
      self._stream.flush()

  def _close_bar(self) -> None:
    if self._bar is not None:
      self._bar.close()  # tqdm repaints the last frame once and ends its line
      self._bar = None
    if self._lines_above is not None:
      self._lines_above.__exit__(None, None, None)
      self._lines_above = None

  def _draw_bar(self, info: LoopInfo) -> None:
    """One frame per boundary: the first opens the bar (tqdm draws it once, with this
    postfix), later ones set the count and redraw once (``update`` would draw a frame
    of its own, with the previous boundary's postfix)."""
    steps_s, _ = self._meter.rates()
    parts = [f"{format_rate(steps_s)} steps/s",
             f"ETA {format_eta(self._eta(info.end_step, steps_s))}"]
    names = sorted(info.metrics) if self.metric_names is None else self.metric_names
    for k in names:
      if k in info.metrics:
        parts.append(f"{k}={info.metrics[k]:.4g}")
    postfix = ", ".join(parts)
    if self._bar is None:
      tqdm = require("tqdm.auto", "loopkit.ProgressHook's bar").tqdm  # lazy: only for a bar
      self._bar = tqdm(total=self._total, initial=info.end_step, unit="step",
                       file=self._stream, dynamic_ncols=True, bar_format=BAR_FORMAT,
                       postfix=postfix)
      self._lines_above = logs.console_lines_above_bar(tqdm, self._stream)
      self._lines_above.__enter__()
    else:
      self._bar.n = info.end_step
      self._bar.set_postfix_str(postfix, refresh=True)


def format_rate(rate: float) -> str:
  """A rate for display: one decimal below 1000, none above; ``"?"`` when unknown.

  Example:
    >>> format_rate(20.04), format_rate(37116.2), format_rate(float("nan"))
    ('20.0', '37116', '?')
  """
  if not math.isfinite(rate):
    return "?"
  return f"{rate:.0f}" if rate >= 1000 else f"{rate:.1f}"
