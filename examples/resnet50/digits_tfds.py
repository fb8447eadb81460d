"""scikit-learn's handwritten digits as a local TFDS dataset (``sklearn_digits``).

The CPU configurations train the ResNet on the 1,797 8x8 grey-scale digits that
ship inside scikit-learn (``sklearn.datasets.load_digits``; nothing is
downloaded). Exposing them as a TFDS dataset means the CPU run goes through the
same ``tfds.builder(...).as_dataset(...)`` code path, per-process split and
preprocessing as ``imagenet2012`` (PNG instead of JPEG bytes).

The dataset is generated into ``data_dir`` at first use (a few seconds, about
1 MB of TFRecords, or of ArrayRecord files for the Grain pipeline); later runs
read the prepared files. Building it says so in two lines of its own (what,
where, how long); TFDS's own output while it builds (a "Downloading and
preparing dataset Unknown size" line, for data nothing downloads, and its
progress bars) is kept back, and shown only if the build fails.

Splits (fixed, stratified by label with ``random_state=0``, as the digits MLP
example): ``train`` 1,437 examples, ``test`` 360 examples. Features:
``image`` uint8 ``[8, 8, 1]`` (the 0..16 pixel values scaled to 0..255 and
rounded), ``label`` int64 0..9.
"""

from __future__ import annotations

import contextlib
import io
import sys
import time

import numpy as np
import tensorflow_datasets as tfds
from absl import logging

NAME = "sklearn_digits"
TEST_SIZE = 360
SPLIT_SEED = 0


class SklearnDigits(tfds.core.GeneratorBasedBuilder):
  """TFDS builder for ``sklearn.datasets.load_digits`` (no download)."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Initial release: 1,437 train / 360 test, stratified, seed 0."}

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self,
        description="UCI optical recognition of handwritten digits (scikit-learn copy), "
                    "8x8 grey-scale, 10 classes.",
        features=tfds.features.FeaturesDict({
            "image": tfds.features.Image(shape=(8, 8, 1), encoding_format="png"),
            "label": tfds.features.ClassLabel(num_classes=10),
        }),
        supervised_keys=("image", "label"),
        homepage="https://scikit-learn.org/stable/modules/generated/"
                 "sklearn.datasets.load_digits.html",
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # the data ships with scikit-learn
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    data = load_digits()
    images = np.round(data.images * (255.0 / 16.0)).astype(np.uint8)[..., None]
    labels = data.target.astype(np.int64)
    idx = np.arange(len(labels))
    train_idx, test_idx = train_test_split(idx, test_size=TEST_SIZE, random_state=SPLIT_SEED,
                                           stratify=labels)
    return {
        "train": self._generate_examples(images, labels, np.sort(train_idx)),
        "test": self._generate_examples(images, labels, np.sort(test_idx)),
    }

  def _generate_examples(self, images, labels, indices):
    for i in indices:
      yield int(i), {"image": images[i], "label": int(labels[i])}


def ensure_prepared(data_dir: str | None, file_format: str = "tfrecord"
                    ) -> tfds.core.DatasetBuilder:
  """Returns the ``sklearn_digits`` builder, generating the files on first use.

  Args:
    data_dir: TFDS data directory (None: TFDS's default, ``$TFDS_DATA_DIR`` or
      ``~/tensorflow_datasets``).
    file_format: ``"tfrecord"`` (read by ``builder.as_dataset``, the tf.data
      pipeline) or ``"array_record"`` (random access through
      ``builder.as_data_source``, the Grain pipeline).

  Returns:
    The prepared builder.

  Raises:
    ValueError: ``data_dir`` holds the digits in the other format (TFDS keeps
      one format per dataset version), naming both.
  """
  try:
    builder = SklearnDigits(data_dir=data_dir, file_format=file_format)
  except ValueError as e:
    if "File format is already set" not in str(e):
      raise
    existing = SklearnDigits(data_dir=data_dir)
    prepared = existing.info.file_format.value
    other = {"tfrecord": "tfdata", "array_record": "grain"}.get(prepared, prepared)
    raise ValueError(f"the {NAME} dataset in {existing.data_dir} was built as {prepared!r}, "
                     f"but {file_format!r} was asked for (TFDS keeps one file format per "
                     "dataset version): pass another directory (--config.data_dir=DIR or "
                     f"$TFDS_DATA_DIR), or read this one with --config.input_pipeline={other}"
                     ) from None
  if builder.data_path.exists():  # prepared earlier (download_and_prepare's own test)
    return builder
  logging.info("building the %s dataset (scikit-learn's 1,797 digits, no download) as %s "
               "files in %s", NAME, file_format, builder.data_dir)
  t0 = time.perf_counter()
  tfds_output = io.StringIO()
  try:
    with contextlib.redirect_stdout(tfds_output), contextlib.redirect_stderr(tfds_output):
      builder.download_and_prepare()
  except BaseException:
    sys.stderr.write(tfds_output.getvalue())  # what TFDS said before it failed
    raise
  splits = builder.info.splits
  logging.info("built %s in %.1f s: %s train and %s test examples in %s", NAME,
               time.perf_counter() - t0, f"{splits['train'].num_examples:,}",
               f"{splits['test'].num_examples:,}", builder.data_dir)
  return builder
