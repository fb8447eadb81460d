"""The CPU benchmark's report (``benchmarks/run.py``): its tables and the issues' targets.

Everything here reads the rows the workers measured (``run.py``'s ``worker``: one row per
workload, device count and system, with every run's time and CPU time and each round's best
run) and returns markdown; nothing is measured. ``gpu_report.py`` reuses the main table and the
mechanism table for the MLP it runs on an accelerator. Stdlib only at import.
"""

from __future__ import annotations

import sys

from benchmarks.runner import (
  ROOT,
  best_rate,
  fastest_per_step,
  find,
  fmt_ratio,
  fmt_round_ratio,
  round_ratio,
)

KS = (1, 10, 100)  # loopkit's and the hand-written loop's K in the CPU line-up

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


def render_round_ratios(rows: list[dict]) -> str:
  """Per-round ratios (median [min-max] over the rounds) of each loopkit K against the
  hand-written K-scan loop, the per-step jit loop (numpy in) and the limit."""
  lines = ["| workload | dev | K | rounds | loopkit / hand-written K-scan | hand-written / limit | "
           "loopkit / limit | loopkit / per-step jit, numpy in |",
           "|---|---|---|---|---|---|---|---|"]
  for wkl, dev in dict.fromkeys((r["workload"], r["devices"]) for r in rows):
    lim = find(rows, wkl, dev, "limit (one scan)")
    jit = find(rows, wkl, dev, "per-step jit, numpy in")
    for k in KS:
      hand = find(rows, wkl, dev, f"hand-written K-scan K={k}")
      for suffix in ("", " prefetch=0"):
        lk = find(rows, wkl, dev, f"loopkit K={k}{suffix}")
        if lk is None:
          continue
        vs_hand = round_ratio(lk, hand)
        n = vs_hand[3] if vs_hand else len(lk.get("round_times") or [])
        lines.append(f"| {wkl} | {dev} | {k}{suffix} | {n} | {fmt_round_ratio(vs_hand)} | "
                     f"{fmt_round_ratio(round_ratio(hand, lim))} | "
                     f"{fmt_round_ratio(round_ratio(lk, lim))} | "
                     f"{fmt_round_ratio(round_ratio(lk, jit))} |")
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
        fmt_ratio(r, find(rows, wkl, dev, "limit (one scan)")),
        fmt_ratio(r, fastest_per_step(rows, wkl, dev)) if is_lk else "",
        fmt_ratio(r, find(rows, wkl, dev, "Keras spe=100")) if is_lk else "",
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
    lim = find(rows, "mlp", r["devices"], "limit (one scan)")
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
    r = find(rows, wkl, dev, system)
    return None if r is None else best_rate(r)

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
    flax_style = find(rows, "mlp", dev, "per-step jit + prefetch")
    if flax_style is not None:
      best = best_rate(flax_style)
      out.append((f"MLP, {dev} dev: loopkit K=100 >= {goal:g}x the Flax-style per-step jit loop "
                  "(device prefetch)", k100 / best >= goal, f"{k100 / best:.2f}x ({best:,.0f} "
                  "steps/s)"))
    fastest = fastest_per_step(rows, "mlp", dev)
    if fastest is not None:
      best = best_rate(fastest)
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
        r = round_ratio(find(rows, "mlp", dev, system + suffix),
                        find(rows, "mlp", dev, reference))
        if r is not None:
          out.append((f"MLP, {dev} dev: loopkit K={k}{suffix} >= {goal} x {what} (median of "
                      f"rounds{close}", r[0] >= goal, f"{fmt_round_ratio(r)} over {r[3]} rounds"))
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



def render_report(results: list[dict], meta: dict) -> str:
  """``RESULTS.md``: the run's record (``meta``: date, command, machine, load, versions, wall
  time, retries), the targets and every table, from the workers' ``results``."""
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
