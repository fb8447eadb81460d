"""Hooks' own state in checkpoints: stable hook names, collecting and handing back.

A hook with ``checkpoint_state() -> dict`` and ``restore_checkpoint_state(d)``
has its state saved with each checkpoint, keyed by its *hook name*
(:func:`hook_names`): its ``hook_name`` attribute if set, else its class name,
with ``#2``, ``#3``... for repeats, so adding an unrelated hook does not move
another hook's saved state. The run (:mod:`loopkit.core.run`) collects the states
(:func:`collect_hook_states`, after flushing the hooks' writers) for a
checkpoint hook, and hands them back on a restore (:func:`give_hook_states`).
Not thread-safe.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["collect_hook_states", "give_hook_states", "hook_names", "match_hook_states"]


def hook_names(hooks: Sequence[Any]) -> list[str]:
  """Stable names of ``hooks``: ``hook_name`` or the class name, ``#2``, ``#3`` for repeats.

  Raises:
    ValueError: a ``hook_name`` given twice, or one that looks like a generated
      repeat (``"Name#2"``) or an old positional key (``"3:Name"``).
  """
  names: list[str] = []
  seen: dict[str, int] = {}
  for h in hooks:
    own = getattr(h, "hook_name", None)
    if own is not None:
      if not isinstance(own, str) or not own or re.fullmatch(r".*#\d+|\d+:.*", own):
        raise ValueError(f"hook {h!r}: hook_name must be a non-empty str without a '#<n>' "
                         f"suffix or '<n>:' prefix, got {own!r}")
      if own in seen:
        raise ValueError(f"two hooks are named {own!r}: give each a different hook_name")
    base = own or type(h).__name__
    seen[base] = seen.get(base, 0) + 1
    names.append(base if seen[base] == 1 else f"{base}#{seen[base]}")
  return names


def match_hook_states(saved: Mapping[str, Any], hooks: Sequence[Any],
                      names: Sequence[str]) -> tuple[dict[int, Any], list[str]]:
  """Which saved hook state goes to which hook.

  New keys are hook names. Keys ``"<index>:<Class>"`` (checkpoints written
  before hook names) go to the hook at that index if it is of that class (the
  old rule), else to the only hook of that class; otherwise they are unmatched.

  Returns:
    ``({index in hooks: state}, [unmatched keys])``.
  """
  by_name = {n: i for i, n in enumerate(names)}
  out: dict[int, Any] = {}
  unmatched = []
  for key, value in saved.items():
    m = re.fullmatch(r"(\d+):(.+)", key)
    if key in by_name:
      out[by_name[key]] = value
    elif m is not None:
      index, cls = int(m.group(1)), m.group(2)
      same_class = [i for i, h in enumerate(hooks) if type(h).__name__ == cls]
      if index < len(hooks) and type(hooks[index]).__name__ == cls:
        out[index] = value
      elif len(same_class) == 1:
        out[same_class[0]] = value
      else:
        unmatched.append(key)
    else:
      unmatched.append(key)
  return out, unmatched


def collect_hook_states(hooks: Sequence[Any], names: Sequence[str],
                        caller: int) -> dict[str, Any]:
  """Flushes every hook but ``caller`` that has ``flush()``, then collects their states.

  Returns:
    ``{hook name: checkpoint_state()}`` of the other hooks that have one.

  Raises:
    TypeError: a state that is not JSON-serialisable (naming the hook).
  """
  others = [(n, h) for j, (n, h) in enumerate(zip(names, hooks)) if j != caller]
  for _, h in others:  # the rows a checkpoint covers are on disk before it is
    flush = getattr(h, "flush", None)
    if callable(flush):
      flush()
  states = {}
  for name, h in others:
    get = getattr(h, "checkpoint_state", None)
    if callable(get):
      value = get()
      try:
        json.dumps(value)
      except (TypeError, ValueError) as e:
        raise TypeError(f"checkpoint_state() of hook {name} is not JSON-serialisable: "
                        f"{e}") from None
      states[name] = value
  return states


def give_hook_states(saved: Mapping[str, Any], hooks: Sequence[Any], names: Sequence[str],
                     caller: int) -> list[str]:
  """Hands each hook but ``caller`` its saved state (``restore_checkpoint_state``).

  Returns:
    The saved keys that match no hook (:func:`match_hook_states`).
  """
  matched, unmatched = match_hook_states(saved, hooks, names)
  for j, value in matched.items():
    put = getattr(hooks[j], "restore_checkpoint_state", None)
    if callable(put) and j != caller:
      put(value)
  return unmatched
