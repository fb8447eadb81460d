"""Argument checks shared by the loop, the program, the feeder, the evaluator and the AOT report.

One function per check, called from everywhere that needs it, so that a bad value gets the same
error (naming the value, and the pytree leaf where there is one) from every entry point.
Pure host functions; thread-safe.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np


def leaf_key(path: tuple) -> tuple[str, ...]:
  """A leaf's keys from its pytree path: dict keys, sequence indices and attribute names as
  strings; the flat key Orbax stores the leaf under (``ocp.tree.to_flat_dict``)."""
  out = []
  for k in path:
    for attr in ("key", "idx", "name"):
      if hasattr(k, attr):
        out.append(str(getattr(k, attr)))
        break
    else:
      out.append(str(k))
  return tuple(out)


def leaf_name(path: tuple) -> str:
  """A leaf's one name in every loopkit message: its keys joined by ``/``
  (``params/head/bias``; ``opt/0/mu/w`` for the first optimizer state's ``mu`` of ``w``),
  the syntax :func:`loopkit.checkpoint.warm_start` patterns are written in; ``<root>`` for
  a state that is one leaf."""
  return "/".join(leaf_key(path)) or "<root>"


def few_names(names: Sequence[str], shown: int = 8) -> str:
  """``"a, b, c"``: every name when there are at most ``shown + 1``, else the first ``shown``
  and ``... (N in all)`` (a list cut short by one name would say no more than the name)."""
  if len(names) <= shown + 1:
    return ", ".join(names)
  return ", ".join(names[:shown]) + f", ... ({len(names)} in all)"


def check_not_deleted(state: Any, what: str = "the train state") -> None:
  """Refuses a state with a deleted (donated) array, naming every such leaf, before it is
  placed: otherwise the first device call fails with JAX's bare "Array has been deleted".

  Raises:
    ValueError: naming the deleted leaves (:func:`leaf_name`) and why they are deleted.
  """
  deleted = [leaf_name(path) for path, x in jax.tree_util.tree_flatten_with_path(state)[0]
             if isinstance(x, jax.Array) and x.is_deleted()]
  if not deleted:
    return
  shown = few_names(deleted)
  raise ValueError(
      f"{what} has {len(deleted)} deleted array{'s' if len(deleted) > 1 else ''} ({shown}): "
      "a run donates the state it is given (its buffers become the state it returns), so a "
      "state given to an earlier run, or one that shares arrays with it (warm_start keeps "
      "the leaves it does not read, as state.replace(...) does), cannot run again. Run the "
      "state the earlier run returned, or a copy made before it (jax.tree.map(jnp.copy, "
      "state))")


def check_iterations_per_loop(k: Any) -> int:
  """Validates K, the steps (slots) per device call.

  Returns:
    ``k``.

  Raises:
    ValueError: ``k`` is not an int (bools are refused) or is < 1.
  """
  if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
    raise ValueError(f"iterations_per_loop must be an int >= 1, got {k!r}")
  if k < 1:
    raise ValueError(f"iterations_per_loop must be >= 1, got {k}")
  return int(k)


def check_step_style(style: Any) -> None:
  """Raises ValueError unless ``style`` is ``"global"`` or ``"per_device"``."""
  if style not in ("global", "per_device"):
    raise ValueError(f"step_style must be 'global' or 'per_device', got {style!r}")


def check_global_batch_size(global_batch_size: int, data_parallel_size: int, *,
                            process_count: int = 1, data_axes: str = "") -> None:
  """Checks that the global batch B splits evenly over the data-parallel size and the processes.

  The one batch-divisibility check of loopkit: the loop, the feeder, the evaluator, device-resident
  data, the host sources (``data_parallel_size=1``) and the AOT report all call it.

  Args:
    global_batch_size: B, examples per step over all devices and processes.
    data_parallel_size: D, the size of the mesh's data axis (the product of the sizes of the
      data axes, for several).
    process_count: P, the processes feeding the batch (1: do not check).
    data_axes: words naming the axes D is the product of (:func:`describe_data_axis`), added
      to the message; empty for one axis.

  Raises:
    ValueError: B < 1, or B not divisible by D or by P (the message names both numbers, and
      the axes with their sizes when D is a product).
  """
  if global_batch_size < 1:
    raise ValueError(f"global batch size must be >= 1, got {global_batch_size}")
  if global_batch_size % data_parallel_size:
    raise ValueError(
        f"global batch size {global_batch_size} is not divisible by the data-parallel "
        f"size {data_parallel_size}{data_axes}")
  if global_batch_size % process_count:
    raise ValueError(f"global batch size {global_batch_size} is not divisible by the process "
                     f"count {process_count}")


def check_data_axis(mesh: Any, data_axis: Any) -> str | tuple[str, ...]:
  """Checks ``data_axis`` against ``mesh``; returns it as ``PartitionSpec`` and collectives take it.

  Args:
    mesh: a ``Mesh`` or ``AbstractMesh``.
    data_axis: the mesh axis the batch is split over (a str), or several (a tuple or list of
      str, the major one first, as in ``PartitionSpec(("data", "fsdp"))``).

  Returns:
    The name for one axis (a 1-tuple too), else the tuple of names.

  Raises:
    TypeError: ``data_axis`` is neither a str nor a sequence of str (names it).
    ValueError: no axis named; a name that is not an axis of ``mesh`` (names the mesh's
      axes); a name given twice.
  """
  names = (data_axis,) if isinstance(data_axis, str) else data_axis
  if not isinstance(names, (tuple, list)) or not all(isinstance(a, str) for a in names):
    raise TypeError(f"data_axis must be a mesh axis name or a tuple of them, got {data_axis!r}")
  if not names:
    raise ValueError("data_axis names no mesh axis: give one (e.g. 'data') or a tuple "
                     "(e.g. ('data', 'fsdp'))")
  for a in names:
    if a not in mesh.axis_names:
      raise ValueError(f"data_axis {a!r} is not an axis of the mesh {tuple(mesh.axis_names)}"
                       + (f" (data_axis={tuple(names)!r})" if len(names) > 1 else ""))
  twice = sorted({a for a in names if names.count(a) > 1})
  if twice:
    raise ValueError(f"data_axis {tuple(names)!r} names the mesh axis {twice[0]!r} twice")
  return names[0] if len(names) == 1 else tuple(names)


def data_axes(data_axis: str | tuple[str, ...]) -> tuple[str, ...]:
  """The names of a checked data axis (:func:`check_data_axis`), as a tuple."""
  return (data_axis,) if isinstance(data_axis, str) else tuple(data_axis)


def leaf_dtype(x: Any) -> Any:
  """A leaf's dtype: ``np.dtype``, or JAX's extended dtype (a typed PRNG key's ``key<fry>``)."""
  dtype = getattr(x, "dtype", None)
  if dtype is None:
    return np.asarray(x).dtype
  try:
    return np.dtype(dtype)
  except TypeError:  # an extended dtype, e.g. a new-style PRNG key's key<fry>
    return dtype


def tree_mismatch(expected: Any, got: Any, *, what: str,
                  check_sharding: bool = False) -> str | None:
  """Describes the first leaf where two pytrees differ, or None if they agree.

  Compares tree structure, then per leaf shape, dtype and (optionally) sharding;
  the message names the leaf by its one name (:func:`leaf_name`, ``params/w``).
  """
  e_leaves, e_def = jax.tree_util.tree_flatten_with_path(expected)
  g_leaves, g_def = jax.tree_util.tree_flatten_with_path(got)
  if e_def != g_def:  # type: ignore[operator]  # PyTreeDef supports !=
    e_paths = [leaf_name(p) for p, _ in e_leaves]
    g_paths = [leaf_name(p) for p, _ in g_leaves]
    for a, b in zip(e_paths, g_paths):
      if a != b:
        return f"{what}: tree structure differs at leaf {a} (expected) vs {b} (got)"
    return (f"{what}: tree structure differs: expected {len(e_paths)} leaves, "
            f"got {len(g_paths)} ({e_def} vs {g_def})")
  for (path, e), (_, g) in zip(e_leaves, g_leaves):
    name = leaf_name(path)
    e_shape, g_shape = np.shape(e), np.shape(g)
    if e_shape != g_shape:
      return f"{what}: leaf {name} has shape {g_shape}, expected {e_shape}"
    e_dtype, g_dtype = leaf_dtype(e), leaf_dtype(g)
    if e_dtype != g_dtype:
      return f"{what}: leaf {name} has dtype {g_dtype}, expected {e_dtype}"
    if check_sharding:
      e_sh, g_sh = getattr(e, "sharding", None), getattr(g, "sharding", None)
      if e_sh is not None and g_sh is not None and not e_sh.is_equivalent_to(g_sh, len(e_shape)):
        return f"{what}: leaf {name} has sharding {g_sh}, expected {e_sh}"
  return None


def device_axis_leaf(x: Any) -> bool:
  """A ``jax.Array`` whose leading axis is a device axis: one row per device.

  What ``flax.jax_utils.prefetch_to_device`` (and ``jax.device_put_sharded``)
  make of a pmap-layout batch ``[devices, B / devices, ...]``, and
  ``flax.jax_utils.replicate`` of a state leaf (``[devices, ...]``).
  """
  sharding = getattr(x, "sharding", None)
  if not isinstance(x, jax.Array) or sharding is None or x.ndim < 1:
    return False
  devices = len(sharding.device_set)
  return devices > 1 and x.shape[0] == devices and sharding.shard_shape(x.shape)[0] == 1


_DEVICE_AXIS_FIX = (
    "Pass numpy batches [B, ...] (drop prefetch_to_device and the reshape to "
    "[devices, B / devices, ...]): loopkit places them on the devices itself and prefetches "
    "(TrainLoop(prefetch=...))")


def check_device_axis_layout(batch: Any, global_batch_size: int | None = None, *,
                             process_count: int = 1) -> None:
  """Refuses a batch already placed for ``jax.pmap``: a leading device axis, one slice per device.

  ``flax.jax_utils.prefetch_to_device`` (Flax's ImageNet ``create_input_iter``) turns
  batches reshaped to ``[devices, B / devices, ...]`` into ``jax.Array`` whose
  leading axis has one row per device; the loop would take each device's slice as
  one example. Unlike a numpy array of that shape (:func:`warn_if_pmap_layout`),
  the array itself says so: its leading axis is its device count and each device
  holds one slice of it.

  Args:
    batch: one batch, a pytree of arrays (the process-local part).
    global_batch_size: B as the loop or evaluator was told it, or None. A leaf
      whose leading axis is ``B / P`` is a global batch that happens to have one
      example per device, and is taken.
    process_count: P.

  Raises:
    ValueError: naming the first such leaf (path, shape, devices), saying how it
      was made and what to pass instead (the batches before the reshape, or
      ``global_batch_size=`` when each row is one example).
  """
  local = None if global_batch_size is None else global_batch_size // process_count
  for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
    if device_axis_leaf(x) and np.shape(x)[0] != local:
      name, shape = leaf_name(path), np.shape(x)
      raise ValueError(
          f"batch leaf {name} is a jax.Array of shape {shape} already on the devices with a "
          f"leading device axis: its {shape[0]} rows lie one per device, the layout that "
          "flax.jax_utils.prefetch_to_device (or jax.device_put_sharded) makes for jax.pmap "
          f"from batches reshaped to [devices, B / devices, ...]; loopkit would take each "
          f"device's slice [{', '.join(map(str, shape[1:]))}] as one example. "
          f"{_DEVICE_AXIS_FIX}; if each row really is one example of a global batch of "
          f"{shape[0] * process_count}, pass global_batch_size={shape[0] * process_count}")


def check_batch_layout(batch: Any, global_batch_size: int, *, process_count: int = 1) -> None:
  """Checks a batch against the loop's ``global_batch_size``.

  Given ``global_batch_size=B``, every leaf of a batch must be ``[B / P, ...]``
  (P processes, each feeding its part). A batch in ``jax.pmap``'s layout
  ``[devices, B / devices, ...]``, or already placed on the devices by
  ``flax.jax_utils.prefetch_to_device``, would otherwise train on a wrong
  leading axis, silently. (Without ``global_batch_size`` the feeder refuses the
  placed layout with :func:`check_device_axis_layout` and warns about the numpy
  one with :func:`warn_if_pmap_layout`.)

  Args:
    batch: one batch, a pytree of arrays (the process-local part).
    global_batch_size: B, as given to the loop.
    process_count: P.

  Raises:
    ValueError: naming every leaf (path and shape) whose leading axis is not
      ``B / P``; for pmap layout saying how to reshape, and for device arrays
      with a leading device axis naming ``prefetch_to_device``.
  """
  local = global_batch_size // process_count
  wrong = [(leaf_name(path), x)
           for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]
           if np.ndim(x) == 0 or np.shape(x)[0] != local]
  if not wrong:
    return
  shown = ", ".join(f"{name} has shape {np.shape(x)}" for name, x in wrong[:5])
  more = f" (and {len(wrong) - 5} more leaves)" if len(wrong) > 5 else ""
  per = f"{local} per process, " if process_count > 1 else ""
  msg = (f"batch leaf {shown}{more}, but the loop's global_batch_size={global_batch_size} "
         f"needs a leading batch axis of {per}[{local}, ...]")
  if any(device_axis_leaf(x) for _, x in wrong):
    raise ValueError(
        f"{msg}: the batch is already on the devices with a leading device axis, as "
        "flax.jax_utils.prefetch_to_device (or jax.device_put_sharded) makes it for jax.pmap. "
        f"{_DEVICE_AXIS_FIX}")
  _, x = wrong[0]
  shape = np.shape(x)
  if len(shape) >= 2 and shape[0] * shape[1] == local:
    raise ValueError(
        f"{msg}: this is jax.pmap's layout [devices, B / devices, ...]; loopkit takes global "
        "batches [B, ...] and splits B over the devices itself, for step_style='per_device' "
        "too: pass x.reshape((-1,) + x.shape[2:]) for every leaf")
  raise ValueError(msg)


def partial_batch_hint(first: Any, batch: Any) -> str:
  """A hint for a batch that differs from the first one only by fewer rows.

  A dataset batched without dropping its remainder ends with a partial batch
  (``N % B`` rows); training needs every step's batch at ``[B, ...]``.

  Args:
    first: the first batch (or its ``jax.ShapeDtypeStruct`` pytree).
    batch: the batch that differs.

  Returns:
    The hint (starting ``"; "``), or ``""`` when ``batch`` is not such a batch.
  """
  try:
    pairs = [(np.shape(a), np.shape(b)) for a, b in
             zip(jax.tree.leaves(first),
                 jax.tree.structure(first).flatten_up_to(batch))]  # type: ignore[attr-defined]
  except (ValueError, TypeError):
    return ""
  rows = {b[0] if b else None for _, b in pairs}
  if (len(rows) != 1 or not all(a and b and a[1:] == b[1:] and b[0] < a[0] for a, b in pairs)):
    return ""
  return (f"; a batch of {rows.pop()} rows after full ones is a dataset's partial last batch: "
          "drop it (tf.data's .batch(B, drop_remainder=True), drop_remainder=True in Grain's "
          "Batch, drop_last=True in a torch DataLoader). Training needs every batch at "
          "[B, ...]; loopkit.Evaluator pads partial batches")


class BatchLayoutWarning(UserWarning):
  """Batches look like ``jax.pmap`` input ``[devices, B / devices, ...]``."""


def warn_if_pmap_layout(batches: Any, data_parallel_size: int) -> bool:
  """Warns when a chunk's batches look like pmap-layout input.

  loopkit takes *global* batches ``[B, ...]`` and splits B over the data axis
  itself, for both step styles. A user coming from ``jax.pmap`` may pass
  ``[D, B / D, ...]`` (D = devices): each device then trains on a
  ``[1, B / D, ...]`` slice with a wrong leading axis, silently. The sign: the
  batch axis equals the data-parallel size, and every leaf (two or more; with a
  single leaf ``[D, b]`` is as likely D examples of b features) has a second
  axis of one common size, labels included (a global batch's labels are
  ``[B]``).

  Args:
    batches: a chunk's pytree of ``[K, B, ...]`` arrays (global shapes).
    data_parallel_size: D.

  Returns:
    Whether it warned.
  """
  shapes = [np.shape(x) for x in jax.tree.leaves(batches)]
  if data_parallel_size < 2 or len(shapes) < 2 or any(len(s) < 3 for s in shapes):
    return False
  if any(s[1] != data_parallel_size for s in shapes) or len({s[2] for s in shapes}) != 1:
    return False
  shown = ", ".join(str(s[1:]) for s in shapes[:3])
  warnings.warn(
      f"every batch leaf has shape [{data_parallel_size}, {shapes[0][2]}, ...] ({shown}"
      f"{' ...' if len(shapes) > 3 else ''}), with the batch axis equal to the "
      f"data-parallel size {data_parallel_size}: this looks like jax.pmap input "
      f"[devices, B / devices, ...]. loopkit takes global batches [B, ...] and splits B "
      f"over the devices itself, for step_style='per_device' too; pass "
      f"x.reshape((-1,) + x.shape[2:]) for every leaf, and numpy batches rather than the "
      f"output of flax.jax_utils.prefetch_to_device (if a global batch of "
      f"{data_parallel_size} examples is meant, pass global_batch_size="
      f"{data_parallel_size} to the loop, or ignore this warning)",
      BatchLayoutWarning, stacklevel=3)
  return True


# The fewest chunk slots the multi-step loop body is compiled for (see loopkit.core.slot_loop).
MIN_SLOTS = 2


_NNX_LOOP = ("loopkit.nnx.NnxTrainLoop(train_step, model, optimizer, metrics, "
             "iterations_per_loop=...)")


def default_step_of(state: Any) -> jax.Array:
  """The step counter of a state: ``state.step`` or ``state["step"]``.

  Raises:
    ValueError: neither exists; for a Flax NNX state (``nnx.state(...)``) the message
      names ``step_of`` for the optimizer's step and :class:`loopkit.nnx.NnxTrainLoop`.
  """
  if hasattr(state, "step"):
    return state.step
  if isinstance(state, dict) and "step" in state:
    return state["step"]
  hint = ""
  if type(state).__module__.startswith("flax.nnx"):
    hint = (f"; this is a Flax NNX {type(state).__name__}: its counter is the nnx.Optimizer's "
            "step (e.g. step_of=lambda s: s['optimizer']['step']), or train the NNX objects "
            f"with their in-place step as they are: {_NNX_LOOP}")
  raise ValueError(
      "the train state has no step counter: give it a scalar int `step` field "
      "(attribute or dict key) or pass step_of=... to TrainLoop" + hint)


def abstract_leaves(state: Any) -> list[tuple[str, jax.ShapeDtypeStruct]]:
  """The abstract leaves of a state: ``(path, leaf)`` of each ``jax.ShapeDtypeStruct``.

  An abstract state (``jax.eval_shape(init)``, with shardings or ``state_shardings=``) stands
  for a state a checkpoint fills: it has shapes, dtypes and shardings but no values
  (:meth:`loopkit.core.program.MultiStepProgram.place_state` keeps it abstract).

  Returns:
    ``[(leaf name, leaf), ...]`` in leaf order (:func:`leaf_name`: ``opt/0/count``); empty for
    a concrete state.
  """
  return [(leaf_name(p), x) for p, x in jax.tree_util.tree_flatten_with_path(state)[0]
          if isinstance(x, jax.ShapeDtypeStruct)]


def describe_abstract(leaves: list[tuple[str, Any]], shown: int = 3) -> str:
  """``"leaf w (float32[8, 4])"``, or the leaves (:func:`few_names`: the first ``shown`` and
  how many in all)."""
  def one(name: str, x: Any) -> str:
    return f"{name} ({x.dtype}[{', '.join(str(d) for d in x.shape)}])"
  names = [one(n, x) for n, x in leaves]
  return f"leaf {names[0]}" if len(names) == 1 else f"leaves {few_names(names, shown)}"


def check_concrete(state: Any, what: str) -> None:
  """Refuses a state with abstract (``jax.ShapeDtypeStruct``) leaves where values are needed.

  Args:
    state: the state pytree.
    what: the start of the message: who gave the state and why it needs values.

  Raises:
    ValueError: ``what``, then the abstract leaves (name, dtype and shape; the first three
      and how many in all), and what gives an abstract state its values.
  """
  leaves = abstract_leaves(state)
  if leaves:
    raise ValueError(
        f"{what}: its {describe_abstract(leaves)} {'is' if len(leaves) == 1 else 'are'} "
        "abstract (jax.ShapeDtypeStruct). An abstract state (jax.eval_shape(init), with "
        "shardings or state_shardings=) needs a checkpoint that restores every leaf: a "
        "CheckpointHook whose directory holds a checkpoint (restore=True), or an init_from="
        "WarmStart that reads every leaf (select=None); to start without one, pass the "
        "initialised state")


def check_not_nnx_objects(state: Any) -> None:
  """Refuses a train state that holds Flax NNX graph objects (``nnx.Module``,
  ``nnx.Optimizer``, ``nnx.MultiMetric``, ``nnx.Rngs``), before it is placed or donated.

  ``TrainLoop`` runs a pure step on a pytree of arrays; an NNX module is a pytree too,
  so it would be donated (the user's model then holds deleted arrays) and the step would
  get a copy, not the user's objects. Looks only when ``flax.nnx`` is imported (a state
  cannot hold its objects otherwise); a pure ``nnx.State`` passes.

  Raises:
    TypeError: naming the object's type and pytree path, and
      :class:`loopkit.nnx.NnxTrainLoop`.
  """
  nnx = sys.modules.get("flax.nnx")
  if nnx is None:
    return
  kinds = tuple(k for k in (getattr(nnx, "Pytree", None), getattr(nnx, "Object", None))
                if isinstance(k, type))
  if not kinds:
    return
  leaves = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: isinstance(x, kinds))[0]
  for path, leaf in leaves:
    if isinstance(leaf, kinds):
      where = f" at {leaf_name(path)}" if path else ""
      raise TypeError(
          f"the train state is (or holds) a Flax NNX object, {type(leaf).__name__}{where}: "
          "TrainLoop runs a pure train_step(state, batch) -> (state, metrics) on a pytree of "
          "arrays (and donates it). For NNX objects and Flax's in-place step "
          f"train_step(model, optimizer, [metrics,] batch, ...), use {_NNX_LOOP}, which "
          "updates the objects after run; or pass TrainLoop the pure state of nnx.split "
          "with a functional step and step_of=...")


def process_of(process_index: int | None, process_count: int | None) -> tuple[int, int]:
  """``(process_index, process_count)``, each defaulting to this JAX process's.

  Raises:
    ValueError: the index is not in ``[0, process_count)``, naming both.
  """
  index = jax.process_index() if process_index is None else int(process_index)
  count = jax.process_count() if process_count is None else int(process_count)
  if count < 1 or not 0 <= index < count:
    raise ValueError(f"process_index {index} is not in [0, process_count={count})")
  return index, count


def process_rows(global_batch_size: int, process_index: int | None = None,
                 process_count: int | None = None) -> tuple[int, int]:
  """The rows of every global batch that a process feeds: loopkit's one global order.

  Process ``p`` of ``P`` feeds rows ``[p * B / P, (p + 1) * B / P)`` of each global batch
  ``[B, ...]``: the sources read them (``ArraySource``, ``GrainSource``, ``DeviceDataset``) and
  the feeder places them there (:func:`loopkit._internal.mesh.check_batch_on_mesh` checks that
  the mesh gives each process's devices those rows), so row ``r`` of a global batch is the same
  example on the same device position for any process count.

  Args:
    global_batch_size: B, divisible by P.
    process_index, process_count: default to JAX's.

  Returns:
    ``(start, stop)``.

  Raises:
    ValueError: B not divisible by P; the index not in ``[0, P)``.
  """
  index, count = process_of(process_index, process_count)
  check_global_batch_size(global_batch_size, 1, process_count=count)
  local = global_batch_size // count
  return index * local, (index + 1) * local
