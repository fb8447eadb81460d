"""The runner core of the benchmarks: what ``run.py`` (CPU devices) and ``gpu.py`` (one
accelerator) share.

* line-ups as data: :class:`Entry`, one system with its arguments and where it runs
  (``benchmarks.systems.build`` makes the systems);
* timing side by side: :func:`time_interleaved` times a line-up of systems in interleaved
  rounds (the order reversed every other round, each round at least ``min_round_secs`` of
  back-to-back runs per system), so that a load spike hurts every system alike;
* ratios: best rates, ratios of best rates, per-round ratios (:func:`round_ratio`) and their
  printing;
* the worker processes: their environment (:func:`worker_env`, ``XLA_FLAGS`` set before JAX
  starts) and the tagged JSON lines they print (:func:`emit`, :func:`parse`);
* the run's record: machine, load, package versions, commit, and the report and raw results
  written to disk (:func:`write_results`).

Stdlib only at import (the parent processes never import JAX); :func:`time_interleaved` runs in
a worker and imports :mod:`benchmarks.measure` there.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The per-step loops of the CPU line-up, the fastest of which the report compares against.
PER_STEP = ("per-step jit + prefetch", "per-step jit, numpy in", "per-step pmap")


def log(msg: str) -> None:
  """One progress line on stderr (stdout carries the workers' results and the report)."""
  print(msg, file=sys.stderr, flush=True)


# -- line-ups -------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Entry:
  """One system of a line-up: its class, its arguments, and where it runs.

  Attributes:
    cls: the system's class name in ``benchmarks/systems.py``, e.g. ``"Loopkit"``.
    kwargs: its keyword arguments after ``(w, data)``, as ``(name, value)`` pairs.
    workloads: the workload names it runs on (None: every workload).
    min_devices: the fewest devices it runs on.
    optional: the name of a package the system may lack (an ``ImportError`` while it is built
      leaves it out with a log line), or None (the error propagates).
  """

  cls: str
  kwargs: tuple[tuple[str, Any], ...] = ()
  workloads: tuple[str, ...] | None = None
  min_devices: int = 1
  optional: str | None = None


def entry(cls: str, workloads: tuple[str, ...] | None = None, min_devices: int = 1,
          optional: str | None = None, **kwargs: Any) -> Entry:
  """An :class:`Entry` with its keyword arguments given as keywords."""
  return Entry(cls, tuple(kwargs.items()), workloads, min_devices, optional)


# -- timing side by side ---------------------------------------------------------

def time_interleaved(systems: Sequence[Any], repeats: int, min_round_secs: float,
                     compiles: Callable[[], int], num_steps: int, tag: str = "",
                     verbose: bool = False) -> dict[str, dict[str, Any]]:
  """Times ``systems`` side by side in ``repeats`` interleaved rounds.

  In round r the systems run in their order (reversed when r is odd); in a round each system
  repeats ``timed()`` until ``min_round_secs`` is spent (at least once), so a 0.1 s run gets as
  many chances at a quiet moment as a 1 s one. Peak RSS is reset before every run.

  Args:
    systems: objects with ``name`` and ``timed() -> seconds`` (:mod:`benchmarks.systems`).
    repeats: rounds.
    min_round_secs: wall seconds of runs per system and round.
    compiles: the process's XLA compilation count so far (timed runs should add none).
    num_steps: S, the steps of one run (for the round log line's steps/s).
    tag: the log lines' prefix, e.g. ``"[1 dev mlp]"``.
    verbose: log every timed run.

  Returns:
    ``{name: {"times": [s, ...], "cpu": [process CPU s, ...], "round_times": [each round's
    best run, s], "peak_rss_mb": MiB, "timed_compiles": n}}``.
  """
  from benchmarks import measure  # noqa: PLC0415  (imports JAX: workers only)

  out = {s.name: {"times": [], "cpu": [], "round_times": [], "peak_rss_mb": 0.0,
                  "timed_compiles": 0} for s in systems}
  for r in range(repeats):
    order = systems if r % 2 == 0 else systems[::-1]
    for s in order:
      if verbose:
        log(f"{tag} timing {s.name}")
      got = out[s.name]
      spent, first_run = 0.0, len(got["times"])
      while spent < min_round_secs or spent == 0.0:
        measure.reset_peak_rss()
        c0 = compiles()
        p0 = time.process_time()
        t = s.timed()
        got["cpu"].append(time.process_time() - p0)
        got["times"].append(t)
        spent += t
        got["timed_compiles"] += compiles() - c0
        got["peak_rss_mb"] = max(got["peak_rss_mb"], measure.peak_rss_mb())
      got["round_times"].append(min(got["times"][first_run:]))
    log(f"{tag} round {r + 1}: " + ", ".join(
        f"{s.name} {num_steps / min(out[s.name]['times']):.0f}" for s in systems))
  return out


def timed_run(fn: Callable[[], Any]) -> tuple[Any, float, float]:
  """``fn()``'s result, wall seconds and process CPU seconds (all threads)."""
  p0, t0 = time.process_time(), time.perf_counter()
  result = fn()
  return result, time.perf_counter() - t0, time.process_time() - p0


# -- ratios ----------------------------------------------------------------------

def best_rate(row: dict) -> float:
  """Steps/s of a row's fastest run."""
  return row["steps"] / min(row["times"])


def find(rows: Iterable[dict], workload: str, devices: int, system: str) -> dict | None:
  """The row of ``system`` on ``workload`` at ``devices``, or None."""
  for r in rows:
    if (r["workload"], r["devices"], r["system"]) == (workload, devices, system):
      return r
  return None


def fmt_ratio(a: dict | None, b: dict | None) -> str:
  """Best rate of ``a`` over best rate of ``b``, two decimals ("" if either is missing)."""
  if a is None or b is None:
    return ""
  return f"{best_rate(a) / best_rate(b):.2f}"


def fastest_per_step(rows: list[dict], workload: str, devices: int) -> dict | None:
  """The fastest of the :data:`PER_STEP` rows (by best rate), or None."""
  found = [r for r in (find(rows, workload, devices, n) for n in PER_STEP) if r is not None]
  return max(found, key=best_rate) if found else None


def round_ratio(a: dict | None, b: dict | None) -> tuple[float, float, float, int] | None:
  """Steps/s of row ``a`` over row ``b``, round by round (each round's best run of each, the two
  timed in the same interleaved round): ``(median, min, max, rounds)``, or None."""
  if a is None or b is None or not a.get("round_times") or not b.get("round_times"):
    return None
  ratios = sorted((a["steps"] / ta) / (b["steps"] / tb)
                  for ta, tb in zip(a["round_times"], b["round_times"]))
  return statistics.median(ratios), ratios[0], ratios[-1], len(ratios)


def fmt_round_ratio(r: tuple[float, float, float, int] | None) -> str:
  """``"median [min-max]"`` of a :func:`round_ratio`, two decimals ("" for None)."""
  return "" if r is None else f"{r[0]:.2f} [{r[1]:.2f}-{r[2]:.2f}]"


def fmt(x: float | None, spec: str) -> str:
  """``format(x, spec)``, or an em dash for None."""
  return "—" if x is None else format(x, spec)


# -- worker processes ------------------------------------------------------------

def worker_env(drop_xla: Iterable[str] = (), add_xla: Iterable[str] = (),
               set_env: dict[str, str] | None = None,
               default_env: dict[str, str] | None = None) -> dict[str, str]:
  """This process's environment for a worker: ``XLA_FLAGS`` without the flags that contain a
  string of ``drop_xla``, plus ``add_xla``; ``set_env`` set, ``default_env`` where unset; the
  repository root first on ``PYTHONPATH``."""
  env = dict(os.environ)
  drop = tuple(drop_xla)
  flags = [f for f in env.get("XLA_FLAGS", "").split() if not any(d in f for d in drop)]
  env["XLA_FLAGS"] = " ".join(flags + list(add_xla))
  env.update(set_env or {})
  for name, value in (default_env or {}).items():
    env.setdefault(name, value)
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  return env


def emit(prefix: str, payload: Any) -> None:
  """One result line on stdout: ``prefix`` and ``payload`` as JSON."""
  print(prefix + json.dumps(payload), flush=True)


def parse(line: str, prefix: str) -> Any:
  """The payload of an :func:`emit` line with ``prefix``, or None for any other line."""
  return json.loads(line[len(prefix):]) if line.startswith(prefix) else None


# -- the record of a run ---------------------------------------------------------

def machine() -> dict:
  """nproc, CPU model (/proc/cpuinfo), RAM (/proc/meminfo), kernel."""
  cpu = "unknown"
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          cpu = line.split(":", 1)[1].strip()
          break
  except OSError:
    pass
  ram = "unknown"
  try:
    with open("/proc/meminfo") as f:
      kb = int(f.readline().split()[1])
      ram = f"{kb / 2**20:.1f} GiB"
  except OSError:
    pass
  return {"nproc": os.cpu_count(), "cpu": cpu, "ram": ram, "kernel": platform.release(),
          "python": platform.python_version()}


def loadavg() -> str:
  """The 1, 5 and 15 minute load averages (/proc/loadavg), or "unknown"."""
  try:
    with open("/proc/loadavg") as f:
      return " ".join(f.read().split()[:3])
  except OSError:
    return "unknown"


def versions(packages: Iterable[str], missing: str | None = "not installed",
             loopkit_imported: bool = True) -> dict[str, str]:
  """Installed versions of ``packages``; a missing one reads ``missing`` (None: left out).

  With ``loopkit_imported`` loopkit's is the imported package's ``__version__`` (a stale
  install's metadata can differ from the tree on PYTHONPATH).
  """
  out = {}
  for p in packages:
    if p == "loopkit" and loopkit_imported:
      import loopkit  # noqa: PLC0415

      out[p] = loopkit.__version__
      continue
    try:
      out[p] = importlib.metadata.version(p)
    except importlib.metadata.PackageNotFoundError:
      if missing is not None:
        out[p] = missing
  return out


def git_commit() -> str:
  """The checkout's commit (+ "dirty" with uncommitted changes), or "" without git."""
  try:
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT,
                          capture_output=True, text=True, timeout=20)
    if head.returncode != 0:
      return ""
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True, timeout=20).stdout.strip()
    return head.stdout.strip() + (" (with uncommitted changes)" if dirty else "")
  except (OSError, subprocess.SubprocessError):
    return ""


def nvidia_smi() -> str:
  """``nvidia-smi``'s name, driver and memory of each GPU, or "" without one."""
  try:
    out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                          "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
    return out.stdout.strip().replace("\n", "; ") if out.returncode == 0 else ""
  except (OSError, subprocess.SubprocessError):
    return ""


def write_results(report: str | None, report_path: str | None, raw_path: str | None,
                  meta: dict, results: Any) -> None:
  """Writes the markdown ``report`` (with a final newline) to ``report_path`` and
  ``{"meta", "results"}`` as JSON to ``raw_path``; a None path writes nothing."""
  if report_path and report is not None:
    with open(report_path, "w") as f:
      f.write(report + "\n")
  if raw_path:
    with open(raw_path, "w") as f:
      json.dump({"meta": meta, "results": results}, f, indent=1)
