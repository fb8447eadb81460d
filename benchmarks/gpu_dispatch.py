"""Why a loopkit call blocks the host on a GPU (the loop's trip count); a chunk's cost to form.

Usage (from the repository root)::

  python benchmarks/gpu_dispatch.py                 # one GPU: about 30 s per flag setting
  python benchmarks/gpu_dispatch.py --tiny          # CPU smoke run

``benchmarks/gpu_exactness.py`` found, on one H200 (jax 0.11.2), that a call of
loopkit's K-step program returns only when the device has finished it, with or
without ``--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL``. This script
times when the call returns (dispatch) and when its result is ready (finish),
median of 5 calls after a warm-up, for one step (a chain of 8 float32
``[N, N]`` matrix products and ``tanh``) compiled as:

* ``jit step``: one step per call (the per-step loop's program);
* ``fori static``: ``lax.fori_loop(0, 10, ...)``, a trip count known when compiled;
* ``scan``: ``lax.scan`` over a ``[10, ...]`` input (also a static trip count);
* ``fori traced``: ``lax.fori_loop(0, n, ...)`` with ``n`` an int32 argument (loopkit's
  loop: one executable for every call length).

and, for the default flag setting, what forming a ResNet-50 chunk costs on the
host: ``np.stack`` of K = 26 uint8 batches ``[256, 224, 224, 3]`` (1.0 GB), one
``jax.device_put`` of the stacked chunk, K separate ``device_put`` calls, and
``jnp.stack`` of the K device arrays on the device.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from benchmarks.gpu import COMMAND_BUFFER_FLAG  # noqa: E402  (stdlib-only at import)

SETTINGS = {"default": [], "command-buffers": [COMMAND_BUFFER_FLAG]}
TAG = "@@dispatch "


def _times(fn, args, calls: int = 5) -> dict:
  import jax  # noqa: PLC0415

  jax.block_until_ready(fn(*args))  # compile + warm-up
  ret, fin = [], []
  for _ in range(calls):
    t0 = time.perf_counter()
    out = fn(*args)
    t1 = time.perf_counter()
    jax.block_until_ready(out)
    t2 = time.perf_counter()
    ret.append(1e3 * (t1 - t0))
    fin.append(1e3 * (t2 - t0))
  return {"return_ms": round(sorted(ret)[calls // 2], 3),
          "finish_ms": round(sorted(fin)[calls // 2], 3)}


def worker(setting: str, tiny: bool) -> None:
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  n = 256 if tiny else 4096
  k = 10
  w = jax.random.normal(jax.random.key(0), (n, n), jnp.float32) / np.sqrt(n)
  x = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
  xs = jnp.stack([x] * k)

  def step(x):
    for _ in range(8):
      x = jnp.tanh(x @ w)
    return x

  body = lambda i, x: step(x)
  rows = {
      "jit step": _times(jax.jit(step), (x,)),
      "fori static (10)": _times(jax.jit(lambda x: jax.lax.fori_loop(0, k, body, x)), (x,)),
      "scan (10)": _times(jax.jit(lambda x, xs: jax.lax.scan(
          lambda c, s: (step(c + s), None), x, xs)[0]), (x, xs)),
      "fori traced (n = 10)": _times(jax.jit(lambda x, m: jax.lax.fori_loop(0, m, body, x)),
                                     (x, jnp.int32(k))),
  }
  print(TAG + json.dumps({"setting": setting, "platform": jax.devices()[0].platform,
                          "n": n, "rows": rows}), flush=True)
  if setting != "default":
    return
  kk, b, s = (4, 8, 32) if tiny else (26, 256, 224)
  rng = np.random.default_rng(0)
  batches = [rng.integers(0, 256, (b, s, s, 3), dtype=np.uint8) for _ in range(kk)]
  t0 = time.perf_counter()
  chunk = np.stack(batches)
  t1 = time.perf_counter()
  jax.block_until_ready(jax.device_put(chunk))
  t2 = time.perf_counter()
  parts = [jax.device_put(x) for x in batches]
  jax.block_until_ready(parts)
  t3 = time.perf_counter()
  jax.block_until_ready(jnp.stack(parts))
  t4 = time.perf_counter()
  jax.block_until_ready(jnp.stack(parts))
  t5 = time.perf_counter()
  print(TAG + json.dumps({"chunk": {"k": kk, "bytes": chunk.nbytes,
                                    "np_stack_s": round(t1 - t0, 3),
                                    "device_put_stacked_s": round(t2 - t1, 3),
                                    "device_put_k_batches_s": round(t3 - t2, 3),
                                    "jnp_stack_on_device_s (first, second)":
                                        [round(t4 - t3, 3), round(t5 - t4, 3)]}}), flush=True)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--tiny", action="store_true")
  p.add_argument("--worker")
  p.add_argument("--timeout-s", type=float, default=120.0)
  args = p.parse_args(argv)
  if args.worker:
    worker(args.worker, args.tiny)
    return 0
  for setting, flags in SETTINGS.items():
    env = dict(os.environ, XLA_FLAGS=" ".join(flags), PYTHONUNBUFFERED="1")
    if args.tiny:
      env["JAX_PLATFORMS"] = "cpu"
    argv2 = [sys.executable, os.path.abspath(__file__), "--worker", setting] + (
        ["--tiny"] if args.tiny else [])
    try:
      out = subprocess.run(argv2, cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=args.timeout_s)
      lines = [ln[len(TAG):] for ln in out.stdout.splitlines() if ln.startswith(TAG)]
      print("\n".join(lines) if lines else f"{setting}: exit {out.returncode}: "
            + " / ".join(out.stderr.splitlines()[-3:]), flush=True)
    except subprocess.TimeoutExpired:
      print(f"{setting}: killed after {args.timeout_s} s", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
