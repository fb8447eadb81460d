"""Device-resident dataset: permutation, gather, TrainLoop integration, resume, no embedding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import loopkit
from loopkit.data.device_data import DeviceDataset, DeviceDataState, _permute, _seed32
from tests.toy import SetPosition

N, B = 100, 16  # steps_per_epoch = 6, 4 examples dropped per epoch


@pytest.mark.parametrize("n", [1, 2, 5, 17, 1000, 4097])
def test_permutation_is_a_bijection_on_host_and_device(n):
  epochs = np.repeat([0, 1, 7], n)
  pos = np.tile(np.arange(n), 3)
  host = _permute(pos, epochs, n=n, seed32=_seed32(5), xp=np).reshape(3, n)
  for perm in host:
    assert sorted(perm.tolist()) == list(range(n))
  device = jax.jit(lambda p, e: _permute(p, e, n=n, seed32=_seed32(5), xp=jnp))(
      jnp.asarray(pos, jnp.int32), jnp.asarray(epochs, jnp.int32))
  np.testing.assert_array_equal(np.asarray(device).reshape(3, n), host)  # bit-identical


def _dataset(mesh, style="global", seed=3, **kw):
  data = {"x": np.arange(N, dtype=np.int32), "f": np.arange(N, dtype=np.float32) / 7}
  return DeviceDataset(data, B, mesh=mesh, seed=seed, step_style=style, **kw)


def test_shuffle_reproducible_per_epoch_and_seed():
  mesh = jax.make_mesh((8,), ("data",))
  a, b = _dataset(mesh), _dataset(mesh)
  np.testing.assert_array_equal(a.epoch_permutation(0), b.epoch_permutation(0))
  assert not np.array_equal(a.epoch_permutation(0), a.epoch_permutation(1))
  assert not np.array_equal(a.epoch_permutation(0), _dataset(mesh, seed=4).epoch_permutation(0))
  assert not np.array_equal(a.epoch_permutation(0), np.arange(N))
  np.testing.assert_array_equal(_dataset(mesh, shuffle=False).epoch_permutation(2), np.arange(N))
  # within an epoch every example appears at most once (N % B dropped)
  ep1 = np.concatenate([a.example_indices(s) for s in range(6, 12)])
  assert len(set(ep1.tolist())) == 6 * B


def _record_step(mesh, style):
  """A step that records the example ids it saw and folds the features into a float."""
  repl = NamedSharding(mesh, P())

  def step(state, batch):
    x, f = batch["x"], batch["f"]
    if style == "per_device":
      x, f = (jax.lax.all_gather(v, "data", tiled=True) for v in (x, f))
    else:
      x, f = (jax.sharding.reshard(v, repl) for v in (x, f))
    seen = state["seen"].at[state["step"]].set(x)
    acc = state["acc"] * 0.5 + jnp.sum(f * jnp.arange(B, dtype=jnp.float32))
    return ({"step": state["step"] + 1, "seen": seen, "acc": acc},
            {"x": jnp.mean(x.astype(jnp.float32))})

  return step


def _init(steps=20):
  return {"step": jnp.zeros((), jnp.int32), "seen": jnp.full((steps, B), -1, jnp.int32),
          "acc": jnp.zeros((), jnp.float32)}


@pytest.mark.parametrize("style", ["global", "per_device"])
@pytest.mark.parametrize("ndev", [1, 2, 8])
def test_loop_gathers_the_permuted_batches(style, ndev):
  mesh = jax.make_mesh((ndev,), ("data",), devices=jax.devices()[:ndev])
  ds = _dataset(mesh, style)
  loop = loopkit.TrainLoop(ds.wrap_step(_record_step(mesh, style)), iterations_per_loop=4,
                           mesh=mesh, step_style=style, steps_per_epoch=ds.steps_per_epoch)
  out = loop.run(ds.attach(_init()), ds, num_steps=14)
  assert isinstance(out, DeviceDataState) and int(out.step) == 14
  ref = np.stack([ds.example_indices(s) for s in range(14)])
  np.testing.assert_array_equal(np.asarray(out.train_state["seen"])[:14], ref)
  assert loop.program.compile_count() == 1 and loop.program.trace_count == 1
  # the data rode along untouched and stays replicated on the mesh
  np.testing.assert_array_equal(np.asarray(out.data["x"]), np.arange(N))
  assert out.data["x"].sharding.is_equivalent_to(NamedSharding(mesh, P()), 1)


def test_mid_epoch_resume_is_identical():
  mesh = jax.make_mesh((8,), ("data",))
  step = _record_step(mesh, "global")
  ds = _dataset(mesh)
  restore = SetPosition()
  loop = loopkit.TrainLoop(ds.wrap_step(step), iterations_per_loop=4, mesh=mesh,
                           steps_per_epoch=ds.steps_per_epoch, hooks=[restore])
  whole = loop.run(ds.attach(_init()), ds, num_steps=14)
  # 9 steps (mid epoch 1), "checkpoint" the train state, restart with new objects
  part = loop.run(ds.attach(_init()), ds, num_steps=9)
  saved_state, saved_position = jax.device_get(part.train_state), loop.data_position
  assert saved_position == {"device_data_step": 9, "seed": ds.seed,
                            "global_batch_size": ds.global_batch_size,
                            "num_examples": ds.num_examples}
  ds2 = _dataset(mesh)
  restore.position = saved_position
  resumed = loop.run(ds2.attach(saved_state), ds2, num_steps=14)
  for k in ("seen", "acc"):
    np.testing.assert_array_equal(np.asarray(resumed.train_state[k]),
                                  np.asarray(whole.train_state[k]))  # bitwise
  assert loop.program.compile_count() == 1


def test_same_results_for_every_k():
  mesh = jax.make_mesh((8,), ("data",))
  ds = _dataset(mesh)
  outs = []
  for k in (1, 3, 5):
    loop = loopkit.TrainLoop(ds.wrap_step(_record_step(mesh, "global")), iterations_per_loop=k,
                             mesh=mesh, steps_per_epoch=ds.steps_per_epoch)
    outs.append(jax.device_get(loop.run(ds.attach(_init()), ds, num_steps=13).train_state))
  for o in outs[1:]:
    np.testing.assert_array_equal(o["seen"], outs[0]["seen"])
    assert o["acc"] == outs[0]["acc"]


def test_dataset_is_an_argument_not_an_embedded_constant():
  mesh = jax.make_mesh((8,), ("data",))
  big = {"x": np.arange(262_144, dtype=np.float32)}  # 1 MiB
  ds = DeviceDataset(big, 16, mesh=mesh, seed=0)

  def step(state, batch):
    return {"step": state["step"] + 1, "s": state["s"] + jnp.sum(batch["x"])}, {}

  wstate = ds.attach({"step": jnp.zeros((), jnp.int32), "s": jnp.zeros(())})
  index = jax.device_put(ds.batch_at(0), NamedSharding(mesh, P("data")))
  hlo = jax.jit(ds.wrap_step(step)).lower(wstate, index).as_text()
  assert len(hlo) < 100_000  # a 1 MiB constant would print as > 2 MB of text


def test_no_implicit_transfers_during_training():
  mesh = jax.make_mesh((8,), ("data",))
  ds = _dataset(mesh)
  loop = loopkit.TrainLoop(ds.wrap_step(_record_step(mesh, "global")), iterations_per_loop=4,
                           mesh=mesh, steps_per_epoch=ds.steps_per_epoch)
  wstate = loop.program.place_state(ds.attach(_init()))
  with jax.transfer_guard("disallow"):
    out = loop.run(wstate, ds, num_steps=8)
  assert int(out.step) == 8
  # what the feeder sends per step: two int32 per example
  assert sum(v.nbytes for v in ds.batch_at(0).values()) == 2 * 4 * B


def test_index_batches_and_end_of_epochs():
  mesh = jax.make_mesh((8,), ("data",))
  ds = _dataset(mesh, num_epochs=2)
  b = ds.batch_at(7)  # epoch 1, second batch
  np.testing.assert_array_equal(b["epoch"], np.ones(B))
  np.testing.assert_array_equal(b["position"], np.arange(B, 2 * B))
  assert b["position"].dtype == np.int32
  with pytest.raises(IndexError):
    ds.batch_at(12)


def test_errors_name_the_numbers():
  mesh = jax.make_mesh((8,), ("data",))
  with pytest.raises(ValueError, match="12 is not divisible by the data-parallel size 8"):
    DeviceDataset({"x": np.arange(100)}, 12, mesh=mesh)
  with pytest.raises(ValueError, match="fewer than one batch"):
    DeviceDataset({"x": np.arange(10)}, 16, mesh=mesh)
  with pytest.raises(ValueError, match="same leading"):
    DeviceDataset({"x": np.arange(100), "y": np.arange(99)}, 16, mesh=mesh)
