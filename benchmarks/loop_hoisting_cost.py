"""What does keeping the step loop's body whole cost (loopkit/core/slot_loop.py, ``no_hoisting``)?

loopkit tags its step loop's XLA while instruction with ``_xla_disable_loop_instr_hoisting`` so
that XLA's while-loop invariant code motion leaves the body as a per-step ``jit`` compiles it
(float32 results then equal a per-step ``jit``'s bitwise on sharded meshes). Whatever the pass
would have moved out of the loop (constants, ``iota`` masks, the partition-index arithmetic of
sharded code) is computed again in every iteration instead. This script times
:class:`loopkit.core.MultiStepProgram` calls of K steps with the tag (the shipped program) and
without it, on:

* ``lm``: a small Transformer LM (causal attention, an ``iota`` mask, AdamW) with its parameters
  sharded over ``fsdp`` and ``tensor`` of a (2, 2, 2) mesh, the batch on ``("data", "fsdp")``;
* ``mlp`` (dispatch-bound) and ``cnn`` (compute-bound) of ``benchmarks/workloads.py``, data
  parallel over all devices.

Both programs are compiled first; then rounds of ``--calls`` calls of each alternate (which goes
first alternates too: the same machine load for both), each call waited for. Chunks are placed
before timing, so a call's time is dispatch + device. Printed: the process's CPU time per step
(all XLA threads), steps/s of the fastest call and of the median call, and XLA's cost analysis
of both programs (:meth:`MultiStepProgram.cost_analysis`: the loop body counted
once, so what no longer leaves the loop shows as its cost per step).

Usage (from the repository root, 8 fake CPU devices)::

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.loop_hoisting_cost
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import loopkit
from benchmarks import workloads
from loopkit.core import slot_loop

# -- the sharded LM --------------------------------------------------------------------------

VOCAB, D_MODEL, HEADS, HEAD_DIM, MLP, SEQ, BATCH = 256, 128, 4, 32, 512, 64, 16
SPECS = {"embed": P("tensor", "fsdp"), "q": P("fsdp", "tensor", None),
         "k": P("fsdp", "tensor", None), "v": P("fsdp", "tensor", None),
         "o": P("tensor", None, "fsdp"), "wi": P("fsdp", "tensor"), "wo": P("tensor", "fsdp"),
         "ln1": P("fsdp"), "ln2": P("fsdp")}
LM_TX = optax.adamw(1e-3, weight_decay=0.1)


def _norm(x, scale):
  x = x - x.mean(-1, keepdims=True)
  return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * scale


def lm_loss(params, batch):
  """Mean next-token cross-entropy of a 1-block pre-norm Transformer with tied embeddings."""
  x = params["embed"][batch["x"]]
  causal = jnp.tril(jnp.ones((SEQ, SEQ), bool))
  h = _norm(x, params["ln1"])
  q, k, v = (jnp.einsum("btd,dhk->bthk", h, params[n]) for n in "qkv")
  a = jnp.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(HEAD_DIM)
  a = jax.nn.softmax(jnp.where(causal, a, -1e9), -1)
  x = x + jnp.einsum("bhqs,bshk,hkd->bqd", a, v, params["o"])
  x = x + jax.nn.gelu(_norm(x, params["ln2"]) @ params["wi"]) @ params["wo"]
  logits = x @ params["embed"].T
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def lm_step(state, batch):
  loss, grads = jax.value_and_grad(lm_loss)(state["params"], batch)
  updates, opt = LM_TX.update(grads, state["opt"], state["params"])
  return ({"params": optax.apply_updates(state["params"], updates), "opt": opt,
           "step": state["step"] + 1}, {"loss": loss})


def lm_state(mesh):
  keys = iter(jax.random.split(jax.random.key(0), 8))
  shapes = {"embed": (VOCAB, D_MODEL), "q": (D_MODEL, HEADS, HEAD_DIM),
            "k": (D_MODEL, HEADS, HEAD_DIM), "v": (D_MODEL, HEADS, HEAD_DIM),
            "o": (HEADS, HEAD_DIM, D_MODEL), "wi": (D_MODEL, MLP), "wo": (MLP, D_MODEL)}
  params = {n: jax.random.normal(next(keys), s) * 0.05 for n, s in shapes.items()}
  params["ln1"] = params["ln2"] = jnp.ones((D_MODEL,))
  shardings = {n: NamedSharding(mesh, SPECS[n]) for n in params}
  params = jax.device_put(params, shardings)
  opt = jax.jit(LM_TX.init)(params)  # moments: as their parameter, by hand below
  adam = opt[0]._replace(mu=jax.device_put(opt[0].mu, shardings),
                         nu=jax.device_put(opt[0].nu, shardings))
  return {"params": params, "opt": (adam,) + tuple(opt[1:]), "step": jnp.zeros((), jnp.int32)}


def lm_chunks(k, calls):
  rng = np.random.default_rng(0)
  toks = rng.integers(0, VOCAB, size=(calls, k, BATCH, SEQ + 1)).astype(np.int32)
  return [{"x": t[..., :-1], "y": t[..., 1:]} for t in toks]


# -- timing ----------------------------------------------------------------------------------


def build(name: str, tagged: bool, k: int, calls: int) -> tuple[Any, Any, list, Any]:
  """``(program, state, placed chunks, n)`` for ``name``, compiled (one call run)."""
  saved = slot_loop._set_xla_metadata  # pylint: disable=protected-access
  if not tagged:
    slot_loop._set_xla_metadata = None  # pylint: disable=protected-access
  try:
    if name == "lm":
      mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), devices=jax.devices(),
                           axis_types=(jax.sharding.AxisType.Auto,) * 3)
      program = loopkit.core.MultiStepProgram(lm_step, iterations_per_loop=k, mesh=mesh,
                                              data_axis=("data", "fsdp"))
      state = program.place_state(lm_state(mesh))
      chunks = lm_chunks(k, calls)
    else:
      w = workloads.get(name, k * calls)
      program = loopkit.core.MultiStepProgram(workloads.make_train_step(w),
                                              iterations_per_loop=k,
                                              mesh=loopkit.data_parallel_mesh())
      state = program.place_state(workloads.init_state(w))
      data = workloads.make_data(w, k * calls)
      chunks = [{n: v[i * k:(i + 1) * k] for n, v in data.items()} for i in range(calls)]
    chunks = [jax.device_put(c, program.batch_sharding) for c in chunks]
    n = jax.device_put(np.int32(k), program.replicated)
    state, _ = program(state, chunks[0], n)  # traces and compiles here, tag or not
    jax.block_until_ready(state)
    return program, state, chunks, n
  finally:
    slot_loop._set_xla_metadata = saved  # pylint: disable=protected-access


def call_secs(built: list, calls: int) -> tuple[list[float], float]:
  """Wall seconds of each of ``calls`` calls (each waited for), and the process's CPU seconds
  over all of them (every XLA thread: less sensitive than wall time to other processes' load);
  the state is carried in ``built``."""
  program, state, chunks, n = built
  secs = []
  cpu0 = time.process_time()
  for i in range(calls):
    t0 = time.perf_counter()
    state, out = program(state, chunks[i % len(chunks)], n)
    jax.block_until_ready((state, out))
    secs.append(time.perf_counter() - t0)
  built[1] = state
  return secs, time.process_time() - cpu0


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--k", type=int, default=8)
  parser.add_argument("--calls", type=int, default=20)
  parser.add_argument("--workloads", default="lm,mlp,cnn")
  args = parser.parse_args()
  print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices, "
        f"K = {args.k}, {args.repeats} rounds of {args.calls} calls each", flush=True)
  for name in args.workloads.split(","):
    built = {tagged: list(build(name, tagged, args.k, args.calls)) for tagged in (False, True)}
    secs: dict[bool, list[float]] = {False: [], True: []}
    cpu = {False: 0.0, True: 0.0}
    for r in range(args.repeats):  # interleaved rounds, the order alternating: same load
      for tagged in ((False, True) if r % 2 == 0 else (True, False)):
        wall, cpu_secs = call_secs(built[tagged], args.calls)
        secs[tagged] += wall
        cpu[tagged] += cpu_secs
    steps = args.repeats * args.calls * args.k
    print(f"{name}: CPU ms per step (all threads) hoisting on {1e3 * cpu[False] / steps:.2f}, "
          f"off (shipped) {1e3 * cpu[True] / steps:.2f} (ratio {cpu[True] / cpu[False]:.3f})",
          flush=True)
    rate = {t: (args.k / min(v), args.k / float(np.median(v))) for t, v in secs.items()}
    print(f"{name}: steps/s (fastest call, median call) hoisting on {rate[False][0]:.1f}, "
          f"{rate[False][1]:.1f}; off (shipped) {rate[True][0]:.1f}, {rate[True][1]:.1f} "
          f"(ratio {rate[True][0] / rate[False][0]:.3f}, {rate[True][1] / rate[False][1]:.3f})",
          flush=True)
    cost = {t: built[t][0].cost_analysis() or {} for t in (False, True)}
    print(f"{name}: XLA cost analysis (one loop iteration + the code outside the loop, per "
          f"device): flops {cost[False].get('flops', 0):.0f} -> {cost[True].get('flops', 0):.0f}, "
          f"bytes accessed {cost[False].get('bytes accessed', 0):.0f} -> "
          f"{cost[True].get('bytes accessed', 0):.0f}", flush=True)


if __name__ == "__main__":
  main()
