"""Case C53: a run whose loss turns NaN does not end quietly. Without NanCheckHook it warns once,
naming the exact first non-finite step, for every K; NanCheckHook still raises there."""

import re
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

import loopkit
from tests import toy

STEPS = 20


def _data(nan_at=13):
  data = toy.batches(STEPS)
  if nan_at is not None:
    data[nan_at - 1] = {**data[nan_at - 1], "x": np.full_like(data[0]["x"], np.nan)}
  return data


def _run(k, hooks, data, step=None):
  loop = loopkit.TrainLoop(step or toy.make_global_step(), iterations_per_loop=k, hooks=hooks)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    state = loop.run(toy.init_state(), data, num_steps=STEPS)
  return loop, state, [w for w in caught if issubclass(w.category, loopkit.NonFiniteWarning)]


@pytest.mark.parametrize("hooks", ["none", "logging"])
@pytest.mark.parametrize("k", [1, 3, 10])
def test_a_nan_loss_warns_once_naming_its_first_step(k, hooks):
  loop, state, caught = _run(k, [] if hooks == "none" else [loopkit.LoggingHook()], _data())
  assert len(caught) == 1, [str(w.message) for w in caught]  # once per run, not per call
  msg = str(caught[0].message)
  assert "metric 'loss' is NaN or infinite at step 13, the first such step" in msg
  first, last = map(int, re.search(r"ran steps (\d+)\.\.(\d+)", msg).groups())
  assert first <= 13 <= last and last - first + 1 <= k
  assert "NanCheckHook" in msg
  assert loop.status == "completed" and loop.ledger.step == STEPS  # the run went on
  assert np.isnan(np.asarray(state["params"]["w"])).all()


@pytest.mark.parametrize("k", [1, 3, 10])
def test_the_first_metric_to_go_non_finite_is_named(k):
  def step(state, batch):  # 'ratio' is infinite at step 7 only, 'loss' NaN from 13 on
    new, m = toy.make_global_step()(state, batch)
    inf_at_7 = jnp.where(new["step"] == 7, jnp.inf, 1.0)
    return new, {**m, "ratio": loopkit.metrics.Max(inf_at_7)}

  _, _, caught = _run(k, [], _data(), step)
  assert len(caught) == 1
  assert "metric 'ratio' is NaN or infinite at step 7," in str(caught[0].message)


@pytest.mark.parametrize("k", [1, 3, 10])
def test_nan_check_hook_still_raises_at_the_first_step(k):
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=k,
                           hooks=[loopkit.NanCheckHook()])
  with warnings.catch_warnings():
    warnings.simplefilter("error", loopkit.NonFiniteWarning)  # the error comes first
    with pytest.raises(loopkit.NonFiniteError, match=r"'loss' is nan at step 13 "):
      loop.run(toy.init_state(), _data(), num_steps=STEPS)


def test_per_device_steps_warn_at_the_first_step_too():
  loop = loopkit.TrainLoop(toy.make_per_device_step(), iterations_per_loop=3,
                           step_style="per_device")
  with pytest.warns(loopkit.NonFiniteWarning, match="'loss' is NaN or infinite at step 13,"):
    loop.run(toy.init_state(), _data(), num_steps=STEPS)
  assert loop.status == "completed"


def test_a_finite_run_does_not_warn():
  for k in (1, 3):
    loop, _, caught = _run(k, [], _data(nan_at=None))
    assert caught == [] and loop.status == "completed"
