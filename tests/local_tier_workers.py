"""Process targets for tests/test_checkpoint_local_tier.py (run under ``jax.distributed``).

:func:`train_tiers` trains the toy model with a :class:`~loopkit.checkpoint.LocalCheckpointHook`
(local tier in ``<local_root>``, one directory per process, persistent tier in
``persistent``) and resumes from whatever the tiers hold. Each process writes
``<marker>/saved_<process>_<step>`` when a local save has started, so the test can kill the
processes once the run is under way. Not a test module itself.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import loopkit
from loopkit.checkpoint import CheckpointHook, LocalCheckpointHook
from loopkit.data import sources
from tests import multihost_workers, toy


def state_on(mesh, layout: str):
  """The toy state plus a key's uint32 data and a bfloat16 leaf; ``w`` (``[4, 2]``) replicated on
  every process (``"replicated"``) or split over the processes (``"sharded"``)."""
  state = toy.init_state()
  state["rng"] = jax.random.key_data(jax.random.key(7))  # uint32 [2]
  state["half"] = jnp.ones((3,), jnp.bfloat16)
  if layout == "sharded":  # the other leaves: the loop replicates them
    w = np.asarray(state["params"]["w"])
    state["params"]["w"] = jax.make_array_from_callback(
        w.shape, NamedSharding(mesh, P("data")), lambda idx: w[idx])
    state["opt"] = toy.TX.init(state["params"])  # Adam's moments of w sharded alike
  return state


def step_fn():
  inner = toy.make_global_step()

  def step(state, batch):
    rest = {k: state[k] for k in ("params", "opt", "step")}
    new, metrics = inner(rest, batch)
    # the key depends on the step only
    key = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), state["step"])
    half = state["half"] + jax.random.uniform(key, (3,)).astype(jnp.bfloat16)
    return {**new, "rng": state["rng"], "half": half}, metrics

  return step


def digest(state) -> str:
  h = hashlib.sha256()
  for x in jax.tree.leaves(state):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    h.update(np.ascontiguousarray(np.asarray(jax.device_get(
        multihost_workers.host_value(x) if x.is_fully_replicated else
        _gathered(x)))).tobytes())
  return h.hexdigest()


def _gathered(x):
  from jax.experimental import multihost_utils
  return multihost_utils.process_allgather(x, tiled=True)


class Slow:
  """An ArraySource that sleeps ``sleep_s`` per batch (the kill lands inside training)."""

  def __init__(self, src, sleep_s):
    self.src, self.sleep_s, self.steps_per_epoch = src, sleep_s, src.steps_per_epoch

  def batch_at(self, step):
    time.sleep(self.sleep_s)
    return self.src.batch_at(step)


class Marking(LocalCheckpointHook):
  marker: Path | None = None

  def save_local(self, step, state, **kw):
    saved = super().save_local(step, state, **kw)
    if self.marker is not None:
      self.wait_until_finished()  # committed here before the test may kill
      (self.marker / f"saved_{jax.process_index()}_{step}").touch()
    return saved


def _loop(k, hooks, mesh, src):
  return loopkit.TrainLoop(step_fn(), iterations_per_loop=k, hooks=hooks, mesh=mesh,
                           steps_per_epoch=src.steps_per_epoch)


def train_tiers(local_root: str, persistent: str, k: int, num_steps: int, *,
                layout: str = "replicated", local_every_steps: int = 3,
                persistent_every_steps: int = 10, sleep_s: float = 0.0,
                marker: str | None = None, reference: bool = False) -> dict:
  """Trains to ``num_steps`` with both tiers, resuming from them; see the module."""
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  src = sources.ArraySource(multihost_workers.dataset(), multihost_workers.GLOBAL_BATCH, seed=3)
  hook = Marking(local_root, CheckpointHook(persistent, every_steps=persistent_every_steps),
                 every_steps=local_every_steps)
  hook.marker = None if marker is None else Path(marker)
  loop = _loop(k, [hook], mesh, Slow(src, sleep_s))
  own_before = hook.local_steps()  # this process's committed local steps at the restart
  persistent_before = hook.persistent.all_steps()
  final = loop.run(state_on(mesh, layout), Slow(src, sleep_s), num_steps=num_steps)
  out = {"process": jax.process_index(), "status": loop.status, "step": loop.ledger.step,
         "own_before": own_before, "persistent_before": persistent_before,
         "restored_step": hook.restored_step, "restored_from": hook.restored_from,
         "local_saved": list(hook.saved_steps),
         "persistent_saved": list(hook.persistent.saved_steps),
         "digest": digest(final), "compiles": loop.program.compile_count()}
  if reference:  # the uninterrupted run, in the same processes
    ref = _loop(k, [], mesh, src).run(state_on(mesh, layout), src, num_steps=num_steps)
    out["reference"] = digest(ref)
  return out
