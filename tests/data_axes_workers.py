"""A tiny sharded MLP trained with the batch on several mesh axes (tests/test_data_axes.py).

Run in the test process (1 process x 8 devices) and in the children of
:func:`loopkit.tools.testing.run_processes` (2 processes x 4 devices), so that the two can be
compared. Functions return plain picklable values.

The model's leaves are sharded on the ``fsdp`` and ``tensor`` axes of a
``("data", "fsdp", "tensor")`` mesh (``w1`` ``P("fsdp", "tensor")``, ``w2`` ``P("tensor",
"fsdp")``, ``b1`` ``P("tensor")``), the batch on ``("data", "fsdp")``: the layout of FSDP +
tensor-parallel training (MaxText's default batch axes). The state also keeps the last step's
example ids with the batch's own sharding, so the devices' shards say which examples each
device trained on.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import loopkit
from loopkit.data import sources

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")
GLOBAL_BATCH = 16
NUM_EXAMPLES = 96  # 6 steps per epoch
LR, MOMENTUM = 0.1, 0.9
SHARDINGS = {"w1": P("fsdp", "tensor"), "b1": P("tensor"), "w2": P("tensor", "fsdp")}


def make_mesh(shape=(2, 2, 2)) -> jax.sharding.Mesh:
  """``jax.make_mesh(shape, ("data", "fsdp", "tensor"))`` over all devices, ``Auto`` axes
  (GSPMD propagation, as Flax's lm1b and MaxText run)."""
  return jax.make_mesh(shape, AXES, devices=jax.devices(),
                       axis_types=(jax.sharding.AxisType.Auto,) * len(AXES))


def dataset(num_examples: int = NUM_EXAMPLES) -> dict[str, np.ndarray]:
  """Regression data with an example id per row (the same on every process)."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(num_examples, 8)).astype(np.float32)
  w = rng.normal(size=(8, 4)).astype(np.float32)
  return {"x": x, "y": np.tanh(x @ w).astype(np.float32),
          "id": np.arange(num_examples, dtype=np.int32)}


def init_state(mesh, *, sharded: bool = True, batch_axis=BATCH_AXES, seed: int = 0) -> dict:
  """Params and momentum sharded on ``fsdp``/``tensor`` (replicated with ``sharded=False``),
  the step, and ``ids`` ``[B]`` int32 with the batch's sharding (``P(batch_axis)``)."""
  k1, k2 = jax.random.split(jax.random.key(seed))
  params = {"w1": jax.random.normal(k1, (8, 16)) * 0.3, "b1": jnp.zeros((16,)),
            "w2": jax.random.normal(k2, (16, 4)) * 0.3}
  spec = lambda name: SHARDINGS[name] if sharded else P()
  params = {k: jax.device_put(v, NamedSharding(mesh, spec(k))) for k, v in params.items()}
  ids_spec = P(batch_axis) if sharded else P()
  return {"params": params, "mom": jax.tree.map(jnp.zeros_like, params),
          "step": jnp.zeros((), jnp.int32),
          "ids": jax.device_put(np.full((GLOBAL_BATCH,), -1, np.int32),
                                NamedSharding(mesh, ids_spec))}


def loss_fn(params, batch):
  h = jax.nn.relu(batch["x"] @ params["w1"] + params["b1"])
  return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


def _update(state, grads, ids):
  mom = jax.tree.map(lambda m, g: MOMENTUM * m + g, state["mom"], grads)
  params = jax.tree.map(lambda p, m: p - LR * m, state["params"], mom)
  return {"params": params, "mom": mom, "step": state["step"] + 1, "ids": ids}


def global_step(state, batch):
  """The step on global arrays (``step_style="global"``): XLA partitions it."""
  loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
  return _update(state, grads, batch["id"]), {"loss": loss}


def make_per_device_step(axis=BATCH_AXES):
  """The pmap-style step: each device's rows, gradients averaged over ``axis`` (a tuple)."""
  def step(state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
    grads = jax.lax.pmean(grads, axis)
    # ids: the first row of each device's slice, summed, the same on every device
    first = jax.lax.psum(batch["id"][0], axis)
    return _update(state, grads, jnp.full_like(state["ids"], first)), {
        "loss": jax.lax.pmean(loss, axis)}
  return step


def host(x: jax.Array) -> np.ndarray:
  """A leaf's global value on this process (replicated leaves only when not addressable)."""
  if not x.is_fully_addressable:
    if x.is_fully_replicated:
      return np.asarray(x.addressable_data(0))
    return None  # type: ignore[return-value]  # the caller gathers the shards
  return np.asarray(x)


def shards(x: jax.Array) -> dict[int, list]:
  """``{device: this device's shard as a list}`` of this process's devices, a device named by
  its place in ``jax.devices()`` (0-7 on 1 x 8 and on 2 x 4, whose ids are not)."""
  place = {d: i for i, d in enumerate(jax.devices())}
  return {place[s.device]: np.asarray(s.data).tolist() for s in x.addressable_shards}


def train(num_steps: int, iterations_per_loop: int, *, mesh_shape=(2, 2, 2),
          data_axis=BATCH_AXES, style: str = "global", hooks=(), state=None) -> dict:
  """Trains on :class:`loopkit.ArraySource` batches; returns shards, losses and the run's facts.

  Returns:
    ``params``/``mom``: ``{leaf: {device: shard}}`` of this process's devices (:func:`shards`);
    ``specs``: each param's ``PartitionSpec`` after the run; ``ids``: ``{device: the last
    step's example ids on that device}``; ``losses``: per step; ``step``, ``compiles``.
  """
  mesh = make_mesh(mesh_shape)
  sharded = style == "global"
  src = sources.ArraySource(dataset(), GLOBAL_BATCH, seed=5)
  losses: list[float] = []
  record = loopkit.CallbackHook(lambda info, _: losses.extend(info.traces["loss"].tolist()),
                                needs_state=False)
  step = global_step if style == "global" else make_per_device_step(data_axis)
  loop = loopkit.TrainLoop(step, iterations_per_loop=iterations_per_loop, mesh=mesh,
                           data_axis=data_axis, step_style=style, hooks=[record, *hooks],
                           steps_per_epoch=src.steps_per_epoch)
  init = state if state is not None else init_state(mesh, sharded=sharded, batch_axis=data_axis)
  out = loop.run(init, src, num_steps=num_steps)
  return {"params": {k: shards(v) for k, v in out["params"].items()},
          "mom": {k: shards(v) for k, v in out["mom"].items()},
          "specs": {k: tuple(v.sharding.spec) for k, v in out["params"].items()},
          "ids": shards(out["ids"]), "losses": losses, "step": loop.ledger.step,
          "state_step": int(host(out["step"])), "compiles": loop.program.compile_count(),
          "process_count": jax.process_count(), "device_count": jax.device_count()}


def train_ks(ks, num_steps: int = 7) -> list[dict]:
  """:func:`train` for each K in ``ks`` (one launch for several runs)."""
  return [train(num_steps, k) for k in ks]


def evaluate(num_examples: int = 21, global_batch: int = 8) -> dict:
  """An exact evaluation with the batch on ``("data", "fsdp")``: per-example ``id`` and
  ``2 * id`` summed, short and padded batches masked."""
  mesh = make_mesh()
  data = {"id": np.arange(num_examples, dtype=np.float32)}
  mine = sources.shard_for_process(data)
  num_batches = sources.eval_batches_per_process(num_examples, global_batch)
  state = jax.device_put(np.float32(2.0), NamedSharding(mesh, P()))
  evaluator = loopkit.Evaluator(lambda s, b: {"id": b["id"], "scaled": s * b["id"]},
                                iterations_per_loop=2, mesh=mesh, data_axis=BATCH_AXES,
                                global_batch_size=global_batch)
  local = global_batch // jax.process_count()
  r = evaluator.evaluate(state, sources.batch_arrays(mine, local, num_batches=num_batches),
                         num_batches=num_batches)
  return {"totals": r.totals, "metrics": r.metrics, "num_examples": r.num_examples,
          "num_batches": r.num_batches}


def two_process_run() -> dict:
  """What the 2-process test compares with 1 process: K = 1 and K = 3 runs, an evaluation."""
  return {"runs": train_ks((1, 3)), "eval": evaluate()}
