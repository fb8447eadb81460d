"""The trainer kit's plateau hooks: EarlyStopping and ReduceLROnPlateau (issue 39 item 3).

The eval metric is a table indexed by the state's step (``TABLE[step // 4]``), so the steps
the hooks act at are known exactly; the train step is tests/toy.py's linear model.
"""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loopkit
from loopkit.training.plateau import EarlyStopping, ReduceLROnPlateau
from loopkit.tools import testing
from tests import toy
from tests._kit_worker import EVERY, TABLE, kit_decisions, table_eval

DATA = toy.batches(48)
EVAL_BATCHES = [{"x": np.zeros((2, 4), np.float32)}]


def hooks(patience=3, min_delta=0.2, **kw):
  evals = loopkit.EvalHook(loopkit.Evaluator(table_eval), EVAL_BATCHES, every_steps=EVERY)
  stop = EarlyStopping(evals, "score", patience=patience, min_delta=min_delta, **kw)
  return evals, stop


@pytest.mark.parametrize("k", [3])  # 3 does not divide the evaluation period; compared to K = 4
def test_stops_at_the_patience_th_evaluation_without_improvement(k):
  evals, stop = hooks(restore_best=True)
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=k, hooks=[evals, stop])
  out = loop.run(toy.init_state(), DATA, num_steps=40)
  assert loop.status == "early stopped"
  assert loop.ledger.step == 20 and stop.stopped_step == 20
  assert [s for s, _ in evals.results] == [4, 8, 12, 16, 20]  # no evaluation after the stop
  assert stop.history == [(4, 5.0, True), (8, 4.0, True), (12, 4.5, False),
                          (16, pytest.approx(3.9), False), (20, pytest.approx(4.2), False)]
  assert (stop.best, stop.best_step, stop.wait) == (4.0, 8, 3)
  # restore_best: run returns the state of the best evaluation (step 8), bitwise
  straight = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4).run(
      toy.init_state(), DATA, num_steps=8)
  toy.assert_bitwise(out, straight)
  assert int(loop.last_state["step"]) == 8 and loop.program.compile_count() == 1


def test_min_delta_zero_counts_small_improvements_and_the_target_completes():
  evals, stop = hooks(min_delta=0.0)  # 3.9 < 4.0 improves: waits 12, then 16 resets
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4, hooks=[evals, stop])
  loop.run(toy.init_state(), DATA, num_steps=24)
  # waits: 12 -> 1, 16 -> 0 (3.9), 20 -> 1, 24 -> 2: patience 3 never reached
  assert loop.status == "completed" and stop.stopped_step is None
  assert [imp for _, _, imp in stop.history] == [True, True, False, True, False, False]
  evals, stop = hooks(patience=1, mode="max")  # max: 5.0 then 4.0 does not improve: stop at 8
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4, hooks=[evals, stop])
  loop.run(toy.init_state(), DATA, num_steps=8)
  assert loop.status == "completed" and stop.wait == 1  # the last boundary: the run completes


def test_resume_keeps_the_counters_and_a_rerun_stays_stopped(tmp_path):
  def make(preempt_at=None):
    evals = loopkit.EvalHook(loopkit.Evaluator(table_eval), EVAL_BATCHES, every_steps=EVERY)
    ckpt = loopkit.CheckpointHook(tmp_path, every_steps=EVERY)
    stop = EarlyStopping(evals, "score", patience=3, min_delta=0.2, restore_best=True,
                         checkpoint=ckpt)
    hs = [evals, stop, ckpt]
    loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4, hooks=hs)
    if preempt_at is not None:
      hs.append(loopkit.CallbackHook(lambda info, s: loop.preemption.request(),
                                     needs_state=False, at_steps=[preempt_at]))
      loop.hooks = hs
    return loop, stop
  best = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4).run(
      toy.init_state(), DATA, num_steps=8)
  loop, stop = make(preempt_at=12)
  out = loop.run(toy.init_state(), DATA, num_steps=40)
  assert loop.status == "preempted" and stop.wait == 1 and int(out["step"]) == 12  # not ended
  loop, stop = make()  # a new process: the counters come from the checkpoint at 12
  out = loop.run(toy.init_state(), DATA, num_steps=40)
  assert loop.status == "early stopped" and loop.ledger.step == 20
  assert stop.stopped_step == 20 and (stop.best, stop.best_step) == (4.0, 8)
  toy.assert_bitwise(out, best)  # the best state, read from the checkpoint of step 8
  loop, stop = make()  # the early-stopped run again: it trains no further
  loop.run(toy.init_state(), DATA, num_steps=40)
  assert loop.status == "early stopped" and loop.ledger.step == 20
  loop.hooks = [h for h in loop.hooks if not isinstance(h, loopkit.CheckpointHook)]
  out = loop.run(toy.init_state(), DATA, num_steps=40)  # a fresh state, no checkpoint: anew
  assert loop.status == "early stopped" and loop.ledger.step == 20 and stop.history[-1][0] == 20
  toy.assert_bitwise(out, best)  # the copy kept at step 8


def test_a_wall_clock_eval_hook_and_its_early_stopping_fire_together():
  """They share one Trigger: its clock is read once per boundary for both (a clock that moves
  at every read would otherwise let the EarlyStopping fire without an evaluation)."""
  from tests._kit_worker import CountingClock
  evals = loopkit.EvalHook(loopkit.Evaluator(table_eval), EVAL_BATCHES, every_secs=2.5,
                           at_end=False)
  evals.trigger.clock = CountingClock()
  stop = EarlyStopping(evals, "score", patience=3, min_delta=0.2)
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4, hooks=[evals, stop])
  loop.run(toy.init_state(), DATA, num_steps=24)
  assert [s for s, _ in evals.results] == [s for s, _, _ in stop.history] == [12, 24]


def test_refuses_bad_arguments_and_a_hook_before_its_eval_hook():
  evals, _ = hooks()
  with pytest.raises(ValueError, match=r"patience must be an int >= 1.*got 0"):
    EarlyStopping(evals, "score", patience=0)
  with pytest.raises(ValueError, match=r"mode must be 'min' or 'max', got 'auto'"):
    EarlyStopping(evals, "score", mode="auto")
  with pytest.raises(TypeError, match=r"pass the loopkit.EvalHook"):
    EarlyStopping(loopkit.LoggingHook(every_steps=4), "score")
  evals, stop = hooks()
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4, hooks=[stop, evals])
  with pytest.raises(RuntimeError, match=r"fired at step 4 .* put the EvalHook in the loop's "
                     r"hooks before the EarlyStopping"):
    loop.run(toy.init_state(), DATA, num_steps=8)
  evals = loopkit.EvalHook(loopkit.Evaluator(table_eval), EVAL_BATCHES, every_steps=EVERY)
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4,
                           hooks=[evals, EarlyStopping(evals, "loss")])
  with pytest.raises(KeyError, match=r"no metric 'loss' \(it has \['score'\]\)"):
    loop.run(toy.init_state(), DATA, num_steps=8)


INJECT = optax.inject_hyperparams(optax.adam)(learning_rate=0.05)


@pytest.mark.parametrize("k", [3])  # compared to K = 4 below
def test_reduce_on_plateau_lowers_the_rate_in_the_state_without_recompiling(k):
  evals = loopkit.EvalHook(loopkit.Evaluator(table_eval), EVAL_BATCHES, every_steps=EVERY)
  lower = ReduceLROnPlateau(evals, "score", factor=0.5, patience=2, min_delta=0.2, cooldown=2)
  loop = loopkit.TrainLoop(toy.make_global_step(INJECT), iterations_per_loop=k,
                           hooks=[evals, lower])
  out = loop.run(toy.init_state(tx=INJECT), DATA, num_steps=28)
  # 12: wait 1; 16: wait 2 -> 0.025, cooldown 2; 20: cooldown 1 left (not counted); 24: the
  # cooldown ends (Keras: the evaluation that ends it counts), wait 1; 28: 3.0 improves
  assert lower.reductions == [(16, pytest.approx(0.05), pytest.approx(0.025))]
  lr = out["opt"].hyperparams["learning_rate"]
  assert lr.dtype == jnp.float32 and float(lr) == np.float32(0.05) * np.float32(0.5)
  assert loop.program.compile_count() == 1
  # the same as a run that lowers the rate by hand at step 16
  state = loopkit.TrainLoop(toy.make_global_step(INJECT), iterations_per_loop=4).run(
      toy.init_state(tx=INJECT), DATA, num_steps=16)
  state["opt"].hyperparams["learning_rate"] = jnp.float32(0.025)
  state = loopkit.TrainLoop(toy.make_global_step(INJECT), iterations_per_loop=4).run(
      state, DATA[16:], num_steps=28)
  toy.assert_bitwise(out, state)


def test_reduce_on_plateau_needs_the_rate_in_the_state():
  evals = loopkit.EvalHook(loopkit.Evaluator(table_eval), EVAL_BATCHES, every_steps=EVERY)
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4,
                           hooks=[evals, ReduceLROnPlateau(evals, "score")])
  with pytest.raises(ValueError, match=r"exactly one optax.inject_hyperparams optimizer state "
                     r"with hyperparams\['learning_rate'\].*the state has 0"):
    loop.run(toy.init_state(), DATA, num_steps=8)


@pytest.mark.slow(
    held_by=("tests/test_multihost.py::"
             "test_a_stop_reason_requested_on_one_process_reads_the_same_on_every_process"),
    reason="two processes (17 s); the agreement that carries these stops is held by that test")
def test_two_processes_stop_together_at_a_time_limit_and_an_early_stop():
  """The budget runs out on process 1 only (its clock): both stop at step 6 (K = 2, the fourth
  boundary); the early stop is taken at step 20 on both (the evaluations sum over both)."""
  want = {"time_limit": ("time limit", 6), "early_stop": ("early stopped", 20, 8)}
  assert testing.run_processes(kit_decisions, num_processes=2, devices_per_process=2,
                               timeout_s=240) == [want, want]
  assert kit_decisions() == want  # one process: the same


def test_nnx_loop_lowers_the_rate_in_its_optimizer_and_hands_back_the_best_objects():
  """An NnxTrainLoop (Conv, BatchNorm, Dropout, Rngs; an nnx.Optimizer over an
  inject_hyperparams SGD): the rate is found in the optimizer's pure state and lowered at 12,
  16 and 20; the early stop at 20 gives the objects the state of step 8 back."""
  from flax import nnx

  from tests import nnx_models
  model = nnx_models.CNN(rngs=nnx.Rngs(0))
  tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
  evals = loopkit.EvalHook(loopkit.Evaluator(table_eval), EVAL_BATCHES, every_steps=EVERY,
                           state_fn=lambda s: {"step": s["optimizer"]["step"]})
  lower = ReduceLROnPlateau(evals, "score", factor=0.5, patience=1, min_delta=0.2)
  stop = EarlyStopping(evals, "score", patience=3, min_delta=0.2, restore_best=True)

  @nnx.jit
  def train_step(model, optimizer, metrics, batch, rngs):
    (loss, _), grads = nnx.value_and_grad(nnx_models.loss_fn, has_aux=True)(model, batch, rngs)
    metrics.update(loss=loss)
    optimizer.update(model, grads)

  loop = loopkit.nnx.NnxTrainLoop(train_step, model, optimizer, metrics, extra=(nnx.Rngs(1),),
                                  iterations_per_loop=4, hooks=[evals, lower, stop])
  loop.run(nnx_models.batches(24), num_steps=24)
  assert loop.status == "early stopped" and loop.ledger.step == 20
  assert [s for s, _, _ in lower.reductions] == [12, 16, 20]
  held = nnx.to_pure_dict(nnx.state(optimizer))
  assert int(held["step"]) == 8  # the objects hold the best evaluation's state
  assert float(held["opt_state"]["hyperparams"]["learning_rate"]) == np.float32(0.1)
  assert loop.program.compile_count() == 1
