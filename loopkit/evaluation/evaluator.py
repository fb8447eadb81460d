"""The evaluator: exact evaluation, up to K eval batches per device call, padded and masked.

An eval step returns **per-example** values, never batch means::

    def eval_step(state, batch):            # batch leaves [B, ...]
      logits = model.apply(state["params"], batch["image"])
      return {"accuracy": (logits.argmax(-1) == batch["label"]).astype(jnp.float32),
              "loss": cross_entropy(logits, batch["label"])}   # each [B]

:class:`Evaluator` pads every batch to the static global batch B (the short
last batch, and on multi-host the extra batches of short processes) with zero
rows and a per-example mask, stacks up to K batches into one chunk
``[K, B, ...]`` (prefetched by :class:`loopkit.data.feeding.ChunkFeeder`), and runs
one compiled program per chunk that computes each batch's ``sum(mask * value)``
(float32) and ``sum(mask)``. Padded rows never count, even when their values are
NaN. The program sums across devices (for per-device steps with ``psum``), and
the host adds the per-batch sums in float64 in batch order, so a metric is
``total / count`` over the real examples, never a mean of batch or device means,
and the same bits for every K: the program runs the training
program's loop (:func:`loopkit.core.slot_loop.run_slots`), so K = 1 compiles the
K = 2 body, and no float32 sum spans batches. Every call length and every eval
run reuses one executable. An evaluator's first evaluation, which waits for its
first batches and compiles that executable (seconds to minutes with nothing else
on the console), logs ``evaluation: waiting for the first batches, then
compiling the eval program (batch B, K per device call)`` before it reads a
batch.

An eval step written for batch means (Flax's examples) is made per-example by
:func:`per_example` (each example evaluated as a batch of one); an NNX eval
step that updates an ``nnx.MultiMetric`` runs through
:class:`loopkit.nnx.NnxEvaluator` the same way.

Multi-host: every process must run the same number of batches (a process
that stops early would leave the others waiting at a collective): pass
``num_batches=loopkit.data.sources.eval_batches_per_process(...)``; processes with
fewer examples are padded with fully masked batches.

The hook that runs an evaluator from a train loop is :class:`loopkit.evaluation.EvalHook`
(:mod:`loopkit.evaluation.hook`); every public name here is importable from
:mod:`loopkit.evaluation`, its public home.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from loopkit._internal.checks import (
  MIN_SLOTS,
  check_device_axis_layout,
  check_iterations_per_loop,
  check_step_style,
  leaf_name,
)
from loopkit._internal.compat import lowering_count
from loopkit._internal.mesh import batch_sharding, check_batch_on_mesh, resolve_mesh
from loopkit.core.slot_loop import build_program, run_slots
from loopkit.data.feeding import ChunkFeeder

log = logging.getLogger("loopkit")


@dataclasses.dataclass(frozen=True)
class EvalResult:
  """The outcome of one evaluation.

  Attributes:
    metrics: ``total / count`` per metric (float; ``nan`` when count is 0).
    totals: masked sums of the per-example values over all examples and
      devices (float, accumulated in float64 across calls).
    num_examples: real (unmasked) examples counted, over all processes.
    num_batches: batches this process fed, padded ones included.
    num_calls: device calls made.
  """

  metrics: dict[str, float]
  totals: dict[str, float]
  num_examples: int
  num_batches: int
  num_calls: int


class Evaluator:
  """Runs an eval step over batches, K per device call, with exact counts.

  Args:
    eval_step: ``(state, batch) -> dict[str, per-example values]``, pure.
      Global style: values ``[B]`` for a batch ``[B, ...]``; per-device style:
      ``[B / D]`` for the device's slice. Values are cast to float32.
    iterations_per_loop: K, the most eval batches per device call.
    mesh: device mesh (default: 1-D mesh ``("data",)`` over all devices).
    data_axis: the mesh axis the batch is split over, or a tuple of them (the batch split
      over their product, the first one major; as in ``TrainLoop``).
    step_style: ``"global"`` or ``"per_device"`` (as in ``TrainLoop``; the per-device sums
      are added over ``data_axis``).
    global_batch_size: B, the static padded batch; must divide by the
      data-parallel size and the process count. Default: the first batch's
      global size rounded up to a multiple of the data-parallel size, then
      fixed for the evaluator's lifetime.
    prefetch: chunks prepared ahead by a background thread (0 = none).

  Raises:
    ValueError: K < 1; ``global_batch_size`` not divisible by the
      data-parallel size (the message names both numbers, and the axes when
      it is a product) or the process count; unknown ``data_axis`` or
      ``step_style``.

  Attributes:
    trace_count: times ``eval_step`` was traced (1 in a healthy run).

  Not thread-safe. Multi-host-safe when every process passes the same
  ``num_batches``.
  """

  def __init__(self, eval_step: Callable, *, iterations_per_loop: int = 1,
               mesh: Mesh | None = None, data_axis: str | tuple[str, ...] = "data",
               step_style: Literal["global", "per_device"] = "global",
               global_batch_size: int | None = None, prefetch: int = 2):
    self.iterations_per_loop = check_iterations_per_loop(iterations_per_loop)
    check_step_style(step_style)
    self.mesh, data_axis, self.data_parallel_size = resolve_mesh(mesh, data_axis)
    self.eval_step = eval_step
    self.data_axis = data_axis
    self.step_style = step_style
    self.prefetch = prefetch
    self.trace_count = 0
    self.global_batch_size: int | None = None
    self._template: Any = None  # one padded example row per leaf, for empty batches
    self._batch_from_first = False  # B was taken from a first batch, not given
    self._batch_sharding = batch_sharding(self.mesh, data_axis)
    if global_batch_size is not None:
      self._set_batch_size(global_batch_size)
    self._replicated = NamedSharding(self.mesh, P())
    self._compiles = 0  # calls that compiled (loopkit._internal.compat.lowering_count)
    self._announced = False  # the first evaluation's wait was announced (one log line)
    self._jitted = build_program(self._loop, mesh=self.mesh, data_axis=data_axis,
                                 style=step_style, out_shardings=self._replicated)

  def _set_batch_size(self, b: int) -> None:
    check_batch_on_mesh(b, self._batch_sharding)
    self.global_batch_size = b

  # -- traced ------------------------------------------------------------------

  def _loop(self, state, chunk, num_batches):
    """fori_loop over the chunk's first ``num_batches`` batches; masked sums."""
    self.trace_count += 1
    batches, mask = chunk["batch"], chunk["mask"]
    take = lambda x, i: jax.lax.dynamic_index_in_dim(x, i, keepdims=False)
    shapes = jax.eval_shape(self.eval_step, state, jax.tree.map(lambda x: take(x, 0), batches))
    if not isinstance(shapes, dict):
      raise TypeError(f"eval_step must return a dict of per-example values, got {type(shapes)}")
    per_example = mask.shape[1:]
    for name, s in shapes.items():
      if tuple(s.shape) != per_example:
        raise ValueError(
            f"eval_step value {name!r} has shape {tuple(s.shape)}; it must be per-example, "
            f"shape {per_example} (e.g. (pred == label).astype(jnp.float32), not its mean)")

    def body(i, slot, acc):  # one batch's sums into slot i: no float32 sum spans batches
      totals, count = acc
      m = slot["mask"]
      out = self.eval_step(state, slot["batch"])
      totals = {k: totals[k].at[i].set(jnp.sum(jnp.where(m, out[k].astype(jnp.float32), 0.0)))
                for k in totals}
      return totals, count.at[i].set(jnp.sum(m.astype(jnp.int32)))

    slots = max(self.iterations_per_loop, MIN_SLOTS)
    init = ({k: jnp.zeros((slots,), jnp.float32) for k in shapes}, jnp.zeros((slots,), jnp.int32))
    # The training program's loop: K = 1 compiles the K = 2 body (program.run_slots).
    totals, count = run_slots(body, chunk, num_batches, init)
    k = self.iterations_per_loop
    totals, count = jax.tree.map(lambda t: t[:k], (totals, count))  # [K] per-batch sums
    if self.step_style == "per_device":
      totals, count = jax.lax.psum((totals, count), self.data_axis)
    return totals, count

  # -- host --------------------------------------------------------------------

  def _pad(self, batch: Any) -> dict[str, Any]:
    """Pads a process-local batch ``[b, ...]`` to ``[B / P, ...]``; adds the mask."""
    local = self.global_batch_size // jax.process_count()
    if self._template is None:  # the first batch: prefetch_to_device output is refused
      check_device_axis_layout(batch, None if self._batch_from_first else self.global_batch_size,
                               process_count=jax.process_count())
    leaves = jax.tree.leaves(batch)
    b = np.shape(leaves[0])[0] if leaves and np.ndim(leaves[0]) else None
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
      if np.ndim(x) == 0 or np.shape(x)[0] != b:
        raise ValueError(f"eval batch leaf {leaf_name(path)} has shape "
                         f"{np.shape(x)}; every leaf needs the same leading batch dimension")
    if b > local:
      hint = ("; the static batch was taken from the first eval batch: if that was a partial "
              "one, give the Evaluator global_batch_size= (the full batch; every batch up to "
              "it is padded, so no drop_remainder is needed)" if self._batch_from_first else "")
      raise ValueError(f"an eval batch has {b} examples on this process, more than the "
                       f"static batch of {local} (global batch {self.global_batch_size})"
                       + hint)

    def pad(x):
      x = np.asarray(x)
      if b == local:
        return x
      return np.concatenate([x, np.zeros((local - b,) + x.shape[1:], x.dtype)])

    if self._template is None:
      self._template = jax.tree.map(lambda x: np.zeros((0,) + np.shape(x)[1:],
                                                       np.asarray(x).dtype), batch)
    return {"batch": jax.tree.map(pad, batch), "mask": np.arange(local) < b}

  def _padded(self, batches: Iterator, num_batches: int | None) -> Iterator[dict[str, Any]]:
    fed = 0
    for batch in batches:
      if num_batches is not None and fed >= num_batches:
        raise ValueError(f"the eval batches outnumber num_batches={num_batches}")
      yield self._pad(batch)
      fed += 1
    while num_batches is not None and fed < num_batches:
      if self._template is None:
        raise ValueError("no eval batch seen yet to pad with: this process got no data; "
                         "run one evaluation with data first or give it one example")
      yield self._pad(self._template)
      fed += 1

  def evaluate(self, state: Any, batches: Iterable, *,
               num_batches: int | None = None) -> EvalResult:
    """Evaluates ``state`` on every example of ``batches`` exactly once.

    Args:
      state: the (train) state pytree passed to ``eval_step``; not donated.
      batches: iterable of batches, pytrees of numpy arrays ``[b, ...]``
        with ``b <= B / P`` (the process-local part on multi-host); short
        and empty batches are padded and masked.
      num_batches: run exactly this many batches, padding with fully masked
        ones; required on multi-host so that all processes agree (see
        :func:`loopkit.data.sources.eval_batches_per_process`).

    Returns:
      An :class:`EvalResult`.

    Raises:
      ValueError: a batch larger than the static batch or with ragged
        leaves; a first batch already on the devices with a leading device axis
        (``flax.jax_utils.prefetch_to_device``: pass the numpy batches
        ``[b, ...]``); more batches than ``num_batches``; ``num_batches`` or the
        Evaluator's ``global_batch_size`` missing on multi-host; a non
        per-example eval output (names the metric).
      Any exception raised by the source.
    """
    if num_batches is None and jax.process_count() > 1:
      raise ValueError("on multi-host, pass num_batches (the same on every process) so no "
                       "process waits at a collective; see eval_batches_per_process")
    if self.global_batch_size is None and jax.process_count() > 1:
      # Guessing B from each process's first batch differs between processes
      # when shards are uneven (10 examples over 4 processes: 3 vs 2 local).
      raise ValueError("on multi-host, give the Evaluator global_batch_size (the same on every "
                       "process): it cannot be inferred from uneven per-process batches")
    if not self._announced:  # the first call's wait (seconds to minutes): say what it is
      batch = ("its batch size from the first batch" if self.global_batch_size is None
               else f"batch {self.global_batch_size}")
      log.info("evaluation: waiting for the first batches, then compiling the eval program "
               "(%s, %d per device call)", batch, self.iterations_per_loop)
      self._announced = True
    it = self._sized(iter(batches))
    if it is None:
      return EvalResult({}, {}, 0, 0, 0)
    outs, fed = self._call_all(state, self._padded(it, num_batches))
    return _eval_result(jax.device_get(outs), fed)

  def _sized(self, it: Iterator) -> Iterator | None:
    """``it`` once the static batch size is known (from its first batch if not given);
    None when that first batch is missing."""
    if self.global_batch_size is not None:
      return it
    first = next(it, None)
    if first is None:
      return None
    b = np.shape(jax.tree.leaves(first)[0])[0] * jax.process_count()
    dp = self.data_parallel_size
    self._set_batch_size(max(dp, -(-b // dp) * dp))
    self._batch_from_first = True
    return itertools.chain([first], it)

  def _call_all(self, state: Any, padded: Iterator[dict[str, Any]]) -> tuple[list[Any], int]:
    """One device call per chunk of up to K padded batches.

    Returns:
      ``(outs, fed)``: each call's device outputs (``[K]`` per-batch sums and
      counts) and the batches fed.
    """
    k = self.iterations_per_loop
    feeder = ChunkFeeder(padded, itertools.repeat(k), iterations_per_loop=k,
                         batch_sharding=self._batch_sharding, replicated=self._replicated,
                         prefetch=self.prefetch)
    outs, fed = [], 0
    try:
      while True:
        chunk = feeder.next()
        if chunk is None or chunk.length == 0:
          break
        lowered = lowering_count()
        outs.append(self._jitted(state, chunk.batches, chunk.num_steps))
        self._compiles += int(lowering_count() > lowered)
        fed += chunk.length
        if chunk.exhausted:
          break
    finally:
      feeder.close()
    return outs, fed

  __call__ = evaluate

  def lower(self, state: Any, chunk: Any) -> jax.stages.Lowered:
    """Lowers the program an eval call would run, without running it (ahead of time).

    Args:
      state: the state passed to ``eval_step``: arrays or ``jax.ShapeDtypeStruct``.
      chunk: ``{"batch": [K, B, ...] leaves, "mask": bool [K, B]}``: arrays or
        ``jax.ShapeDtypeStruct`` (B split over the data axis).

    Returns:
      ``jax.stages.Lowered`` for ``(state, chunk, num_batches: int32 scalar)``,
      the chunk on the evaluator's batch sharding and ``num_batches`` replicated,
      as the feeder places them.
    """
    chunk = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self._batch_sharding), chunk)
    num = jax.ShapeDtypeStruct((), jnp.int32, sharding=self._replicated)
    return self._jitted.lower(state, chunk, num)

  def compile_count(self) -> int:
    """Calls that compiled the eval program (1 in a healthy run).

    Counted from JAX's public lowering events
    (:func:`loopkit._internal.compat.lowering_count`) around
    each call, as for :meth:`loopkit.core.program.MultiStepProgram.compile_count`.
    """
    return self._compiles


def _eval_result(outs: list[Any], fed: int) -> EvalResult:
  """Adds the fetched per-batch sums in float64, in batch order, into an :class:`EvalResult`."""
  totals: dict[str, float] = {}
  count = 0
  for sums, n in outs:  # [K] per batch; slots past the call's length are 0
    for name, v in sums.items():
      for x in v:
        totals[name] = totals.get(name, 0.0) + float(x)
    count += int(np.sum(n))
  metrics = {name: (v / count if count else float("nan")) for name, v in totals.items()}
  return EvalResult(metrics, totals, count, fed, len(outs))


def per_example(eval_step: Callable) -> Callable:
  """Turns an eval step that returns batch means into one that returns per-example values.

  Flax's examples write ``eval_step(state, batch) -> {"loss": loss.mean(),
  "accuracy": (pred == label).mean()}``. A mean over a padded batch would
  count the padding rows; this wrapper runs the step on every example as a
  batch of one (``jax.vmap`` over the batch axis), so each example's value
  is its own "batch mean", and :class:`Evaluator` weights it by its mask:
  the result is the exact per-example mean over the real examples, whatever
  the batch size, padding or device count.

  Example:
    >>> ev = loopkit.Evaluator(loopkit.evaluation.per_example(eval_step))  # doctest: +SKIP

  Args:
    eval_step: ``(state, batch) -> dict[str, scalar]``, the values means over
      the batch's examples; it must not mix examples (no BatchNorm in training
      mode, no cross-example normalisation). Per-device style: the step sees
      its device's slice; values must be local means (no ``pmean``: the
      Evaluator sums over devices).

  Returns:
    ``(state, batch) -> dict[str, [B]]``: the values per example, float32.
  """
  def step(state, batch):
    def one(example):
      out = eval_step(state, jax.tree.map(lambda x: x[None], example))
      if not isinstance(out, dict):
        raise TypeError(f"eval_step must return a dict of batch means, got {type(out)}")
      for name, v in out.items():
        if jnp.ndim(v) != 0:
          raise ValueError(f"per_example: eval_step value {name!r} has shape {jnp.shape(v)}; "
                           "a batch mean is a scalar")
      return {k: jnp.asarray(v, jnp.float32) for k, v in out.items()}
    return jax.vmap(one)(batch)
  return step


def evaluate(eval_step: Callable, state: Any, batches: Iterable, *,
             num_batches: int | None = None, **evaluator_kwargs) -> EvalResult:
  """One-off evaluation: ``Evaluator(eval_step, **evaluator_kwargs).evaluate(...)``.

  Keep an :class:`Evaluator` instead when evaluating repeatedly (it compiles
  once). Arguments and errors as in :class:`Evaluator` and
  :meth:`Evaluator.evaluate`.
  """
  return Evaluator(eval_step, **evaluator_kwargs).evaluate(state, batches,
                                                           num_batches=num_batches)
