"""Multi-host: real processes on localhost under jax.distributed (CPU collectives via gloo).

2 processes x 4 devices are compared with 1 process x 8 devices (this pytest
process, see conftest.py). The functions the processes run are in
tests/multihost_workers.py. Slow tests (a hung peer, the coordinator dying,
the ResNet example's cpu config) are marked ``slow``; the ResNet example's
preemption and bitwise resume, in a tiny form, is in the default suite.
"""

import json
import os
import re
import signal
import time

import jax
import numpy as np
import pytest

from loopkit.tools import testing
from tests import multihost_workers as workers

# Bitwise equality between 2 x 4 and 1 x 8 does not hold: the gradient and loss
# all-reduce over 8 devices adds the same 8 float32 partial sums, but XLA's
# in-process CPU all-reduce and the cross-process gloo all-reduce associate
# them differently, so they round differently (a few ulp per step; step 3's
# loss already differs in the last bit). Everything else is identical (data
# order, program, per-process halves), so the trajectories stay within float32
# noise: measured max |diff| after 12 Adam steps is 6e-8 for params of size
# ~0.5 (1 ulp); after 30 steps 1.7e-7. ATOL = 1e-6 leaves a 6x-15x margin and is
# still 1e4 below the size of one Adam update (lr 0.05). Within one process
# count, results are bitwise equal (across processes and across K).
ATOL = 1e-6
# How a process learns that its peer is gone: a failed gloo collective, or JAX's
# coordination service terminating it.
_PEER_GONE = r"Gloo \w+ failed|another task died|stopped sending heartbeats"


def assert_params_bitwise(a, b, what):
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=f"{what}: leaf {k}")


def assert_params_close(a, b, what):
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_allclose(a[k], b[k], rtol=0, atol=ATOL, err_msg=f"{what}: leaf {k}")


# -- training: 2 processes x 4 devices vs 1 process x 8 --------------------------------------

# the fourth: the accelerator paths (chunks assembled on the devices from batches placed as
# they come, full calls on the static-trip executable) forced on these CPU devices
ACCELERATOR_PATHS = {"chunk_assembly": "device", "full_call_loop": "static"}
VARIANTS = [(12, 5, "global"), (12, 1, "global"), (12, 5, "per_device"),
            (12, 5, "global", ACCELERATOR_PATHS)]


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory):
  """One launch, three trainings (global K=5 observed by writers, global K=1, per-device)."""
  logdir = tmp_path_factory.mktemp("logs")
  t0 = time.monotonic()
  runs = testing.run_processes(workers.train_variants, num_processes=2, devices_per_process=4,
                               args=(VARIANTS, str(logdir)), timeout_s=300)
  print(f"2 x 4, three 12-step trainings: {time.monotonic() - t0:.1f} s")
  return {"runs": runs, "logdir": logdir}


def test_training_equivalence_2x4_vs_1x8(two_process_runs):
  p0, p1 = (r[0] for r in two_process_runs["runs"])
  single = workers.train(12, 5, "global")
  for r in (p0, p1):
    assert (r["process_count"], r["device_count"], r["local_device_count"]) == (2, 8, 4)
    assert r["step"] == r["ledger_step"] == 12
    assert r["examples_seen"] == single["examples_seen"] == 12 * workers.GLOBAL_BATCH
    assert r["status"] == "completed" and r["compiles"] == 1
  assert_params_bitwise(p0["params"], p1["params"], "process 0 vs process 1")
  assert_params_close(p0["params"], single["params"], "2 x 4 vs 1 x 8")
  np.testing.assert_array_equal(p0["losses"], p1["losses"])
  np.testing.assert_allclose(p0["losses"], single["losses"], rtol=1e-6)
  assert len(p0["losses"]) == 12


def test_training_equivalence_per_device_style(two_process_runs):
  p0, p1 = (r[2] for r in two_process_runs["runs"])
  single = workers.train(12, 5, "per_device")
  assert_params_bitwise(p0["params"], p1["params"], "process 0 vs process 1")
  assert_params_close(p0["params"], single["params"], "2 x 4 vs 1 x 8 (per_device)")
  assert p0["step"] == 12 and p0["compiles"] == 1


def test_multi_process_result_does_not_depend_on_k(two_process_runs):
  k5, k1 = (two_process_runs["runs"][0][0], two_process_runs["runs"][0][1])
  assert_params_bitwise(k5["params"], k1["params"], "2 x 4: K=5 vs K=1")
  np.testing.assert_array_equal(k5["losses"], k1["losses"])


def test_accelerator_paths_on_two_processes(two_process_runs):
  """Device-assembled chunks and static-trip full calls: bitwise the default path's result on
  both processes, each process feeding its own rows, both executables compiled."""
  for runs in two_process_runs["runs"]:
    default, accel = runs[0], runs[3]
    assert_params_bitwise(default["params"], accel["params"], "2 x 4: accelerator paths")
    np.testing.assert_array_equal(default["losses"], accel["losses"])
    assert accel["seen"] == default["seen"] and accel["compiles"] == 2


def test_training_data_order_and_per_process_halves(two_process_runs):
  """Each process feeds its half of every global batch; together exactly the 1 x 8 batches."""
  p0, p1 = (r[0] for r in two_process_runs["runs"])
  single = workers.train(12, 5, "global")
  half = workers.GLOBAL_BATCH // 2
  assert len(p0["seen"]) == len(p1["seen"]) == len(single["seen"]) == 12
  for step, (a, b, whole) in enumerate(zip(p0["seen"], p1["seen"], single["seen"], strict=True)):
    assert len(a) == len(b) == half
    assert a + b == whole, f"step {step}"
    assert not set(a) & set(b)
  # The first epoch (10 steps x 16 = all 160 examples): disjoint and complete.
  epoch0 = [i for s in range(10) for i in p0["seen"][s] + p1["seen"][s]]
  assert sorted(epoch0) == list(range(workers.NUM_EXAMPLES))


def test_only_process_zero_writes_logs_tensorboard_and_progress(two_process_runs):
  logdir = two_process_runs["logdir"]
  p0, p1 = (r[0] for r in two_process_runs["runs"])
  files = sorted(os.listdir(logdir))
  events = [f for f in files if f.startswith("events.out.tfevents")]
  assert len(events) == 1, files  # one TensorBoard writer, not one per process
  rows = [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [5, 10, 12]  # written once each
  assert rows[-1]["examples_seen"] == 192
  np.testing.assert_allclose(rows[0]["loss"], np.mean(p0["losses"][:5]), rtol=1e-6)
  progress0 = (logdir / "progress_0.txt").read_text().splitlines()
  assert [line.split(" ")[1] for line in progress0] == ["0/12:", "5/12", "10/12", "12/12"]
  assert progress0[0] == (
      "step 0/12: waiting for the first batches, then compiling the first device call")
  assert (logdir / "progress_1.txt").read_text() == ""
  metric_lines = lambda r: [m for m in r["log_lines"] if m.startswith("step ")]
  assert metric_lines(p1) == []
  # One line per boundary: the ConsoleWriter's (LoggingHook does not log a second copy).
  assert [m.split(":")[0] for m in metric_lines(p0)] == ["step 5", "step 10", "step 12"]


# -- data shards and evaluation (C27) ------------------------------------------------------


def test_c27_shards_disjoint_complete_and_eval_exact():
  t0 = time.monotonic()
  out = testing.run_processes(workers.shards_and_eval, num_processes=4, devices_per_process=1,
                              args=(10, 8), timeout_s=180)
  print(f"4 x 1 shards + 2 evaluations: {time.monotonic() - t0:.1f} s")
  assert [len(r["examples"]) for r in out] == [3, 3, 2, 2]
  assert [r["bounds"] for r in out] == [(0, 3), (3, 6), (6, 8), (8, 10)]
  everything = [i for r in out for i in r["examples"]]
  assert sorted(everything) == list(range(10)) and len(set(everything)) == 10
  # Every process runs the same number of eval batches (short ones padded and masked).
  assert {r["num_batches"] for r in out} == {2}
  single = workers.shards_and_eval(10, 8)  # 1 process x 8 devices
  for r in out + [single]:
    assert r["compiles"] == 1
    for e in r["eval"]:
      assert e["num_examples"] == 10 and e["num_batches"] == 2
      assert e["totals"] == {"scaled": 90.0, "x": 45.0}
      assert e["metrics"] == {"scaled": 9.0, "x": 4.5}


# -- agreement at each boundary (C30) --------------------------------------------------------


def test_c30_wall_clock_hooks_fire_at_the_same_steps_on_every_process(tmp_path):
  """20 repeats, process 0 slowed: both processes fire every_secs hooks (a callback and a
  checkpoint) at identical steps, and no collective ever mismatches (every run completes)."""
  pytest.importorskip("orbax.checkpoint")
  t0 = time.monotonic()
  p0, p1 = testing.run_processes(workers.wall_clock_hooks, num_processes=2,
                                 devices_per_process=4, args=(str(tmp_path / "ckpt"),),
                                 kwargs={"cache_dir": str(tmp_path / "jax_cache")},
                                 timeout_s=420)
  print(f"C30, 2 x 4, 20 repeats: {time.monotonic() - t0:.1f} s; one agreement costs "
        f"{p0['agree_secs'] * 1e6:.0f} us (process 0), {p1['agree_secs'] * 1e6:.0f} us "
        "(process 1) on 2 processes")
  assert p0["status"] == p1["status"] == [("completed", 24)] * 20
  assert p0["callback"] == p1["callback"]
  assert p0["saved"] == p1["saved"]
  # The clocks really decided: the time marks fired inside the runs, at varying steps.
  assert all(steps for steps in p0["callback"]) and all(s[-1] == 24 for s in p0["saved"])
  assert any(len(s) > 1 for s in p0["saved"])
  assert "2 processes would run calls of different lengths" in p0["time_based_k_error"]
  from loopkit.core.agreement import agree
  assert agree([True, False]) == [True, False]  # one process: the local answer


STOP_PLANS = [{0: "enough"}, {1: "diverged on 1"}, {1: "late", 0: "first"}, {}]


def test_a_stop_reason_requested_on_one_process_reads_the_same_on_every_process():
  """Item 9: process 0 alone, process 1 alone, both (process 0's reason wins), neither."""
  p0, p1 = testing.run_processes(workers.stop_reasons, num_processes=2, devices_per_process=2,
                                 args=(STOP_PLANS,), timeout_s=240)
  want = [("enough", 6), ("diverged on 1", 6), ("first", 6), ("completed", 8)]
  assert p0 == p1 == want
  assert workers.stop_reasons(STOP_PLANS[:1]) == want[:1]  # one process: its own reason


# -- checkpoints and preemption -------------------------------------------------------------


def test_preemption_sigterm_to_one_process_both_stop_and_save_the_same_step(tmp_path):
  """SIGTERM reaches process 1 only; both stop at step 4 (cadence 6) and save it.

  Then 1 process x 8 devices resumes from that checkpoint (saved by 2 processes).
  """
  ckpt, marker = tmp_path / "ckpt", tmp_path / "marker"
  marker.mkdir()
  t0 = time.monotonic()
  with testing.ProcessGroup(workers.train_until_sigterm, num_processes=2,
                            devices_per_process=4, args=(str(ckpt), str(marker))) as group:
    while not (marker / "ready").exists():  # process 1 waits at step 4
      assert all(c is None for c in group.poll()), group.check(group.wait(1))
      assert time.monotonic() - t0 < 120, "process 1 never reached step 4"
      time.sleep(0.02)
    group.send_signal(1, signal.SIGTERM)
    results = group.wait(timeout_s=120)
    p0, p1 = group.check(results)  # both exited 0: a clean stop, not a crash
  print(f"2 x 4 preemption run: {time.monotonic() - t0:.1f} s")
  assert (p1["signal_received"], p1["requested"]) == (signal.SIGTERM, True)
  assert (p0["signal_received"], p0["requested"]) == (None, False)  # told by agreement
  for r in (p0, p1):
    assert r["status"] == "preempted"
    assert r["step"] == r["ledger_step"] == 4
    assert r["saved_steps"] == [4] and r["all_steps"] == [4]
    assert r["sigterm_handler_restored"]
  assert_params_bitwise(p0["params"], p1["params"], "process 0 vs process 1")

  resumed = workers.train_checkpointed(str(ckpt), 12)  # 1 x 8 restores the 2 x 4 checkpoint
  assert resumed["restored"]["step"] == 4 and resumed["restored_step"] == 4
  assert resumed["restored"]["data_position"] == 4
  assert_params_bitwise(resumed["restored"]["params"], p0["params"], "restored vs saved")
  assert resumed["step"] == 12 and resumed["examples_seen"] == 192
  assert resumed["saved_steps"] == [6, 12] and resumed["compiles"] == 1
  assert resumed["seen"] == workers.train(12, 3)["seen"][4:]  # the next unconsumed batch
  assert_params_close(resumed["params"], workers.train(12, 3)["params"],
                      "preempted 2 x 4 + resumed 1 x 8 vs uninterrupted 1 x 8")


def test_checkpoint_1x8_to_2x4_and_back(tmp_path):
  """1 x 8 saves step 6; 2 x 4 restores it and saves 12; 1 x 8 restores 12 exactly."""
  first = workers.train_checkpointed(str(tmp_path), 6)
  assert first["all_steps"] == [6]
  t0 = time.monotonic()
  p0, p1 = testing.run_processes(workers.train_checkpointed, num_processes=2,
                                 devices_per_process=4, args=(str(tmp_path), 12),
                                 timeout_s=300)
  print(f"2 x 4 restore + 6 steps + save: {time.monotonic() - t0:.1f} s")
  for r in (p0, p1):
    assert r["restored_step"] == 6 and r["restored"]["data_position"] == 6
    assert_params_bitwise(r["restored"]["params"], first["params"], "2 x 4 restored vs saved")
    assert r["step"] == 12 and r["saved_steps"] == [12] and r["all_steps"] == [6, 12]
  assert_params_bitwise(p0["params"], p1["params"], "process 0 vs process 1")
  whole = workers.train(12, 3)
  assert [p0["seen"][s] + p1["seen"][s] for s in range(6)] == whole["seen"][6:]
  back = workers.train_checkpointed(str(tmp_path), 12)  # nothing left to run
  assert back["restored"]["step"] == 12 and back["step"] == 12
  assert_params_bitwise(back["restored"]["params"], p0["params"], "1 x 8 restored vs 2 x 4")
  assert_params_close(p0["params"], whole["params"], "1x8 + 2x4 vs uninterrupted 1x8")


# -- a process dies ------------------------------------------------------------------------


def test_one_process_dies_the_other_fails_quickly_with_a_clear_error():
  t0 = time.monotonic()
  with testing.ProcessGroup(workers.train_and_die, num_processes=2, devices_per_process=4,
                            args=(1,), heartbeat_timeout_s=5) as group:
    results = group.wait(timeout_s=120, stop_on_failure=False)  # let process 0 fail by itself
  print(f"process 1 died at {results[1].wall_s:.1f} s, process 0 failed at "
        f"{results[0].wall_s:.1f} s (total {time.monotonic() - t0:.1f} s)")
  r0, r1 = results
  assert r1.returncode == 17 and "process 1 exits at step 4" in r1.stdout
  assert not r0.killed and r0.returncode not in (0, None)
  assert r0.wall_s - r1.wall_s < 5 + 15  # heartbeat timeout + margin
  # Process 0 waits in the boundary's all-gather: gloo sees the peer's socket close
  # ("Gloo AllGather failed: ... Connection reset by peer" in our runs); failing that,
  # JAX's coordination service terminates it.
  assert re.search(_PEER_GONE, r0.stderr), r0.stderr[-3000:]
  with pytest.raises(testing.MultiProcessError, match="process 1: exit 17") as e:
    group.check(results)
  assert re.search(_PEER_GONE, str(e.value))


@pytest.mark.slow(held_by="tests/test_multihost.py::test_one_process_dies_the_other_fails_quickly_with_a_clear_error",
                  reason="waits out a 5 s heartbeat timeout and JAX's teardown")
def test_a_hung_process_is_detected_by_heartbeat(tmp_path):
  """SIGSTOP (a frozen host: sockets stay open) -> JAX terminates the other process."""
  marker = tmp_path / "marker"
  marker.mkdir()
  with testing.ProcessGroup(workers.train_until_sigterm, num_processes=2,
                            devices_per_process=4, heartbeat_timeout_s=5,
                            args=(str(tmp_path / "ckpt"), str(marker))) as group:
    t0 = time.monotonic()
    while not (marker / "ready").exists():
      assert time.monotonic() - t0 < 120
      time.sleep(0.02)
    group.send_signal(1, signal.SIGSTOP)
    t_stop = time.monotonic()
    results = group.wait(timeout_s=180, failure_grace_s=0)
    detected = time.monotonic() - t_stop
  print(f"hung process detected after {detected:.1f} s (heartbeat timeout 5 s)")
  r0, r1 = results
  assert r0.returncode == -signal.SIGABRT and not r0.killed
  assert "detected fatal errors" in r0.stderr and "stopped sending heartbeats" in r0.stderr
  assert r1.killed
  assert detected < 5 + 20


@pytest.mark.slow(held_by="tests/test_multihost.py::test_one_process_dies_the_other_fails_quickly_with_a_clear_error",
                  reason="waits out a 5 s heartbeat timeout")
def test_the_coordinator_process_dies():
  with testing.ProcessGroup(workers.train_and_die, num_processes=2, devices_per_process=4,
                            args=(0,), heartbeat_timeout_s=5) as group:
    results = group.wait(timeout_s=120, stop_on_failure=False)
  r0, r1 = results
  assert r0.returncode == 17
  assert not r1.killed and r1.returncode not in (0, None)
  assert r1.wall_s - r0.wall_s < 5 + 15


# -- the ResNet example ----------------------------------------------------------------------

_RESNET_MAIN = os.path.join(os.path.dirname(__file__), "..", "examples", "resnet50", "main.py")


@pytest.mark.slow(held_by="tests/test_multihost.py::test_training_equivalence_2x4_vs_1x8",
                  reason="the ResNet-18 example on 2 processes")
@pytest.mark.skipif(not os.path.exists(_RESNET_MAIN), reason="examples/resnet50 not present")
def test_resnet_example_cpu_config_on_two_processes(tmp_path):
  """examples/resnet50 (configs/cpu.py) as 2 processes x 4 devices, a few steps.

  The same as ``python -m loopkit.tools.testing -n 2 -d 4 examples.resnet50.main --workdir=...``.
  """
  pytest.importorskip("tensorflow_datasets")
  from examples.resnet50 import config_checks, digits_tfds
  from examples.resnet50.configs import cpu

  data_dir = str(tmp_path / "tfds")
  # once, not by two processes at the same time; as ArrayRecord: the CPU config reads through Grain
  digits_tfds.ensure_prepared(data_dir, file_format=config_checks.file_format(cpu.get_config()))
  workdir = tmp_path / "work"
  args = [f"--workdir={workdir}", f"--config.data_dir={data_dir}",
          "--config.num_train_steps=4", "--config.iterations_per_loop=2",
          "--config.eval_every_epochs=0", "--config.checkpoint_every_epochs=0",
          "--config.checkpoint_every_steps=2"]
  t0 = time.monotonic()
  # unsafe_rbg draws the initial weights (as workers.resnet_example does): the eager init's
  # programs compile several times faster than threefry's; nothing asserted here is a value
  assert testing.run_processes("examples.resnet50.main", num_processes=2, devices_per_process=4,
                               args=args, env={"JAX_DEFAULT_PRNG_IMPL": "unsafe_rbg"},
                               timeout_s=1200, heartbeat_timeout_s=100) == [None, None]
  print(f"ResNet example, 2 x 4, 4 steps + eval: {time.monotonic() - t0:.1f} s")
  r = json.loads((workdir / "results.json").read_text())
  assert (r["step"], r["num_devices"], r["status"], r["compile_count"]) == (4, 8, "completed", 1)
  assert r["eval_count"] == 360  # every test digit exactly once across the 2 processes' splits
  assert r["ledger"]["examples_seen"] == 4 * r["global_batch_size"]
  assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "4", "TRAIN_COMPLETE"]
  assert len([f for f in os.listdir(workdir) if f.startswith("events.out")]) == 1
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  train_steps = [row["step"] for row in rows if "loss" in row]
  eval_steps = [row["step"] for row in rows if "eval/accuracy" in row]
  # Each row written once (by process 0): no step repeats.
  assert eval_steps[-1] == train_steps[-1] == 4
  assert eval_steps == sorted(set(eval_steps)) and train_steps == sorted(set(train_steps))
  assert {row["eval/num_examples"] for row in rows if "eval/accuracy" in row} == {360}


RESNET_STEPS, RESNET_PREEMPT_AT = 8, 6  # K = 2, a checkpoint every 4 steps


@pytest.mark.slow(held_by="tests/test_multihost.py::test_preemption_sigterm_to_one_process_both_stop_and_save_the_same_step",
                  reason="3 runs of the ResNet example on 2 processes: 100 s alone")
@pytest.mark.skipif(not os.path.exists(_RESNET_MAIN), reason="examples/resnet50 not present")
def test_resnet_example_preempted_on_two_processes_resumes_bitwise(tmp_path):
  """The ResNet example's train_and_evaluate as 2 processes x 4 devices, tiny (digits 8x8).

  Its data path is the CPU config's: ArrayRecord through Grain, one Grain worker
  process per process, each process reading only its rows of the global batch.

  A run waits at step 6 until SIGTERM reaches BOTH processes; both stop at 6
  ("preempted") and save it (beside the cadence's 4). A resume (2 x 4 again)
  to step 8 then ends bitwise equal to an uninterrupted 2 x 4 run: params,
  BatchNorm statistics and optimizer state, leaf by leaf, and the ledger.
  """
  pytest.importorskip("tensorflow_datasets")
  pytest.importorskip("orbax.checkpoint")
  from examples.resnet50 import config_checks, digits_tfds
  from examples.resnet50.configs import cpu

  data_dir, cache_dir = str(tmp_path / "tfds"), str(tmp_path / "jax_cache")
  # once, not by two processes at the same time; as ArrayRecord: the CPU config reads through Grain
  digits_tfds.ensure_prepared(data_dir, file_format=config_checks.file_format(cpu.get_config()))
  work, marker = tmp_path / "preempted", tmp_path / "marker"
  marker.mkdir()
  t0 = time.monotonic()
  with testing.ProcessGroup(workers.resnet_example, num_processes=2, devices_per_process=4,
                            args=(str(work), data_dir, RESNET_STEPS),
                            kwargs={"wait_at_step": RESNET_PREEMPT_AT,
                                    "marker_dir": str(marker), "cache_dir": cache_dir},
                            heartbeat_timeout_s=60) as group:
    while not all((marker / f"ready_{p}").exists() for p in (0, 1)):  # both wait at step 6
      assert all(c is None for c in group.poll()), group.check(group.wait(1))
      assert time.monotonic() - t0 < 300, f"the processes never reached step {RESNET_PREEMPT_AT}"
      time.sleep(0.05)
    t_ready = time.monotonic()
    for p in (0, 1):
      group.send_signal(p, signal.SIGTERM)
    p0, p1 = group.check(group.wait(timeout_s=t_ready - t0 + 120))  # both exit 0: clean stops
  t_preempted = time.monotonic()
  for r in (p0, p1):
    assert r["signal_received"] == signal.SIGTERM
    assert r["status"] == "preempted"
    assert r["step"] == r["ledger"]["step"] == RESNET_PREEMPT_AT
    assert r["ledger"]["examples_seen"] == RESNET_PREEMPT_AT * r["global_batch_size"]
    assert r["checkpoints"] == [4, RESNET_PREEMPT_AT] and r["restored_step"] is None
    # a preemption stops without evaluating (no eval row at 6: the resume evaluates at 8)
    assert r["eval_count"] is None and r["eval_history"] == [] and r["compile_count"] == 1
  assert_bitwise_tree(p0["state"], p1["state"], "preempted: process 0 vs 1")

  q0, q1 = testing.run_processes(workers.resnet_resume_and_reference, num_processes=2,
                                 devices_per_process=4,
                                 args=(str(work), str(tmp_path / "whole"), data_dir,
                                       RESNET_STEPS, cache_dir),
                                 timeout_s=300, heartbeat_timeout_s=60)
  t_end = time.monotonic()
  print(f"ResNet example 2 x 4: preempted run {t_preempted - t0:.1f} s (SIGTERM at "
        f"{t_ready - t0:.1f} s), resume + uninterrupted run {t_end - t_preempted:.1f} s, "
        f"total {t_end - t0:.1f} s")
  for (resumed, whole), before in (((q0[0], q0[1]), p0), ((q1[0], q1[1]), p1)):
    assert resumed["restored_step"] == RESNET_PREEMPT_AT and whole["restored_step"] is None
    for r in (resumed, whole):
      assert r["status"] == "completed" and r["step"] == RESNET_STEPS
      assert r["ledger"]["examples_seen"] == RESNET_STEPS * r["global_batch_size"]
      assert r["compile_count"] == 1
    assert resumed["checkpoints"] == [4, RESNET_PREEMPT_AT, RESNET_STEPS]
    assert whole["checkpoints"] == []
    ledger = lambda r: {k: v for k, v in r["ledger"].items() if k != "seconds"}
    assert ledger(resumed) == ledger(whole)  # step, epoch, examples seen, device calls
    # Steps 7-8 changed each part of the state, so the equality below is not the saved one's.
    for part in ("params", "batch_stats", "opt_state"):
      moved = jax.tree.map(lambda a, b: not np.array_equal(a, b),
                           getattr(before["state"], part), getattr(whole["state"], part))
      assert any(jax.tree.leaves(moved)), part
    assert_bitwise_tree(resumed["state"], whole["state"],
                        "preempted + resumed vs uninterrupted (2 x 4)")
    assert resumed["eval_accuracy"] == whole["eval_accuracy"]
  assert_bitwise_tree(q0[0]["state"], q1[0]["state"], "resumed: process 0 vs 1")


# -- preemption while the next chunk is read from a slow source -------------------------------

SLOW_SECS = 0.5  # per batch of workers.slow_shard after the first chunk (K = 8: 4 s a chunk)
# The signal goes out as batch 10 (the 3rd of steps 9-16) is read; the main thread waits for
# the chunk in the feeder (workers.train_slow_until_sigterm reads it after the first call).
MARK_AT = workers.SLOW_K + 2


def _read_markers(marker, processes) -> dict[int, float] | None:
  """The ``time.time()`` each process started reading batch MARK_AT, once all have."""
  times = {}
  for p in processes:
    f = marker / f"reading_{p}"
    text = f.read_text() if f.exists() else ""
    if not text:
      return None
    times[p] = float(text)
  return times


@pytest.mark.parametrize("signalled", [(0, 1), (1,)], ids=["both", "process1"])
def test_preemption_while_a_slow_chunk_forms_on_two_processes(tmp_path, signalled):
  """2 x 4, K=8, a source of 0.3 s batches: SIGTERM while the 2nd chunk (steps 9-16) is read.

  Both processes stop at step 8 (the last completed boundary) and save it with
  data position 8: the batches read into the abandoned (or, on an unsignalled
  process, the completed but discarded) chunk are not counted. A signalled
  process abandons its chunk after the batch in flight; an unsignalled one
  learns of the preemption only at the agreement, after forming its whole
  chunk (the documented limitation, docs/multihost.md), so with one process
  signalled both stop only when process 0's chunk is complete. The resumed
  2 x 4 run reaches bitwise the state of an uninterrupted 2 x 4 run, having
  consumed every batch exactly once, in order.
  """
  ckpt, marker, cache = tmp_path / "ckpt", tmp_path / "marker", str(tmp_path / "jax_cache")
  marker.mkdir()
  t0 = time.monotonic()
  with testing.ProcessGroup(workers.train_slow_until_sigterm, num_processes=2,
                            devices_per_process=4, args=(str(ckpt), str(marker)),
                            kwargs={"secs": SLOW_SECS, "mark_at": MARK_AT,
                                    "cache_dir": cache}) as group:
    while (marks := _read_markers(marker, (0, 1))) is None:  # both read the 2nd chunk
      assert all(c is None for c in group.poll()), group.check(group.wait(1))
      assert time.monotonic() - t0 < 120, f"the processes never reached batch {MARK_AT}"
      time.sleep(0.01)
    t_signal = time.time()
    for p in signalled:
      group.send_signal(p, signal.SIGTERM)
    while any(c is None for c in group.poll()):
      assert time.time() - t_signal < 60, "the processes did not exit after SIGTERM"
      time.sleep(0.01)
    t_exit = time.time()
    p0, p1 = group.check(group.wait(timeout_s=120))  # both exited 0: a clean stop
  stop = [r["stop_time"] - t_signal for r in (p0, p1)]
  ret = [r["return_time"] - t_signal for r in (p0, p1)]
  # Seconds each process still needed at the signal to read the chunk's batches 10-15.
  rest = [(2 * workers.SLOW_K - MARK_AT) * SLOW_SECS - (t_signal - marks[p]) for p in (0, 1)]
  print(f"\nsignalled {signalled}: processes read batch {MARK_AT} at "
        f"{[round(marks[p] - t_signal, 3) for p in (0, 1)]} s; rest of the chunk "
        f"{[round(s, 2) for s in rest]} s; after SIGTERM: agreed to stop "
        f"{[round(s, 2) for s in stop]} s, run() returned {[round(s, 2) for s in ret]} s, "
        f"both exited {t_exit - t_signal:.2f} s; pulled {p0['pulled']}, {p1['pulled']}; "
        f"whole launch {time.monotonic() - t0:.1f} s")
  for p, r in enumerate((p0, p1)):
    if p in signalled:
      assert (r["signal_received"], r["requested"]) == (signal.SIGTERM, True)
    else:
      assert (r["signal_received"], r["requested"]) == (None, False)  # told by agreement
    assert r["status"] == "preempted"
    assert r["step"] == r["ledger_step"] == r["stop_step"] == workers.SLOW_K  # step 8
    assert r["saved_steps"] == [8] and r["all_steps"] == [8]
    assert r["data_position"] == 8  # batches the device consumed, not batches read
    assert r["compiles"] == 1
    seen = r["state"]["seen"]
    np.testing.assert_array_equal(seen[:8].ravel(), np.arange(8 * workers.GLOBAL_BATCH))
    assert (seen[8:] == -1).all()
    in_flight_at_signal = t_signal - marks[p] < SLOW_SECS - 0.05  # still reading batch 10
    if p in signalled:  # batches 8-10 read into the abandoned chunk; batch 11 never started
      assert r["pulled"] == 11 if in_flight_at_signal else 11 <= r["pulled"] <= 12
    else:  # the whole chunk (batches 8-15) was read, then discarded at the agreement
      assert r["pulled"] >= 16
  assert_params_bitwise(p0["state"]["params"], p1["state"]["params"], "process 0 vs 1")
  assert min(rest) > 2.0, f"the signal came late: {rest}"  # the test's set-up, not loopkit
  if signalled == (0, 1):
    # The feeder does not wait for the batch in flight (its 50 ms poll, then the
    # all-gather): bounded generously by two batch times, well under the rest of the chunk.
    assert max(stop) < 3 * SLOW_SECS, (stop, rest)  # well under the ~3 s left in the chunk
  else:
    # Process 0 reads the rest of its chunk before it reaches the agreement (it learns of
    # the preemption only there); process 1 waits for it in the all-gather.
    assert min(stop) > rest[0] - 0.1, (stop, rest)
    assert max(stop) < rest[0] + 2.0, (stop, rest)
  assert t_exit - t_signal < max(stop) + 20  # checkpoint write, shutdown, interpreter exit

  t1 = time.monotonic()
  q0, q1 = testing.run_processes(workers.resume_slow, num_processes=2, devices_per_process=4,
                                 args=(str(ckpt),), kwargs={"cache_dir": cache},
                                 timeout_s=180)
  print(f"2 x 4 resume + uninterrupted reference: {time.monotonic() - t1:.1f} s")
  for r, before in ((q0, p0), (q1, p1)):
    assert r["restored"]["step"] == r["restored_step"] == 8
    assert r["restored"]["data_position"] == 8
    assert_bitwise_tree(r["restored"]["state"], before["state"], "restored vs saved")
    assert r["status"] == "completed" and r["step"] == workers.SLOW_STEPS
    assert r["data_position"] == r["pulled"] == workers.SLOW_STEPS  # skipped 8, read 16
    assert r["saved_steps"] == [workers.SLOW_STEPS]
    seen = r["state"]["seen"]  # every batch consumed exactly once, in order
    np.testing.assert_array_equal(seen.ravel(),
                                  np.arange(workers.SLOW_STEPS * workers.GLOBAL_BATCH))
    ref = r["reference"]
    assert ref["status"] == "completed" and ref["step"] == workers.SLOW_STEPS
    assert_bitwise_tree(r["state"], ref["state"], "preempted + resumed vs uninterrupted 2 x 4")
  assert_bitwise_tree(q0["state"], q1["state"], "process 0 vs 1 after the resume")


def assert_bitwise_tree(a, b, what):
  assert jax.tree.structure(a) == jax.tree.structure(b), what
  for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b),
                          strict=True):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape, f"{what}: {jax.tree_util.keystr(path)}"
    assert x.tobytes() == y.tobytes(), f"{what}: {jax.tree_util.keystr(path)}"
