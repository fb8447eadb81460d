"""Where a warm start reads from: a source located, listed as named leaves, read on demand.

A source (:mod:`loopkit.checkpoint.warm`) is a loopkit checkpoint directory (its latest complete
step, or ``step=``), one step directory of it, a plain Orbax PyTree checkpoint, a step of an
Orbax ``CheckpointManager`` (its one item, or ``item=``), or a pytree in memory. Each becomes a
``_Source``: its leaves by path (``params/head/kernel``) with their shapes and dtypes (from
loopkit's leaf record where there is one, else Orbax's metadata), and a ``read`` that restores
only the chosen leaves, each in the dtype and sharding of the live leaf it replaces. Not
thread-safe. Multi-host: every process reads (Orbax reads each process's shards).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from loopkit._internal.extras import missing as _missing_extra

try:
  import orbax.checkpoint as ocp
  from etils import epath
except ImportError as e:
  raise _missing_extra(e, "loopkit.checkpoint") from e

from loopkit.checkpoint.files import _COMMIT_FILE, _TMP_MARK
from loopkit.checkpoint.items import _dtype_name, _is_key, _leaves_from_record, _orbax_key

log = logging.getLogger("loopkit")


_PYTREE_METADATA = "_METADATA"  # Orbax's PyTree checkpoint metadata file


@dataclasses.dataclass(frozen=True)
class _Leaf:
  """A leaf's name and kind: ``shape``/``dtype`` logical (a typed key: ``()``, ``key<fry>``);
  ``physical`` when only its key data's shape and dtype are known (Orbax's metadata)."""

  key: tuple[str, ...]
  shape: tuple[int, ...]
  dtype: str | None
  physical: bool = False

  @property
  def path(self) -> str:
    return "/".join(self.key)

  def described(self) -> str:
    dims = ",".join(str(d) for d in self.shape)
    return f"{self.dtype}[{dims}]"


@dataclasses.dataclass
class _Source:
  where: str
  step: int | None
  leaves: dict[str, _Leaf]  # by path
  read: Callable[[dict[tuple[str, ...], Any]], dict[tuple[str, ...], Any]]


def _is_pytree_dir(path: epath.Path) -> bool:
  return (path / _PYTREE_METADATA).exists()


def _step_dirs(path: epath.Path) -> dict[int, epath.Path]:
  """Digit-named step directories; only committed ones when any is (an unfinished save is
  not read)."""
  steps = {int(p.name): p for p in path.iterdir()
           if p.name.isdigit() and _TMP_MARK not in p.name and p.is_dir()}
  committed = {s: p for s, p in steps.items() if (p / _COMMIT_FILE).exists()}
  return committed or steps


def _items(path: epath.Path) -> list[str]:
  """The Orbax PyTree items of a step directory (``state`` for loopkit, ``default``, ...)."""
  return sorted(p.name for p in path.iterdir() if p.is_dir() and _is_pytree_dir(p))


def _locate(source: epath.Path, step: int | None, item: str | None
            ) -> tuple[epath.Path, int | None, epath.Path | None]:
  """``(PyTree directory, step, loopkit leaf record directory or None)`` of a source path."""
  if not source.exists():
    raise FileNotFoundError(f"warm start: the source {source} does not exist")
  path, found_step = source, None
  if not _is_pytree_dir(path) and not _items(path):
    steps = _step_dirs(path)
    if steps:  # a checkpoint root (loopkit's, or an Orbax manager's)
      if step is None:
        step = max(steps)
      elif step not in steps:
        raise FileNotFoundError(f"warm start: no checkpoint {step} in {source} (found "
                                f"{sorted(steps)})")
      path, found_step = steps[step], step
  if found_step is None and path.name.isdigit():
    found_step = int(path.name)
  if step is not None and found_step != step:
    what = "one checkpoint" if found_step is None else f"step {found_step}"
    raise ValueError(f"warm start: step={step} chooses a step directory of a checkpoint "
                     f"directory; {source} is {what}")
  if _is_pytree_dir(path) and item is None:
    return path, found_step, None
  items = _items(path)
  if item is None:
    if "state" in items:
      item = "state"
    elif len(items) == 1:
      item = items[0]
    else:
      raise FileNotFoundError(
          f"warm start: {path} is not an Orbax PyTree checkpoint" + (
              f"; it holds the items {items}: pass item=<name>" if items else
              " nor a directory of step directories or items holding one"))
  if item not in items:
    raise FileNotFoundError(f"warm start: {path} has no Orbax PyTree item {item!r} "
                            f"(its items: {items})")
  record = path / "leaves" if item == "state" and (path / "leaves").exists() else None
  return path / item, found_step, record


def _read_record(record: epath.Path) -> dict[tuple[str, ...], dict[str, Any]] | None:
  try:
    with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as c:
      return _leaves_from_record(c.restore(record))
  except Exception as e:  # pylint: disable=broad-except  # Orbax's metadata is enough
    log.info("warm start: not using loopkit's leaf record %s: %s", record, e)
    return None


def _restore_args(target: Any) -> Any:
  if target.sharding is None:
    return ocp.RestoreArgs(restore_type=np.ndarray, dtype=target.dtype)
  return ocp.ArrayRestoreArgs(sharding=target.sharding, global_shape=target.shape,
                              dtype=target.dtype)


def _dir_source(path: epath.Path, step: int | None, item: str | None) -> _Source:
  tree_dir, step, record_dir = _locate(path, step, item)
  meta = ocp.PyTreeCheckpointHandler().metadata(tree_dir)
  tree = getattr(meta, "tree", meta)
  flat = ocp.tree.to_flat_dict(tree)
  record = _read_record(record_dir) if record_dir is not None else None
  leaves = {}
  for key, m in flat.items():
    if m is None or getattr(m, "shape", None) is None:
      continue  # None / empty nodes (loopkit saves zero-size leaves as None)
    key = tuple(str(k) for k in key)
    r = (record or {}).get(key)
    leaf = (_Leaf(key, tuple(r["shape"]), r["dtype"]) if r is not None else
            _Leaf(key, tuple(m.shape), str(np.dtype(m.dtype)) if m.dtype is not None else None,
                  physical=record is None))
    leaves[leaf.path] = leaf

  def read(wanted: dict[tuple[str, ...], Any]) -> dict[tuple[str, ...], Any]:
    keyed = {tuple(str(k) for k in key): key for key in flat}
    chosen = {keyed[k]: v for k, v in wanted.items()}
    item_tree = ocp.tree.from_flat_dict(
        {k: chosen.get(k, ocp.PLACEHOLDER) for k in flat}, target=tree)
    args = ocp.tree.from_flat_dict(
        {k: _restore_args(chosen[k]) if k in chosen else ocp.PLACEHOLDER for k in flat},
        target=tree)
    with ocp.PyTreeCheckpointer() as c:
      out = c.restore(tree_dir, args=ocp.args.PyTreeRestore(item=item_tree, restore_args=args))
    got = ocp.tree.to_flat_dict(out)
    return {k: got[keyed[k]] for k in wanted}

  return _Source(str(tree_dir), step, leaves, read)


def _tree_source(tree: Any) -> _Source:
  flat = {_orbax_key(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
  leaves = {}
  for key, x in flat.items():
    if not hasattr(x, "shape"):
      x = np.asarray(x)
    leaves["/".join(key)] = _Leaf(key, tuple(x.shape), _dtype_name(x))

  def read(wanted: dict[tuple[str, ...], Any]) -> dict[tuple[str, ...], Any]:
    out = {}
    for k, target in wanted.items():
      x = flat[k] if hasattr(flat[k], "dtype") else np.asarray(flat[k])
      if not _is_key(target) and x.dtype != target.dtype:
        x = x.astype(target.dtype)
      out[k] = (np.asarray(x) if target.sharding is None
                else jax.device_put(x, target.sharding))
    return out

  return _Source("the given tree", None, leaves, read)
