"""The host ledger: training accounting kept on the host, saved in checkpoints.

Invariant: ``ledger.step`` == the step counter inside the state == the optimizer's
update count == the checkpoint label. Plain data; not thread-safe.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class Ledger:
  """Where training stands.

  Attributes:
    step: global step, the number of optimizer updates applied.
    examples_seen: training examples consumed (sum of global batch sizes).
    loop_index: device calls dispatched so far (across resumes).
    steps_per_epoch: steps in one epoch, or None when unknown.
    seconds: wall time (s) by bucket, cumulative over resumes: ``total``
      (wall time inside ``run``), ``compile`` (first dispatch: trace +
      compile), ``dispatch``, ``device_wait`` (host blocked fetching a call's
      outputs), ``data_wait``, hook time by the hook's ``time_bucket``
      (``hooks`` by default, ``checkpoint``, ``eval``), ``replica_check``
      (per-device style: comparing the devices' copies of the state before a
      hook gets it; the first check of a run, which compiles the check, is in
      ``compile``, and its wait for the call in ``device_wait``), and ``lost`` (time of
      work redone after restarts, see :mod:`loopkit.goodput`).
    lost_steps: steps redone after restarts (trained past the last
      checkpoint, then lost).
  """

  step: int = 0
  examples_seen: int = 0
  loop_index: int = 0
  steps_per_epoch: int | None = None
  seconds: dict[str, float] = dataclasses.field(default_factory=dict)
  lost_steps: int = 0

  @property
  def epoch(self) -> int:
    """0-based epoch index of the next step (0 when steps_per_epoch is unknown)."""
    return self.step // self.steps_per_epoch if self.steps_per_epoch else 0

  @property
  def step_in_epoch(self) -> int:
    """Steps done in the current epoch (restarts at 0 at each epoch end)."""
    return self.step % self.steps_per_epoch if self.steps_per_epoch else self.step

  def advance(self, num_steps: int, global_batch_size: int) -> None:
    """Records one device call of ``num_steps`` steps."""
    self.step += num_steps
    self.examples_seen += num_steps * global_batch_size
    self.loop_index += 1

  def add_time(self, bucket: str, secs: float) -> None:
    self.seconds[bucket] = self.seconds.get(bucket, 0.0) + secs

  def to_dict(self) -> dict[str, Any]:
    """JSON-serialisable form (for checkpoints and metric writers)."""
    return {"step": self.step, "epoch": self.epoch, "step_in_epoch": self.step_in_epoch,
            "examples_seen": self.examples_seen, "loop_index": self.loop_index,
            "steps_per_epoch": self.steps_per_epoch, "seconds": dict(self.seconds),
            "lost_steps": self.lost_steps}

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> Ledger:
    return cls(step=int(d["step"]), examples_seen=int(d["examples_seen"]),
               loop_index=int(d["loop_index"]), steps_per_epoch=d.get("steps_per_epoch"),
               seconds={k: float(v) for k, v in d.get("seconds", {}).items()},
               lost_steps=int(d.get("lost_steps", 0)))
