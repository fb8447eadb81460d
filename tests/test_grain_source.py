"""GrainSource (loopkit/data/grain_source.py): one global order, O(1) exact resume, errors.

The order and rows are checked against the source's own record ids; resumes run
real TrainLoops with a CheckpointHook on tmp_path and compare with an
uninterrupted run, bitwise. The records are counted by the data source
(tests/grain_workers.py), so a resume's reads are seen. Multi-process resumes
(2 -> 1, 1 -> 2) run under jax.distributed on CPU.
"""

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import toy

import loopkit
from loopkit.checkpoint import CheckpointHook
from loopkit.data import ArraySource, GrainSource
from loopkit.tools import testing
from tests import bootstrap
from tests import grain_workers as workers

B = workers.GLOBAL_BATCH


def records(n=workers.NUM_RECORDS):
  return workers.CountingRecords(n)


# -- the order -----------------------------------------------------------------------------


def test_each_epoch_is_a_new_permutation_and_the_remainder_is_dropped():
  src = GrainSource(records(), B, seed=5)
  assert src.steps_per_epoch == 6
  for epoch in range(3):
    ids = np.concatenate([src.record_indices_at(epoch * 6 + s) for s in range(6)])
    assert len(set(ids.tolist())) == 96 and ids.min() >= 0 and ids.max() < 100
  e0 = np.concatenate([src.record_indices_at(s) for s in range(6)])
  e1 = np.concatenate([src.record_indices_at(6 + s) for s in range(6)])
  assert not np.array_equal(e0, e1)
  plain = GrainSource(records(), B, shuffle=False)
  assert plain.record_indices_at(7).tolist() == list(range(16, 32))  # epoch 1, step 1


def test_chunk_at_equals_stacked_batches_across_an_epoch_end():
  src = GrainSource(records(), B, seed=5)
  chunk = src.chunk_at(4, 5)  # steps 4..8: epoch 0's last two, epoch 1's first three
  assert chunk["x"].shape == (5, B, 4) and chunk["id"].dtype == np.int32
  for i in range(5):
    batch = src.batch_at(4 + i)
    for key in batch:
      assert chunk[key][i].tobytes() == batch[key].tobytes()
    assert chunk["id"][i].tolist() == src.record_indices_at(4 + i).tolist()


def test_read_threads_give_the_same_chunks_and_reopen_where_a_read_jumps():
  direct, threaded = GrainSource(records(), B, seed=5), GrainSource(records(), B, seed=5,
                                                                   read_threads=4)
  for step, n in [(0, 3), (3, 3), (6, 2), (20, 4), (2, 1)]:  # the last two re-open
    got, want = threaded.chunk_at(step, n), direct.chunk_at(step, n)
    for key in want:
      assert got[key].tobytes() == want[key].tobytes(), (step, key)
  threaded.close()


@pytest.mark.parametrize("count", [2, 4])
def test_rows_of_every_process_make_the_one_process_batch_in_place(count):
  """Process p reads rows [p B/P, (p+1) B/P) of the same global batch; the
  augmentation (a Grain random_map) is keyed by the global index, and the batch
  transform works row by row, so the values match too (with 1 or 2 read threads)."""

  def transform(ds):
    return ds.random_map(lambda r, rng: {**r, "x": r["x"] + rng.normal(size=4)}, seed=9)

  def rows(batch):  # a batch transform: row by row, once per read
    return {**batch, "y": batch["y"] * batch["x"][:, :2]}

  one = GrainSource(records(), B, seed=5, transform=transform, batch_transform=rows)
  parts = [GrainSource(records(), B, seed=5, transform=transform, batch_transform=rows,
                       process_index=p, process_count=count, read_threads=p + 1)
           for p in range(count)]
  for step in (0, 7, 61):
    whole = one.chunk_at(step, 2)
    joined = {k: np.concatenate([p.chunk_at(step, 2)[k] for p in parts], axis=1)
              for k in whole}
    for key in whole:
      assert joined[key].tobytes() == whole[key].tobytes(), (step, key)


def test_array_record_files_through_grain_sources(tmp_path):
  """ArrayRecord files read by ``grain.sources.ArrayRecordDataSource`` (Grain's batched
  reads), decoded by a Grain ``map``: the same batches as the in-memory records."""
  grain = pytest.importorskip("grain")
  from array_record.python.array_record_module import ArrayRecordWriter

  recs = records(40)
  paths = []
  for shard in range(2):  # two files, 20 records each
    paths.append(str(tmp_path / f"toy.array_record-0000{shard}-of-00002"))
    writer = ArrayRecordWriter(paths[-1], "group_size:1")
    for i in range(shard * 20, shard * 20 + 20):
      writer.write(np.concatenate([recs.x[i], recs.y[i], [np.float32(i)]]).tobytes())
    writer.close()

  def decode(raw):
    v = np.frombuffer(raw, np.float32)
    return {"x": v[:4], "y": v[4:6], "id": np.int32(v[6])}

  from_files = GrainSource(grain.sources.ArrayRecordDataSource(paths), 8, seed=5,
                           transform=lambda ds: ds.map(decode))
  in_memory = GrainSource(recs, 8, seed=5)
  for step in (0, 4, 13):
    got, want = from_files.chunk_at(step, 3), in_memory.chunk_at(step, 3)
    for key in want:
      assert got[key].tobytes() == want[key].tobytes(), (step, key)


def test_num_epochs_ends_the_source():
  src = GrainSource(records(), B, seed=5, num_epochs=2)
  assert src.chunk_at(10, 5)["x"].shape == (2, B, 4)
  assert src.chunk_at(12, 3)["x"].shape == (0, B, 4)
  with pytest.raises(IndexError, match="step 12"):
    src.batch_at(12)
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=5,
                           steps_per_epoch=src.steps_per_epoch)
  with pytest.warns(loopkit.DataExhaustedWarning, match="ran out at step 12"):
    loop.run(toy.init_state(), src, num_steps=100)
  assert loop.ledger.step == 12


@pytest.mark.parametrize("prefetch", [1, 2])
def test_the_feeder_reads_at_most_its_prefetch_depth_ahead(prefetch):
  """With a slow consumer, the steps read run at most (prefetch + 2) chunks ahead of the
  steps whose hooks run: the next call's chunk (dispatched before this call's hooks),
  ``prefetch`` queued and one formed, waiting for room; each chunk one ``chunk_at``."""
  src = workers.Recording(GrainSource(records(), B, seed=5))
  ahead, calls = [], []
  real = src.src.chunk_at
  src.src.chunk_at = lambda step, n: calls.append(n) or real(step, n)

  def slow(info, _):
    time.sleep(0.05)  # the prefetch thread fills its queue meanwhile
    ahead.append(max(src.served) + 1 - info.end_step)

  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=3, prefetch=prefetch,
                           hooks=[loopkit.CallbackHook(slow, needs_state=False)])
  loop.run(toy.init_state(), src, num_steps=30)
  assert 3 <= max(ahead) <= (prefetch + 2) * 3, ahead
  assert calls == [3] * 10  # one chunk_at per call, no per-batch reads


def test_the_run_stops_the_workers_and_a_later_run_starts_them_at_its_step(uninterrupted):
  """The feeder closes a GrainSource when a run ends (its worker process exits); the same
  source then serves a second run, continuing at step 6, the uninterrupted run's batches."""
  import multiprocessing

  grain_workers = lambda: [p for p in multiprocessing.active_children() if "grain" in p.name]
  src = workers.Recording(GrainSource(records(), B, seed=5, worker_count=1))
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4,
                           steps_per_epoch=src.steps_per_epoch)
  state = loop.run(toy.init_state(), src, num_steps=6)
  assert grain_workers() == []
  state = loop.run(state, src, num_steps=14)
  assert grain_workers() == []
  assert src.served == uninterrupted["served"]
  toy.assert_bitwise({k: np.asarray(v) for k, v in state["params"].items()},
                     uninterrupted["params"])


# -- O(1) resume ---------------------------------------------------------------------------


@pytest.mark.parametrize("worker_count", [0, 1])
def test_a_resume_reads_no_record_before_its_step(tmp_path, worker_count):
  """Records read by a resume at s = 0, mid epoch 1 and mid epoch 10: K * B of steps >= s.

  The first run of each depth writes a checkpoint at s; the resumed run (a
  fresh source whose every read is logged with its global index, by the Grain
  worker process too) runs K = 4 steps and stops. tf.data's ``skip(n)`` would
  read s * B records first. Without workers the source reads exactly the K * B
  records of steps s .. s + K - 1; a worker process reads ahead of the feeder,
  at most ``READ_AHEAD`` batches past them, and is gone when ``run`` returns.
  """
  k = 4
  depths = {"s=0": 0, "mid epoch 1": 3, "mid epoch 10": 9 * 6 + 3}
  got = {}
  for name, s in depths.items():
    d = tmp_path / name.replace(" ", "_")
    if s:
      workers.train(str(d), s, k, every_steps=10**6)
    log = str(d / "reads.txt") if s else str(tmp_path / "reads_0.txt")
    out = workers.train(str(d), s + k, k, every_steps=10**6, prefetch=2,
                        worker_count=worker_count, read_log=log)
    assert out["restored_step"] == (s or None) and out["step"] == s + k
    assert sorted(out["served"]) == list(range(s, s + k))
    assert out["grain_workers_after_run"] == []
    steps = workers.steps_read(log)
    assert min(steps) == s  # nothing before the resume step
    assert steps[:k * B] == [t for t in range(s, s + k) for _ in range(B)]  # each row once
    beyond = steps[k * B:]  # read ahead by the worker, never fed
    assert len(beyond) <= (READ_AHEAD if worker_count else 0) * B and all(
        t >= s + k for t in beyond), beyond
    got[name] = (len(steps), sorted(set(beyond)), round(out["first_call_s"], 2))
  print(f"{worker_count} workers: records read, steps read ahead and seconds to the first "
        "call's end, per resume depth:", got)
  if not worker_count:
    assert {reads for reads, _, _ in got.values()} == {k * B}


# Batches one Grain worker (buffers of 1 batch) reads past the last fed one: 5 measured
# (grain 0.2.18); the bound is what matters, its value only Grain's buffering.
READ_AHEAD = 6


# -- exact resume --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def uninterrupted():
  return workers.train(None, 14, 4)


@pytest.mark.parametrize("k", [1, 3])
def test_resume_is_bitwise_equal_to_uninterrupted(tmp_path, k, uninterrupted):
  first = workers.train(str(tmp_path), 7, k, every_steps=10**6)
  resumed = workers.train(str(tmp_path), 14, k)
  assert resumed["restored_step"] == 7 and resumed["step"] == 14
  served = {**first["served"], **resumed["served"]}
  assert served == uninterrupted["served"]
  toy.assert_bitwise(resumed["params"], uninterrupted["params"])
  assert resumed["position"] == {"grain_step": 14, "seed": 5, "global_batch_size": B,
                                 "num_records": workers.NUM_RECORDS}


@pytest.mark.parametrize("count", [1, pytest.param(2, marks=pytest.mark.slow(
    held_by="tests/test_grain_source.py::test_a_resume_reads_no_record_before_its_step",
    reason="a second Grain worker process"))])
def test_a_resume_with_another_worker_count_is_bitwise(tmp_path, count, uninterrupted):
  """0 workers to step 6, then Grain worker processes to 14: the same batches and bits."""
  workers.train(str(tmp_path), 6, 3, every_steps=10**6)
  t0 = time.perf_counter()
  resumed = workers.train(str(tmp_path), 14, 3, worker_count=count)
  print(f"resume with {count} workers: {time.perf_counter() - t0:.1f} s "
        f"(first call after {resumed['first_call_s']:.1f} s)")
  assert resumed["restored_step"] == 6
  assert resumed["served"] == {s: uninterrupted["served"][s] for s in range(6, 14)}
  toy.assert_bitwise(resumed["params"], uninterrupted["params"])


# -- errors --------------------------------------------------------------------------------


def test_a_global_batch_that_does_not_divide_over_the_processes():
  with pytest.raises(ValueError, match="global batch size 6 is not divisible by the process "
                                       "count 4"):
    GrainSource(records(), 6, process_count=4, process_index=0)
  with pytest.raises(ValueError, match="100 records are fewer than one global batch of 128"):
    GrainSource(records(), 128)
  with pytest.raises(ValueError, match="one element per record"):
    GrainSource(records(), B, transform=lambda ds: ds[:50])


def test_a_checkpoint_from_another_pipeline_is_refused_at_run_start(tmp_path):
  data = {"x": records().x, "y": records().y}
  loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=2,
                    hooks=[CheckpointHook(tmp_path)]).run(
      toy.init_state(), ArraySource(data, B, seed=5), num_steps=4)
  hook = CheckpointHook(tmp_path)
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=2, hooks=[hook])
  with pytest.raises(ValueError, match=r"data position \{'array_step': 4, 'seed': 5, "
                                       r"'global_batch_size': 16, 'num_examples': 100\} came "
                                       r"from an ArraySource .*not from a GrainSource .*"
                                       r"'grain_step': 4"):
    loop.run(toy.init_state(), GrainSource(records(), B, seed=5), num_steps=8)
  hook.close()


def test_position_checks_name_both_values():
  src = GrainSource(records(), B, seed=5)
  src.check_position(src.position_at(3), 3)
  with pytest.raises(ValueError, match=r"\{'tf_batches': 3\} came from a tf.data pipeline"):
    src.check_position({"tf_batches": 3}, 3)
  with pytest.raises(ValueError, match="another pipeline's iterator state"):
    src.check_position({"global_next_index": 48}, 3)
  with pytest.raises(ValueError, match="has seed=4 but this GrainSource has seed=5"):
    src.check_position({**src.position_at(3), "seed": 4}, 3)
  with pytest.raises(ValueError, match="has grain_step=2 but this GrainSource has grain_step=3"):
    src.check_position(src.position_at(2), 3)
  with pytest.raises(ValueError, match="has num_records=99 but"):
    src.check_position({**src.position_at(3), "num_records": 99}, 3)


@pytest.mark.tf
def test_a_tfdata_source_refuses_a_grain_position():
  import tensorflow as tf

  it = iter(loopkit.data.TfDataSource(tf.data.Dataset.range(10).batch(2)))
  position = GrainSource(records(), B).position_at(3)
  with pytest.raises(ValueError, match=r"'grain_step': 3.*did not come from a tf.data pipeline"):
    it.set_state(position)


# -- several processes ---------------------------------------------------------------------


def test_2_processes_save_1_process_resumes_with_the_same_examples(tmp_path, uninterrupted):
  """2 x 4 devices train to step 7 and save; 1 x 8 (this process) resumes to 14.

  Each of the two processes reads through a Grain worker process of its own.
  Every step's global batch (the two processes' rows in order) is the
  uninterrupted 1 x 8 run's (which read without workers). The params are not
  bitwise: gloo's cross-process all-reduce adds the 8 partial sums in another
  order than the in-process one (tests/test_multihost.py); the measured
  difference is printed.
  """
  t0 = time.perf_counter()
  p0, p1 = testing.run_processes(workers.train, num_processes=2, devices_per_process=4,
                                 args=(str(tmp_path), 7, 3),
                                 kwargs={"every_steps": 10**6, "worker_count": 1},
                                 timeout_s=240)
  print(f"2 x 4 to step 7: {time.perf_counter() - t0:.1f} s")
  for s in range(7):
    assert p0["served"][s] + p1["served"][s] == uninterrupted["served"][s], s
  assert p0["grain_workers_after_run"] == p1["grain_workers_after_run"] == []
  toy.assert_bitwise(p0["params"], p1["params"])
  resumed = workers.train(str(tmp_path), 14, 3)
  assert resumed["restored_step"] == 7
  for s in range(7, 14):
    assert resumed["served"][s] == uninterrupted["served"][s], s
  diff = max(float(np.max(np.abs(resumed["params"][k] - uninterrupted["params"][k])))
             for k in resumed["params"])
  print(f"2 x 4 + 1 x 8 vs 1 x 8: max |param diff| {diff:.2e}")
  for key in resumed["params"]:
    np.testing.assert_allclose(resumed["params"][key], uninterrupted["params"][key], atol=1e-6)


def test_1_process_saves_2_processes_resume_with_the_same_examples(tmp_path, uninterrupted):
  """1 x 8 trains to step 7; 2 x 4 resume it to 14, each reading only its rows."""
  first = workers.train(str(tmp_path), 7, 3, every_steps=10**6)
  p0, p1 = testing.run_processes(workers.train, num_processes=2, devices_per_process=4,
                                 args=(str(tmp_path), 14, 3), timeout_s=240)
  for p in (p0, p1):
    assert p["restored_step"] == 7 and p["step"] == 14
    assert p["reads"] == 7 * B // 2  # only its rows of steps 7..13
  for s in range(7, 14):
    assert p0["served"][s] + p1["served"][s] == uninterrupted["served"][s], s
  assert {**first["served"]} == {s: uninterrupted["served"][s] for s in range(7)}
  toy.assert_bitwise(p0["params"], p1["params"])
  for key in p0["params"]:
    np.testing.assert_allclose(p0["params"][key], uninterrupted["params"][key], atol=1e-6)


@pytest.mark.slow(held_by="tests/test_grain_source.py::test_2_processes_save_1_process_resumes_with_the_same_examples",
                  reason="6 processes in 3 runs")
def test_2_processes_save_4_processes_resume_bitwise_where_devices_match(tmp_path):
  """2 x 4 to step 7, then 4 x 2 to 14 (B = 16 divides over 4): the example ids of every step
  are the uninterrupted 2 x 4 run's, and the params its bits (both sides reduce the 8
  devices' sums across processes with gloo, in the same order: measured 0 difference)."""
  whole = testing.run_processes(workers.train, num_processes=2, devices_per_process=4,
                                args=(None, 14, 3), timeout_s=240)
  testing.run_processes(workers.train, num_processes=2, devices_per_process=4,
                        args=(str(tmp_path), 7, 3), kwargs={"every_steps": 10**6},
                        timeout_s=240)
  four = testing.run_processes(workers.train, num_processes=4, devices_per_process=2,
                               args=(str(tmp_path), 14, 3), timeout_s=300)
  for s in range(7, 14):
    assert sum((p["served"][s] for p in four), []) == sum((p["served"][s] for p in whole), []), s
  assert all(p["reads"] == 7 * B // 4 for p in four)
  toy.assert_bitwise(four[0]["params"], whole[0]["params"])  # measured: 0 difference


# -- processes -----------------------------------------------------------------------------


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
  """(state, ppid, start time in ticks) of ``pid`` from /proc, or None once it is gone."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      fields = f.read().rsplit(")", 1)[1].split()
  except OSError:
    return None
  return fields[0], int(fields[1]), int(fields[19])


def _descendants(pid: int) -> dict[int, int]:
  """Every live descendant of ``pid`` (from /proc's ppid fields): {pid: start time}."""
  children: dict[int, list[int]] = {}
  for name in os.listdir("/proc"):
    if name.isdigit() and (st := _proc_stat(int(name))) and st[0] != "Z":
      children.setdefault(st[1], []).append(int(name))
  out, todo = {}, [pid]
  while todo:
    for c in children.get(todo.pop(), []):
      if (st := _proc_stat(c)) is not None:
        out[c] = st[2]
        todo.append(c)
  return out


def _alive(procs: dict[int, int]) -> dict[int, str]:
  """The ones of ``procs`` ({pid: start time}) still running (not gone, not a zombie): their
  command lines."""
  out = {}
  for pid, start in procs.items():
    st = _proc_stat(pid)
    if st is not None and st[0] != "Z" and st[2] == start:  # the same process, not a reused pid
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        out[pid] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
  return out


def _lines(stream) -> queue.Queue:
  """The lines of ``stream`` as they arrive (None at its end), read on a daemon thread."""
  out: queue.Queue = queue.Queue()
  def read():
    for line in stream:
      out.put(line.strip())
    out.put(None)
  threading.Thread(target=read, daemon=True).start()
  return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads processes from /proc")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_c69_nothing_outlives_a_killed_run(tmp_path, sig):
  """C69: a checkpointed run over a GrainSource with one worker process (the Quickstart's
  input), signalled right after its first checkpoint: its Grain worker (``spawn_main``) and
  multiprocessing's resource tracker exit within 10 s of the run's death (measured: under 1 s).
  Before the fix both outlived a SIGKILL (still running 15 s later); SIGTERM saves and exits
  (rc 0) with nothing left, as before."""
  err = tmp_path / "stderr.txt"
  with open(err, "w") as err_file:
    proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "_grain_kill_worker.py"),
                             "--dir", str(tmp_path / "ckpt")], stdout=subprocess.PIPE,
                            stderr=err_file, text=True, env=bootstrap.env(), cwd=bootstrap.ROOT)
  lines = _lines(proc.stdout)
  started: dict[int, int] = {}
  try:
    line = lines.get(timeout=90)
    assert line is not None and line.startswith("SAVED"), (
        f"no SAVED line (rc={proc.poll()}): {err.read_text()[-3000:]}")
    started = _descendants(proc.pid)
    kinds = sorted("grain worker" if "spawn_main" in c else
                   "resource tracker" if "resource_tracker" in c else c
                   for c in _alive(started).values())
    assert kinds == ["grain worker", "resource tracker"]  # what the run started, all running
    proc.send_signal(sig)
    rc = proc.wait(timeout=60)
    died = time.monotonic()
    while _alive(started) and time.monotonic() - died < 10:
      time.sleep(0.1)
    left = _alive(started)
    assert not left, f"{time.monotonic() - died:.0f} s after the run died, still running: {left}"
    if sig == signal.SIGKILL:
      assert rc == -signal.SIGKILL
    else:
      assert (rc, lines.get(timeout=10).split()[:2]) == (0, ["DONE", "preempted"])
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
    for pid in _alive(started):  # a failed check's survivors: processes this test started
      os.kill(pid, signal.SIGKILL)


def test_device_count_is_eight_here():
  assert jax.device_count() == 8  # the 1 x 8 side of the comparisons above
