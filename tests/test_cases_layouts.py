"""Cases C60, C61, C63 and C64 from shared/cases/CASES.md ("Found by trying loopkit 0.2.0"): a
layout the loop can know from what it is given is refused before step 1, naming both sides: a
model-parallel state on another mesh than the loop's, ``prefetch_to_device`` batches, a source's
own epoch length, and a resume with another batch size."""

import logging
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import loopkit
from loopkit._internal.mesh import pinned_state_shardings
from tests import toy

AUTO3 = (jax.sharding.AxisType.Auto,) * 3
RULES = (("embed", "fsdp"), ("mlp", "tensor"))  # logical axis -> mesh axis (lm1b's form)


def _mesh3(devices=None):
  """A (2, 2, 2) mesh ('data', 'fsdp', 'tensor') over the 8 fake CPU devices, Auto axes."""
  return jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=AUTO3,
                       devices=jax.devices() if devices is None else devices)


def _mlp_and_step():
  """A Flax linen MLP whose kernels and biases carry logical partitioning (lm1b's way), an
  optax Adam train step over a dict state, and the state's init."""
  import flax.linen as nn

  def part(init, axes):
    return nn.with_logical_partitioning(init, axes)

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Dense(16, kernel_init=part(nn.initializers.lecun_normal(), ("embed", "mlp")),
                   bias_init=part(nn.initializers.zeros, ("mlp",)))(x)
      return nn.Dense(4, kernel_init=part(nn.initializers.lecun_normal(), ("mlp", "embed")),
                      bias_init=part(nn.initializers.zeros, ("embed",)))(nn.relu(x))

  model, tx = MLP(), optax.adam(1e-2)

  def init(key):
    params = model.init(key, jnp.zeros((1, 8)))["params"]
    return {"params": params, "opt": tx.init(params), "step": jnp.zeros((), jnp.int32)}

  def step(state, batch):
    def loss_fn(p):
      return jnp.mean((model.apply({"params": p}, batch["x"]) - batch["y"]) ** 2)
    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    updates, opt = tx.update(grads, state["opt"], state["params"])
    return ({"params": optax.apply_updates(state["params"], updates), "opt": opt,
             "step": state["step"] + 1}, {"loss": loss})

  return nn, init, step


def _sharded_state(mesh):
  """The MLP's state initialised straight onto ``mesh`` with the shardings its logical axes say
  (nn.get_partition_spec + nn.logical_to_mesh_sharding under jit, as Flax's lm1b does)."""
  nn, init, step = _mlp_and_step()
  abstract = jax.eval_shape(init, jax.random.key(0))
  shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, RULES)
  state = nn.meta.unbox(jax.jit(init, out_shardings=shardings)(jax.random.key(0)))
  return state, step


def _regression_data(n=64):
  rng = np.random.default_rng(0)
  return {"x": rng.normal(size=(n, 8)).astype(np.float32),
          "y": rng.normal(size=(n, 4)).astype(np.float32)}


def _on_axis(state, axis):
  return [x for x in jax.tree.leaves(state) if axis in jax.tree.leaves(tuple(x.sharding.spec))]


# -- C60: a model-parallel state on the wrong mesh ------------------------------------------

LOOP_MESHES = {  # the loop's mesh against the state's (2, 2, 2) one -> how the error names it
    "none_given": (lambda: None, r"the loop's mesh is \{'data': 8\} over devices 0-7 \(the "
                                 r"default of a TrainLoop built without mesh=\)"),
    "other_axes": (lambda: jax.make_mesh((4, 2), ("data", "model"), axis_types=AUTO3[:2]),
                   r"the loop's mesh is \{'data': 4, 'model': 2\} over devices 0-7: "),
    "other_devices": (lambda: _mesh3(jax.devices()[::-1]),
                      r"the loop's mesh is \{'data': 2, 'fsdp': 2, 'tensor': 2\} over devices "
                      r"7, 6, 5, 4, 3, 2, 1, 0: "),
}


@pytest.mark.parametrize("loop_mesh", sorted(LOOP_MESHES))
def test_c60_a_state_sharded_on_another_mesh_is_refused_before_step_1(loop_mesh):
  pytest.importorskip("flax")
  make_mesh, names_loop_mesh = LOOP_MESHES[loop_mesh]
  state, step = _sharded_state(_mesh3())
  assert len(_on_axis(state, "tensor")) == 9 and len(_on_axis(state, "fsdp")) == 9  # sharded
  loop = loopkit.TrainLoop(step, iterations_per_loop=2, mesh=make_mesh())
  with pytest.raises(ValueError) as error:
    loop.run(state, loopkit.ArraySource(_regression_data(), 8), num_steps=4)
  message = str(error.value)
  # The first sharded leaf (path and spec), its mesh, the loop's mesh, the count, and mesh=.
  assert message.startswith(
      "state leaf opt/0/mu/Dense_0/bias (shape (16,)) is sharded as "
      f"{P('tensor')} on the mesh {{'data': 2, 'fsdp': 2, 'tensor': 2}} over devices 0-7, but "
  ), message
  assert re.search(names_loop_mesh, message), message
  assert ("the loop would replicate it (12 of 14 state leaves would lose their sharding). Build "
          "the loop on the state's mesh: TrainLoop(..., mesh=<that mesh>") in message
  assert loop.ledger is None and loop.program.compile_count() == 0  # refused before step 1
  assert not any(x.is_deleted() for x in jax.tree.leaves(state))  # not donated


@pytest.mark.parametrize("k", [1, 3])
def test_c60_on_the_state_mesh_every_sharding_is_kept_across_the_run(k):
  pytest.importorskip("flax")
  mesh = _mesh3()
  state, step = _sharded_state(mesh)
  before = jax.tree.map(lambda x: x.sharding, state)
  loop = loopkit.TrainLoop(step, iterations_per_loop=k, mesh=mesh)
  out = loop.run(state, loopkit.ArraySource(_regression_data(), 8), num_steps=4)
  assert int(out["step"]) == 4 and loop.status == "completed"
  after = jax.tree.map(lambda x: x.sharding, out)
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(before)[0], jax.tree.leaves(after)):
    assert a == b, (jax.tree_util.keystr(path), a, b)  # leaf by leaf, 'tensor' and 'fsdp' kept
  assert len(_on_axis(out, "tensor")) == 9 and loop.program.compile_count() == 1


def test_c60_leaves_sharded_on_two_meshes_are_refused_naming_both():
  mesh, other = _mesh3(), jax.make_mesh((4, 2), ("data", "model"), axis_types=AUTO3[:2])
  state = toy.init_state()
  state["params"]["w"] = jax.device_put(state["params"]["w"], NamedSharding(mesh, P("fsdp")))
  state["params"]["b"] = jax.device_put(state["params"]["b"], NamedSharding(other, P("model")))
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=2, mesh=mesh)
  with pytest.raises(ValueError, match=(
      r"state leaf params/b \(shape \(2,\)\) is sharded as .* on the mesh \{'data': "
      r"4, 'model': 2\} over devices 0-7, but the loop's mesh is \{'data': 2, 'fsdp': 2, "
      r"'tensor': 2\} over devices 0-7: the loop would replicate it \(1 of 8 state leaves would "
      r"lose their sharding\)\. The state's sharded leaves are on 2 meshes \(params/b"
      r" on \{'data': 4, 'model': 2\} .*; params/w on \{'data': 2, 'fsdp': 2, "
      r"'tensor': 2\} .*\): put every leaf on one mesh")):
    loop.run(state, toy.batches(4), num_steps=4)


def test_c60_a_sharded_state_in_per_device_style_is_refused():
  mesh = loopkit.data_parallel_mesh(devices=jax.devices()[:2])
  state = toy.init_state()
  state["params"]["w"] = jax.device_put(state["params"]["w"], NamedSharding(mesh, P("data")))
  loop = loopkit.TrainLoop(toy.make_per_device_step(), iterations_per_loop=2, mesh=mesh,
                           step_style="per_device")
  with pytest.raises(ValueError, match=r"state leaf params/w \(shape \(4, 2\)\) is "
                     r"sharded as .* on the mesh \{'data': 2\} over devices 0-1, but "
                     r"step_style='per_device' keeps the state replicated .*use "
                     r"step_style='global' for a sharded state"):
    loop.run(state, toy.batches(4), num_steps=4)


def test_c60_a_state_replicated_by_flax_for_pmap_is_refused_with_the_pmap_hint():
  jax_utils = pytest.importorskip("flax.jax_utils")
  state = jax_utils.replicate(toy.init_state())
  loop = loopkit.TrainLoop(toy.make_per_device_step(), iterations_per_loop=2,
                           step_style="per_device")
  with pytest.raises(ValueError, match=r"state leaf opt/0/count \(shape \(8,\)\) is "
                     r"sharded as .*: the loop would replicate it \(8 of 8 .*leading axis is a "
                     r"device axis.*flax\.jax_utils\.replicate.*jax_utils\.unreplicate"):
    loop.run(state, toy.batches(4), num_steps=4)


def test_c60_what_loses_nothing_is_placed_on_the_loop_mesh():
  """Unsharded, single-device, replicated-elsewhere leaves are replicated on the loop's mesh; a
  leaf on a mesh that places alike (other axis types) keeps its spec on the loop's mesh."""
  mesh = _mesh3()
  explicit = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"),
                           axis_types=(jax.sharding.AxisType.Explicit,) * 3)
  four = jax.make_mesh((4,), ("data",), devices=jax.devices()[4:])
  x = np.zeros((4, 4), np.float32)
  state = {"numpy": x, "plain": jnp.asarray(x), "one_device": jax.device_put(x, jax.devices()[5]),
           "replicated_on_4": jax.device_put(x, NamedSharding(four, P())),
           "explicit": jax.device_put(x, NamedSharding(explicit, P("fsdp", "tensor"))),
           "kept": jax.device_put(x, NamedSharding(mesh, P(None, "tensor")))}
  got = pinned_state_shardings(state, mesh)
  assert {k: (v.mesh == mesh, v.spec) for k, v in got.items()} == {
      "numpy": (True, P()), "plain": (True, P()), "one_device": (True, P()),
      "replicated_on_4": (True, P()), "explicit": (True, P("fsdp", "tensor")),
      "kept": (True, P(None, "tensor"))}
  assert got["kept"] is state["kept"].sharding


# -- C61: prefetch_to_device output without global_batch_size= ------------------------------

D, B = 8, 16  # devices (all of them, as Flax's ImageNet example), global batch


def _image_batches(n):
  rng = np.random.default_rng(0)
  return [{"image": rng.normal(size=(B, 4, 4, 3)).astype(np.float32),
           "label": rng.integers(0, 10, size=(B,)).astype(np.int32)} for _ in range(n)]


def _create_input_iter(batches):
  """Flax ImageNet's create_input_iter: reshape to [devices, B / devices, ...], then
  flax.jax_utils.prefetch_to_device(it, 2)."""
  from flax import jax_utils
  shard = lambda b: jax.tree.map(lambda x: x.reshape((D, -1) + x.shape[1:]), b)
  return jax_utils.prefetch_to_device(map(shard, batches), 2)


def _image_step(state, batch):
  loss = jnp.mean(batch["image"]) * state["w"] + jnp.mean(batch["label"].astype(jnp.float32))
  return {"w": state["w"] * 0.5, "step": state["step"] + 1}, {"loss": loss}


def _image_state():
  return {"w": jnp.ones(()), "step": jnp.zeros((), jnp.int32)}


@pytest.mark.parametrize("k", [1, 3])
def test_c61_prefetch_to_device_batches_are_refused_without_global_batch_size(k):
  pytest.importorskip("flax")
  loop = loopkit.TrainLoop(_image_step, iterations_per_loop=k)
  state = _image_state()
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # refused, not warned about
    with pytest.raises(ValueError) as error:
      loop.run(state, _create_input_iter(_image_batches(6)), num_steps=6)
  assert str(error.value) == (
      "batch leaf image is a jax.Array of shape (8, 2, 4, 4, 3) already on the devices with "
      "a leading device axis: its 8 rows lie one per device, the layout that "
      "flax.jax_utils.prefetch_to_device (or jax.device_put_sharded) makes for jax.pmap from "
      "batches reshaped to [devices, B / devices, ...]; loopkit would take each device's slice "
      "[2, 4, 4, 3] as one example. Pass numpy batches [B, ...] (drop prefetch_to_device and "
      "the reshape to [devices, B / devices, ...]): loopkit places them on the devices itself "
      "and prefetches (TrainLoop(prefetch=...)); if each row really is one example of a global "
      "batch of 8, pass global_batch_size=8")
  assert loop.ledger.step == 0 and loop.program.compile_count() == 0
  assert not any(x.is_deleted() for x in jax.tree.leaves(state))
  # The batches before the reshape and prefetch_to_device train.
  loop.run(state, _image_batches(6), num_steps=6)
  assert loop.ledger.step == 6 and loop.ledger.examples_seen == 6 * B


def test_c61_a_global_batch_of_one_example_per_device_takes_global_batch_size():
  """What the message offers for the other reading of the layout: a global batch [8, ...]
  placed on the data axis (one example per device) is refused without global_batch_size=8 and
  trains with it."""
  mesh = loopkit.data_parallel_mesh()
  placed = [jax.device_put({k: v[:D] for k, v in b.items()}, NamedSharding(mesh, P("data")))
            for b in _image_batches(3)]
  with pytest.raises(ValueError, match=r"batch leaf image is a jax\.Array of shape "
                     r"\(8, 4, 4, 3\) .*pass global_batch_size=8$"):
    loopkit.TrainLoop(_image_step, iterations_per_loop=2).run(_image_state(), placed,
                                                             num_steps=3)
  loop = loopkit.TrainLoop(_image_step, iterations_per_loop=2, global_batch_size=D)
  loop.run(_image_state(), placed, num_steps=3)
  assert loop.ledger.step == 3 and loop.ledger.examples_seen == 3 * D


def test_c61_the_evaluator_refuses_prefetch_to_device_batches_too():
  pytest.importorskip("flax")

  def eval_step(state, batch):
    return {"x": jnp.mean(batch["image"], axis=(1, 2, 3))}

  with pytest.raises(ValueError, match=r"batch leaf image is a jax\.Array of shape "
                     r"\(8, 2, 4, 4, 3\) already on the devices .*Pass numpy batches"):
    loopkit.Evaluator(eval_step).evaluate(_image_state(), list(_create_input_iter(
        _image_batches(2))))
  result = loopkit.Evaluator(eval_step).evaluate(_image_state(), _image_batches(2))
  assert result.num_examples == 2 * B


# -- C63: two epoch lengths -----------------------------------------------------------------

N63 = 240  # examples: 15 steps of 16


def _epoch_sources():
  data = {"x": np.random.default_rng(1).normal(size=(N63, 4)).astype(np.float32),
          "y": np.zeros((N63, 2), np.float32)}
  out = {"ArraySource": lambda: loopkit.ArraySource(data, B, seed=0)}
  try:
    import grain  # noqa: F401
  except ImportError:
    pass
  else:
    records = [{"x": data["x"][i], "y": data["y"][i]} for i in range(N63)]
    out["GrainSource"] = lambda: loopkit.data.GrainSource(records, B, seed=0)
  return out


@pytest.mark.parametrize("kind", ["ArraySource", "GrainSource", "DeviceDataset"])
def test_c63_a_loop_epoch_other_than_the_source_epoch_is_refused(kind):
  if kind == "DeviceDataset":
    mesh = loopkit.data_parallel_mesh()
    ds = loopkit.data.DeviceDataset({"x": np.zeros((N63, 4), np.float32),
                                     "y": np.zeros((N63, 2), np.float32)}, B, mesh=mesh)
    source, step, state = ds, ds.wrap_step(toy.make_global_step()), ds.attach(toy.init_state())
  else:
    if kind not in _epoch_sources():
      pytest.skip("grain is not installed")
    source, step, state = _epoch_sources()[kind](), toy.make_global_step(), toy.init_state()
  assert source.steps_per_epoch == 15
  loop = loopkit.TrainLoop(step, iterations_per_loop=4, steps_per_epoch=20)
  with pytest.raises(ValueError) as error:
    loop.run(state, source, num_steps=30)
  assert str(error.value) == (
      f"TrainLoop(steps_per_epoch=20), but the {kind} given to run has an epoch of 15 steps "
      "(240 examples // global batch 16): the loop's epochs (LoopInfo.epoch, every_epochs "
      "hooks, num_epochs) would not end where the source's do. Pass steps_per_epoch=15, or "
      "steps_per_epoch='auto' to take the source's")
  assert loop.ledger is None  # before anything ran


def test_c63_with_the_source_epoch_step_20_is_in_epoch_1():
  rows = []
  hook = loopkit.CallbackHook(lambda info, state: rows.append((info.end_step, info.epoch,
                                                               info.step_in_epoch)),
                              needs_state=False, at_steps=[15, 20])
  for steps_per_epoch in (15, "auto"):
    rows.clear()
    loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4, hooks=[hook],
                             steps_per_epoch=steps_per_epoch)
    loop.run(toy.init_state(), _epoch_sources()["ArraySource"](), num_steps=20)
    assert rows == [(15, 0, 15), (20, 1, 5)]  # steps_per_epoch=20 said (20, 0, 20)


def test_c63_a_stream_declares_no_epoch_and_is_not_checked():
  batches = [{"x": np.ones((B, 4), np.float32), "y": np.ones((B, 2), np.float32)}] * 40
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4, steps_per_epoch=20)
  loop.run(toy.init_state(), batches, num_steps=40)  # a list of two 20-step epochs
  assert loop.ledger.step == 40 and (loop.ledger.epoch, loop.ledger.step_in_epoch) == (1, 20)


# -- C64: a resume with another batch size --------------------------------------------------


def _resume_sources(kind, batch):
  n = 256
  data = {"x": np.random.default_rng(2).normal(size=(n, 4)).astype(np.float32),
          "y": np.zeros((n, 2), np.float32)}
  if kind == "ArraySource":
    return loopkit.ArraySource(data, batch, seed=3), toy.make_global_step(), toy.init_state()
  if kind == "GrainSource":
    pytest.importorskip("grain")
    records = [{"x": data["x"][i], "y": data["y"][i]} for i in range(n)]
    return loopkit.data.GrainSource(records, batch, seed=3), toy.make_global_step(), \
        toy.init_state()
  ds = loopkit.data.DeviceDataset(data, batch, mesh=loopkit.data_parallel_mesh(), seed=3)
  return ds, ds.wrap_step(toy.make_global_step()), ds.attach(toy.init_state())


@pytest.mark.parametrize("kind", ["ArraySource", "GrainSource", "DeviceDataset"])
def test_c64_a_resume_with_another_batch_size_is_refused_naming_both(kind, tmp_path):
  pytest.importorskip("orbax.checkpoint")
  from loopkit.checkpoint import CheckpointHook

  source, step, state = _resume_sources(kind, 64)
  hook = CheckpointHook(tmp_path, async_save=False)
  loopkit.TrainLoop(step, iterations_per_loop=2, hooks=[hook]).run(state, source, num_steps=4)
  hook.close()
  key = {"ArraySource": "array_step", "GrainSource": "grain_step",
         "DeviceDataset": "device_data_step"}[kind]
  examples = "num_records" if kind == "GrainSource" else "num_examples"

  source, step, state = _resume_sources(kind, 32)
  hook = CheckpointHook(tmp_path, async_save=False)
  loop = loopkit.TrainLoop(step, iterations_per_loop=2, hooks=[hook])
  with pytest.raises(ValueError) as error:
    loop.run(state, source, num_steps=8)
  hook.close()
  saved = {key: 4, "seed": 3, "global_batch_size": 64, examples: 256}
  here = {**saved, "global_batch_size": 32}
  assert str(error.value) == (
      f"the checkpoint's data position has global_batch_size=64 but this {kind} has "
      f"global_batch_size=32 (saved {saved!r}, here {here!r}): step 4's batch would hold other "
      "examples than the saved run's; build the source as the run that saved it did, or start "
      "a new run in another directory")
  assert loop.ledger.step == 4 and loop.program.compile_count() == 0  # restored, not trained

  # The same batch size resumes at step 4.
  source, step, state = _resume_sources(kind, 64)
  hook = CheckpointHook(tmp_path, async_save=False)
  loop = loopkit.TrainLoop(step, iterations_per_loop=2, hooks=[hook])
  loop.run(state, source, num_steps=6)
  hook.close()
  assert loop.ledger.step == 6 and loop.ledger.loop_index == 3  # 2 calls before, 1 after


def test_c64_a_bare_step_of_loopkit_0_2_is_taken_with_a_warning(caplog):
  source = loopkit.ArraySource({"x": np.zeros((64, 2), np.float32)}, 16, seed=3)
  with caplog.at_level(logging.WARNING, logger="loopkit"):
    source.check_position(4, 4)
  assert ("the checkpoint's data position is the bare step 4 (saved by loopkit 0.2): this "
          "ArraySource cannot check that the run that saved it had the same global batch size "
          "(16), seed and examples") in caplog.text
  with pytest.raises(ValueError, match=r"data position 3 came from a batch count or the bare "
                     r"step of a step-indexed source .*not from an ArraySource \(whose position "
                     r"here is \{'array_step': 4, "):
    source.check_position(3, 4)
  with pytest.raises(ValueError, match=r"has seed=2, num_examples=65 but this ArraySource has "
                     r"seed=3, num_examples=64 .*step 4's batch would hold other examples"):
    source.check_position({**source.position_at(4), "seed": 2, "num_examples": 65}, 4)
