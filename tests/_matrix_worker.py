"""Subprocess worker for tests/test_matrix.py: one user's script, its parts chosen by a cell.

``python tests/_matrix_worker.py CELL_JSON``: ``CELL_JSON`` names the loop (``train``:
:class:`loopkit.TrainLoop` over tests/toy.py's regression; ``nnx``:
:class:`loopkit.nnx.NnxTrainLoop` over tests/nnx_models.py's CNN with BatchNorm, Dropout and
``nnx.Rngs``), ``k`` (iterations_per_loop), the logging set-up at the top of the script
(``none``, ``orbax``: ``import orbax.checkpoint``, ``clu``: CLU's logging writer in CLU's
``AsyncMultiWriter`` beside loopkit's ``JsonlWriter``, ``absl``: ``absl.app.run(main)``,
``basic``: ``logging.basicConfig(level=logging.INFO)``), the hooks (``eval``: ``none``,
``evaluator``: :class:`loopkit.Evaluator`, ``nnx``: :class:`loopkit.nnx.NnxEvaluator`, each in
an :class:`loopkit.EvalHook`; and on/off: ``checkpoint``, ``progress``, ``goodput``,
``profiler``, ``nancheck``, ``callback``), the ending (``complete``; ``raise``: a hook raises;
``sigint``: the process sends itself SIGINT; ``sigkill``: it SIGKILLs itself right after a
checkpoint) and the schedule (``schedule``: steps, every_* of each hook, the ending's step).

Everything lives in ``workdir``: ``metrics.jsonl`` (rows, eval rows, goodput rows), ``ckpt/``,
``callback.txt`` (one line ``end_step state_step`` per firing), ``plugins/profile/``, and, when
``run`` returns, ``result-<phase>.json`` (status, step, restored step, the final state's digest,
whether TensorFlow was imported). An uncaught exception ends the script as it ends a user's.

``mode: reference`` instead trains every (loop, K) of ``refs`` straight through (logging,
both evaluators where they apply, checkpoints, the callback) and writes ``reference.json``.

Not a test module itself.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import sys

CELL = json.loads(sys.argv[1]) if __name__ == "__main__" else {}
if __name__ == "__main__":  # set the device count before JAX is imported
  HERE = os.path.dirname(os.path.abspath(__file__))
  sys.path[:0] = [os.path.dirname(HERE), HERE]
  from tests import bootstrap
  bootstrap.start(1)

# The logging set-up under test, where a user's script has it: at the top.
SETUP = CELL.get("logging", "none")
if SETUP == "basic":
  logging.basicConfig(level=logging.INFO)
elif SETUP == "orbax":
  import orbax.checkpoint  # noqa: F401  # (what any script with a CheckpointHook does)
elif SETUP == "absl":
  from absl import app

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import loopkit  # noqa: E402
from tests import toy  # noqa: E402


class Boom(RuntimeError):
  pass


def clu_writer(path: str):
  """CLU's ``create_default_writer(just_logging=True)`` (its ``LoggingWriter`` in its
  ``AsyncMultiWriter``, logging through absl on CLU's writer thread), with loopkit's
  ``JsonlWriter`` beside it for the rows on disk.

  ``clu/metric_writers/__init__.py`` imports CLU's TensorFlow ``SummaryWriter`` (seconds of
  TensorFlow start-up, and no TensorFlow in the newest-JAX environment): CLU's own writer
  modules are imported here without that ``__init__``.
  """
  import types

  import clu
  pkg = types.ModuleType("clu.metric_writers")
  pkg.__path__ = [os.path.join(os.path.dirname(clu.__file__), "metric_writers")]
  sys.modules["clu.metric_writers"] = pkg
  from clu.metric_writers import async_writer, logging_writer
  return async_writer.AsyncMultiWriter([logging_writer.LoggingWriter(),
                                        loopkit.observe.JsonlWriter(path)])


def digest(state) -> str:
  """sha256 of every leaf's bytes (typed keys as their key data), in leaf order."""
  h = hashlib.sha256()
  for x in jax.tree.leaves(jax.device_get(state)):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    h.update(np.ascontiguousarray(np.asarray(x)).tobytes())
  return h.hexdigest()


# -- the two loops: a plain pytree state, and Flax NNX objects --------------------------------

class TrainModel:
  """tests/toy.py's regression: batches of 8, eval on 8 + 8 + 5 examples (one padded)."""

  step_key = "step"

  def __init__(self, steps: int):
    self.batches = toy.batches(steps, batch_size=8)
    self.eval_batches = toy.batches(3, batch_size=8, seed=7)
    self.eval_batches[-1] = {k: v[:5] for k, v in self.eval_batches[-1].items()}

  @staticmethod
  def eval_step(state, batch):
    pred = batch["x"] @ state["params"]["w"] + state["params"]["b"]
    return {"err": jnp.mean((pred - batch["y"]) ** 2, axis=-1)}  # [B]

  def loop(self, k, hooks):
    return loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=k, hooks=hooks)

  def evaluators(self):
    return {"evaluator": (loopkit.Evaluator(self.eval_step), None)}

  def run(self, loop, steps):
    return loop.run(toy.init_state(), self.batches, num_steps=steps)

  @staticmethod
  def state_step(state) -> int:
    return int(state["step"])


class NnxModel:
  """tests/nnx_models.py's CNN (Conv, BatchNorm, Dropout, nnx.Rngs), Flax MNIST's steps."""

  def __init__(self, steps: int):
    import nnx_models
    from flax import nnx
    import loopkit.nnx  # noqa: F401
    self.nnx, self.lib = nnx, nnx_models
    self.model, self.optimizer, self.metrics, self.rngs = nnx_models.make()
    self.batches = nnx_models.batches(steps, batch_size=8)
    self.eval_batches = nnx_models.batches(3, batch_size=8, seed=7)
    self.eval_batches[-1] = {k: v[:5] for k, v in self.eval_batches[-1].items()}
    clone = nnx.clone(self.model)
    clone.eval()
    self.eval_graphdef = nnx.graphdef(clone)

  def eval_step(self, model_state, batch):
    """A pure per-example eval step over the loop state's model part (for loopkit.Evaluator)."""
    import optax
    model = self.nnx.merge(self.eval_graphdef, model_state)
    logits = model(batch["image"], None)
    return {"accuracy": (logits.argmax(-1) == batch["label"]).astype(jnp.float32),
            "loss": optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])}

  def loop(self, k, hooks):
    return loopkit.nnx.NnxTrainLoop(self.lib.train_step, self.model, self.optimizer,
                                    self.metrics, extra=(self.rngs,), iterations_per_loop=k,
                                    hooks=hooks)

  def evaluators(self):
    nnx = self.nnx
    eval_metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(),
                                   loss=nnx.metrics.Average("loss"))
    return {"evaluator": (loopkit.Evaluator(self.eval_step), lambda s: s["model"]),
            "nnx": (loopkit.nnx.NnxEvaluator(self.lib.eval_step, self.model, eval_metrics), None)}

  def run(self, loop, steps):
    return loop.run(self.batches, num_steps=steps)

  @staticmethod
  def state_step(state) -> int:
    return int(state["optimizer"]["step"])


MODELS = {"train": TrainModel, "nnx": NnxModel}


def eval_hook(evaluator, state_fn, batches, **kw):
  """The obvious form for either evaluator kind: ``EvalHook(evaluator, batches, ...)``."""
  if state_fn is not None:
    kw["state_fn"] = state_fn
  return loopkit.EvalHook(evaluator, batches, **kw)


def record_callback(path: str, state_step):
  def fn(info, state):
    with open(path, "a") as f:
      f.write(f"{info.end_step} {state_step(state)}\n")
  return fn


# -- a cell's script ---------------------------------------------------------------------------

def main(cell) -> None:
  s, wd = cell["schedule"], cell["workdir"]
  m = MODELS[cell["loop"]](s["steps"])
  jsonl = os.path.join(wd, "metrics.jsonl")
  writer = (clu_writer(jsonl) if cell["logging"] == "clu"
            else loopkit.observe.create_default_writer(wd))  # TensorBoard, JSONL, console
  hooks = []
  if cell["nancheck"]:
    hooks.append(loopkit.NanCheckHook())
  hooks.append(loopkit.LoggingHook(writer, every_steps=s["log_every"]))
  if cell["eval"] != "none":
    evaluator, state_fn = m.evaluators()[cell["eval"]]
    hooks.append(eval_hook(evaluator, state_fn, m.eval_batches, writer=writer,
                           every_steps=s["eval_every"]))
  ckpt = None
  if cell["checkpoint"]:
    ckpt = loopkit.CheckpointHook(os.path.join(wd, "ckpt"), every_steps=s["ckpt_every"])
    hooks.append(ckpt)
  if cell["progress"]:
    hooks.append(loopkit.ProgressHook())
  if cell["goodput"]:
    hooks.append(loopkit.observe.GoodputHook(writer, workdir=wd))
  if cell["profiler"]:
    hooks.append(loopkit.observe.ProfilerHook(wd, start_step=s["profile_from"],
                                              num_steps=s["profile_steps"]))
  if cell["callback"]:
    hooks.append(loopkit.CallbackHook(record_callback(os.path.join(wd, "callback.txt"),
                                                      m.state_step),
                                      every_steps=s["callback_every"], at_end=False))
  ending, phase = cell["ending"], cell["phase"]
  if phase == "first" and ending != "complete":
    def end(info, state):
      del state
      if ending == "raise":
        raise Boom(f"the matrix's hook raises at step {info.end_step}")
      if ending == "sigint":  # as a Ctrl-C would
        os.kill(os.getpid(), signal.SIGINT)
      else:  # sigkill: right after the checkpoint of this step is on disk
        ckpt.wait_until_finished()
        os.kill(os.getpid(), signal.SIGKILL)
    hooks.append(loopkit.CallbackHook(end, at_steps=[s[ending + "_at"]], at_end=False))
  loop = m.loop(cell["k"], hooks)
  final = m.run(loop, s["steps"])
  out = {"status": loop.status, "step": loop.ledger.step, "digest": digest(final),
         "restored_step": None if ckpt is None else ckpt.restored_step,
         "tensorflow": "tensorflow" in sys.modules}
  with open(os.path.join(wd, f"result-{phase}.json"), "w") as f:
    json.dump(out, f)


def reference(cell) -> None:
  """Straight runs, one per (loop, K) of ``cell["refs"]``: rows, evaluations of every
  evaluator kind, checkpoint steps, callback firings, the final state's digest."""
  s, wd = cell["schedule"], cell["workdir"]
  out = {}
  for name, k in cell["refs"]:
    m = MODELS[name](s["steps"])
    key = f"{name}/{k}"
    log_hook = loopkit.LoggingHook(every_steps=s["log_every"])
    evals = {}
    for kind, (ev, fn) in m.evaluators().items():  # NnxEvaluator: the form that works on 0.2.0
      evals[kind] = (ev.hook(m.eval_batches, every_steps=s["eval_every"]) if kind == "nnx"
                     else eval_hook(ev, fn, m.eval_batches, every_steps=s["eval_every"]))
    ckpt = loopkit.CheckpointHook(os.path.join(wd, key.replace("/", "-")),
                                  every_steps=s["ckpt_every"])
    calls = os.path.join(wd, key.replace("/", "-") + ".callback.txt")
    callback = loopkit.CallbackHook(record_callback(calls, m.state_step),
                                    every_steps=s["callback_every"], at_end=False)
    loop = m.loop(k, [log_hook, *evals.values(), ckpt, callback])
    final = m.run(loop, s["steps"])
    ckpt.close()
    with open(calls) as f:
      fired = [list(map(int, line.split())) for line in f]
    out[key] = {
        "status": loop.status,
        "rows": [[step, scalars] for step, scalars in log_hook.records],
        "evals": {kind: [[step, r.metrics, r.num_examples] for step, r in h.results]
                  for kind, h in evals.items()},
        "checkpoints": ckpt.all_steps(), "callback": fired, "digest": digest(final)}
  with open(os.path.join(wd, "reference.json"), "w") as f:
    json.dump(out, f)


if __name__ == "__main__":
  if CELL.get("mode") == "reference":
    reference(CELL)
  elif SETUP == "absl":
    app.run(lambda argv: main(CELL))
  else:
    main(CELL)
