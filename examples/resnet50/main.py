"""Trains a ResNet with loopkit.TrainLoop: ImageNet on a TPU pod slice, digits on a CPU.

  python -m examples.resnet50.main --workdir /tmp/resnet-cpu        # configs/cpu.py
  python -m examples.resnet50.main --workdir /tmp/r50 \\
      --config examples/resnet50/configs/cpu_resnet50.py
  python -m examples.resnet50.main --workdir gs://BUCKET/resnet50 \\
      --config examples/resnet50/configs/imagenet_tpu.py           # every TPU worker

  python -m examples.resnet50.main --workdir /tmp/aot \\
      --config examples/resnet50/configs/imagenet_tpu.py --compile_only=v5e:4x8

``--compile_only=TOPOLOGY`` compiles the run's programs for a TPU topology
without a TPU or data and prints the memory/FLOPs report (README.md).
``--config.eval_only=True`` with a training run's ``--workdir`` and config evaluates
each of its checkpoints once, beside it, and stops when it completes (README.md).
Rerunning with the same ``--workdir`` resumes from the latest checkpoint
(state, ledger, data position). Override fields with ``--config.<name>=value``,
e.g. ``--config.iterations_per_loop=1``. With ``config.distributed`` (set in
``imagenet_tpu.py``) or ``JAX_COORDINATOR_ADDRESS`` in the environment,
``jax.distributed.initialize()`` runs first (on Cloud TPU it finds the other
workers by itself).

On a CPU-only machine the run uses 8 fake CPU devices (data parallel over all
of them), set through ``XLA_FLAGS`` before JAX is imported unless ``XLA_FLAGS``
already names a device count (the flag affects only the CPU backend).

What a run prints is its own: the CPU configs (``config.platform = "cpu"``) keep
JAX from probing for a TPU or GPU (on a machine with libtpu installed that probe
prints libtpu's errors and "Unable to initialize backend 'tpu'"); TensorFlow's
C++ INFO lines at import ("oneDNN custom operations are on", "This TensorFlow
binary is optimized ...", after absl's "All log messages before
absl::InitializeLog()"), in this process and in Grain's workers, are off
(``TF_CPP_MIN_LOG_LEVEL=1`` unless set: its warnings and errors still show;
and ``TF_ENABLE_ONEDNN_OPTS=0`` unless set: on a CPU with AVX512_VNNI or AMX,
TensorFlow 2.21 turns its oneDNN ops on and says so before any log level
applies; off, its data-pipeline ops compute alike on every x86 CPU);
Orbax's and TFDS's INFO lines are dropped; building the digits dataset and
initialising the model say what they do and how long it took.
"""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()
# Before TensorFlow is imported (here, by TFDS and in Grain's worker processes, which inherit
# the environment): TF's C++ logs from WARNING up, and its oneDNN ops off (their INFO line
# ignores the log level; the input pipeline's ops then round alike on every x86 CPU).
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
_COMPILATION_CACHE = flags.DEFINE_bool(
    "compilation_cache", True, "Keep JAX's persistent compilation cache in WORKDIR/jax_cache: "
    "a rerun (a resume after a preemption) loads the train and eval programs instead of "
    "compiling them again; the goodput ledger's compile seconds show the saving.")
_COMPILE_ONLY = flags.DEFINE_string(
    "compile_only", None, "Compile the run's train and eval programs for this TPU topology "
    "(e.g. v5e:2x2, v5e:4x8, v4-32; 'local': this machine's devices) through libtpu, print "
    "the memory/FLOPs report, write it to WORKDIR/aot_report.json and exit: no data, no "
    "training, no TPU needed (pip install 'loopkit[tpu]').")
_COMPILE_EVAL = flags.DEFINE_bool(
    "compile_eval", True, "With --compile_only: also compile the evaluator's program.")
_INPUT_RATES = flags.DEFINE_string(
    "input_rates", None, "With --compile_only: the JSON that benchmarks/input.py --out wrote; "
    "its measured images/s per process are printed next to the rate the chip's compute bound "
    "needs from each host.")
flags.mark_flags_as_required(["workdir"])


def _quiet_libraries(record) -> bool:
  """absl log filter: drops Orbax's and TFDS's INFO lines (per save / per epoch), keeps the rest."""
  noisy = ("/orbax/", "/tensorflow_datasets/")
  return record.levelno >= pylogging.WARNING or not any(n in record.pathname for n in noisy)


def use_platform(platform: str) -> None:
  """Makes ``platform`` (``config.platform``, e.g. ``"cpu"``) JAX's only one, before its
  backends start, in this process and in the ones it starts (Grain's workers).

  ``""`` or an environment that sets ``JAX_PLATFORMS`` itself: left to JAX and the
  environment. JAX otherwise tries every backend it knows (TPU through libtpu, where
  installed, then GPU) before it settles on the CPU, and the failed tries are logged.
  """
  if not platform or "JAX_PLATFORMS" in os.environ:
    return
  os.environ["JAX_PLATFORMS"] = platform
  jax.config.update("jax_platforms", platform)


def enable_compilation_cache(workdir: str) -> str:
  """Points JAX's persistent compilation cache at ``workdir/jax_cache`` (before any compile).

  Every program that took at least 1 s to compile is stored (JAX's default threshold; the
  train and eval programs, not the small initialisation ones), whatever its size.

  Returns:
    The cache directory.
  """
  path = os.path.join(workdir, "jax_cache")
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return path


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Too many command-line arguments: {argv[1:]}")
  logging.get_absl_handler().addFilter(_quiet_libraries)
  config = _CONFIG.value
  wrong = config_checks.problems(config)
  if wrong:  # before JAX's backend, TensorFlow and the workdir
    raise app.UsageError("the config has wrong values:\n  " + "\n  ".join(wrong))
  if _COMPILE_ONLY.value:
    return _compile_only(config, _COMPILE_ONLY.value, _WORKDIR.value)
  use_platform(config.get("platform", ""))
  if _COMPILATION_CACHE.value:
    enable_compilation_cache(_WORKDIR.value)
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
  if config.eval_only:
    return _eval_only(train, config, _WORKDIR.value)
  t0 = time.perf_counter()
  r = train.train_and_evaluate(config, _WORKDIR.value)
  wall = time.perf_counter() - t0
  if jax.process_index() != 0:
    return
  resumed = "" if r["restored_step"] is None else f", resumed from step {r['restored_step']}"
  rate = r["train_examples_per_sec"]
  evaluated = (f"eval accuracy {r['eval_accuracy']:.4f} on {r['eval_count']} "
               f"{config.dataset}/{config.eval_split} examples" if r["eval_count"] is not None
               else "not evaluated (the same command resumes)")
  print(f"{r['model']}: {evaluated} at step {r['step']} "
        f"({r['num_train_steps'] / r['steps_per_epoch']:.3g} epochs of "
        f"{r['steps_per_epoch']} steps, batch {r['global_batch_size']}, "
        f"iterations_per_loop={r['iterations_per_loop']}, {r['device_calls']} device calls, "
        f"{r['num_devices']} devices, {r['compile_count']} train compilation"
        f"{'' if r['compile_count'] == 1 else 's'}{resumed}; compile {r['compile_secs']:.1f} s"
        + (f" this run, {r['compile_secs_all_runs']:.1f} s over all runs" if resumed else "")
        + "); "
        f"status {r['status']}; {wall:.1f} s wall"
        + (f"; {rate:.1f} train examples/s (steady state)" if rate else ""))
  if r.get("warm_started"):
    print(f"warm start (init_from): {r['warm_started'].removeprefix('warm start ')}")
  print(f"results (JSON):        {r['results_path']}")
  print(f"metrics (JSONL, TB):   {os.path.join(r['workdir'], 'metrics.jsonl')} "
        f"(tensorboard --logdir {r['workdir']})")
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
  for step, accuracy, loss in r["evaluated"]:
    print(f"  step {step}: eval accuracy {accuracy:.4f}, loss {loss:.4f}")
  print(f"metrics (JSONL, TB):   {r['rows_path']}")
  if r["status"] != "complete":
    raise SystemExit(1)


def _compile_only(config, topology: str, workdir: str) -> None:
  """--compile_only: the AOT report of the run's programs (no jax.distributed, no data)."""
  import json  # noqa: PLC0415

  from examples.resnet50 import train  # noqa: PLC0415

  t0 = time.perf_counter()
  report = train.compile_only(config, topology, with_eval=_COMPILE_EVAL.value)
  print(report)
  measured = None
  if _INPUT_RATES.value:
    with open(_INPUT_RATES.value) as f:
      measured = json.load(f)
  for line in train.input_rate_lines(report, measured):
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
