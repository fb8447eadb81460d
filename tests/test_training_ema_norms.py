"""The trainer kit's step metrics and averages: loopkit.norms and loopkit.ema (issue 39)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loopkit
from loopkit.training import ema, norms
from tests import toy

DATA = toy.batches(12)
DECAY = 0.9


def step_with_norms_and_ema(state, batch):
  loss, grads = jax.value_and_grad(toy.loss_fn)(state["params"], batch)
  updates, opt = toy.TX.update(grads, state["opt"], state["params"])
  params = optax.apply_updates(state["params"], updates)
  new = {"params": params, "opt": opt, "step": state["step"] + 1,
         "ema": ema.update(state["ema"], params, DECAY)}
  return new, {"loss": loss, **norms.norms(grads=grads, updates=updates)}


STEP = norms.with_norms(step_with_norms_and_ema, update_norm=False)  # adds param_norm


def init():
  s = toy.init_state()
  return {**s, "ema": ema.init(s["params"])}


class Traces(loopkit.Hook):
  """Every step's metric values, concatenated over the calls."""

  needs_state = False

  def __init__(self):
    super().__init__()
    self.steps = {}

  def after_each_call(self, info):
    for k, v in info.traces.items():
      self.steps[k] = np.concatenate([self.steps.get(k, np.zeros(0, np.float32)), v])


@pytest.fixture(scope="module")
def runs():
  out = {}
  params = []  # every step's parameters (K = 1: a boundary per step)
  keep = loopkit.CallbackHook(lambda info, s: params.append(jax.device_get(s["params"])))
  for k in (1, 4):
    traces, rows = Traces(), loopkit.LoggingHook(every_steps=6)
    hooks = [traces, rows] + ([keep] if k == 1 else [])
    loop = loopkit.TrainLoop(STEP, iterations_per_loop=k, hooks=hooks)
    out[k] = loop.run(init(), DATA, num_steps=12), traces.steps, rows.records, params
  return out


def test_norms_are_step_metrics_the_same_for_every_k(runs):
  (s1, t1, r1, _), (s4, t4, r4, _) = runs[1], runs[4]
  assert sorted(t1) == ["grad_norm", "loss", "param_norm", "update_norm"]
  assert r1 == r4 and [s for s, _ in r1] == [6, 12]  # the rows, bitwise
  for name in t1:
    assert t1[name].tobytes() == t4[name].tobytes(), name
  toy.assert_bitwise(s1, s4)


def test_norms_equal_a_hand_loop_and_optax(runs):
  _, traces, _, _ = runs[4]
  tree_norm = getattr(getattr(optax, "tree", None), "norm", None) or optax.global_norm
  state, one = init(), jax.jit(STEP)
  hand = {"grad_norm": [], "update_norm": [], "param_norm": []}
  for batch in DATA:
    state, m = one(state, batch)
    for name, values in hand.items():
      values.append(np.float32(m[name]))
  for name, values in hand.items():  # one step per jit call (XLA may fuse it otherwise)
    np.testing.assert_allclose(traces[name], values, rtol=1e-6, err_msg=name)
  tree = {"a": jnp.ones(3), "b": jnp.full((2,), 2.0)}
  assert float(norms.global_norm(tree)) == float(tree_norm(tree)) == np.sqrt(np.float32(11))


def test_ema_in_the_state_is_exact_and_swapped_in_for_evaluation(runs):
  s4, params = runs[4][0], runs[1][3]
  # the average by hand over the loop's own parameters of every step, one update per call
  assert len(params) == 12
  avg, one = init()["params"], jax.jit(ema.update, static_argnums=2)
  for p in params:
    avg = one(avg, p, DECAY)
  d, by_numpy = np.float32(DECAY), jax.tree.map(np.asarray, init()["params"])
  for p in params:  # the formula in numpy float32 (to rounding: XLA may contract to an FMA)
    by_numpy = jax.tree.map(lambda e, x: d * e + (np.float32(1) - d) * x, by_numpy, p)
  for name in ("w", "b"):
    np.testing.assert_allclose(s4["ema"][name], by_numpy[name], rtol=1e-6, atol=1e-7)
  toy.assert_bitwise(s4["ema"], avg)
  assert not np.array_equal(s4["ema"]["w"], s4["params"]["w"])

  def eval_step(st, batch):
    pred = batch["x"] @ st["params"]["w"] + st["params"]["b"]
    return {"mse": jnp.mean((pred - batch["y"]) ** 2, axis=-1)}
  evaluator = loopkit.Evaluator(eval_step)
  plain = loopkit.EvalHook(evaluator, DATA[:2], every_steps=6)
  averaged = loopkit.EvalHook(evaluator, DATA[:2], every_steps=6, prefix="eval_ema",
                              state_fn=ema.swapped())
  loop = loopkit.TrainLoop(STEP, iterations_per_loop=4, hooks=[plain, averaged])
  out = loop.run(init(), DATA, num_steps=12)
  want = evaluator.evaluate({**out, "params": out["ema"]}, DATA[:2]).metrics["mse"]
  assert averaged.results[-1][1].metrics["mse"] == want != plain.results[-1][1].metrics["mse"]
  with pytest.raises(TypeError, match=r"no 'params' and 'average'"):
    ema.swapped(ema="average")({"params": 1})


def test_with_norms_refuses_a_name_the_step_has():
  step = norms.with_norms(lambda s, b: (s, {"param_norm": 0.0}))
  with pytest.raises(ValueError, match=r"already hold \['param_norm'\]; pass param_norm=False"):
    step({"params": jnp.ones(2)}, None)
