"""tests/budget.py: a slow test names its default-suite twin; an unlisted test over the budget
fails a CI session. Each rule is run on a small suite of its own, through pytest in a
subprocess, with this repository's conftest.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import budget

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _suite(tmp_path, body: str, env_extra=None, *args: str) -> subprocess.CompletedProcess:
  """Runs ``body`` as tests/test_tiny.py under a copy of the root conftest.py and pyproject's
  pytest options (``-n 0``: in one process), returning the completed pytest process."""
  (tmp_path / "tests").mkdir(parents=True)
  for name in ("conftest.py", "pyproject.toml"):
    (tmp_path / name).write_text(open(os.path.join(ROOT, name)).read())
  for name in ("budget.py", "durations_budget.txt"):
    (tmp_path / "tests" / name).write_text(open(os.path.join(ROOT, "tests", name)).read())
  (tmp_path / "tests" / "test_tiny.py").write_text(textwrap.dedent(body))
  return subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "tests/test_tiny.py",
                         *args], cwd=tmp_path, env={**_clean_env(), **(env_extra or {})},
                        capture_output=True, text=True, timeout=120)


def _clean_env() -> dict[str, str]:
  """This environment without the CI budget and this session's xdist and pytest settings."""
  return {k: v for k, v in os.environ.items()
          if k not in ("LOOPKIT_TEST_BUDGET_S", "PYTEST_XDIST_WORKER", "PYTEST_ADDOPTS")}


_SLOW_MARKS = """
import pytest

def test_fast():
  pass

@pytest.mark.slow(held_by="tests/test_tiny.py::test_fast", reason="twin named")
def test_slow_ok():
  pass

@pytest.mark.slow
def test_slow_without_twin():
  pass

@pytest.mark.slow(held_by="tests/test_tiny.py::test_gone")
def test_slow_with_a_missing_twin():
  pass

@pytest.mark.slow(held_by="tests/test_tiny.py::test_slow_ok")
def test_slow_whose_twin_is_slow():
  pass
"""


def test_a_slow_mark_must_name_an_existing_default_suite_test(tmp_path):
  out = _suite(tmp_path, _SLOW_MARKS)
  assert out.returncode == 4, out.stdout + out.stderr  # pytest's usage error
  err = out.stdout + out.stderr
  assert "tests/test_tiny.py::test_slow_without_twin: no held_by=" in err
  assert "test_slow_with_a_missing_twin: held_by='tests/test_tiny.py::test_gone' is not a test" in err
  assert ("test_slow_whose_twin_is_slow: held_by='tests/test_tiny.py::test_slow_ok' is slow "
          "itself") in err
  assert "test_slow_ok:" not in err
  # one test selected: its twin is read from the file, not from what was collected
  one = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-m", "slow",
                        "tests/test_tiny.py::test_slow_ok"], cwd=tmp_path, env=_clean_env(),
                       capture_output=True, text=True, timeout=120)
  assert one.returncode == 0 and "1 passed" in one.stdout, one.stdout + one.stderr


_SLEEPER = """
import time

def test_sleeps():
  time.sleep(1.2)

def test_quick():
  pass
"""


def test_an_unlisted_test_over_the_budget_fails_only_where_ci_sets_it(tmp_path):
  ci = _suite(tmp_path / "ci", _SLEEPER, {"LOOPKIT_TEST_BUDGET_S": "1"})
  assert ci.returncode == 1, ci.stdout + ci.stderr
  assert "2 passed" in ci.stdout
  assert "tests over 1 s not listed in tests/durations_budget.txt" in ci.stdout
  listed_part = ci.stdout.split("not listed in tests/durations_budget.txt")[-1]
  assert "tests/test_tiny.py::test_sleeps" in listed_part and "test_quick" not in listed_part
  local = _suite(tmp_path / "local", _SLEEPER)  # budget 20 s: nothing over it, exit 0
  assert local.returncode == 0 and "not listed" not in local.stdout, local.stdout
  (tmp_path / "ci" / "tests" / "durations_budget.txt").write_text(
      "tests/test_tiny.py::test_sleeps  # sleeps on purpose\n")
  again = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "tests/test_tiny.py"],
                         cwd=tmp_path / "ci", env={**_clean_env(), "LOOPKIT_TEST_BUDGET_S": "1"},
                         capture_output=True, text=True, timeout=120)
  assert again.returncode == 0 and "not listed" not in again.stdout, again.stdout


def test_every_listed_test_exists_and_gives_a_reason():
  import ast
  for name, reason in budget.listed().items():
    path, _, func = name.partition("::")
    assert reason, f"{name}: no reason"
    tree = ast.parse(open(os.path.join(ROOT, path)).read())
    assert func in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}, name
