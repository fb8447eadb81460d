"""Evaluation in the users' shape: batch-mean eval steps and nnx.MultiMetric eval steps give the
exact per-example mean over the whole set, padding excluded (C15, C18), on 1 and 8 devices."""

import jax
import jax.numpy as jnp
import nnx_models
import numpy as np
import optax
import pytest
from flax import nnx

import loopkit
import loopkit.nnx

N, B = 37, 8  # 5 batches, the last one 5 examples: padded by 3 rows


@pytest.fixture(scope="module")
def data():
  rng = np.random.default_rng(1)
  x = rng.normal(size=(N, 8, 8, 1)).astype(np.float32)
  y = rng.integers(0, 10, N).astype(np.int32)
  return x, y, [{"image": x[i:i + B], "label": y[i:i + B]} for i in range(0, N, B)]


@pytest.fixture(scope="module")
def model_and_exact(data):
  x, y, _ = data
  model, _, metrics, _ = nnx_models.make()
  model.eval()
  logits = np.asarray(model(x, None))
  loss = np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, y), np.float64)
  return model, metrics, {"loss": loss.mean(), "correct": int(np.sum(logits.argmax(-1) == y))}


MESHES = {"1": lambda: loopkit.data_parallel_mesh(devices=jax.devices()[:1]),
          "8": lambda: loopkit.data_parallel_mesh()}


@pytest.mark.parametrize("devices", ["1", "8"])
def test_nnx_multimetric_eval_step_is_exact(data, model_and_exact, devices):
  model, metrics, exact = model_and_exact
  ev = loopkit.nnx.NnxEvaluator(nnx_models.eval_step, model, metrics, iterations_per_loop=2,
                                mesh=MESHES[devices]())
  got = ev.evaluate(data[2])
  assert int(metrics.accuracy.count[...]) == int(metrics.loss.count[...]) == N
  assert float(metrics.accuracy.total[...]) == exact["correct"]
  assert float(got["accuracy"]) == np.float32(exact["correct"] / N)
  np.testing.assert_allclose(float(got["loss"]), exact["loss"], rtol=1e-6)
  assert ev.last.num_batches == 5 and ev.last.num_calls == 3
  ev.evaluate(data[2][:2])  # a second set: same executable, totals replaced
  assert int(metrics.accuracy.count[...]) == 2 * B and ev.compile_count() == 1


@pytest.mark.parametrize("style,devices", [("global", "1"), ("global", "8"),
                                           ("per_device", "8")])
def test_batch_mean_eval_step_is_exact(data, model_and_exact, style, devices):
  model, _, exact = model_and_exact
  graphdef, state = nnx.split(model)

  def eval_step(state, batch):  # Flax's linen-style eval step: batch means
    logits = nnx.merge(graphdef, state)(batch["image"], None)
    return {"loss": optax.softmax_cross_entropy_with_integer_labels(
                logits, batch["label"]).mean(),
            "accuracy": jnp.mean(logits.argmax(-1) == batch["label"])}

  ev = loopkit.Evaluator(loopkit.evaluation.per_example(eval_step), iterations_per_loop=2,
                         mesh=MESHES[devices](), step_style=style)
  r = ev.evaluate(state, data[2])
  assert r.num_examples == N
  assert r.totals["accuracy"] == exact["correct"]
  np.testing.assert_allclose(r.metrics["loss"], exact["loss"], rtol=1e-6)
  # Without the wrapper the step's batch means are refused (they would count the padding).
  with pytest.raises(ValueError, match="per-example"):
    loopkit.Evaluator(eval_step, mesh=MESHES[devices](), step_style=style).evaluate(
        state, data[2])


def test_nnx_eval_hook_in_a_train_loop(data):
  model, optimizer, metrics, rngs = nnx_models.make()
  eval_metrics = nnx_models.make()[2]
  ev = loopkit.nnx.NnxEvaluator(nnx_models.eval_step, model, eval_metrics,
                                iterations_per_loop=2)
  hook = ev.hook(data[2], every_steps=4)
  loop = loopkit.nnx.NnxTrainLoop(nnx_models.train_step, model, optimizer, metrics,
                                  extra=(rngs,), iterations_per_loop=3, hooks=[hook])
  loop.run(nnx_models.batches(8), num_steps=8)
  assert [s for s, _ in hook.results] == [4, 8]
  assert all(r.num_examples == N for _, r in hook.results)
  model.eval()  # the hook evaluated in inference mode without switching the user's model
  want = loopkit.nnx.NnxEvaluator(nnx_models.eval_step, model, eval_metrics).evaluate(data[2])
  assert hook.results[-1][1].metrics == {k: float(v) for k, v in want.items()}


# -- C48: evaluation in train mode ----------------------------------------------------------


class OwnRngs(nnx.Module):
  """BatchNorm and a Dropout holding its own nnx.Rngs (or none): [b, 8, 8, 1] -> [b, 10]."""

  def __init__(self, seed=0, dropout_rngs=True):
    rngs = nnx.Rngs(seed)
    self.linear1 = nnx.Linear(64, 16, rngs=rngs)
    self.bn = nnx.BatchNorm(16, rngs=rngs)
    self.dropout = nnx.Dropout(0.5, rngs=rngs if dropout_rngs else None)
    self.linear2 = nnx.Linear(16, 10, rngs=rngs)

  def __call__(self, x, rngs=None):
    x = nnx.relu(self.bn(self.linear1(x.reshape(x.shape[0], -1))))
    return self.linear2(self.dropout(x, rngs=rngs))


def _modes(model):
  return [(p, getattr(m, "use_running_average", None), getattr(m, "deterministic", None))
          for p, m in nnx.iter_modules(model)]


@pytest.mark.parametrize("make", ["own_rngs", "mnist_cnn"])
def test_c48_evaluation_runs_in_eval_mode_and_leaves_the_model_in_train_mode(data, make):
  model = OwnRngs() if make == "own_rngs" else nnx_models.make(seed=3)[0]
  model(data[0][:16], nnx.Rngs(5))  # a train-mode forward pass: BatchNorm's running stats move
  metrics = nnx_models.make()[2]
  modes = _modes(model)
  assert modes and all(m[1] in (False, None) and m[2] in (False, None) for m in modes)
  got = loopkit.nnx.NnxEvaluator(nnx_models.eval_step, model, metrics,
                                 iterations_per_loop=2).evaluate(data[2])
  assert _modes(model) == modes  # the user's model keeps its mode
  inference = nnx.clone(model)
  inference.eval()
  want = loopkit.nnx.NnxEvaluator(nnx_models.eval_step, inference, nnx_models.make()[2],
                                  iterations_per_loop=2).evaluate(data[2], eval_mode=False)
  assert {k: np.asarray(v) for k, v in got.items()} == {k: np.asarray(v) for k, v in want.items()}
  assert int(metrics.loss.count[...]) == N
  x, y, _ = data  # and that is the model.eval() forward pass over the whole set
  logits = np.asarray(inference(x, None))
  assert float(metrics.accuracy.total[...]) == int(np.sum(logits.argmax(-1) == y))
  np.testing.assert_allclose(float(got["loss"]), np.mean(np.asarray(
      optax.softmax_cross_entropy_with_integer_labels(logits, y), np.float64)), rtol=1e-6)
  assert abs(float(got["loss"]) - np.log(10)) > 1e-3  # not the train-mode constant ln 10
  # A model switched to eval mode stays so, and gives the same numbers.
  model.eval()
  again = loopkit.nnx.NnxEvaluator(nnx_models.eval_step, model,
                                   nnx_models.make()[2]).evaluate(data[2])
  assert {k: np.asarray(v) for k, v in again.items()} == {k: np.asarray(v)
                                                          for k, v in want.items()}
  assert all(m[1] in (True, None) and m[2] in (True, None) for m in _modes(model))


@pytest.mark.parametrize("make,named", [
    ("own_rngs", r"bn \(BatchNorm\) normalises with batch statistics"),
    ("mnist_cnn", r"batch_norm1 \(BatchNorm\) normalises with batch statistics"),
    ("dropout_without_rngs", r"dropout \(Dropout\) is in training mode and has no rngs")])
def test_c48_a_train_mode_evaluation_that_would_be_wrong_is_refused(data, make, named):
  if make == "mnist_cnn":
    model = nnx_models.make()[0]
  else:
    model = OwnRngs(dropout_rngs=make == "own_rngs")
    if make == "dropout_without_rngs":
      model.bn.use_running_average = True  # only the Dropout is in training mode
  ev = loopkit.nnx.NnxEvaluator(nnx_models.eval_step, model, nnx_models.make()[2])
  with pytest.raises(ValueError, match=named + r".*call model\.eval\(\) first, or evaluate "
                     r"with eval_mode=True"):
    ev.evaluate(data[2], eval_mode=False)
  assert ev.compile_count() == 0
  if make == "own_rngs":  # only BatchNorm in eval mode: Monte Carlo dropout is allowed
    model.bn.use_running_average = True
    got = ev.evaluate(data[2], eval_mode=False)
    assert int(ev.metrics.loss.count[...]) == N and np.isfinite(float(got["loss"]))
    assert model.dropout.deterministic is False


# -- C56: EvalHook(NnxEvaluator(...)) in an NnxTrainLoop ------------------------------------


def test_c56_eval_hook_of_an_nnx_evaluator_evaluates_each_epoch_and_its_checkpoint_is_written(
    data, tmp_path):
  """The docs' hook order (logging, eval, checkpoint), every_epochs=1, a CNN with BatchNorm and
  Dropout: each epoch's evaluation equals evaluating by hand the model Flax's own nnx.jit loop
  trained to that step, and each epoch's checkpoint is written."""
  mesh = loopkit.data_parallel_mesh(devices=jax.devices()[:1])  # bitwise vs the nnx.jit loop
  spe, train = 4, nnx_models.batches(8)
  model, optimizer, metrics, rngs = nnx_models.make()
  ev = loopkit.nnx.NnxEvaluator(nnx_models.eval_step, model, nnx_models.make()[2],
                                iterations_per_loop=2, mesh=mesh)
  log = loopkit.LoggingHook(every_epochs=1)
  evaluation = loopkit.EvalHook(ev, data[2], every_epochs=1)
  ckpt = loopkit.CheckpointHook(str(tmp_path / "ckpt"), every_epochs=1)
  loop = loopkit.nnx.NnxTrainLoop(nnx_models.train_step, model, optimizer, metrics,
                                  extra=(rngs,), iterations_per_loop=3, steps_per_epoch=spe,
                                  mesh=mesh, hooks=[log, evaluation, ckpt])
  loop.run(train, num_epochs=2)
  ckpt.close()
  assert [s for s, _ in evaluation.results] == [4, 8]
  assert ckpt.all_steps() == [4, 8] and [s for s, _ in log.records] == [4, 8]
  assert evaluation.evaluator is ev and all(r.num_examples == N for _, r in evaluation.results)

  by_hand = nnx_models.make()  # Flax's loop: one nnx.jit call per step, evaluated at 4 and 8
  for (step, result), epoch in zip(evaluation.results, (0, 1)):
    for b in train[epoch * spe:(epoch + 1) * spe]:
      nnx_models.train_step(*by_hand[:3], b, by_hand[3])
    values = ev.evaluate(data[2], state=nnx.to_pure_dict(nnx.state(by_hand[0])))
    want = {k: float(v) for k, v in values.items()}
    assert int(by_hand[1].step[...]) == step
    assert result.metrics == want, (step, result.metrics, want)
  assert evaluation.results[0][1].metrics != evaluation.results[1][1].metrics


def test_c56_nnx_evaluator_hook_is_the_same_eval_hook(data):
  model, _, _, _ = nnx_models.make()
  ev = loopkit.nnx.NnxEvaluator(nnx_models.eval_step, model, nnx_models.make()[2])
  hook = ev.hook(data[2], every_epochs=1, prefix="test")
  assert type(hook) is loopkit.EvalHook and hook.evaluator is ev and hook.prefix == "test"
  assert hook.state_fn({"model": "m", "optimizer": "o"}) == "m"


def test_c56_an_nnx_evaluator_in_a_plain_train_loop_is_refused_before_the_first_step(data):
  from tests import toy
  model = nnx_models.make()[0]
  hook = loopkit.EvalHook(loopkit.nnx.NnxEvaluator(nnx_models.eval_step, model,
                                                   nnx_models.make()[2]), data[2], every_steps=2)
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=2, hooks=[hook])
  with pytest.raises(TypeError, match=r"EvalHook\(NnxEvaluator\): its state_fn cannot take this "
                                      r"loop's train state \(KeyError: 'model'\); an NnxEvaluator "
                                      r"evaluates the 'model' part of an NnxTrainLoop's state"):
    loop.run(toy.init_state(), iter(toy.batches(4)), num_steps=4)
  assert loop.ledger.step == 0 and loop.ledger.loop_index == 0 and hook.results == []
