"""Case C50: every reported number is as exact as the parameters. LoggingHook rows (read back
from a JsonlWriter) and EvalHook totals are bitwise the same for K = 1, 3, 10, for every
built-in metric kind, a user's own kind and NNX's MultiMetric, on 1 and 8 devices."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import loopkit
import loopkit.nnx
from loopkit import metrics
from tests import toy
from tests.test_metrics import RootMeanSquare  # a user's kind: merge, compute, reduce_devices

STEPS = 24
EVERY = 8  # rows at 8, 16, 24: K = 3 and K = 10 divide neither
KS = (1, 3, 10)


def _every_kind(step):
  """The toy step, returning every built-in kind and the user's one (per device: local values)."""
  def wrapped(state, batch):
    state, m = step(state, batch)
    x, loss = batch["x"], m["loss"]
    n = jnp.asarray(x.shape[0], jnp.float32)
    return state, {
        "loss": loss,  # a plain scalar: Mean(loss, 1)
        "mean": metrics.Mean.of(jnp.mean(x * x) * (1.0 + loss), n),
        "sum": metrics.Sum(jnp.sum(x) * 0.1 + loss),
        "last": metrics.Last(loss * 3.0),
        "max": metrics.Max(jnp.max(x) * loss),
        "rms": RootMeanSquare(jnp.sum(x * x) * loss, jnp.asarray(x.size, jnp.float32))}
  return wrapped


def _rows(path):
  return [json.loads(line) for line in path.read_text().splitlines()]


def _run_rows(tmp_path, k, style, devices, data):
  mesh = loopkit.data_parallel_mesh(devices=jax.devices()[:devices])
  step = toy.make_global_step() if style == "global" else toy.make_per_device_step()
  path = tmp_path / f"{style}{devices}k{k}.jsonl"
  writer = loopkit.observe.writers.JsonlWriter(path, flush_secs=0)
  hook = loopkit.LoggingHook(writer, every_steps=EVERY, throughput=False)
  loop = loopkit.TrainLoop(_every_kind(step), iterations_per_loop=k, mesh=mesh,
                           step_style=style, hooks=[hook])
  state = loop.run(toy.init_state(), data, num_steps=STEPS)
  return path.read_text(), state


@pytest.mark.parametrize("devices", [1, 8])
@pytest.mark.parametrize("style", ["global", "per_device"])
def test_rows_are_bitwise_equal_for_every_k(tmp_path, style, devices):
  data = toy.batches(STEPS)
  texts, states = {}, {}
  for k in KS:
    texts[k], states[k] = _run_rows(tmp_path, k, style, devices, data)
  for k in KS[1:]:
    toy.assert_bitwise(states[k], states[1])  # the parameters already were
  rows = {k: [json.loads(line) for line in t.splitlines()] for k, t in texts.items()}
  assert [r["step"] for r in rows[1]] == [8, 16, 24]
  names = ["last", "loss", "max", "mean", "rms", "sum"]
  assert all(sorted(set(r) - {"step", "epoch", "examples_seen"}) == names for r in rows[1])
  for k in KS[1:]:
    for want, got in zip(rows[1], rows[k], strict=True):
      diff = {n: (want[n], got[n]) for n in names if repr(want[n]) != repr(got[n])}
      assert not diff, f"K={k} row at step {want['step']} differs from K=1: {diff}"
    assert texts[k] == texts[1]  # the files, byte for byte


def test_one_call_of_100_steps_logs_the_row_of_100_calls(tmp_path):
  """Within a call: XLA:CPU sums a [100] trace vectorised, not in step order (C50)."""
  data = toy.batches(100)
  texts = {}
  for k in (1, 100):
    writer = loopkit.observe.writers.JsonlWriter(tmp_path / f"k{k}.jsonl", flush_secs=0)
    hook = loopkit.LoggingHook(writer, every_steps=100, throughput=False)
    loop = loopkit.TrainLoop(_every_kind(toy.make_global_step()), iterations_per_loop=k,
                             mesh=loopkit.data_parallel_mesh(devices=jax.devices()[:1]),
                             hooks=[hook])
    loop.run(toy.init_state(), data, num_steps=100)
    texts[k] = (tmp_path / f"k{k}.jsonl").read_text()
  assert len(texts[1].splitlines()) == 1
  assert texts[100] == texts[1]


@pytest.mark.parametrize("kind", ["Mean", "Sum", "Max", "Last", "RootMeanSquare"])
def test_fold_steps_is_the_merge_loop_in_step_order(kind):
  rng = np.random.default_rng(1)
  a, b = (rng.normal(size=1000) * 100).astype(np.float32), rng.random(1000).astype(np.float32)
  a[10] = -0.0  # Max of -0.0 and 0.0 depends on the order too
  steps = {"Mean": metrics.Mean(a, b), "Sum": metrics.Sum(a), "Max": metrics.Max(a),
           "Last": metrics.Last(a), "RootMeanSquare": RootMeanSquare(a, b)}[kind]
  at = lambda i: jax.tree.map(lambda x: np.asarray(x)[i], steps)  # noqa: E731
  want = at(0)
  for i in range(1, 1000):
    want = metrics.merge(want, at(i))
  got = metrics.fold_steps(steps)
  assert type(got) is type(want)
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert np.float32(x).tobytes() == np.float32(y).tobytes()
  # continuing a running value: the same as one fold over all the steps
  head = jax.tree.map(lambda x: x[:400], steps)
  tail = jax.tree.map(lambda x: x[400:], steps)
  again = metrics.fold_steps(tail, metrics.fold_steps(head))
  for x, y in zip(jax.tree.leaves(again), jax.tree.leaves(want), strict=True):
    assert np.float32(x).tobytes() == np.float32(y).tobytes()
  if kind in ("Mean", "Sum"):  # what the fold is not: numpy's pairwise sum
    assert np.sum(a) != np.float32(jax.tree.leaves(got)[0])


def test_fold_steps_refuses_another_kind():
  with pytest.raises(TypeError, match="cannot merge Sum with Mean"):
    metrics.fold_steps(metrics.Mean(np.ones(2, np.float32), np.ones(2, np.float32)),
                       metrics.Sum(np.float32(1)))


# -- Flax's NNX data-parallel toy example ---------------------------------------------------


class MLP(nnx.Module):
  """A two-layer regression MLP as in Flax's NNX toy examples: [B, 1] -> [B, 1]."""

  def __init__(self, rngs: nnx.Rngs):
    self.linear1 = nnx.Linear(1, 32, rngs=rngs)
    self.linear2 = nnx.Linear(32, 1, rngs=rngs)

  def __call__(self, x):
    return self.linear2(nnx.relu(self.linear1(x)))


def _nnx_loss(model, batch):
  return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def nnx_train_step(model, optimizer, metrics_, batch):
  loss, grads = nnx.value_and_grad(_nnx_loss)(model, batch)
  metrics_.update(loss=loss)
  optimizer.update(model, grads)
  return {"loss": loss}


def nnx_eval_step(model, metrics_, batch):
  metrics_.update(loss=_nnx_loss(model, batch))


def _nnx_batches(n, batch_size=16, seed=0):
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    x = rng.uniform(size=(batch_size, 1)).astype(np.float32)
    out.append({"x": x, "y": (0.8 * x ** 2 + 0.1
                              + rng.normal(0, 0.1, size=x.shape)).astype(np.float32)})
  return out


@pytest.mark.parametrize("devices", [1, 8])
def test_nnx_multimetric_rows_and_eval_totals_are_bitwise_equal_for_every_k(tmp_path, devices):
  data, eval_data = _nnx_batches(STEPS), _nnx_batches(5, batch_size=12, seed=1)
  mesh = loopkit.data_parallel_mesh(devices=jax.devices()[:devices])
  texts, params, totals = {}, {}, {}
  for k in KS:
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    train_metrics = nnx.MultiMetric(train_loss=nnx.metrics.Average("loss"))
    evaluator = loopkit.nnx.NnxEvaluator(
        nnx_eval_step, model, nnx.MultiMetric(loss=nnx.metrics.Average("loss")),
        iterations_per_loop=k, mesh=mesh)
    path = tmp_path / f"k{k}.jsonl"
    writer = loopkit.observe.writers.JsonlWriter(path, flush_secs=0)
    ev = evaluator.hook(eval_data, every_steps=EVERY, writer=writer)
    loop = loopkit.nnx.NnxTrainLoop(
        nnx_train_step, model, optimizer, train_metrics, iterations_per_loop=k, mesh=mesh,
        hooks=[loopkit.LoggingHook(writer, every_steps=EVERY, throughput=False), ev])
    loop.run(data, num_steps=STEPS)
    texts[k] = path.read_text()
    params[k] = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    totals[k] = [(s, r.totals) for s, r in ev.results]
  rows = [json.loads(line) for line in texts[1].splitlines()]
  assert [r["step"] for r in rows] == [8, 8, 16, 16, 24, 24]  # a train and an eval row each
  assert {"loss", "train_loss"} <= set(rows[0]) and "eval/loss" in rows[1]
  assert [s for s, _ in totals[1]] == [8, 16, 24]
  for k in KS[1:]:
    toy.assert_bitwise(params[k], params[1])
    assert totals[k] == totals[1]  # floats compared exactly
    assert texts[k] == texts[1], f"K={k}:\n{texts[k]}\nK=1:\n{texts[1]}"
