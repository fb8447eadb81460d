"""This process's shards of a state as one row of uint32 words, for the local checkpoint tier.

The local tier (:mod:`loopkit.checkpoint.local_tier`) saves, per process, the bytes of the shards
that process holds, each distinct index once (:func:`_pack`; :func:`_unpack` puts them back
into a live state's structure, shardings and dtypes), as this process's row of a global
``[P, n]`` uint32 array that Orbax writes (:func:`_as_row`): every process's row length comes
from the global shardings alone (:func:`_word_counts`). A copy is read back only where its
fingerprint (the leaves and this process's layout of indices: :func:`_fingerprint`) matches.
Pure host functions over ``jax.Array`` leaves; not thread-safe.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

import jax
import numpy as np

from loopkit._internal.extras import missing

try:
  import orbax.checkpoint as ocp
except ImportError as e:
  raise missing(e, "loopkit.checkpoint") from e

from loopkit.checkpoint.items import _is_key, _leaf_record


def _row_sharding() -> jax.sharding.NamedSharding:
  """One row per process, on its first device: ``[P, n]`` over the axis ``p``."""
  first: dict[int, Any] = {}
  for d in jax.devices():
    first.setdefault(d.process_index, d)
  mesh = jax.sharding.Mesh(np.array([first[p] for p in sorted(first)]), ("p",))
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("p"))


def _word_counts(state: Any) -> list[int]:
  """Every process's number of words in :func:`_pack` (from the global shardings alone)."""
  nbytes = [0] * jax.process_count()
  for x in jax.tree.leaves(state):
    p = _physical(x)
    itemsize = np.dtype(p.dtype).itemsize
    held: dict[int, set] = {}
    for d, idx in p.sharding.devices_indices_map(p.shape).items():
      held.setdefault(d.process_index, set()).add(  # type: ignore[attr-defined]
          tuple((s.start or 0, dim if s.stop is None else s.stop)
                for s, dim in zip(idx, p.shape, strict=True)))
    for proc, indices in held.items():
      nbytes[proc] += sum(math.prod(b - a for a, b in i) * itemsize for i in indices)
  return [max(1, math.ceil(n / 4)) for n in nbytes]


def _as_row(words: np.ndarray) -> jax.Array:
  """``words`` (``[n]``, n the same on every process) as this process's row of a global
  ``[P, n]`` uint32 array.

  Orbax saves global arrays only (on several processes a process-local one is refused); with
  no primary host and no replica choice each process writes its own row into its directory.
  """
  sharding = _row_sharding()
  device = next(d for d in sharding.mesh.devices.flat if d.process_index == jax.process_index())
  return jax.make_array_from_single_device_arrays(
      (jax.process_count(), words.size), sharding, [jax.device_put(words[None], device)])


def _words_restore() -> Any:
  """Orbax's restore args for the words: this process's row (see :func:`_as_row`)."""
  return ocp.args.PyTreeRestore(
      restore_args={"w": ocp.ArrayRestoreArgs(sharding=_row_sharding())})


def _check_leaves(state: Any) -> None:
  for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
    if not isinstance(x, jax.Array):
      raise TypeError(f"the local checkpoint tier saves jax.Array leaves; leaf "
                      f"{jax.tree_util.keystr(path) or '<root>'} is a {type(x).__name__}")


def _physical(x: jax.Array) -> jax.Array:
  return jax.random.key_data(x) if _is_key(x) else x


def _indices(x: jax.Array) -> list[list[list[int]]]:
  """The distinct indices of this process's shards of ``x``, sorted: ``[[start, stop], ...]``
  per dimension."""
  seen = set()
  for idx in x.sharding.addressable_devices_indices_map(x.shape).values():
    seen.add(tuple((s.start or 0, dim if s.stop is None else s.stop)
                   for s, dim in zip(idx, x.shape, strict=True)))  # type: ignore[arg-type]
  return [[list(d) for d in i] for i in sorted(seen)]


def _layout(state: Any) -> list[list[list[list[int]]]]:
  return [_indices(_physical(x)) for x in jax.tree.leaves(state)]


def _fingerprint(state: Any, layout: Any) -> str:
  """What a copy must match to be read into ``state`` here: the leaves and this layout."""
  text = json.dumps([_leaf_record(state), layout], sort_keys=True)
  return hashlib.sha256(text.encode()).hexdigest()


def _pack(state: Any, length: int | None = None) -> tuple[np.ndarray, list]:
  """This process's shards, each distinct index once, in leaf and index order, as uint32 words
  (zero-padded to ``length`` words, default the fewest that hold them, at least 1), copied
  once; and their layout (:func:`_layout`)."""
  shards, layout = [], []
  for x in jax.tree.leaves(state):
    p = _physical(x)
    by_index: dict[tuple, Any] = {}
    for shard in p.addressable_shards:
      key = tuple((s.start or 0, dim if s.stop is None else s.stop)
                  for s, dim in zip(shard.index, p.shape, strict=True))
      by_index.setdefault(key, shard)
    idx = sorted(by_index)
    layout.append([[list(d) for d in i] for i in idx])
    shards += [np.asarray(by_index[i].data) for i in idx]
  nbytes = sum(a.nbytes for a in shards)
  words = np.zeros(max(1, math.ceil(nbytes / 4), length or 0), np.uint32)
  raw, offset = words.view(np.uint8), 0
  for a in shards:
    raw[offset:offset + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    offset += a.nbytes
  return words, layout


def _unpack(words: np.ndarray, like: Any) -> Any:
  """The state from ``_pack``'s words, in ``like``'s structure, shardings and dtypes."""
  raw = np.ascontiguousarray(words).view(np.uint8)
  offset = 0
  leaves, treedef = jax.tree.flatten(like)
  out = []
  for x in leaves:
    p = _physical(x)
    dtype = np.dtype(p.dtype)
    at = {}
    for i in map(tuple, map(lambda d: tuple(map(tuple, d)), _indices(p))):
      shape = tuple(b - a for a, b in i)
      n = math.prod(shape) * dtype.itemsize
      at[i] = raw[offset:offset + n].view(dtype).reshape(shape)
      offset += n
    index_map = p.sharding.addressable_devices_indices_map(p.shape)
    arrays = []
    for d, idx in index_map.items():
      key = tuple((s.start or 0, dim if s.stop is None else s.stop)
                  for s, dim in zip(idx, p.shape, strict=True))  # type: ignore[arg-type]
      arrays.append(jax.device_put(np.array(at[key]), d))
    y = jax.make_array_from_single_device_arrays(p.shape, p.sharding, arrays)
    if _is_key(x):
      y = jax.random.wrap_key_data(y, impl=jax.random.key_impl(x))  # type: ignore[assignment]
    out.append(y)
  return jax.tree.unflatten(treedef, out)
