"""K-invariance on a GPU with and without XLA's deterministic ops; is the step loop a CUDA graph?

Usage (from the repository root)::

  python benchmarks/gpu_exactness.py --out /tmp/exactness   # one H200: about 2-3 minutes
  python benchmarks/gpu_exactness.py --tiny --out /tmp/x    # CPU smoke run of every code path

loopkit's promise is that K (``iterations_per_loop``) changes speed, never the
result. On a CPU the final state is bitwise equal for every K (tests/); on a GPU
two things can break it: XLA kernels that add in a nondeterministic order
(scatter-add through atomics: an embedding's gradient; some cuDNN convolution
algorithms), which ``--xla_gpu_deterministic_ops=true`` replaces, and different
kernel choices in the programs of different K. This script trains two of the
examples' real steps for the same 30 steps, from the same initial state and
batches, at K = 10, 3, 1 and 1 again (the same executable twice) in one process:

* ``resnet``: examples/resnet50's train step (ResNet-18 v1.5, 16 base filters,
  32x32 uint8 images, batch 64, 10 classes, bfloat16 compute with float32
  parameters, BatchNorm, SGD Nesterov), :func:`examples.resnet50.gpu_bench.build_step`;
* ``lm``: examples/lm's train step at its ``tiny`` config (2 layers, 32 wide, byte
  embedding, AdamW with clipping) on a (1, 1, 1) mesh, batch 16 of 33 bytes.

Each flag setting runs in its own worker process (XLA reads ``XLA_FLAGS`` once);
the settings run side by side on the one GPU (``XLA_PYTHON_CLIENT_PREALLOCATE=false``).
``deterministic`` runs twice, in two processes, to compare the final state
across processes (what a kill and resume relies on). Per run the worker records
the SHA-256 of the final state's bytes, the leaves that differ from the
setting's first run (K = 10) and the largest absolute difference.

Whether the K-step loop runs as one CUDA graph is read from XLA's optimized HLO
of the K = 10 program (:meth:`loopkit.core.MultiStepProgram.compiled`): with
``--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL`` XLA moves the step loop's
``while`` into a command-buffer computation; without it the loop stays a host-driven
``while`` whose trip count (traced: every call length shares one executable) the
host reads back each iteration. The worker also times three calls of the ResNet
K = 10 program on a chunk already on the device: the time until the call returns
(dispatch) against the time until its result is ready. The HLO texts are written
to ``--out`` as ``hlo.tar.gz``.

Writes ``exactness.json`` and ``exactness.md`` (a section for
``benchmarks/RESULTS_gpu.md``) to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import traceback
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from benchmarks import gpu  # noqa: E402  (stdlib-only at import)
from benchmarks.gpu import COMMAND_BUFFER_FLAG, DETERMINISTIC_FLAG  # noqa: E402

# name -> XLA flags; "deterministic-2" repeats "deterministic" in a second process.
SETTINGS = {
    "default": [],
    "deterministic": [DETERMINISTIC_FLAG],
    "deterministic-2": [DETERMINISTIC_FLAG],
    "command-buffers": [COMMAND_BUFFER_FLAG],
    "deterministic+command-buffers": [DETERMINISTIC_FLAG, COMMAND_BUFFER_FLAG],
}
RUN_KS = (10, 3, 1, 1)  # the first run is each setting's reference; K = 1 twice: same executable
STEPS = 30
TAG = "@@exactness "


def _emit(kind: str, payload: Any) -> None:
  print(TAG + kind + " " + json.dumps(payload), flush=True)


# == worker ======================================================================================

def graph_summary(hlo: str) -> dict:
  """Where the while loops of an optimized HLO module are: in a command buffer or not.

  Args:
    hlo: ``Compiled.as_text()``: computations as ``[ENTRY ]%name (...) -> ... {`` ... ``}``.

  Returns:
    ``{"command_buffer_computations": int, "whiles_in_command_buffers": int,
    "whiles_elsewhere": int, "entry_whiles": int, "step_loop_in_command_buffer": bool}``: the
    last is True when the entry computation has no ``while`` of its own and a command-buffer
    computation has one (the step loop was moved into a CUDA graph).
  """
  comps: dict[str, list[str]] = {}
  entry = None
  name = None
  for line in hlo.splitlines():
    m = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
    if m and not line.startswith(" "):
      name = m.group(2)
      comps[name] = []
      if m.group(1):
        entry = name
    elif line.startswith("}"):
      name = None
    elif name is not None:
      comps[name].append(line)
  is_while = lambda ln: re.search(r"=\s*\S.*\swhile\(", ln) is not None
  cb = [n for n in comps if "command_buffer" in n]
  in_cb = sum(is_while(ln) for n in cb for ln in comps[n])
  elsewhere = sum(is_while(ln) for n in comps if n not in cb for ln in comps[n])
  entry_whiles = sum(is_while(ln) for ln in comps.get(entry or "", []))
  return {"command_buffer_computations": len(cb), "whiles_in_command_buffers": in_cb,
          "whiles_elsewhere": elsewhere, "entry_whiles": entry_whiles,
          "step_loop_in_command_buffer": bool(entry_whiles == 0 and in_cb > 0)}


def _state_digest(leaves: list) -> str:
  h = hashlib.sha256()
  for x in leaves:
    h.update(str(x.dtype).encode() + str(x.shape).encode())
    h.update(x.tobytes())
  return h.hexdigest()[:16]


def _diff(leaves: list, ref: list) -> tuple[int, float]:
  import numpy as np  # noqa: PLC0415

  differ, worst = 0, 0.0
  for x, r in zip(leaves, ref):
    if x.tobytes() != r.tobytes():
      differ += 1
      if np.issubdtype(x.dtype, np.floating):
        worst = max(worst, float(np.max(np.abs(x.astype(np.float64) - r.astype(np.float64)))))
  return differ, worst


def _resnet(tiny: bool):
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  from examples.resnet50 import gpu_bench  # noqa: PLC0415

  batch, size, filters = (8, 16, 4) if tiny else (64, 32, 16)
  step, state = gpu_bench.build_step(depth=18, batch=batch, num_filters=filters, num_classes=10)
  rng = np.random.default_rng(0)
  batches = [{"image": rng.integers(0, 256, (batch, size, size, 3), dtype=np.uint8),
              "label": rng.integers(0, 10, (batch,), dtype=np.int32)} for _ in range(STEPS)]
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  return step, state, batches, mesh, "data"


def _lm(tiny: bool):
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415

  from examples.lm import models, train  # noqa: PLC0415
  from examples.lm.configs import tiny as tiny_config  # noqa: PLC0415

  del tiny  # the tiny config is small on every machine
  config = tiny_config.get_config()
  config.mesh_shape = (jax.device_count(), 1, 1)
  config.num_train_steps = STEPS
  mesh = train.make_mesh(config)
  with jax.set_mesh(mesh), nnx.logical_axis_rules(models.LOGICAL_AXIS_RULES):
    graphdef, state = nnx.split(train.create_model(config))
  nnx_step = train.make_train_step(config)

  def step(state, batch):  # the example's in-place NNX step as a pure one (as NnxTrainLoop runs it)
    model, optimizer = nnx.merge(graphdef, state)
    metrics = nnx_step(model, optimizer, batch)
    return nnx.to_pure_dict(nnx.state((model, optimizer))), metrics

  rng = np.random.default_rng(1)
  batches = [{"tokens": rng.integers(0, 256, (config.global_batch_size, config.seq_len + 1),
                                     dtype=np.uint8)} for _ in range(STEPS)]
  return step, nnx.to_pure_dict(state), batches, mesh, train.BATCH_AXES


# The NNX LM's step counter is its optimizer's (the ResNet's: state.step, loopkit's default).
STEP_OF = {"lm": {"step_of": lambda s: s[1]["step"]}, "resnet": {}}


def _dispatch_times(program, host_state, batches, k: int) -> dict:
  """Three calls of ``program`` at K = ``k`` on a chunk on the device: ms to return, to finish."""
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  state = program.place_state(jax.device_put(host_state))
  chunk = jax.device_put(jax.tree.map(lambda *xs: np.stack(xs), *batches[:k]),
                         program.batch_sharding)
  n = jax.device_put(np.int32(k), program.replicated)
  state, out = program(state, chunk, n)  # compiled already; a warm-up call
  jax.block_until_ready(out.step)
  dispatch, total = [], []
  for _ in range(3):
    t0 = time.perf_counter()
    state, out = program(state, chunk, n)
    t1 = time.perf_counter()
    jax.block_until_ready(out.step)
    t2 = time.perf_counter()
    dispatch.append(1e3 * (t1 - t0))
    total.append(1e3 * (t2 - t0))
  return {"dispatch_ms": sorted(dispatch)[1], "call_ms": sorted(total)[1]}


def worker(setting: str, tiny: bool, hlo_dir: str) -> int:
  import jax  # noqa: PLC0415  (XLA_FLAGS was set by the parent)

  dev = jax.devices()[0]
  _emit("META", {"setting": setting, "device_kind": dev.device_kind, "platform": dev.platform,
                 "jax": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", "")})
  import loopkit  # noqa: PLC0415

  for model, build in (("lm", _lm), ("resnet", _resnet)):
    try:
      step, state, batches, mesh, data_axis = build(tiny)
      shardings = jax.tree.map(lambda x: x.sharding, state)
      host_state = jax.device_get(state)
      del state
      ref = None
      for i, k in enumerate(RUN_KS):
        t0 = time.perf_counter()
        loop = loopkit.TrainLoop(step, iterations_per_loop=k, mesh=mesh, data_axis=data_axis,
                                 **STEP_OF[model])
        final = loop.run(jax.device_put(host_state, shardings), batches, num_steps=STEPS)
        leaves = [jax.device_get(x) for x in jax.tree.leaves(final)]
        row = {"setting": setting, "model": model, "run": i, "k": k,
               "secs": round(time.perf_counter() - t0, 2), "digest": _state_digest(leaves),
               "step": loop.ledger.step, "compile_count": loop.program.compile_count()}
        if ref is None:
          ref = leaves
        row["leaves"] = len(leaves)
        row["leaves_differ_from_run0"], row["max_abs_diff_from_run0"] = _diff(leaves, ref)
        if i == 0:
          compiled = loop.program.compiled()
          text = compiled.as_text() if compiled is not None else ""
          row["graph"] = graph_summary(text)
          with open(os.path.join(hlo_dir, f"{setting}.{model}.k{k}.hlo.txt"), "w") as f:
            f.write(text)
          if model == "resnet":
            row["timing"] = _dispatch_times(loop.program, host_state, batches, k)
        _emit("ROW", row)
        del final, leaves, loop
    except Exception as e:  # noqa: BLE001  (a model's failure is a row, not the end)
      print(traceback.format_exc(), file=sys.stderr, flush=True)
      first = str(e).splitlines()[0][:300] if str(e) else ""
      _emit("ROW", {"setting": setting, "model": model, "error": f"{type(e).__name__}: {first}"})
  _emit("DONE", {})
  return 0


# == parent ======================================================================================

def launch(setting: str, tiny: bool, hlo_dir: str, timeout_s: float) -> dict:
  """Runs one worker to its end or ``timeout_s``; returns its rows, meta and stderr tail."""
  env = dict(os.environ)
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith(("--xla_gpu_deterministic_ops", "--xla_gpu_enable_command_buffer"))]
  env["XLA_FLAGS"] = " ".join(flags + SETTINGS[setting])
  env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # the settings share the GPU
  env.setdefault("PYTHONUNBUFFERED", "1")
  if tiny:
    env["JAX_PLATFORMS"] = "cpu"
  argv = [sys.executable, os.path.abspath(__file__), "--worker", setting, "--hlo-dir", hlo_dir]
  if tiny:
    argv.append("--tiny")
  proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  out: dict = {"setting": setting, "rows": [], "meta": None, "done": False, "stderr": []}

  def read_err():
    for line in proc.stderr:
      out["stderr"] = (out["stderr"] + [line.rstrip()])[-30:]

  t = threading.Thread(target=read_err, daemon=True)
  t.start()
  timer = threading.Timer(timeout_s, proc.kill)
  timer.start()
  for line in proc.stdout:
    if not line.startswith(TAG):
      continue
    kind, _, payload = line[len(TAG):].partition(" ")
    if kind == "ROW":
      out["rows"].append(json.loads(payload))
      print(f"[{setting}] {payload.strip()}", flush=True)
    elif kind == "META":
      out["meta"] = json.loads(payload)
    elif kind == "DONE":
      out["done"] = True
  proc.wait()
  timed_out = not timer.is_alive() and proc.returncode != 0
  timer.cancel()
  t.join(timeout=5)
  out["returncode"] = proc.returncode
  if not out["done"]:
    out["killed"] = (f"killed after {timeout_s:.0f} s" if timed_out else
                     f"exit {proc.returncode} before its end")
  return out


def verdicts(results: list[dict]) -> list[dict]:
  """Per (setting, model): K-invariant? same executable twice equal? And across processes."""
  rows = [r for res in results for r in res["rows"] if "digest" in r]
  out = []
  for setting in SETTINGS:
    for model in ("lm", "resnet"):
      rs = sorted((r for r in rows if r["setting"] == setting and r["model"] == model),
                  key=lambda r: r["run"])
      if not rs:
        continue
      k1 = [r for r in rs if r["k"] == 1]
      out.append({
          "setting": setting, "model": model, "runs": len(rs),
          "k_invariant": (len({r["digest"] for r in rs}) == 1 if len(rs) == len(RUN_KS) else
                          False if len({r["digest"] for r in rs}) > 1 else None),
          "k1_twice_equal": k1[0]["digest"] == k1[1]["digest"] if len(k1) == 2 else None,
          "max_abs_diff": max(r["max_abs_diff_from_run0"] for r in rs),
          "leaves_differ": max(r["leaves_differ_from_run0"] for r in rs),
          "digests": {f"K={r['k']}#{r['run']}": r["digest"] for r in rs}})
  return out


def across(results: list[dict], a: str, b: str) -> dict:
  """Whether settings ``a`` and ``b`` (separate processes) ended on the same states, per model."""
  digest = {(r["setting"], r["model"], r["run"]): r["digest"]
            for res in results for r in res["rows"] if "digest" in r}
  out = {}
  for model in ("lm", "resnet"):
    pairs = [(digest.get((a, model, i)), digest.get((b, model, i))) for i in range(len(RUN_KS))]
    pairs = [p for p in pairs if None not in p]
    out[model] = None if not pairs else all(x == y for x, y in pairs)
  return out


def render(results: list[dict], meta: dict) -> str:
  v = verdicts(results)
  yn = lambda x: "—" if x is None else ("yes" if x else "**no**")
  lines = [
      "## Exactness: the final state at K = 10, 3, 1, 1 (`benchmarks/gpu_exactness.py`)", "",
      f"- date: {meta['date']}; command: `{meta['command']}`; loopkit commit: {meta['commit']}",
      f"- device: {meta['device']}; jax {meta['jax']}",
      f"- {STEPS} steps from one initial state and the same batches; runs in order K = "
      f"{', '.join(map(str, RUN_KS))} in one process per setting; the settings ran side by side "
      "on the one GPU.", "",
      "| setting | model | K-invariant (all 4 runs equal) | K = 1 twice equal | leaves differing "
      "| max abs diff |", "|---|---|---|---|---|---|"]
  for r in v:
    lines.append(f"| {r['setting']} | {r['model']} | {yn(r['k_invariant'])} | "
                 f"{yn(r['k1_twice_equal'])} | {r['leaves_differ']} | {r['max_abs_diff']:.3g} |")
  lines += ["", "Across processes (same runs, same digests?): " + "; ".join(
      f"{a} vs {b}: " + ", ".join(f"{m} {yn(x)}" for m, x in across(results, a, b).items())
      for a, b in (("deterministic", "deterministic-2"), ("default", "command-buffers"),
                   ("deterministic", "deterministic+command-buffers"))), ""]
  lines += ["### The step loop and CUDA graphs (optimized HLO of the K = 10 program)", "",
            "| setting | model | command-buffer computations | whiles in them | other whiles | "
            "step loop in a command buffer | ResNet call: ms to return / ms to finish |",
            "|---|---|---|---|---|---|---|"]
  for res in results:
    for r in res["rows"]:
      if "graph" in r:
        g, tm = r["graph"], r.get("timing")
        timing = f"{tm['dispatch_ms']:.2f} / {tm['call_ms']:.2f}" if tm else ""
        lines.append(f"| {r['setting']} | {r['model']} | {g['command_buffer_computations']} | "
                     f"{g['whiles_in_command_buffers']} | {g['whiles_elsewhere']} | "
                     f"{yn(g['step_loop_in_command_buffer'])} | {timing} |")
  failed = [(res["setting"], r) for res in results for r in res["rows"] if "error" in r]
  failed += [(res["setting"], {"model": "*", "error": res["killed"] + ": " +
                               " / ".join(res["stderr"][-3:])})
             for res in results if res.get("killed")]
  if failed:
    lines += ["", "Failures:", ""] + [f"- {s} {r['model']}: {r['error']}" for s, r in failed]
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", help="folder for exactness.json/.md and hlo.tar.gz")
  p.add_argument("--tiny", action="store_true", help="CPU smoke run (JAX_PLATFORMS=cpu)")
  p.add_argument("--timeout-s", type=float, default=200.0, help="per worker (they run together)")
  p.add_argument("--settings", default=",".join(SETTINGS))
  p.add_argument("--worker", help=argparse.SUPPRESS)
  p.add_argument("--hlo-dir", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.worker:
    return worker(args.worker, args.tiny, args.hlo_dir)
  if not args.out:
    p.error("--out is required")

  os.makedirs(args.out, exist_ok=True)
  hlo_dir = tempfile.mkdtemp(prefix="loopkit-hlo-")  # only the tarball goes to --out
  t0 = time.perf_counter()
  results: list[dict] = [{} for _ in args.settings.split(",")]

  def one(i, s):
    results[i] = launch(s, args.tiny, hlo_dir, args.timeout_s)

  threads = [threading.Thread(target=one, args=(i, s))
             for i, s in enumerate(args.settings.split(","))]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  m = next((r["meta"] for r in results if r.get("meta")), {}) or {}
  meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
          "command": "python benchmarks/gpu_exactness.py " + " ".join(argv or sys.argv[1:]),
          "commit": gpu.git_commit(), "device": gpu.nvidia_smi() or m.get("device_kind", "?"),
          "jax": m.get("jax", "?"), "wall_s": round(time.perf_counter() - t0, 1)}
  with open(os.path.join(args.out, "exactness.json"), "w") as f:
    json.dump({"meta": meta, "results": results, "verdicts": verdicts(results)}, f, indent=1)
  md = render(results, meta)
  with open(os.path.join(args.out, "exactness.md"), "w") as f:
    f.write(md)
  buf = io.BytesIO()
  with tarfile.open(fileobj=buf, mode="w:gz") as tar:
    tar.add(hlo_dir, arcname="hlo")
  with open(os.path.join(args.out, "hlo.tar.gz"), "wb") as f:
    f.write(buf.getvalue())
  print(md, flush=True)
  print(f"wall {meta['wall_s']} s", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
