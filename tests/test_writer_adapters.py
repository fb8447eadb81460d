"""The writers users already have: CLU's metric_writers and Flax's tensorboard.SummaryWriter, in
LoggingHook and EvalHook, read back from their TensorFlow event files."""

import glob
import json

import numpy as np
import pytest
import toy

import loopkit
from loopkit.observe import writers as writers_lib

pytestmark = pytest.mark.tf
tf = pytest.importorskip("tensorflow")  # collection imports this module even where deselected


def read_events(logdir):
  """{tag: [(step, value)]} from TF2 summary event files (tensor or simple values)."""
  out = {}
  for path in sorted(glob.glob(f"{logdir}/**/events.out.tfevents.*", recursive=True)):
    for event in tf.compat.v1.train.summary_iterator(path):
      for v in event.summary.value:
        value = (float(tf.make_ndarray(v.tensor)) if v.HasField("tensor")
                 else float(v.simple_value))
        out.setdefault(v.tag, []).append((event.step, value))
  return out


def _train_logging(writer, tmp_path):
  """toy run, 6 steps, K=4: LoggingHook with ``writer`` and a JsonlWriter twin, every 2 steps."""
  jsonl = tmp_path / "twin.jsonl"
  twin = writers_lib.JsonlWriter(jsonl)
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4,
                           hooks=[loopkit.LoggingHook(writer, every_steps=2),
                                  loopkit.LoggingHook(twin, every_steps=2)])
  loop.run(toy.init_state(), toy.batches(6), num_steps=6)
  twin.close()
  return [json.loads(line) for line in jsonl.read_text().splitlines()]


def test_flax_summary_writer(tmp_path):
  from flax.metrics import tensorboard
  writer = tensorboard.SummaryWriter(str(tmp_path / "flax"))
  assert isinstance(writers_lib.as_writer(writer), writers_lib.FlaxSummaryWriter)
  want = _train_logging(writer, tmp_path)
  writer.flush()
  got = read_events(tmp_path / "flax")
  assert [r["step"] for r in want] == [2, 4, 6]
  assert [s for s, _ in got["loss"]] == [2, 4, 6]
  np.testing.assert_array_equal([v for _, v in got["loss"]],
                                np.float32([r["loss"] for r in want]))


@pytest.mark.parametrize("asynchronous", [False, True])
def test_clu_metric_writers(tmp_path, asynchronous):
  metric_writers = pytest.importorskip("clu.metric_writers")
  writer = metric_writers.create_default_writer(str(tmp_path / "clu"),
                                                asynchronous=asynchronous)
  assert writers_lib.as_writer(writer) is writer  # CLU's interface is loopkit's
  want = _train_logging(writer, tmp_path)
  writer.close()
  got = read_events(tmp_path / "clu")
  assert [s for s, _ in got["loss"]] == [2, 4, 6]
  np.testing.assert_array_equal([v for _, v in got["loss"]],
                                np.float32([r["loss"] for r in want]))


def test_eval_hook_takes_flax_and_clu_writers(tmp_path):
  metric_writers = pytest.importorskip("clu.metric_writers")
  from flax.metrics import tensorboard
  flax_w = tensorboard.SummaryWriter(str(tmp_path / "flax"))
  clu_w = metric_writers.create_default_writer(str(tmp_path / "clu"), asynchronous=False)

  def eval_step(state, batch):
    return {"err": (batch["x"] @ state["params"]["w"] - batch["y"])[:, 0] ** 2}

  ev = loopkit.Evaluator(eval_step)
  hooks = [loopkit.EvalHook(ev, toy.batches(2), writer=w, every_steps=3) for w in (flax_w,
                                                                                 clu_w)]
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=2, hooks=hooks)
  loop.run(toy.init_state(), toy.batches(6), num_steps=6)
  flax_w.flush()
  clu_w.close()
  for d in ("flax", "clu"):
    got = read_events(tmp_path / d)
    assert [s for s, _ in got["eval/err"]] == [3, 6], d
    np.testing.assert_array_equal([v for _, v in got["eval/err"]],
                                  np.float32([r.metrics["err"] for _, r in hooks[0].results]))
    assert got["eval/num_examples"] == [(3, 32.0), (6, 32.0)]


def test_not_a_writer_is_refused_when_the_hook_is_built():
  with pytest.raises(TypeError, match=r"builtins\.object is not a metric writer"):
    loopkit.LoggingHook(object())
  with pytest.raises(TypeError, match="scalar\\(tag, value, step\\)"):
    loopkit.EvalHook(loopkit.Evaluator(lambda s, b: b), [], writer=42)
