"""Argument checks shared by the loop, the program, the feeder, the evaluator and the AOT report.

One function per check, called from everywhere that needs it, so that a bad value gets the same
error (naming the value, and the pytree leaf where there is one) from every entry point.
Pure host functions; thread-safe.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


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
                            process_count: int = 1) -> None:
  """Checks that the global batch B splits evenly over the data-parallel size and the processes.

  The one batch-divisibility check of loopkit: the loop, the feeder, the evaluator, device-resident
  data, the host sources (``data_parallel_size=1``) and the AOT report all call it.

  Args:
    global_batch_size: B, examples per step over all devices and processes.
    data_parallel_size: D, the size of the mesh's data axis.
    process_count: P, the processes feeding the batch (1: do not check).

  Raises:
    ValueError: B < 1, or B not divisible by D or by P (the message names both numbers).
  """
  if global_batch_size < 1:
    raise ValueError(f"global batch size must be >= 1, got {global_batch_size}")
  if global_batch_size % data_parallel_size:
    raise ValueError(
        f"global batch size {global_batch_size} is not divisible by the data-parallel "
        f"size {data_parallel_size}")
  if global_batch_size % process_count:
    raise ValueError(f"global batch size {global_batch_size} is not divisible by the process "
                     f"count {process_count}")


def check_data_axis(mesh: Any, data_axis: str) -> None:
  """Raises ValueError unless ``data_axis`` is an axis of ``mesh`` (names both)."""
  if data_axis not in mesh.axis_names:
    raise ValueError(f"data_axis {data_axis!r} is not an axis of the mesh {mesh.axis_names}")


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
  the message names the leaf path (``jax.tree_util.keystr``).
  """
  e_leaves, e_def = jax.tree_util.tree_flatten_with_path(expected)
  g_leaves, g_def = jax.tree_util.tree_flatten_with_path(got)
  if e_def != g_def:  # type: ignore[operator]  # PyTreeDef supports !=
    e_paths = [jax.tree_util.keystr(p) for p, _ in e_leaves]
    g_paths = [jax.tree_util.keystr(p) for p, _ in g_leaves]
    for a, b in zip(e_paths, g_paths):
      if a != b:
        return f"{what}: tree structure differs at leaf {a} (expected) vs {b} (got)"
    return (f"{what}: tree structure differs: expected {len(e_paths)} leaves, "
            f"got {len(g_paths)} ({e_def} vs {g_def})")
  for (path, e), (_, g) in zip(e_leaves, g_leaves):
    name = jax.tree_util.keystr(path) or "<root>"
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
