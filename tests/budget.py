"""The suite's two speed rules, used by the root conftest.py.

1. **Every slow test names its fast twin.** ``@pytest.mark.slow(held_by="FILE::TEST", reason=...)``:
   ``held_by`` is the default-suite test (path from the repository root, ``::`` and the
   function name, without parameters) that holds the same kind of fault, and it must be a
   collected test that is not itself slow. A slow mark without it, or naming a test that does
   not exist or is slow, is a usage error at collection.
2. **A time budget per default-suite test.** A test whose setup + call + teardown takes more
   than :data:`BUDGET_S` seconds must be listed, with its reason, in
   ``tests/durations_budget.txt`` (one ``FILE::TEST  # SECONDS s: reason`` per line, the
   seconds measured alone; the entry covers every parametrisation). An unlisted one is printed at the end of the session, and fails
   the session where the environment variable ``LOOPKIT_TEST_BUDGET_S`` is set: .ci/run sets
   it to the budget scaled to its two suites side by side on 2 cores.
"""

from __future__ import annotations

import ast
import collections
import os
import pathlib

import pytest

BUDGET_S = 20.0  # seconds, measured alone with the README's command on 2 cores
BUDGET_FILE = pathlib.Path(__file__).with_name("durations_budget.txt")
ROOT = pathlib.Path(__file__).resolve().parent.parent  # nodeids are relative to it

_durations: collections.Counter[str] = collections.Counter()


def _function_id(nodeid: str) -> str:
  """``tests/test_x.py::test_y[3-a]`` -> ``tests/test_x.py::test_y``."""
  return nodeid.split("[", 1)[0]


def _test_functions(path: str) -> dict[str, bool] | None:
  """The module-level test functions of ``path`` (from the repository root): name -> whether a
  decorator marks it slow. None where the file does not exist."""
  full = ROOT / path
  if not full.is_file():
    return None
  tree = ast.parse(full.read_text())
  return {node.name: any("mark.slow" in ast.unparse(d) for d in node.decorator_list)
          for node in tree.body if isinstance(node, ast.FunctionDef)}


def check_slow_marks(items) -> None:
  """Raises ``pytest.UsageError`` naming each collected ``slow`` test whose ``held_by`` is
  missing, names no test function of its file, or names one that is itself marked slow.

  The twins are read from the source files, so the check is the same whatever subset of the
  suite is selected."""
  wrong = []
  for item in items:
    mark = item.get_closest_marker("slow")
    if mark is None:
      continue
    held_by = mark.kwargs.get("held_by")
    if not held_by:
      wrong.append(f"{item.nodeid}: no held_by= (the default-suite test of the same kind)")
      continue
    for twin in [held_by] if isinstance(held_by, str) else held_by:
      path, _, name = twin.partition("::")
      functions = _test_functions(path)
      if functions is None or name not in functions:
        wrong.append(f"{item.nodeid}: held_by={twin!r} is not a test")
      elif functions[name]:
        wrong.append(f"{item.nodeid}: held_by={twin!r} is slow itself")
  if wrong:
    raise pytest.UsageError("slow marks (tests/budget.py):\n  " + "\n  ".join(sorted(set(wrong))))


def listed() -> dict[str, str]:
  """``tests/durations_budget.txt``: test -> reason."""
  out = {}
  for line in BUDGET_FILE.read_text().splitlines():
    name, _, reason = line.partition("#")
    if name.strip():
      out[name.strip()] = reason.strip()
  return out


def long_files_first(items) -> None:
  """Reorders ``items`` in place: the files with a test in the budget file first (longest
  listed seconds first), each file's tests in their order. xdist hands out files in this
  order, so the longest start first instead of ending the session on one worker."""
  weight: collections.Counter[str] = collections.Counter()
  for name, reason in listed().items():
    secs = reason.split(" s", 1)[0].rsplit(" ", 1)[-1]
    weight[name.split("::", 1)[0]] += float(secs) if secs.replace(".", "").isdigit() else 1.0
  order = {f: i for i, f in enumerate(dict.fromkeys(i.nodeid.split("::", 1)[0] for i in items))}
  items.sort(key=lambda i: (-weight[i.nodeid.split("::", 1)[0]],
                            order[i.nodeid.split("::", 1)[0]]))


def record(report) -> None:
  """Adds one phase's seconds to its test, if it is not slow (the xdist controller sees every
  worker's reports)."""
  if "PYTEST_XDIST_WORKER" not in os.environ and "slow" not in report.keywords:
    _durations[report.nodeid] += report.duration


def over_budget() -> list[tuple[str, float]]:
  """The tests over the budget that the budget file does not list, slowest first."""
  limit = float(os.environ.get("LOOPKIT_TEST_BUDGET_S") or BUDGET_S)
  known = listed()
  return sorted(((n, s) for n, s in _durations.items()
                 if s > limit and _function_id(n) not in known), key=lambda x: -x[1])


def over_budget_fails() -> bool:
  return bool(os.environ.get("LOOPKIT_TEST_BUDGET_S")) and bool(over_budget())


def report(terminalreporter) -> None:
  over = over_budget()
  if not over:
    return
  limit = float(os.environ.get("LOOPKIT_TEST_BUDGET_S") or BUDGET_S)
  terminalreporter.section(f"tests over {limit:g} s not listed in tests/durations_budget.txt")
  for name, secs in over:
    terminalreporter.write_line(f"{secs:7.1f} s  {name}")
  if os.environ.get("LOOPKIT_TEST_BUDGET_S"):
    terminalreporter.write_line("(this fails the session: make them faster, mark them slow with "
                                "held_by=, or list them with a reason)")
