"""Generates docs/_static/timeline.png: device calls and host gaps for K=1 and K=8.

A real run: a small MLP trained by loopkit.TrainLoop on 8 fake CPU devices. The
program's ``__call__`` is wrapped to record when each device call is dispatched
and (from a watcher thread, without blocking the loop) when its outputs are
ready.

Run: python docs/scripts/make_timeline.py [--out docs/_static/timeline.png]
"""

import argparse
import os
import threading
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import matplotlib  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import loopkit  # noqa: E402

TX = optax.sgd(0.01)


def init():
  k1, k2 = jax.random.split(jax.random.key(0))
  params = {"w1": jax.random.normal(k1, (64, 256)) * 0.05,
            "w2": jax.random.normal(k2, (256, 10)) * 0.05}
  return {"params": params, "opt": TX.init(params), "step": jnp.zeros((), jnp.int32)}


def step(state, batch):
  def loss_fn(p):
    h = jax.nn.relu(batch["x"] @ p["w1"])
    return optax.softmax_cross_entropy_with_integer_labels(h @ p["w2"], batch["y"]).mean()
  loss, g = jax.value_and_grad(loss_fn)(state["params"])
  u, opt = TX.update(g, state["opt"])
  return {"params": optax.apply_updates(state["params"], u), "opt": opt,
          "step": state["step"] + 1}, {"loss": loss}


def batches(n):
  rng = np.random.default_rng(0)
  for _ in range(n):
    yield {"x": rng.normal(size=(256, 64)).astype(np.float32),
           "y": rng.integers(0, 10, size=(256,)).astype(np.int32)}


class TracedProgram:
  """Wraps a MultiStepProgram: records dispatch and ready times of each call."""

  def __init__(self, program):
    self._program = program
    self.events = []

  def __getattr__(self, name):
    return getattr(self._program, name)

  def __call__(self, state, chunk, num_steps):
    t0 = time.perf_counter()
    state, out = self._program(state, chunk, num_steps)
    ev = {"dispatch": t0, "returned": time.perf_counter()}
    self.events.append(ev)

    def wait():  # off the loop's thread, so the loop is not slowed down
      out.step.block_until_ready()
      ev["ready"] = time.perf_counter()

    threading.Thread(target=wait).start()
    return state, out


def record(k, num_steps):
  loop = loopkit.TrainLoop(step, iterations_per_loop=k, hooks=[loopkit.Hook(every_steps=12)])
  traced = loop.program = TracedProgram(loop.program)
  loop.run(init(), batches(num_steps), num_steps=num_steps)  # first run compiles
  traced.events.clear()
  state = loop.run(init(), batches(num_steps), num_steps=num_steps)
  jax.block_until_ready(state)
  while any("ready" not in ev for ev in traced.events):
    time.sleep(0.01)
  return traced.events


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "_static",
                                                    "timeline.png"))
  parser.add_argument("--num_steps", type=int, default=48)
  args = parser.parse_args()
  fig, axes = plt.subplots(2, 1, figsize=(10, 3.6), sharex=True)
  for ax, k in zip(axes, [1, 8]):
    events = record(k, args.num_steps)
    t0 = events[0]["dispatch"]
    prev_ready = None
    for i, ev in enumerate(events):
      start = max(ev["returned"], prev_ready or ev["returned"])
      ax.broken_barh([(1e3 * (start - t0), 1e3 * (ev["ready"] - start))], (0.55, 0.35),
                     color="tab:blue" if i % 2 == 0 else "tab:cyan")
      ax.broken_barh([(1e3 * (ev["dispatch"] - t0), 1e3 * (ev["returned"] - ev["dispatch"]))],
                     (0.1, 0.35), color="tab:orange")
      prev_ready = ev["ready"]
    total = 1e3 * (events[-1]["ready"] - t0)
    ax.set_yticks([0.275, 0.725], ["host dispatch", "device call"])
    ax.set_title(f"iterations_per_loop={k}: {len(events)} device calls, "
                 f"{args.num_steps} steps in {total:.0f} ms", fontsize=9, loc="left")
    print(f"K={k}: calls={len(events)} wall_ms={total:.1f}")
  axes[-1].set_xlabel("time since first dispatch (ms)")
  fig.suptitle("loopkit timeline: MLP, global batch 256, 8 fake CPU devices "
               "(hook every 12 steps cuts K=8 calls into 8+4)", fontsize=9)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  fig.savefig(args.out, dpi=120)
  print("wrote", os.path.abspath(args.out))


if __name__ == "__main__":
  main()
