"""loopkit.nnx: Flax MNIST's in-place NNX step (CNN with Dropout + BatchNorm + nnx.Rngs) through
NnxTrainLoop against the same step under its own per-step nnx.jit loop."""

import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import nnx_models
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from nnx_models import arrays, batches, make

import loopkit
import loopkit.nnx
from tests import bootstrap, toy

STEPS = 12
DATA = batches(STEPS)


@pytest.fixture(scope="module")
def reference():
  """Flax's own loop: one nnx.jit call per step, as in examples/mnist."""
  objs = make()
  for b in DATA:
    nnx_models.train_step(*objs[:3], b, objs[3])
  return objs


def _run(k, mesh, step=nnx_models.train_step, style="global", axis_name=None, **kw):
  objs = make(axis_name=axis_name)
  loop = loopkit.nnx.NnxTrainLoop(step, *objs[:3], extra=(objs[3],), iterations_per_loop=k,
                                  mesh=mesh, step_style=style, **kw)
  loop.run(DATA, num_steps=STEPS)
  return loop, objs


@pytest.mark.parametrize("k", [1, 3, 10])
def test_bitwise_equal_to_nnx_jit_loop_on_one_device(reference, k):
  loop, objs = _run(k, loopkit.data_parallel_mesh(devices=jax.devices()[:1]))
  got, want = arrays(objs), arrays(reference)
  assert len(got) == len(want) == 21  # 6 params, 4 BN, 6 momenta, step, 4 metric sums
  for a, b in zip(got, want):
    np.testing.assert_array_equal(a, b)
  assert loop.ledger.step == int(objs[1].step[...]) == STEPS
  assert loop.program.compile_count() == 1 and loop.program.trace_count == 1
  assert loop.status == "completed"
  # The user's objects are alive and hold the result (the state given to the device was a copy).
  assert objs[2].compute()["accuracy"] == reference[2].compute()["accuracy"]
  assert int(objs[2].accuracy.count[...]) == STEPS * 16
  np.asarray(objs[0].conv1.kernel[...])


@pytest.mark.parametrize("k", [1, 3, 10])
def test_allclose_to_nnx_jit_loop_on_eight_devices(reference, k):
  _, objs = _run(k, loopkit.data_parallel_mesh())
  for a, b in zip(arrays(objs), arrays(reference)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert int(objs[2].accuracy.count[...]) == STEPS * 16


@pytest.fixture(scope="module")
def per_device_reference():
  """The per-device step (BatchNorm axis_name='data', grads pmean'd) per step under nnx.jit."""
  mesh = loopkit.data_parallel_mesh()
  objs = make(axis_name="data")

  @nnx.jit
  def step(model, optimizer, metrics, batch, rngs):
    nnx.shard_map(nnx_models.per_device_train_step, mesh=mesh,
                  in_specs=(P(), P(), P(), P("data"), P()), out_specs=None,
                  check_vma=False)(model, optimizer, metrics, batch, rngs)

  for b in DATA:
    step(*objs[:3], b, objs[3])
  return objs


@pytest.mark.parametrize("k", [1, 3, 10])
def test_per_device_with_batchnorm_axis_name(per_device_reference, k):
  loop, objs = _run(k, loopkit.data_parallel_mesh(), step=nnx_models.per_device_train_step,
                    style="per_device", axis_name="data")
  # model, optimizer and rngs: bitwise equal to nnx.shard_map under nnx.jit, step by step
  # (the reference's metrics are device 0's only: NnxTrainLoop sums the devices').
  ref = per_device_reference
  for a, b in zip(arrays((objs[0], objs[1], objs[3])), arrays((ref[0], ref[1], ref[3]))):
    np.testing.assert_array_equal(a, b)
  assert int(objs[2].accuracy.count[...]) == STEPS * 16  # all 8 devices' examples
  assert int(objs[2].loss.count[...]) == STEPS * 8  # 8 device means per step
  # One trace (one XLA compile per jax_log_compiles); compile_count() reads 2 here: jit's C++
  # dispatch cache keeps a second entry for a per_device state with a typed key (nnx.Rngs).
  assert loop.program.trace_count == 1


def test_metrics_logged_per_call_are_exact_means():
  seen = []
  hook = loopkit.CallbackHook(lambda info, s: seen.append(info.metric_values), needs_state=False,
                              every_steps=4)
  _, objs = _run(4, loopkit.data_parallel_mesh(devices=jax.devices()[:1]), hooks=[hook])
  assert len(seen) == 3
  total = sum(float(m["accuracy"].total) for m in seen)
  count = sum(float(m["accuracy"].count) for m in seen)
  assert count == STEPS * 16
  assert total == float(objs[2].accuracy.total[...])  # correct predictions, exactly


@pytest.fixture(scope="module")
def clean_arrays():
  """The objects' arrays at steps 3, 5 and 10 of a run without error (K = 1, 8 devices)."""
  objs = make()
  loop = loopkit.nnx.NnxTrainLoop(nnx_models.train_step, *objs[:3], extra=(objs[3],),
                                  iterations_per_loop=1)
  out, done = {}, 0
  for step in (3, 5, 10):
    loop.run(DATA[done:step], num_steps=step)
    out[step], done = arrays(objs), step
  return out


def assert_arrays_equal(got, want):
  assert len(got) == len(want) == 21
  for a, b in zip(got, want):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("k, kept", [(1, 5), (3, 3)])  # the chunk of step 6 is never dispatched
def test_c43_objects_hold_the_last_completed_boundary_when_run_raises(clean_arrays, k, kept):
  objs = make()
  loop = loopkit.nnx.NnxTrainLoop(nnx_models.train_step, *objs[:3], extra=(objs[3],),
                                  iterations_per_loop=k)
  bad = list(DATA[:10])
  bad[5] = {"image": DATA[5]["image"][:, :4], "label": DATA[5]["label"]}
  with pytest.raises(ValueError, match=r"step 6 .*leaf image has shape \(16, 4, 8, 1\)"):
    loop.run(bad, num_steps=10)
  # Flax's own loop would keep these steps too: the objects hold step `kept`, as the ledger.
  assert int(objs[1].step[...]) == loop.ledger.step == kept
  assert_arrays_equal(arrays(objs), clean_arrays[kept])  # live arrays: not donated
  loop.run(DATA[kept:10], num_steps=10)  # and they go on to the result of a run without error
  assert_arrays_equal(arrays(objs), clean_arrays[10])
  # A run refused before it takes the objects' state leaves them as they are.
  objs[0].linear1.bias[...] = 7.0
  with pytest.raises(ValueError, match="num_steps"):
    loop.run(DATA, num_steps=-1)
  np.testing.assert_array_equal(objs[0].linear1.bias[...], np.full(10, 7.0, np.float32))


def test_c43_objects_keep_their_values_when_the_device_call_fails():
  def fail(step):
    if int(step) == 4:
      raise RuntimeError("device failure at 4")

  def step(model, optimizer, metrics, batch, rngs):
    jax.debug.callback(fail, optimizer.step[...] + 1)
    nnx_models.train_step(model, optimizer, metrics, batch, rngs)

  objs = make()
  before = arrays(objs)
  loop = loopkit.nnx.NnxTrainLoop(step, *objs[:3], extra=(objs[3],), iterations_per_loop=1,
                                  mesh=loopkit.data_parallel_mesh(devices=jax.devices()[:1]))
  with pytest.raises(jax.errors.JaxRuntimeError, match="device failure at 4"):
    loop.run(DATA, num_steps=6)
  # The state of step 3 went into the failed call (donated): the objects keep their values
  # (their own arrays, never donated) rather than take unreadable ones.
  assert loop.ledger.step == 3 and loop.loop.last_state is None
  assert_arrays_equal(arrays(objs), before)


def test_c43_objects_keep_their_values_when_the_kept_state_is_unreadable(monkeypatch, caplog):
  # Where a failed call surfaces late (asynchronous dispatch), the kept state is readable only as
  # that call's error; the adapter then leaves the objects as they were and says so.
  objs = make()
  before = arrays(objs)
  loop = loopkit.nnx.NnxTrainLoop(nnx_models.train_step, *objs[:3], extra=(objs[3],),
                                  iterations_per_loop=1,
                                  mesh=loopkit.data_parallel_mesh(devices=jax.devices()[:1]))
  bad = DATA[:2] + [{"image": DATA[2]["image"][:, :4], "label": DATA[2]["label"]}]

  def unreadable(tree):
    raise RuntimeError("INTERNAL: the call failed")

  monkeypatch.setattr(loopkit.nnx.jax, "block_until_ready", unreadable)
  with pytest.raises(ValueError, match="step 3"):
    loop.run(bad, num_steps=4)
  assert "the state at step 2 is not readable (RuntimeError: INTERNAL" in caplog.text
  assert_arrays_equal(arrays(objs), before)


def test_second_run_continues_and_sees_reset_metrics(reference):
  objs = make()
  loop = loopkit.nnx.NnxTrainLoop(nnx_models.train_step, *objs[:3], extra=(objs[3],),
                                  iterations_per_loop=5,
                                  mesh=loopkit.data_parallel_mesh(devices=jax.devices()[:1]))
  loop.run(DATA[:7], num_steps=7)
  objs[2].reset()
  loop.run(DATA[7:], num_steps=STEPS)
  for a, b in zip(arrays(objs[:2]), arrays(reference[:2])):
    np.testing.assert_array_equal(a, b)
  assert int(objs[2].accuracy.count[...]) == 5 * 16
  assert loop.program.compile_count() == 1


def test_structure_change_is_named():
  objs = make()
  loop = loopkit.nnx.NnxTrainLoop(nnx_models.train_step, *objs[:3], extra=(objs[3],),
                                  iterations_per_loop=2)
  objs[0].eval()
  with pytest.raises(ValueError, match=r"model\.train\(\)"):
    loop.run(DATA, num_steps=2)


WORKER = Path(__file__).parent / "_nnx_worker.py"


def _worker(*args, check=True, cache_dir=None):
  """Runs tests/_nnx_worker.py; ``cache_dir``: JAX's persistent compilation cache, shared by
  the workers of one test (the resumed worker loads the killed one's programs; the
  executables, so the results, are the same)."""
  env = bootstrap.env()  # the worker sets its own device count (bootstrap.start)
  if cache_dir is not None:
    env.update(toy.compilation_cache_env(cache_dir))
  out = subprocess.run([sys.executable, str(WORKER), *args], capture_output=True, text=True,
                       env=env, timeout=600)
  if check:
    assert out.returncode == 0, out.stderr[-3000:]
  return out


def test_kill_and_resume_in_a_fresh_process_is_bitwise(tmp_path, reference):
  ckpt, cache = tmp_path / "ckpt", tmp_path / "jax_cache"
  killed = _worker("--out", str(tmp_path / "a"), "--dir", str(ckpt), "--kill-at", "6",
                   check=False, cache_dir=cache)
  assert killed.returncode == -9, killed.stderr[-3000:]
  _worker("--out", str(tmp_path / "b"), "--dir", str(ckpt), cache_dir=cache)
  info = json.loads((tmp_path / "b.json").read_text())
  assert info == {"status": "completed", "step": 12, "optimizer_step": 12, "restored_step": 6}
  # Against Flax's own uninterrupted nnx.jit loop (this process, 1 device as in the workers).
  got, want = np.load(str(tmp_path / "b.npz")), arrays(reference)
  assert len(got.files) == len(want) == 21
  for i, w in enumerate(want):
    np.testing.assert_array_equal(got[f"arr_{i}"], w)


# -- C65: NNX mistakes named ---------------------------------------------------------------


@nnx.jit
def _update_twice(model, optimizer, metrics, batch, rngs):
  _, grads = nnx.value_and_grad(nnx_models.loss_fn, has_aux=True)(model, batch, rngs)
  optimizer.update(model, grads)
  optimizer.update(model, grads)


@nnx.jit
def _never_update(model, optimizer, metrics, batch, rngs):
  loss, logits = nnx_models.loss_fn(model, batch, rngs)
  metrics.update(loss=loss, logits=logits, labels=batch["label"])


ONCE = ("train_step must call optimizer.update(model, grads) exactly once per step "
        "(optimizer.step is the loop's step counter)")


@pytest.mark.parametrize("step,counter,what", [
    (_update_twice, 20, "train_step calls optimizer.update 2 times per step; " + ONCE
     + "; to accumulate gradients over microbatches, see loopkit.core.accumulation.accumulate "
       "or optax.MultiSteps"),
    (_never_update, 0, "train_step never called optimizer.update(model, grads); " + ONCE),
], ids=["twice", "never"])
def test_c65_optimizer_update_not_once_per_step_is_named(step, counter, what):
  objs = make()
  loop = loopkit.nnx.NnxTrainLoop(step, *objs[:3], extra=(objs[3],), iterations_per_loop=10,
                                  mesh=loopkit.data_parallel_mesh(devices=jax.devices()[:1]))
  with pytest.raises(loopkit.core.StepCounterError) as e:
    loop.run(batches(10), num_steps=10)
  assert str(e.value) == (f"optimizer.step is {counter} after device call 0 (steps 1..10, so "
                          f"10 was expected): {what}")
  assert (e.value.counter, e.value.start_step, e.value.end_step) == (counter, 0, 10)


def test_c65_nnx_objects_given_to_train_loop_are_refused_before_they_are_donated():
  model, optimizer, metrics, rngs = make()
  before = arrays((model, optimizer))
  loop = loopkit.TrainLoop(lambda s, b: (s, {}), iterations_per_loop=2)
  use = (r"use loopkit\.nnx\.NnxTrainLoop\(train_step, model, optimizer, metrics, "
         r"iterations_per_loop=\.\.\.\)")
  for state, what in [(model, "CNN"), (optimizer, "Optimizer"), ((model, optimizer), "CNN at 0"),
                      ({"params": nnx.state(model), "rngs": rngs}, "Rngs at rngs")]:
    with pytest.raises(TypeError, match=re.escape(
        f"the train state is (or holds) a Flax NNX object, {what}: TrainLoop runs a pure "
        "train_step(state, batch) -> (state, metrics)") + ".*" + use):
      loop.run(state, iter(batches(2)), num_steps=2)
  for a, b in zip(arrays((model, optimizer)), before):  # nothing donated, nothing changed
    np.testing.assert_array_equal(a, b)
  # A pure nnx.State is a pytree TrainLoop takes; without a step it names step_of and NnxTrainLoop.
  with pytest.raises(ValueError, match=re.escape(
      "the train state has no step counter: give it a scalar int `step` field (attribute or "
      "dict key) or pass step_of=... to TrainLoop; this is a Flax NNX State: its counter is the "
      "nnx.Optimizer's step (e.g. step_of=lambda s: s['optimizer']['step']), or train the NNX "
      "objects with their in-place step as they are: loopkit.nnx.NnxTrainLoop(")):
    loop.run(nnx.state(model), iter(batches(2)), num_steps=2)


def test_c65_a_model_in_eval_mode_when_the_loop_is_built_warns():
  objs = make()
  objs[0].eval()
  with pytest.warns(loopkit.nnx.EvalModeWarning) as w:
    loopkit.nnx.NnxTrainLoop(nnx_models.train_step, *objs[:3], extra=(objs[3],),
                             iterations_per_loop=2)
  assert len(w) == 1 and str(w[0].message).startswith(
      "NnxTrainLoop: the model is in inference mode, as after model.eval(): batch_norm1 "
      "(BatchNorm.use_running_average=True), dropout1 (Dropout.deterministic=True); its train "
      "steps would run with Dropout off and BatchNorm normalising by (and not updating) its "
      "running statistics. Call model.train() before building the NnxTrainLoop")
  assert w[0].filename == __file__  # points at the user's line
  objs[0].train()  # training mode, or a mix built on purpose: no warning
  frozen = make()
  frozen[0].batch_norm1.use_running_average = True  # frozen statistics, Dropout still on
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for o in (objs, frozen):
      loopkit.nnx.NnxTrainLoop(nnx_models.train_step, *o[:3], extra=(o[3],), iterations_per_loop=2)
