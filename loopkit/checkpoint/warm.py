"""Warm start: a new run's state from another run's checkpoint (fine-tuning).

:func:`warm_start` reads chosen leaves of a checkpoint into a live train state
and keeps the others as they are: the parameters of a pretrained run go into a
fresh state (a fresh optimizer state, step 0), keys may be renamed, source
leaves dropped and new leaves (a new head) kept fresh, dtypes cast, and every
leaf read is placed with the live leaf's sharding (another mesh, another
number of devices). ``CheckpointHook(init_from=...)`` does it at ``run`` start
when its own directory holds no checkpoint yet, so a warm-started run that is
killed resumes from its own checkpoints, not from the source.

Sources: a loopkit checkpoint directory (its latest complete step, or
``step=``), one step directory of it, a plain Orbax PyTree checkpoint (what
``ocp.StandardCheckpointer().save(path, params)`` or ``ocp.PyTreeCheckpointer``
write, as Flax's examples do), a step of an Orbax ``CheckpointManager`` (its
one item, or ``item=``), or a pytree in memory (located, listed and read by
:mod:`loopkit.checkpoint.warm_sources`).

Leaves are named by their path with ``/`` between keys (Orbax's flat keys):
``params/head/kernel`` for ``state.params["head"]["kernel"]``, ``opt/0/mu/w``
for the first optimizer state's ``mu`` of ``w``. A pattern (a regular
expression) matches a leaf when it matches the whole path or a whole leading
part of it: ``"params"`` matches every leaf under ``params``.

Not thread-safe. Multi-host: every process calls it (Orbax reads each
process's shards).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from loopkit._internal.checks import few_names
from loopkit._internal.extras import missing as _missing_extra

try:
  from etils import epath
except ImportError as e:
  raise _missing_extra(e, "loopkit.checkpoint") from e

from loopkit.checkpoint.items import (
  _dtype_name,
  _empty_like,
  _is_empty,
  _is_key,
  _orbax_key,
)
from loopkit.checkpoint.warm_sources import _dir_source, _Leaf, _Source, _tree_source
from loopkit.core.state_leaves import as_loop_leaf

log = logging.getLogger("loopkit")

__all__ = ["WarmStart", "WarmStartError", "warm_start"]

_SHOWN = 20  # leaves listed per group in an error


class WarmStartError(ValueError):
  """Chosen leaves of the train state cannot be taken from the warm-start source.

  The message lists them (path, shape, dtype) with the source's leaves that no
  train-state leaf took, and names the argument that maps them (``rename``,
  ``exclude``, ``missing="keep"``, ``cast``).
  """


# -- patterns ----------------------------------------------------------------------


def _patterns(value: str | Sequence[str] | None, what: str) -> list[re.Pattern] | None:
  if value is None:
    return None
  items = [value] if isinstance(value, str) else list(value)
  out = []
  for p in items:
    if not isinstance(p, str):
      raise TypeError(f"{what} patterns must be strings (regular expressions), got {p!r}")
    try:
      out.append(re.compile(p))
    except re.error as e:
      raise ValueError(f"{what} pattern {p!r} is not a regular expression: {e}") from None
  return out


def _heads(path: str) -> list[tuple[str, str]]:
  """``(head, rest)`` splits of ``a/b/c`` at its slashes, longest head first."""
  parts = path.split("/")
  return [("/".join(parts[:i]), "".join("/" + p for p in parts[i:]))
          for i in range(len(parts), -1, -1)]


def _matches(rx: re.Pattern, path: str) -> bool:
  return any(rx.fullmatch(head) for head, _ in _heads(path))


def _tidy_path(path: str) -> str:
  return "/".join(p for p in path.split("/") if p)


def _renamed(path: str, rules: list[tuple[re.Pattern, str]]) -> tuple[str, int | None]:
  """The source path of a train-state leaf and the index of the rule that mapped it."""
  for i, (rx, replacement) in enumerate(rules):
    for head, rest in _heads(path):
      m = rx.fullmatch(head)
      if m:
        return _tidy_path(m.expand(replacement) + rest), i
  return path, None


# -- the warm start ----------------------------------------------------------------


def _target(x: Any) -> Any:
  """What a live leaf's replacement must be: shape, dtype, sharding (None: a numpy array)."""
  sharding = getattr(x, "sharding", None)
  if sharding is None and not isinstance(x, np.ndarray):
    sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def _as(value: Any, read_as: Any, target: Any) -> Any:
  """``value``, read for ``read_as``, in ``target``'s dtype and sharding."""
  if read_as is target or (read_as.dtype == target.dtype and read_as.sharding == target.sharding):
    return value
  if value.dtype != target.dtype:
    value = value.astype(target.dtype)
  return np.asarray(value) if target.sharding is None else jax.device_put(value, target.sharding)


def _physical(x: Any) -> tuple[tuple[int, ...], str]:
  data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
  return tuple(data.shape), str(data.dtype)


def _difference(live: _Leaf, x: Any, found: _Leaf, cast: bool) -> str | None:
  """Why ``found`` cannot fill the live leaf, or None."""
  shape, dtype = live.shape, live.dtype
  if found.physical and _is_key(x):  # Orbax's metadata shows a key's data
    shape, dtype = _physical(x)
  if found.shape != shape:
    return "shape"
  if found.dtype is None or found.dtype == dtype:
    return None
  keys = _is_key(x) or found.dtype.startswith("key<")
  return "dtype" if keys or not cast else None


def _listed(lines: list[str]) -> list[str]:
  more = len(lines) - _SHOWN
  return lines[:_SHOWN] + ([f"    ... and {more} more"] if more > 0 else [])


def _suggested_rename(missing: list[tuple[_Leaf, str]], unused: list[_Leaf]) -> str | None:
  """A ``rename`` that maps the missing leaves to unused source leaves of their shape with the
  longest common tail of keys, then head: ``{"params": ""}`` for a source without the prefix;
  ``{"params/(.*)": "\\1/value"}`` for a Flax NNX ``nnx.State`` saved as it is (each array
  under its Variable's ``value``) read into plain dicts of arrays."""
  votes: collections.Counter = collections.Counter()
  for live, _ in missing:
    best = None
    for u in unused:
      if u.shape != live.shape:
        continue
      wrapped = len(u.key) > 1 and u.key[-1] == "value" and live.key[-1] != "value"
      key = u.key[:-1] if wrapped else u.key
      n = m = 0  # keys in common at the end, then at the start
      while n < min(len(key), len(live.key)) and key[-1 - n] == live.key[-1 - n]:
        n += 1
      while m < min(len(key), len(live.key)) - n and key[m] == live.key[m]:
        m += 1
      if n and (best is None or (n, m, not wrapped) > best[0]):
        best = ((n, m, not wrapped), "/".join(live.key[:-n]), "/".join(key[:-n]), wrapped)
    if best is not None and (best[1] != best[2] or best[3]):
      votes[best[1:]] += 1
  if not votes:
    return None
  (head, to, wrapped), _ = votes.most_common(1)[0]
  if not wrapped:
    return f"rename={{{re.escape(head)!r}: {to!r}}}"
  pattern = f"{re.escape(head)}/(.*)" if head else "(.*)"
  return f"rename={{{pattern!r}: r'{to + '/' if to else ''}\\1/value'}}"


def _exclusion(keys: list[tuple[str, ...]]) -> str:
  """An ``exclude`` value for these leaves: their common module (``'params/head'``) or paths."""
  common = keys[0]
  for k in keys[1:]:
    n = 0
    while n < min(len(common), len(k)) and common[n] == k[n]:
      n += 1
    common = common[:n]
  if len(keys) > 1 and len(common) >= 2:
    return repr(re.escape("/".join(common)))
  return repr([re.escape("/".join(k)) for k in keys[:3]] if len(keys) > 1
              else re.escape("/".join(keys[0])))


def _as_written(argument: str) -> str:
  """An argument as the user of :func:`warm_start` or :class:`WarmStart` writes it."""
  return argument


def _error(source: _Source, missing: list[tuple[_Leaf, str]],
           different: list[tuple[_Leaf, _Leaf, str]], unused: list[_Leaf],
           spell: Callable[[str], str] = _as_written) -> WarmStartError:
  at = f" (step {source.step})" if source.step is not None else ""
  lines = [f"warm start from {source.where}{at}: {_leaves(len(missing) + len(different))} of "
           "the train state cannot be taken from the source"]
  if missing:
    rename, exclude, keep = (spell(a) for a in (
        "rename={train-state pattern: source path}", "exclude=<pattern>", 'missing="keep"'))
    lines.append(f"  {len(missing)} not in the source (map each to a source path with "
                 f"{rename}, or keep its fresh value with {exclude} or {keep}):")
    lines += _listed([f"    {live.path}  {live.described()}" + (
        f"  (looked for {wanted})" if wanted != live.path else "") for live, wanted in missing])
  shapes = [d for d in different if d[2] == "shape"]
  dtypes = [d for d in different if d[2] == "dtype"]
  if shapes:
    exclusion = spell(f"exclude={_exclusion([live.key for live, _, _ in shapes])}")
    lines.append(f"  {len(shapes)} with another shape in the source (keep the fresh value "
                 f"with {exclusion}, or rename it to a source leaf of its shape):")
    lines += _listed([f"    {live.path}  {live.described()} in the train state, "
                      f"{found.path}  {found.described()} in the source"
                      for live, found, _ in shapes])
  if dtypes:
    lines.append(f"  {len(dtypes)} with another dtype in the source ({spell('cast=True')} "
                 "casts numbers; a PRNG key's impl cannot be cast):")
    lines += _listed([f"    {live.path}  {live.described()} in the train state, "
                      f"{found.path}  {found.described()} in the source"
                      for live, found, _ in dtypes])
  # The source's leaves near the problem (under the same first key), else all of them.
  seen = {found.path for _, found, _ in different}
  unused = [u for u in unused if u.path not in seen]
  firsts = {w.split("/")[0] for _, w in missing} | {f.key[0] for _, f, _ in different}
  near = [u for u in unused if u.key[0] in firsts] or (unused if missing else [])
  if near:
    under = "" if len(near) == len(unused) else f" under {', '.join(sorted(firsts))}"
    lines.append(f"  source leaves{under} that no train-state leaf takes ({len(near)}):")
    lines += _listed([f"    {u.path}  {u.described()}" for u in near])
  hint = _suggested_rename(missing, unused) if missing else None
  if hint:
    lines.append(f"  perhaps: {spell(hint)}")
  return WarmStartError("\n".join(lines))


@dataclasses.dataclass(frozen=True)
class WarmStart:
  """Which leaves of a train state to take from which checkpoint (see :func:`warm_start`).

  ``CheckpointHook(directory, init_from=WarmStart(...))`` applies it at ``run``
  start when ``directory`` holds no checkpoint; a path alone,
  ``init_from="/runs/pretrain/checkpoints"``, means ``WarmStart(path)`` (its
  ``params``).

  Attributes: the keyword arguments of :func:`warm_start`, and ``source``.
  """

  source: Any
  select: str | Sequence[str] | None = "params"
  exclude: str | Sequence[str] = ()
  rename: Mapping[str, str] | Sequence[tuple[str, str]] = ()
  missing: str = "error"
  cast: bool = True
  step: int | None = None
  item: str | None = None

  def __post_init__(self):
    if self.missing not in ("error", "keep"):
      raise ValueError(f"missing must be 'error' or 'keep', got {self.missing!r}")
    self._compiled()  # bad patterns raise here, at construction

  def _compiled(self) -> tuple[list[re.Pattern] | None, list[re.Pattern],
                               list[tuple[re.Pattern, str]]]:
    select = _patterns(self.select, "select")
    exclude = _patterns(self.exclude, "exclude") or []
    pairs = list(self.rename.items()) if isinstance(self.rename, Mapping) else list(self.rename)
    rules = []
    for pair in pairs:
      if not (isinstance(pair, (tuple, list)) and len(pair) == 2
              and all(isinstance(v, str) for v in pair)):
        raise TypeError(f"rename takes {{pattern: source path}} or (pattern, source path) "
                        f"pairs of strings, got {pair!r}")
      rules.append((_patterns(pair[0], "rename")[0], pair[1]))  # type: ignore[index]
    return select, exclude, rules

  def _open(self) -> _Source:
    if isinstance(self.source, (str, os.PathLike)):
      path = epath.Path(self.source)
      if "://" not in str(path):
        path = epath.Path(os.path.abspath(os.path.expanduser(os.fspath(path))))
      return _dir_source(path, self.step, self.item)
    if self.step is not None or self.item is not None:
      raise ValueError("step= and item= choose within a checkpoint directory; the source is "
                       f"a {type(self.source).__name__}")
    return _tree_source(self.source)

  def apply(self, state: Any) -> Any:
    """The state with the chosen leaves read from the source (see :func:`warm_start`)."""
    return self.run(state)[0]

  def run(self, state: Any, *, spell: Callable[[str], str] = _as_written) -> tuple[Any, str]:
    """Like :meth:`apply`; also returns a one-line account of what was taken and kept.

    ``spell`` writes an argument an error suggests (``"exclude='params/head'"``) as the
    caller's API takes it (``CheckpointHook``: ``init_from=WarmStart(..., exclude=...)``)."""
    select, exclude, rules = self._compiled()
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    lives = []  # (name, the leaf as the loop takes it: a Python scalar as its array)
    for p, x in flat:
      x = as_loop_leaf(x)
      lives.append((_Leaf(_orbax_key(p), tuple(x.shape), _dtype_name(x)), x))
    paths = [live.path for live, _ in lives]
    if select is not None:
      for rx in select:
        if not any(_matches(rx, p) for p in paths):
          raise ValueError(f"warm start: select pattern {rx.pattern!r} matches no leaf of the "
                           f"train state (its leaves: {few_names(paths)}); {spell('select=None')} "
                           "takes every leaf")
    for rx in exclude:
      if not any(_matches(rx, p) for p in paths):
        raise ValueError(f"warm start: exclude pattern {rx.pattern!r} matches no leaf of the "
                         f"train state (its leaves: {few_names(paths)})")
    source = self._open()
    chosen: dict[int, tuple[_Leaf, str]] = {}
    used_rules: set[int] = set()
    for i, (live, x) in enumerate(lives):
      if (select is not None and not any(_matches(rx, live.path) for rx in select)) or any(
          _matches(rx, live.path) for rx in exclude):
        continue
      if _is_empty(x):  # nothing to read: it stays (zero-size)
        continue
      wanted, rule = _renamed(live.path, rules)
      if rule is not None:
        used_rules.add(rule)
      chosen[i] = (live, wanted)
    for j, (rx, _) in enumerate(rules):
      if j not in used_rules:
        names = few_names([c[0].path for c in chosen.values()])
        raise ValueError(f"warm start: rename pattern {rx.pattern!r} matches no chosen leaf of "
                         f"the train state (chosen: {names})")
    missing, different, taken = [], [], {}
    for i, (live, wanted) in chosen.items():
      found = source.leaves.get(wanted)
      if found is None:
        missing.append((live, wanted))
        continue
      why = _difference(live, lives[i][1], found, self.cast)
      if why:
        different.append((live, found, why))
      else:
        taken[i] = found
    used = {f.path for f in taken.values()}
    unused = [leaf for path, leaf in sorted(source.leaves.items()) if path not in used]
    if different or (missing and self.missing == "error"):
      raise _error(source, missing, different, unused, spell)
    unread = [live for i, (live, x) in enumerate(lives)
              if i not in taken and isinstance(x, jax.ShapeDtypeStruct) and not _is_empty(x)]
    if unread:  # refused before anything is read
      at = f" (step {source.step})" if source.step is not None else ""
      raise WarmStartError(
          f"warm start from {source.where}{at}: {_leaves(len(unread))} of the train state "
          f"{'is' if len(unread) == 1 else 'are'} abstract (jax.ShapeDtypeStruct) and not read "
          f"from the source: {few_names([f'{u.path} {u.described()}' for u in unread], 3)}. An "
          "abstract leaf takes its value from the source: choose it (select=None reads every "
          "leaf) or give it a value to keep")
    # One read per source leaf (several leaves may take the same one: a layer copied).
    targets = {i: _target(lives[i][1]) for i in taken}
    first: dict[tuple[str, ...], Any] = {}
    for i, found in taken.items():
      first.setdefault(found.key, targets[i])
    values = source.read(first) if first else {}
    leaves = [_as(values[taken[i].key], first[taken[i].key], targets[i]) if i in taken
              else _empty_like(x) if isinstance(x, jax.ShapeDtypeStruct) else x
              for i, (_, x) in enumerate(flat)]  # (an abstract leaf not taken: zero-size)
    kept = [live.path for i, (live, _) in enumerate(lives) if i not in taken]
    at = f" step {source.step}" if source.step is not None else ""
    absent = few_names([m[0].path for m in missing])
    account = (f"warm start from {source.where}{at}: {_leaves(len(taken))} read, {len(kept)} "
               f"kept as they were" + (f" ({len(missing)} not in the source: {absent})"
                                       if missing else "")
               + f", {_leaves(len(unused)).replace(' ', ' source ', 1)} not used")
    log.info("%s", account)
    return jax.tree_util.tree_unflatten(treedef, leaves), account


def _leaves(n: int) -> str:
  return f"{n} leaf" if n == 1 else f"{n} leaves"


def warm_start(state: Any, source: Any, *, select: str | Sequence[str] | None = "params",
               exclude: str | Sequence[str] = (),
               rename: Mapping[str, str] | Sequence[tuple[str, str]] = (),
               missing: str = "error", cast: bool = True, step: int | None = None,
               item: str | None = None) -> Any:
  """Returns ``state`` with its chosen leaves read from another run's checkpoint.

  For fine-tuning: give the fresh state of the new run (its optimizer state
  fresh, its step 0) and take the pretrained parameters::

    state = warm_start(init(), "/runs/pretrain/checkpoints")            # its params
    state = warm_start(init(), path, exclude="params/head")             # a new head
    state = warm_start(init(), "/flax/params", rename={"params": ""})   # a params-only tree

  Leaves not chosen, and chosen ones ``missing="keep"`` lets through, keep their
  value in ``state``; so does the step counter unless chosen, so a loop given
  the result starts at ``state``'s step.

  Args:
    state: the live train state, any state ``TrainLoop.run`` takes
      (``jax.Array`` leaves, any shardings; numpy leaves are read as numpy;
      Python scalars, e.g. Flax ``TrainState.create``'s ``step=0``, as the
      loop places them: an ``int`` as int32; a Flax ``TrainState``, an
      ``nnx.State``). Each leaf read takes its shape, dtype and sharding: a
      checkpoint saved on one mesh is read onto another.
      A leaf may be abstract (``jax.ShapeDtypeStruct``, with ``sharding`` for
      where it goes: ``jax.eval_shape(init)``) where it is read: only the
      leaves read are allocated (a source leaf read straight into its sharding).
    source: a loopkit checkpoint directory (its latest step, or ``step``), one
      of its step directories, a plain Orbax PyTree checkpoint directory
      (``ocp.StandardCheckpointer().save(path, tree)``, ``ocp.PyTreeCheckpointer``),
      a step directory of an Orbax ``CheckpointManager`` (its item ``state``, its
      only item, or ``item``), a directory of such steps, or a pytree.
    select: patterns of the state's leaves to read (default ``"params"``: every
      leaf under ``params``); None reads every leaf.
    exclude: patterns of leaves not to read although selected (a new head:
      ``"params/head"``).
    rename: ``{pattern: source path}`` (or pairs, tried in order): a chosen leaf
      whose path (or leading part) matches a pattern is read from the
      replacement (with ``\\1`` groups) plus the rest of its path; e.g.
      ``{"params/encoder": "params/backbone"}``, or ``{"params": ""}`` for a
      source that holds the parameters alone. Several leaves may read one
      source leaf (a layer copied).
    missing: ``"error"`` (default) or ``"keep"``: what to do with a chosen leaf
      the source lacks (``"keep"``: keep its value, e.g. a layer added).
    cast: read numbers in the state's dtype (bfloat16 from float32, say);
      False refuses another dtype. A PRNG key's impl is never cast.
    step: the step to read from a directory of steps (default: the latest
      complete one).
    item: the Orbax item to read in a step directory with several.

  Returns:
    A state of ``state``'s tree structure: the chosen leaves read (new arrays),
    placed with their live leaf's sharding and dtype; the other leaves are
    ``state``'s, the same objects (as ``state.replace(...)`` keeps them, with no
    second copy in memory). A run donates its state, so run the result or
    ``state``, not both: a run given a state whose arrays an earlier run
    took refuses it before it starts, naming those leaves.

  Raises:
    WarmStartError: a chosen leaf is not in the source (with
      ``missing="error"``), or has another shape there (or another dtype with
      ``cast=False``); the message lists those leaves with their paths, shapes
      and dtypes, the source leaves nothing took, and the argument that maps
      them (and a likely ``rename``). Also an abstract leaf that is not read
      (not chosen, or kept by ``missing="keep"``), naming it. Nothing is read.
    ValueError: a ``select``, ``exclude`` or ``rename`` pattern that matches
      no leaf, or an invalid argument.
    FileNotFoundError: no such source, step or item.
  """
  return WarmStart(source, select=select, exclude=exclude, rename=rename, missing=missing,
                   cast=cast, step=step, item=item).apply(state)
