"""Test setup for tests/, doctests and examples: 8 fake CPU devices, set before JAX initialises.

On x86, XLA:CPU's generated code is capped at AVX2 (``--xla_cpu_max_isa=AVX2`` in
``XLA_FLAGS`` unless it names a cap already): under jax 0.12 an AVX-512 CPU rounds a step inside
loopkit's loop and under a per-step ``jit`` differently (docs/concepts.md, "AVX-512 CPUs under
jax 0.12"), and the bitwise comparisons with ``jit`` must not depend on the machine.

One persistent JAX compilation cache per session (a temporary directory, removed at the end):
every xdist worker and every subprocess a test starts (tests/bootstrap.py copies this
environment) loads a program that an earlier test compiled instead of compiling it again.
``lowering_count`` (the compile counts the tests assert) counts lowerings, which a cache hit
still does, so the counts do not change. A cache directory already set in the environment is
used as it is (and kept).

The default suite runs on ``min(cores, 4)`` xdist workers (pyproject's ``-n auto``), each test
file in one worker (``--dist loadfile``: a module's fixtures are built once); ``-n 0`` runs
in this process.

Two checks keep the suite fast and honest (:mod:`tests.budget`): a test marked ``slow`` must
name, as ``held_by=``, the default-suite test that holds the same kind; and a default-suite test
over the budget (``tests/durations_budget.txt``) that the file does not list fails the session
where ``LOOPKIT_TEST_BUDGET_S`` is set (.ci/run), and is reported otherwise.

Tests marked ``tf`` need TensorFlow and TFDS (extra ``data``): where either is not installed
(.ci/run's newest-JAX environment, extra ``test-notf``) they are skipped, so that plain
``pytest`` runs in both environments. Modules that import TensorFlow at the top skip themselves
at collection (``pytest.importorskip``).
"""

import importlib.util
import os
import platform
import shutil
import sys
import tempfile

import pytest

_FLAG = "--xla_force_host_platform_device_count=8"
ISA_FLAG = "--xla_cpu_max_isa=AVX2"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
# The AVX2 cap (module docstring; subprocesses inherit it): with AVX-512 code, jax 0.12 rounds
# test_conv_layout's net 3.0e-8 off its per-step jit after 3 steps. tests/test_conv_layout.py::
# test_native_isa_k_invariant_and_within_a_bound_of_jit runs without the cap.
if (platform.machine().lower() in ("x86_64", "amd64")
    and "xla_cpu_max_isa" not in os.environ["XLA_FLAGS"]):
  os.environ["XLA_FLAGS"] += " " + ISA_FLAG
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Set before JAX is imported (its config reads these at import) and before xdist starts its
# workers (they inherit this environment, so the whole session shares one directory).
_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _OWN_CACHE = tempfile.mkdtemp(prefix="loopkit-tests-jax-cache-")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
  # every program, however quick to compile (JAX's default keeps only those over 1 s)
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests"))
import budget  # pylint: disable=g-import-not-at-top,wrong-import-position  # noqa: E402

# Not test modules: Sphinx config, figure scripts, benchmark scripts.
collect_ignore = ["docs/conf.py"]
collect_ignore_glob = ["docs/scripts/*", "benchmarks/*"]

_MISSING_TF = [m for m in ("tensorflow", "tensorflow_datasets")
               if importlib.util.find_spec(m) is None]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
  """``-n auto``: one worker per core, at most 4 (each holds 8 fake devices and its programs)."""
  del config
  return max(1, min(os.cpu_count() or 1, 4))


@pytest.hookimpl(tryfirst=True)  # before ``-m 'not slow'`` deselects the slow tests
def pytest_collection_modifyitems(config, items):
  """Checks each ``slow`` mark's ``held_by``; skips the tests marked ``tf`` where TensorFlow or
  TFDS is not installed."""
  budget.check_slow_marks(items)
  budget.long_files_first(items)
  del config
  if not _MISSING_TF:
    return
  skip = pytest.mark.skip(reason=f"marked tf: needs {' and '.join(_MISSING_TF)} (extra `data`)")
  for item in items:
    if item.get_closest_marker("tf") is not None:
      item.add_marker(skip)


def pytest_runtest_logreport(report):
  budget.record(report)


def pytest_terminal_summary(terminalreporter):
  budget.report(terminalreporter)


def pytest_sessionfinish(session):
  if budget.over_budget_fails():
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_unconfigure(config):
  del config
  if _OWN_CACHE and "PYTEST_XDIST_WORKER" not in os.environ:  # the session's own, at its end
    shutil.rmtree(_OWN_CACHE, ignore_errors=True)
