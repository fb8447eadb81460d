"""Subprocess worker for tests/test_leaf_kinds.py: every leaf kind through save, kill, resume.

Run as ``python tests/_leaf_worker.py --phase P --dir D --out O --k K``. The
state holds one sub-state per leaf kind (:data:`KINDS`), each changed by every
step in a way that depends on its own value, so a leaf restored wrongly (or
with another dtype or key impl) changes the final state. Under
``JAX_ENABLE_X64=1`` the state also holds int64 and uint64 leaves.

Phases:
  * ``save``: trains towards step 8 with a :class:`loopkit.CheckpointHook`
    saving at step 4; once that save committed, the process SIGKILLs itself.
  * ``resume``: in a fresh process, (a) an uninterrupted reference run of 8
    steps (digests at step 4 and at the end) and (b) a run with a
    ``CheckpointHook`` on the same directory, which restores step 4 and trains
    to 8. Writes ``O.json``: per kind, the digests of the reference at 4 and 8,
    of the restored state and of the resumed final state, and the final dtypes.

Not a test module itself.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys


def parse_args(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--phase", required=True, choices=["save", "resume"])
  p.add_argument("--dir", required=True)
  p.add_argument("--out", required=True)
  p.add_argument("--k", type=int, required=True)
  p.add_argument("--devices", type=int, default=2)
  return p.parse_args(argv)


if __name__ == "__main__":  # set the device count before JAX is imported
  ARGS = parse_args()
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from tests import bootstrap
  bootstrap.start(ARGS.devices)  # CPU, ARGS.devices fake devices

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import loopkit  # noqa: E402

NUM_STEPS, SAVE_AT, BATCH = 8, 4, 8
X64 = bool(jax.config.jax_enable_x64)


class Net(nnx.Module):
  """Linear + Dropout: the dropout mask comes from the module's own nnx.Rngs stream."""

  def __init__(self, rngs: nnx.Rngs):
    self.lin = nnx.Linear(4, 3, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)

  def __call__(self, x):
    return self.drop(self.lin(x))


def _nnx_parts(seed=0):
  model = Net(nnx.Rngs(params=seed, dropout=seed + 1))
  opt = nnx.Optimizer(model, optax.adam(0.05), wrt=nnx.Param)
  return nnx.split((model, opt))


GRAPHDEF, _ = _nnx_parts()


def init_kinds(seed: int = 0) -> dict:
  """One sub-state per leaf kind (explicit dtypes, so x64 changes only the int64 kind).

  Another ``seed`` changes every value (keys included), so a resumed run that
  ends equal to the reference must have restored every leaf.
  """
  r = seed
  kinds = {
      "typed_key": {"key": jax.random.key(r), "keys": jax.random.split(jax.random.key(r + 1), 3),
                    "rbg": jax.random.key(r + 2, impl="rbg"),
                    "w": jnp.full((3,), r, jnp.float32)},
      "bool": {"flag": jnp.array(r == 0), "mask": jnp.array([True, r == 0, True])},
      "int8": {"x": jnp.array([100, -7, 3 + r], jnp.int8)},
      "uint32": {"x": jnp.array([1, 2 + r, 4000000000], jnp.uint32)},
      "bfloat16": {"w": jnp.array([0.3, -1.7, 5.0 + r], jnp.bfloat16)},
      "zero_d": {"s": jnp.array(0.25 + r, jnp.float32), "i": jnp.array(3 + r, jnp.int32)},
      "empty": {"a": jnp.zeros((0,), jnp.float32), "b": jnp.zeros((3, 0), jnp.float32),
                "keys": jax.random.split(jax.random.key(r + 3), 0),
                "s": jnp.array(1.0 + r, jnp.float32)},
      "none": {"nothing": None, "nested": {"also": None, "x": jnp.array(2.0 + r, jnp.float32)}},
      "nnx": _nnx_parts(r)[1],
  }
  if X64:
    kinds["int64"] = {"x": jnp.array([2**40 + 7, -(2**50) + r], jnp.int64),
                      "u": jnp.array([2**63 + 5 + r], jnp.uint64)}
  return kinds


def init_state(seed: int = 0) -> dict:
  return {"kinds": init_kinds(seed), "step": jnp.zeros((), jnp.int32)}


def _nnx_step(nstate, batch):
  model, opt = nnx.merge(GRAPHDEF, nstate)

  def loss_fn(m):
    return jnp.mean((m(batch["x"]) - batch["y"]) ** 2)

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  opt.update(model, grads)
  return nnx.split((model, opt))[1], loss


def train_step(state, batch):
  k, x = state["kinds"], batch["x"]
  m = jnp.mean(x)
  out = {}
  tk = k["typed_key"]
  key, sub = jax.random.split(tk["key"])
  keys = jax.vmap(lambda q: jax.random.split(q)[0])(tk["keys"])
  rbg, rsub = jax.random.split(tk["rbg"])
  f32 = jnp.float32
  noise = (jax.random.normal(sub, (3,), f32) + jax.random.uniform(rsub, (3,), f32)
           + jax.vmap(lambda q: jax.random.uniform(q, (), f32))(keys))
  out["typed_key"] = {"key": key, "keys": keys, "rbg": rbg, "w": tk["w"] + noise}
  b = k["bool"]
  out["bool"] = {"flag": jnp.logical_xor(b["flag"], m > 0),
                 "mask": jnp.logical_xor(b["mask"], jnp.roll(b["mask"], 1))}
  out["int8"] = {"x": (k["int8"]["x"] * 3 + 11).astype(jnp.int8)}
  out["uint32"] = {"x": k["uint32"]["x"] * jnp.uint32(1664525) + jnp.uint32(1013904223)}
  out["bfloat16"] = {"w": (k["bfloat16"]["w"] * 0.9 + m.astype(jnp.bfloat16))
                     .astype(jnp.bfloat16)}
  z = k["zero_d"]
  out["zero_d"] = {"s": z["s"] * 1.5 + m, "i": z["i"] * 5 + 1}
  e = k["empty"]
  out["empty"] = {"a": e["a"] + 1.0, "b": e["b"] * 2.0, "keys": e["keys"],
                  "s": e["s"] + jnp.sum(e["a"]) + m}
  n = k["none"]
  out["none"] = {"nothing": None, "nested": {"also": None, "x": n["nested"]["x"] * 0.5 + m}}
  out["nnx"], loss = _nnx_step(k["nnx"], batch)
  if X64:
    i = k["int64"]
    out["int64"] = {"x": i["x"] * 6364136223846793005 + 1442695040888963407,
                    "u": i["u"] * jnp.uint64(2862933555777941757) + jnp.uint64(3037000493)}
  return {"kinds": out, "step": state["step"] + 1}, {"loss": loss}


def make_batches(n):
  rng = np.random.default_rng(0)
  return [{"x": rng.normal(size=(BATCH, 4)).astype(np.float32),
           "y": rng.normal(size=(BATCH, 3)).astype(np.float32)} for _ in range(n)]


def _leaf_bytes(x) -> bytes:
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  return np.ascontiguousarray(np.asarray(jax.device_get(x))).tobytes()


def digests(state) -> dict[str, str]:
  """Per kind: sha256 over every leaf's path, shape, dtype and bytes (key data for keys)."""
  out = {}
  for kind, sub in state["kinds"].items():
    h = hashlib.sha256()
    for path, x in jax.tree_util.tree_flatten_with_path(sub)[0]:
      h.update(f"{jax.tree_util.keystr(path)}|{x.shape}|{x.dtype}|".encode())
      h.update(_leaf_bytes(x))
    out[kind] = h.hexdigest()
  return out


def dtypes(state) -> dict[str, list[str]]:
  return {kind: [str(x.dtype) for x in jax.tree.leaves(sub)]
          for kind, sub in state["kinds"].items()}


class KillAfterCommit(loopkit.Hook):
  """At ``step``: waits until the checkpoint hook's save committed, then SIGKILLs."""

  needs_state = False

  def __init__(self, ckpt, step):
    super().__init__(at_steps=[step], at_end=False)
    self.ckpt = ckpt

  def on_trigger(self, info, state):
    self.ckpt.wait_until_finished()
    print(f"KILLING at {info.end_step} saved {self.ckpt.all_steps()}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


class Capture(loopkit.Hook):
  """Digests of the state handed to on_run_start (after a restore) and at ``step``."""

  def __init__(self, step):
    super().__init__(at_steps=[step], at_end=False)
    self.start = None
    self.at = None

  def on_run_start(self, loop, state):
    self.start = digests(state)

  def on_trigger(self, info, state):
    self.at = digests(state)


def main(args):
  data = make_batches(NUM_STEPS)
  if args.phase == "save":
    ckpt = loopkit.CheckpointHook(args.dir, at_steps=[SAVE_AT])
    loop = loopkit.TrainLoop(train_step, iterations_per_loop=args.k,
                             hooks=[ckpt, KillAfterCommit(ckpt, SAVE_AT)])
    loop.run(init_state(), data, num_steps=NUM_STEPS)
    raise SystemExit("the run was not killed")
  ref_capture = Capture(SAVE_AT)
  ref_loop = loopkit.TrainLoop(train_step, iterations_per_loop=args.k, hooks=[ref_capture])
  ref = ref_loop.run(init_state(), data, num_steps=NUM_STEPS)
  ckpt = loopkit.CheckpointHook(args.dir, at_steps=[SAVE_AT])
  capture = Capture(SAVE_AT)
  loop = loopkit.TrainLoop(train_step, iterations_per_loop=args.k, hooks=[ckpt, capture])
  final = loop.run(init_state(seed=7), data, num_steps=NUM_STEPS)  # the checkpoint must win
  info = {"x64": X64, "restored_step": ckpt.restored_step, "status": loop.status,
          "step": loop.ledger.step, "trace_count": loop.program.trace_count,
          "ref_at_save": ref_capture.at, "ref_final": digests(ref),
          "ref_dtypes": dtypes(ref), "restored": capture.start, "final": digests(final),
          "final_dtypes": dtypes(final), "init_dtypes": dtypes(init_state()),
          "init": digests(init_state()), "other_seed": digests(init_state(seed=7))}
  with open(args.out + ".tmp", "w") as f:
    json.dump(info, f)
  os.replace(args.out + ".tmp", args.out)


if __name__ == "__main__":
  main(ARGS)
