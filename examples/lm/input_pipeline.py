"""Byte-level text from the Python standard library's own sources: nothing downloaded.

The corpus is the ``*.py`` files directly in the running interpreter's standard library
directory (``sysconfig.get_paths()["stdlib"]``, not its subpackages), in sorted order: 168 files,
4.70 MB under CPython 3.11.7, 164 files, 4.58 MB under 3.12.1. Every install of one Python
version has the same files, so the corpus, the split and every batch are the same on every
machine with that version (and differ between versions).

* **Split, by file.** File ``i`` of the sorted list is held out when
  ``i % heldout_every == heldout_every - 1``: about one file in ``heldout_every`` is never
  trained on (whole files, so no window of held-out text is seen in training).
* **Records.** Each split's files are concatenated (each followed by one ``\\0`` byte, a
  document separator the model learns) and cut into non-overlapping windows of
  ``seq_len + 1`` bytes; a record is one window, uint8 ``[seq_len + 1]`` (inputs are its first
  ``seq_len`` bytes, targets its last ``seq_len``). The tail shorter than a window is dropped.
* **Training batches.** :class:`loopkit.data.GrainSource` over the training windows: Grain's
  global shuffle, the global batch of step ``s`` a pure function of ``(seed, s)``, O(1) resume
  (the checkpoint stores the step), each process reading only its rows.
* **Evaluation batches.** ``num_windows`` held-out windows spread evenly over the held-out
  text (window ``j * stride``), in order, in batches of ``eval_batch_size`` (the last one may
  be short: loopkit's :class:`~loopkit.Evaluator` pads and masks it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sysconfig
from collections.abc import Iterator, Sequence

import jax
import numpy as np

import loopkit


def stdlib_dir() -> str:
  """The running interpreter's standard library directory."""
  return sysconfig.get_paths()["stdlib"]


def source_files(root: str | None = None) -> list[str]:
  """The corpus: names of the ``*.py`` files directly in ``root`` (default: the stdlib), sorted.

  Raises:
    ValueError: ``root`` holds no ``.py`` file (naming it).
  """
  root = root or stdlib_dir()
  names = sorted(n for n in os.listdir(root)
                 if n.endswith(".py") and os.path.isfile(os.path.join(root, n)))
  if not names:
    raise ValueError(f"no .py files in {root!r}")
  return names


def split_files(names: Sequence[str], heldout_every: int) -> tuple[list[str], list[str]]:
  """``(train, heldout)``: file ``i`` is held out when ``i % heldout_every == heldout_every - 1``.

  Raises:
    ValueError: ``heldout_every < 2`` or a split with no file.
  """
  if heldout_every < 2:
    raise ValueError(f"heldout_every must be >= 2, got {heldout_every}")
  train = [n for i, n in enumerate(names) if i % heldout_every != heldout_every - 1]
  heldout = [n for i, n in enumerate(names) if i % heldout_every == heldout_every - 1]
  if not train or not heldout:
    raise ValueError(f"{len(names)} files with heldout_every={heldout_every} leave a split empty")
  return train, heldout


def read_text(root: str, names: Sequence[str]) -> np.ndarray:
  """The files' bytes, each followed by a ``\\0``: uint8 ``[total]``."""
  parts = []
  for name in names:
    with open(os.path.join(root, name), "rb") as f:
      parts.append(f.read())
    parts.append(b"\0")
  return np.frombuffer(b"".join(parts), np.uint8)


class Windows:
  """Non-overlapping windows of a byte array, a random-access data source for Grain.

  Record ``i`` is ``{"tokens": text[i * w : (i + 1) * w]}`` (uint8 ``[w]``, ``w = seq_len + 1``).
  Picklable (Grain's worker processes).

  Args:
    text: uint8 ``[N]``.
    seq_len: tokens per training sequence.
  """

  def __init__(self, text: np.ndarray, seq_len: int):
    self.text = text
    self.width = seq_len + 1
    self.num_windows = len(text) // self.width

  def __len__(self) -> int:
    return self.num_windows

  def __getitem__(self, i: int) -> dict[str, np.ndarray]:
    i = int(i)
    if not 0 <= i < self.num_windows:
      raise IndexError(f"window {i} of {self.num_windows}")
    return {"tokens": self.text[i * self.width:(i + 1) * self.width]}


@dataclasses.dataclass(frozen=True)
class Corpus:
  """The two splits of the corpus.

  Attributes:
    root: the directory read.
    train_files, heldout_files: file names (disjoint, together the whole sorted list).
    train_text, heldout_text: their bytes (uint8).
    digest: sha256 of the file names and bytes of both splits, in order (hex, 12 digits).
  """

  root: str
  train_files: list[str]
  heldout_files: list[str]
  train_text: np.ndarray
  heldout_text: np.ndarray
  digest: str


def load_corpus(root: str | None = None, *, heldout_every: int = 16) -> Corpus:
  """Reads and splits the corpus (:func:`source_files`, :func:`split_files`)."""
  root = root or stdlib_dir()
  train_files, heldout_files = split_files(source_files(root), heldout_every)
  train_text, heldout_text = read_text(root, train_files), read_text(root, heldout_files)
  h = hashlib.sha256()
  for part in ("\n".join(train_files).encode(), train_text.tobytes(),
               "\n".join(heldout_files).encode(), heldout_text.tobytes()):
    h.update(part)
  return Corpus(root=root, train_files=train_files, heldout_files=heldout_files,
                train_text=train_text, heldout_text=heldout_text, digest=h.hexdigest()[:12])


def train_source(corpus: Corpus, *, seq_len: int, global_batch_size: int, seed: int,
                 worker_count: int = 0) -> loopkit.data.GrainSource:
  """The training batches: ``{"tokens": uint8 [B / P, seq_len + 1]}`` per step, through Grain."""
  return loopkit.data.GrainSource(Windows(corpus.train_text, seq_len), global_batch_size,
                                  seed=seed, worker_count=worker_count)


class EvalBatches:
  """The held-out windows, ``num_windows`` spread evenly, in batches: a re-iterable.

  Window ``j`` is held-out window ``j * (total // num_windows)``. Global batch ``i`` holds
  windows ``[i * B, (i + 1) * B)`` (the last one may be short: the evaluator pads and masks it);
  process ``p`` of ``P`` yields rows ``[p * B / P, (p + 1) * B / P)`` of each, the rows its
  devices hold. Every iteration yields the same batches ``{"tokens": uint8 [rows, seq_len + 1]}``.

  Args:
    corpus: the corpus (its held-out text).
    seq_len: tokens per sequence.
    num_windows: held-out sequences to evaluate.
    global_batch_size: B, divisible by the process count.
    process_index, process_count: default to JAX's.

  Raises:
    ValueError: fewer held-out windows than ``num_windows``; B not divisible by the process
      count.
  """

  def __init__(self, corpus: Corpus, *, seq_len: int, num_windows: int, global_batch_size: int,
               process_index: int | None = None, process_count: int | None = None):
    windows = Windows(corpus.heldout_text, seq_len)
    if len(windows) < num_windows:
      raise ValueError(f"the held-out text has {len(windows)} windows of {seq_len + 1} bytes, "
                       f"fewer than num_windows={num_windows}")
    count = jax.process_count() if process_count is None else process_count
    index = jax.process_index() if process_index is None else process_index
    if global_batch_size % count:
      raise ValueError(f"eval batch {global_batch_size} is not divisible by the {count} "
                       "processes")
    stride = len(windows) // num_windows
    self.tokens = np.stack([windows[j * stride]["tokens"] for j in range(num_windows)])
    self.global_batch_size = global_batch_size
    self.num_batches = -(-num_windows // global_batch_size)
    local = global_batch_size // count
    self._rows = (index * local, (index + 1) * local)

  def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
    b, (lo, hi) = self.global_batch_size, self._rows
    for i in range(self.num_batches):
      yield {"tokens": self.tokens[i * b:(i + 1) * b][lo:hi]}
