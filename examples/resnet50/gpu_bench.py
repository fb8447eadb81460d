"""ResNet-50 training throughput at K = 1 and K = 100 on whatever accelerator is present.

  python examples/resnet50/gpu_bench.py            # ResNet-50, 224x224, batch 256, bf16
  python examples/resnet50/gpu_bench.py --tiny     # CPU check: 32x32, batch 16, 8 filters

Runs the example's real train step (ResNet-50 v1.5, SGD Nesterov, label
smoothing, bfloat16 compute with float32 parameters, uint8 images normalised
on the device) in loopkit's compiled multi-step program
(:class:`loopkit.core.MultiStepProgram`, the program ``TrainLoop`` dispatches, in
the ``"global"`` step style over all local devices) for K = 1 and K = 100
train steps per device call, on synthetic data that stays on the device
(random uint8 images and labels, one chunk ``[K, B, S, S, 3]`` reused by every
call). So it measures device compute plus per-call overhead, not the input
pipeline. Per K: one call to compile, one warm-up call, then timed calls
dispatched back to back while the host fetches each call's step counter one
call late, as ``TrainLoop`` does. Prints one JSON line per K and a summary.

Expected wall time on one H200: about 2-3 minutes (two compilations of
ResNet-50 dominate; the timed part is 200 steps per K).

``benchmarks/gpu.py`` is the side-by-side run (per-step loop, ``TrainLoop`` at
K = 1, 26, 100 from a host source, this device-resident limit, the MLP, with
and without XLA's while-loop command buffers); it builds its step with
:func:`build_step` from here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# Runnable as a script from anywhere: put the repository root on the path.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

if (__name__ == "__main__" and "--tiny" in sys.argv
    and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", "")):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import loopkit  # noqa: E402
from examples.resnet50 import train  # noqa: E402
from examples.resnet50.configs import default  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--tiny", action="store_true",
                 help="32x32, batch 16, 8 base filters, few steps, 8 fake CPU devices: a "
                      "correctness check for CPUs")
  p.add_argument("--batch", type=int, default=256, help="global batch size")
  p.add_argument("--image_size", type=int, default=224)
  p.add_argument("--depth", type=int, default=50)
  p.add_argument("--ks", default="1,100", help="iterations_per_loop values to measure")
  p.add_argument("--timed_steps", type=int, default=None, help="steps timed per K (rounded "
                 "up to whole calls; default 200, 100 with --tiny)")
  p.add_argument("--float32", action="store_true", help="float32 compute instead of bf16")
  args = p.parse_args(argv)
  if args.tiny:
    args.batch, args.image_size = 16, 32
  if args.timed_steps is None:
    args.timed_steps = 100 if args.tiny else 200
  return args


def build_step(*, depth: int = 50, batch: int = 256, num_filters: int = 64,
               num_classes: int = 1000, half_precision: bool = True):
  """(train_step, initial state) of the example's ResNet recipe at these sizes.

  Args:
    depth: ResNet depth (18, 34, 50, ...; ``models.STAGE_SIZES``).
    batch: global batch size B (sets the learning-rate schedule's scale only).
    num_filters: base filter count (64 for ResNet-50 proper).
    num_classes: logits per example.
    half_precision: bfloat16 compute with float32 parameters (else float32).

  Returns:
    ``(train_step, state)``: ``train_step(state, {"image": uint8 [B, S, S, 3],
    "label": int32 [B]}) -> (state, metrics)`` and the initial
    :class:`examples.resnet50.train.TrainState` (built by one jitted init, on
    the default device).
  """
  config = default.get_config()
  config.model.depth = depth
  config.model.num_filters = num_filters
  config.num_classes = num_classes
  config.half_precision = half_precision
  config.global_batch_size = batch
  steps_per_epoch = 1_281_167 // batch
  schedule = train.learning_rate_schedule(config, steps_per_epoch)
  tx = train.create_optimizer(config, schedule)
  graphdefs = []

  def init():  # one compiled program: eager NNX init compiles every initialiser op apart
    graphdef, state = train.create_train_state(train.create_model(config), tx)
    graphdefs.append(graphdef)  # static structure, no arrays
    return state

  state = jax.jit(init)()
  step = train.make_train_step(graphdefs[0], tx, schedule, num_classes=config.num_classes,
                               label_smoothing=config.label_smoothing,
                               dtype=train.compute_dtype(config))
  return step, state


def build(args):
  """(train_step, initial state) of the example for the benchmark's settings."""
  return build_step(depth=args.depth, batch=args.batch, num_filters=8 if args.tiny else 64,
                    half_precision=not args.float32)


def measure(args, k: int, mesh) -> dict:
  """Images/s for ``iterations_per_loop = k`` (compile and warm-up excluded)."""
  step, state = build(args)
  program = loopkit.core.MultiStepProgram(step, iterations_per_loop=k, mesh=mesh)
  state = program.place_state(state)
  shape = (k, args.batch, args.image_size, args.image_size, 3)

  @jax.jit(out_shardings=program.batch_sharding)
  def synthetic(key):  # generated on the device: no multi-GB host arrays
    k1, k2 = jax.random.split(key)
    return {"image": jax.random.bits(k1, shape, jnp.uint8),
            "label": jax.random.randint(k2, (k, args.batch), 0, 1000, jnp.int32)}

  chunk = synthetic(jax.random.key(0))
  n = jax.device_put(np.int32(k), program.replicated)
  t0 = time.perf_counter()
  state, out = program(state, chunk, n)  # compile + first call
  jax.block_until_ready(out.step)
  compile_secs = time.perf_counter() - t0
  state, out = program(state, chunk, n)  # warm-up
  jax.block_until_ready(out.step)
  calls = max(1, -(-args.timed_steps // k))
  pending = None
  t0 = time.perf_counter()
  for _ in range(calls):
    state, out = program(state, chunk, n)
    if pending is not None:
      jax.device_get(pending.step)  # fetch one call late, like TrainLoop
    pending = out
  last = jax.device_get(pending)
  secs = time.perf_counter() - t0
  steps = calls * k
  assert int(last.step) == (calls + 2) * k, (int(last.step), calls, k)
  loss = loopkit.metrics.fold_steps(last.traces["loss"]).compute()
  return {"iterations_per_loop": k, "images_per_sec": round(steps * args.batch / secs, 1),
          "ms_per_step": round(1000 * secs / steps, 3), "timed_steps": steps,
          "timed_secs": round(secs, 3), "compile_secs": round(compile_secs, 1),
          "compile_count": program.compile_count(), "loss": round(loss, 4),
          "global_batch": args.batch, "image_size": args.image_size,
          "model": f"ResNet-{args.depth}" + ("/8 filters" if args.tiny else ""),
          "dtype": "float32" if args.float32 else "bfloat16",
          "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}"}


def main(argv=None) -> list[dict]:
  args = parse_args(argv)
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  if args.batch % jax.device_count():
    raise SystemExit(f"--batch {args.batch} is not divisible by {jax.device_count()} devices")
  print(f"# jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].device_kind} "
        f"({jax.devices()[0].platform})", flush=True)
  rows = []
  for k in (int(x) for x in args.ks.split(",")):
    row = measure(args, k, mesh)
    rows.append(row)
    print(json.dumps(row), flush=True)
  base = rows[0]["images_per_sec"]
  for row in rows:
    print(f"# K={row['iterations_per_loop']:>4}: {row['images_per_sec']:>9.1f} images/s "
          f"({row['ms_per_step']:.2f} ms/step, x{row['images_per_sec'] / base:.3f} vs "
          f"K={rows[0]['iterations_per_loop']}), compile {row['compile_secs']} s", flush=True)
  return rows


if __name__ == "__main__":
  main()
