"""The feeder's checks of every batch against the first one: structure, shapes, dtypes, the
batch layout on the mesh; fast paths per batch, per chunk (one flatten of the chunk's
batches) and per stacked chunk (``chunk_at``).

:class:`FirstBatchChecks` is a base of :class:`loopkit.data.feeding.ChunkFeeder`: its methods
read the feeder's batch sharding and expected batch, and set the first batch's spec.
"""

from __future__ import annotations

import operator
from typing import Any

import jax
import numpy as np

from loopkit._internal.checks import (
  check_batch_layout,
  check_device_axis_layout,
  leaf_name,
  partial_batch_hint,
  tree_mismatch,
)
from loopkit._internal.mesh import check_batch_on_mesh

__all__ = ["FirstBatchChecks"]


_SHAPE_DTYPE = operator.attrgetter("shape", "dtype")


class FirstBatchChecks:
  """Checks a feeder's batches against its first batch (a base of
  :class:`~loopkit.data.feeding.ChunkFeeder`, which sets ``_spec`` to None,
  ``_expected_batch``, ``_batch_sharding`` and ``_list_defs`` before the first check)."""

  _spec: Any  # the first batch's leaves as jax.ShapeDtypeStruct (None before it)
  _spec_def: Any  # its structure (a PyTreeDef)
  _leaf_specs: list[tuple[tuple[int, ...], Any]]
  _expected_batch: int | None  # B as the loop was told it (None: the first batch's)
  _batch_sharding: Any  # jax.sharding.NamedSharding of one batch
  _list_defs: dict[int, Any]  # n -> structure of n first batches
  global_batch_size: int

  def _check(self, batch: Any, step: int) -> list:
    """Checks a batch against the first one; returns its leaves (flattened once)."""
    if self._spec is None:
      leaves = jax.tree.leaves(batch)
      if not leaves:
        raise ValueError("a batch must have at least one array leaf")
      if self._expected_batch is not None:
        check_batch_layout(batch, self._expected_batch, process_count=jax.process_count())
      else:  # a leading device axis (prefetch_to_device) is plain from the arrays themselves
        check_device_axis_layout(batch, process_count=jax.process_count())
      b_local = np.shape(leaves[0])[0] if np.ndim(leaves[0]) else None
      for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        if np.ndim(x) == 0 or np.shape(x)[0] != b_local:
          raise ValueError(
              f"batch leaf {leaf_name(path)} has shape {np.shape(x)}; every "
              f"leaf needs the same leading batch dimension ({b_local})")
      b_global = b_local * jax.process_count()
      check_batch_on_mesh(b_global, self._batch_sharding)
      self._spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype),
                                batch)
      spec_leaves, self._spec_def = jax.tree.flatten(self._spec)
      self._leaf_specs = [(s.shape, s.dtype) for s in spec_leaves]
      self.global_batch_size = b_global
      return jax.tree.leaves(batch)
    # Fast path (per batch, on the prefetch thread): one flatten along the first
    # batch's structure (raises on any other node type or key set; a subtree where
    # the first batch had a leaf has no array shape) and a shape and dtype compare
    # per leaf; tree_mismatch only to word the error.
    try:
      leaves = self._spec_def.flatten_up_to(batch)
    except (ValueError, TypeError):
      pass
    else:
      try:  # numpy's dtypes of built-in types are singletons: `is` first, then ==
        for x, (shape, dtype) in zip(leaves, self._leaf_specs):
          if x.shape != shape or (x.dtype is not dtype and x.dtype != dtype):
            break
        else:
          return leaves
      except AttributeError:  # a leaf that is not an array
        pass
    problem = tree_mismatch(self._spec, jax.tree.map(np.asarray, batch),
                            what=f"batch for step {step + 1} differs from the first batch")
    if problem:
      raise ValueError(problem + partial_batch_hint(self._spec, batch))
    return jax.tree.leaves(batch)

  def _check_chunk(self, got: list, step: int) -> list[list]:
    """Checks a chunk's batches against the first batch; returns each leaf's arrays.

    The fast path checks the whole chunk at once: one flatten of the list of
    batches (in C++), compared with the structure of a list of that many first
    batches (a ``None``, a missing or extra key, another node type all change
    it), and one set of ``(shape, dtype)`` per leaf. Anything else goes batch by
    batch through :meth:`_check`, which raises for the first batch that differs,
    naming its step and leaf, as when each batch was checked as it came.

    Args:
      got: the chunk's batches, in order (at least one).
      step: the global step before the first of them.

    Returns:
      Per leaf (in the first batch's flattening order), the ``n`` batches' arrays.
    """
    if self._spec is None:
      self._check(got[0], step)
    n = len(got)
    treedef = self._list_defs.get(n)
    if treedef is None:
      treedef = self._list_defs[n] = jax.tree.structure([self._spec] * n)
    leaves, got_def = jax.tree.flatten(got)
    if got_def == treedef:
      width = len(self._leaf_specs)
      cols = [leaves[j::width] for j in range(width)]
      try:  # map(attrgetter) reads the attributes without a bytecode loop (half the cost)
        if all(set(map(_SHAPE_DTYPE, col)) == {spec} for col, spec in zip(cols, self._leaf_specs)):
          return cols
      except AttributeError:  # a leaf that is not an array
        pass
    return [list(col) for col in zip(*[self._check(b, step + i) for i, b in enumerate(got)])]

  def _check_stacked(self, stacked: Any, count: int, step: int) -> list[np.ndarray]:
    """Checks ``count`` stacked batches (leaves ``[count, B, ...]``) against the first batch.

    Returns:
      The leaves, in the first batch's flattening order.

    Raises:
      ValueError: naming the first batch of the chunk and the leaf that differs.
    """
    if self._spec is None:
      self._check(jax.tree.map(lambda x: x[0], stacked), step)
    try:
      leaves = self._spec_def.flatten_up_to(stacked)
      if all(isinstance(x, np.ndarray) and x.shape == (count,) + shape and x.dtype == dtype
             for x, (shape, dtype) in zip(leaves, self._leaf_specs)):
        return leaves
    except (ValueError, TypeError):
      pass
    first = jax.tree.map(lambda x: np.asarray(x)[0], stacked)
    problem = tree_mismatch(self._spec, first, what=(
        f"chunk_at({step}, {count}) returned batches that differ from the first batch"))
    raise ValueError(problem or f"chunk_at({step}, {count}) must return leaves [{count}, B, ...] "
                     "with the first batch's shapes and dtypes")
