"""Goodput of checkpoint strategies under preemptions: persistent only, two retention tiers,
local + persistent, simulated with save and restore costs measured on this machine.

**Measured here** (real saves of this library, one process, ``--sizes-mb`` states of float32
leaves): for :class:`loopkit.CheckpointHook` (the persistent path) and
:class:`loopkit.checkpoint.LocalCheckpointHook` (the local tier), the time a save blocks the
caller (``block``: the hook returns once the arrays are off the device), the time until the
save is committed (``commit``) and the time a restore takes. A least-squares line
``t = fixed + bytes / bandwidth`` is fitted per tier and quantity; the *fixed* parts (Orbax's
metadata, barriers, the JSON items) are the library's own and are kept.

**Scaled to a pod.** The size parts are replaced by the stated pod figures (flags): a state
of ``--state-gb`` (1 and 100 GB by default) spread over ``--hosts`` hosts; a persistent
save or restore moves the whole state at ``--persistent-gbps`` (aggregate over the pod, e.g.
a 200 GB checkpoint in 38 s to GCS is 5.3 GB/s, Orbax #392; ``--persistent-restore-gbps``
for restores, which at 704 processes took 22-24 minutes in marin #8538); a local one moves each
host's share at ``--local-gbps`` per host (RAM disk); the blocking copy off the device moves each
host's share at ``--d2h-gbps``; a host replaced after a preemption
(``--host-loss``: the fraction of preemptions that replace one) refills its share from a peer at
``--peer-gbps`` when the state is replicated across hosts (``--replicated``), else the run
falls back to the persistent tier. Every restart also costs ``--restart-s`` (scheduling,
process start, compilation).

**The run.** ``--work-h`` hours of training (useful work), preemptions a Poisson process of
mean ``--mtbf-h`` hours of wall time, ``--trials`` runs per strategy (same seeds for every
strategy). A save at interval ``I`` (of useful work) blocks ``block`` seconds and becomes
restorable ``commit`` seconds later (a save not committed by the preemption is lost; the next
save waits for the last). A preemption loses the work since the newest restorable checkpoint
of any usable tier, then pays ``--restart-s`` plus that tier's restore. Goodput is useful
work over wall time.

Usage (from the repository root)::

  python benchmarks/checkpoint_tiers_goodput.py                  # measures 4-256 MB here
  python benchmarks/checkpoint_tiers_goodput.py --state-gb 1 100 --persistent-gbps 5 \\
      --local-gbps 4 --hosts 64 --mtbf-h 4 --host-loss 0.2
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import random
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GB = 1e9


# -- measuring this library's saves ------------------------------------------------------


def measure(sizes_mb: list[float], repeats: int, root: str) -> dict[str, list[tuple]]:
  """``{"persistent"|"local": [(bytes, block_s, commit_s, restore_s), ...]}``, best of
  ``repeats`` per size."""
  sys.path.insert(0, ROOT)
  import jax
  import jax.numpy as jnp

  from loopkit.checkpoint import CheckpointHook, LocalCheckpointHook, local_tier
  from loopkit.core.ledger import Ledger

  out: dict[str, list[tuple]] = {"persistent": [], "local": []}
  for mb in sizes_mb:
    n = int(mb * 1e6 / 4)
    state = {"w": jnp.arange(n, dtype=jnp.float32).reshape(-1, 1000),
             "step": jnp.zeros((), jnp.int32)}
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    best = {"persistent": None, "local": None}
    for r in range(repeats):
      d = os.path.join(root, f"{mb}-{r}")
      ckpt = CheckpointHook(os.path.join(d, "p"))
      t0 = time.perf_counter()
      ckpt.save(1, state, ledger=Ledger(step=1))
      t1 = time.perf_counter()
      ckpt.wait_until_finished()
      t2 = time.perf_counter()
      ckpt.restore(state)
      t3 = time.perf_counter()
      ckpt.close()
      row = (nbytes, t1 - t0, t2 - t0, t3 - t2)
      best["persistent"] = min(best["persistent"] or row, row, key=lambda x: x[2])
      tier = LocalCheckpointHook(os.path.join(d, "l"), CheckpointHook(os.path.join(d, "q")),
                                 every_steps=1)
      t0 = time.perf_counter()
      tier.save_local(1, state, ledger=Ledger(step=1))
      t1 = time.perf_counter()
      tier.wait_until_finished()
      t2 = time.perf_counter()
      words, _ = tier.read_local(1)  # what on_run_start reads: the words, then unpacked
      local_tier._unpack(words, state)["w"].block_until_ready()
      t3 = time.perf_counter()
      tier.close()
      row = (nbytes, t1 - t0, t2 - t0, t3 - t2)
      best["local"] = min(best["local"] or row, row, key=lambda x: x[2])
      shutil.rmtree(d, ignore_errors=True)
    for k in out:
      out[k].append(best[k])
  return out


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
  """Least-squares ``t = a + b * bytes``: ``(a seconds, 1/b bytes per second)``."""
  n = len(points)
  mx = sum(x for x, _ in points) / n
  my = sum(y for _, y in points) / n
  sxx = sum((x - mx) ** 2 for x, _ in points)
  b = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
  a = max(0.0, my - b * mx)
  return a, (1.0 / b if b > 0 else math.inf)


# -- the pod cost model --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Tier:
  """One tier's costs for one state size, seconds."""

  block: float  # the save blocks training this long
  commit: float  # restorable this long after the save started
  restore: float  # a restart reads it back in this long


def pod_tiers(fixed: dict[str, dict[str, float]], a: argparse.Namespace,
              state_gb: float) -> dict[str, Tier]:
  size = state_gb * GB
  share = size / a.hosts
  block = lambda kind: fixed[kind]["block"] + share / (a.d2h_gbps * GB)  # noqa: E731
  persistent = Tier(block=block("persistent"),
                    commit=fixed["persistent"]["commit"] + size / (a.persistent_gbps * GB),
                    restore=fixed["persistent"]["restore"]
                    + size / ((a.persistent_restore_gbps or a.persistent_gbps) * GB))
  local = Tier(block=block("local"),
               commit=fixed["local"]["commit"] + share / (a.local_gbps * GB),
               restore=fixed["local"]["restore"] + share / (a.local_gbps * GB))
  peer = dataclasses.replace(local, restore=local.restore + share / (a.peer_gbps * GB))
  return {"persistent": persistent, "local": local, "peer": peer}


@dataclasses.dataclass(frozen=True)
class Strategy:
  name: str
  persistent_s: float  # persistent save interval, seconds of useful work
  local_s: float | None = None  # local save interval (None: no local tier)


def simulate(s: Strategy, tiers: dict[str, Tier], a: argparse.Namespace, seed: int) -> float:
  """One run's goodput (useful work / wall time)."""
  rng = random.Random(seed)
  work = a.work_h * 3600.0
  mtbf = a.mtbf_h * 3600.0
  wall = 0.0
  done = 0.0  # useful work at the current point of the run
  restorable = {"persistent": 0.0, "local": 0.0}  # newest restorable work per tier
  pending: list[tuple[float, str, float]] = []  # (wall time committed, tier, work)
  next_preempt = rng.expovariate(1.0 / mtbf)
  busy_until = {"persistent": 0.0, "local": 0.0}  # the tier's last save commits then

  def next_save(lo):
    """The next save point after work ``lo``: ``(work, tier)``; persistent wins a tie."""
    points = [((math.floor(lo / every + 1e-9) + 1) * every, tier)
              for tier, every in (("persistent", s.persistent_s), ("local", s.local_s)) if every]
    return min(points, key=lambda p: (p[0], p[1] != "persistent"))

  while done < work - 1e-9:
    # train to the next save point or the end
    target, tier = next_save(done)
    if target >= work:
      target, tier = work, None
    run_until = wall + (target - done)
    if run_until >= next_preempt:  # preempted while training
      wall = next_preempt
    else:
      wall, done = run_until, target
      if tier is not None:
        wait = max(0.0, busy_until[tier] - wall)  # the last save of the tier first
        cost = tiers[tier]
        if wall + wait + cost.block >= next_preempt:
          wall = next_preempt
        else:
          wall += wait + cost.block
          start = wall - cost.block
          busy_until[tier] = start + cost.commit
          pending.append((start + cost.commit, tier, done))
          continue
      else:
        continue
    # a preemption at `wall`: what is restorable now
    for t_commit, t, w in pending:
      if t_commit <= wall:
        restorable[t] = max(restorable[t], w)
    pending = []
    host_lost = rng.random() < a.host_loss
    options = [(restorable["persistent"], "persistent")]
    if s.local_s:
      if not host_lost:
        options.append((restorable["local"], "local"))
      elif a.replicated:
        options.append((restorable["local"], "peer"))
    resume, source = max(options, key=lambda o: (o[0], o[1] != "persistent"))
    restore = tiers[source].restore if resume > 0 else 0.0
    wall += a.restart_s + restore
    done = resume
    if host_lost and not a.replicated:
      restorable["local"] = 0.0  # the lost host's share of the local tier is gone
    busy_until = {"persistent": wall, "local": wall}
    next_preempt = wall + rng.expovariate(1.0 / mtbf)
    # commits after the preemption never happen (pending was cleared)
  return work / wall


def strategies(a: argparse.Namespace) -> list[Strategy]:
  out = [Strategy(f"persistent every {m:g} min", m * 60) for m in a.persistent_min]
  out.append(Strategy(f"retention tiers: temporary every {a.temporary_min:g} min, permanent "
                      f"every {a.permanent_min:g} min (both persistent)", a.temporary_min * 60))
  out += [Strategy(f"local every {lm:g} min + persistent every {pm:g} min", pm * 60, lm * 60)
          for pm in a.tiered_persistent_min for lm in a.local_min]
  return out


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--sizes-mb", type=float, nargs="+", default=[4, 32, 128, 256])
  p.add_argument("--repeats", type=int, default=2)
  p.add_argument("--dir", default=None, help="where to measure (default: a temp dir)")
  p.add_argument("--state-gb", type=float, nargs="+", default=[1, 100])
  p.add_argument("--hosts", type=int, default=64)
  p.add_argument("--persistent-gbps", type=float, default=5.3)
  p.add_argument("--persistent-restore-gbps", type=float, default=None,
                 help="aggregate restore bandwidth (default: --persistent-gbps)")
  p.add_argument("--local-gbps", type=float, default=4.0, help="per host")
  p.add_argument("--d2h-gbps", type=float, default=10.0, help="per host")
  p.add_argument("--peer-gbps", type=float, default=5.0, help="per host")
  p.add_argument("--restart-s", type=float, default=300.0)
  p.add_argument("--work-h", type=float, default=72.0)
  p.add_argument("--mtbf-h", type=float, default=4.0)
  p.add_argument("--host-loss", type=float, default=0.3)
  p.add_argument("--replicated", type=int, default=1, help="1: the state is replicated "
                 "across hosts (a peer refills a replaced host), 0: it is not")
  p.add_argument("--persistent-min", type=float, nargs="+", default=[5, 10, 30, 60, 120])
  p.add_argument("--temporary-min", type=float, default=30)
  p.add_argument("--permanent-min", type=float, default=240)
  p.add_argument("--local-min", type=float, nargs="+", default=[2, 5])
  p.add_argument("--tiered-persistent-min", type=float, nargs="+", default=[60])
  p.add_argument("--trials", type=int, default=200)
  a = p.parse_args(argv)

  root = a.dir or tempfile.mkdtemp(prefix="loopkit-tiers-")
  try:
    rows = measure(a.sizes_mb, a.repeats, root)
  finally:
    if a.dir is None:
      shutil.rmtree(root, ignore_errors=True)
  print("Measured on this machine (best of", a.repeats, "per size; seconds):")
  print(f"{'tier':<11}{'MB':>8}{'block':>9}{'commit':>9}{'restore':>9}")
  for kind, pts in rows.items():
    for nbytes, b, c, r in pts:
      print(f"{kind:<11}{nbytes / 1e6:>8.1f}{b:>9.3f}{c:>9.3f}{r:>9.3f}")
  fixed: dict[str, dict[str, float]] = {}
  print("\nFitted t = fixed + bytes / bandwidth (this machine's disk and memory):")
  for kind, pts in rows.items():
    fixed[kind] = {}
    for i, q in ((1, "block"), (2, "commit"), (3, "restore")):
      f, bw = fit([(pt[0], pt[i]) for pt in pts])
      fixed[kind][q] = f
      print(f"  {kind:<10} {q:<8} fixed {f:7.3f} s, {bw / GB:8.2f} GB/s")
  print("\nPod model (the fixed parts above kept; sizes at the stated bandwidths):")
  print(f"  hosts {a.hosts}; persistent {a.persistent_gbps:g} GB/s aggregate (restore "
        f"{a.persistent_restore_gbps or a.persistent_gbps:g}); local "
        f"{a.local_gbps:g} GB/s per host; device-to-host {a.d2h_gbps:g} GB/s per host; peer "
        f"{a.peer_gbps:g} GB/s per host; restart {a.restart_s:g} s")
  print(f"  run {a.work_h:g} h of training; preemptions Poisson, mean {a.mtbf_h:g} h apart; "
        f"{a.host_loss:.0%} of them replace a host; state "
        f"{'replicated' if a.replicated else 'not replicated'} across hosts; "
        f"{a.trials} trials per strategy")
  for gb in a.state_gb:
    tiers = pod_tiers(fixed, a, gb)
    print(f"\nState {gb:g} GB:")
    for name, t in tiers.items():
      print(f"  {name:<10} save blocks {t.block:8.2f} s, restorable after {t.commit:8.2f} s, "
            f"restore {t.restore:8.2f} s")
    young = math.sqrt(2 * tiers["persistent"].block * a.mtbf_h * 3600)
    print(f"  (Young's optimum for the persistent interval: sqrt(2 * block * MTBF) = "
          f"{young / 60:.1f} min)")
    print(f"  {'strategy':<86}{'goodput':>9}{'p10':>8}{'p90':>8}")
    for s in strategies(a):
      g = sorted(simulate(s, tiers, a, seed) for seed in range(a.trials))
      mean = sum(g) / len(g)
      print(f"  {s.name:<86}{mean:>9.2%}{g[len(g) // 10]:>8.2%}{g[9 * len(g) // 10]:>8.2%}")


if __name__ == "__main__":
  main()
