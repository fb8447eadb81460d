"""pytest: skip importing the command-line scripts during doctest collection.

``main.py`` defines absl flags at import (``--workdir``/``--config``, also
defined by other examples' ``main.py``) and ``gpu_bench.py`` is a script; both
are exercised by ``resnet50_test.py`` in subprocesses instead. ``digits_tfds.py`` imports TFDS,
so it is not collected where TensorFlow is not installed (CI's no-TensorFlow suite).
"""

import importlib.util

collect_ignore = ["main.py", "gpu_bench.py"]
if importlib.util.find_spec("tensorflow_datasets") is None:
  collect_ignore.append("digits_tfds.py")
