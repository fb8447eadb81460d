"""What one accelerator run (``benchmarks/gpu.py``) measures, as data: the XLA flag settings,
the variants and their order, the plans (sizes, step counts, budget) and the budget's cost model.

Stdlib only at import.
"""

from __future__ import annotations

import dataclasses
import os

COMMAND_BUFFER_FLAG = "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"
DETERMINISTIC_FLAG = "--xla_gpu_deterministic_ops=true"
# the flag the "on" setting adds, by the name LOOPKIT_GPU_ON_FLAG gives (default deterministic)
ON_FLAGS = {"deterministic": DETERMINISTIC_FLAG, "command-buffers": COMMAND_BUFFER_FLAG}


def flag_name() -> str:
  """The report's name of the ``on``/``off`` column: the flag's short name."""
  return {v: k for k, v in ON_FLAGS.items()}[on_flag()].replace("-", " ")


def on_flag() -> str:
  """The XLA flag of the ``on`` setting (``LOOPKIT_GPU_ON_FLAG``, default deterministic)."""
  name = os.environ.get("LOOPKIT_GPU_ON_FLAG", "deterministic")
  if name not in ON_FLAGS:
    raise ValueError(f"LOOPKIT_GPU_ON_FLAG={name!r}; expected one of {sorted(ON_FLAGS)}")
  return ON_FLAGS[name]


FLAG_SETTINGS = ("on", "off")  # the order the workers run in
# Peak dense bf16 tensor-core rate by device kind. NVIDIA's H200 datasheet (nvidia.com/h200,
# "H200 SXM": BF16 Tensor Core 1,979 TFLOPS *with sparsity*) halves to 989 TFLOP/s dense; the
# H200 shares the H100's compute engine (same figure on the H100 SXM datasheet). A bf16
# 8192^3 matmul reaches 769-798 TFLOP/s on the H200 machine described in gpu.py's docstring.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12}
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
