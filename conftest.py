"""Test setup for tests/, doctests and examples: 8 fake CPU devices, set before JAX initialises."""

import importlib.util
import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Not test modules: Sphinx config, figure scripts, benchmark scripts.
collect_ignore = ["docs/conf.py"]
collect_ignore_glob = ["docs/scripts/*", "benchmarks/*"]

# Modules that import TensorFlow when imported (doctest collection imports every module). Where
# TensorFlow is not installed (CI's newest-JAX suite, `-m 'not slow and not tf'`) they are not
# collected; their tests are marked `tf`.
if importlib.util.find_spec("tensorflow") is None:
  collect_ignore += ["tests/nnx_mnist_original.py", "tests/nnx_mnist_ported.py"]
  # (examples/resnet50/conftest.py does the same for digits_tfds.py: pytest reads collect_ignore
  # from the nearest conftest only)
