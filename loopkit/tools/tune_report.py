"""The K tuner's results: a K's measurements (:class:`TuneRow`, their median and its
uncertainty: :func:`combine`), the pick (:func:`within_noise`, :func:`recommend`), and the
report (:class:`TuneResult`'s table and warnings, :func:`plot`).

No measuring here (that is :mod:`loopkit.tools.tune`, which re-exports these names).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence

from loopkit._internal.extras import require

__all__ = ["TuneResult", "TuneRow", "combine", "plot", "recommend", "within_noise"]


_MAD_TO_SIGMA = 1.4826  # sigma = 1.4826 x median absolute deviation, for normal data


# The standard error of a median of n normal samples is about sqrt(pi / 2) x sigma / sqrt(n).
_MEDIAN_SE = math.sqrt(math.pi / 2)


@dataclasses.dataclass(frozen=True)
class TuneRow:
  """Measurements at one K.

  Attributes:
    iterations_per_loop: K.
    steps_per_sec: training steps per second of wall time, steady state: the
      median over the repeats (:func:`combine`), or the one measurement.
    host_overhead: fraction of steady-state wall time the host was not waiting
      on the device, in [0, 1].
    compile_secs: the first dispatch (trace + compile) in seconds.
    input_bytes_per_call: bytes of input per device call (K x global batch).
    secs_per_call: steady-state wall time per device call.
    device_chunk_bytes: device bytes of the input chunks a run holds at once, on one device:
      :func:`loopkit.data.assembly.chunk_buffers_in_flight` (``prefetch + 3``) chunks of
      ``max(K, 2)`` slots of the per-device batch; what a run checks against a GPU's or TPU's
      memory before its first step.
    repeat_steps_per_sec: steps/s of every repeat at this K, in measurement
      order; empty for a single measurement.
  """

  iterations_per_loop: int
  steps_per_sec: float
  host_overhead: float
  compile_secs: float
  input_bytes_per_call: int
  secs_per_call: float
  repeat_steps_per_sec: tuple[float, ...] = ()
  device_chunk_bytes: int = 0

  @property
  def repeats(self) -> int:
    """How many measurements the row holds (1 for a single measurement)."""
    return max(len(self.repeat_steps_per_sec), 1)

  @property
  def spread(self) -> float:
    """``(max - min) / max`` of steps/s over the repeats (0 for fewer than two)."""
    r = self.repeat_steps_per_sec
    return (max(r) - min(r)) / max(r) if len(r) > 1 and max(r) > 0 else 0.0

  @property
  def uncertainty(self) -> float:
    """The relative standard error of the median steps/s; nan for fewer than two repeats.

    ``sqrt(pi / 2) x 1.4826 x MAD / median / sqrt(n)`` over the ``n`` repeats,
    MAD being their median absolute deviation from the median: 1.4826 x MAD
    estimates the standard deviation of one measurement (exactly for normal
    noise, and one outlier among the repeats barely moves it), and a median of
    ``n`` such measurements varies by about ``sqrt(pi / 2)`` x that / ``sqrt(n)``.
    A fraction: 0.02 is +-2%.
    """
    r = self.repeat_steps_per_sec
    if len(r) < 2:
      return float("nan")
    med = statistics.median(r)
    if med <= 0:
      return float("inf")
    mad = statistics.median(abs(x - med) for x in r)
    return _MEDIAN_SE * _MAD_TO_SIGMA * mad / med / math.sqrt(len(r))


def combine(measurements: Sequence[TuneRow]) -> TuneRow:
  """One row from several measurements of the same K: steps/s is their median.

  The other columns are those of the measurement at the median (for an even
  count, the slower of the two middle ones); ``repeat_steps_per_sec`` lists
  every measurement's steps/s, in order.

  Args:
    measurements: :class:`TuneRow` s of one K (their own repeats ignored).

  Returns:
    A :class:`TuneRow` (for one measurement: that row, with no repeats).

  Raises:
    ValueError: no measurements, or measurements of different K (naming them).
  """
  if not measurements:
    raise ValueError("combine needs at least one measurement")
  ks = sorted({m.iterations_per_loop for m in measurements})
  if len(ks) > 1:
    raise ValueError(f"combine takes measurements of one K, got K={ks}")
  if len(measurements) == 1:
    return dataclasses.replace(measurements[0], repeat_steps_per_sec=())
  samples = tuple(m.steps_per_sec for m in measurements)
  middle = sorted(measurements, key=lambda m: m.steps_per_sec)[(len(measurements) - 1) // 2]
  return dataclasses.replace(middle, steps_per_sec=statistics.median(samples),
                             repeat_steps_per_sec=samples)


def _band(row: TuneRow, best: TuneRow, tolerance: float) -> float:
  """How far below ``best`` (a fraction of its steps/s) ``row`` still ties with it: the larger
  of ``tolerance`` and twice the standard error of the difference of the two medians."""
  se = [u * r.steps_per_sec for r in (row, best) if not math.isnan(u := r.uncertainty)]
  if not se or best.steps_per_sec <= 0:
    return tolerance
  return max(tolerance, 2 * math.hypot(*se) / best.steps_per_sec)


def _check_rows(rows: Sequence[TuneRow], tolerance: float) -> TuneRow:
  """The best row (highest steps/s; the smaller K on equal values), after checking."""
  if not rows:
    raise ValueError("recommend needs at least one row")
  if not 0 <= tolerance < 1:
    raise ValueError(f"tolerance must be in [0, 1), got {tolerance}")
  return max(rows, key=lambda r: (r.steps_per_sec, -r.iterations_per_loop))


def within_noise(rows: Sequence[TuneRow], tolerance: float = 0.02) -> list[int]:
  """The K whose steps/s cannot be told apart from the best's, in increasing order.

  A row ties with the best row when ``best - row`` (their steps/s) is at most
  the larger of ``tolerance x best`` and twice the standard error of that
  difference, ``2 x hypot(u_row x row, u_best x best)`` with ``u`` the rows'
  :attr:`TuneRow.uncertainty` (an unknown one, a single measurement, counts
  0). The best row is always in.

  Args:
    rows: measurements (any order).
    tolerance: relative tolerance in [0, 1).

  Returns:
    The tying K, sorted.

  Raises:
    ValueError: for no rows or a tolerance outside [0, 1).
  """
  best = _check_rows(rows, tolerance)
  return sorted(r.iterations_per_loop for r in rows
                if r.steps_per_sec >= (1 - _band(r, best, tolerance)) * best.steps_per_sec)


def recommend(rows: Sequence[TuneRow], tolerance: float = 0.02) -> int:
  """The smallest K within ``tolerance`` or the noise of the best (:func:`within_noise`).

  Args:
    rows: measurements (any order); a row's steps/s is the median of its
      repeats (:func:`combine`).
    tolerance: relative tolerance in [0, 1).

  Returns:
    K.

  Raises:
    ValueError: for no rows or a tolerance outside [0, 1).

  Example:
    >>> rows = [TuneRow(k, s, 0.0, 0.0, 0, 0.0) for k, s in [(1, 50.), (2, 99.), (4, 100.)]]
    >>> recommend(rows)
    2
  """
  return within_noise(rows, tolerance)[0]


def _ks(ks: Sequence[int]) -> str:
  return ", ".join(str(k) for k in ks)


def _pct(x: float) -> str:
  return f"{100 * x:.1f}%"


@dataclasses.dataclass(frozen=True)
class TuneResult:
  """A sweep's rows and the recommended K.

  Attributes:
    rows: one :class:`TuneRow` per K, in sweep order.
    recommended: the smallest K within ``tolerance`` or the measurement noise
      of the best (:func:`recommend`).
    tolerance: the relative tolerance used (0.02 = 2%).
  """

  rows: list[TuneRow]
  recommended: int
  tolerance: float

  @property
  def best(self) -> TuneRow:
    """The row with the highest (median) steps/s."""
    return _check_rows(self.rows, self.tolerance)

  @property
  def ties(self) -> list[int]:
    """The K within noise of the best (:func:`within_noise`), sorted."""
    return within_noise(self.rows, self.tolerance)

  @property
  def noisy(self) -> list[TuneRow]:
    """The rows whose :attr:`TuneRow.uncertainty` is above the tolerance, in sweep order."""
    return [r for r in self.rows if r.uncertainty > self.tolerance]

  @property
  def at_largest(self) -> bool:
    """Whether the recommended K is the largest tried (the sweep may have ended too early)."""
    return len(self.rows) > 1 and self.recommended == max(r.iterations_per_loop
                                                          for r in self.rows)

  def warnings(self) -> list[str]:
    """The ``warning:`` lines the table ends with (also logged by :func:`sweep`), maybe none.

    One for noise above the tolerance (naming each such K, its uncertainty,
    spread and repeats, the tolerance, and whether K tie within the noise),
    one for a sweep of single measurements (noise unknown), one when
    :attr:`at_largest`.
    """
    out = []
    tol = _pct(self.tolerance)
    noisy = self.noisy
    if noisy:
      rows = ", ".join(f"K={r.iterations_per_loop} +-{_pct(r.uncertainty)} (spread "
                       f"{_pct(r.spread)} over {r.repeats} repeats)" for r in noisy)
      ties = self.ties
      verdict = (f"K={_ks(ties)} are within the noise of the best and cannot be told apart, so "
                 "the smallest is recommended" if len(ties) > 1 else
                 f"K={ties[0]} is faster than every other K by more than the noise")
      out.append(f"warning: the measurements are noisier than the {tol} tolerance: {rows}; "
                 f"{verdict} (a quieter machine or a longer --min-secs narrows the noise)")
    if len(self.rows) > 1 and all(r.repeats == 1 for r in self.rows):
      out.append(f"warning: one measurement per K, so the noise is unknown and one fast or slow "
                 f"measurement can decide against the {tol} tolerance: measure with "
                 "--repeats 3 or more")
    if self.at_largest:
      out.append(f"warning: K={self.recommended} is the largest K tried; throughput may still "
                 f"grow with K (try larger values, e.g. --ks ...,{2 * self.recommended},"
                 f"{4 * self.recommended})")
    return out

  def warning(self) -> str | None:
    """:meth:`warnings` as one string (lines joined by newlines), or None when there are none."""
    w = self.warnings()
    return "\n".join(w) if w else None

  def recommendation(self) -> str:
    """The sentence that names the recommended K and why (the table's last line before warnings).

    Examples: ``recommended iterations_per_loop = 8 (the smallest of K=8, 16, 32, which are
    within 2% or the measurement noise of the best: 7,012 steps/s +-3.1% at K=32)``;
    ``recommended iterations_per_loop = 32 (the fastest: 7,012 steps/s +-0.4%; no other K is
    within 2% or the measurement noise of it)``.
    """
    best, ties = self.best, self.ties
    pm = "" if math.isnan(best.uncertainty) else f" +-{_pct(best.uncertainty)}"
    tol = f"{100 * self.tolerance:g}%"
    if len(ties) == 1:
      return (f"recommended iterations_per_loop = {self.recommended} (the fastest: "
              f"{best.steps_per_sec:,.0f} steps/s{pm}; no other K is within {tol} or the "
              "measurement noise of it)")
    return (f"recommended iterations_per_loop = {self.recommended} (the smallest of "
            f"K={_ks(ties)}, which are within {tol} or the measurement noise of the best: "
            f"{best.steps_per_sec:,.0f} steps/s{pm} at K={best.iterations_per_loop})")

  def table(self) -> str:
    """A Markdown table of the rows; the recommended K is marked ``*``, tying K ``=``.

    Columns: K, steps/s (the median of the repeats), ``+-`` (its uncertainty,
    :attr:`TuneRow.uncertainty`; ``-`` for one measurement), repeats, spread over
    repeats (``(max - min) / max``), seconds per device call, host overhead
    fraction, compile seconds, input bytes per call, device bytes of the chunks in flight
    (:attr:`TuneRow.device_chunk_bytes`). Then
    :meth:`recommendation` and :meth:`warnings`.
    """
    ties = self.ties
    lines = ["| K | steps/s | +- | repeats | spread | s/call | host overhead | compile s | "
             "input bytes/call | device chunks |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in self.rows:
      k = r.iterations_per_loop
      mark = " *" if k == self.recommended else " =" if k in ties else ""
      one = r.repeats == 1
      lines.append(f"| {k}{mark} | {r.steps_per_sec:,.0f} | "
                   f"{'-' if one else _pct(r.uncertainty)} | {r.repeats} | "
                   f"{'-' if one else _pct(r.spread)} | {r.secs_per_call:.4g} | "
                   f"{r.host_overhead:.2f} | {r.compile_secs:.2f} | {r.input_bytes_per_call:,} | "
                   f"{r.device_chunk_bytes:,} |")
    lines.append("")
    lines.append(self.recommendation())
    lines.extend(self.warnings())
    return "\n".join(lines)


def plot(result: TuneResult, path: str, *, title: str | None = None) -> None:
  """Writes a PNG: median steps/s against K (log2 axis) with each repeat and the median's
  uncertainty, host overhead, the 2% band and the pick.

  Args:
    result: a :class:`TuneResult`.
    path: the PNG file to write.
    title: the plot's title (default names the recommendation).
  """
  matplotlib = require("matplotlib", "loopkit.tools.tune's plot")  # lazy: only the tuner needs it
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  ks = [r.iterations_per_loop for r in result.rows]
  sps = [r.steps_per_sec for r in result.rows]
  best = max(sps)
  fig, ax = plt.subplots(figsize=(7.5, 4.4), dpi=120)
  for r in result.rows:  # every measurement, behind the medians
    ax.plot([r.iterations_per_loop] * len(r.repeat_steps_per_sec), r.repeat_steps_per_sec, ".",
            color="tab:blue", alpha=0.35, ms=4)
  err = [0.0 if math.isnan(r.uncertainty) else r.uncertainty * r.steps_per_sec
         for r in result.rows]
  ax.errorbar(ks, sps, yerr=err, fmt="o-", color="tab:blue", capsize=3,
              label="steps/s (median +- uncertainty)")
  ax.axhline((1 - result.tolerance) * best, color="tab:gray", ls=":", lw=1,
             label=f"{100 * (1 - result.tolerance):g}% of best")
  rec = next(r for r in result.rows if r.iterations_per_loop == result.recommended)
  ax.plot([rec.iterations_per_loop], [rec.steps_per_sec], "*", ms=16, color="tab:red",
          label=f"recommended K={rec.iterations_per_loop}")
  ax.set_xscale("log", base=2)
  ax.set_xticks(ks)
  ax.set_xticklabels([str(k) for k in ks])
  ax.set_xlabel("iterations_per_loop (K, steps per device call)")
  ax.set_ylabel("training steps / s")
  ax.set_ylim(bottom=0)
  ax2 = ax.twinx()
  ax2.plot(ks, [r.host_overhead for r in result.rows], "s--", color="tab:orange", ms=4,
           label="host overhead (fraction)")
  ax2.set_ylim(0, 1.05)
  ax2.set_ylabel("host overhead fraction")
  lines = ax.get_legend_handles_labels()
  lines2 = ax2.get_legend_handles_labels()
  fig.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="lower center", ncol=4,
             fontsize=8, frameon=False)
  ax.set_title(title or f"throughput vs iterations_per_loop (recommended K="
               f"{result.recommended})", fontsize=10)
  fig.tight_layout(rect=(0, 0.07, 1, 1))
  fig.savefig(path)
  plt.close(fig)
