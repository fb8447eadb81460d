"""Trains an MLP on scikit-learn's handwritten digits with loopkit.TrainLoop.

  python -m examples.digits.main --workdir /tmp/loopkit-digits
  python -m examples.digits.main --workdir /tmp/d --config.iterations_per_loop=5

On a CPU-only machine the run uses 8 fake CPU devices (data parallel over all
of them), set through ``XLA_FLAGS`` before JAX is imported unless ``XLA_FLAGS``
already names a device count; ``config.platform = "cpu"`` keeps JAX from probing
for a TPU or GPU first (a failed probe prints libtpu's errors where it is installed).
"""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

import time  # noqa: E402

import jax  # noqa: E402
from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from examples.digits import train  # noqa: E402

_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for metrics.jsonl and results.json.")
_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "default.py"),
    "Training configuration file (an ml_collections ConfigDict).", lock_config=True)
flags.mark_flags_as_required(["workdir"])


def use_platform(platform: str) -> None:
  """Makes ``platform`` (``config.platform``) JAX's only one before its backends start
  (``""``, or ``JAX_PLATFORMS`` in the environment: left to JAX and the environment)."""
  if platform and "JAX_PLATFORMS" not in os.environ:
    os.environ["JAX_PLATFORMS"] = platform
    jax.config.update("jax_platforms", platform)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Too many command-line arguments: {argv[1:]}")
  use_platform(_CONFIG.value.get("platform", ""))
  t0 = time.perf_counter()
  logging.info("JAX devices: %d x %s", jax.device_count(), jax.devices()[0].platform)
  results = train.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  wall = time.perf_counter() - t0
  print(f"test accuracy {results['test_accuracy']:.4f} ({results['test_correct']}/"
        f"{results['test_count']} held-out digits) after {results['step']} steps "
        f"({results['epochs']} epochs, iterations_per_loop={results['iterations_per_loop']}, "
        f"{results['device_calls']} device calls, {results['num_devices']} devices, "
        f"{results['compile_count']} compilation) in {wall:.1f} s")
  print(f"metrics (JSON lines): {results['metrics_path']}")
  print(f"summary (JSON):       {results['results_path']}")


if __name__ == "__main__":
  app.run(main)
