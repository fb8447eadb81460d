"""Exact evaluation: C15, C18 (eval tail), C27 (equal eval steps), counts on 1/2/8 devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import loopkit
from loopkit.data.sources import batch_arrays, eval_batches_per_process, shard_for_process
from loopkit.evaluation import EvalHook, EvalResult, Evaluator, evaluate
from tests import toy
from tests.test_k_invariance import _data, _Net, _while_body


def mesh_of(n):
  return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])


def accuracy_step(state, batch):
  """Per-example correctness and a value that is NaN on padded rows (valid == 0)."""
  correct = (batch["pred"] == batch["label"]).astype(jnp.float32)
  x = batch["x"].astype(jnp.float32) * state["w"]
  nan_if_padding = jnp.where(batch["valid"] > 0, x, jnp.nan)
  return {"accuracy": correct, "x": nan_if_padding}


def c15_batches():
  out, start = [], 0
  for size, correct in zip([4, 4, 2], [4, 0, 2], strict=True):
    label = np.zeros(size, np.int32)
    pred = np.where(np.arange(size) < correct, 0, 1).astype(np.int32)
    out.append({"pred": pred, "label": label, "x": np.arange(start, start + size, dtype=np.int32),
                "valid": np.ones(size, np.int32)})
    start += size
  return out


STATE = {"w": jnp.float32(2.0)}


@pytest.mark.parametrize("style", ["global", "per_device"])
@pytest.mark.parametrize("ndev", [1, 2])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_c15_per_example_weighting(ndev, style, k):
  ev = Evaluator(accuracy_step, iterations_per_loop=k, mesh=mesh_of(ndev), step_style=style)
  r = ev.evaluate(STATE, c15_batches())
  assert r.metrics["accuracy"] == 0.6  # the mean of batch means would be 0.667
  assert r.num_examples == 10 and r.totals["accuracy"] == 6.0
  assert r.totals["x"] == 2.0 * sum(range(10))  # padded NaN rows never count
  assert r.num_batches == 3 and r.num_calls == -(-3 // k)
  assert ev.compile_count() == 1


def test_c18_batch_not_divisible_raises_naming_numbers():
  with pytest.raises(ValueError, match=r"global batch size 12 .* data-parallel size 8"):
    Evaluator(accuracy_step, mesh=mesh_of(8), global_batch_size=12)
  with pytest.raises(ValueError, match=r"global batch size 12 .* data-parallel size 8"):
    loopkit.TrainLoop(lambda s, b: (s, {}), iterations_per_loop=2, mesh=mesh_of(8),
                      global_batch_size=12)


def _examples(n, correct_every=3):
  """Examples 0..n-1; example i is correct iff i % correct_every == 0."""
  ids = np.arange(n, dtype=np.int32)
  return {"pred": (ids % correct_every != 0).astype(np.int32), "label": np.zeros(n, np.int32),
          "x": ids, "valid": np.ones(n, np.int32)}


def test_c18_eval_tail_one_padded_batch_compiled_once():
  ev = Evaluator(accuracy_step, iterations_per_loop=4, mesh=mesh_of(8), global_batch_size=16)
  r = ev.evaluate(STATE, batch_arrays(_examples(10), 16))
  assert r.num_batches == 1 and r.num_calls == 1
  assert r.num_examples == 10  # the mask sums to 10
  assert r.totals["accuracy"] == 4.0 and r.metrics["accuracy"] == 0.4  # ids 0, 3, 6, 9
  assert ev.compile_count() == 1 and ev.trace_count == 1
  r2 = ev.evaluate(STATE, batch_arrays(_examples(37), 16))  # 3 batches, last one short
  assert (r2.num_examples, r2.num_batches) == (37, 3)
  assert ev.compile_count() == 1 and ev.trace_count == 1


ANNOUNCED = ("evaluation: waiting for the first batches, then compiling the eval program "
             "({}, 4 per device call)")


@pytest.mark.parametrize("batch_size,said", [(16, "batch 16"),
                                             (None, "its batch size from the first batch")])
def test_the_first_evaluation_says_what_it_waits_for_before_it_waits(caplog, batch_size, said):
  """C70: an evaluator's first call waits for its first batches (a pipeline starting) and its
  compile: one line says so before the first batch is read and before the compile; a second
  evaluation says nothing."""
  ev = Evaluator(accuracy_step, iterations_per_loop=4, mesh=mesh_of(8),
                 global_batch_size=batch_size)
  seen_at_first_batch = []

  def source(n):
    for i, batch in enumerate(batch_arrays(_examples(n), 16)):
      if i == 0:
        seen_at_first_batch.append((list(caplog.messages), ev.compile_count()))
      yield batch

  with caplog.at_level("INFO", logger="loopkit"):
    first = ev.evaluate(STATE, source(37))
    ev.evaluate(STATE, source(10))
  said = ANNOUNCED.format(said)
  assert seen_at_first_batch == [([said], 0), ([said], 1)]
  assert caplog.messages == [said]
  assert (first.num_examples, ev.compile_count()) == (37, 1)


@pytest.mark.parametrize("style", ["global", "per_device"])
@pytest.mark.parametrize("ndev", [1, 2, 8])
def test_eval_counts_exact_on_1_2_8_devices(ndev, style):
  n = 37
  ev = Evaluator(accuracy_step, iterations_per_loop=3, mesh=mesh_of(ndev), step_style=style,
                 global_batch_size=8)
  r = ev.evaluate(STATE, batch_arrays(_examples(n), 8))
  assert r.num_examples == n and r.num_batches == 5 and r.num_calls == 2
  assert r.totals["accuracy"] == float(sum(i % 3 == 0 for i in range(n))) == 13.0
  assert r.totals["x"] == 2.0 * sum(range(n))
  assert r.metrics["accuracy"] == 13.0 / 37


def test_inferred_batch_size_rounds_up_to_devices():
  ev = Evaluator(accuracy_step, mesh=mesh_of(8))
  r = ev.evaluate(STATE, batch_arrays(_examples(10), 10))
  assert ev.global_batch_size == 16 and r.num_examples == 10


def test_c27_equal_eval_steps_per_process_simulated():
  """10 examples over 4 processes, global batch 8: every process runs 2 batches."""
  data = _examples(10)
  n = eval_batches_per_process(10, 8, 4)
  results = []
  for p in range(4):
    shard = shard_for_process(data, p, 4)
    # the process-local part of the global batch: 8 / 4 = 2 rows, on 2 local devices
    ev = Evaluator(accuracy_step, iterations_per_loop=3, mesh=mesh_of(2), global_batch_size=2)
    results.append(ev.evaluate(STATE, batch_arrays(shard, 2), num_batches=n))
  assert [r.num_batches for r in results] == [2, 2, 2, 2]  # nobody waits at a collective
  assert [r.num_calls for r in results] == [1, 1, 1, 1]
  assert [r.num_examples for r in results] == [3, 3, 2, 2]
  assert sum(r.totals["accuracy"] for r in results) == 4.0  # ids 0, 3, 6, 9
  assert sum(r.totals["x"] for r in results) == 2.0 * sum(range(10))


def test_num_batches_pads_with_empty_batches_and_rejects_excess():
  ev = Evaluator(accuracy_step, iterations_per_loop=2, mesh=mesh_of(2), global_batch_size=4)
  r = ev.evaluate(STATE, batch_arrays(_examples(5), 4), num_batches=5)
  assert (r.num_batches, r.num_calls, r.num_examples) == (5, 3, 5)
  with pytest.raises(ValueError, match="outnumber num_batches=1"):
    ev.evaluate(STATE, batch_arrays(_examples(5), 4), num_batches=1)


def test_errors():
  ev = Evaluator(accuracy_step, mesh=mesh_of(2), global_batch_size=4)
  with pytest.raises(ValueError, match="6 examples on this process, more than the static batch"):
    ev.evaluate(STATE, [_examples(6)])

  def mean_step(state, batch):
    return {"accuracy": jnp.mean((batch["pred"] == batch["label"]).astype(jnp.float32))}

  with pytest.raises(ValueError, match="'accuracy' has shape \\(\\); it must be per-example"):
    Evaluator(mean_step, mesh=mesh_of(2)).evaluate(STATE, c15_batches())

  def failing():
    yield _examples(4)
    raise RuntimeError("eval source broke")

  with pytest.raises(RuntimeError, match="eval source broke"):
    ev.evaluate(STATE, failing())


def test_evaluate_function():
  r = evaluate(accuracy_step, STATE, c15_batches(), mesh=mesh_of(2), iterations_per_loop=2)
  assert r.metrics["accuracy"] == 0.6 and r.num_examples == 10


# -- EvalHook from a TrainLoop ----------------------------------------------------


def train_step(state, batch):
  return {"step": state["step"] + 1, "w": state["w"] + 1.0}, {"w": state["w"]}


def _train_batches(n):
  return [{"u": np.zeros(2, np.float32)} for _ in range(n)]


def test_eval_hook_every_steps_and_at_end():
  mesh = mesh_of(2)
  ev = Evaluator(accuracy_step, iterations_per_loop=2, mesh=mesh, global_batch_size=4)
  data = _examples(10)
  hook = EvalHook(ev, lambda: batch_arrays(data, 4), every_steps=4)
  loop = loopkit.TrainLoop(train_step, iterations_per_loop=3, mesh=mesh, hooks=[hook])
  loop.run({"step": jnp.zeros((), jnp.int32), "w": jnp.float32(0.0)}, _train_batches(10),
           num_steps=10)
  assert [s for s, _ in hook.results] == [4, 8, 10]
  for step, r in hook.results:  # the state at that step: w == step
    assert r.num_examples == 10 and r.totals["x"] == step * sum(range(10))
  assert ev.compile_count() == 1


def test_eval_hook_every_epoch_with_device_data():
  from loopkit.data.device_data import DeviceDataset

  mesh = mesh_of(2)
  ds = DeviceDataset({"u": np.zeros(20, np.float32)}, 4, mesh=mesh, seed=0)  # 5 steps/epoch
  ev = Evaluator(accuracy_step, iterations_per_loop=4, mesh=mesh, global_batch_size=4)
  eval_batches = list(batch_arrays(_examples(10), 4))  # a list: re-iterable
  hook = EvalHook(ev, eval_batches, every_epochs=1, at_end=False)
  loop = loopkit.TrainLoop(ds.wrap_step(train_step), iterations_per_loop=3, mesh=mesh,
                           steps_per_epoch=ds.steps_per_epoch, hooks=[hook])
  loop.run(ds.attach({"step": jnp.zeros((), jnp.int32), "w": jnp.float32(0.0)}), ds,
           num_epochs=3)
  assert [s for s, _ in hook.results] == [5, 10, 15]
  assert [r.totals["x"] for _, r in hook.results] == [s * 45.0 for s in (5, 10, 15)]


def test_eval_hook_rejects_one_shot_iterator():
  ev = Evaluator(accuracy_step, mesh=mesh_of(2), global_batch_size=4)
  with pytest.raises(ValueError, match="re-iterable"):
    EvalHook(ev, iter(c15_batches()), every_steps=2)


# -- at_end is the end of training, not a preemption (NEW-B, tests/test_matrix.py) -----------


def _toy_eval_step(state, batch):
  return {"err": (batch["x"] @ state["params"]["w"] - batch["y"])[:, 0] ** 2}  # [B]


def _eval_run(workdir, k, *, num_steps=16, batches=16, extra=(), eval_kw=None):
  """toy.py's model, 16 steps, an EvalHook every 7 steps (at_end by default) writing to
  ``workdir/metrics.jsonl`` and checkpoints every 6: ``(loop, eval hook, checkpoint hook)``."""
  ev = EvalHook(Evaluator(_toy_eval_step), toy.batches(3, seed=7),
                writer=loopkit.observe.JsonlWriter(workdir / "metrics.jsonl"), every_steps=7,
                **(eval_kw or {}))
  ckpt = loopkit.CheckpointHook(workdir / "ckpt", every_steps=6, async_save=False)
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=k,
                           hooks=[ev, ckpt, *extra])
  loop.run(toy.init_state(), toy.batches(batches), num_steps=num_steps)
  ev.writer.close()
  return loop, ev, ckpt


def _jsonl(path):
  import json
  return [json.loads(line) for line in open(path)]


@pytest.mark.parametrize("k", [1, 3])
def test_eval_at_end_skips_a_sigint_and_the_resume_writes_the_straight_runs_rows(tmp_path, k):
  """NEW-B: Ctrl-C at step 9 stops the run there ("preempted", a checkpoint at 9) without an
  evaluation at 9, which an uninterrupted run does not have; the resumed run evaluates at 14
  and at its end, 16, and the file then holds the uninterrupted run's rows, values exact."""
  import os
  import signal

  (tmp_path / "straight").mkdir()
  (tmp_path / "cut").mkdir()
  _, straight, _ = _eval_run(tmp_path / "straight", k)
  assert [s for s, _ in straight.results] == [7, 14, 16]

  def ctrl_c(info, state):
    del info, state
    os.kill(os.getpid(), signal.SIGINT)

  sigint = loopkit.CallbackHook(ctrl_c, at_steps=[9], at_end=False)
  loop, cut, ckpt = _eval_run(tmp_path / "cut", k, extra=[sigint])
  assert (loop.status, loop.ledger.step) == ("preempted", 9)
  assert [s for s, _ in cut.results] == [7]  # not 9: a preemption is not training's end
  assert ckpt.all_steps() == [6, 9]  # the checkpoint still lands at the preemption
  loop, resumed, ckpt = _eval_run(tmp_path / "cut", k)
  assert (loop.status, ckpt.restored_step) == ("completed", 9)
  assert [s for s, _ in resumed.results] == [14, 16]
  rows = _jsonl(tmp_path / "cut" / "metrics.jsonl")
  assert [r["step"] for r in rows] == [7, 14, 16]
  assert rows == _jsonl(tmp_path / "straight" / "metrics.jsonl")


def test_eval_at_end_evaluates_where_training_ends_early(tmp_path):
  """A stop a hook requests (early stopping) and the end of the data end training: the at_end
  evaluation runs there, once. ``at_end=False``: only the marks."""
  (tmp_path / "stop").mkdir()
  (tmp_path / "data").mkdir()
  (tmp_path / "marks").mkdir()
  class EarlyStop(loopkit.Hook):  # needs_state (the default): it runs before the next call

    def on_run_start(self, ctx, state):
      self.ctx = ctx

    def on_trigger(self, info, state):
      self.ctx.request_stop("early stop")

  loop, ev, _ = _eval_run(tmp_path / "stop", 3, extra=[EarlyStop(at_steps=[9], at_end=False)])
  assert (loop.status, loop.ledger.step) == ("early stop", 9)
  assert [s for s, _ in ev.results] == [7, 9]
  with pytest.warns(loopkit.DataExhaustedWarning):
    loop, ev, _ = _eval_run(tmp_path / "data", 3, batches=10)
  assert (loop.status, [s for s, _ in ev.results]) == ("data_exhausted", [7, 10])
  _, ev, _ = _eval_run(tmp_path / "marks", 3, eval_kw={"at_end": False})
  assert [s for s, _ in ev.results] == [7, 14]


# -- K = 1 compiles the eval step like every K (the training program's loop) ---------------


def _half_precision_eval(dtype, style):
  """The C38 net (tests/test_k_invariance.py) as an eval step: per-example loss in ``dtype``."""
  model = _Net(dtype, "data" if style == "per_device" else None)
  variables = model.init(jax.random.key(0), jnp.ones((1, 8, 8, 3), dtype))

  def eval_step(state, batch):
    logits, _ = model.apply(state, batch["x"], mutable=["batch_stats"])
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return {"loss": -jnp.take_along_axis(logp, batch["y"][:, None], axis=1)[:, 0]}

  return variables, eval_step, _data(dtype)


@pytest.mark.parametrize("style", ["global", "per_device"])
def test_eval_k1_totals_bitwise_equal_k2_k3_in_float16(style):
  """Every batch's eval step sees only state and batch (both loop-invariant at K = 1), so a
  K = 1 loop without the slot padding hoists the whole step; with it totals agree bitwise."""
  state, eval_step, data = _half_precision_eval(jnp.float16, style)
  totals = {}
  for k in (1, 2, 3):
    ev = Evaluator(eval_step, iterations_per_loop=k, step_style=style, prefetch=0)
    result = ev.evaluate(state, data)
    assert result.num_examples == 256 * len(data) and ev.compile_count() == 1
    totals[k] = result.totals["loss"]
  assert totals[1] == totals[2] == totals[3]


def test_eval_k1_compiles_the_same_loop_body_as_k2():
  state, eval_step, data = _half_precision_eval(jnp.float16, "per_device")
  bodies = []
  for k in (1, 2):
    ev = Evaluator(eval_step, iterations_per_loop=k, step_style="per_device",
                   global_batch_size=256)
    chunk = {"batch": jax.tree.map(lambda x, k=k: np.stack([x] * k), data[0]),
             "mask": np.ones((k, 256), bool)}
    bodies.append(_while_body(ev.lower(state, chunk).compile().as_text()))
  assert len(bodies[0]) > 30  # the eval step is in there
  assert bodies[0] == bodies[1]


# -- C56: what EvalHook takes is checked when it is built -------------------------------------


class _BatchesFirst:
  """An evaluator whose evaluate takes the batches first (NnxEvaluator's form, without
  for_eval_hook)."""

  def evaluate(self, batches, *, state=None):
    return {}


class _OwnEvaluator:
  """A user's evaluator in EvalHook's form: evaluate(state, batches, *, num_batches=None)."""

  def __init__(self):
    self.states = []

  def evaluate(self, state, batches, *, num_batches=None):
    self.states.append(int(state["step"]))
    n = sum(len(b["x"]) for b in batches)
    return EvalResult({"n": float(n)}, {"n": float(n)}, n, len(batches), 1)


@pytest.mark.parametrize("kind,match", [
    ("function", r"EvalHook got the function eval_step, not an evaluator: wrap an eval step "
                 r"that returns per-example values as EvalHook\(loopkit\.Evaluator\(eval_step\)"),
    ("class", r"EvalHook got the class Evaluator, not an evaluator: pass an instance"),
    ("batches_first", r"EvalHook calls evaluator\.evaluate\(state, batches, num_batches=\.\.\.\) "
                      r"at each firing, which _BatchesFirst\.evaluate\(batches, \*, state=None\) "
                      r"does not accept"),
    ("no_evaluate", r"EvalHook got a dict, which has no evaluate\(state, batches, \*, "
                    r"num_batches=None\) method"),
])
def test_c56_a_value_that_is_not_an_evaluator_is_refused_when_the_hook_is_built(kind, match):
  def eval_step(state, batch):
    return {"x": batch["x"]}
  value = {"function": eval_step, "class": Evaluator, "batches_first": _BatchesFirst(),
           "no_evaluate": {"evaluate": 1}}[kind]
  with pytest.raises(TypeError, match=match):
    EvalHook(value, [{"x": np.zeros((2, 1), np.float32)}], every_epochs=1)


def test_c56_a_users_evaluator_in_evalhooks_form_is_called_at_each_firing():
  own = _OwnEvaluator()
  hook = EvalHook(own, [{"x": np.zeros((3, 1), np.float32)}], every_steps=2)
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=3, hooks=[hook])
  loop.run(toy.init_state(), toy.batches(4), num_steps=4)
  assert own.states == [2, 4] and [(s, r.metrics) for s, r in hook.results] == [
      (2, {"n": 3.0}), (4, {"n": 3.0})]
