"""What changed between two calls of the compiled program, when one compiled it again.

:func:`call_signature` records, per leaf of a call's state, batch and step count, the shape,
dtype, weak type and sharding a compilation is specialised on; :func:`signature_change` says
which leaf differs between the first call and a call that compiled again, for the
:class:`RecompileWarning` the train program raises
(:meth:`loopkit.core.program.MultiStepProgram.__call__`). Pure host functions; thread-safe.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from loopkit._internal.checks import leaf_dtype, leaf_name


class RecompileWarning(UserWarning):
  """The train program compiled again in a run; the message names the leaf that changed."""


def call_signature(state: Any, batches: Any, num_steps: Any) -> list[tuple[str, tuple]]:
  """Per leaf of a program call: ``(name, (shape, dtype, weak_type, sharding))``.

  Only metadata is read, so donated (deleted) arrays are fine.
  """
  out = []
  for what, tree in (("state", state), ("batch", batches), ("num_steps", num_steps)):
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
      out.append((f"{what} leaf {leaf_name(path)}",
                  (np.shape(x), leaf_dtype(x), bool(getattr(x, "weak_type", False)),
                   getattr(x, "sharding", None))))
  return out


def _describe(sig: tuple) -> str:
  shape, dtype, weak, sharding = sig
  where = (f"sharding {sharding}" if sharding is not None else
           "a host (numpy) array, placed by the call")
  return f"shape {shape} dtype {dtype}{' (weak-typed)' if weak else ''} {where}"


def signature_change(first: list[tuple[str, tuple]], now: list[tuple[str, tuple]]) -> str:
  """Says which leaf's shape, dtype, weak type or sharding differs between two signatures."""
  if [name for name, _ in first] != [name for name, _ in now]:
    return ("the tree structure of the state or the batch changed: first call "
            f"{[n for n, _ in first]}, this call {[n for n, _ in now]}")
  changed = []
  for (name, a), (_, b) in zip(first, now):
    if a[3] is None or b[3] is None:  # a numpy leaf (None): JAX compiles again for a
      same_sharding = a[3] is b[3]      # placed one, even with the same pinned sharding
    else:
      same_sharding = a[3] == b[3] or a[3].is_equivalent_to(b[3], len(a[0]))
    if a[:3] != b[:3] or not same_sharding:
      changed.append(f"{name} has {_describe(b)}, the first call had {_describe(a)}")
  if not changed:
    return "no leaf's shape, dtype, weak type or sharding changed (a retrace of the step?)"
  return "; ".join(changed)
