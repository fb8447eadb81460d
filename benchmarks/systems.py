"""The systems compared by the benchmark, each timed on the same workload.

Every system follows one protocol: ``warm()`` runs the whole workload once
(compiling whatever it compiles), ``timed()`` runs it again from the initial
state and returns wall seconds up to the final state being ready, and
``train_compiles()`` counts the executables of its train program.

Systems:
  * :class:`Loopkit`: ``loopkit.TrainLoop(step, iterations_per_loop=K)`` fed by
    an iterator of numpy batches (its own prefetch thread stacks and places
    ``[K, B, ...]`` chunks).
  * :class:`PerStepJit`: a Flax-example loop, one ``jax.jit`` call per step,
    the state donated, batches placed two ahead (``jax.device_put`` into a
    deque, like ``flax.jax_utils.prefetch_to_device``) and metrics fetched every
    100 steps (the examples' ``log_every_steps``).
  * :class:`PerStepPmap`: the same with ``jax.pmap`` and
    ``flax.jax_utils.prefetch_to_device(it, 2)`` (the Flax ImageNet example).
  * :class:`KerasFit`: Keras 3 on the JAX backend,
    ``fit(steps_per_execution=100)``, data-parallel over all devices.
  * :class:`HandwrittenScan`: the ``iterations_per_loop`` loop a user writes by
    hand without loopkit: ``np.stack`` K numpy batches from the same list, one
    ``jit(lambda s, c: lax.scan(step, s, c))`` call per chunk, each call's metrics
    fetched after the next call is dispatched (as ``TrainLoop`` does).
  * :class:`Limit`: one jitted ``lax.scan`` over all S steps with the whole
    data set ``[S, B, ...]`` already on the devices: no host work at all.

A line-up (which systems a run measures, with which arguments, on which workloads and
device counts) is data: a tuple of :class:`benchmarks.runner.Entry` (``benchmarks/run.py``'s
``LINEUP``), built here by :func:`build`.

Runs in a worker process whose device count was fixed before JAX started.
"""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import loopkit
from benchmarks import runner, workloads as wl

# Per-step loops wait for their outputs every this many steps (Flax examples: log_every_steps).
LOG_EVERY_STEPS = 100
# ... but on more than one fake CPU device never let more than this many calls run ahead:
# jax 0.10.2's XLA:CPU deadlocks in an all-reduce rendezvous ("only 7 of them arrived", process
# aborted after 40 s) with about 45 or more collective programs in flight (measured here: 40 in
# flight ran 3000 steps, 45, 50 and 64 hung; cf. jax-ml/jax#25861). loopkit keeps at most 2.
MAX_IN_FLIGHT_MULTI_DEVICE = 20


def wait_every() -> int:
  """Steps between waits for a per-step loop here: :data:`LOG_EVERY_STEPS` on one device,
  :data:`MAX_IN_FLIGHT_MULTI_DEVICE` on several."""
  return LOG_EVERY_STEPS if jax.device_count() == 1 else MAX_IN_FLIGHT_MULTI_DEVICE


# -- helpers -------------------------------------------------------------------

def data_mesh() -> jax.sharding.Mesh:
  """1-D mesh ``("data",)`` over all devices, ``Auto`` axis type (classic jit sharding).

  With ``jax.make_mesh``'s default ``Explicit`` axes a numpy batch passed to a jitted step
  is typed as replicated, and the step is compiled to run the whole batch on every device;
  every system here gets the same ``Auto`` mesh instead.
  """
  return jax.make_mesh((jax.device_count(),), ("data",),
                       axis_types=(jax.sharding.AxisType.Auto,))


def device_prefetch(batches: Iterable, sharding: Any, size: int = 2) -> Iterator:
  """Places batches on the devices ``size`` ahead (double buffering for size 2).

  Like ``flax.jax_utils.prefetch_to_device`` for ``jit``: the batch axis is laid
  out by ``sharding`` instead of a leading device axis.
  """
  queue = collections.deque()
  it = iter(batches)

  def enqueue(n):
    for b in itertools.islice(it, n):
      queue.append(jax.device_put(b, sharding))

  enqueue(size)
  while queue:
    yield queue.popleft()
    enqueue(1)


def scan_step(w: wl.Workload) -> Callable:
  """The workload's train step for a hand-made ``lax.scan``: on CPU with the convolution
  relayout that loopkit's program applies itself (``conv_layout.with_canonical_convs``), so
  scans compare like with like."""
  step = wl.make_train_step(w)
  if jax.devices()[0].platform == "cpu":
    step = loopkit.conv_layout.with_canonical_convs(step)
  return step


def per_step_loop(step: Callable, state: Any, batches: Iterable, wait_every: int,
                  mark_at: int = -1, mark: Callable | None = None) -> Any:
  """The Flax examples' train loop: one ``step`` call per batch, metrics fetched every
  ``wait_every`` steps and at the end; ``mark()`` after step ``mark_at``. Returns the
  final state, ready."""
  train_metrics = []
  for i, batch in enumerate(batches, 1):
    state, metrics = step(state, batch)
    train_metrics.append(metrics)
    if i % wait_every == 0:
      jax.device_get(train_metrics)
      train_metrics = []
    if i == mark_at and mark is not None:
      mark()
  jax.device_get(train_metrics)
  return jax.block_until_ready(state)


class System:
  """Protocol of a benchmarked system (see module docstring)."""

  name: str = "?"
  calls_per_run: int = 0
  steps_per_call: int = 1

  def warm(self) -> None:
    """Compiles and warms on a short run (a full call and a short one where that applies)."""
    raise NotImplementedError

  def timed(self) -> float:
    raise NotImplementedError

  def train_compiles(self) -> int | None:
    return None

  def run_calls(self, calls: int, mark_at: int, mark: Callable[[], None]) -> None:
    """Runs one run of ``calls`` device calls on cycled data, calling ``mark()`` after
    call ``mark_at`` (for the RSS growth figure)."""
    raise NotImplementedError


# -- systems ---------------------------------------------------------------------

class Loopkit(System):
  """loopkit ``TrainLoop`` with ``iterations_per_loop=K``, global-array step.

  ``source="list"`` feeds an iterator over the list of numpy batches (a Python object
  per batch, like most input pipelines); ``"array"`` a ``loopkit.ArraySource`` over the
  same batches in the same order (``shuffle=False``), which the feeder reads a whole
  chunk at a time (``chunk_at``).
  """

  def __init__(self, w: wl.Workload, data: dict[str, np.ndarray], k: int,
               style: str = "global", prefetch: int = 2, source: str = "list"):
    self.name = (f"loopkit K={k}" + (" per-device" if style == "per_device" else "")
                 + (f" prefetch={prefetch}" if prefetch != 2 else "")
                 + (" ArraySource" if source == "array" else ""))
    self.k = self.steps_per_call = k
    self.w = w
    self.batches = wl.batch_list(data)
    self.array_source = wl.array_source(data) if source == "array" else None
    step = wl.make_train_step(w, axis_name="data" if style == "per_device" else None)
    self.loop = loopkit.TrainLoop(step, iterations_per_loop=k, mesh=data_mesh(),
                                  step_style=style, prefetch=prefetch)
    self.calls_per_run = -(-len(self.batches) // k)

  def warm(self) -> None:
    n = min(len(self.batches), self.k + max(1, self.k // 2))  # a full call and a short one
    jax.block_until_ready(self.loop.run(wl.init_state(self.w), self._source(), num_steps=n))

  def _source(self) -> Any:
    return self.array_source if self.array_source is not None else iter(self.batches)

  def timed(self) -> float:
    state = wl.init_state(self.w)
    t0 = time.perf_counter()
    state = self.loop.run(state, self._source(), num_steps=len(self.batches))
    jax.block_until_ready(state)
    return time.perf_counter() - t0

  def train_compiles(self) -> int:
    return self.loop.program.compile_count()

  def run_calls(self, calls: int, mark_at: int, mark: Callable[[], None]) -> None:
    # A second loop with a hook at the mark (the timed loop keeps no hooks).
    hook = loopkit.CallbackHook(lambda info, state: mark(), needs_state=False,
                                at_steps=[mark_at * self.k], at_end=False)
    loop = loopkit.TrainLoop(self.loop.program.train_step, iterations_per_loop=self.k,
                             mesh=self.loop.mesh, step_style=self.loop.program.style,
                             prefetch=self.loop.prefetch, hooks=[hook])
    n = calls * self.k
    src = itertools.islice(itertools.cycle(self.batches), n)
    jax.block_until_ready(loop.run(wl.init_state(self.w), src, num_steps=n))


class PerStepJit(System):
  """One ``jax.jit`` call per step, Flax-example style.

  With ``prefetch`` the batches are placed two ahead with ``jax.device_put``;
  without, the numpy batch goes straight into the jitted call (JAX transfers it
  on dispatch), which on CPU is the cheaper of the two.
  """

  def __init__(self, w: wl.Workload, data: dict[str, np.ndarray], prefetch: bool = True):
    self.name = "per-step jit + prefetch" if prefetch else "per-step jit, numpy in"
    self.prefetch = prefetch
    self.w = w
    self.batches = wl.batch_list(data)
    mesh = data_mesh()
    self.replicated = NamedSharding(mesh, P())
    self.batch_sharding = NamedSharding(mesh, P("data"))
    # Shardings pinned as in the Flax examples' jit loops: state replicated, batch split on
    # "data" (a numpy batch is split by the call itself; without in_shardings every device
    # would get the whole batch).
    self.step = jax.jit(wl.make_train_step(w), donate_argnums=(0,),
                        in_shardings=(self.replicated, self.batch_sharding),
                        out_shardings=(self.replicated, self.replicated))
    self.calls_per_run = len(self.batches)
    self.wait_every = wait_every()

  def _train(self, batches: Iterable, mark_at: int = -1, mark: Callable | None = None) -> Any:
    state = jax.device_put(wl.init_state(self.w), self.replicated)
    if self.prefetch:
      batches = device_prefetch(batches, self.batch_sharding)
    return per_step_loop(self.step, state, batches, self.wait_every, mark_at, mark)

  def warm(self) -> None:
    self._train(self.batches[:2])

  def timed(self) -> float:
    t0 = time.perf_counter()
    self._train(self.batches)
    return time.perf_counter() - t0

  def train_compiles(self) -> int:
    return self.step._cache_size()

  def run_calls(self, calls: int, mark_at: int, mark: Callable[[], None]) -> None:
    self._train(itertools.islice(itertools.cycle(self.batches), calls), mark_at, mark)


class PerStepPmap(System):
  """One ``jax.pmap`` call per step with ``flax.jax_utils.prefetch_to_device(it, 2)``."""

  name = "per-step pmap"

  def __init__(self, w: wl.Workload, data: dict[str, np.ndarray]):
    from flax import jax_utils  # noqa: PLC0415

    self.jax_utils = jax_utils
    self.w = w
    n = jax.local_device_count()
    self.sharded = [jax.tree.map(lambda x: x.reshape((n, -1) + x.shape[1:]), b)
                    for b in wl.batch_list(data)]
    self.step = jax.pmap(wl.make_train_step(w, axis_name="batch"), axis_name="batch",
                         donate_argnums=(0,))
    self.calls_per_run = len(self.sharded)
    self.wait_every = wait_every()

  def _train(self, batches: Iterable, mark_at: int = -1, mark: Callable | None = None) -> Any:
    state = self.jax_utils.replicate(wl.init_state(self.w))
    batches = self.jax_utils.prefetch_to_device(iter(batches), 2)
    return per_step_loop(self.step, state, batches, self.wait_every, mark_at, mark)

  def warm(self) -> None:
    self._train(self.sharded[:2])

  def timed(self) -> float:
    t0 = time.perf_counter()
    self._train(self.sharded)
    return time.perf_counter() - t0

  def train_compiles(self) -> int | None:
    cache_size = getattr(self.step, "_cache_size", None)  # absent on pmap: see XLA counts
    return cache_size() if callable(cache_size) else None

  def run_calls(self, calls: int, mark_at: int, mark: Callable[[], None]) -> None:
    self._train(itertools.islice(itertools.cycle(self.sharded), calls), mark_at, mark)


class KerasFit(System):
  """Keras 3, JAX backend, ``fit(steps_per_execution=100)``; data-parallel on >1 device."""

  name = "Keras spe=100"

  def __init__(self, w: wl.Workload, data: dict[str, np.ndarray]):
    import keras  # noqa: PLC0415

    if keras.backend.backend() != "jax":
      raise RuntimeError("KERAS_BACKEND=jax must be set before keras is imported")
    if jax.device_count() > 1:
      keras.distribution.set_distribution(keras.distribution.DataParallel(
          devices=jax.devices()))
    self.w = w
    s, b = data["y"].shape
    self.x = data["x"].reshape((s * b,) + data["x"].shape[2:])
    self.y = data["y"].reshape(s * b)
    self.params = jax.device_get(wl.init_params(w))
    self.model = wl.make_keras_model(w, self.params)
    self.initial = [v.numpy() for v in self.model.trainable_variables]
    if jax.device_count() > 1:
      self._bound_in_flight(MAX_IN_FLIGHT_MULTI_DEVICE)
    self.calls_per_run = -(-s // 100)
    self.steps_per_call = 100

  def _bound_in_flight(self, every: int) -> None:
    """Makes Keras' jitted step wait for its result every ``every`` calls.

    Keras 3.15 dispatches the ``steps_per_execution`` steps of one execution without
    waiting; on several fake CPU devices 100 all-reducing programs in flight deadlock
    XLA:CPU (see :data:`MAX_IN_FLIGHT_MULTI_DEVICE`), so the jitted step that
    ``make_train_function`` builds is wrapped, like the per-step loops' waits here.
    """
    model = self.model
    make = model.make_train_function

    def make_bounded(force=False):
      make(force)
      for cell in model.train_function.__closure__ or ():
        step = cell.cell_contents
        if hasattr(step, "bounded"):  # train_function kept from an earlier fit
          return
        if hasattr(step, "_cache_size"):
          calls = itertools.count(1)

          def bounded(state, data, step=step, calls=calls):
            logs, state = step(state, data)
            if next(calls) % every == 0:
              jax.block_until_ready(state)
            return logs, state

          bounded.bounded = True
          bounded._cache_size = step._cache_size
          cell.cell_contents = bounded
          return
      raise RuntimeError("Keras' jitted train step not found in train_function's closure")

    model.make_train_function = make_bounded

  def warm(self) -> None:
    n = min(len(self.y), 150 * wl.BATCH)  # one execution of 100 steps and one of 50
    self._fit(self.x[:n], self.y[:n])

  def _fit(self, x, y, callbacks=()) -> None:
    for v, init in zip(self.model.trainable_variables, self.initial):
      v.assign(init)  # same starting point every run; the optimizer (plain SGD) has no slots
    self.model.fit(x, y, batch_size=wl.BATCH, epochs=1, shuffle=False, verbose=0,
                   callbacks=list(callbacks))
    jax.block_until_ready([v.value for v in self.model.trainable_variables])

  def timed(self) -> float:
    t0 = time.perf_counter()
    self._fit(self.x, self.y)
    return time.perf_counter() - t0

  def train_compiles(self) -> int | None:
    fn = getattr(self.model, "train_function", None)
    cells = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ())]
    for c in cells:  # iterator_step closes over the jitted train_step
      if hasattr(c, "_cache_size"):
        return c._cache_size()
    return None

  def run_calls(self, calls: int, mark_at: int, mark: Callable[[], None]) -> None:
    import keras  # noqa: PLC0415

    class Mark(keras.callbacks.Callback):
      def on_train_batch_end(self, batch, logs=None):  # once per execution of 100 steps
        if batch + 1 == mark_at * 100:
          mark()

      def on_train_end(self, logs=None):  # the second reading, before fit lets go of its data
        mark()

    def batches():  # cycled, so the source holds no new memory
      for i in itertools.count():
        j = i % (len(self.y) // wl.BATCH)
        yield (self.x[j * wl.BATCH:(j + 1) * wl.BATCH], self.y[j * wl.BATCH:(j + 1) * wl.BATCH])

    for v, init in zip(self.model.trainable_variables, self.initial):
      v.assign(init)
    self.model.fit(batches(), steps_per_epoch=calls * 100, epochs=1, verbose=0,
                   callbacks=[Mark()])


class HandwrittenScan(System):
  """The K-step loop a TPUEstimator user writes without loopkit (the issue's anchor).

  Per chunk: ``np.stack`` the next K numpy batches of the same list loopkit's default row
  reads (``[K, B, ...]``), one call of ``jit(lambda s, c: lax.scan(step, s, c))`` with the
  state donated and replicated and the chunk split on ``"data"`` (the numpy chunk goes
  straight into the call, which transfers it), then ``jax.device_get`` of the previous
  call's ``[K]`` metrics (one call late, as ``TrainLoop`` fetches them). Same step and the
  same CPU convolution relayout as loopkit's program. No thread, no accounting, no hooks: the
  difference to ``loopkit K=k`` on the same source is loopkit's own host work. A last chunk
  shorter than K (S not a multiple of K) is a second compiled program.
  """

  def __init__(self, w: wl.Workload, data: dict[str, np.ndarray], k: int):
    self.name = f"hand-written K-scan K={k}"
    self.k = self.steps_per_call = k
    self.w = w
    self.batches = wl.batch_list(data)
    mesh = data_mesh()
    self.replicated = NamedSharding(mesh, P())
    step = scan_step(w)
    self.fn = jax.jit(lambda state, chunk: jax.lax.scan(step, state, chunk),
                      donate_argnums=(0,),
                      in_shardings=(self.replicated, NamedSharding(mesh, P(None, "data"))),
                      out_shardings=(self.replicated, self.replicated))
    self.calls_per_run = -(-len(self.batches) // k)

  def _train(self, batches: Iterable, mark_at: int = -1, mark: Callable | None = None) -> Any:
    state = jax.device_put(wl.init_state(self.w), self.replicated)
    it, pending, calls = iter(batches), None, 0
    while group := list(itertools.islice(it, self.k)):
      chunk = jax.tree.map(lambda *xs: np.stack(xs), *group)
      state, metrics = self.fn(state, chunk)
      if pending is not None:
        jax.device_get(pending)
      pending, calls = metrics, calls + 1
      if calls == mark_at and mark is not None:
        mark()
    jax.device_get(pending)
    return jax.block_until_ready(state)

  def warm(self) -> None:
    self._train(self.batches[:self.k])  # one full chunk: the program every S here runs

  def timed(self) -> float:
    t0 = time.perf_counter()
    self._train(self.batches)
    return time.perf_counter() - t0

  def final_state(self) -> Any:
    """The state after one run over the whole list (for the equality check)."""
    return jax.device_get(self._train(self.batches))

  def train_compiles(self) -> int:
    return self.fn._cache_size()

  def run_calls(self, calls: int, mark_at: int, mark: Callable[[], None]) -> None:
    n = calls * self.k
    self._train(itertools.islice(itertools.cycle(self.batches), n), mark_at, mark)


class Limit(System):
  """One jitted ``lax.scan`` over all S steps, the data ``[S, B, ...]`` already on device."""

  name = "limit (one scan)"
  calls_per_run = 1

  def __init__(self, w: wl.Workload, data: dict[str, np.ndarray]):
    self.w = w
    mesh = data_mesh()
    self.replicated = NamedSharding(mesh, P())
    self.data = jax.block_until_ready(
        jax.device_put(data, NamedSharding(mesh, P(None, "data"))))
    step = scan_step(w)
    self.fn = jax.jit(lambda state, d: jax.lax.scan(step, state, d), donate_argnums=(0,))
    self.steps_per_call = data["y"].shape[0]

  def _state(self) -> Any:
    return jax.block_until_ready(jax.device_put(wl.init_state(self.w), self.replicated))

  def warm(self) -> None:
    # Compiled ahead of time, not run (a run is all S steps); timed runs reuse it.
    self.compiled = self.fn.lower(self._state(), self.data).compile()

  def timed(self) -> float:
    state = self._state()
    t0 = time.perf_counter()
    jax.block_until_ready(self.compiled(state, self.data))
    return time.perf_counter() - t0

  def train_compiles(self) -> int:
    return int(hasattr(self, "compiled")) + self.fn._cache_size()


# -- line-ups --------------------------------------------------------------------

def build(lineup: Iterable[runner.Entry], w: wl.Workload, data: dict[str, np.ndarray],
          leave_out: Iterable[str] = (), log: Callable[[str], None] = print,
          devices: int | None = None) -> list[System]:
  """The systems of ``lineup`` that run on workload ``w`` at ``devices``, in the line-up's
  order (which is the order of the timed rounds and of the report's rows).

  Args:
    lineup: the entries.
    w: the workload; ``data`` its ``[S, B, ...]`` arrays (:func:`benchmarks.workloads.make_data`).
    leave_out: class names not to build (e.g. ``"KerasFit"`` for ``--no-keras``).
    log: where an optional system's ``ImportError`` is reported.
    devices: the device count the entries are chosen for (default ``jax.device_count()``).

  Raises:
    ValueError: an entry names no :class:`System` class of this module.
  """
  devices, out = devices or jax.device_count(), []
  for e in lineup:
    if (e.cls in leave_out or devices < e.min_devices
        or (e.workloads is not None and w.name not in e.workloads)):
      continue
    cls = globals().get(e.cls)
    if not (isinstance(cls, type) and issubclass(cls, System)):
      raise ValueError(f"line-up entry {e!r}: {e.cls!r} is no system of benchmarks/systems.py")
    try:
      out.append(cls(w, data, **dict(e.kwargs)))
    except ImportError as err:
      if e.optional is None:
        raise
      log(f"skipping {e.optional}: {err}")
  return out
