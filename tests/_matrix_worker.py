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
checkpoint), the schedule (``schedule``: steps, every_* of each hook, the ending's step) and
the later factors: ``rewind`` (the batch of data step ``spike_at`` blows the loss up, finite
for the regression, NaN for the CNN, whose BatchNorm normalizes any scale away, and a
:class:`loopkit.checkpoint.LossSpikeHook` rewinds to checkpoint 6 and skips data steps
7..``spike_at + margin``), ``watchdog`` (a :class:`loopkit.observe.Watchdog` with generous
deadlines), ``tracker`` (``mlflow``: an :class:`loopkit.observe.MlflowWriter` on a file store
in ``workdir/mlruns`` beside the JSONL writer), ``tiers`` (2: ``keep_every_steps``, a permanent
tier beside the temporary one), ``warm`` (``CheckpointHook(init_from=WarmStart(...))`` of the
reference's own checkpoint, ``warm_from``; the test waits for it) and ``sidecar`` (the test starts
a ``mode: sidecar`` process beside the cell's).

Everything lives in ``workdir``: ``metrics.jsonl`` (rows, eval rows, goodput rows), ``ckpt/``,
``callback.txt`` (one line ``end_step state_step`` per firing), ``plugins/profile/``, and, when
``run`` returns, ``result-<phase>.json`` (status, step, restored step, the final state's digest,
whether TensorFlow was imported, the rewinds made as (spike step, restored step), the ledger's
skip ranges). An uncaught exception ends the script as it ends a user's.

``mode: reference`` instead trains every (loop, K, variant) of ``refs`` straight through
(logging, both evaluators where they apply, an evaluation at every step a cell may checkpoint,
checkpoints, the callback; variant ``warm``: from the warm start, ``skip``: given the range a
rewind skips) and writes ``reference.json`` (and ``warm-ready`` once the warm start's source,
the first runs' checkpoints, is on disk). ``mode: sidecar`` follows a cell's ``ckpt/`` with a
:class:`loopkit.tools.follower.CheckpointFollower` (rows in ``sidecar/metrics.jsonl``) until the
file ``sidecar-stop`` appears, then evaluates what is left and exits.

Not a test module itself.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import sys
import time

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


def clu_writer(path: str, extra=()):
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
                                        loopkit.observe.JsonlWriter(path), *extra])


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
    self.batches = toy.batches(steps + EXTRA_BATCHES, batch_size=8)
    self.eval_batches = toy.batches(3, batch_size=8, seed=7)
    self.eval_batches[-1] = {k: v[:5] for k, v in self.eval_batches[-1].items()}

  @staticmethod
  def eval_step(state, batch):
    pred = batch["x"] @ state["params"]["w"] + state["params"]["b"]
    return {"err": jnp.mean((pred - batch["y"]) ** 2, axis=-1)}  # [B]

  def spike(self, i: int) -> None:
    """Blows up data step ``i``'s loss (1-based): inputs x 100, a finite spike."""
    b = self.batches[i - 1]
    self.batches[i - 1] = {"x": b["x"] * 100, "y": b["y"]}

  def loop(self, k, hooks):
    return loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=k, hooks=hooks)

  @staticmethod
  def like():
    return toy.init_state()

  warm_select = "params"

  def evaluators(self):
    return {"evaluator": (loopkit.Evaluator(self.eval_step), None)}

  def run(self, loop, steps, skip_steps=None):
    return loop.run(toy.init_state(), self.batches, num_steps=steps, skip_steps=skip_steps)

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
    self.batches = nnx_models.batches(steps + EXTRA_BATCHES, batch_size=8)
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

  def spike(self, i: int) -> None:
    """Makes data step ``i``'s loss NaN (1-based): BatchNorm normalizes any finite scale away."""
    b = self.batches[i - 1]
    self.batches[i - 1] = {"image": np.full_like(b["image"], np.nan), "label": b["label"]}

  def like(self):
    return self.loop(1, []).state()

  warm_select = "model"

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

  def run(self, loop, steps, skip_steps=None):
    return loop.run(self.batches, num_steps=steps, skip_steps=skip_steps)

  @staticmethod
  def state_step(state) -> int:
    return int(state["optimizer"]["step"])


MODELS = {"train": TrainModel, "nnx": NnxModel}
EXTRA_BATCHES = 4  # past the 14 steps: what a rewind's skipped data steps take


def skip_range(s) -> list[int]:
  """The data steps a rewind at ``spike_at`` skips: after checkpoint 6 through the margin."""
  return [s["ckpt_every"] + 1, s["spike_at"] + s["spike_margin"]]


def checkpoint_hook(cell, directory):
  """The cell's CheckpointHook: one tier or two; a warm start from ``warm_from`` or none."""
  s, kw = cell["schedule"], {}
  if cell.get("tiers") == 2:
    kw["keep_every_steps"] = s["keep_every"]
  if cell.get("warm"):
    kw["init_from"] = loopkit.checkpoint.WarmStart(cell["warm_from"],
                                                   select=MODELS[cell["loop"]].warm_select)
  return loopkit.CheckpointHook(directory, every_steps=s["ckpt_every"], **kw)


def tracker(wd: str):
  """MLflow on a file store in ``wd/mlruns``, its run's id kept in ``wd``."""
  return loopkit.observe.MlflowWriter(tracking_uri="file://" + os.path.join(wd, "mlruns"),
                                      experiment="matrix", dir=wd)


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
  extra = [tracker(wd)] if cell["tracker"] == "mlflow" else []
  if cell["logging"] == "clu":
    writer = clu_writer(jsonl, extra)
  else:
    writer = loopkit.observe.create_default_writer(wd)  # TensorBoard, JSONL, console
    if extra:
      writer = loopkit.observe.MultiWriter([writer, *extra])
  if cell["rewind"]:
    m.spike(s["spike_at"])
  hooks = []
  if cell["watchdog"]:  # generous: it must not fire
    hooks.append(loopkit.observe.Watchdog(floor_secs=600.0, first_secs=3600.0, workdir=wd))
  if cell["nancheck"]:
    hooks.append(loopkit.NanCheckHook())
  hooks.append(loopkit.LoggingHook(writer, every_steps=s["log_every"]))
  if cell["eval"] != "none":
    evaluator, state_fn = m.evaluators()[cell["eval"]]
    hooks.append(eval_hook(evaluator, state_fn, m.eval_batches, writer=writer,
                           every_steps=s["eval_every"]))
  ckpt = None
  if cell["checkpoint"]:
    ckpt = checkpoint_hook(cell, os.path.join(wd, "ckpt"))
    hooks.append(ckpt)
  spikes = None
  if cell["rewind"]:
    spikes = loopkit.checkpoint.LossSpikeHook(ckpt, factor=10.0, window=3,
                                              margin=s["spike_margin"])
    hooks.append(spikes)
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
         "tensorflow": "tensorflow" in sys.modules,
         "rewinds": None if spikes is None else [[r["step"], r["restored_step"]]
                                                 for r in spikes.rewinds],
         "skip_steps": [list(r) for r in loop.ledger.skip_steps]}
  with open(os.path.join(wd, f"result-{phase}.json"), "w") as f:
    json.dump(out, f)


def reference(cell) -> None:
  """Straight runs, one per (loop, K, variant) of ``cell["refs"]``: rows, evaluations of every
  evaluator kind and at every step a cell may checkpoint, checkpoint steps, callback firings,
  the final state's digest. Variant ``warm``: from the warm start of the first runs'
  checkpoints (``warm-ready`` is written once they are on disk); ``skip``: given the range a
  rewind skips (the spiked batch in it)."""
  s, wd = cell["schedule"], cell["workdir"]
  out, sources = {}, set()
  for name, k, variant in cell["refs"]:
    if "warm" in variant:  # the source: the other reference process's first runs
      while not os.path.exists(os.path.join(wd, "warm-ready")):
        time.sleep(0.2)
    m = MODELS[name](s["steps"])
    key = f"{name}/{k}" + (f"/{variant}" if variant else "")
    tag = key.replace("/", "-")
    skip = None
    if "skip" in variant:
      m.spike(s["spike_at"])
      skip = [tuple(skip_range(s))]
    log_hook = loopkit.LoggingHook(every_steps=s["log_every"])
    evals = {}
    for kind, (ev, fn) in m.evaluators().items():  # NnxEvaluator: the form that works on 0.2.0
      evals[kind] = (ev.hook(m.eval_batches, every_steps=s["eval_every"]) if kind == "nnx"
                     else eval_hook(ev, fn, m.eval_batches, every_steps=s["eval_every"]))
    ev, fn = m.evaluators()["evaluator"]  # what a sidecar gives at each checkpoint's step
    at_saves = eval_hook(ev, fn, m.eval_batches, at_steps=s["save_steps"], at_end=False)
    ckpt = checkpoint_hook({**cell, "loop": name, "warm": "warm" in variant,
                            "warm_from": os.path.join(wd, f"{name}-1")},
                           os.path.join(wd, tag))
    calls = os.path.join(wd, tag + ".callback.txt")
    callback = loopkit.CallbackHook(record_callback(calls, m.state_step),
                                    every_steps=s["callback_every"], at_end=False)
    loop = m.loop(k, [log_hook, *evals.values(), at_saves, ckpt, callback])
    final = m.run(loop, s["steps"], skip_steps=skip)
    ckpt.close()
    with open(calls) as f:
      fired = [list(map(int, line.split())) for line in f]
    out[key] = {
        "status": loop.status,
        "rows": [[step, scalars] for step, scalars in log_hook.records],
        "evals": {kind: [[step, r.metrics, r.num_examples] for step, r in h.results]
                  for kind, h in evals.items()},
        "at_saves": [[step, r.metrics, r.num_examples] for step, r in at_saves.results],
        "checkpoints": ckpt.all_steps(), "callback": fired, "digest": digest(final)}
    if not variant and k == 1:
      sources.add(name)
      if sources == set(MODELS):
        open(os.path.join(wd, "warm-ready"), "a").close()
  with open(os.path.join(wd, cell["name"] + ".json"), "w") as f:
    json.dump(out, f)


def sidecar(cell) -> None:
  """Follows the cell's checkpoints beside its run: each new one evaluated once, with the
  evaluator of the in-run EvalHook, rows in ``sidecar/metrics.jsonl``."""
  from loopkit.tools.follower import CheckpointFollower
  s, wd = cell["schedule"], cell["workdir"]
  m = MODELS[cell["loop"]](s["steps"])
  ev, fn = m.evaluators()["evaluator"]
  out = os.path.join(wd, "sidecar")
  os.makedirs(out, exist_ok=True)
  writer = loopkit.observe.JsonlWriter(os.path.join(out, "metrics.jsonl"))
  follower = CheckpointFollower(os.path.join(wd, "ckpt"), m.like(), ev, m.eval_batches,
                                writer=writer, state_fn=fn,
                                progress_file=os.path.join(out, "progress.json"))
  stop = os.path.join(wd, "sidecar-stop")
  while True:
    done = os.path.exists(stop)
    follower.poll()
    if done:
      break
    time.sleep(0.2)
  writer.close()
  with open(os.path.join(out, "result.json"), "w") as f:
    json.dump({"steps": [step for step, _ in follower.results],
               "skipped": follower.skipped_steps}, f)


if __name__ == "__main__":
  if CELL.get("mode") == "reference":
    reference(CELL)
  elif CELL.get("mode") == "sidecar":
    sidecar(CELL)
  elif SETUP == "absl":
    app.run(lambda argv: main(CELL))
  else:
    main(CELL)
