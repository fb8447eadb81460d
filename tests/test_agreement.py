"""The agreement (loopkit.core.agreement): the same answers on every process, through the
coordination service without waiting for the program in flight, the device fallback, and a
clear error for a process that does not answer."""

import pytest

from loopkit.core import agreement
from loopkit.tools import testing
from tests import multihost_workers as workers


def test_one_process_agrees_with_itself_without_communication():
  assert agreement.agree([True, False]) == [True, False]
  assert agreement.agree([]) == []
  assert agreement.agree_with_reason([False], "diverged") == ([False], "diverged")
  assert agreement.agree_with_reason([False], None) == ([False], None)


@pytest.fixture(scope="module")
def two_processes():
  return testing.run_processes(workers.agreement_paths, num_processes=2, devices_per_process=1,
                               timeout_s=240)


@pytest.mark.parametrize("path", ["service", "devices"])
def test_every_process_gets_the_or_and_the_lowest_index_reason(two_processes, path):
  expected = [[True, True, False], [[False], "from 1"], [[True], "from 0"], []]
  assert all(r["has_client"] for r in two_processes)
  assert [r[path] for r in two_processes] == [expected, expected]


def test_the_service_answers_while_the_program_runs_and_devices_wait_for_it(two_processes):
  for r in two_processes:
    service, devices = r["service_in_flight"], r["devices_in_flight"]
    print(f"agreement with a {service['program_secs']:.2f} s program in flight: service "
          f"{service['agree_secs'] * 1e3:.1f} ms, devices {devices['agree_secs'] * 1e3:.1f} ms")
    assert not service["ready_when_agreed"], service  # answered before the program ended
    assert devices["ready_when_agreed"], devices  # the all-gather queued behind it


def test_the_store_keeps_at_most_two_blocks_of_agreements(two_processes):
  """After 205 agreements (numbers 0-204), only those of the current and the previous
  block of 64 are kept (one directory delete per 64 agreements)."""
  for r in two_processes:
    rounds = r["rounds_in_store"]
    assert rounds[-1] == 204 and rounds[-1] - rounds[0] < 128, rounds
    assert rounds[0] % 64 == 0 and rounds == list(range(rounds[0], rounds[-1] + 1))


def test_a_process_that_does_not_answer_is_named(two_processes):
  late = two_processes[0]["late"]
  assert late is not None and late.startswith("process 1 did not answer agreement"), late
  assert "within 1 s (this is process 0)" in late
  assert two_processes[1]["late"] is None  # the late process found process 0's answer
