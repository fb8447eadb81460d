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
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script: benchmarks/ is sys.path[0], not the root
  sys.path.insert(0, ROOT)

from benchmarks import runner  # noqa: E402  (stdlib-only at import: no JAX here)
from benchmarks.run_report import (  # noqa: E402, F401  (the report's names, as they were here)
  KS,
  check_targets,
  render_mechanism,
  render_report,
  render_round_ratios,
  render_table,
)
from benchmarks.runner import (  # noqa: E402, F401
  entry,
  fmt_round_ratio as _fmt_round_ratio,
  log as _log,
  machine,
  round_ratio,
)

RESULTS = os.path.join(ROOT, "benchmarks", "RESULTS.md")
RAW = os.path.join(ROOT, "benchmarks", "results.json")  # the measurements behind RESULTS.md
PACKAGES = ["jax", "jaxlib", "flax", "optax", "keras", "numpy", "loopkit"]
# Steps per timed run, S, by (workload, device count): the same for every system. S >= 2 x 100
# so that K=100 makes more than one call per run.
DEFAULT_STEPS = {("mlp", 1): 5000, ("mlp", 8): 1000, ("cnn", 1): 300, ("cnn", 8): 200}
CNN_MAX_REPEATS = 2


# The systems a worker measures, in the order of its rounds and of the report's rows.
LINEUP = (
    entry("Limit"),
    *(entry("Loopkit", k=k) for k in KS),
    *(entry("HandwrittenScan", k=k) for k in KS),  # the anchor, same source
    # The prefetch thread's share of the host cost (GIL, 2 cores); with prefetch=0 the main
    # thread forms chunk n + 1 between dispatching call n and waiting for it (issue 40's lever
    # "in-memory chunks formed on the main thread").
    *(entry("Loopkit", ("mlp",), k=k, prefetch=0) for k in KS),
    *(entry("Loopkit", ("mlp",), k=k, source="array") for k in (1, 100)),
    entry("Loopkit", min_devices=2, k=100, style="per_device"),
    entry("PerStepJit", prefetch=True), entry("PerStepJit", prefetch=False),
    entry("PerStepPmap", min_devices=2),
    entry("KerasFit", optional="Keras"),  # keras is in the `bench` extra
)


# -- worker ----------------------------------------------------------------------

def worker(args: argparse.Namespace) -> dict:
  """Measures every system at this process's device count; returns a JSON-able dict."""
  sys.path.insert(0, ROOT)
  import jax  # noqa: PLC0415  (after XLA_FLAGS is set by the parent)

  from benchmarks import (
    measure,  # noqa: PLC0415
    systems as sy,  # noqa: PLC0415
    workloads as wl,  # noqa: PLC0415
  )

  n_dev = jax.device_count()
  counter = measure.CompileCounter()
  out = {"devices": n_dev, "rows": [], "mechanism": []}
  for wname in args.workloads:
    steps = args.steps.get((wname, n_dev)) or DEFAULT_STEPS[wname, 1 if n_dev == 1 else 8]
    w = wl.get(wname, steps)
    data = wl.make_data(w)
    wl.init_state(w)  # the initialisers' own compilations, before anything is counted
    systems = sy.build(LINEUP, w, data, leave_out=("KerasFit",) if args.no_keras else (),
                       log=_log)
    tag = f"[{n_dev} dev {wname}]"
    first = {}
    for s in systems:
      c0 = counter.count
      s.warm()
      first[s.name] = counter.count - c0
      _log(f"{tag} warmed {s.name}: {first[s.name]} XLA compiles")
    repeats = min(args.repeats, CNN_MAX_REPEATS) if wname == "cnn" else args.repeats
    timed = runner.time_interleaved(systems, repeats, args.min_round_secs,
                                    lambda: counter.count, w.num_steps, tag, args.verbose)
    growth = {}
    if wname == "mlp" and args.rss_calls:
      for s in systems:
        if isinstance(s, sy.Limit):
          continue
        # 500 calls, or fewer where they would take longer than --rss-secs (K=100 and
        # Keras on 8 fake devices): the number of calls is reported with the growth.
        rate = w.num_steps / min(timed[s.name]["times"])
        calls = max(20, min(args.rss_calls, int(args.rss_secs * rate / s.steps_per_call)))
        growth[s.name] = (measure.rss_growth(s, calls), calls)
        _log(f"{tag} RSS growth {s.name}: {growth[s.name][0]:+.2f} MiB over {calls} calls")
    for s in systems:
      t = timed[s.name]
      out["rows"].append({
          "workload": wname, "devices": n_dev, "system": s.name, "steps": w.num_steps,
          "calls": s.calls_per_run, "times": t["times"], "cpu": t["cpu"],
          "round_times": t["round_times"],
          "train_compiles": s.train_compiles(), "first_run_compiles": first[s.name],
          "timed_compiles": t["timed_compiles"], "peak_rss_mb": t["peak_rss_mb"],
          "rss_growth_mb": growth.get(s.name, (None, None))[0],
          "rss_calls": growth.get(s.name, (None, None))[1]})
    if wname == "mlp" and args.profile_repeats:
      from benchmarks import host_profile  # noqa: PLC0415
      out["profile"] = host_profile.profile_rows(args.profile_repeats)
      out["memcpy_gb_s"] = host_profile.memcpy_gb_s()
      _log(f"{tag} host profile: " + ", ".join(
          f"{name} {r['main'] + r['producer']:.0f} us" for name, r in out["profile"]
          if "main" in r))
    if wname == "mlp" and args.mechanism_calls:
      for k in (10, 100):
        # 8 fake devices make a call 10-30x slower (collectives on 2 cores): fewer calls.
        calls = (args.mechanism_calls if n_dev == 1
                 else max(5, args.mechanism_calls // (5 if k == 10 else 10)))
        m = measure.mechanism_cost(w, data, k, calls=calls, repeats=args.repeats)
        out["mechanism"].append({"devices": n_dev, "workload": wname, "k": k, **m})
        _log(f"{tag} mechanism K={k}: {m}")
    del systems, data
  return out


# -- main ------------------------------------------------------------------------

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


RESULT = "RESULT "  # prefix of the worker's result line on stdout


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.worker:
    runner.emit(RESULT, worker(args))
    return 0
  if args.render:
    with open(args.render) as f:
      saved = json.load(f)
    print(render_report(saved["results"], saved["meta"]))
    return 0
  t0 = time.time()
  meta = {"date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
          "command": " ".join(["python", os.path.relpath(__file__, ROOT)] + sys.argv[1:]),
          "machine": machine(), "versions": runner.versions(PACKAGES),
          "load_start": runner.loadavg(), "repeats": args.repeats,
          "min_round_secs": args.min_round_secs, "retries": []}
  results = []
  for n in args.devices:
    env = runner.worker_env(
        drop_xla=["xla_force_host_platform_device_count"],
        add_xla=[f"--xla_force_host_platform_device_count={n}"],
        set_env={"JAX_PLATFORMS": "cpu", "KERAS_BACKEND": "jax"},
        default_env={"TF_CPP_MIN_LOG_LEVEL": "3"})
    for _attempt in range(2):
      _log(f"== worker: {n} device(s), load {runner.loadavg()}")
      proc = subprocess.run(_worker_argv(args), env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            text=True, check=False)
      got = [x for x in (runner.parse(ln, RESULT) for ln in proc.stdout.splitlines())
             if x is not None]
      if proc.returncode == 0 and got:
        break
      # With 8 fake devices XLA:CPU sometimes aborts in an all-reduce rendezvous (see
      # README.md); one retry, recorded in the report.
      _log(f"worker for {n} device(s) failed with exit code {proc.returncode}")
      meta["retries"].append(f"{n}-device worker exited with code {proc.returncode}; rerun")
    else:
      return 1
    results.append(got[-1])
  meta["load_end"] = runner.loadavg()
  meta["wall_s"] = time.time() - t0
  report = render_report(results, meta)
  print(report)
  runner.write_results(None, None, args.json, meta, results)
  if not args.no_save:
    runner.write_results(report, RESULTS, RAW, meta, results)
    _log(f"wrote {os.path.relpath(RESULTS, ROOT)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
