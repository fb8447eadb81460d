"""Memory of a resume onto another mesh: an abstract state against an initialised one (C78).

Usage (from the repository root)::

  python benchmarks/abstract_restore.py [--width 4096] [--layers 3]

Saves one checkpoint of a state of ``layers`` float32 ``[width, width]`` kernels and their
momenta (384 MiB at the defaults), sharded ``P("fsdp", "tensor")`` on a ``(2, 2, 2)`` mesh of 8
CPU devices. Then, each in a fresh process, a ``TrainLoop`` on a ``(1, 4, 2)`` mesh with
``state_shardings=`` resumes it (``num_steps`` = the checkpoint's step: nothing is trained, so
the figures are the restore's), given

* ``abstract``: ``jax.eval_shape(init)``;
* ``initialised``: ``jax.jit(init, out_shardings=...)()``, the state made on the new mesh
  (the cheapest way to have a concrete state there).

For each it prints the bytes the live arrays hold on the devices (a replicated leaf once per
device) before the restore and after it (hooks placed before and after the ``CheckpointHook``),
in copies of the state, and the growth of the process's peak resident memory (``ru_maxrss``)
from before the state was made to the end of ``run``: on CPU devices the arrays are in that
memory, with whatever else the restore holds while it reads (Orbax, TensorStore).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _setup() -> None:
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _model(width: int, layers: int):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top

  def init():
    ws = {f"w{i}": jnp.full((width, width), 0.01 * (i + 1), jnp.float32) for i in range(layers)}
    return {"params": ws, "mu": jax.tree.map(jnp.zeros_like, ws),
            "step": jnp.zeros((), jnp.int32)}

  def step(state, batch):
    grads = jax.tree.map(lambda w: w * jnp.mean(batch["x"]), state["params"])
    mu = jax.tree.map(lambda m, g: 0.9 * m + g, state["mu"], grads)
    params = jax.tree.map(lambda w, m: w - 1e-3 * m, state["params"], mu)
    return {"params": params, "mu": mu, "step": state["step"] + 1}, {}

  kernel = P("fsdp", "tensor")
  specs = {"params": {f"w{i}": kernel for i in range(layers)},
           "mu": {f"w{i}": kernel for i in range(layers)}, "step": P()}
  return init, step, specs


def _mesh(shape):
  import jax  # pylint: disable=g-import-not-at-top
  n = shape[0] * shape[1] * shape[2]
  return jax.make_mesh(shape, ("data", "fsdp", "tensor"), devices=jax.devices()[:n],
                       axis_types=(jax.sharding.AxisType.Auto,) * 3)


def device_bytes(arrays=None) -> int:
  """Bytes the arrays (default: the live ones) hold on the devices, from their shardings."""
  import math  # pylint: disable=g-import-not-at-top

  import jax  # pylint: disable=g-import-not-at-top
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
             * len(x.sharding.device_set)
             for x in (jax.live_arrays() if arrays is None else arrays))


def _save(directory: str, width: int, layers: int) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top

  import loopkit  # pylint: disable=g-import-not-at-top
  init, _, specs = _model(width, layers)
  mesh = _mesh((2, 2, 2))
  state = jax.jit(lambda: {**init(), "step": jax.numpy.asarray(2, jax.numpy.int32)},
                  out_shardings=jax.tree.map(lambda p: NamedSharding(mesh, p), specs))()
  hook = loopkit.CheckpointHook(directory)
  hook.save(2, state, ledger=loopkit.core.Ledger(step=2), data_position=2)
  hook.close()


def _resume(directory: str, width: int, layers: int, kind: str) -> dict:
  import gc  # pylint: disable=g-import-not-at-top

  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top

  import loopkit  # pylint: disable=g-import-not-at-top
  init, step, specs = _model(width, layers)
  mesh = _mesh((1, 4, 2))
  seen = []

  class Probe(loopkit.Hook):
    def __init__(self):
      super().__init__(at_end=False)

    def on_run_start(self, ctx, state):
      gc.collect()
      seen.append(device_bytes())

  loop = loopkit.TrainLoop(step, iterations_per_loop=2, mesh=mesh,
                           data_axis=("data", "fsdp"), state_shardings=specs,
                           hooks=[Probe(), loopkit.CheckpointHook(directory), Probe()])
  batches = [{"x": np.ones((8, 1), np.float32)}] * 2
  gc.collect()
  start, rss0 = device_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  if kind == "abstract":
    state = jax.eval_shape(init)
  else:
    state = jax.jit(init, out_shardings=jax.tree.map(lambda p: NamedSharding(mesh, p), specs))()
  out = loop.run(state, batches, num_steps=2)
  rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  assert loop.hooks[1].restored_step == 2
  return {"kind": kind, "state_bytes": device_bytes(jax.tree.leaves(out)),
          "before": seen[0] - start, "after": seen[1] - start,
          "peak_rss_growth": (rss1 - rss0) * 1024}  # ru_maxrss: KiB on Linux


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--width", type=int, default=4096)
  parser.add_argument("--layers", type=int, default=3)
  parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)  # (directory, kind)
  args = parser.parse_args()
  _setup()
  if args.child:
    directory, kind = args.child
    if kind == "save":
      _save(directory, args.width, args.layers)
    else:
      print(json.dumps(_resume(directory, args.width, args.layers, kind)))
    return
  mib = 2 ** 20
  with tempfile.TemporaryDirectory() as tmp:
    directory = os.path.join(tmp, "ckpt")
    common = [sys.executable, os.path.abspath(__file__), "--width", str(args.width),
              "--layers", str(args.layers), "--child", directory]
    subprocess.run(common + ["save"], check=True, cwd=ROOT)
    rows = []
    for kind in ("abstract", "initialised"):
      out = subprocess.run(common + [kind], check=True, cwd=ROOT, capture_output=True,
                           text=True).stdout
      rows.append(json.loads(out.strip().splitlines()[-1]))
  print(f"state: {rows[0]['state_bytes'] / mib:.1f} MiB; (1, 4, 2) mesh of 8 CPU devices")
  print("| state given to run | device bytes before the restore | after the restore | "
        "peak RSS growth |")
  print("|---|---|---|---|")
  for r in rows:
    one = r["state_bytes"]
    print(f"| {r['kind']} | {r['before'] / mib:.1f} MiB ({r['before'] / one:.2f} copies) | "
          f"{r['after'] / mib:.1f} MiB ({r['after'] / one:.2f}) | "
          f"{r['peak_rss_growth'] / mib:.0f} MiB ({r['peak_rss_growth'] / one:.2f}) |")


if __name__ == "__main__":
  main()
