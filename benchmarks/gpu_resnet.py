"""The ResNet variants of the accelerator run (``benchmarks/gpu.py``), measured in a worker:
the per-step ``jit`` loop, ``TrainLoop`` at K from the host pool, and the limit (loopkit's
program on a chunk already on the device); and :class:`BoundaryClock`, the hook that times a
run's steady state.

Stdlib only at import (JAX, loopkit and the ResNet example are imported where they run).
"""

from __future__ import annotations

import itertools
import time
from typing import Any

from benchmarks import runner
from benchmarks.gpu_plan import Plan, timed_steps, variant_k


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
    state, secs, cpu = runner.timed_run(lambda: train(state, n))
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
    state, secs, cpu = runner.timed_run(lambda: jax.block_until_ready(
        loop.run(state, self.source(n), num_steps=plan.warm_steps + n)))
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

    def back_to_back(state):
      pending = None
      for _ in range(calls):
        state, out = program(state, chunk, n_full)
        if pending is not None:
          jax.device_get(pending.step)  # fetched one call late, as TrainLoop does
        pending = out
      return jax.device_get(pending)

    last, secs, cpu = runner.timed_run(lambda: back_to_back(state))
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
