"""Source adapters: one conformance test every source passes; per-process shards (C27)."""

import itertools
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import loopkit
from loopkit.data.sources import (
  ArraySource,
  TfDataSource,
  batch_arrays,
  eval_batches_per_process,
  grain_shard_for_process,
  grain_shard_options,
  open_source,
  process_shard_bounds,
  shard_for_process,
  tfds_split_for_process,
)
from tests.toy import SetPosition

MESH2 = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
REPL2 = NamedSharding(MESH2, P())
STEPS, B, N = 15, 2, 40


def fingerprint_np(batch):
  """Per-example int fingerprint of a batch: sum of every leaf's values, [B] int64."""
  leaves = [np.asarray(x).reshape(np.shape(x)[0], -1).astype(np.int64).sum(1)
            for x in jax.tree.leaves(batch)]
  return sum(leaves)


def fingerprint_step(state, batch):
  leaves = [x.reshape(x.shape[0], -1).astype(jnp.int32).sum(1) for x in jax.tree.leaves(batch)]
  fp = jax.sharding.reshard(sum(leaves), REPL2)
  return ({"step": state["step"] + 1, "seen": state["seen"].at[state["step"]].set(fp)},
          {"fp": jnp.mean(fp.astype(jnp.float32))})


class Reiterable:
  """A plain re-iterable (each iter() is a fresh generator from the start)."""

  def __init__(self, batches):
    self.batches = batches

  def __iter__(self):
    return (b for b in self.batches)


def _int_batches():
  rng = np.random.default_rng(0)
  xs = rng.permutation(N).astype(np.int32)
  return [{"x": xs[i:i + B], "y": xs[i:i + B] * 3} for i in range(0, N, B)]


def _grain_iter_dataset():
  import grain
  return (grain.MapDataset.range(N).shuffle(seed=7)
          .map(lambda i: {"x": np.int32(i), "y": np.int32(3 * i)})
          .batch(B).to_iter_dataset())


def _grain_dataloader():
  import grain
  sampler = grain.samplers.IndexSampler(N, shard_options=grain.sharding.NoSharding(),
                                        shuffle=True, seed=3, num_epochs=1)
  return grain.DataLoader(data_source=[{"x": np.int32(i), "y": np.int32(3 * i)}
                                       for i in range(N)],
                          sampler=sampler, operations=[grain.transforms.Batch(B)],
                          worker_count=0)


def _tf_data():
  import tensorflow as tf
  ds = tf.data.Dataset.range(N).shuffle(N, seed=5, reshuffle_each_iteration=False)
  ds = ds.map(lambda i: {"x": tf.cast(i, tf.int32), "y": tf.cast(3 * i, tf.int32)})
  return TfDataSource(ds.batch(B))


def _tfds_mock():
  tfds = pytest.importorskip("tensorflow_datasets")
  with tfds.testing.mock_data(num_examples=N):
    ds = tfds.load("mnist", split="train", shuffle_files=False)
  return TfDataSource(ds.batch(B))


SOURCES = {
    "list": lambda: _int_batches(),
    "reiterable": lambda: Reiterable(_int_batches()),
    "array_source": lambda: ArraySource({"x": np.arange(N, dtype=np.int32),
                                         "y": np.arange(0, 3 * N, 3, dtype=np.int32)}, B, seed=11),
    "grain_source": lambda: loopkit.data.GrainSource(
        [{"x": np.int32(i), "y": np.int32(3 * i)} for i in range(N)], B, seed=11),
    "grain_iter_dataset": _grain_iter_dataset,
    "grain_dataloader": _grain_dataloader,
    "tf_data": _tf_data,
    "tfds_mock": _tfds_mock,
}


class StopAt9(loopkit.Hook):
  """When armed, stops the run at step 9 (a kill right after a checkpoint)."""

  needs_state = True  # synchronous at its step, like a checkpoint hook

  def __init__(self):
    super().__init__(at_steps=[9], at_end=False)
    self.armed = False
    self.loop = None

  def on_run_start(self, loop, state):
    self.loop = loop

  def on_trigger(self, info, state):
    if self.armed:
      self.loop.request_stop("killed")


@pytest.fixture(scope="module")
def loop():
  restore, stop = SetPosition(), StopAt9()
  lp = loopkit.TrainLoop(fingerprint_step, iterations_per_loop=3, prefetch=2, mesh=MESH2,
                         hooks=[restore, stop])
  lp.restore, lp.stop = restore, stop
  return lp


def _state():
  return {"step": jnp.zeros((), jnp.int32), "seen": jnp.full((STEPS, B), -1, jnp.int32)}


@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.tf) if k.startswith("tf")
                                  else k for k in SOURCES])
def test_source_conformance(kind, loop):
  """Same batches through the loop as read directly; exact resume from a saved position."""
  if kind.startswith("grain"):
    pytest.importorskip("grain")
  if kind.startswith("tf"):
    pytest.importorskip("tensorflow")
  make = SOURCES[kind]
  direct, _ = open_source(make(), None, 0)
  ref = np.stack([fingerprint_np(b) for b in itertools.islice(direct, STEPS)])
  assert len(np.unique(ref)) > STEPS  # a real, varied sequence

  # 1. the loop consumes exactly the source's batches, in order
  loop.restore.position = None
  full = loop.run(_state(), make(), num_steps=STEPS)
  compiles = loop.program.compile_count()
  np.testing.assert_array_equal(np.asarray(full["seen"]), ref)

  # 2. killed at 9 while the prefetcher reads ahead; the position survives a
  #    pickle round trip (as in a checkpoint); a fresh source resumes exactly
  loop.restore.position = None
  loop.stop.armed = True
  try:
    part = loop.run(_state(), make(), num_steps=STEPS)
  finally:
    loop.stop.armed = False
  assert loop.status == "killed" and loop.ledger.step == 9
  position = pickle.loads(pickle.dumps(loop.data_position))
  loop.restore.position = position
  resumed = loop.run(jax.device_get(part), make(), num_steps=STEPS)
  np.testing.assert_array_equal(np.asarray(resumed["seen"]), ref)
  assert loop.program.compile_count() == compiles  # resuming compiles nothing new


def test_array_source_shuffle_reproducible_and_per_epoch():
  data = {"x": np.arange(12, dtype=np.int32)}
  a, b = ArraySource(data, 4, seed=1), ArraySource(data, 4, seed=1)
  epoch = lambda s, e: np.concatenate([s.batch_at(e * 3 + i)["x"] for i in range(3)])
  np.testing.assert_array_equal(epoch(a, 0), epoch(b, 0))
  assert sorted(epoch(a, 0)) == list(range(12))
  assert not np.array_equal(epoch(a, 0), epoch(a, 1))
  assert not np.array_equal(epoch(a, 0), epoch(ArraySource(data, 4, seed=2), 0))
  # mid-epoch resume: a fresh source asked for step 4 gives the same batch
  np.testing.assert_array_equal(ArraySource(data, 4, seed=1).batch_at(4)["x"], a.batch_at(4)["x"])


def test_array_source_process_parts_form_the_global_batch():
  data = {"x": np.arange(20, dtype=np.int32)}
  whole = ArraySource(data, 8, seed=4, process_index=0, process_count=1)
  parts = [ArraySource(data, 8, seed=4, process_index=p, process_count=4) for p in range(4)]
  for step in (0, 1, 2, 5):
    np.testing.assert_array_equal(np.concatenate([p.batch_at(step)["x"] for p in parts]),
                                  whole.batch_at(step)["x"])


def test_array_source_errors():
  with pytest.raises(ValueError, match="fewer than one batch"):
    ArraySource({"x": np.arange(3)}, 4)
  with pytest.raises(ValueError, match="6 is not divisible by the process count 4"):
    ArraySource({"x": np.arange(30)}, 6, process_index=0, process_count=4)
  with pytest.raises(ValueError, match="same leading"):
    ArraySource({"x": np.arange(30), "y": np.arange(29)}, 2)
  with pytest.raises(IndexError):
    ArraySource({"x": np.arange(10)}, 2, num_epochs=1).batch_at(5)


# -- per-process shards (C27) ---------------------------------------------------


@pytest.mark.parametrize("n,p", [(10, 4), (0, 3), (7, 7), (5, 8), (1000, 7), (13, 1)])
def test_process_shards_disjoint_complete_balanced(n, p):
  bounds = [process_shard_bounds(n, i, p) for i in range(p)]
  sizes = [b - a for a, b in bounds]
  assert max(sizes) - min(sizes) <= 1
  assert sorted(sizes, reverse=True) == sizes  # the first processes get the extra ones
  ids = np.concatenate([np.arange(a, b) for a, b in bounds])
  np.testing.assert_array_equal(ids, np.arange(n))  # disjoint and complete, in order


def test_c27_shard_sizes_and_eval_steps():
  data = {"x": np.arange(10)}
  shards = [shard_for_process(data, i, 4)["x"] for i in range(4)]
  assert [len(s) for s in shards] == [3, 3, 2, 2]
  assert sorted(np.concatenate(shards).tolist()) == list(range(10))
  # global batch 8 over 4 processes: 2 per process; all run ceil(3 / 2) = 2 batches
  n = eval_batches_per_process(10, 8, 4)
  assert n == 2
  counts = [[len(b["x"]) for b in batch_arrays({"x": s}, 2, num_batches=n)] for s in shards]
  assert counts == [[2, 1], [2, 1], [2, 0], [2, 0]]
  with pytest.raises(ValueError, match="not divisible by the process count"):
    eval_batches_per_process(10, 6, 4)


def test_c27_grain_map_dataset_shards():
  grain = pytest.importorskip("grain")
  got = [list(grain_shard_for_process(grain.MapDataset.range(10), process_index=p,
                                      process_count=4)) for p in range(4)]
  assert [len(g) for g in got] == [3, 3, 2, 2]
  assert [list(range(*process_shard_bounds(10, p, 4))) for p in range(4)] == got


def test_grain_dataloader_shards_drop_the_remainder():
  """Why eval uses grain_shard_for_process: a sharded DataLoader keeps N // P records."""
  grain = pytest.importorskip("grain")
  got = []
  for p in range(4):
    sampler = grain.samplers.IndexSampler(
        10, shard_options=grain_shard_options(process_index=p, process_count=4),
        shuffle=False, num_epochs=1)
    got.append([int(x) for x in grain.DataLoader(data_source=list(range(10)),
                                                 sampler=sampler, worker_count=0)])
  assert [len(g) for g in got] == [2, 2, 2, 2]
  assert len(set(itertools.chain(*got))) == 8  # disjoint, but 2 examples never read


@pytest.mark.tf
def test_c27_tfds_split_for_process(tmp_path):
  tfds = pytest.importorskip("tensorflow_datasets")
  from tensorflow_datasets.testing.test_utils import DummyDatasetSharedGenerator

  builder = DummyDatasetSharedGenerator(data_dir=str(tmp_path))
  builder.download_and_prepare()  # its "test" split holds the 10 examples 20..29
  got = []
  for p in range(4):
    ds = builder.as_dataset(split=tfds_split_for_process("test", process_index=p,
                                                         process_count=4),
                            shuffle_files=False)
    got.append(sorted(int(e["x"]) for e in tfds.as_numpy(ds)))
  assert [len(g) for g in got] == [3, 3, 2, 2]
  union = sorted(itertools.chain(*got))
  assert union == list(range(20, 30)) and len(set(union)) == 10


@pytest.mark.parametrize("shuffle", [True, False])
def test_array_source_chunk_at_equals_stacked_batch_at(shuffle):
  """chunk_at (one gather per leaf, used by the feeder) == stacking batch_at, step by step:
  within an epoch, across one and several epoch ends, on each process of 3, and at the end."""
  data = {"x": np.arange(26, dtype=np.int32), "y": np.arange(52, dtype=np.float32).reshape(26, 2)}
  for p in range(3):
    src = ArraySource(data, 6, seed=7, shuffle=shuffle, num_epochs=4, process_index=p,
                      process_count=3)  # 4 steps per epoch, 16 steps in all
    for step, n in ((0, 1), (1, 2), (0, 4), (3, 2), (2, 7), (1, 14), (13, 3), (12, 10)):
      got = src.chunk_at(step, n)
      m = min(n, 16 - step)
      for name in data:
        want = np.stack([src.batch_at(s)[name] for s in range(step, step + m)])
        assert got[name].dtype == data[name].dtype
        np.testing.assert_array_equal(got[name], want, err_msg=f"{name} {step} {n} {p}")
      # The feeder's path: the same rows written into its padded chunk buffers, rest untouched.
      into = {name: np.full((n + 1, 2) + data[name].shape[1:], -1, data[name].dtype)
              for name in data}
      assert src._chunk_into(step, n, [into[name] for name in sorted(data)]) == m
      for name in data:
        np.testing.assert_array_equal(into[name][:m], got[name], err_msg=f"{name} {step} {n}")
        assert (into[name][m:] == -1).all()
    assert src.chunk_at(16, 3)["y"].shape == (0, 2, 2)  # past the last epoch: no batch
  with pytest.raises(IndexError):
    src.chunk_at(-1, 2)


def test_array_source_runs_bitwise_as_its_batches_one_by_one():
  """The feeder's chunk path (ArraySource.chunk_at) against the per-batch path (the same
  source behind batch_at only): the same batches at every step for K = 1, 3, 7, with calls cut
  at epoch ends (steps_per_epoch given: the source ends between calls) and without (K = 7: calls
  of 7, 7, then 1 of 6 planned: the source ends inside a chunk); the same positions, call
  counts and ledgers."""

  class BatchAtOnly:
    def __init__(self, src):
      self.src = src

    def batch_at(self, step):
      return self.src.batch_at(step)

  def record(state, batch):
    x = jax.sharding.reshard(batch["x"], REPL2)
    return ({"step": state["step"] + 1, "seen": state["seen"].at[state["step"]].set(x)},
            {"x": jnp.mean(x.astype(jnp.float32))})

  data = {"x": np.arange(23, dtype=np.int32)}  # 5 steps per epoch of batch 4, 3 epochs: 15
  for k, spe in ((1, 5), (3, 5), (7, 5), (3, None), (7, None)):
    runs = []
    for make in (lambda s: s, BatchAtOnly):
      src = make(ArraySource(data, 4, seed=3, num_epochs=3))
      loop = loopkit.TrainLoop(record, iterations_per_loop=k, steps_per_epoch=spe, mesh=MESH2)
      with pytest.warns(loopkit.DataExhaustedWarning):
        out = loop.run({"step": jnp.zeros((), jnp.int32),
                        "seen": jnp.full((20, 4), -1, jnp.int32)}, src, num_steps=20)
      runs.append((np.asarray(out["seen"]), loop.data_position, loop.ledger.step,
                   loop.ledger.loop_index, loop.status))
    (seen, *rest), (seen_ref, *rest_ref) = runs
    np.testing.assert_array_equal(seen, seen_ref, err_msg=f"K={k}")
    calls = {(7, None): 3, (3, None): 5}.get((k, spe), rest_ref[2])  # 15 = 7 + 7 + 1, 5 x 3
    # The same step; the ArraySource saves it with what makes its batches (position_at).
    assert rest[0] == {"array_step": 15, "seed": 3, "global_batch_size": 4, "num_examples": 23}
    rest[0] = rest[0]["array_step"]
    assert rest == rest_ref == [15, 15, calls, "data_exhausted"], (k, spe, rest, rest_ref)
    assert (seen[15:] == -1).all() and sorted(seen[:5].ravel()) != list(range(20))


def test_chunk_at_that_returns_other_shapes_is_named():
  class Bad:
    def batch_at(self, step):
      return {"x": np.zeros((2,), np.int32)}

    def chunk_at(self, step, n):  # float32 from step 2 on: the first chunk's batches are int32
      return {"x": np.zeros((n, 2), np.int32 if step < 2 else np.float32)}

  loop = loopkit.TrainLoop(lambda s, b: ({"step": s["step"] + 1}, {}), iterations_per_loop=2,
                           mesh=MESH2)
  with pytest.raises(ValueError, match=r"chunk_at\(2, 2\).*leaf x .*int32"):
    loop.run({"step": jnp.zeros((), jnp.int32)}, Bad(), num_steps=4)
