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

Every K is measured ``repeats`` times (default 3) in interleaved rounds over all K, so slow
drifts of the machine hit every K alike; a row's steps/s is the *median* of its repeats, so one
measurement that is much faster or slower than the others (another process paused, a short
window) cannot decide. The repeats also measure the noise: a row's ``±`` is the uncertainty of
its median (:attr:`TuneRow.uncertainty`, from the median absolute deviation of the repeats).
While a row that could be the pick has an uncertainty above ``tolerance``, it is measured
again, up to ``max_repeats`` times.

The pick (:func:`recommend`): the rows *within noise of the best* are those whose median is
below the best's by at most the larger of ``tolerance`` (2%) and twice the standard error of
that difference (from the two medians' uncertainties); they cannot be told apart, and the
smallest K of them is recommended
(larger K gains nothing measurable but delays hooks, grows the input chunk in memory and
coarsens the planner's cuts). The table says which K tie. When a row's uncertainty is still
above the tolerance after ``max_repeats``, the table ends with a ``warning:`` line naming each
such K, its uncertainty and spread (``(max - min) / max`` of its repeats) and the tolerance
(also logged to ``loopkit``); so does a sweep with one repeat (noise unknown), and one whose
recommendation is the largest K tried (throughput may still grow).

Command line (the target is ``module:function`` returning
``(train_step, init_state, batches)``; the default is a small built-in MLP)::

  python -m loopkit.tools.tune
  python -m loopkit.tools.tune my_project.train:tune_target --ks 1,4,16,64 --plot k.png

``batches`` may be a zero-argument callable returning a fresh iterable (called
once per K), a step-indexed source (``batch_at(step)``), or a re-iterable
(a list, a dataset object); ``init_state`` a state pytree or a zero-argument
callable. The state is copied to the host once and placed anew for every K.

This module measures (:func:`measure`, :func:`sweep`, the command line); the rows, the pick and
the report live in :mod:`loopkit.tools.tune_report` and are importable from here.
"""

from __future__ import annotations

import argparse
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

from loopkit._internal.checks import MIN_SLOTS
from loopkit.core.context import RunContext
from loopkit.core.hooks import Hook, LoopInfo
from loopkit.core.ledger import Bucket
from loopkit.core.loop import DataExhaustedWarning, TrainLoop
from loopkit.data.assembly import chunk_buffers_in_flight
from loopkit.tools._targets import load_target
from loopkit.tools.tune_report import (
  TuneResult,
  TuneRow,
  _pct,
  combine,
  plot,
  recommend,
  within_noise,
)

__all__ = ["DEFAULT_KS", "TuneResult", "TuneRow", "combine", "demo_target", "main", "measure",
           "plot", "recommend", "sweep", "within_noise"]

DEFAULT_KS = tuple(2 ** i for i in range(11))  # 1, 2, 4, ..., 1024

log = logging.getLogger("loopkit")


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


def _device_chunk_bytes(loop: TrainLoop, batch_bytes: int) -> int:
  """:attr:`TuneRow.device_chunk_bytes` of ``loop`` for a global batch of ``batch_bytes``."""
  per_device = batch_bytes // loop.data_parallel_size
  slots = max(loop.program.iterations_per_loop, MIN_SLOTS)
  return chunk_buffers_in_flight(loop.prefetch) * slots * per_device


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
                 secs_per_call=wall / (len(clock.marks) - warmup_calls),
                 device_chunk_bytes=_device_chunk_bytes(loop, source.batch_bytes or 0))


def sweep(target: Callable[[], tuple] | tuple, *, ks: Sequence[int] = DEFAULT_KS,
          calls: int = 3, warmup_calls: int = 1, min_secs: float = 0.0, repeats: int = 3,
          max_repeats: int = 10, tolerance: float = 0.02, plot_path: str | None = None,
          verbose: bool = False, log_warnings: bool = True, **loop_kwargs) -> TuneResult:
  """Measures every K of ``ks`` until its noise is known, and recommends one.

  Args:
    target: ``(train_step, init_state, batches)`` or a zero-argument callable
      returning it (called once).
    ks: the values of K to try (ints >= 1).
    calls, warmup_calls, min_secs: see :func:`measure`.
    repeats: the least measurements of every K, taken in interleaved rounds
      over all of ``ks`` (slow drifts of a shared machine hit every K alike);
      each row's steps/s is the median of its measurements (:func:`combine`).
      1 measures once and leaves the noise unknown (the table warns).
    max_repeats: the most measurements of one K: after the first ``repeats``
      rounds, the K within noise of the best (:func:`within_noise`) whose
      :attr:`TuneRow.uncertainty` is above ``tolerance`` are measured again,
      one round at a time, until none is or each has ``max_repeats``.
    tolerance: see :func:`within_noise`.
    plot_path: if given, a PNG of throughput against K is written there.
    verbose: print each measurement as it is taken (to stderr).
    log_warnings: log the result's warnings to the ``loopkit`` logger (the command line,
      which prints the table they end, does not: each would show twice).
    **loop_kwargs: passed to :class:`~loopkit.TrainLoop`.

  Returns:
    A :class:`TuneResult`; its warnings (:meth:`TuneResult.warnings`) are
    also logged to the ``loopkit`` logger (unless ``log_warnings=False``).

  Raises:
    ValueError: ``repeats < 1`` or ``max_repeats < repeats`` (naming both), or
      a sized ``batches`` (e.g. a list) shorter than
      ``(warmup_calls + calls) * max(ks)``, before anything is measured.
  """
  if repeats < 1 or max_repeats < repeats:
    raise ValueError(f"repeats must be >= 1 and max_repeats >= repeats, got repeats={repeats}, "
                     f"max_repeats={max_repeats}")
  train_step, init_state, batches = target() if callable(target) else target
  if callable(init_state):
    init_state = init_state()
  init_state = jax.device_get(init_state)
  need = (warmup_calls + calls) * max(int(k) for k in ks)
  if hasattr(batches, "__len__") and not callable(batches) and len(batches) < need:
    raise ValueError(  # before any K is measured, not after the small ones
        f"sweep needs at least {need} batches ((warmup_calls={warmup_calls} + calls={calls}) x "
        f"the largest K={max(int(k) for k in ks)}); the source has {len(batches)}")
  ks = [int(k) for k in ks]
  taken: dict[int, list[TuneRow]] = {k: [] for k in ks}

  def take(k: int, why: str) -> None:
    row = measure(train_step, init_state, batches, iterations_per_loop=k, calls=calls,
                  warmup_calls=warmup_calls, min_secs=min_secs, **dict(loop_kwargs))
    taken[k].append(row)
    if verbose:
      print(f"[{len(taken[k])}{why}] K={k}: {row.steps_per_sec:,.0f} steps/s, "
            f"{row.secs_per_call:.4g} s per call, host overhead {row.host_overhead:.2f}, "
            f"compile {row.compile_secs:.2f} s", file=sys.stderr)

  for _ in range(repeats):  # rounds over all K: slow drifts of the machine hit every K alike
    for k in ks:
      take(k, f"/{repeats}")
  while True:  # more rounds over the K that could be the pick while their noise is too large
    rows = {k: combine(taken[k]) for k in ks}
    ties = within_noise(list(rows.values()), tolerance)
    again = [k for k in ks if k in ties and len(taken[k]) < max_repeats
             and rows[k].uncertainty > tolerance]
    if not again:
      break
    for k in again:
      take(k, f"/{max_repeats} max: +-{_pct(rows[k].uncertainty)} > {_pct(tolerance)}")
  result = TuneResult(rows=[rows[k] for k in ks], recommended=recommend(list(rows.values()),
                                                                         tolerance),
                      tolerance=tolerance)
  for line in result.warnings() if log_warnings else ():
    log.warning("%s", line.removeprefix("warning: "))
  if plot_path is not None:
    plot(result, plot_path)
  return result


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
  p.add_argument("--repeats", type=int, default=3,
                 help="measure each K at least this many times; a row is the median "
                      "(default 3)")
  p.add_argument("--max-repeats", type=int, default=10,
                 help="measure a K that could be the pick again while its uncertainty is "
                      "above the tolerance, up to this many times (default 10)")
  p.add_argument("--tolerance", type=float, default=0.02,
                 help="recommend the smallest K within this fraction, or the measurement "
                      "noise, of the best (0.02)")
  p.add_argument("--plot", default="tuner.png", help="PNG to write ('' for none)")
  p.add_argument("--prefetch", type=int, default=2, help="chunks prefetched (default 2)")
  args = p.parse_args(argv)
  try:
    ks = [int(k) for k in args.ks.split(",") if k.strip()]
  except ValueError:
    raise SystemExit(f"--ks must be comma-separated integers, got {args.ks!r}") from None
  result = sweep(load_target(args.target), ks=ks, calls=args.calls,
                 warmup_calls=args.warmup_calls, min_secs=args.min_secs,
                 repeats=args.repeats, max_repeats=max(args.max_repeats, args.repeats),
                 tolerance=args.tolerance,
                 plot_path=args.plot or None, verbose=True, log_warnings=False,
                 prefetch=args.prefetch)
  print(f"target {args.target} on {jax.device_count()} {jax.devices()[0].platform} device(s)")
  print(result.table())
  if args.plot:
    print(f"plot written to {args.plot}")
  return result


if __name__ == "__main__":
  main()
