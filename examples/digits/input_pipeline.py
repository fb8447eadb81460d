"""Input pipeline: scikit-learn's handwritten digits, a fixed test split, per-epoch shuffles.

The data is the UCI "Optical Recognition of Handwritten Digits" test set that
ships inside scikit-learn (``sklearn.datasets.load_digits``): 1,797 grey-scale
images of 8x8 pixels with values 0..16, labels 0..9. Nothing is downloaded.

The test split is fixed by ``split_seed`` (stratified by label) and never seen
in training. Training batches come from :class:`TrainBatches`, a step-indexed
source: the batch for global step ``s`` is a pure function of ``(seed, s)``, so
a resumed run or a run with a different ``iterations_per_loop`` sees exactly
the same batches in the same order.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split


@dataclasses.dataclass(frozen=True)
class Split:
  """One split of the digits data, on the host.

  Attributes:
    images: float32 ``[N, 64]``, pixels scaled from 0..16 to 0..1.
    labels: int32 ``[N]``, the digit 0..9.
  """

  images: np.ndarray
  labels: np.ndarray

  def __len__(self) -> int:
    return int(self.labels.shape[0])


def load_splits(*, test_size: int, split_seed: int) -> tuple[Split, Split]:
  """Loads the digits and splits off a fixed, stratified test set.

  Args:
    test_size: number of held-out test examples (e.g. 360 of 1,797).
    split_seed: seed of the split; the same seed gives the same split.

  Returns:
    ``(train, test)`` splits with disjoint examples.

  Raises:
    ValueError: ``test_size`` is not in ``[10, 1787]`` (scikit-learn's stratified
      split needs at least one example of each class on both sides).
  """
  data = load_digits()
  images = (data.data / 16.0).astype(np.float32)
  labels = data.target.astype(np.int32)
  if not 10 <= test_size <= len(labels) - 10:
    raise ValueError(f"test_size must be in [10, {len(labels) - 10}], got {test_size}")
  x_train, x_test, y_train, y_test = train_test_split(
      images, labels, test_size=test_size, random_state=split_seed, stratify=labels)
  return Split(x_train, y_train), Split(x_test, y_test)


class TrainBatches:
  """Shuffled training batches, indexed by global step (a loopkit ``batch_at`` source).

  Epoch ``e`` uses the permutation drawn from ``numpy.random.default_rng((seed, e))``
  and drops the last ``len(split) % batch_size`` examples of that permutation,
  so every epoch has exactly :attr:`steps_per_epoch` full batches.

  Args:
    split: the training split.
    batch_size: global batch size B (must divide by the data-parallel size,
      e.g. a multiple of 8 for 8 devices).
    seed: shuffle seed.

  Raises:
    ValueError: ``batch_size`` < 1 or larger than the split.

  Thread-safe (no mutable state besides a one-epoch permutation cache guarded
  by being recomputed on a miss).
  """

  def __init__(self, split: Split, *, batch_size: int, seed: int):
    if not 1 <= batch_size <= len(split):
      raise ValueError(f"batch_size must be in [1, {len(split)}], got {batch_size}")
    self.split = split
    self.batch_size = batch_size
    self.seed = seed
    self.steps_per_epoch = len(split) // batch_size
    self._cache: tuple[int, np.ndarray] | None = None

  def permutation(self, epoch: int) -> np.ndarray:
    """Example order of ``epoch`` (0-based): int64 ``[N]``."""
    cached = self._cache
    if cached is not None and cached[0] == epoch:
      return cached[1]
    perm = np.random.default_rng((self.seed, epoch)).permutation(len(self.split))
    self._cache = (epoch, perm)
    return perm

  def batch_at(self, step: int) -> dict[str, np.ndarray]:
    """The batch consumed by global step ``step + 1`` (``step`` = steps done before it).

    Returns:
      ``{"image": float32 [B, 64], "label": int32 [B]}``.
    """
    epoch, index = divmod(step, self.steps_per_epoch)
    idx = self.permutation(epoch)[index * self.batch_size:(index + 1) * self.batch_size]
    return {"image": self.split.images[idx], "label": self.split.labels[idx]}

  def __iter__(self):
    """Batches from step 0 on, without end (for use outside loopkit)."""
    step = 0
    while True:
      yield self.batch_at(step)
      step += 1
