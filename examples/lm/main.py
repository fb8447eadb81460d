"""Trains the byte-level Transformer LM with loopkit: FSDP + tensor parallelism on a mesh.

  python -m examples.lm.main --workdir /tmp/lm-cpu                 # configs/default.py, CPU
  python -m examples.lm.main --workdir /tmp/lm-aot \\
      --config examples/lm/configs/pod.py --compile_only=v5p:2x2x4  # AOT for a TPU slice

The CPU run uses 8 fake CPU devices (set through ``XLA_FLAGS`` before JAX is imported, unless
``XLA_FLAGS`` already names a device count) on a ``("data", "fsdp", "tensor")`` mesh of shape
``config.mesh_shape``. Rerunning with the same ``--workdir`` resumes from the latest checkpoint
(state, ledger, data position). Override fields with ``--config.<name>=value``, e.g.
``--config.iterations_per_loop=1``. ``--compile_only=TOPOLOGY`` compiles the run's programs for
a TPU topology through libtpu, without a TPU or data, prints the memory/FLOPs report, writes it
to ``WORKDIR/aot_report.json`` and exits. ``--config.eval_only=True`` with a training run's
``--workdir`` and config evaluates each of its checkpoints once, beside it, and stops when the
run completes (README.md).
"""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

import json  # noqa: E402
import logging as pylogging  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Directory for checkpoints, TensorBoard/JSONL metrics and results.json.")
_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "default.py"),
    "Training configuration file (an ml_collections ConfigDict).", lock_config=True)
_COMPILE_ONLY = flags.DEFINE_string(
    "compile_only", None, "Compile the run's train and eval programs for this TPU topology "
    "(e.g. v5p:2x2x4, v5e:4x8; 'local': this machine's devices) through libtpu, print the "
    "memory/FLOPs report, write it to WORKDIR/aot_report.json and exit.")
_COMPILE_EVAL = flags.DEFINE_bool(
    "compile_eval", True, "With --compile_only: also compile the evaluator's program.")
flags.mark_flags_as_required(["workdir"])


def _quiet_libraries(record) -> bool:
  """absl log filter: drops Orbax's INFO lines (one per save), keeps the rest."""
  return record.levelno >= pylogging.WARNING or "/orbax/" not in record.pathname


def _use_platform(platform: str) -> None:
  """Makes ``platform`` JAX's only one before its backends start (no TPU/GPU probe), unless
  the environment sets ``JAX_PLATFORMS``."""
  if platform and "JAX_PLATFORMS" not in os.environ:
    os.environ["JAX_PLATFORMS"] = platform
    jax.config.update("jax_platforms", platform)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Too many command-line arguments: {argv[1:]}")
  logging.get_absl_handler().addFilter(_quiet_libraries)
  config = _CONFIG.value
  if _COMPILE_ONLY.value:
    return _compile_only(config, _COMPILE_ONLY.value, _WORKDIR.value)
  _use_platform(config.get("platform", ""))
  if config.distributed or "JAX_COORDINATOR_ADDRESS" in os.environ:
    jax.distributed.initialize()
  logging.info("JAX process %d/%d, %d devices (%d local) x %s", jax.process_index(),
               jax.process_count(), jax.device_count(), jax.local_device_count(),
               jax.devices()[0].platform)
  from examples.lm import train  # noqa: PLC0415 (after the platform is set)
  if config.eval_only:
    return _eval_only(train, config, _WORKDIR.value)
  t0 = time.perf_counter()
  r = train.train_and_evaluate(config, _WORKDIR.value)
  wall = time.perf_counter() - t0
  if jax.process_index() != 0:
    return
  resumed = "" if r["restored_step"] is None else f", resumed from step {r['restored_step']}"
  rate = r["tokens_per_sec"]
  evaluated = ("not evaluated (the same command resumes)" if r["eval_perplexity"] is None else
               f"held-out perplexity {r['eval_perplexity']:.3f} "
               f"({r['eval_bits_per_byte']:.3f} bits/byte, next-byte accuracy "
               f"{r['eval_accuracy']:.4f}) on {r['eval_count']} sequences of {r['seq_len']} bytes")
  print(f"byte-level LM, {r['num_params']:,} parameters: {evaluated} at step {r['step']} "
        f"(batch {r['global_batch_size']}, iterations_per_loop={r['iterations_per_loop']}, "
        f"{r['device_calls']} device calls, mesh {r['mesh_shape']}, {r['compile_count']} train "
        f"compilation{'' if r['compile_count'] == 1 else 's'}{resumed}); status {r['status']}; "
        f"{wall:.1f} s wall" + (f"; {rate:,.0f} train tokens/s (steady state)" if rate else ""))
  if r["continuation"]:
    print(f"greedy continuation of {r['prompt']!r}: {r['continuation']!r}")
  print(f"results (JSON):        {r['results_path']}")
  print(f"metrics (JSONL, TB):   {os.path.join(r['workdir'], 'metrics.jsonl')}")
  print(f"checkpoints (Orbax):   {os.path.join(r['workdir'], 'checkpoints')}")


def _eval_only(train, config, workdir: str) -> None:
  """--config.eval_only=True: evaluate the checkpoints of the training run in WORKDIR beside it."""
  t0 = time.perf_counter()
  r = train.evaluate_beside(config, workdir)
  if jax.process_index() != 0:
    return
  skipped = (f", skipped {r['skipped']} (deleted by the run's retention before they were read)"
             if r["skipped"] else "")
  print(f"eval_only: {len(r['evaluated'])} checkpoint(s) of {workdir} evaluated{skipped}; "
        f"{'the training run completed' if r['status'] == 'complete' else 'stopped waiting'}; "
        f"{time.perf_counter() - t0:.1f} s wall")
  for step, perplexity in r["evaluated"]:
    print(f"  step {step}: held-out perplexity {perplexity:.3f}")
  print(f"metrics (JSONL, TB):   {r['rows_path']}")
  if r["status"] != "complete":
    raise SystemExit(1)


def _compile_only(config, topology: str, workdir: str) -> None:
  """--compile_only: the AOT report of the run's programs (no jax.distributed, no data)."""
  from examples.lm import models, train  # noqa: PLC0415

  t0 = time.perf_counter()
  report = train.compile_only(config, topology, with_eval=_COMPILE_EVAL.value)
  print(f"byte-level LM, {models.param_count(train.model_config(config)):,} parameters, "
        f"sequences of {config.seq_len} bytes, mesh_shape {tuple(config.mesh_shape)}")
  print(report)
  for line in train.flops_lines(config, report):
    print(line)
  print(f"compiled for {topology} in {time.perf_counter() - t0:.1f} s on "
        f"{os.cpu_count()} CPUs (jax {jax.__version__})")
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, "aot_report.json")
  with open(path, "w") as f:
    json.dump(report.to_dict(), f, indent=2)
  print(f"report (JSON): {path}")


if __name__ == "__main__":
  app.run(main)
