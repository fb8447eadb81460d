"""Side-by-side benchmark: loopkit against a per-step loop, Keras and the limit.

Usage (from the repository root)::

  python benchmarks/run.py                 # full run, writes benchmarks/RESULTS.md
  python benchmarks/run.py --quick         # short smoke run, prints only
  nox -s bench

The runner starts one worker process per device count (1 and 8 fake CPU
devices: ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` and
``KERAS_BACKEND=jax`` are set in the worker's environment before JAX or Keras
is imported). A worker builds every system for a workload, runs each once to
compile and warm it, then times ``--repeats`` rounds with the systems
interleaved inside each round and keeps each system's best round, so that a
load spike on a shared machine hurts every system alike. The runner prints one
markdown report and (unless ``--no-save``) writes it with the date, machine,
load average, command and package versions to ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "RESULTS.md")
RAW = os.path.join(ROOT, "benchmarks", "results.json")  # the measurements behind RESULTS.md
PACKAGES = ["jax", "jaxlib", "flax", "optax", "keras", "numpy", "loopkit"]
KS = (1, 10, 100)
# Steps per timed run, S, by (workload, device count): the same for every system. S >= 2 x 100
# so that K=100 makes more than one call per run.
DEFAULT_STEPS = {("mlp", 1): 5000, ("mlp", 8): 1000, ("cnn", 1): 300, ("cnn", 8): 200}
CNN_MAX_REPEATS = 2

# Targets from the issue (CPU, MLP workload).
TARGET_LIMIT = 0.95   # loopkit K=100 / limit
TARGET_STEP_1 = 5.0   # loopkit K=100 / per-step loop, 1 device
TARGET_STEP_8 = 3.0   # loopkit K=100 / per-step loop, 8 devices
TARGET_KERAS = 6.0    # loopkit K=100 / Keras steps_per_execution=100
FLAT_RSS_MB = 5.0     # RSS growth over 500 calls counted as flat
# Issue 19's host-cost goals (MLP).
TARGET_K1_STEP = 0.9       # loopkit K=1 / per-step jit, numpy in (1 and 8 devices)
TARGET_LIMIT_8 = 0.9       # loopkit K=100 / limit on 8 devices (TARGET_LIMIT on 1)
TARGET_HOST_US = 100.0     # host CPU per call <= this + the chunk's bytes at memcpy speed
# Issue 40's (MLP, 1 and 8 devices; per-round medians): loopkit / the hand-written K-scan loop on
# the same source at K = 10 and 100, and loopkit K=1 / the per-step jit loop (numpy in).
TARGET_HANDWRITTEN = 0.95
TARGET_K1_STEP_MEDIAN = 0.5


# -- worker ----------------------------------------------------------------------

def worker(args: argparse.Namespace) -> dict:
  """Measures every system at this process's device count; returns a JSON-able dict."""
  sys.path.insert(0, ROOT)
  import jax  # noqa: PLC0415  (after XLA_FLAGS is set by the parent)

  from benchmarks import (
    systems as sy,  # noqa: PLC0415
    workloads as wl,  # noqa: PLC0415
  )

  n_dev = jax.device_count()
  counter = sy.CompileCounter()
  out = {"devices": n_dev, "rows": [], "mechanism": []}
  for wname in args.workloads:
    steps = args.steps.get((wname, n_dev)) or DEFAULT_STEPS[wname, 1 if n_dev == 1 else 8]
    w = wl.get(wname, steps)
    data = wl.make_data(w)
    wl.init_state(w)  # the initialisers' own compilations, before anything is counted
    systems = [sy.Limit(w, data)] + [sy.Loopkit(w, data, k) for k in KS]
    systems += [sy.HandwrittenScan(w, data, k) for k in KS]  # the anchor, same source
    if wname == "mlp":  # the prefetch thread's share of the host cost (GIL, 2 cores); with
      # prefetch=0 the main thread forms chunk n + 1 between dispatching call n and waiting for
      # it (issue 40's lever "in-memory chunks formed on the main thread")
      systems += [sy.Loopkit(w, data, k, prefetch=0) for k in KS]
      systems += [sy.Loopkit(w, data, k, source="array") for k in (1, 100)]
    if n_dev > 1:
      systems.append(sy.Loopkit(w, data, 100, style="per_device"))
    systems += [sy.PerStepJit(w, data, prefetch=True), sy.PerStepJit(w, data, prefetch=False)]
    if n_dev > 1:
      systems.append(sy.PerStepPmap(w, data))
    if not args.no_keras:
      try:
        systems.append(sy.KerasFit(w, data))
      except ImportError as e:  # keras is in the `bench` extra
        _log(f"skipping Keras: {e}")
    first = {}
    for s in systems:
      c0 = counter.count
      s.warm()
      first[s.name] = counter.count - c0
      _log(f"[{n_dev} dev {wname}] warmed {s.name}: {first[s.name]} XLA compiles")
    times = {s.name: [] for s in systems}
    cpu = {s.name: [] for s in systems}
    peaks = {s.name: 0.0 for s in systems}
    timed_compiles = {s.name: 0 for s in systems}
    rounds = {s.name: [] for s in systems}  # each round's best run, for per-round ratios
    repeats = min(args.repeats, CNN_MAX_REPEATS) if wname == "cnn" else args.repeats
    for r in range(repeats):
      order = systems if r % 2 == 0 else systems[::-1]
      for s in order:
        if args.verbose:
          _log(f"[{n_dev} dev {wname}] timing {s.name}")
        # A round of a system is at least --min-round-secs of back-to-back runs, so a
        # 0.1 s run gets as many chances at a quiet moment as a 1 s one.
        spent, first_run = 0.0, len(times[s.name])
        while spent < args.min_round_secs or spent == 0.0:
          sy.reset_peak_rss()
          c0 = counter.count
          p0 = time.process_time()
          t = s.timed()
          cpu[s.name].append(time.process_time() - p0)
          times[s.name].append(t)
          spent += t
          timed_compiles[s.name] += counter.count - c0
          peaks[s.name] = max(peaks[s.name], sy.peak_rss_mb())
        rounds[s.name].append(min(times[s.name][first_run:]))
      _log(f"[{n_dev} dev {wname}] round {r + 1}: " + ", ".join(
          f"{s.name} {w.num_steps / min(times[s.name]):.0f}" for s in systems))
    growth = {}
    if wname == "mlp" and args.rss_calls:
      for s in systems:
        if isinstance(s, sy.Limit):
          continue
        # 500 calls, or fewer where they would take longer than --rss-secs (K=100 and
        # Keras on 8 fake devices): the number of calls is reported with the growth.
        rate = w.num_steps / min(times[s.name])
        calls = max(20, min(args.rss_calls, int(args.rss_secs * rate / s.steps_per_call)))
        growth[s.name] = (sy.rss_growth(s, calls), calls)
        _log(f"[{n_dev} dev {wname}] RSS growth {s.name}: {growth[s.name][0]:+.2f} MiB "
             f"over {calls} calls")
    for s in systems:
      out["rows"].append({
          "workload": wname, "devices": n_dev, "system": s.name, "steps": w.num_steps,
          "calls": s.calls_per_run, "times": times[s.name], "cpu": cpu[s.name],
          "round_times": rounds[s.name],
          "train_compiles": s.train_compiles(), "first_run_compiles": first[s.name],
          "timed_compiles": timed_compiles[s.name], "peak_rss_mb": peaks[s.name],
          "rss_growth_mb": growth.get(s.name, (None, None))[0],
          "rss_calls": growth.get(s.name, (None, None))[1]})
    if wname == "mlp" and args.profile_repeats:
      from benchmarks import host_profile  # noqa: PLC0415
      out["profile"] = host_profile.profile_rows(args.profile_repeats)
      out["memcpy_gb_s"] = host_profile.memcpy_gb_s()
      _log(f"[{n_dev} dev {wname}] host profile: " + ", ".join(
          f"{name} {r['main'] + r['producer']:.0f} us" for name, r in out["profile"]
          if "main" in r))
    if wname == "mlp" and args.mechanism_calls:
      for k in (10, 100):
        # 8 fake devices make a call 10-30x slower (collectives on 2 cores): fewer calls.
        calls = (args.mechanism_calls if n_dev == 1
                 else max(5, args.mechanism_calls // (5 if k == 10 else 10)))
        m = sy.mechanism_cost(w, data, k, calls=calls, repeats=args.repeats)
        out["mechanism"].append({"devices": n_dev, "workload": wname, "k": k, **m})
        _log(f"[{n_dev} dev {wname}] mechanism K={k}: {m}")
    del systems, data
  return out


def _log(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


# -- report ----------------------------------------------------------------------

def _best_rate(row: dict) -> float:
  return row["steps"] / min(row["times"])


def _find(rows, workload, devices, system):
  for r in rows:
    if (r["workload"], r["devices"], r["system"]) == (workload, devices, system):
      return r
  return None


def _fmt_ratio(a: dict | None, b: dict | None) -> str:
  if a is None or b is None:
    return ""
  return f"{_best_rate(a) / _best_rate(b):.2f}"


PER_STEP = ("per-step jit + prefetch", "per-step jit, numpy in", "per-step pmap")


def _fastest_per_step(rows, workload, devices):
  found = [r for r in (_find(rows, workload, devices, n) for n in PER_STEP) if r is not None]
  return max(found, key=_best_rate) if found else None


def round_ratio(a: dict | None, b: dict | None) -> tuple[float, float, float, int] | None:
  """Steps/s of row ``a`` over row ``b``, round by round (each round's best run of each, the two
  timed in the same interleaved round): ``(median, min, max, rounds)``, or None."""
  if a is None or b is None or not a.get("round_times") or not b.get("round_times"):
    return None
  ratios = sorted((a["steps"] / ta) / (b["steps"] / tb)
                  for ta, tb in zip(a["round_times"], b["round_times"]))
  return statistics.median(ratios), ratios[0], ratios[-1], len(ratios)


def _fmt_round_ratio(r: tuple[float, float, float, int] | None) -> str:
  return "" if r is None else f"{r[0]:.2f} [{r[1]:.2f}-{r[2]:.2f}]"


def render_round_ratios(rows: list[dict]) -> str:
  """Per-round ratios (median [min-max] over the rounds) of each loopkit K against the
  hand-written K-scan loop, the per-step jit loop (numpy in) and the limit."""
  lines = ["| workload | dev | K | rounds | loopkit / hand-written K-scan | hand-written / limit | "
           "loopkit / limit | loopkit / per-step jit, numpy in |", "|---|---|---|---|---|---|---|---|"]
  for wkl, dev in dict.fromkeys((r["workload"], r["devices"]) for r in rows):
    lim = _find(rows, wkl, dev, "limit (one scan)")
    jit = _find(rows, wkl, dev, "per-step jit, numpy in")
    for k in KS:
      hand = _find(rows, wkl, dev, f"hand-written K-scan K={k}")
      for suffix in ("", " prefetch=0"):
        lk = _find(rows, wkl, dev, f"loopkit K={k}{suffix}")
        if lk is None:
          continue
        vs_hand = round_ratio(lk, hand)
        n = vs_hand[3] if vs_hand else len(lk.get("round_times") or [])
        lines.append(f"| {wkl} | {dev} | {k}{suffix} | {n} | {_fmt_round_ratio(vs_hand)} | "
                     f"{_fmt_round_ratio(round_ratio(hand, lim))} | "
                     f"{_fmt_round_ratio(round_ratio(lk, lim))} | "
                     f"{_fmt_round_ratio(round_ratio(lk, jit))} |")
  return "\n".join(lines)


def render_table(rows: list[dict]) -> str:
  """The main table: one row per (workload, devices, system)."""
  head = ("| workload | dev | system | S | calls | steps/s (best) | worst/best | CPU µs/step | "
          "/ limit | "
          "loopkit / fastest per-step | loopkit / Keras | train-program executables | "
          "XLA compiles: warm-up / timed runs | peak RSS MiB | RSS growth MiB (calls) |")
  lines = [head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
  for r in rows:
    wkl, dev, name = r["workload"], r["devices"], r["system"]
    rates = [r["steps"] / t for t in r["times"]]
    is_lk = name.startswith("loopkit")
    cols = [
        wkl, str(dev), name, str(r["steps"]), str(r["calls"]), f"{max(rates):,.0f}",
        f"{min(rates) / max(rates):.2f}", f"{min(r['cpu']) / r['steps'] * 1e6:.1f}",
        _fmt_ratio(r, _find(rows, wkl, dev, "limit (one scan)")),
        _fmt_ratio(r, _fastest_per_step(rows, wkl, dev)) if is_lk else "",
        _fmt_ratio(r, _find(rows, wkl, dev, "Keras spe=100")) if is_lk else "",
        "n/a" if r["train_compiles"] is None else str(r["train_compiles"]),
        f"{r['first_run_compiles']} / {r['timed_compiles']}", f"{r['peak_rss_mb']:.0f}",
        "" if r["rss_growth_mb"] is None else f"{r['rss_growth_mb']:+.2f} ({r['rss_calls']})",
    ]
    lines.append("| " + " | ".join(cols) + " |")
  return "\n".join(lines)


def render_mechanism(mech: list[dict]) -> str:
  """The tail/event mechanism table (device-resident chunk, no host feeding)."""
  lines = ["| dev | K | unmasked lax.scan µs/call | loopkit fori_loop n=K µs/call | cost "
           "(loopkit / scan) | loopkit n=K/2 µs/call | compiles |",
           "|---|---|---|---|---|---|---|"]
  for m in mech:
    lines.append(f"| {m['devices']} | {m['k']} | {m['scan_us']:.1f} | {m['loopkit_us']:.1f} | "
                 f"{m['loopkit_us'] / m['scan_us']:.3f} | {m['loopkit_half_us']:.1f} | "
                 f"{m['loopkit_compiles']} |")
  return "\n".join(lines)


def render_host_cost(rows: list[dict]) -> str:
  """Host CPU per call: (loopkit CPU/step - limit CPU/step) * K, MLP rows."""
  lines = ["| dev | system | K | host CPU µs per call | host CPU µs per step |",
           "|---|---|---|---|---|"]
  for r in rows:
    if r["workload"] != "mlp" or not r["system"].startswith("loopkit"):
      continue
    lim = _find(rows, "mlp", r["devices"], "limit (one scan)")
    if lim is None:
      continue
    k = r["steps"] // r["calls"] if r["calls"] else 1
    per_step = (min(r["cpu"]) / r["steps"] - min(lim["cpu"]) / lim["steps"]) * 1e6
    lines.append(f"| {r['devices']} | {r['system']} | {k} | {per_step * k:,.0f} | "
                 f"{per_step:.1f} |")
  return "\n".join(lines) if len(lines) > 2 else ""


def check_targets(rows: list[dict], profiles: dict | None = None
                  ) -> list[tuple[str, bool | None, str]]:
  """Evaluates the issues' targets on the MLP: (target, met or None if not measured, detail).

  ``profiles``: ``{devices: (host profile rows, memcpy GB/s)}`` from the workers.
  """
  out = []

  def rate(dev, system, wkl="mlp"):
    r = _find(rows, wkl, dev, system)
    return None if r is None else _best_rate(r)

  for dev in (1, 8):
    k100 = rate(dev, "loopkit K=100")
    if k100 is None:
      continue
    lim = rate(dev, "limit (one scan)")

    def ceiling(other: float, lim: float | None = lim) -> str:  # the limit's own ratio
      return "" if lim is None else f"; the limit itself is {lim / other:.2f}x"

    if lim is not None:
      ratio, goal = k100 / lim, TARGET_LIMIT if dev == 1 else TARGET_LIMIT_8
      out.append((f"MLP, {dev} dev: loopkit K=100 >= {goal} x limit", ratio >= goal,
                  f"{ratio:.2f} ({k100:,.0f} vs {lim:,.0f} steps/s)"))
      k0 = rate(dev, "loopkit K=100 prefetch=0")
      if k0 is not None:
        out.append((f"MLP, {dev} dev: loopkit K=100 prefetch=0 >= {goal} x limit (not the "
                    "default)", k0 / lim >= goal, f"{k0 / lim:.2f} ({k0:,.0f} steps/s)"))
      ka = rate(dev, "loopkit K=100 ArraySource")
      if ka is not None:
        out.append((f"MLP, {dev} dev: loopkit K=100 ArraySource >= {goal} x limit",
                    ka / lim >= goal, f"{ka / lim:.2f} ({ka:,.0f} steps/s)"))
    numpy_in = rate(dev, "per-step jit, numpy in")
    for name in ("loopkit K=1", "loopkit K=1 ArraySource"):
      k1 = rate(dev, name)
      if k1 is not None and numpy_in is not None:
        out.append((f"MLP, {dev} dev: {name.removeprefix('loopkit ')} >= {TARGET_K1_STEP} x the "
                    "per-step jit loop (numpy in)", k1 / numpy_in >= TARGET_K1_STEP,
                    f"{k1 / numpy_in:.2f} ({k1:,.0f} vs {numpy_in:,.0f} steps/s)"))
    goal = TARGET_STEP_1 if dev == 1 else TARGET_STEP_8
    flax_style = _find(rows, "mlp", dev, "per-step jit + prefetch")
    if flax_style is not None:
      best = _best_rate(flax_style)
      out.append((f"MLP, {dev} dev: loopkit K=100 >= {goal:g}x the Flax-style per-step jit loop "
                  "(device prefetch)", k100 / best >= goal, f"{k100 / best:.2f}x ({best:,.0f} "
                  "steps/s)"))
    fastest = _fastest_per_step(rows, "mlp", dev)
    if fastest is not None:
      best = _best_rate(fastest)
      out.append((f"MLP, {dev} dev: loopkit K=100 >= {goal:g}x the fastest per-step loop measured",
                  k100 / best >= goal,
                  f"{k100 / best:.2f}x ({fastest['system']}: {best:,.0f} steps/s"
                  f"{ceiling(best)})"))
    ker = rate(dev, "Keras spe=100")
    if ker:
      out.append((f"MLP, {dev} dev: loopkit K=100 >= {TARGET_KERAS:g}x Keras "
                  "steps_per_execution=100", k100 / ker >= TARGET_KERAS,
                  f"{k100 / ker:.2f}x ({ker:,.0f} steps/s{ceiling(ker)})"))
  # The default (prefetch=2) and the main-thread forming rows (prefetch=0), each per round.
  variants = (("", ")"), (" prefetch=0", "; not the default)"))
  for dev in (1, 8):
    pairs = [(f"loopkit K={k}", f"hand-written K-scan K={k}", k, TARGET_HANDWRITTEN,
              "the hand-written K-scan loop") for k in (10, 100)]
    pairs.append(("loopkit K=1", "per-step jit, numpy in", 1, TARGET_K1_STEP_MEDIAN,
                  "the per-step jit loop, numpy in"))
    for system, reference, k, goal, what in pairs:
      for suffix, close in variants:
        r = round_ratio(_find(rows, "mlp", dev, system + suffix),
                        _find(rows, "mlp", dev, reference))
        if r is not None:
          out.append((f"MLP, {dev} dev: loopkit K={k}{suffix} >= {goal} x {what} (median of "
                      f"rounds{close}", r[0] >= goal, f"{_fmt_round_ratio(r)} over {r[3]} rounds"))
  for dev, (prof, gb_s) in sorted((profiles or {}).items()):
    for name, r in prof:
      if "prefetch=2" not in name:  # the default
        continue
      budget = TARGET_HOST_US + r["chunk_bytes"] / (gb_s * 1e3)  # bytes / (GB/s) in us
      host = r["main"] + r["producer"]
      out.append((f"MLP, {dev} dev, {name.removeprefix('loopkit ')}: host CPU per call <= "
                  f"{TARGET_HOST_US:g} us + the chunk at memcpy speed", host <= budget,
                  f"{host:,.0f} us vs {budget:,.0f} us ({r['chunk_bytes'] / 1e3:,.0f} kB at "
                  f"{gb_s:.1f} GB/s)"))
  lk = [r for r in rows if r["system"].startswith("loopkit")]
  if lk:
    ok = all(r["train_compiles"] == 1 and r["timed_compiles"] == 0 for r in lk)
    out.append(("loopkit: exactly 1 train-program compilation per run, none when re-run", ok,
                ", ".join(sorted({f"{r['train_compiles']}" for r in lk})) + " executable(s); "
                f"{sum(r['timed_compiles'] for r in lk)} XLA compiles in all timed runs"))
  grown = [r for r in lk if r["rss_growth_mb"] is not None]
  if grown:  # growth, not shrinkage, is what a leak looks like
    worst = max(grown, key=lambda r: r["rss_growth_mb"])
    out.append((f"loopkit: flat RSS (growth < {FLAT_RSS_MB:g} MiB over up to "
                f"{max(r['rss_calls'] for r in grown)} calls in one run)",
                worst["rss_growth_mb"] < FLAT_RSS_MB,
                f"largest {worst['rss_growth_mb']:+.2f} MiB over {worst['rss_calls']} calls "
                f"({worst['system']}, {worst['devices']} dev)"))
  return out


def render_targets(targets) -> str:
  lines = ["| target | met | measured |", "|---|---|---|"]
  for name, ok, detail in targets:
    lines.append(f"| {name} | {'—' if ok is None else ('yes' if ok else '**no**')} | {detail} |")
  return "\n".join(lines)


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


def versions() -> dict:
  """Installed versions; loopkit's from the imported package (a stale install's metadata can
  differ from the tree on PYTHONPATH)."""
  import loopkit  # pylint: disable=g-import-not-at-top
  out = {}
  for p in PACKAGES:
    if p == "loopkit":
      out[p] = loopkit.__version__
      continue
    try:
      out[p] = importlib.metadata.version(p)
    except importlib.metadata.PackageNotFoundError:
      out[p] = "not installed"
  return out


def render_report(results: list[dict], meta: dict) -> str:
  rows = [r for res in results for r in res["rows"]]
  mech = [m for res in results for m in res["mechanism"]]
  profiles = {res["devices"]: (res["profile"], res["memcpy_gb_s"]) for res in results
              if res.get("profile")}
  m = meta["machine"]
  parts = [
      "# loopkit benchmarks: side by side",
      "",
      "Generated by `benchmarks/run.py`; see `benchmarks/README.md` for what each system is "
      "and how the figures are measured.",
      "",
      f"- date: {meta['date']}",
      f"- command: `{meta['command']}`",
      f"- machine: {m['nproc']} CPUs ({m['cpu']}), {m['ram']} RAM, Linux {m['kernel']}, "
      f"Python {m['python']}",
      f"- load average (1/5/15 min) at start: {meta['load_start']}; at end: {meta['load_end']}",
      "- packages: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
      f"- repeats: best run of {meta['repeats']} interleaved rounds per system (a round: runs "
      f"back to back for at least {meta['min_round_secs']:g} s; CNN: 2 rounds); S (steps per "
      "run, the same for every system) in the table; batch 32, SGD 0.01",
      f"- wall time of the whole run: {meta['wall_s']:.0f} s"
      + (f"; retries: {'; '.join(meta['retries'])}" if meta["retries"] else ""),
      "",
      "## Targets (MLP workload)",
      "",
      render_targets(check_targets(rows, profiles)),
      "",
      "Why the missed targets are missed on this machine, and what was fixed on the way: "
      "`benchmarks/README.md`, section *What the numbers say*.",
      "",
      "## Ratios round by round (median [min-max] over the interleaved rounds)",
      "",
      "Each round times every system back to back; a ratio is taken within a round (each "
      "system's best run of that round) and the median over the rounds is reported with the "
      "smallest and largest, so a load spike in one round moves one value, not the figure. "
      "The hand-written K-scan loop (`HandwrittenScan` in `benchmarks/systems.py`) reads the "
      "same list of numpy batches as `loopkit K=k`: their ratio is loopkit's own host work.",
      "",
      render_round_ratios(rows),
      "",
      "## Steps per second, ratios, compilations, memory",
      "",
      render_table(rows),
      "",
  ]
  host = render_host_cost(rows)
  if host:
    parts += [
        "## loopkit's host cost per device call (MLP)",
        "",
        "CPU time the process spends per call beyond the limit's: (CPU µs/step of loopkit − "
        "CPU µs/step of the limit) × K. On a 2-core machine that is also running the compiled "
        "steps (XLA:CPU uses both cores), this host work cannot hide behind the device work; "
        "it is what separates loopkit from the limit here.",
        "",
        host,
        "",
    ]
  if profiles:
    if ROOT not in sys.path:  # run as a script: benchmarks/ is sys.path[0], not the root
      sys.path.insert(0, ROOT)
    from benchmarks import host_profile  # noqa: PLC0415
    parts += [
        "## Host CPU per device call, by phase (MLP)",
        "",
        "`benchmarks/host_profile.py` inside each worker: µs of CPU per call by phase "
        "(`time.thread_time` of the thread that runs it; phases defined in "
        "`benchmarks/README.md`), best of the profile's runs by host CPU; memcpy speed "
        "measured in the same worker.",
        "",
    ]
    for dev, (prof, gb_s) in sorted(profiles.items()):
      parts += [f"{dev} device(s), memcpy {gb_s:.1f} GB/s:", "", host_profile.render(prof), ""]
  if mech:
    parts += [
        "## Cost of loopkit's tail/event mechanism (MLP, chunk already on device)",
        "",
        "loopkit's program runs a `fori_loop` with a traced trip count over a fixed `[K, B, ...]` "
        "chunk, so every call length reuses one executable; the reference is an unmasked "
        "`lax.scan` of exactly K steps over the same chunk, also returning the `[K]` loss trace.",
        "",
        render_mechanism(mech),
        "",
    ]
  return "\n".join(parts)


# -- main ------------------------------------------------------------------------

def _loadavg() -> str:
  try:
    with open("/proc/loadavg") as f:
      return " ".join(f.read().split()[:3])
  except OSError:
    return "unknown"


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--devices", type=int, nargs="+", default=[1, 8])
  p.add_argument("--workloads", nargs="+", default=["mlp", "cnn"], choices=["mlp", "cnn"])
  p.add_argument("--repeats", type=int, default=3, help="timed rounds per system (best kept)")
  p.add_argument("--mlp-steps", type=int, help="S for the MLP (default 5000 on 1 device, "
                 "1000 on 8)")
  p.add_argument("--cnn-steps", type=int, help="S for the CNN (default 300 on 1 device, 200 on 8)")
  p.add_argument("--rss-calls", type=int, default=500, help="calls for the RSS growth (0: skip)")
  p.add_argument("--rss-secs", type=float, default=4.0,
                 help="fewer RSS calls where 500 would take longer than this")
  p.add_argument("--mechanism-calls", type=int, default=100,
                 help="calls per timing of the tail/event mechanism (0: skip)")
  p.add_argument("--profile-repeats", type=int, default=3,
                 help="runs per row of the per-phase host profile (0: skip)")
  p.add_argument("--no-keras", action="store_true", help="skip the Keras system")
  p.add_argument("--quick", action="store_true",
                 help="small smoke run (S=1000/20, 2 repeats, 20 RSS calls); implies --no-save")
  p.add_argument("--no-save", action="store_true", help="print only, do not write RESULTS.md")
  p.add_argument("--json", help="also write the raw measurements to this JSON file")
  p.add_argument("--render", metavar="JSON",
                 help="only re-render the report from saved measurements (no run)")
  p.add_argument("--min-round-secs", type=float, default=0.5,
                 help="a system's round repeats its run until this much time is spent")
  p.add_argument("--verbose", action="store_true", help="log every timed run")
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.quick:
    args.mlp_steps, args.cnn_steps, args.repeats = args.mlp_steps or 500, args.cnn_steps or 10, 2
    args.rss_calls, args.mechanism_calls, args.no_save = 20, 10, True
    args.profile_repeats = 1
    args.min_round_secs = 0.0
  args.steps = {}
  for n in (1, 8):
    if args.mlp_steps:
      args.steps["mlp", n] = args.mlp_steps
    if args.cnn_steps:
      args.steps["cnn", n] = args.cnn_steps
  return args


def _worker_argv(args: argparse.Namespace) -> list[str]:
  argv = [sys.executable, os.path.abspath(__file__), "--worker", "--workloads", *args.workloads,
          "--repeats", str(args.repeats), "--rss-calls", str(args.rss_calls),
          "--rss-secs", str(args.rss_secs), "--mechanism-calls", str(args.mechanism_calls),
          "--min-round-secs", str(args.min_round_secs),
          "--profile-repeats", str(args.profile_repeats)]
  if args.mlp_steps:
    argv += ["--mlp-steps", str(args.mlp_steps)]
  if args.cnn_steps:
    argv += ["--cnn-steps", str(args.cnn_steps)]
  if args.no_keras:
    argv.append("--no-keras")
  if args.verbose:
    argv.append("--verbose")
  return argv


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.worker:
    print("RESULT " + json.dumps(worker(args)), flush=True)
    return 0
  if args.render:
    with open(args.render) as f:
      saved = json.load(f)
    print(render_report(saved["results"], saved["meta"]))
    return 0
  t0 = time.time()
  meta = {"date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
          "command": " ".join(["python", os.path.relpath(__file__, ROOT)] + sys.argv[1:]),
          "machine": machine(), "versions": versions(), "load_start": _loadavg(),
          "repeats": args.repeats, "min_round_secs": args.min_round_secs, "retries": []}
  results = []
  for n in args.devices:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (" ".join(f for f in env.get("XLA_FLAGS", "").split()
                                 if "xla_force_host_platform_device_count" not in f)
                        + f" --xla_force_host_platform_device_count={n}").strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["KERAS_BACKEND"] = "jax"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    for _attempt in range(2):
      _log(f"== worker: {n} device(s), load {_loadavg()}")
      proc = subprocess.run(_worker_argv(args), env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            text=True, check=False)
      lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
      if proc.returncode == 0 and lines:
        break
      # With 8 fake devices XLA:CPU sometimes aborts in an all-reduce rendezvous (see
      # README.md); one retry, recorded in the report.
      _log(f"worker for {n} device(s) failed with exit code {proc.returncode}")
      meta["retries"].append(f"{n}-device worker exited with code {proc.returncode}; rerun")
    else:
      return 1
    results.append(json.loads(lines[-1][len("RESULT "):]))
  meta["load_end"] = _loadavg()
  meta["wall_s"] = time.time() - t0
  report = render_report(results, meta)
  print(report)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"meta": meta, "results": results}, f, indent=1)
  if not args.no_save:
    with open(RESULTS, "w") as f:
      f.write(report + "\n")
    with open(RAW, "w") as f:
      json.dump({"meta": meta, "results": results}, f, indent=1)
    _log(f"wrote {os.path.relpath(RESULTS, ROOT)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
