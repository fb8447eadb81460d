"""The loop/hook contract: hooks read a read-only context and return what they change.

Covers loopkit.core.context (Restore, LedgerAdjustment, RunContext), the
one epoch convention (loopkit.core.ledger.epoch_of) and the run object's named steps.
Hook names: tests/test_hook_state.py.
"""

import jax
import pytest

import loopkit
from loopkit.core.ledger import Bucket, Ledger, LedgerView, epoch_of
from tests import toy


def make_loop(hooks, k=4, **kw):
  return loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=k, hooks=hooks, **kw)


# -- the epoch convention ------------------------------------------------------------------


def test_one_epoch_convention_for_loop_info_and_ledger():
  """Step 20, 10 per epoch: epoch 1 with 10 steps done (LoopInfo's meaning), in both."""
  assert epoch_of(20, 10) == (1, 10)
  assert epoch_of(21, 10) == (2, 1)
  assert epoch_of(0, 10) == (0, 0)
  assert epoch_of(7, None) == (0, 7)
  led = Ledger(step=20, steps_per_epoch=10)
  assert (led.epoch, led.step_in_epoch) == (1, 10)
  assert led.to_dict()["epoch"] == 1 and led.to_dict()["step_in_epoch"] == 10
  seen = []
  hook = loopkit.CallbackHook(lambda i, s: seen.append((i.end_step, i.epoch, i.step_in_epoch)),
                              needs_state=False)
  loop = make_loop([hook], k=10, steps_per_epoch=10)
  loop.run(toy.init_state(), toy.batches(20), num_steps=20)
  assert seen == [(10, 0, 10), (20, 1, 10)]
  assert (loop.ledger.epoch, loop.ledger.step_in_epoch) == seen[-1][1:]


# -- the read-only context --------------------------------------------------------------------


class Writes(loopkit.Hook):
  """Tries to write run state the old way, in on_run_start."""

  needs_state = False

  def __init__(self, what):
    super().__init__()
    self.what = what

  def on_run_start(self, ctx, state):
    if self.what == "ledger":
      ctx.ledger = Ledger(step=3)
    elif self.what == "position":
      ctx.data_position = 3
    elif self.what == "ledger_field":
      ctx.ledger.step = 3
    else:
      ctx.ledger.seconds["total"] = 1.0


@pytest.mark.parametrize("what", ["ledger", "position", "ledger_field", "seconds"])
def test_hooks_cannot_write_run_state(what):
  loop = make_loop([Writes(what)])
  with pytest.raises((AttributeError, TypeError), match="read-only|does not support"):
    loop.run(toy.init_state(), toy.batches(4), num_steps=4)


def test_context_reads_are_live_and_request_stop_is_a_request():
  class Reads(loopkit.Hook):
    needs_state = False

    def on_run_start(self, ctx, state):
      self.ctx = ctx
      self.start = (ctx.ledger.step, ctx.target_step, ctx.status, ctx.hook_name)

    def after_each_call(self, info):
      assert self.ctx.ledger.step >= info.end_step  # live: may be a call ahead
      if info.end_step == 8:
        self.ctx.request_stop("enough")

    def on_run_end(self, ctx, state):
      self.end = (ctx.ledger.step, ctx.status, ctx.data_position)

  hook = Reads()
  loop = make_loop([hook])
  loop.run(toy.init_state(), toy.batches(16), num_steps=16)
  assert hook.start == (0, 16, None, "Reads")
  # after_each_call(8) runs one call late (the call to 12 is dispatched): the run stops at 12.
  assert hook.end == (12, "enough", 12) and loop.status == "enough"
  assert isinstance(loop.ledger, Ledger) and isinstance(hook.ctx.ledger, LedgerView)


# -- returned changes ---------------------------------------------------------------------------


class RestoresTo(loopkit.Hook):
  """Returns a Restore (a state at ``step``, its ledger and a position)."""

  needs_state = False

  def __init__(self, state, ledger, position):
    super().__init__(at_end=False)
    self.restore = loopkit.core.Restore(state, ledger, position)

  def on_run_start(self, ctx, state):
    return self.restore


def test_a_restore_sets_state_ledger_and_position_together():
  """A Restore at step 8 (ledger at 8, position 8): the run continues with batch 8."""
  ref = make_loop([]).run(toy.init_state(), toy.batches(12), num_steps=12)
  loop8 = make_loop([])
  at8 = loop8.run(toy.init_state(), toy.batches(12), num_steps=8)
  ledger = loop8.ledger.copy()
  hook = RestoresTo(jax.tree.map(lambda x: x.copy(), at8), ledger, 8)
  loop = make_loop([hook])
  final = loop.run(toy.init_state(seed=1), toy.batches(12), num_steps=12)
  toy.assert_bitwise(final, ref)
  assert loop.ledger.step == 12 and loop.ledger.examples_seen == 12 * 16
  assert loop.ledger.loop_index == 3 and loop.data_position == 12
  assert ledger.step == 8  # the hook's ledger is copied, not adopted


def test_a_restore_with_a_ledger_at_another_step_is_refused():
  loop8 = make_loop([])
  at8 = loop8.run(toy.init_state(), toy.batches(8), num_steps=8)
  hook = RestoresTo(at8, Ledger(step=4), 4)
  with pytest.raises(ValueError, match="state at step 8 with a ledger at step 4"):
    make_loop([hook]).run(toy.init_state(), toy.batches(12), num_steps=12)


def test_a_state_at_another_step_without_a_restore_is_refused():
  at8 = make_loop([]).run(toy.init_state(), toy.batches(8), num_steps=8)

  class ReturnsState(loopkit.Hook):
    def on_run_start(self, ctx, state):
      return at8

  with pytest.raises(ValueError, match="state at step 8 but the ledger is at step 0.*Restore"):
    make_loop([ReturnsState()]).run(toy.init_state(), toy.batches(12), num_steps=12)


def test_a_ledger_adjustment_is_applied_once_after_every_restore():
  class Adjusts(loopkit.Hook):
    needs_state = False
    calls = 0

    def adjust_ledger(self, ctx):
      self.calls += 1
      self.seen = ctx.ledger.step
      return loopkit.core.LedgerAdjustment(lost_steps=3, set_seconds={Bucket.LOST: 2.0},
                                      add_seconds={"custom": 0.5})

  at8 = make_loop([]).run(toy.init_state(), toy.batches(8), num_steps=8)
  adj = Adjusts()
  loop = make_loop([adj, RestoresTo(at8, Ledger(step=8, loop_index=2), 8)])
  loop.run(toy.init_state(), toy.batches(12), num_steps=12)
  assert adj.calls == 1 and adj.seen == 8  # after the restore by the hook after it
  assert loop.ledger.lost_steps == 3 and loop.ledger.seconds["lost"] == 2.0
  assert loop.ledger.seconds["custom"] == 0.5
