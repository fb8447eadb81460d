"""What every process runs in the GrainSource tests (tests/test_grain_source.py).

Each function runs inside a child of :func:`loopkit.tools.testing.run_processes`
(P processes x D devices under ``jax.distributed``) or in the test process
itself (1 process x 8 devices). They return plain picklable values.
"""

from __future__ import annotations

import threading
import time

import jax
import numpy as np

import loopkit
from loopkit.data import GrainSource
from tests import toy

GLOBAL_BATCH = 16
NUM_RECORDS = 100  # 6 steps per epoch at GLOBAL_BATCH (4 records of each epoch dropped)


class CountingRecords:
  """A Grain random-access data source (``len``, ``[i]``) of toy regression records.

  Counts the records read (thread-safe), so a test sees what a resume reads.
  Record i is ``{"x": [4] float32, "y": [2] float32, "id": int32 i}``.
  """

  def __init__(self, num_records: int = NUM_RECORDS, seed: int = 0):
    rng = np.random.default_rng(seed)
    true_w = rng.normal(size=(4, 2)).astype(np.float32)
    self.x = rng.normal(size=(num_records, 4)).astype(np.float32)
    self.y = (self.x @ true_w).astype(np.float32)
    self.reads = 0
    self._lock = threading.Lock()

  def __len__(self) -> int:
    return len(self.x)

  def __getitem__(self, i: int) -> dict:
    with self._lock:
      self.reads += 1
    return {"x": self.x[i], "y": self.y[i], "id": np.int32(i)}

  def __getstate__(self):  # picklable for Grain's worker processes (the lock is not)
    state = dict(self.__dict__)
    del state["_lock"]
    return state

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._lock = threading.Lock()


class IndexLog:
  """A Grain ``map_with_index`` transform that logs each global flat index it reads.

  Appends ``index`` (``step * GLOBAL_BATCH + row``) to ``path``, one line per record, from
  whichever process reads it (Grain's worker processes included), and passes the record on.
  """

  def __init__(self, path: str):
    self.path = path

  def __call__(self, index: int, record: dict) -> dict:
    with open(self.path, "a") as f:  # one short append per line: whole lines, any process
      f.write(f"{index}\n")
    return record


def steps_read(path: str) -> list[int]:
  """The step of every record :class:`IndexLog` logged to ``path``, sorted."""
  with open(path) as f:
    return sorted(int(line) // GLOBAL_BATCH for line in f)


class Recording:
  """Delegates to a :class:`GrainSource` and records the example ids of each step it serves."""

  def __init__(self, src: GrainSource):
    self.src = src
    self.steps_per_epoch = src.steps_per_epoch
    self.chunks_are_fresh = True
    self.served: dict[int, list[int]] = {}

  def batch_at(self, step: int):
    return self.src.batch_at(step)

  def chunk_at(self, step: int, num_steps: int):
    chunk = self.src.chunk_at(step, num_steps)
    for i, ids in enumerate(chunk["id"]):
      self.served[step + i] = ids.tolist()
    return chunk

  def position_at(self, step: int):
    return self.src.position_at(step)

  def check_position(self, position, step: int) -> None:
    self.src.check_position(position, step)

  def close(self) -> None:
    self.src.close()


def train(directory: str | None, num_steps: int, iterations_per_loop: int = 3, *,
          worker_count: int = 0, every_steps: int = 6, prefetch: int = 2,
          read_log: str | None = None) -> dict:
  """Trains the toy model on a GrainSource, resuming from ``directory``'s latest checkpoint.

  Returns the final params (numpy), the ledger step, the example ids this
  process fed per step (``{step: ids}``, steps from the resume on), the records
  read in this process, the seconds from ``run`` to the first chunk, the restored
  step, and whether any Grain worker process was still running after ``run``
  returned. ``read_log``: a file :class:`IndexLog` appends every record read to
  (worker processes included).
  """
  import multiprocessing

  from loopkit.checkpoint import CheckpointHook

  records = CountingRecords()
  transform = None if read_log is None else (lambda ds: ds.map_with_index(IndexLog(read_log)))
  src = Recording(GrainSource(records, GLOBAL_BATCH, seed=5, worker_count=worker_count,
                              transform=transform))
  hooks: list = []
  ckpt = None
  if directory is not None:
    ckpt = CheckpointHook(directory, every_steps=every_steps)
    hooks.append(ckpt)
  first: list[float] = []
  t0 = time.perf_counter()
  hooks.append(loopkit.CallbackHook(
      lambda info, _: first or first.append(time.perf_counter() - t0), needs_state=False))
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=iterations_per_loop,
                           hooks=hooks, steps_per_epoch=src.steps_per_epoch, prefetch=prefetch)
  state = loop.run(toy.init_state(), src, num_steps=num_steps)
  workers_left = [p.name for p in multiprocessing.active_children() if "grain" in p.name]
  out = {
      "grain_workers_after_run": workers_left,
      "process_index": jax.process_index(),
      "process_count": jax.process_count(),
      "params": {k: _host(v) for k, v in state["params"].items()},
      "step": loop.ledger.step,
      "served": src.served,
      "reads": records.reads,
      "first_call_s": first[0] if first else None,
      "restored_step": ckpt.restored_step if ckpt is not None else None,
      "position": loop.data_position,
  }
  if ckpt is not None:
    ckpt.close()
  return out


def _host(x) -> np.ndarray:
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return np.asarray(x.addressable_data(0))
  return np.asarray(x)
