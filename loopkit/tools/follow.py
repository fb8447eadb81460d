"""Evaluation beside training, from the command line: follow a run's checkpoints.

::

  python -m loopkit.tools.follow my_project.evaluate:follow_target \\
      --directory /tmp/run/checkpoints --output_dir /tmp/run/follow

The target is ``module:function``, called with no arguments, returning ``(like, evaluator,
batches)`` or a dict with those keys and, optionally, ``num_batches``, ``state_fn``, ``mesh``
and ``prefix`` (:class:`loopkit.tools.follower.CheckpointFollower`'s arguments): ``like`` the train
state's structure (the initial state, or its ``jax.eval_shape``), ``evaluator`` what
:class:`loopkit.EvalHook` takes, ``batches`` the eval batches (re-iterable, or a callable).

The command evaluates each new checkpoint in ``--directory`` once, in step order, writes the
rows (``eval/<metric>``, ``eval/num_examples`` at the checkpoint's step) to
``OUTPUT_DIR/metrics.jsonl``, TensorBoard files there and the console
(:func:`loopkit.observe.create_default_writer`), remembers its progress in
``OUTPUT_DIR/follow_progress.json`` (a restarted command continues), and exits 0 once the
training run wrote ``TRAIN_COMPLETE`` and every checkpoint up to it was evaluated, or 1 when
``--timeout_secs`` passed without a new checkpoint.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from loopkit.tools._targets import load_target

PROGRESS_FILE = "follow_progress.json"
_KEYS = ("like", "evaluator", "batches", "num_batches", "state_fn", "mesh", "prefix")


def _target_kwargs(spec: str, made: Any) -> dict[str, Any]:
  """The follower's arguments from what the target returned."""
  if isinstance(made, Mapping):
    unknown = sorted(set(made) - set(_KEYS))
    missing = [k for k in _KEYS[:3] if k not in made]
    if unknown or missing:
      raise SystemExit(f"{spec} returned a dict with keys {sorted(made)}: it needs like, "
                       f"evaluator, batches and may have {', '.join(_KEYS[3:])}"
                       + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
    return dict(made)
  if isinstance(made, tuple) and len(made) == 3:
    return dict(zip(_KEYS[:3], made, strict=True))
  raise SystemExit(f"{spec} must return (like, evaluator, batches) or a dict with those keys, "
                   f"got {type(made).__name__}")


def main(argv: Sequence[str] | None = None) -> int:
  """Command line: ``python -m loopkit.tools.follow module:function --directory D --output_dir O``.

  Returns:
    0 when the training run completed and every checkpoint up to it was evaluated (or
    skipped: deleted before it could be read); 1 after ``--timeout_secs`` without a new
    checkpoint.
  """
  p = argparse.ArgumentParser(
      prog="python -m loopkit.tools.follow",
      description="Evaluate each new checkpoint of a training run once, beside it; stop when "
                  "the run writes TRAIN_COMPLETE.")
  p.add_argument("target", help="module:function returning (like, evaluator, batches) or a "
                                "dict of CheckpointFollower's arguments")
  p.add_argument("--directory", required=True, help="the training run's checkpoint directory")
  p.add_argument("--output_dir", required=True,
                 help="where the rows (metrics.jsonl, TensorBoard) and the progress go")
  p.add_argument("--poll_secs", type=float, default=10.0,
                 help="seconds between listings of the directory (default 10)")
  p.add_argument("--timeout_secs", type=float, default=None,
                 help="give up after this many seconds without a new checkpoint (default: "
                      "wait for TRAIN_COMPLETE)")
  args = p.parse_args(argv)
  kwargs = _target_kwargs(args.target, load_target(args.target)())

  from loopkit.tools.follower import CheckpointFollower  # pylint: disable=g-import-not-at-top
  from loopkit.observe import writers  # pylint: disable=g-import-not-at-top

  writer = writers.create_default_writer(args.output_dir)
  try:
    follower = CheckpointFollower(
        args.directory, kwargs.pop("like"), kwargs.pop("evaluator"), kwargs.pop("batches"),
        writer=writer, progress_file=os.path.join(args.output_dir, PROGRESS_FILE),
        poll_secs=args.poll_secs, timeout_secs=args.timeout_secs, **kwargs)
    follower.run()
  finally:
    writer.close()
  evaluated = [s for s, _ in follower.results]
  print(f"{follower.status}: evaluated {len(evaluated)} checkpoint(s) {evaluated}"
        + (f", skipped {follower.skipped_steps} (deleted before they were read)"
           if follower.skipped_steps else "")
        + f"; rows in {os.path.join(args.output_dir, 'metrics.jsonl')}")
  return 0 if follower.status == "complete" else 1


if __name__ == "__main__":
  sys.exit(main())
