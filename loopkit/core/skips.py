"""Skipping data steps: the batches a run passes over, and rewinds (e.g. at loss spikes).

Two counters, kept apart:

* the **global step** (``ledger.step``) stays the number of optimizer updates applied: the
  state's step, the optimizer's count and the checkpoint label, as everywhere in loopkit;
* the **data step** counts batches the source has given (1-based: data step ``s`` is the
  ``s``-th batch in the source's order, ``batch_at(s - 1)`` of a step-indexed source).

Without skips they are equal. A skip range ``(a, b)`` passes over data steps ``a..b``
(inclusive): their batches are drawn and dropped (a plain iterable, tf.data, a Grain
iterator) or stepped over without being read (a step-indexed source, ``batch_at``), no
update is applied for them, and ``ledger.skipped_steps`` counts them, so after every call
``data step == ledger.step + ledger.skipped_steps`` (:attr:`loopkit.core.Ledger.data_step`).
``num_steps`` still counts updates: a run with ``skip_steps=[(31, 40)]`` asked for 60 steps
applies 60 updates, the last on data step 70. Epochs (``steps_per_epoch``, ``num_epochs``)
count updates too.

The planner ends a call where a skip range starts (:func:`cut_steps`), so every call's
batches are consecutive data steps; the feeder passes over a range just before it forms the
call that follows it (:func:`skip_count`), so a range is counted in the ledger at that call.
The ranges in force are kept in ``ledger.skip_steps``, saved with every checkpoint: a resume
keeps them whatever the resumed run is given.

A hook may *rewind* the run (:class:`RewindRequest`): at a boundary it asks, the processes
agree (:mod:`loopkit.core.agreement`), it returns a :class:`~loopkit.core.context.Restore` of
an earlier checkpoint, and the run continues from there with a new skip range from the data
step after that checkpoint through the request's ``skip_through``
(:class:`loopkit.checkpoint.LossSpikeHook` does this at loss spikes). A rewind is a resume
inside the process: the ledger is the checkpoint's with the thrown-away work booked as lost
(:func:`rewound_ledger`), and every hook's ``adjust_ledger`` is called as at a run's start,
so rows, records and histories past the restored step go. Pure host functions; thread-safe.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from loopkit.core.ledger import Bucket, Ledger
from loopkit.data.feeding import skip_count

__all__ = ["RewindRequest", "check_reopenable", "check_skip_steps", "cut_steps", "merge_ranges",
           "rewound_ledger", "skip_count"]

SkipRanges = tuple[tuple[int, int], ...]
"""Skip ranges ``((first, last), ...)`` in data steps, inclusive, disjoint and ascending."""


@dataclasses.dataclass(frozen=True)
class RewindRequest:
  """A hook's request to rewind the run, returned by its ``rewind_request(info)``.

  Attributes:
    before_step: the hook restores a checkpoint at a global step below this one (the
      first bad step).
    skip_through: the last data step to pass over: the run skips the data steps from the
      one after the restored checkpoint's through this one.
    reason: what happened, in words (logged with the rewind).
  """

  before_step: int
  skip_through: int
  reason: str


def _is_int(x: Any) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def check_skip_steps(skip_steps: Any) -> SkipRanges:
  """Checks a user's ``skip_steps``: ``[(first, last), ...]`` data steps, inclusive.

  Args:
    skip_steps: None, or an iterable of pairs of ints ``(first, last)`` with
      ``1 <= first <= last``, in ascending order and not overlapping.

  Returns:
    The ranges as a tuple of int pairs (``()`` for None).

  Raises:
    ValueError: naming the offending entry: not a pair of ints, a first data step below 1,
      a last step before the first, ranges out of order or overlapping.

  Example:
    >>> check_skip_steps([(31, 40), [61, 61]])
    ((31, 40), (61, 61))
  """
  if skip_steps is None:
    return ()
  if isinstance(skip_steps, (str, bytes, dict)) or not isinstance(skip_steps, Iterable):
    raise ValueError(f"skip_steps must be a list of (first, last) data-step pairs, got "
                     f"{skip_steps!r}")
  ranges: list[tuple[int, int]] = []
  for entry in skip_steps:
    if (isinstance(entry, (str, bytes, dict)) or not isinstance(entry, Sequence)
        or len(entry) != 2 or not all(_is_int(x) for x in entry)):
      raise ValueError(f"skip_steps entry {entry!r} is not a pair (first, last) of int data "
                       "steps, e.g. (31, 40)")
    first, last = int(entry[0]), int(entry[1])
    if first < 1:
      raise ValueError(f"skip_steps entry {entry!r}: data steps count from 1 (the first batch), "
                       f"got first={first}")
    if last < first:
      raise ValueError(f"skip_steps entry {entry!r}: last={last} is before first={first}")
    if ranges and first <= ranges[-1][1]:
      prev = ranges[-1]
      why = "overlaps" if first >= prev[0] else "comes before"
      raise ValueError(f"skip_steps entry {entry!r} {why} the entry {prev!r} before it: give "
                       "disjoint ranges in ascending order")
    ranges.append((first, last))
  return tuple(ranges)


def merge_ranges(*lists: Iterable[Sequence[int]]) -> SkipRanges:
  """The union of several lists of skip ranges, as disjoint ascending ranges (overlapping and
  adjacent ranges joined).

  Example:
    >>> merge_ranges([(31, 40)], [(35, 45), (46, 50)], [(3, 3)])
    ((3, 3), (31, 50))
  """
  out: list[list[int]] = []
  for first, last in sorted((int(a), int(b)) for ranges in lists for a, b in ranges):
    if out and first <= out[-1][1] + 1:
      out[-1][1] = max(out[-1][1], last)
    else:
      out.append([first, last])
  return tuple((a, b) for a, b in out)


def covered(ranges: SkipRanges, first: int, last: int) -> bool:
  """Whether data steps ``first..last`` all lie in ``ranges`` (merged, :func:`merge_ranges`)."""
  return any(a <= first and last <= b for a, b in ranges)


def rewound_ledger(restored: Ledger, before: Ledger, *, skip_through: int, total_secs: float,
                   restore_secs: float) -> Ledger:
  """The ledger a rewind leaves: the restored checkpoint's, as after a crash and a resume.

  The new skip range runs from the restored data step + 1 through ``skip_through``, joined
  to the ranges in force before the rewind and the checkpoint's. The steps trained past
  the checkpoint add to ``lost_steps``; the wall time spent since the checkpoint's
  ``total`` (whatever its bucket then: the thrown-away steps, their rows, evaluations and
  waits) goes to ``seconds["lost"]``, out of ``total``, and the restore to
  ``seconds["checkpoint"]``, so ``total + lost`` (goodput's job time) goes on counting the
  wall time and nothing the rewind threw away is productive
  (:func:`loopkit.observe.goodput.summarize`). A checkpoint's ``total`` is the one ticked at
  the start of the boundary it was saved at, so the hooks' time at that boundary before
  the save, in the checkpoint's buckets already, counts in ``lost`` too (a resume after a
  crash leaves it out of the job time instead).

  Args:
    restored: the checkpoint's ledger (not changed).
    before: the run's ledger when the rewind began.
    skip_through: the last data step to skip (>= ``restored.data_step + 1``).
    total_secs: ``before``'s ``seconds["total"]`` brought up to the rewind's start (s).
    restore_secs: the restore's wall time (s), added to ``seconds["checkpoint"]``.

  Returns:
    A new :class:`~loopkit.core.ledger.Ledger`.

  Example:
    >>> r = Ledger(step=20, seconds={"total": 10.0, "checkpoint": 1.0})
    >>> b = Ledger(step=24, seconds={"total": 12.5, "checkpoint": 1.2}, lost_steps=3)
    >>> n = rewound_ledger(r, b, skip_through=25, total_secs=13.0, restore_secs=0.5)
    >>> n.skip_steps, n.lost_steps, n.seconds
    (((21, 25),), 7, {'total': 10.0, 'checkpoint': 1.5, 'lost': 3.0})
  """
  ledger = restored.copy()
  ledger.skip_steps = merge_ranges(restored.skip_steps, before.skip_steps,
                                   [(restored.data_step + 1, skip_through)])
  ledger.lost_steps = before.lost_steps + max(before.step - restored.step, 0)
  seconds = ledger.seconds
  seconds[Bucket.LOST] = before.seconds.get(Bucket.LOST, 0.0) + max(
      total_secs - restored.seconds.get(Bucket.TOTAL, 0.0), 0.0)
  seconds[Bucket.CHECKPOINT] = seconds.get(Bucket.CHECKPOINT, 0.0) + restore_secs
  return ledger


def cut_steps(ranges: SkipRanges, step: int, data_step: int) -> list[int]:
  """The global steps after ``step`` at which a call must end because a skip range follows.

  Args:
    ranges: merged skip ranges.
    step: the global step (updates applied) now.
    data_step: the data steps consumed now.

  Returns:
    Ascending global steps ``> step``: for each range ahead, the step after which the next
    batch would be the range's first (a range that starts at the next batch needs no cut).

  Example:
    >>> cut_steps(((31, 40), (51, 55)), 0, 0)  # update 30 is data step 30, update 40 data 50
    [30, 40]
  """
  cuts = []
  for first, last in ranges:
    if last <= data_step:
      continue
    if first > data_step + 1:
      step += first - 1 - data_step
      cuts.append(step)
    data_step = last
  return cuts


def check_reopenable(batches: Any, hook: str) -> None:
  """Refuses a source that a rewind could not open again at an earlier position.

  A rewind re-opens the source at the restored checkpoint's position, as a resume does:
  a step-indexed source (``batch_at``), an iterable that starts again on each ``iter()``
  (a list, a tf.data dataset, a Grain ``DataLoader``) or an iterator with ``set_state``
  (a Grain iterator) can; a one-shot iterator (a generator) cannot.

  Raises:
    ValueError: naming the source's type and ``hook``.
  """
  if (hasattr(batches, "batch_at") or callable(getattr(batches, "set_state", None))
      or not isinstance(batches, Iterator)):
    return
  raise ValueError(
      f"{hook} may rewind the run to an earlier checkpoint, but the batches are a one-shot "
      f"{type(batches).__module__}.{type(batches).__qualname__} (an iterator without "
      "set_state) that cannot be opened again at an earlier position: pass a re-iterable "
      "source (a list, a tf.data dataset, a Grain DataLoader, loopkit.ArraySource) instead")
