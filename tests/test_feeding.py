"""Feeding: chunk contents and positions, C25 resume under prefetch, errors, shutdown."""

import itertools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import loopkit
from loopkit.data.feeding import ChunkFeeder
from loopkit.data.sources import ArraySource
from tests.toy import SetPosition

MESH2 = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
REPL2 = NamedSharding(MESH2, P())


def record_step(state, batch):
  """Writes the batch's ints into state["seen"][step] (a [S, B] int32 buffer)."""
  x = jax.sharding.reshard(batch["x"], REPL2)
  seen = state["seen"].at[state["step"]].set(x)
  return {"step": state["step"] + 1, "seen": seen}, {"x": jnp.mean(x.astype(jnp.float32))}


def init_state(steps=30, batch=2):
  return {"step": jnp.zeros((), jnp.int32), "seen": jnp.full((steps, batch), -1, jnp.int32)}


class CountingSource:
  """Re-iterable ints 0..n-1 in batches of 2; remembers the highest element read."""

  def __init__(self, n=100, batch=2):
    self.n, self.batch, self.max_read = n, batch, -1

  def __iter__(self):
    for i in range(0, self.n, self.batch):
      self.max_read = max(self.max_read, i + self.batch - 1)
      yield {"x": np.arange(i, i + self.batch, dtype=np.int32)}


def _c25(make_source, expected_position):
  """C25 with one source kind: returns nothing, asserts every value of the case."""
  saved = {}

  def checkpoint(info, state):
    saved["position"] = info.data_position
    saved["state"] = jax.device_get(state)
    loop.request_stop("killed")

  restore = SetPosition()
  loop = loopkit.TrainLoop(record_step, iterations_per_loop=3, prefetch=2, mesh=MESH2,
                           hooks=[loopkit.CallbackHook(checkpoint, at_steps=[9], at_end=False),
                                  restore])
  source = make_source()
  out_a = loop.run(init_state(), source, num_steps=30)  # "killed" after the save at 9
  assert loop.status == "killed" and loop.ledger.step == 9
  seen_a = np.asarray(out_a["seen"])[:9].ravel()
  np.testing.assert_array_equal(seen_a, np.arange(18))
  assert saved["position"] == expected_position  # not the prefetched position
  if isinstance(source, CountingSource):
    assert source.max_read > 17  # the prefetcher really had read ahead
  # restart: a fresh process, a fresh source, the saved position
  restore.position = saved["position"]
  out_b = loop.run(saved["state"], make_source(), num_steps=15)
  seen = np.asarray(out_b["seen"])
  np.testing.assert_array_equal(seen[9], [18, 19])  # first batch after the restore
  np.testing.assert_array_equal(seen[:15].ravel(), np.arange(30))  # 0..29, no gap, no repeat
  assert loop.ledger.step == 15
  assert loop.program.compile_count() == 1


def test_c25_plain_iterable_resume_under_prefetch():
  # a plain iterable's position is the batch count: 9 batches = elements 0..17
  _c25(CountingSource, 9)


def test_c25_grain_resume_under_prefetch():
  grain = pytest.importorskip("grain")
  ds = grain.MapDataset.range(100).map(lambda i: np.int32(i)).to_iter_dataset().batch(2)
  _c25(lambda: _GrainX(iter(ds)), {"next_index": 18})


class _GrainX:
  """A Grain iterator whose batches are wrapped as {"x": batch}; forwards state."""

  def __init__(self, it):
    self._it = it

  def __iter__(self):
    return self

  def __next__(self):
    return {"x": np.asarray(next(self._it), np.int32)}

  def get_state(self):
    return self._it.get_state()

  def set_state(self, state):
    self._it.set_state(state)


def test_c25_step_indexed_resume():
  src = lambda: ArraySource({"x": np.arange(100, dtype=np.int32)}, 2, shuffle=False)
  # a step-indexed source's position is the next step, with what makes its batch
  _c25(src, {"array_step": 9, "seed": 0, "global_batch_size": 2, "num_examples": 100})


def _feeder(source, plan, k=3, prefetch=2, **kw):
  return ChunkFeeder(source, iter(plan), iterations_per_loop=k,
                     batch_sharding=NamedSharding(MESH2, P(None, "data")), replicated=REPL2,
                     data_parallel_size=2, prefetch=prefetch, **kw)


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_chunks_padded_with_zeros_and_positions_per_chunk(prefetch):
  source = [{"x": np.array([i, i + 100], np.int32)} for i in range(1, 8)]
  feeder = _feeder(source, [3, 2, 3, 3], prefetch=prefetch)
  chunks = []
  while (c := feeder.next()) is not None:
    chunks.append(c)
    if c.exhausted:
      break
  feeder.close()
  assert [c.length for c in chunks] == [3, 2, 2]
  assert [c.position for c in chunks] == [3, 5, 7]
  assert [c.exhausted for c in chunks] == [False, False, True]
  assert [int(c.num_steps) for c in chunks] == [3, 2, 2]
  second = np.asarray(chunks[1].batches["x"])
  assert second.shape == (3, 2)  # always K slots
  np.testing.assert_array_equal(second, [[4, 104], [5, 105], [0, 0]])
  assert chunks[1].batches["x"].sharding.is_equivalent_to(NamedSharding(MESH2, P(None, "data")),
                                                          2)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_chunk_placement_after_the_first_two_equals_device_put(dtype):
  """From the third chunk on, the transfer skips jax.device_put's per-call Python
  (loopkit.data.placement.Placer): same values, dtype (float64 -> float32 without x64, which keeps
  jax.device_put), sharding and commitment."""
  source = [{"x": np.array([2 * i, 2 * i + 1], dtype), "y": np.array([[i], [-i]], np.int32)}
            for i in range(10)]
  feeder = _feeder(source, [3, 3, 2, 2], prefetch=0)
  chunks = [feeder.next() for _ in range(4)]
  feeder.close()
  assert feeder._place._fast == (dtype == np.float32)
  sharding = NamedSharding(MESH2, P(None, "data"))
  for c, first in zip(chunks, [0, 3, 6, 8]):
    want = {"x": np.zeros((3, 2), dtype), "y": np.zeros((3, 2, 1), np.int32)}
    for j in range(c.length):
      want["x"][j], want["y"][j] = source[first + j]["x"], source[first + j]["y"]
    ref = jax.device_put(want, sharding)
    for name in ("x", "y"):
      got = c.batches[name]
      assert got.dtype == ref[name].dtype and got.committed
      assert got.sharding.is_equivalent_to(sharding, got.ndim)
      assert [s.device for s in got.addressable_shards] == [
          s.device for s in ref[name].addressable_shards]
      np.testing.assert_array_equal(np.asarray(got), np.asarray(ref[name]))
      for s, r in zip(got.addressable_shards, ref[name].addressable_shards):
        np.testing.assert_array_equal(np.asarray(s.data), np.asarray(r.data))


def test_large_chunk_leaves_aligned_and_padded_with_zeros():
  """Leaves >= 64 KiB are formed in 64-byte aligned buffers (XLA:CPU then aliases them);
  their padding slots are zeroed like small ones."""
  rng = np.random.default_rng(0)
  source = [{"x": rng.standard_normal((2, 8192)).astype(np.float32)} for _ in range(5)]
  feeder = _feeder(source, [3, 2, 3], prefetch=0)
  arr = feeder._empty_leaf((3, 2, 8192), np.dtype(np.float32))
  assert arr.__array_interface__["data"][0] % 64 == 0 and arr.shape == (3, 2, 8192)
  empty_leaf = feeder._empty_leaf

  def garbage_leaf(shape, dtype):  # uninitialised memory need not be zeros
    leaf = empty_leaf(shape, dtype)
    leaf.fill(7)
    return leaf

  feeder._empty_leaf = garbage_leaf
  chunks = [feeder.next() for _ in range(2)]
  feeder.close()
  np.testing.assert_array_equal(np.asarray(chunks[0].batches["x"]), np.stack(
      [b["x"] for b in source[:3]]))
  want = np.zeros((3, 2, 8192), np.float32)
  want[:2] = [b["x"] for b in source[3:5]]
  np.testing.assert_array_equal(np.asarray(chunks[1].batches["x"]), want)


@pytest.mark.parametrize("change", ["extra key", "missing key", "subtree for a leaf",
                                    "list for a tuple", "None for a leaf"])
def test_batch_structure_change_is_an_error(change):
  x = np.array([0, 1], np.int32)
  first = {"x": x, "t": (x, x)}
  later = {"extra key": {"x": x, "t": (x, x), "z": x}, "missing key": {"x": x},
           "subtree for a leaf": {"x": {"a": x}, "t": (x, x)},
           "list for a tuple": {"x": x, "t": [x, x]},
           "None for a leaf": {"x": None, "t": (x, x)}}[change]
  feeder = _feeder([first, first, later], [3], prefetch=0)
  with pytest.raises(ValueError, match=r"batch for step 3 differs from the first batch: "):
    feeder.next()
  feeder.close()


class Boom(Exception):
  pass


def _failing_source(fail_at):
  for i in itertools.count():
    if i == fail_at:
      raise Boom(f"source failed at batch {i}")
    yield {"x": np.array([2 * i, 2 * i + 1], np.int32)}


@pytest.mark.parametrize("prefetch", [0, 2])
def test_producer_exception_surfaces_in_training_thread(prefetch):
  loop = loopkit.TrainLoop(record_step, iterations_per_loop=3, prefetch=prefetch, mesh=MESH2)
  caller = threading.get_ident()
  with pytest.raises(Boom, match="source failed at batch 7"):
    loop.run(init_state(), _failing_source(7), num_steps=20)
  assert threading.get_ident() == caller


def test_close_never_hangs_when_source_blocks():
  release = threading.Event()

  def blocking():
    yield {"x": np.array([0, 1], np.int32)}
    release.wait(60)  # a stuck reader
    yield {"x": np.array([2, 3], np.int32)}

  feeder = _feeder(blocking(), itertools.repeat(3), close_timeout_secs=0.5)
  time.sleep(0.2)  # the producer is now stuck inside the source
  t0 = time.perf_counter()
  feeder.close()
  assert time.perf_counter() - t0 < 2.0
  release.set()


def test_close_never_hangs_when_queue_full():
  source = ({"x": np.array([2 * i, 2 * i + 1], np.int32)} for i in itertools.count())
  feeder = _feeder(source, itertools.repeat(3), prefetch=1)
  first = feeder.next()
  time.sleep(0.3)  # producer has filled the queue and blocks on put
  t0 = time.perf_counter()
  feeder.close()
  assert time.perf_counter() - t0 < 1.0
  assert not feeder._thread.is_alive()
  np.testing.assert_array_equal(np.asarray(first.batches["x"]), [[0, 1], [2, 3], [4, 5]])


def test_loop_with_endless_source_returns_promptly():
  source = ({"x": np.array([2 * i, 2 * i + 1], np.int32)} for i in itertools.count())
  loop = loopkit.TrainLoop(record_step, iterations_per_loop=3, prefetch=4, mesh=MESH2)
  t0 = time.perf_counter()
  out = loop.run(init_state(), source, num_steps=7)
  assert time.perf_counter() - t0 < 30
  np.testing.assert_array_equal(np.asarray(out["seen"])[:7].ravel(), np.arange(14))
  assert loop.data_position == 7


def test_finite_step_indexed_source_ends_the_run():
  src = ArraySource({"x": np.arange(10, dtype=np.int32)}, 2, shuffle=False, num_epochs=1)
  loop = loopkit.TrainLoop(record_step, iterations_per_loop=3, mesh=MESH2)
  with pytest.warns(loopkit.DataExhaustedWarning):
    out = loop.run(init_state(), src, num_steps=9)
  assert loop.ledger.step == 5 and loop.status == "data_exhausted"
  np.testing.assert_array_equal(np.asarray(out["seen"])[:5].ravel(), np.arange(10))
