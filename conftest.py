"""Test setup for tests/, doctests and examples: 8 fake CPU devices, set before JAX initialises.

Tests marked ``tf`` need TensorFlow and TFDS (extra ``data``): where either is not installed
(.ci/run's newest-JAX environment, extra ``test-notf``) they are skipped, so that plain
``pytest`` runs in both environments. Modules that import TensorFlow at the top skip themselves
at collection (``pytest.importorskip``).
"""

import importlib.util
import os

import pytest

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Not test modules: Sphinx config, figure scripts, benchmark scripts.
collect_ignore = ["docs/conf.py"]
collect_ignore_glob = ["docs/scripts/*", "benchmarks/*"]

_MISSING_TF = [m for m in ("tensorflow", "tensorflow_datasets")
               if importlib.util.find_spec(m) is None]


def pytest_collection_modifyitems(config, items):
  """Skips the tests marked ``tf`` where TensorFlow or TFDS is not installed."""
  del config
  if not _MISSING_TF:
    return
  skip = pytest.mark.skip(reason=f"marked tf: needs {' and '.join(_MISSING_TF)} (extra `data`)")
  for item in items:
    if item.get_closest_marker("tf") is not None:
      item.add_marker(skip)
