"""K tuner: measure throughput against ``iterations_per_loop`` and pick K.

For every K of a sweep (default 1, 2, 4, ..., 1024) the tuner builds a fresh
:class:`~loopkit.TrainLoop`, runs ``warmup_calls`` device calls of K steps (the
first compiles), then at least ``calls`` more and at least ``min_secs`` of wall
time, and measures over those (after compilation and the pipeline's fill):

* **steps/s**: steps / wall time between the boundaries that close the warm-up
  and the last call;
* **host overhead**: the fraction of that wall time the host was *not*
  blocked waiting for the device (``1 - device_wait / wall``): near 1 when
  per-call host work dominates (small K), near 0 when the device is the
  bottleneck (large K);
* **compile s**: the first dispatch (trace + compile + the first call's
  launch) from the loop's ledger;
* **input bytes/call**: K x the bytes of one global batch (what crosses to the
  device per call).

It recommends the smallest K whose throughput is within ``tolerance`` (2%) of
the best: larger K gains nothing measurable but delays hooks, grows the input
chunk in memory and coarsens the planner's cuts. With ``repeats > 1`` each K
keeps its fastest measurement and the table shows the spread over the repeats
(``(max - min) / max`` of steps/s): a spread larger than the tolerance means
the machine's noise, not K, decides between rows within it. When the
recommendation is the largest K tried, the sweep may have ended too early
(throughput may still grow): the table and a ``loopkit`` warning say so.

Command line (the target is ``module:function`` returning
``(train_step, init_state, batches)``; the default is a small built-in MLP)::

  python -m loopkit.tools.tune
  python -m loopkit.tools.tune my_project.train:tune_target --ks 1,4,16,64 --plot k.png

``batches`` may be a zero-argument callable returning a fresh iterable (called
once per K), a step-indexed source (``batch_at(step)``), or a re-iterable
(a list, a dataset object); ``init_state`` a state pytree or a zero-argument
callable. The state is copied to the host once and placed anew for every K.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import math
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from loopkit._internal.extras import require
from loopkit.core.context import RunContext
from loopkit.core.hooks import Hook, LoopInfo
from loopkit.core.ledger import Bucket
from loopkit.core.loop import DataExhaustedWarning, TrainLoop

__all__ = ["DEFAULT_KS", "TuneResult", "TuneRow", "demo_target", "main", "measure", "plot",
           "recommend", "sweep"]

DEFAULT_KS = tuple(2 ** i for i in range(11))  # 1, 2, 4, ..., 1024

log = logging.getLogger("loopkit")


@dataclasses.dataclass(frozen=True)
class TuneRow:
  """Measurements at one K.

  Attributes:
    iterations_per_loop: K.
    steps_per_sec: training steps per second of wall time, steady state.
    host_overhead: fraction of steady-state wall time the host was not waiting
      on the device, in [0, 1].
    compile_secs: the first dispatch (trace + compile) in seconds.
    input_bytes_per_call: bytes of input per device call (K x global batch).
    secs_per_call: steady-state wall time per device call.
    repeat_steps_per_sec: steps/s of every repeat at this K (a sweep's row
      keeps the fastest as ``steps_per_sec``); empty for a single measurement.
  """

  iterations_per_loop: int
  steps_per_sec: float
  host_overhead: float
  compile_secs: float
  input_bytes_per_call: int
  secs_per_call: float
  repeat_steps_per_sec: tuple[float, ...] = ()

  @property
  def spread(self) -> float:
    """``(max - min) / max`` of steps/s over the repeats (0 for fewer than two)."""
    r = self.repeat_steps_per_sec
    return (max(r) - min(r)) / max(r) if len(r) > 1 and max(r) > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class TuneResult:
  """A sweep's rows and the recommended K.

  Attributes:
    rows: one :class:`TuneRow` per K, in sweep order.
    recommended: the smallest K within ``tolerance`` of the best throughput.
    tolerance: the relative tolerance used (0.02 = 2%).
  """

  rows: list[TuneRow]
  recommended: int
  tolerance: float

  @property
  def at_largest(self) -> bool:
    """Whether the recommended K is the largest tried (the sweep may have ended too early)."""
    return len(self.rows) > 1 and self.recommended == max(r.iterations_per_loop
                                                          for r in self.rows)

  def warning(self) -> str | None:
    """The sentence the table ends with when :attr:`at_largest`, else None."""
    if not self.at_largest:
      return None
    return (f"warning: K={self.recommended} is the largest K tried; throughput may still grow "
            f"with K (try larger values, e.g. --ks ...,{2 * self.recommended},"
            f"{4 * self.recommended})")

  def table(self) -> str:
    """A Markdown table of the rows; the recommended K is marked ``*``.

    Columns: K, steps/s (the fastest repeat), the spread over repeats
    (``(max - min) / max``, ``-`` for one), seconds per device call, host
    overhead fraction, compile seconds, input bytes per call.
    """
    lines = ["| K | steps/s | spread | s/call | host overhead | compile s | input bytes/call |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in self.rows:
      mark = " *" if r.iterations_per_loop == self.recommended else ""
      spread = f"{100 * r.spread:.1f}%" if len(r.repeat_steps_per_sec) > 1 else "-"
      lines.append(f"| {r.iterations_per_loop}{mark} | {r.steps_per_sec:,.0f} | {spread} | "
                   f"{r.secs_per_call:.4g} | {r.host_overhead:.2f} | {r.compile_secs:.2f} | "
                   f"{r.input_bytes_per_call:,} |")
    best = max(self.rows, key=lambda r: r.steps_per_sec)
    lines.append("")
    lines.append(f"recommended iterations_per_loop = {self.recommended} (smallest K within "
                 f"{100 * self.tolerance:g}% of the best, {best.steps_per_sec:,.0f} steps/s "
                 f"at K={best.iterations_per_loop})")
    warning = self.warning()
    if warning is not None:
      lines.append(warning)
    return "\n".join(lines)


def recommend(rows: Sequence[TuneRow], tolerance: float = 0.02) -> int:
  """The smallest K whose steps/s is at least ``(1 - tolerance)`` x the best.

  Args:
    rows: measurements (any order).
    tolerance: relative tolerance in [0, 1).

  Returns:
    K.

  Raises:
    ValueError: for no rows or a tolerance outside [0, 1).

  Example:
    >>> rows = [TuneRow(k, s, 0.0, 0.0, 0, 0.0) for k, s in [(1, 50.), (2, 99.), (4, 100.)]]
    >>> recommend(rows)
    2
  """
  if not rows:
    raise ValueError("recommend needs at least one row")
  if not 0 <= tolerance < 1:
    raise ValueError(f"tolerance must be in [0, 1), got {tolerance}")
  best = max(r.steps_per_sec for r in rows)
  return min(r.iterations_per_loop for r in rows
             if r.steps_per_sec >= (1 - tolerance) * best)


class _BoundaryClock(Hook):
  """Records (host time, step, cumulative device_wait) at every boundary and stops
  the loop once ``calls`` calls and ``min_secs`` seconds were measured."""

  needs_state = False

  def __init__(self, warmup_calls: int, calls: int, min_secs: float):
    super().__init__()
    self.warmup_calls, self.calls, self.min_secs = warmup_calls, calls, min_secs
    self.marks: list[tuple[float, int, float]] = []

  def on_run_start(self, ctx: RunContext, state: Any) -> None:
    self._ctx = ctx

  def after_each_call(self, info: LoopInfo) -> None:
    ctx = self._ctx
    self.marks.append((time.perf_counter(), info.end_step,
                       ctx.ledger.seconds.get(Bucket.DEVICE_WAIT, 0.0)))
    measured = len(self.marks) - self.warmup_calls
    if (measured >= self.calls
        and self.marks[-1][0] - self.marks[self.warmup_calls - 1][0] >= self.min_secs):
      ctx.request_stop("measured")


def _batch_bytes(batch: Any) -> int:
  return int(sum(np.asarray(x).nbytes for x in jax.tree.leaves(batch))) * jax.process_count()


class _Peek:
  """Wraps a batch source and remembers the first batch's size in bytes."""

  def __init__(self, source: Any):
    self.source = source
    self.batch_bytes: int | None = None
    if hasattr(source, "batch_at"):
      self.batch_at = self._batch_at

  def _batch_at(self, step):
    b = self.source.batch_at(step)
    if self.batch_bytes is None:
      self.batch_bytes = _batch_bytes(b)
    return b

  def __iter__(self):
    for b in self.source:
      if self.batch_bytes is None:
        self.batch_bytes = _batch_bytes(b)
      yield b


def _fresh_batches(batches: Any) -> Any:
  if callable(batches) and not hasattr(batches, "batch_at"):
    return batches()
  if hasattr(batches, "batch_at"):
    return batches
  if iter(batches) is batches:
    raise ValueError("the tuner runs the loop once per K, so batches must be re-iterable: "
                     "pass a zero-argument callable returning a fresh iterable, a list, or a "
                     "step-indexed source with batch_at(step); got a one-shot iterator")
  return batches


def measure(train_step: Callable, init_state: Any, batches: Any, *, iterations_per_loop: int,
            calls: int = 3, warmup_calls: int = 1, min_secs: float = 0.0,
            max_calls: int = 100_000, **loop_kwargs) -> TuneRow:
  """Runs ``warmup_calls`` calls of K steps, then measures at least ``calls`` more.

  Args:
    train_step: ``(state, batch) -> (state, metrics)``.
    init_state: the state pytree (host or device arrays; not modified).
    batches: see the module docstring.
    iterations_per_loop: K.
    calls: measured calls (>= 1).
    warmup_calls: calls run first and not measured (>= 1: the first includes
      compilation).
    min_secs: keep measuring (more calls) until the measured window is at
      least this long, so a small K is not timed over a few milliseconds.
    max_calls: the most measured calls (a bound for ``min_secs``).
    **loop_kwargs: more :class:`~loopkit.TrainLoop` arguments (mesh, prefetch...).

  Returns:
    A :class:`TuneRow`.

  Raises:
    ValueError: for ``calls`` or ``warmup_calls`` < 1, or a source that ran
      out before ``(warmup_calls + calls) * K`` steps.

  The measured window runs from the boundary that closes the warm-up to the last
  boundary; the loop is stopped (``request_stop``) once it is long enough.
  """
  if calls < 1 or warmup_calls < 1:
    raise ValueError(f"calls and warmup_calls must be >= 1, got {calls}, {warmup_calls}")
  k = iterations_per_loop
  clock = _BoundaryClock(warmup_calls, calls, min_secs)
  hooks = list(loop_kwargs.pop("hooks", ())) + [clock]
  loop = TrainLoop(train_step, iterations_per_loop=k, hooks=hooks, **loop_kwargs)
  source = _Peek(_fresh_batches(batches))
  step0 = int(jax.device_get(loop.step_of(init_state)))
  num_steps = step0 + (warmup_calls + max(calls, max_calls)) * k
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DataExhaustedWarning)
    state = loop.run(jax.tree.map(np.asarray, init_state), source, num_steps=num_steps)
  jax.block_until_ready(state)
  ledger = loop.ledger
  assert ledger is not None  # set by run
  if len(clock.marks) < warmup_calls + calls:
    raise ValueError(f"the batch source ran out at step {ledger.step} while measuring "
                     f"K={k}; it needs at least {(warmup_calls + calls) * k} batches")
  t0, s0, w0 = clock.marks[warmup_calls - 1]
  t1, s1, w1 = clock.marks[-1]
  wall = t1 - t0
  return TuneRow(iterations_per_loop=k, steps_per_sec=(s1 - s0) / wall,
                 host_overhead=min(max(1.0 - (w1 - w0) / wall, 0.0), 1.0),
                 compile_secs=ledger.seconds.get(Bucket.COMPILE, 0.0),
                 input_bytes_per_call=k * (source.batch_bytes or 0),
                 secs_per_call=wall / (len(clock.marks) - warmup_calls))


def sweep(target: Callable[[], tuple] | tuple, *, ks: Sequence[int] = DEFAULT_KS,
          calls: int = 3, warmup_calls: int = 1, min_secs: float = 0.0, repeats: int = 1,
          tolerance: float = 0.02, plot_path: str | None = None, verbose: bool = False,
          **loop_kwargs) -> TuneResult:
  """Measures every K of ``ks`` and recommends one.

  Args:
    target: ``(train_step, init_state, batches)`` or a zero-argument callable
      returning it (called once).
    ks: the values of K to try (ints >= 1).
    calls, warmup_calls, min_secs: see :func:`measure`.
    repeats: rounds over all of ``ks``; each K keeps its fastest measurement
      (best-of-n, in interleaved rounds, filters out interference from other
      processes on a shared machine).
    tolerance: see :func:`recommend`.
    plot_path: if given, a PNG of throughput against K is written there.
    verbose: print each row as it is measured (to stderr).
    **loop_kwargs: passed to :class:`~loopkit.TrainLoop`.

  Returns:
    A :class:`TuneResult`.

  Raises:
    ValueError: a sized ``batches`` (e.g. a list) shorter than
      ``(warmup_calls + calls) * max(ks)``, before anything is measured.
  """
  train_step, init_state, batches = target() if callable(target) else target
  if callable(init_state):
    init_state = init_state()
  init_state = jax.device_get(init_state)
  need = (warmup_calls + calls) * max(int(k) for k in ks)
  if hasattr(batches, "__len__") and not callable(batches) and len(batches) < need:
    raise ValueError(  # before any K is measured, not after the small ones
        f"sweep needs at least {need} batches ((warmup_calls={warmup_calls} + calls={calls}) x "
        f"the largest K={max(int(k) for k in ks)}); the source has {len(batches)}")
  best: dict[int, TuneRow] = {}
  seen: dict[int, list[float]] = {}
  for rep in range(repeats):  # rounds over all K: slow drifts of the machine hit every K alike
    for k in ks:
      row = measure(train_step, init_state, batches, iterations_per_loop=int(k), calls=calls,
                    warmup_calls=warmup_calls, min_secs=min_secs, **dict(loop_kwargs))
      seen.setdefault(int(k), []).append(row.steps_per_sec)
      if int(k) not in best or row.steps_per_sec > best[int(k)].steps_per_sec:
        best[int(k)] = row
      if verbose:
        print(f"[{rep + 1}/{repeats}] K={row.iterations_per_loop}: {row.steps_per_sec:,.0f} "
              f"steps/s, {row.secs_per_call:.4g} s per call, host overhead "
              f"{row.host_overhead:.2f}, compile {row.compile_secs:.2f} s", file=sys.stderr)
  rows = [dataclasses.replace(best[int(k)], repeat_steps_per_sec=tuple(seen[int(k)])
                              if repeats > 1 else ()) for k in ks]
  result = TuneResult(rows=rows, recommended=recommend(rows, tolerance), tolerance=tolerance)
  if result.at_largest:
    log.warning("%s", result.warning())
  if plot_path is not None:
    plot(result, plot_path)
  return result


def plot(result: TuneResult, path: str, *, title: str | None = None) -> None:
  """Writes a PNG: steps/s against K (log2 axis) with host overhead, the 2% band, the pick.

  Args:
    result: a :class:`TuneResult`.
    path: the PNG file to write.
    title: the plot's title (default names the recommendation).
  """
  matplotlib = require("matplotlib", "loopkit.tools.tune's plot")  # lazy: only the tuner needs it
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  ks = [r.iterations_per_loop for r in result.rows]
  sps = [r.steps_per_sec for r in result.rows]
  best = max(sps)
  fig, ax = plt.subplots(figsize=(7.5, 4.4), dpi=120)
  ax.plot(ks, sps, "o-", color="tab:blue", label="steps/s")
  ax.axhline((1 - result.tolerance) * best, color="tab:gray", ls=":", lw=1,
             label=f"{100 * (1 - result.tolerance):g}% of best")
  rec = next(r for r in result.rows if r.iterations_per_loop == result.recommended)
  ax.plot([rec.iterations_per_loop], [rec.steps_per_sec], "*", ms=16, color="tab:red",
          label=f"recommended K={rec.iterations_per_loop}")
  ax.set_xscale("log", base=2)
  ax.set_xticks(ks)
  ax.set_xticklabels([str(k) for k in ks])
  ax.set_xlabel("iterations_per_loop (K, steps per device call)")
  ax.set_ylabel("training steps / s")
  ax.set_ylim(bottom=0)
  ax2 = ax.twinx()
  ax2.plot(ks, [r.host_overhead for r in result.rows], "s--", color="tab:orange", ms=4,
           label="host overhead (fraction)")
  ax2.set_ylim(0, 1.05)
  ax2.set_ylabel("host overhead fraction")
  lines = ax.get_legend_handles_labels()
  lines2 = ax2.get_legend_handles_labels()
  fig.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="lower center", ncol=4,
             fontsize=8, frameon=False)
  ax.set_title(title or f"throughput vs iterations_per_loop (recommended K="
               f"{result.recommended})", fontsize=10)
  fig.tight_layout(rect=(0, 0.07, 1, 1))
  fig.savefig(path)
  plt.close(fig)


# -- built-in demo target --------------------------------------------------------


class _DemoBatches:
  """Step-indexed regression batches from a small fixed pool (cheap on the host)."""

  def __init__(self, batch_size: int, dim: int, pool: int = 16, seed: int = 0):
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(dim, 1)).astype(np.float32)
    self._pool = []
    for _ in range(pool):
      x = rng.normal(size=(batch_size, dim)).astype(np.float32)
      self._pool.append({"x": x, "y": np.tanh(x @ w)})

  def batch_at(self, step: int) -> dict[str, np.ndarray]:
    return self._pool[step % len(self._pool)]


def demo_target(batch_size: int = 64, dim: int = 32, hidden: int = 512,
                learning_rate: float = 0.05) -> tuple[Callable, dict, _DemoBatches]:
  """A small MLP regression (plain JAX, SGD) for ``python -m loopkit.tools.tune``.

  A 2-layer tanh MLP ``[dim] -> [hidden] -> [1]`` on batches ``x: [B, dim]``
  float32, ``y: [B, 1]`` float32, mean squared error, plain SGD. Small enough
  that per-call host overhead is visible on a CPU, large enough (about 6 MFLOP
  per step) that the curve flattens at a moderate K.

  Returns:
    ``(train_step, init_state, batches)``: the state is
    ``{"params": {...}, "step": int32 scalar}``; ``batches`` is step-indexed.
  """
  k1, k2 = jax.random.split(jax.random.key(0))
  params = {"w1": jax.random.normal(k1, (dim, hidden)) / math.sqrt(dim),
            "b1": jnp.zeros((hidden,)),
            "w2": jax.random.normal(k2, (hidden, 1)) / math.sqrt(hidden),
            "b2": jnp.zeros((1,))}
  state = {"params": params, "step": jnp.zeros((), jnp.int32)}

  def loss_fn(p, batch):
    h = jnp.tanh(batch["x"] @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] + p["b2"] - batch["y"]) ** 2)

  def train_step(state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
    params = jax.tree.map(lambda p, g: p - learning_rate * g, state["params"], grads)
    return {"params": params, "step": state["step"] + 1}, {"loss": loss}

  return train_step, state, _DemoBatches(batch_size, dim)


def _load_target(spec: str) -> Callable[[], tuple]:
  module, _, name = spec.partition(":")
  if not module or not name:
    raise SystemExit(f"target must be module:function, got {spec!r}")
  fn = getattr(importlib.import_module(module), name, None)
  if fn is None:
    raise SystemExit(f"module {module!r} has no attribute {name!r}")
  return fn


def main(argv: Sequence[str] | None = None) -> TuneResult:
  """Command line: ``python -m loopkit.tools.tune [module:function] [options]``.

  Prints the table and the recommendation to stdout; see ``--help``.
  """
  p = argparse.ArgumentParser(
      prog="python -m loopkit.tools.tune",
      description="Measure throughput against iterations_per_loop and recommend K.")
  p.add_argument("target", nargs="?", default="loopkit.tools.tune:demo_target",
                 help="module:function returning (train_step, init_state, batches) "
                      "(default: a built-in MLP demo)")
  p.add_argument("--ks", default=",".join(str(k) for k in DEFAULT_KS),
                 help="comma-separated values of K (default 1,2,4,...,1024)")
  p.add_argument("--calls", type=int, default=3, help="measured calls per K (default 3)")
  p.add_argument("--warmup-calls", type=int, default=1,
                 help="unmeasured calls per K, the first compiles (default 1)")
  p.add_argument("--min-secs", type=float, default=1.0,
                 help="measure each K for at least this many seconds (default 1.0)")
  p.add_argument("--repeats", type=int, default=1,
                 help="measure each K this many times, keep the fastest (default 1)")
  p.add_argument("--tolerance", type=float, default=0.02,
                 help="recommend the smallest K within this fraction of the best (0.02)")
  p.add_argument("--plot", default="tuner.png", help="PNG to write ('' for none)")
  p.add_argument("--prefetch", type=int, default=2, help="chunks prefetched (default 2)")
  args = p.parse_args(argv)
  try:
    ks = [int(k) for k in args.ks.split(",") if k.strip()]
  except ValueError:
    raise SystemExit(f"--ks must be comma-separated integers, got {args.ks!r}") from None
  result = sweep(_load_target(args.target), ks=ks, calls=args.calls,
                 warmup_calls=args.warmup_calls, min_secs=args.min_secs,
                 repeats=args.repeats, tolerance=args.tolerance,
                 plot_path=args.plot or None, verbose=True, prefetch=args.prefetch)
  print(f"target {args.target} on {jax.device_count()} {jax.devices()[0].platform} device(s)")
  print(result.table())
  if args.plot:
    print(f"plot written to {args.plot}")
  return result


if __name__ == "__main__":
  main()
