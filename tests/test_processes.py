"""The multi-process launcher (loopkit.tools.processes, through loopkit.tools.testing):
topology and arguments, string and module targets, a failing process, a timeout, targets a
child cannot import. Training across processes: tests/test_multihost.py."""

import json
import signal
import time

import pytest

from loopkit.tools import testing
from tests import multihost_workers as workers


def test_run_processes_topology_and_arguments():
  t0 = time.monotonic()
  out = testing.run_processes(workers.topology, num_processes=2, devices_per_process=4,
                              args=("hello",), kwargs={"scale": 10}, timeout_s=120)
  print(f"2 x 4 start-up and all-gather: {time.monotonic() - t0:.1f} s")
  for i, r in enumerate(out):
    assert r["tag"] == "hello"
    assert (r["process_index"], r["process_count"], r["device_count"]) == (i, 2, 8)
    assert r["device_processes"] == [0] * 4 + [1] * 4 and r["local_is_slice"]
    assert r["platform"] == "cpu" and r["collectives"] == "gloo"
    assert r["gathered"] == [0, 10]


def test_run_processes_accepts_a_string_target_and_a_module(tmp_path):
  out = testing.run_processes("tests.multihost_workers:topology", num_processes=2,
                              args=("s",), timeout_s=120)
  assert [r["process_index"] for r in out] == [0, 1]
  assert testing.run_processes("tests.multihost_workers", num_processes=2,
                               args=(str(tmp_path), "m"), timeout_s=120) == [None, None]
  for i in range(2):
    r = json.loads((tmp_path / f"main_{i}.json").read_text())
    assert (r["tag"], r["process_index"], r["device_count"]) == ("m", i, 2)


def test_a_failing_process_is_named_with_its_traceback_and_the_others_killed():
  t0 = time.monotonic()
  with pytest.raises(testing.MultiProcessError) as e:
    testing.run_processes(workers.fail_on, num_processes=2, args=(1, "bad shard 7"),
                          timeout_s=120)
  elapsed = time.monotonic() - t0
  msg = str(e.value)
  assert "process 1: exit 1 after" in msg and "ValueError: bad shard 7" in msg
  assert "process 0: killed by loopkit.tools.testing" in msg  # it was sleeping for 120 s
  assert "--- process 1 stderr" in msg and 'raise ValueError(message)' in msg
  r0, r1 = e.value.results
  assert r0.killed and not r1.killed and r1.returncode == 1 and "bad shard 7" in r1.error
  assert elapsed < 60, elapsed
  assert not isinstance(e.value, testing.MultiProcessTimeout)


def test_timeout_kills_and_reports():
  t0 = time.monotonic()
  with pytest.raises(testing.MultiProcessTimeout, match=r"timed out after 4 s") as e:
    testing.run_processes(workers.sleep, num_processes=1, args=(600,), timeout_s=4)
  assert time.monotonic() - t0 < 20
  assert e.value.results[0].killed and e.value.results[0].returncode == -signal.SIGKILL


def test_unimportable_targets_are_rejected_before_launch():
  with pytest.raises(ValueError, match="cannot be imported by a child process"):
    testing.run_processes(lambda: 1)

  def local():
    return 1

  with pytest.raises(ValueError, match="module level"):
    testing.ProcessGroup(local)
