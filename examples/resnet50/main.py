"""Trains a ResNet with loopkit.TrainLoop: ImageNet on a TPU pod slice, digits on a CPU.

  python -m examples.resnet50.main --workdir /tmp/resnet-cpu        # configs/cpu.py
  python -m examples.resnet50.main --workdir gs://BUCKET/resnet50 \\
      --config examples/resnet50/configs/imagenet_flax.py           # every TPU worker

Rerunning with the same ``--workdir`` resumes from the latest checkpoint (state, ledger, data
position). Override fields with ``--config.<name>=value``, e.g. ``--config.iterations_per_loop=1``.
With ``config.distributed`` (the ImageNet configs) or ``JAX_COORDINATOR_ADDRESS`` in the
environment, ``jax.distributed.initialize()`` runs first.

On a CPU-only machine the run uses 8 fake CPU devices, set through ``XLA_FLAGS`` before JAX is
imported unless ``XLA_FLAGS`` already names a device count (the flag affects only the CPU
backend). What a run prints is its own (C70): ``config.platform = "cpu"`` keeps JAX from
probing for a TPU or GPU (with libtpu installed that probe prints libtpu's errors);
``TF_CPP_MIN_LOG_LEVEL=1`` and ``TF_ENABLE_ONEDNN_OPTS=0`` (unless set) keep TensorFlow's C++
INFO lines at import off, here and in Grain's workers (on a CPU with AVX512_VNNI or AMX,
TensorFlow 2.21 announces its oneDNN ops whatever the log level; off, the input pipeline's ops
compute alike on every x86 CPU); Orbax's and TFDS's INFO lines are dropped.
"""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()
# Before TensorFlow is imported (by TFDS, and in Grain's worker processes, which inherit it).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import logging as pylogging  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from examples.resnet50 import config_checks  # noqa: E402

_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Directory for checkpoints, TensorBoard/JSONL metrics and results.json "
    "(a shared one, e.g. gs://..., on a multi-host pod slice).")
_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "cpu.py"),
    "Training configuration file (an ml_collections ConfigDict).", lock_config=True)
flags.mark_flags_as_required(["workdir"])


def _quiet_libraries(record) -> bool:
  """absl log filter: drops Orbax's and TFDS's INFO lines (per save / per epoch), keeps the rest."""
  noisy = ("/orbax/", "/tensorflow_datasets/")
  return record.levelno >= pylogging.WARNING or not any(n in record.pathname for n in noisy)


def use_platform(platform: str) -> None:
  """Makes ``platform`` (``config.platform``, e.g. ``"cpu"``) JAX's only one, before its
  backends start, in this process and in the ones it starts (Grain's workers).

  ``""`` or an environment that sets ``JAX_PLATFORMS`` itself: left to JAX.
  """
  if not platform or "JAX_PLATFORMS" in os.environ:
    return
  os.environ["JAX_PLATFORMS"] = platform
  jax.config.update("jax_platforms", platform)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Too many command-line arguments: {argv[1:]}")
  logging.get_absl_handler().addFilter(_quiet_libraries)
  config = _CONFIG.value
  wrong = config_checks.problems(config)
  if wrong:  # before JAX's backend, TensorFlow and the workdir
    raise app.UsageError("the config has wrong values:\n  " + "\n  ".join(wrong))
  use_platform(config.get("platform", ""))
  if config.distributed or "JAX_COORDINATOR_ADDRESS" in os.environ:
    jax.distributed.initialize()  # before any other JAX call
  logging.info("JAX process %d/%d, %d devices (%d local) x %s", jax.process_index(),
               jax.process_count(), jax.device_count(), jax.local_device_count(),
               jax.devices()[0].platform)
  # Seconds with nothing else on the console (TensorFlow alone: 13 s measured on 2 busy cores).
  logging.info("importing TensorFlow (the input pipeline), Flax and the training code")
  import tensorflow as tf  # noqa: PLC0415  (tf.data only: keep TF off accelerators)
  tf.config.set_visible_devices([], "GPU")
  from examples.resnet50 import train  # noqa: PLC0415

  t0 = time.perf_counter()
  results = train.train_and_evaluate(config, _WORKDIR.value)
  if jax.process_index() == 0:
    print("\n".join(train.summary(config, results, time.perf_counter() - t0)))


if __name__ == "__main__":
  app.run(main)
