"""What a checkpoint holds besides the arrays: the leaf record and the data positions.

Used by :mod:`loopkit.checkpoint`: a JSON record of every state leaf's logical
shape and dtype (read by the mismatch check, before anything is restored), the
re-making of zero-size leaves, and the per-process data positions as JSON.
"""

from __future__ import annotations

import base64
import json
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from loopkit._internal.checks import leaf_key, leaf_name
from loopkit._internal.extras import missing

try:
  import orbax.checkpoint as ocp
except ImportError as e:
  raise missing(e, "loopkit.checkpoint") from e


# -- leaves ----------------------------------------------------------------------
#
# Orbax (>= 0.11) saves typed PRNG keys natively, as their uint32 key data plus
# the impl's name, and wraps them back on restore; its metadata then shows the
# key data's shape and dtype. It refuses zero-size arrays. loopkit therefore
# saves zero-size leaves as None (the live state gives their shape and dtype
# back) and writes its own JSON record of every leaf's logical shape and dtype
# (item "leaves"), which the mismatch check reads.


def _is_key(x: Any) -> bool:
  return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _is_empty(x: Any) -> bool:
  return math.prod(x.shape) == 0


def _storable(state: Any) -> Any:
  return jax.tree.map(lambda x: None if _is_empty(x) else x, state)


def _dtype_name(x: Any) -> str:
  return str(x.dtype) if _is_key(x) else str(np.dtype(x.dtype))


def _leaf_record(state: Any) -> dict[str, Any]:
  """``{"leaves": [{"path", "key", "shape", "dtype"[, "impl"]}, ...]}`` of a state."""
  leaves = []
  for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
    entry = {"path": jax.tree_util.keystr(path) or "<root>", "key": list(_orbax_key(path)),
             "shape": list(x.shape), "dtype": _dtype_name(x)}
    if _is_key(x) and isinstance(x, jax.Array):
      entry["impl"] = str(jax.random.key_impl(x))
    leaves.append(entry)
  return {"leaves": leaves}


def _leaves_from_record(record: dict[str, Any]) -> dict[tuple[str, ...], dict[str, Any]]:
  return {tuple(e["key"]): {"shape": tuple(e["shape"]), "dtype": e["dtype"],
                            "impl": e.get("impl")} for e in record["leaves"]}


def _leaves_from_orbax(tree: Any) -> dict[tuple[str, ...], dict[str, Any]]:
  """The same from Orbax's metadata (checkpoints without the record): key data for keys."""
  return {key: {"shape": tuple(getattr(m, "shape", ()) or ()),
                "dtype": str(np.dtype(m.dtype)) if getattr(m, "dtype", None) is not None
                else None, "impl": None, "physical": True}
          for key, m in ocp.tree.to_flat_dict(tree).items() if m is not None}


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))


_orbax_key = leaf_key  # the flat key Orbax stores a leaf under


def _described(dtype: str | None, impl: str | None) -> str:
  return f"{dtype} (impl {impl})" if impl else str(dtype)


def _tree_differences(saved: dict[tuple[str, ...], dict[str, Any]], like: Any
                      ) -> list[tuple[tuple[str, ...], bool, str]]:
  """Every difference between the saved leaves and a live state: ``(the leaf's keys, whether
  the train state has it, what differs)``, each leaf named by its one name
  (:func:`~loopkit._internal.checks.leaf_name`, ``params/head/bias``); empty when they agree."""
  out = []
  seen = set()
  for path, x in jax.tree_util.tree_flatten_with_path(like)[0]:
    key = _orbax_key(path)
    name = leaf_name(path)
    if key not in saved:
      out.append((key, True, f"leaf {name} of the train state is not in the checkpoint"))
      continue
    seen.add(key)
    m = saved[key]
    shape, dtype = tuple(x.shape), _dtype_name(x)
    impl = str(jax.random.key_impl(x)) if _is_key(x) and isinstance(x, jax.Array) else None
    if m.get("physical") and _is_key(x):  # Orbax's metadata shows a key's data
      data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
      shape, dtype = tuple(data.shape), str(data.dtype)
    if m["shape"] != shape:
      out.append((key, True, f"leaf {name} has shape {m['shape']} in the checkpoint, {shape} "
                             "in the train state"))
    elif m["dtype"] is not None and m["dtype"] != dtype:
      out.append((key, True, f"leaf {name} has dtype {_described(m['dtype'], m.get('impl'))} "
                             f"in the checkpoint, {_described(dtype, impl)} in the train state"))
  out += [(key, False, f"the checkpoint has leaf {'/'.join(key) or '<root>'} that the train "
                       "state lacks") for key in saved if key not in seen]
  return out


def _empty_like(x: Any) -> jax.Array:
  return jnp.zeros(x.shape, x.dtype, device=getattr(x, "sharding", None))


def _into_structure(restored: Any, like: Any) -> Any:
  """Puts restored leaves into exactly ``like``'s tree structure (zero-size ones anew)."""
  like_leaves = jax.tree_util.tree_flatten_with_path(like)[0]
  like_def = jax.tree.structure(like)
  if jax.tree.structure(restored) == like_def:  # type: ignore[operator]
    return restored
  flat = {_orbax_key(p): v for p, v in jax.tree_util.tree_flatten_with_path(restored)[0]}
  return jax.tree.unflatten(like_def, [_empty_like(x) if _is_empty(x) else flat[_orbax_key(p)]
                                       for p, x in like_leaves])


def _jsonable(x: Any) -> Any:
  if isinstance(x, dict):
    return {str(k): _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  if isinstance(x, np.generic):
    return x.item()
  if isinstance(x, np.ndarray):
    return x.tolist()
  return x


def _check_json(value: Any, what: str) -> None:
  try:
    json.dumps(value)
  except (TypeError, ValueError) as e:
    raise TypeError(f"{what} is not JSON-serialisable: {e}") from None


def _encode_position(position: Any) -> dict[str, Any]:
  """One process's data position as JSON: ``{"kind": ..., "value": ...}``."""
  if position is None:
    return {"kind": "none"}
  if isinstance(position, (int, np.integer)) and not isinstance(position, bool):
    return {"kind": "int", "value": int(position)}
  if isinstance(position, (bytes, bytearray)):
    return {"kind": "bytes", "value": base64.b64encode(bytes(position)).decode("ascii")}
  value = _jsonable(position)
  _check_json(value, f"the data position ({type(position).__name__})")
  return {"kind": "json", "value": value}


def _decode_position(d: dict[str, Any]) -> Any:
  kind = d.get("kind")
  if kind == "none":
    return None
  if kind == "int":
    return int(d["value"])
  if kind == "bytes":
    return base64.b64decode(d["value"])
  if kind == "json":
    return d["value"]
  raise ValueError(f"unknown data position kind {kind!r} in checkpoint")


def _allgather_json(value: Any) -> list[Any]:
  """Every process's JSON-serialisable ``value``, in process order (a collective)."""
  if jax.process_count() == 1:
    return [value]
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  raw = np.frombuffer(json.dumps(value).encode(), np.uint8)
  lengths = multihost_utils.process_allgather(np.asarray(raw.size, np.int32))
  padded = np.zeros(int(np.max(lengths)), np.uint8)
  padded[:raw.size] = raw
  rows = np.asarray(multihost_utils.process_allgather(padded))
  return [json.loads(bytes(row[:n]).decode())
          for row, n in zip(rows, np.asarray(lengths), strict=True)]


def _encode_positions(position: Any) -> dict[str, Any]:
  """Every process's position (one entry per process, in process order)."""
  return {"per_process": _allgather_json(_encode_position(position))}


def _decode_positions(d: dict[str, Any]) -> Any:
  per = d["per_process"]
  n, i = jax.process_count(), jax.process_index()
  if len(per) == n:
    return _decode_position(per[i])
  if all(p == per[0] for p in per):
    return _decode_position(per[0])
  raise ValueError(f"the checkpoint's data positions were saved by {len(per)} processes and "
                   f"differ; they cannot be given to {n} processes")
