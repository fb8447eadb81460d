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

# The run's pieces (stdlib-only at import: no JAX in the parent). Their names are this module's
# too, as before the split: gpu_exactness.py, gpu_dispatch.py and the tests use them from here.
from benchmarks import run as cpu_run, runner  # noqa: E402
from benchmarks.gpu_plan import (  # noqa: E402, F401
  ALL_VARIANTS,
  COMMAND_BUFFER_FLAG,
  CPU_SMOKE,
  DETERMINISTIC_FLAG,
  FLAG_SETTINGS,
  H200,
  ON_FLAGS,
  ORDER,
  PEAK_FLOPS,
  PLANS,
  RESNET_VARIANTS,
  Estimates,
  Plan,
  chunk_bytes,
  flag_name,
  on_flag,
  timed_steps,
  variant_k,
)
from benchmarks.gpu_report import (  # noqa: E402, F401
  flops_per_step,
  images_per_s,
  peak_flops,
  render_report,
  render_resnet,
  resnet_headlines,
  summarize_resnet,
)
from benchmarks.gpu_resnet import BoundaryClock, ResNetBench  # noqa: E402, F401
from benchmarks.runner import git_commit, log as _log, nvidia_smi  # noqa: E402, F401

# XLA's per-fusion autotuning results, kept in a directory that every worker of the run shares:
# the second flag setting's compiles reuse the first's cuDNN/cuBLAS/Triton choices (shorter
# compiles, and the same kernels with and without the flag). Dropped if XLA does not know it.
AUTOTUNE_CACHE_FLAG = "--xla_gpu_per_fusion_autotune_cache_dir"
PACKAGES = ["jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin",
            "jax-cuda12-pjrt", "flax", "optax", "numpy", "ml_collections", "loopkit"]
TAG = "@@gpu.py "  # prefix of the worker's protocol lines on stdout


# == worker ======================================================================================

def _emit(kind: str, payload: Any) -> None:
  runner.emit(f"{TAG}{kind} ", payload)


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
  add = [on_flag()] if flag == "on" else []
  if autotune_dir:
    add.append(f"{AUTOTUNE_CACHE_FLAG}={autotune_dir}")
  return runner.worker_env(
      drop_xla=["--xla_gpu_enable_command_buffer", "--xla_gpu_deterministic_ops",
                "--xla_force_host_platform_device_count"], add_xla=add,
      set_env={"JAX_PLATFORMS": "cpu"} if plan.platform == "cpu" else None,
      default_env={"PYTHONUNBUFFERED": "1"})


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
      _log(f"== worker, {flag_name()} {flag}: {', '.join(todo)} "
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
          "machine": runner.machine(),
          "versions": runner.versions(PACKAGES, missing=None, loopkit_imported=False),
          "nvidia_smi": nvidia_smi(), "commit": git_commit(),
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
  runner.write_results(report, args.out, None, meta, res)
  if args.out:
    _log(f"wrote {args.out}")
  runner.write_results(None, None, args.json, meta, res)
  return 0


if __name__ == "__main__":
  sys.exit(main())
