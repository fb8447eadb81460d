"""Trains the byte-level Transformer LM with loopkit: FSDP + tensor parallelism on a mesh.

  python -m examples.lm.main --workdir /tmp/lm-cpu                 # configs/default.py, CPU

The CPU run uses 8 fake CPU devices (set through ``XLA_FLAGS`` before JAX is imported, unless
``XLA_FLAGS`` already names a device count) on a ``("data", "fsdp", "tensor")`` mesh of shape
``config.mesh_shape``. Rerunning with the same ``--workdir`` resumes from the latest checkpoint.
Override fields with ``--config.<name>=value``, e.g. ``--config.iterations_per_loop=1``.
"""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

import logging as pylogging  # noqa: E402

import jax  # noqa: E402
from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Directory for checkpoints and TensorBoard/JSONL metrics.")
_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "default.py"),
    "Training configuration file (an ml_collections ConfigDict).", lock_config=True)
flags.mark_flags_as_required(["workdir"])


def _quiet_orbax(record) -> bool:
  """absl log filter: drops Orbax's INFO lines (several per save), keeps the rest."""
  return record.levelno >= pylogging.WARNING or "/orbax/" not in record.pathname


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Too many command-line arguments: {argv[1:]}")
  logging.get_absl_handler().addFilter(_quiet_orbax)
  config = _CONFIG.value
  if config.platform and "JAX_PLATFORMS" not in os.environ:  # no TPU/GPU probe on the CPU run
    jax.config.update("jax_platforms", config.platform)
  if config.distributed:
    jax.distributed.initialize()
  logging.info("JAX process %d/%d, %d devices (%d local) x %s", jax.process_index(),
               jax.process_count(), jax.device_count(), jax.local_device_count(),
               jax.devices()[0].platform)
  from examples.lm import train  # noqa: PLC0415

  results = train.train_and_evaluate(config, _WORKDIR.value)
  if jax.process_index() == 0:
    print("\n".join(train.summary(config, results)))


if __name__ == "__main__":
  app.run(main)
