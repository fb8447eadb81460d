"""Checkpoints through Orbax: the hook, its files, its items, the directory lock, the spike hook.

:class:`CheckpointHook` saves and restores the train state, the ledger, the
data position and the hooks' own state as one Orbax checkpoint per step
(needs ``pip install 'loopkit[checkpoint]'``). ``files`` finds and tidies step
directories, ``items`` turns run state into Orbax items and back, ``lock``
checks the directory at run start and keeps two runs out of one directory,
``tiers`` composes the temporary and permanent retention tiers;
:class:`LocalCheckpointHook` (``local_tier``) adds a fast local tier (each host's disk)
beside a persistent ``CheckpointHook``.
:class:`LossSpikeHook` rewinds a run to its last checkpoint at a loss spike and skips the
data around it (``spike``).
An evaluation sidecar that follows the directory is :mod:`loopkit.tools.follower`.
``warm`` starts a run from chosen leaves of another run's checkpoint
(:func:`warm_start`, ``CheckpointHook(init_from=...)``).
"""

from loopkit.checkpoint.hook import (
    CheckpointError,
    CheckpointHook,
    CheckpointWarning,
    RestoredCheckpoint,
)
from loopkit.checkpoint.local_tier import LocalCheckpointHook
from loopkit.checkpoint.spike import LossSpikeError, LossSpikeHook
from loopkit.checkpoint.warm import WarmStart, WarmStartError, warm_start

__all__ = [
    "CheckpointError",
    "CheckpointHook",
    "CheckpointWarning",
    "LocalCheckpointHook",
    "LossSpikeError",
    "LossSpikeHook",
    "RestoredCheckpoint",
    "WarmStart",
    "WarmStartError",
    "warm_start",
]
