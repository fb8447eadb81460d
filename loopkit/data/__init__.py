"""Input: sources, the chunk feeder, placement on the mesh, device-resident data.

A source yields global or process-local batches; the feeder stacks K of them
into a ``[K, B, ...]`` chunk on a host thread and places it on the mesh.
:class:`ArraySource` forms a chunk in one gather (``chunk_at``) and resumes in
O(1); :class:`GrainSource` does the same over a Grain random-access dataset
(ArrayRecord, ``tfds.data_source``), with one global order for any process
count and Grain worker processes; :class:`TfDataSource` wraps ``tf.data``;
the ``*_for_process`` helpers give each process its share of a dataset.
:class:`DeviceDataset` keeps a whole (small) dataset on the devices.

Imports only ``loopkit._internal``.
"""

from loopkit._internal.checks import BatchLayoutWarning
from loopkit.data.device_data import DeviceDataset, DeviceDataState
from loopkit.data.grain_source import GrainSource
from loopkit.data.sources import (
  ArraySource,
  TfDataSource,
  batch_arrays,
  eval_batches_per_process,
  grain_shard_for_process,
  grain_shard_options,
  process_shard_bounds,
  shard_for_process,
  steps_per_epoch_of,
  tfds_split_for_process,
)

__all__ = [
    "ArraySource",
    "BatchLayoutWarning",
    "DeviceDataState",
    "DeviceDataset",
    "GrainSource",
    "TfDataSource",
    "batch_arrays",
    "eval_batches_per_process",
    "grain_shard_for_process",
    "grain_shard_options",
    "process_shard_bounds",
    "shard_for_process",
    "steps_per_epoch_of",
    "tfds_split_for_process",
]
