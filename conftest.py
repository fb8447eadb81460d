"""Test setup for tests/, doctests and examples: 8 fake CPU devices, set before JAX initialises."""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Not test modules: Sphinx config, figure scripts, benchmark scripts.
collect_ignore = ["docs/conf.py"]
collect_ignore_glob = ["docs/scripts/*", "benchmarks/*"]

