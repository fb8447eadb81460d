"""Accelerator benchmark: ResNet-50 and the dispatch-bound MLP, side by side, in one run.

Usage (from the repository root)::

  python benchmarks/gpu.py --out benchmarks/RESULTS_gpu.md   # one H200: at most ~8 minutes
  python benchmarks/gpu.py --tiny                            # CPU smoke run, ~1-2 minutes

What one run measures, each variant **with and without** one XLA flag, by default
``XLA_FLAGS=--xla_gpu_deterministic_ops=true`` (the setting under which the bitwise promise
holds on a GPU), or with ``LOOPKIT_GPU_ON_FLAG=command-buffers`` in the environment
``--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL`` (XLA reads ``XLA_FLAGS`` once, when
the backend starts, so every flag setting runs in its own worker process):

* ResNet-50 v1.5, 224x224, bfloat16 compute, global batch 256, the example's
  real train step (``examples/resnet50``: SGD Nesterov, label smoothing, uint8
  images normalised on the device), fed from a host source of uint8 images
  (a pool of distinct random numpy batches, cycled):

  - ``per-step``: the Flax examples' loop, one state-donating ``jax.jit`` call
    per step, batches placed two ahead (``benchmarks.systems.device_prefetch``,
    what ``flax.jax_utils.prefetch_to_device(it, 2)`` does for pmap), metrics
    fetched every 100 steps (``benchmarks.systems.per_step_loop``);
  - ``K=1``, ``K=26``, ``K=100``: ``loopkit.TrainLoop`` end to end with its GPU defaults
    (``chunk_assembly="device"``: the feeder thread places each batch as it comes and the
    chunk ``[K, B, ...]`` is assembled on the device; ``full_call_loop="static"``: full calls
    run a static-trip executable, which XLA:GPU runs without the host);
  - ``limit``: loopkit's K=100 program alone, called back to back on one chunk
    already on the device (no input work at all: what K=100 could reach).

  images/s, ratios to the per-step loop and to the limit (same flag setting),
  MFU (FLOPs per step from the compiled single-step executable's
  ``cost_analysis()``, over the device's peak dense bf16 rate, :data:`PEAK_FLOPS`)
  and host CPU seconds per device call (``time.process_time`` over the timed
  run, all threads of the process, divided by its calls).
* The dispatch-bound MLP of ``benchmarks/run.py`` (``x [32, 64]`` -> 64 -> 10):
  the same worker as the CPU benchmark (``run.worker``): the one-scan limit,
  loopkit K = 1, 10, 100 (and K=100 without the prefetch thread), the per-step
  ``jit`` loops, and the tail/event mechanism.

Target machine of the ``h200`` plan: one NVIDIA H200 (141 GB of HBM3e, about
139 GiB visible to JAX), 16 CPU cores, 128 GiB of host memory.

Time budget: the whole run is planned to end within ``--budget-s`` (default 450 s
for the H200 plan). The flag settings share what is left in turn; each worker
estimates every variant's cost (compile + warm-up + timed steps, refined by what
it has measured) before starting it and records it as skipped, with the
reason, where it would not fit; the parent kills a variant that runs past its
timeout or past the total budget, records that, and starts a fresh worker for
the variants left. Any variant's failure is a row of the
report, never the end of the run. The report is written with the date, the
exact command, package versions and the device to ``--out``; ``--json`` keeps
the raw rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import itertools
import json
import os
import queue
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from benchmarks import run as cpu_run  # noqa: E402  (stdlib-only at import: no JAX here)

COMMAND_BUFFER_FLAG = "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"
DETERMINISTIC_FLAG = "--xla_gpu_deterministic_ops=true"
# the flag the "on" setting adds, by the name LOOPKIT_GPU_ON_FLAG gives (default deterministic)
ON_FLAGS = {"deterministic": DETERMINISTIC_FLAG, "command-buffers": COMMAND_BUFFER_FLAG}


def _flag_name() -> str:
  """The report's name of the ``on``/``off`` column: the flag's short name."""
  return {v: k for k, v in ON_FLAGS.items()}[on_flag()].replace("-", " ")


def on_flag() -> str:
  """The XLA flag of the ``on`` setting (``LOOPKIT_GPU_ON_FLAG``, default deterministic)."""
  name = os.environ.get("LOOPKIT_GPU_ON_FLAG", "deterministic")
  if name not in ON_FLAGS:
    raise ValueError(f"LOOPKIT_GPU_ON_FLAG={name!r}; expected one of {sorted(ON_FLAGS)}")
  return ON_FLAGS[name]

# XLA's per-fusion autotuning results, kept in a directory that every worker of the run shares:
# the second flag setting's compiles reuse the first's cuDNN/cuBLAS/Triton choices (shorter
# compiles, and the same kernels with and without the flag). Dropped if XLA does not know it.
AUTOTUNE_CACHE_FLAG = "--xla_gpu_per_fusion_autotune_cache_dir"
FLAG_SETTINGS = ("on", "off")  # the order the workers run in
# Peak dense bf16 tensor-core rate by device kind. NVIDIA's H200 datasheet (nvidia.com/h200,
# "H200 SXM": BF16 Tensor Core 1,979 TFLOPS *with sparsity*) halves to 989 TFLOP/s dense; the
# H200 shares the H100's compute engine (same figure on the H100 SXM datasheet). A bf16
# 8192^3 matmul reaches 769-798 TFLOP/s on the H200 machine described in the module docstring.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12}
PACKAGES = ["jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin",
            "jax-cuda12-pjrt", "flax", "optax", "numpy", "ml_collections", "loopkit"]
TAG = "@@gpu.py "  # prefix of the worker's protocol lines on stdout
RESNET_VARIANTS = ("per-step", "K=1", "K=26", "K=100", "limit")
ALL_VARIANTS = ("mlp",) + RESNET_VARIANTS
# Most important first within a worker: with the flag the loopkit rows against the per-step
# loop and the limit; without it, loopkit against the limit (the per-step program has no
# while loop, so the flag should not change it).
ORDER = {"on": ("mlp", "per-step", "K=100", "limit", "K=26", "K=1"),
         "off": ("mlp", "K=100", "limit", "per-step", "K=26", "K=1")}


@dataclasses.dataclass(frozen=True)
class Plan:
  """Sizes, step counts and the time budget of one configuration.

  The ``est_*`` fields are the budget's starting estimates (seconds); a worker
  replaces them with what it measures as it goes (its first compile, its step
  time), and hands its estimates to the next worker.
  """

  name: str
  depth: int
  num_filters: int
  image_size: int
  batch: int
  num_classes: int
  ks: tuple[int, ...]           # loopkit's iterations_per_loop values
  limit_k: int                  # K of the limit (the device-resident program)
  warm_steps: int               # steps of each variant's warm-up run (includes its compile)
  timed_steps: int              # steps timed per variant, rounded up to whole calls
  min_calls: int                # ... and at least this many calls for K > 1
  pool: int                     # distinct host batches cycled by the source
  mlp_steps: int                # S of the MLP (steps per timed run)
  mlp_repeats: int
  mlp_min_round_secs: float
  mlp_mechanism_calls: int
  budget_s: float               # the whole run, all workers
  est_setup_s: float            # worker start: import, backend, model init, host pool
  est_compile_s: float          # one ResNet program
  est_step_s: float             # one ResNet step
  est_mlp_s: float              # the whole MLP block
  host_bytes_per_s: float       # host stacking + transfer of a chunk (pipeline fill)
  est_limit_extra_s: float      # the limit's own set-up: its chunk made on the device, the state
  min_timeout_s: float          # a variant's timeout: max(this, 2.5 x its estimate)
  platform: str                 # "gpu" or "cpu" (the tiny plan forces JAX_PLATFORMS=cpu)

  @property
  def model_name(self) -> str:
    return f"ResNet-{self.depth} v1.5" + ("" if self.num_filters == 64
                                          else f" ({self.num_filters} base filters)")


# The H200 plan's estimates are guesses (no H200 has run this script yet): compile of a
# ResNet-50 train program with XLA's autotuning ~60 s, a step ~65 ms (about 3,900 images/s).
# The budget logic replaces them with measured values after the first variant.
H200 = Plan(name="h200", depth=50, num_filters=64, image_size=224, batch=256, num_classes=1000,
            ks=(1, 26, 100), limit_k=100, warm_steps=5, timed_steps=100, min_calls=2, pool=4,
            mlp_steps=5000, mlp_repeats=3, mlp_min_round_secs=0.3, mlp_mechanism_calls=50,
            budget_s=450.0, est_setup_s=25.0, est_compile_s=60.0, est_step_s=0.065,
            est_mlp_s=40.0, host_bytes_per_s=2e9, est_limit_extra_s=5.0, min_timeout_s=90.0,
            platform="gpu")
# Same code paths on this CPU: a ResNet-18 with 8 base filters at 32x32, batch 8.
CPU_SMOKE = Plan(name="cpu_smoke", depth=18, num_filters=8, image_size=32, batch=8,
                 num_classes=10, ks=(1, 26, 100), limit_k=100, warm_steps=2, timed_steps=26,
                 min_calls=2, pool=4, mlp_steps=400, mlp_repeats=1, mlp_min_round_secs=0.0,
                 mlp_mechanism_calls=5, budget_s=600.0, est_setup_s=30.0, est_compile_s=20.0,
                 est_step_s=0.02, est_mlp_s=40.0, host_bytes_per_s=1e9, est_limit_extra_s=10.0,
                 min_timeout_s=150.0, platform="cpu")
PLANS = {"h200": H200, "cpu_smoke": CPU_SMOKE}


def variant_k(plan: Plan, variant: str) -> int | None:
  """iterations_per_loop of a ResNet variant (None for the per-step loop and the MLP)."""
  if variant == "limit":
    return plan.limit_k
  if variant.startswith("K="):
    return int(variant[2:])
  return None


def timed_steps(plan: Plan, variant: str) -> int:
  """Steps a ResNet variant times: ``plan.timed_steps`` rounded up to whole calls of K,
  at least ``plan.min_calls`` calls for K > 1."""
  k = variant_k(plan, variant)
  if not k or k == 1:
    return plan.timed_steps
  return k * max(plan.min_calls, -(-plan.timed_steps // k))


def chunk_bytes(plan: Plan, k: int) -> int:
  """Bytes of one ``[K, B, S, S, 3]`` uint8 chunk plus its int32 labels."""
  return k * plan.batch * (plan.image_size ** 2 * 3 + 4)


@dataclasses.dataclass
class Estimates:
  """The budget's running cost model (seconds), refined by measurements."""

  setup_s: float
  compile_s: float
  step_s: float
  mlp_s: float

  @classmethod
  def of(cls, plan: Plan) -> Estimates:
    return cls(plan.est_setup_s, plan.est_compile_s, plan.est_step_s, plan.est_mlp_s)

  def expected_s(self, plan: Plan, variant: str, compiled_ks: frozenset = frozenset()) -> float:
    """Expected wall seconds of ``variant``: compile + warm-up + timed steps (+ one chunk's
    pipeline fill for loopkit; no compile for the limit if its program is already built)."""
    if variant == "mlp":
      return self.mlp_s
    k = variant_k(plan, variant)
    steps = plan.warm_steps + timed_steps(plan, variant)
    compile_s = 0.0 if (variant == "limit" and k in compiled_ks) else self.compile_s
    fill = 2 * chunk_bytes(plan, k) / plan.host_bytes_per_s if variant.startswith("K=") else 0.0
    extra = plan.est_limit_extra_s if variant == "limit" else 0.0
    return compile_s + 1.1 * steps * self.step_s + fill + extra

  def timeout_s(self, plan: Plan, variant: str, compiled_ks: frozenset = frozenset()) -> float:
    return max(plan.min_timeout_s, 2.5 * self.expected_s(plan, variant, compiled_ks))


# == worker ======================================================================================

def _emit(kind: str, payload: Any) -> None:
  print(TAG + kind + " " + json.dumps(payload), flush=True)


def _log(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def _flops_of(cost: Any) -> float | None:
  """``flops`` of a ``cost_analysis()`` result (a dict; a list of one dict in older JAX)."""
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  if not cost or "flops" not in cost:
    return None
  return float(cost["flops"])


class ResNetBench:
  """The ResNet variants of one worker: one model, one host pool, one mesh.

  Every variant starts from the same initial state (a host copy, placed anew) and
  reads the same cycled pool of host batches ``{"image": uint8 [B, S, S, 3],
  "label": int32 [B]}``.
  """

  def __init__(self, plan: Plan):
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: PLC0415

    from benchmarks import systems  # noqa: PLC0415
    from examples.resnet50 import gpu_bench  # noqa: PLC0415

    self.jax, self.np, self.systems, self.plan = jax, np, systems, plan
    self.step, state = gpu_bench.build_step(depth=plan.depth, batch=plan.batch,
                                            num_filters=plan.num_filters,
                                            num_classes=plan.num_classes)
    self.host_state = jax.device_get(state)
    self.mesh = systems.data_mesh()
    self.replicated = NamedSharding(self.mesh, P())
    self.batch_sharding = NamedSharding(self.mesh, P("data"))
    rng = np.random.default_rng(0)
    s = plan.image_size
    self.pool = [{"image": rng.integers(0, 256, (plan.batch, s, s, 3), dtype=np.uint8),
                  "label": rng.integers(0, plan.num_classes, (plan.batch,), dtype=np.int32)}
                 for _ in range(plan.pool)]
    self.programs: dict[int, Any] = {}  # K -> loopkit.core.MultiStepProgram compiled here
    spec = lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype)
    from loopkit.core import flops as flops_lib  # noqa: PLC0415

    traced = jax.jit(self.step).trace(jax.tree.map(spec, self.host_state),
                                      jax.tree.map(spec, self.pool[0]))  # traced once for both
    self.lowered_flops = _flops_of(traced.lower().cost_analysis())
    self.jaxpr_flops = flops_lib.jaxpr_flops(traced.jaxpr)

  def source(self, n: int):
    return itertools.islice(itertools.cycle(self.pool), n)

  def per_step(self, variant: str) -> dict:
    jax, sy, plan = self.jax, self.systems, self.plan
    jitted = jax.jit(self.step, donate_argnums=(0,),
                     in_shardings=(self.replicated, self.batch_sharding),
                     out_shardings=(self.replicated, self.replicated))
    every = sy.wait_every()
    state = jax.device_put(self.host_state, self.replicated)
    t0 = time.perf_counter()
    # Compiled ahead (one executable for certain, and the FLOPs from its own cost analysis);
    # called like the jitted function, state donated.
    step = jitted.lower(state, jax.device_put(self.pool[0], self.batch_sharding)).compile()
    flops = _flops_of(step.cost_analysis())

    def train(state, n):
      return sy.per_step_loop(step, state, sy.device_prefetch(self.source(n),
                                                              self.batch_sharding), every)

    state = train(state, plan.warm_steps)
    warm_s = time.perf_counter() - t0
    n = timed_steps(plan, variant)
    p0, t0 = time.process_time(), time.perf_counter()
    state = train(state, n)
    secs, cpu = time.perf_counter() - t0, time.process_time() - p0
    assert int(jax.device_get(state.step)) == plan.warm_steps + n
    return {"system": "per-step jit + prefetch 2", "k": None, "steps": n, "calls": n,
            "secs": secs, "cpu_s": cpu, "warm_s": warm_s, "executables": 1,
            "compiled_flops": flops}

  def loopkit(self, variant: str) -> dict:
    import loopkit  # noqa: PLC0415

    jax, plan = self.jax, self.plan
    k = variant_k(plan, variant)
    clock = BoundaryClock()
    loop = loopkit.TrainLoop(self.step, iterations_per_loop=k, mesh=self.mesh, hooks=[clock])
    t0 = time.perf_counter()
    state = jax.block_until_ready(loop.run(self.host_state, self.source(plan.warm_steps),
                                           num_steps=plan.warm_steps))
    warm_s = time.perf_counter() - t0
    n = timed_steps(plan, variant)
    clock.marks.clear()
    before = dict(loop.ledger.seconds)
    p0, t0 = time.process_time(), time.perf_counter()
    state = loop.run(state, self.source(n), num_steps=plan.warm_steps + n)
    jax.block_until_ready(state)
    secs, cpu = time.perf_counter() - t0, time.process_time() - p0
    if loop.status != "completed" or loop.ledger.step != plan.warm_steps + n:
      raise RuntimeError(f"TrainLoop ended {loop.status!r} at step {loop.ledger.step}")
    spent = {b: loop.ledger.seconds.get(b, 0.0) - before.get(b, 0.0)
             for b in ("dispatch", "device_wait", "data_wait")}
    self.programs[k] = loop.program
    return {"system": f"loopkit TrainLoop K={k}", "k": k, "steps": n, "calls": -(-n // k),
            "secs": secs, "cpu_s": cpu, "warm_s": warm_s,
            "executables": loop.program.compile_count(),
            "steady_steps_per_s": clock.steps_per_s(), "loss": clock.last_loss,
            "dispatch_s": spent["dispatch"], "device_wait_s": spent["device_wait"],
            "data_wait_s": spent["data_wait"]}

  def limit(self, variant: str) -> dict:
    import jax.numpy as jnp  # noqa: PLC0415

    import loopkit  # noqa: PLC0415

    jax, np, plan = self.jax, self.np, self.plan
    k = variant_k(plan, variant)
    program = self.programs.get(k)
    reused = program is not None
    if program is None:
      program = loopkit.core.MultiStepProgram(self.step, iterations_per_loop=k, mesh=self.mesh)
    shape = (k, plan.batch, plan.image_size, plan.image_size, 3)

    @jax.jit(out_shardings=program.batch_sharding)
    def synthetic(key):  # made on the device: no multi-GB host array for the limit
      k1, k2 = jax.random.split(key)
      return {"image": jax.random.bits(k1, shape, jnp.uint8),
              "label": jax.random.randint(k2, (k, plan.batch), 0, plan.num_classes, jnp.int32)}

    chunk = jax.block_until_ready(synthetic(jax.random.key(0)))
    state = program.place_state(self.host_state)
    compiles_before = program.compile_count()
    n_warm = jax.device_put(np.int32(min(k, plan.warm_steps)), program.replicated)
    n_full = jax.device_put(np.int32(k), program.replicated)
    t0 = time.perf_counter()
    state, out = program(state, chunk, n_warm)
    jax.block_until_ready(out.step)
    warm_s = time.perf_counter() - t0
    n = timed_steps(plan, variant)
    calls = n // k
    pending = None
    p0, t0 = time.process_time(), time.perf_counter()
    for _ in range(calls):
      state, out = program(state, chunk, n_full)
      if pending is not None:
        jax.device_get(pending.step)  # fetched one call late, as TrainLoop does
      pending = out
    last = jax.device_get(pending)
    secs, cpu = time.perf_counter() - t0, time.process_time() - p0
    assert int(last.step) == min(k, plan.warm_steps) + n, int(last.step)
    loss = loopkit.metrics.fold_steps(last.traces["loss"])
    return {"system": f"limit: K={k} program, chunk on device", "k": k, "steps": n,
            "calls": calls, "secs": secs, "cpu_s": cpu, "warm_s": warm_s,
            "executables": program.compile_count(),
            "program_reused": reused, "compiled_here": program.compile_count() - compiles_before,
            "loss": float(loss.total / loss.count)}


class BoundaryClock:
  """A loopkit hook that records ``(perf_counter, end_step)`` at every boundary.

  Boundaries are processed one call late, so the interval between two marks is
  one device call in steady state; :meth:`steps_per_s` runs from the first mark (after
  the pipeline fill: the first chunk's stacking and transfer) to the last but one.
  """

  needs_state = False

  def __init__(self):
    import loopkit  # noqa: PLC0415

    self.trigger = loopkit.Trigger()  # every call; on_trigger does nothing, after_each_call() times
    self.marks: list[tuple[float, int]] = []
    self.last_loss: float | None = None

  def on_run_start(self, loop, state):
    return None

  def after_each_call(self, info) -> None:
    self.marks.append((time.perf_counter(), info.end_step))
    if "loss" in info.metrics:
      self.last_loss = float(info.metrics["loss"])

  def on_trigger(self, info, state):
    return None

  def on_run_end(self, loop, state):
    return None

  def steps_per_s(self) -> float | None:
    """Steps/s from the first mark to the one before the last (None under 3 marks).

    A call's mark comes when the host reads its results, one call late: after the next call
    finished where a call blocks the host (the traced-trip-count loop on a GPU,
    ``benchmarks/gpu_dispatch.py``), after the call itself where dispatch is asynchronous; the
    last mark follows the one before it at once. From the first mark to the last but one the
    time and the steps cover the same calls either way (the H200 run of 2026-12-04 took the last
    mark, which counted one call more than the time held: 10,127 images/s at K = 26 above a
    limit of 6,959).
    """
    if len(self.marks) < 3:
      return None
    (t0, s0), (t1, s1) = self.marks[0], self.marks[-2]
    return (s1 - s0) / (t1 - t0) if t1 > t0 else None


def run_mlp(plan: Plan) -> dict:
  """The CPU benchmark's MLP worker (``benchmarks/run.py``) on this process's devices."""
  args = argparse.Namespace(
      workloads=["mlp"], steps={("mlp", 1): plan.mlp_steps, ("mlp", 8): plan.mlp_steps},
      repeats=plan.mlp_repeats, rss_calls=0, rss_secs=0.0,
      mechanism_calls=plan.mlp_mechanism_calls, min_round_secs=plan.mlp_min_round_secs,
      no_keras=True, verbose=False, profile_repeats=0)  # run.py's host profile: CPU runs only
  return cpu_run.worker(args)


def worker(args: argparse.Namespace) -> int:
  """Runs ``args.variants`` in order under one flag setting; one protocol line per event."""
  plan = PLANS[args.config]
  est = Estimates(**json.loads(args.estimates)) if args.estimates else Estimates.of(plan)
  t_start = time.perf_counter()
  import jax  # noqa: PLC0415  (XLA_FLAGS was set by the parent)

  # The backend starts here, before anything imports loopkit: the flag setting is the parent's,
  # whatever loopkit might do to XLA_FLAGS at import.
  dev = jax.devices()[0]
  startup_s = time.perf_counter() - t_start
  _emit("META", {"flag": args.flag, "device_kind": dev.device_kind, "platform": dev.platform,
                 "device_count": jax.device_count(), "jax": jax.__version__,
                 "xla_flags": os.environ.get("XLA_FLAGS", "")})
  if plan.platform != "cpu" and dev.platform == "cpu":  # no accelerator: ResNet-50 here would
    for variant in args.variants.split(","):           # only spend the budget
      _emit("ROW", {"variant": variant, "flag": args.flag, "status": "failed: no accelerator: "
                    f"JAX sees only cpu devices (plan {plan.name})"})
    _emit("DONE", {})
    return 0
  bench = None
  for variant in args.variants.split(","):
    compiled = frozenset(bench.programs) if bench is not None else frozenset()
    need = est.expected_s(plan, variant, compiled)
    if variant in RESNET_VARIANTS and bench is None:
      need += est.setup_s
    left = args.deadline - time.time()
    row = {"variant": variant, "flag": args.flag, "expected_s": round(need, 1)}
    if need > left:
      _emit("ROW", {**row, "status": f"skipped: {left:.0f} s left of this flag's share, "
                    f"expected {need:.0f} s"})
      continue
    _emit("START", {"variant": variant, "timeout_s": est.timeout_s(plan, variant, compiled)
                    + (est.setup_s if variant in RESNET_VARIANTS and bench is None else 0.0)})
    t0 = time.perf_counter()
    try:
      if variant == "mlp":
        result = {"mlp": run_mlp(plan)}
        est.mlp_s = time.perf_counter() - t0
      else:
        if bench is None:
          s0 = time.perf_counter()
          bench = ResNetBench(plan)
          est.setup_s = startup_s + time.perf_counter() - s0
          row["lowered_flops"] = bench.lowered_flops
          row["jaxpr_flops"] = bench.jaxpr_flops
        fn = (bench.per_step if variant == "per-step" else
              bench.limit if variant == "limit" else bench.loopkit)
        result = fn(variant)
        # Refine the cost model: this variant's step time; its compile = warm-up run minus
        # its warm steps (the limit's reused program has none to measure).
        est.step_s = result["secs"] / result["steps"]
        if not (variant == "limit" and result.get("program_reused")):
          est.compile_s = max(1.0, result["warm_s"] - plan.warm_steps * est.step_s)
      row.update(result, status="ok")
    except Exception as e:  # noqa: BLE001  (a variant's failure is a row, not the end)
      _log(traceback.format_exc())
      first = str(e).splitlines()[0][:300] if str(e) else ""
      row["status"] = f"failed: {type(e).__name__}: {first}".replace("|", "/")
    row["took_s"] = round(time.perf_counter() - t0, 1)
    _emit("ROW", row)
    _emit("EST", dataclasses.asdict(est))
    import gc  # noqa: PLC0415

    gc.collect()  # the variant's chunks and states go before the next one's
  _emit("DONE", {})
  return 0


# == parent ======================================================================================

@dataclasses.dataclass
class WorkerRun:
  """What the parent saw of one worker process."""

  rows: list[dict]
  meta: dict | None
  estimates: dict | None
  done: bool
  in_flight: str | None
  returncode: int | None
  stderr_tail: list[str]
  killed: str | None = None  # why the parent killed it, if it did


def _worker_env(plan: Plan, flag: str, autotune_dir: str | None) -> dict[str, str]:
  env = dict(os.environ)
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_gpu_enable_command_buffer")
           and not f.startswith("--xla_gpu_deterministic_ops")
           and not f.startswith("--xla_force_host_platform_device_count")]
  if flag == "on":
    flags.append(on_flag())
  if autotune_dir:
    flags.append(f"{AUTOTUNE_CACHE_FLAG}={autotune_dir}")
  env["XLA_FLAGS"] = " ".join(flags)
  if plan.platform == "cpu":
    env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  env.setdefault("PYTHONUNBUFFERED", "1")
  return env


def launch_worker(plan: Plan, flag: str, variants: list[str], deadline: float,
                  hard_deadline: float, estimates: dict | None,
                  autotune_dir: str | None = None) -> WorkerRun:
  """Runs one worker; kills it when its variant in flight passes its timeout or the run
  passes ``hard_deadline`` (``time.time()`` values)."""
  argv = [sys.executable, os.path.abspath(__file__), "--worker", "--config", plan.name,
          "--flag", flag, "--variants", ",".join(variants), "--deadline", repr(deadline)]
  if estimates:
    argv += ["--estimates", json.dumps(estimates)]
  proc = subprocess.Popen(argv, env=_worker_env(plan, flag, autotune_dir), cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True)
  lines: queue.Queue = queue.Queue()
  tail: list[str] = []

  def read_stdout():
    for line in proc.stdout:
      lines.put(line)
    lines.put(None)

  def read_stderr():  # forwarded live, the last lines kept for the report
    for line in proc.stderr:
      sys.stderr.write(f"[{flag}] {line}")
      sys.stderr.flush()
      tail.append(line.rstrip())
      del tail[:-30]

  threads = [threading.Thread(target=read_stdout, daemon=True),
             threading.Thread(target=read_stderr, daemon=True)]
  for t in threads:
    t.start()
  out = WorkerRun([], None, None, False, None, None, tail)
  # Until the first START: the worker's own start-up (imports, backend).
  kill_at = min(hard_deadline, time.time() + max(plan.min_timeout_s, 4 * plan.est_setup_s))
  killed = None
  while True:
    try:
      line = lines.get(timeout=max(0.05, min(1.0, kill_at - time.time())))
    except queue.Empty:
      line = ""
    if line is None:
      break
    if line.startswith(TAG):
      kind, _, payload = line[len(TAG):].partition(" ")
      data = json.loads(payload)
      if kind == "META":
        out.meta = data
      elif kind == "START":
        out.in_flight = data["variant"]
        kill_at = min(hard_deadline, time.time() + data["timeout_s"])
        _log(f"[{flag}] {data['variant']}: started, timeout {data['timeout_s']:.0f} s")
      elif kind == "ROW":
        out.rows.append(data)
        out.in_flight = None
        kill_at = min(hard_deadline, time.time() + 60.0)  # the worker's next step or exit
        _log(f"[{flag}] {data['variant']}: {data['status']} ({data.get('took_s', 0)} s)")
      elif kind == "EST":
        out.estimates = data
      elif kind == "DONE":
        out.done = True
    elif line:
      sys.stdout.write(line)  # whatever else the worker printed
    if killed is None and time.time() >= kill_at and proc.poll() is None:
      killed = ("the total budget" if kill_at >= hard_deadline else "its timeout")
      _log(f"[{flag}] killing the worker: {out.in_flight or 'start-up'} ran past {killed}")
      os.killpg(proc.pid, signal.SIGKILL)
  out.returncode = proc.wait()
  out.killed = killed
  for t in threads:
    t.join(timeout=5)
  if out.in_flight is not None:
    reason = (f"timed out: killed after passing {killed}" if killed else
              f"failed: the worker exited with code {out.returncode} during this variant")
    last = _last_line(tail)
    out.rows.append({"variant": out.in_flight, "flag": flag, "status": reason
                     + (f" (last stderr line: {last})" if last and not killed else "")})
  return out


def _last_line(lines: list[str]) -> str:
  return next((ln.strip()[:200] for ln in reversed(lines) if ln.strip()), "").replace("|", "/")


def run_all(plan: Plan, flags: list[str], variants: list[str] | None,
            autotune_cache: bool = True) -> dict:
  """Runs every flag setting's workers within ``plan.budget_s``; returns rows and metadata."""
  t0 = time.time()
  hard_deadline = t0 + plan.budget_s
  rows: list[dict] = []
  metas: dict[str, dict] = {}
  notes: list[str] = []
  estimates = None
  made = (tempfile.mkdtemp(prefix="loopkit-gpu-autotune-")
          if autotune_cache and plan.platform == "gpu" else None)
  autotune_dir = made
  for i, flag in enumerate(flags):
    todo = [v for v in (variants or ORDER[flag])]
    share_deadline = time.time() + (hard_deadline - time.time()) / (len(flags) - i)
    for _attempt in range(3):  # a worker that dies is restarted for the variants left
      if not todo:
        break
      if share_deadline - time.time() < plan.est_setup_s:
        break
      _log(f"== worker, {_flag_name()} {flag}: {', '.join(todo)} "
           f"({share_deadline - time.time():.0f} s of {hard_deadline - time.time():.0f} s left)")
      got = launch_worker(plan, flag, todo, share_deadline, hard_deadline, estimates,
                          autotune_dir)
      if (got.meta is None and autotune_dir
          and any("Unknown flag" in ln and AUTOTUNE_CACHE_FLAG in ln for ln in got.stderr_tail)):
        notes.append(f"XLA does not know {AUTOTUNE_CACHE_FLAG}: ran without a shared "
                     "autotuning cache")
        autotune_dir = None
        continue  # the same variants again, without the flag
      rows += got.rows
      if got.meta is None:  # died or hung before JAX came up: a restart would do the same
        why = (f"timed out: the worker's start-up ran past {got.killed}" if got.killed else
               f"failed: the worker exited with code {got.returncode} before JAX started "
               f"(last stderr line: {_last_line(got.stderr_tail)})")
        rows += [{"variant": v, "flag": flag, "status": why} for v in todo]
        todo = []
        break
      metas.setdefault(flag, got.meta or {})
      estimates = got.estimates or estimates
      seen = {r["variant"] for r in got.rows}
      todo = [v for v in todo if v not in seen]
      if got.done:
        break
    for v in todo:
      rows.append({"variant": v, "flag": flag, "status": "skipped: no time left for another "
                   "worker in this flag's share"})
  if autotune_dir:
    notes.append(f"workers shared XLA's autotuning results ({AUTOTUNE_CACHE_FLAG})")
  if made:
    shutil.rmtree(made, ignore_errors=True)
  return {"rows": rows, "metas": metas, "wall_s": time.time() - t0, "estimates": estimates,
          "notes": notes}


# == report ======================================================================================

def _find(rows: list[dict], variant: str, flag: str) -> dict | None:
  for r in rows:
    if r["variant"] == variant and r["flag"] == flag and r["status"] == "ok":
      return r
  return None


def images_per_s(row: dict, batch: int) -> float:
  return row["steps"] * batch / row["secs"]


def flops_per_step(rows: list[dict]) -> tuple[float | None, str]:
  """FLOPs of one train step: the step's jaxpr count (:func:`loopkit.core.flops.jaxpr_flops`,
  matrix products and convolutions) if a row has it, else the compiled per-step executable's
  cost analysis, else the lowered (unoptimised) HLO's.

  The jaxpr count comes first because XLA:GPU's cost analysis leaves out the convolutions it
  hands to cuDNN (custom calls): on the H200 it gave 105.8 GFLOP for a ResNet-50 step of batch
  256, against 7.23 TFLOP counted from its jaxpr (28.2 GFLOP per image, forward and backward).
  """
  for r in rows:
    if r.get("jaxpr_flops"):
      return r["jaxpr_flops"], "step's jaxpr (`loopkit.core.flops.jaxpr_flops`: matrix " \
          "products and convolutions; XLA:GPU's `cost_analysis()` leaves out cuDNN's convolutions)"
  for r in rows:
    if r["status"] == "ok" and r.get("compiled_flops"):
      return r["compiled_flops"], "compiled per-step executable's `cost_analysis()`"
  for r in rows:
    if r.get("lowered_flops"):
      return r["lowered_flops"], "lowered HLO (`jit(step).lower(...).cost_analysis()`; no " \
          "per-step row had the compiled count)"
  return None, "not measured"


def peak_flops(device_kind: str, override: float | None) -> float | None:
  if override:
    return override
  for name, peak in PEAK_FLOPS.items():
    if name in device_kind:
      return peak
  return None


def summarize_resnet(rows: list[dict], plan: Plan, peak: float | None) -> list[dict]:
  """One entry per (ResNet variant, flag) in table order, ratios from the measured rows.

  Ratios are to the per-step loop and to the limit of the *same* flag setting;
  MFU = FLOPs per step x steps/s / peak.
  """
  flops, _ = flops_per_step(rows)
  out = []
  for variant in RESNET_VARIANTS:
    for flag in FLAG_SETTINGS:
      r = next((x for x in rows if x["variant"] == variant and x["flag"] == flag), None)
      if r is None:
        continue
      e = {"variant": variant, "flag": flag, "status": r["status"], "row": r}
      if r["status"] == "ok":
        ips = images_per_s(r, plan.batch)
        e["images_per_s"] = ips
        if r.get("steady_steps_per_s"):
          e["steady_images_per_s"] = r["steady_steps_per_s"] * plan.batch
        base = _find(rows, "per-step", flag)
        lim = _find(rows, "limit", flag)
        e["vs_per_step"] = ips / images_per_s(base, plan.batch) if base else None
        e["vs_limit"] = ips / images_per_s(lim, plan.batch) if lim else None
        e["mfu"] = flops * ips / plan.batch / peak if (flops and peak) else None
        e["cpu_s_per_call"] = r["cpu_s"] / r["calls"]
      out.append(e)
  return out


def _f(x: float | None, fmt: str) -> str:
  return "—" if x is None else format(x, fmt)


def render_resnet(rows: list[dict], plan: Plan, peak: float | None) -> str:
  lines = [f"| system | {_flag_name()} | steps (calls) | images/s | steady images/s | / per-step "
           "| / limit | MFU | host CPU s/call | dispatch s | device wait s | compile + warm-up s "
           "| executables | status |", "|" + "---|" * 14]
  for e in summarize_resnet(rows, plan, peak):
    r = e["row"]
    if e["status"] != "ok":
      lines.append(f"| {e['variant']} | {e['flag']} | | | | | | | | | | | | {e['status']} |")
      continue
    lines.append(
        f"| {r['system']} | {e['flag']} | {r['steps']} ({r['calls']}) | "
        f"{e['images_per_s']:,.1f} | {_f(e.get('steady_images_per_s'), ',.1f')} | "
        f"{_f(e['vs_per_step'], '.3f')} | {_f(e['vs_limit'], '.3f')} | "
        + ("—" if e["mfu"] is None else f"{100 * e['mfu']:.1f}%") + " | "
        f"{e['cpu_s_per_call']:.4f} | {_f(r.get('dispatch_s'), '.2f')} | "
        f"{_f(r.get('device_wait_s'), '.2f')} | {r['warm_s']:.1f} | {r['executables']} | ok |")
  return "\n".join(lines)


def resnet_headlines(rows: list[dict], plan: Plan, peak: float | None) -> list[str]:
  """One line per flag setting with the figures the issue's closing note asks for."""
  by = {(e["variant"], e["flag"]): e for e in summarize_resnet(rows, plan, peak)
        if e["status"] == "ok"}
  out = []
  for flag in FLAG_SETTINGS:
    parts = []
    for v in ("K=26", "K=100"):
      e = by.get((v, flag))
      if e:
        parts.append(f"{v} {e['images_per_s']:,.0f} images/s = {_f(e['vs_per_step'], '.2f')}x "
                     f"per-step, {_f(e['vs_limit'], '.2f')}x the limit, MFU "
                     + ("—" if e["mfu"] is None else f"{100 * e['mfu']:.1f}%"))
    for v in ("per-step", "limit"):
      e = by.get((v, flag))
      if e:
        parts.append(f"{v} {e['images_per_s']:,.0f} images/s")
    if parts:
      out.append(f"- {_flag_name()} {flag}: " + "; ".join(parts))
  return out


def mlp_rows(rows: list[dict], flag: str) -> tuple[list[dict], list[dict]]:
  r = _find(rows, "mlp", flag)
  if r is None:
    return [], []
  return r["mlp"]["rows"], r["mlp"]["mechanism"]


def render_mlp_summary(rows: list[dict]) -> str:
  """MLP steps/s and ratios, both flag settings side by side."""
  lines = ["| system | " + " | ".join(
      f"steps/s ({f}) | / limit ({f}) | / per-step jit + prefetch ({f}) | / fastest per-step "
      f"({f}) | host CPU µs/step ({f})" for f in FLAG_SETTINGS) + " |",
      "|---|" + "---|" * (5 * len(FLAG_SETTINGS))]
  names = []
  for flag in FLAG_SETTINGS:
    for r in mlp_rows(rows, flag)[0]:
      if r["system"] not in names:
        names.append(r["system"])
  for name in names:
    cols = [name]
    for flag in FLAG_SETTINGS:
      mrows = mlp_rows(rows, flag)[0]
      r = next((x for x in mrows if x["system"] == name), None)
      if r is None:
        cols += [""] * 5
        continue
      rate = cpu_run._best_rate(r)
      lim = cpu_run._find(mrows, "mlp", r["devices"], "limit (one scan)")
      flax = cpu_run._find(mrows, "mlp", r["devices"], "per-step jit + prefetch")
      fastest = cpu_run._fastest_per_step(mrows, "mlp", r["devices"])
      cols += [f"{rate:,.0f}", _f(rate / cpu_run._best_rate(lim) if lim else None, ".3f"),
               _f(rate / cpu_run._best_rate(flax) if flax else None, ".2f"),
               _f(rate / cpu_run._best_rate(fastest) if fastest else None, ".2f"),
               f"{min(r['cpu']) / r['steps'] * 1e6:.1f}"]
    lines.append("| " + " | ".join(cols) + " |")
  return "\n".join(lines)


def render_budget(rows: list[dict]) -> str:
  lines = [f"| {_flag_name()} | variant | expected s | took s | status |", "|---|---|---|---|---|"]
  for r in rows:
    status = r["status"] if r["status"] == "ok" else r["status"].replace("|", "/")
    lines.append(f"| {r['flag']} | {r['variant']} | {r.get('expected_s', '—')} | "
                 f"{r.get('took_s', '—')} | {status} |")
  return "\n".join(lines)


def versions() -> dict[str, str]:
  out = {}
  for p in PACKAGES:
    try:
      out[p] = importlib.metadata.version(p)
    except importlib.metadata.PackageNotFoundError:
      pass
  return out


def git_commit() -> str:
  """The checkout's commit (+ "dirty" with uncommitted changes), or "" without git."""
  try:
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT,
                          capture_output=True, text=True, timeout=20)
    if head.returncode != 0:
      return ""
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True, timeout=20).stdout.strip()
    return head.stdout.strip() + (" (with uncommitted changes)" if dirty else "")
  except (OSError, subprocess.SubprocessError):
    return ""


def nvidia_smi() -> str:
  try:
    out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                          "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
    return out.stdout.strip().replace("\n", "; ") if out.returncode == 0 else ""
  except (OSError, subprocess.SubprocessError):
    return ""


def render_report(res: dict, plan: Plan, meta: dict) -> str:
  rows = res["rows"]
  m = next((x for x in res["metas"].values() if x), {})
  kind = m.get("device_kind", "unknown")
  peak = peak_flops(kind, meta.get("peak_flops"))
  flops, flops_src = flops_per_step(rows)
  ok = sum(r["status"] == "ok" for r in rows)
  parts = [
      "# loopkit on an accelerator: ResNet-50 and the dispatch-bound MLP, side by side",
      "",
      "Generated by `benchmarks/gpu.py` in one run; `benchmarks/README.md` says what each "
      "system is. Every variant ran with and without "
      f"`XLA_FLAGS={on_flag()}` (*on* / *off*), each flag setting in its "
      "own worker process.",
      "",
      f"- date: {meta['date']}",
      f"- command: `{meta['command']}`",
      f"- device: {m.get('device_count', '?')} x {kind} (platform {m.get('platform', '?')})"
      + (f"; nvidia-smi: {meta['nvidia_smi']}" if meta.get("nvidia_smi") else ""),
      f"- host: {meta['machine']['nproc']} CPUs ({meta['machine']['cpu']}), "
      f"{meta['machine']['ram']} RAM, Python {meta['machine']['python']}",
      "- packages: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
      f"- XLA_FLAGS seen by the workers: on: `{res['metas'].get('on', {}).get('xla_flags', '—')}`"
      f"; off: `{res['metas'].get('off', {}).get('xla_flags', '—')}`",
      f"- plan `{plan.name}`: {plan.model_name}, {plan.image_size}x{plan.image_size}, bfloat16, "
      f"global batch {plan.batch}, {plan.num_classes} classes; each variant: a warm-up run of "
      f"{plan.warm_steps} steps (its compile), then {plan.timed_steps} timed steps rounded up to "
      f"whole calls (at least {plan.min_calls} calls for K > 1); host pool of {plan.pool} "
      f"distinct uint8 batches; MLP S = {plan.mlp_steps}, best of {plan.mlp_repeats} rounds",
      f"- budget {plan.budget_s:.0f} s; wall time {res['wall_s']:.0f} s; {ok} of {len(rows)} "
      "variants measured" + ("" if ok == len(rows) else
                             " (the rest were skipped or failed: see *Budget*)"),
  ]
  if meta.get("commit"):
    parts.insert(parts.index(f"- command: `{meta['command']}`") + 1,
                 f"- loopkit commit: {meta['commit']}")
  parts += [f"- note: {n}" for n in res.get("notes", [])]
  if m.get("platform") not in (None, "gpu", "cuda", "rocm", "tpu"):
    parts += ["", f"**Not an accelerator run**: the workers ran on `{m.get('platform')}` "
              "devices; the figures check the code paths, not speed."]
  parts += [
      "",
      f"## {plan.model_name}, {plan.image_size}x{plan.image_size}, bf16, batch {plan.batch}",
      "",
      f"FLOPs per train step: {_f(None if flops is None else flops / 1e9, ',.4g')} GFLOP, "
      f"from the {flops_src}; MFU against "
      + (f"{peak / 1e12:.0f} TFLOP/s peak dense bf16 (NVIDIA's datasheet: 1,979 TFLOPS "
         "with sparsity)" if peak else "no peak (unknown device kind; pass --peak-tflops)")
      + ". *images/s* is end to end over the timed run (loopkit: `TrainLoop.run` from the host "
      "source, its first chunk's stacking and transfer included); *steady* runs from the run's "
      "first boundary to its last but one (at least 3 calls). Ratios are to the same flag "
      "setting's per-step loop and limit. *host CPU s/call*: `time.process_time` (all "
      "threads) over the timed run / calls. *dispatch* and *device wait*: the loop's ledger "
      "buckets over the timed run.",
      "",
      render_resnet(rows, plan, peak),
      "",
  ]
  parts += resnet_headlines(rows, plan, peak) + [""]
  parts += ["## Dispatch-bound MLP (`benchmarks/run.py`'s workload, 1 device)", "",
            render_mlp_summary(rows), ""]
  for flag in FLAG_SETTINGS:
    mrows, mech = mlp_rows(rows, flag)
    if mrows:
      parts += [f"### MLP, {_flag_name()} {flag}: every system", "",
                cpu_run.render_table(mrows), ""]
    if mech:
      parts += [f"Tail/event mechanism, {_flag_name()} {flag} (loopkit's `fori_loop` with a "
                "traced trip count against an unmasked `lax.scan` of K steps, chunk on device):",
                "", cpu_run.render_mechanism(mech), ""]
  parts += ["## Budget", "",
            "Expected seconds are the worker's estimate when it started the variant (compile + "
            "warm-up + timed steps, refined by what it had measured); a variant that would not "
            "fit its flag setting's share of the budget is skipped, one past its timeout is "
            "killed.", "", render_budget(rows), ""]
  return "\n".join(parts)


# == main ========================================================================================

def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--tiny", action="store_true", help="the cpu_smoke plan (same as "
                 "--config=cpu_smoke): a ResNet-18 with 8 filters at 32x32 on this CPU")
  p.add_argument("--config", choices=sorted(PLANS), default=None, help="plan (default h200)")
  p.add_argument("--out", help="write the markdown report here (tiny plan: never "
                 "RESULTS_gpu.md)")
  p.add_argument("--json", help="also write the raw rows to this JSON file")
  p.add_argument("--budget-s", type=float, help="override the plan's total time budget")
  p.add_argument("--flags", default=",".join(FLAG_SETTINGS),
                 help="command-buffer settings to run, in order (on,off)")
  p.add_argument("--variants", help="comma-separated subset, in this order, of "
                 + ",".join(ALL_VARIANTS) + " (default: every one, most important first)")
  p.add_argument("--peak-tflops", type=float, help="peak dense bf16 TFLOP/s for MFU (default "
                 "from the device kind: " + ", ".join(f"{k} {v / 1e12:.0f}"
                                                      for k, v in PEAK_FLOPS.items()) + ")")
  p.add_argument("--no-autotune-cache", action="store_true", help="do not share XLA's "
                 "autotuning results between the workers (" + AUTOTUNE_CACHE_FLAG + ")")
  p.add_argument("--render", metavar="JSON", help="only re-render a report from --json output")
  # worker-only
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--flag", help=argparse.SUPPRESS)
  p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
  p.add_argument("--estimates", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.tiny:
    if args.config not in (None, "cpu_smoke"):
      p.error("--tiny is --config=cpu_smoke")
    args.config = "cpu_smoke"
  args.config = args.config or "h200"
  if (args.config != "h200" and args.out
      and os.path.basename(args.out).lower() == "results_gpu.md"):
    p.error(f"the {args.config} plan does not write RESULTS_gpu.md (that file is for an "
            "accelerator run); use e.g. --out benchmarks/RESULTS_gpu_cpu_smoke.md")
  flags = args.flags.split(",")
  if any(f not in FLAG_SETTINGS for f in flags):
    p.error(f"--flags takes on and/or off, got {args.flags!r}")
  if args.variants and any(v not in ALL_VARIANTS for v in args.variants.split(",")):
    p.error(f"--variants takes {','.join(ALL_VARIANTS)}, got {args.variants!r}")
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.worker:
    return worker(args)
  plan = PLANS[args.config]
  if args.budget_s:
    plan = dataclasses.replace(plan, budget_s=args.budget_s)
  if args.render:
    with open(args.render) as f:
      saved = json.load(f)
    print(render_report(saved["results"], PLANS[saved["meta"]["plan"]], saved["meta"]))
    return 0
  meta = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
          "command": " ".join(["python", os.path.relpath(os.path.abspath(__file__), ROOT)]
                              + [shlex.quote(a) for a in sys.argv[1:]]),
          "machine": cpu_run.machine(), "versions": versions(), "nvidia_smi": nvidia_smi(),
          "commit": git_commit(),
          "plan": plan.name, "budget_s": plan.budget_s,
          "peak_flops": args.peak_tflops * 1e12 if args.peak_tflops else None}
  est = Estimates.of(plan)
  _log(f"plan {plan.name}: budget {plan.budget_s:.0f} s; first estimates: setup "
       f"{est.setup_s:.0f} s, compile {est.compile_s:.0f} s, step {est.step_s * 1e3:.0f} ms; "
       + ", ".join(f"{v} ~{est.expected_s(plan, v):.0f} s" for v in ALL_VARIANTS))
  res = run_all(plan, args.flags.split(","), args.variants.split(",") if args.variants else None,
                autotune_cache=not args.no_autotune_cache)
  report = render_report(res, plan, meta)
  print(report)
  if args.out:
    with open(args.out, "w") as f:
      f.write(report + "\n")
    _log(f"wrote {args.out}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"meta": meta, "results": res}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
