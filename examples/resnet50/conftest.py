"""pytest: skip importing the command-line scripts during doctest collection.

``main.py`` defines absl flags at import (``--workdir``/``--config``, also
defined by other examples' ``main.py``) and ``gpu_bench.py`` is a script; both
are exercised by ``resnet50_test.py`` in subprocesses instead. ``digits_tfds.py`` imports TFDS,
so it is not collected where TensorFlow is not installed (CI's no-TensorFlow suite).
The ``digits_dir`` fixture (the digits as a TFDS dataset) serves ``resnet50_test.py`` and
``recipe_test.py``.
"""

import importlib.util

import pytest

collect_ignore = ["main.py", "gpu_bench.py"]
if importlib.util.find_spec("tensorflow_datasets") is None:
  collect_ignore.append("digits_tfds.py")


@pytest.fixture(scope="module")
def digits_dir(tmp_path_factory):
  """A TFDS data directory with ``sklearn_digits`` prepared in it (module-scoped)."""
  from examples.resnet50 import digits_tfds
  d = str(tmp_path_factory.mktemp("tfds"))
  digits_tfds.ensure_prepared(d)
  return d


@pytest.fixture(scope="module")
def digits_array_record_dir(tmp_path_factory):
  """A TFDS data directory with ``sklearn_digits`` prepared as ArrayRecord (the Grain path)."""
  from examples.resnet50 import digits_tfds
  d = str(tmp_path_factory.mktemp("tfds_ar"))
  digits_tfds.ensure_prepared(d, file_format="array_record")
  return d
