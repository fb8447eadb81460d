"""The host ledger: training accounting kept on the host, saved in checkpoints.

Invariant: ``ledger.step`` == the step counter inside the state == the optimizer's
update count == the checkpoint label. Plain data; not thread-safe. Only the run
(:mod:`loopkit.core.run`) writes the loop's ledger; hooks read it through a read-only
view (:class:`LedgerView`).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from typing import Any


class Bucket:
  """Names of the ledger's time buckets (``Ledger.seconds`` keys; seconds of wall time).

  A hook's own time goes to its ``time_bucket`` (default :attr:`HOOKS`; the ``hooks``
  time of a run's start and end, outside the device calls, goes to :attr:`SETUP`).
  """

  TOTAL = "total"  # wall time inside TrainLoop.run
  COMPILE = "compile"  # the first dispatch (trace + compile) and the first replica check
  DISPATCH = "dispatch"  # dispatching device calls
  DEVICE_WAIT = "device_wait"  # the host blocked fetching a call's outputs
  DATA_WAIT = "data_wait"  # the host waiting for the next input chunk
  HOOKS = "hooks"  # hooks without a time_bucket of their own
  CHECKPOINT = "checkpoint"  # checkpoint hooks
  EVAL = "eval"  # evaluation hooks
  REPLICA_CHECK = "replica_check"  # per-device style: comparing the devices' state copies
  LOST = "lost"  # work redone after restarts (loopkit.observe.goodput), or a rewind threw away
  SETUP = "setup"  # a run's start and end outside the calls (see Ledger.seconds)

  # The loop's own buckets; every other bucket holds hooks' time (a hook's time_bucket).
  LOOP = (TOTAL, COMPILE, DISPATCH, DEVICE_WAIT, DATA_WAIT, REPLICA_CHECK, LOST, SETUP)


def hook_seconds(seconds: Mapping[str, float]) -> float:
  """The hooks' time in a ledger's ``seconds``: the sum of every bucket not in :attr:`Bucket.LOOP`
  (``hooks``, ``checkpoint``, ``eval`` and any hook's own ``time_bucket``), in seconds."""
  return float(sum(v for k, v in seconds.items() if k not in Bucket.LOOP))


def epoch_of(step: int, steps_per_epoch: int | None) -> tuple[int, int]:
  """The one epoch convention of loopkit: ``(epoch, step_in_epoch)`` after global step ``step``.

  ``epoch`` is the 0-based epoch that step ``step`` belongs to (the epoch of the
  last step done) and ``step_in_epoch`` the steps done in it, so at an epoch end
  ``step_in_epoch == steps_per_epoch`` (steps 20, 10 per epoch: epoch 1, 10 steps
  in it). Step 0 is ``(0, 0)``. Without ``steps_per_epoch``: ``(0, step)``.
  :class:`~loopkit.core.hooks.LoopInfo` and :class:`Ledger` both use it.

  Args:
    step: global step (updates applied), >= 0.
    steps_per_epoch: steps in one epoch, or None / 0 when unknown.
  """
  if not steps_per_epoch:
    return 0, step
  epoch = max(step - 1, 0) // steps_per_epoch
  return epoch, step - epoch * steps_per_epoch


@dataclasses.dataclass
class Ledger:
  """Where training stands.

  Attributes:
    step: global step, the number of optimizer updates applied.
    examples_seen: training examples consumed (sum of global batch sizes).
    loop_index: device calls dispatched so far (across resumes).
    steps_per_epoch: steps in one epoch, or None when unknown.
    seconds: wall time (s) by bucket (names in :class:`Bucket`), cumulative over
      resumes: ``total`` (wall time inside ``run``), ``compile`` (first
      dispatch: trace + compile), ``dispatch``, ``device_wait`` (host blocked
      fetching a call's outputs), ``data_wait``, hook time by the hook's
      ``time_bucket`` (``hooks`` by default, ``checkpoint``, ``eval``),
      ``replica_check`` (per-device style: comparing the devices' copies of the
      state before a hook gets it; the first check of a run, which compiles the
      check, is in ``compile``, and its wait for the call in ``device_wait``),
      ``setup`` (a run's start before its first device call and its end after
      the last call's hooks: the time no other bucket took then, and the
      ``hooks`` bucket's time then; so a run that trains nothing adds only
      to ``setup``, ``data_wait``, ``checkpoint``, ``eval`` and ``total``),
      and ``lost`` (time of work redone after restarts, see :mod:`loopkit.observe.goodput`,
      and the time since the restored checkpoint that a rewind threw away, see
      :func:`loopkit.core.skips.rewound_ledger`).
    lost_steps: steps redone after restarts (trained past the last
      checkpoint, then lost), or after rewinds (:mod:`loopkit.core.skips`).
    skipped_steps: data steps passed over without an update (:mod:`loopkit.core.skips`):
      after every call the source has given :attr:`data_step` = ``step + skipped_steps``
      batches.
    skip_steps: the skip ranges in force, ``((first, last), ...)`` in data steps
      (inclusive, disjoint, ascending): those given to ``run``, those saved in the
      checkpoint it resumed from, and those a rewind added.
  """

  step: int = 0
  examples_seen: int = 0
  loop_index: int = 0
  steps_per_epoch: int | None = None
  seconds: dict[str, float] = dataclasses.field(default_factory=dict)
  lost_steps: int = 0
  skipped_steps: int = 0
  skip_steps: tuple[tuple[int, int], ...] = ()

  @property
  def data_step(self) -> int:
    """Batches the source has given so far: ``step + skipped_steps``."""
    return self.step + self.skipped_steps

  @property
  def epoch(self) -> int:
    """0-based epoch of the last step done (:func:`epoch_of`; 0 when steps_per_epoch is unknown)."""
    return epoch_of(self.step, self.steps_per_epoch)[0]

  @property
  def step_in_epoch(self) -> int:
    """Steps done in that epoch (== steps_per_epoch at an epoch end, :func:`epoch_of`)."""
    return epoch_of(self.step, self.steps_per_epoch)[1]

  def advance(self, num_steps: int, global_batch_size: int) -> None:
    """Records one device call of ``num_steps`` steps."""
    self.step += num_steps
    self.examples_seen += num_steps * global_batch_size
    self.loop_index += 1

  def add_time(self, bucket: str, secs: float) -> None:
    self.seconds[bucket] = self.seconds.get(bucket, 0.0) + secs

  def copy(self) -> Ledger:
    """An independent copy (its own ``seconds``)."""
    return dataclasses.replace(self, seconds=dict(self.seconds))

  def to_dict(self) -> dict[str, Any]:
    """JSON-serialisable form (for checkpoints and metric writers)."""
    epoch, in_epoch = epoch_of(self.step, self.steps_per_epoch)
    return {"step": self.step, "epoch": epoch, "step_in_epoch": in_epoch,
            "examples_seen": self.examples_seen, "loop_index": self.loop_index,
            "steps_per_epoch": self.steps_per_epoch, "seconds": dict(self.seconds),
            "lost_steps": self.lost_steps, "skipped_steps": self.skipped_steps,
            "skip_steps": [list(r) for r in self.skip_steps]}

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> Ledger:
    return cls(step=int(d["step"]), examples_seen=int(d["examples_seen"]),
               loop_index=int(d["loop_index"]), steps_per_epoch=d.get("steps_per_epoch"),
               seconds={k: float(v) for k, v in d.get("seconds", {}).items()},
               lost_steps=int(d.get("lost_steps", 0)),
               skipped_steps=int(d.get("skipped_steps", 0)),
               skip_steps=tuple((int(a), int(b)) for a, b in d.get("skip_steps", ())))


class LedgerView:
  """A read-only view of a live :class:`Ledger` (what hooks get as ``ctx.ledger``).

  Reads go to the ledger as it is now (no copy); ``seconds`` is a read-only
  mapping; assigning any attribute raises ``AttributeError``. :meth:`copy`
  gives a plain, writable :class:`Ledger` of the current values.
  """

  __slots__ = ("_ledger",)
  _ledger: Ledger

  def __init__(self, ledger: Ledger):
    object.__setattr__(self, "_ledger", ledger)

  step = property(lambda self: self._ledger.step)
  examples_seen = property(lambda self: self._ledger.examples_seen)
  loop_index = property(lambda self: self._ledger.loop_index)
  steps_per_epoch = property(lambda self: self._ledger.steps_per_epoch)
  lost_steps = property(lambda self: self._ledger.lost_steps)
  skipped_steps = property(lambda self: self._ledger.skipped_steps)
  skip_steps = property(lambda self: self._ledger.skip_steps)
  data_step = property(lambda self: self._ledger.data_step)
  epoch = property(lambda self: self._ledger.epoch)
  step_in_epoch = property(lambda self: self._ledger.step_in_epoch)

  @property
  def seconds(self) -> Mapping[str, float]:
    return types.MappingProxyType(self._ledger.seconds)

  def copy(self) -> Ledger:
    return self._ledger.copy()

  def to_dict(self) -> dict[str, Any]:
    return self._ledger.to_dict()

  def __setattr__(self, name: str, value: Any) -> None:
    raise AttributeError(
        f"the ledger is read-only for hooks (tried to set {name!r}): a hook returns what it "
        "changes (a state, a loopkit.core.Restore, or a loopkit.core.LedgerAdjustment) and the "
        "loop "
        "applies it")

  def __repr__(self) -> str:
    return f"LedgerView({self._ledger!r})"
