"""Checkpoints through Orbax: the hook, its files, its items, the directory lock, the follower.

:class:`CheckpointHook` saves and restores the train state, the ledger, the
data position and the hooks' own state as one Orbax checkpoint per step
(needs ``pip install 'loopkit[checkpoint]'``). ``files`` finds and tidies step
directories, ``items`` turns run state into Orbax items and back, ``lock``
checks the directory at run start and keeps two runs out of one directory.
:class:`CheckpointFollower` (``follow``) evaluates each new checkpoint of a
training run beside it, once, and stops when the run completes.
"""

from loopkit.checkpoint.follower import CheckpointFollower, follow
from loopkit.checkpoint.hook import (
    CheckpointError,
    CheckpointHook,
    CheckpointWarning,
    RestoredCheckpoint,
)

__all__ = ["CheckpointError", "CheckpointFollower", "CheckpointHook", "CheckpointWarning",
           "RestoredCheckpoint", "follow"]
