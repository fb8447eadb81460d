"""TrainLoop.run that raises: the work done survives in ``loop.last_state`` (case C43), and every
hook whose ``on_run_start`` was called gets ``on_run_error`` (issue #24 item 9)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import loopkit
from tests import toy

STEPS = 10
DATA = toy.batches(STEPS)


def mesh_of(devices):
  return loopkit.data_parallel_mesh(devices=jax.devices()[:devices])


def make_loop(k=3, style="global", devices=8, **kw):
  step = toy.make_global_step() if style == "global" else toy.make_per_device_step()
  return loopkit.TrainLoop(step, iterations_per_loop=k, step_style=style, mesh=mesh_of(devices),
                           **kw)


@functools.cache
def reference(style, devices):
  """The state after each step of one uninterrupted run (K = 1; K changes no bit), on the host."""
  states = {}

  def keep(info, state):
    states[info.end_step] = jax.device_get(state)

  make_loop(1, style, devices, hooks=[loopkit.CallbackHook(keep)]).run(
      toy.init_state(), DATA, num_steps=STEPS)
  return states


def clean(step, style="global", devices=8):
  """The state of an uninterrupted run at ``step``."""
  return reference(style, devices)[step]


def bad_at(step):
  """DATA with the batch of ``step`` (1-based) of another shape."""
  data = list(DATA)
  data[step - 1] = {"x": data[step - 1]["x"][:, :3], "y": data[step - 1]["y"]}
  return data


def assert_kept(loop, step, position=None, **config):
  """The loop kept the state of step ``step``: ledger, state and position agree, arrays live."""
  kept = loop.last_state
  assert not any(x.is_deleted() for x in jax.tree.leaves(kept))
  assert loop.ledger.step == int(kept["step"]) == step
  assert loop.data_position == (step if position is None else position)  # batches consumed
  toy.assert_bitwise(jax.device_get(kept), clean(step, **config))
  return kept


@pytest.mark.parametrize("style, devices", [("global", 8), ("per_device", 8), ("global", 1)])
@pytest.mark.parametrize("k, kept", [(1, 5), (3, 3)])  # the chunk of step 6 is never dispatched
def test_c43_a_bad_batch_keeps_the_last_completed_boundary(style, devices, k, kept):
  loop = make_loop(k, style, devices)
  with pytest.raises(ValueError, match=r"step 6 .*leaf x has shape \(16, 3\)"):
    loop.run(toy.init_state(), bad_at(6), num_steps=STEPS)
  state = assert_kept(loop, kept, style=style, devices=devices)
  # The kept state goes on: the rest of the data, bitwise the uninterrupted run, no recompile.
  final = loop.run(state, DATA[kept:], num_steps=STEPS)
  toy.assert_bitwise(jax.device_get(final), clean(STEPS, style, devices))
  assert loop.status == "completed" and loop.program.compile_count() == 1


class Raises(loopkit.Hook):
  """Raises in ``where`` (``after_each_call`` / ``on_trigger`` / ``on_run_end``) at ``at_steps``."""

  def __init__(self, where, needs_state=False, at_steps=(6,)):
    super().__init__(at_steps=at_steps, at_end=False)
    self.where, self.needs_state, self.steps = where, needs_state, at_steps

  def after_each_call(self, info):
    if self.where == "after_each_call" and info.end_step in self.steps:
      raise RuntimeError(f"after_each_call at {info.end_step}")

  def on_trigger(self, info, state):
    if self.where == "on_trigger":
      raise RuntimeError(f"on_trigger at {info.end_step}")

  def on_run_end(self, ctx, state):
    if self.where == "on_run_end":
      raise RuntimeError("on_run_end")


@pytest.mark.parametrize("where, needs_state, kept", [
    ("on_trigger", True, 6),  # the boundary of step 6 runs before the next dispatch
    ("on_trigger", False, 9),  # one call late: (6, 9] was dispatched, its state is the latest
    ("after_each_call", False, 9),
    ("on_run_end", False, STEPS),
])
def test_c43_a_hook_that_raises_keeps_the_latest_state(where, needs_state, kept):
  loop = make_loop(3, hooks=[Raises(where, needs_state)])  # calls end at 3, 6, 9, 10
  with pytest.raises(RuntimeError, match=where):
    loop.run(toy.init_state(), DATA, num_steps=STEPS)
  assert_kept(loop, kept)


def test_c43_a_step_indexed_source_goes_on_from_the_kept_state():
  source = loopkit.ArraySource(jax.tree.map(lambda *xs: np.concatenate(xs), *DATA),
                               global_batch_size=16, shuffle=False)  # batch s is DATA[s]
  loop = make_loop(3, hooks=[Raises("on_trigger")])
  with pytest.raises(RuntimeError, match="on_trigger at 6"):
    loop.run(toy.init_state(), source, num_steps=STEPS)
  # the position is the step (with what makes its batch): the source resumes there itself
  state = assert_kept(loop, 9, source.position_at(9))
  assert source.position_at(9)["array_step"] == 9
  final = loop.run(state, source, num_steps=STEPS)
  toy.assert_bitwise(jax.device_get(final), clean(STEPS))


def zero_params(state):
  return {**state, "params": jax.tree.map(jnp.zeros_like, state["params"])}


class ZeroParams(loopkit.Hook):
  """Returns the state with zero params from ``where`` (at step 6 for ``on_trigger``)."""

  def __init__(self, where):
    super().__init__(at_steps=[6], at_end=False)
    self.where = where

  def on_trigger(self, info, state):
    return zero_params(state) if self.where == "on_trigger" else None

  def on_run_end(self, ctx, state):
    return zero_params(state) if self.where == "on_run_end" else None


@pytest.mark.parametrize("where, kept", [("on_trigger", 6), ("on_run_end", STEPS)])
def test_c43_a_state_returned_by_a_hook_is_kept_when_a_later_hook_raises(where, kept):
  loop = make_loop(3, hooks=[ZeroParams(where), Raises(where, needs_state=True)])
  with pytest.raises(RuntimeError, match=where):
    loop.run(toy.init_state(), DATA, num_steps=STEPS)
  state = jax.device_get(loop.last_state)
  assert loop.ledger.step == int(state["step"]) == kept
  toy.assert_bitwise(state, zero_params(clean(kept)))


def source(exc, at_step):
  for i, b in enumerate(DATA):
    if i + 1 == at_step:
      raise exc
    yield b


@pytest.mark.parametrize("exc, k, kept, prefetch", [
    (RuntimeError("source"), 1, 5, 2), (RuntimeError("source"), 3, 3, 2),
    (KeyboardInterrupt(), 1, 5, 2), (KeyboardInterrupt(), 3, 3, 0)])
def test_c43_an_exception_from_the_source_keeps_the_last_completed_boundary(exc, k, kept,
                                                                            prefetch):
  # A KeyboardInterrupt raised by the source (not a preemption signal) is re-raised, also
  # from the prefetch thread.
  loop = make_loop(k, prefetch=prefetch)
  with pytest.raises(type(exc)):
    loop.run(toy.init_state(), source(exc, 6), num_steps=STEPS)
  assert_kept(loop, kept)


def test_c43_a_failed_device_call_leaves_no_state_to_read():
  # The call of step 6 fails on the host callback, after taking its donated input (the state of
  # step 5): nothing readable is left, and the loop says so with None, not deleted arrays.
  def fail(step):
    if int(step) == 6:
      raise RuntimeError("device failure at 6")

  def step(state, batch):
    jax.debug.callback(fail, state["step"] + 1)
    return toy.make_global_step()(state, batch)

  loop = loopkit.TrainLoop(step, iterations_per_loop=1, mesh=mesh_of(1))
  with pytest.raises(jax.errors.JaxRuntimeError, match="device failure at 6"):
    loop.run(toy.init_state(), DATA, num_steps=STEPS)
  assert loop.ledger.step == 5
  assert loop.last_state is None


def test_c43_a_run_refused_before_it_took_the_state_leaves_the_last_state():
  loop = make_loop(3)
  first = loop.run(toy.init_state(), DATA[:3], num_steps=3)
  with pytest.raises(ValueError, match="num_steps"):
    loop.run(first, DATA[3:], num_steps=-1)
  assert loop.last_state is first and loop.ledger.step == 3
  assert not any(x.is_deleted() for x in jax.tree.leaves(first))  # the state given is intact


class Records(loopkit.Hook):
  """Records its on_run_start / on_run_error calls; raises in ``raise_in``."""

  needs_state = False

  def __init__(self, name, calls, raise_in=None, returns=None):
    super().__init__(at_end=False)
    self.hook_name, self.calls, self.raise_in, self.returns = name, calls, raise_in, returns

  def on_run_start(self, ctx, state):
    self.calls.append((self.hook_name, "start"))
    if self.raise_in == "on_run_start":
      raise RuntimeError(f"{self.hook_name} cannot start")
    return self.returns

  def adjust_ledger(self, ctx):
    if self.raise_in == "adjust_ledger":
      raise RuntimeError(f"{self.hook_name} cannot adjust")

  def on_run_error(self, ctx, error):
    self.calls.append((self.hook_name, f"error: {error}"))


@pytest.mark.parametrize("restore", [True, False])
def test_on_run_error_reaches_the_hooks_started_before_an_on_run_start_raised(restore):
  calls = []
  if restore:  # the first hook restores step 4, as a checkpoint hook would
    want, step, position = clean(4), 4, 4
    returned = loopkit.core.Restore(want, loopkit.core.Ledger(step=4), position)
  else:  # the first hook edits the state before training
    want, step, position = zero_params(jax.device_get(toy.init_state())), 0, None
    returned = want
  hooks = [Records("a", calls, returns=returned), Records("b", calls, raise_in="on_run_start"),
           Records("c", calls)]
  loop = make_loop(3, hooks=hooks)
  with pytest.raises(RuntimeError, match="b cannot start"):
    loop.run(toy.init_state(), DATA, num_steps=STEPS)
  # a (started) and b (the one that raised) clean up; c never started.
  assert calls == [("a", "start"), ("b", "start"), ("a", "error: b cannot start"),
                   ("b", "error: b cannot start")]
  # No call was made: the work kept is the first hook's state, with its ledger and position.
  kept = jax.device_get(loop.last_state)
  assert loop.ledger.step == int(kept["step"]) == step and loop.data_position == position
  toy.assert_bitwise(kept, want)


def test_on_run_error_reaches_every_hook_after_every_on_run_start_returned():
  calls = []
  hooks = [Records("a", calls), Records("b", calls, raise_in="adjust_ledger")]
  with pytest.raises(RuntimeError, match="b cannot adjust"):
    make_loop(3, hooks=hooks).run(toy.init_state(), DATA, num_steps=STEPS)
  assert calls == [("a", "start"), ("b", "start"), ("a", "error: b cannot adjust"),
                   ("b", "error: b cannot adjust")]
