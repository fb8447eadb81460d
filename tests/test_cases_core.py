"""Cases C01-C04, C09, C10, C12, C14 and the first half of C18 from shared/cases/CASES.md."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loopkit
from loopkit.metrics import Sum
from tests import toy


class Recorder(loopkit.Hook):
  """Records (end step, state step, optimizer count) after each firing."""

  def __init__(self, **trigger):
    super().__init__(**trigger)
    self.seen = []
    self.lengths = []

  def after_each_call(self, info):
    self.lengths.append(info.num_steps)

  def on_trigger(self, info, state):
    self.seen.append((info.end_step, int(state["step"]), toy.opt_count(state)))


def test_c01_tail():
  rec = Recorder()
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4, hooks=[rec])
  state = loop.run(toy.init_state(), iter(toy.batches(10)), num_steps=10)
  assert rec.lengths == [4, 4, 2]
  assert rec.seen == [(4, 4, 4), (8, 8, 8), (10, 10, 10)]
  assert toy.opt_count(state) == 10 and loop.ledger.step == 10


def counting_step(state, batch):
  return {"step": state["step"] + 1}, {"x": jnp.mean(batch["x"])}


def test_c01_epochs():
  loop = loopkit.TrainLoop(counting_step, iterations_per_loop=1000, steps_per_epoch=1000,
                           prefetch=0)
  data = ({"x": np.zeros((8,), np.float32)} for _ in range(10800))
  loop.run({"step": jnp.zeros((), jnp.int32)}, data, num_steps=10800)
  assert loop.ledger.step == 10800
  assert loop.ledger.epoch == 10 and loop.ledger.step_in_epoch == 800
  assert loop.ledger.loop_index == 11


@pytest.mark.parametrize("n,every,expected_saves,expected_calls", [
    (32, 8, [8, 16, 24, 32], [4] * 8),
    (24, 6, [6, 12, 18, 24], [4, 2] * 4),
])
def test_c02_save_cadence(n, every, expected_saves, expected_calls):
  saves = Recorder(every_steps=every)
  calls = Recorder()
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4, hooks=[saves, calls])
  loop.run(toy.init_state(), iter(toy.batches(n)), num_steps=n)
  assert [s[0] for s in saves.seen] == expected_saves
  assert calls.lengths == expected_calls


@pytest.mark.parametrize("n,expected", [(50, [10, 20, 30, 40, 50]), (45, [10, 20, 30, 40, 45])])
def test_c03_reported_step_is_end_of_call(n, expected):
  rec = Recorder()
  log = loopkit.LoggingHook()
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=10, hooks=[rec, log])
  loop.run(toy.init_state(), iter(toy.batches(n)), num_steps=n)
  assert rec.seen == [(s, s, s) for s in expected]
  assert [step for step, _ in log.records] == expected


def test_c04_k_larger_than_epoch():
  per_epoch = loopkit.LoggingHook(every_epochs=1)
  rec = Recorder()
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=20, steps_per_epoch=5,
                           hooks=[per_epoch, rec])
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    loop.run(toy.init_state(), iter(toy.batches(10)), num_epochs=2)
  assert rec.lengths == [5, 5]
  assert [(s, r["epoch"]) for s, r in per_epoch.records] == [(5, 0), (10, 1)]
  assert loop.ledger.step == 10 and loop.status == "completed"


def lr_state_and_step():
  sched = optax.linear_schedule(1.0, 0.0, 10)
  tx = optax.sgd(sched)

  def step(state, batch):
    loss, g = jax.value_and_grad(toy.loss_fn)(state["params"], batch)
    u, opt = tx.update(g, state["opt"], state["params"])
    lr = sched(state["step"])
    return ({"params": optax.apply_updates(state["params"], u), "opt": opt,
             "step": state["step"] + 1}, {"lr": lr, "loss": loss})

  return toy.init_state(tx=tx), step


def test_c09_schedule_per_step():
  state, step = lr_state_and_step()
  lrs = []
  hook = loopkit.CallbackHook(lambda i, s: lrs.extend(i.traces["lr"]), needs_state=False)
  loop = loopkit.TrainLoop(step, iterations_per_loop=4, hooks=[hook])
  data = iter(toy.batches(10))
  state = loop.run(state, data, num_steps=6)
  state = loop.run(state, data, num_steps=10)
  np.testing.assert_allclose(lrs, [1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1], rtol=1e-6)
  assert int(optax.tree_utils.tree_get(state["opt"], "count")) == 10


def test_c10_no_retracing():
  def counted(traces):
    base = toy.make_global_step()

    def step(state, batch):
      traces.append(1)
      return base(state, batch)
    return step

  for k in [1, 5, 10]:
    traces = []
    step = counted(traces)
    loop = loopkit.TrainLoop(step, iterations_per_loop=k)
    data = iter(toy.batches(3 * k))
    state = toy.init_state()
    for call in range(3):
      state = loop.run(state, data, num_steps=(call + 1) * k)
    assert len(traces) == 1 and loop.program.compile_count() == 1
  traces = []
  loop = loopkit.TrainLoop(counted(traces), iterations_per_loop=4)
  state = loop.run(toy.init_state(), iter(toy.batches(10)), num_steps=10)  # tail of 2
  assert len(traces) == 1 and loop.program.compile_count() == 1
  for leaf, sh in zip(jax.tree.leaves(state), jax.tree.leaves(loop.program.state_shardings)):
    assert leaf.sharding == sh


@pytest.mark.parametrize("style", ["global", "per_device"])
def test_c12_low_precision_metrics(style):
  def step(state, batch):
    loss = jnp.ones((), jnp.bfloat16) + 0 * batch["x"].sum().astype(jnp.bfloat16)
    return {"step": state["step"] + 1}, {"loss": loss, "loss_sum": Sum(loss)}

  log = loopkit.LoggingHook(at_steps=[1000])
  loop = loopkit.TrainLoop(step, iterations_per_loop=100, hooks=[log], step_style=style)
  data = ({"x": np.ones((8, 2), np.float32)} for _ in range(1000))
  loop.run({"step": jnp.zeros((), jnp.int32)}, data, num_steps=1000)
  (step_at, rec), = log.records
  assert step_at == 1000
  expected_sum = 1000.0 if style == "global" else 8000.0  # per-device sums add over 8 devices
  assert rec["loss_sum"] == expected_sum
  assert rec["loss"] == 1.0


def dropout_program():
  """Per-device step that records every (step, device) dropout mask in the state."""
  def step(state, batch):
    key = loopkit.step_key(state["key"], state["step"], axis_name="data")
    mask = jax.random.bernoulli(key, 0.5, (32,))
    bits = jax.lax.all_gather(mask, "data")  # [8, 32], same on every device
    masks = state["masks"].at[state["step"]].set(bits)
    return (state | {"step": state["step"] + 1, "masks": masks},
            {"x": jnp.mean(batch["x"])})

  def init():
    return {"step": jnp.zeros((), jnp.int32), "key": jax.random.key_data(jax.random.key(7)),
            "masks": jnp.zeros((8, 8, 32), bool)}

  return step, init


def test_c14_dropout_keys():
  step, init = dropout_program()
  data = lambda: ({"x": np.ones((16, 2), np.float32)} for _ in range(8))
  loop = loopkit.TrainLoop(step, iterations_per_loop=4, step_style="per_device")
  a = np.asarray(loop.run(init(), data(), num_steps=8)["masks"])
  flat = a.reshape(64, 32)
  assert len({m.tobytes() for m in flat}) == 64  # all (device, step) masks distinct
  loop = loopkit.TrainLoop(step, iterations_per_loop=4, step_style="per_device")
  b = np.asarray(loop.run(init(), data(), num_steps=8)["masks"])
  np.testing.assert_array_equal(a, b)
  # "restore" at step 4 (a fresh loop from the step-4 state), then step 5
  loop = loopkit.TrainLoop(step, iterations_per_loop=4, step_style="per_device")
  mid = jax.device_get(loop.run(init(), data(), num_steps=4))
  loop2 = loopkit.TrainLoop(step, iterations_per_loop=1, step_style="per_device")
  c = np.asarray(loop2.run(mid, data(), num_steps=5)["masks"])
  np.testing.assert_array_equal(c[4], a[4])


def test_c18_divisibility_at_construction():
  with pytest.raises(ValueError, match=r"global batch size 12 is not divisible by the "
                                       r"data-parallel size 8"):
    loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4, global_batch_size=12)


def test_c18_divisibility_from_data():
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4)
  with pytest.raises(ValueError, match="global batch size 12 is not divisible by the "
                                       "data-parallel size 8"):
    loop.run(toy.init_state(), iter(toy.batches(4, batch_size=12)), num_steps=4)
