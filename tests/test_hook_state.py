"""Hooks' names in checkpoints (loopkit.core.hook_state): stable and unique, old positional
keys matched by index then by unique class, unmatched restored states logged."""

import logging

import pytest

import loopkit
from loopkit.core.hook_state import hook_names, match_hook_states
from loopkit.core.ledger import Ledger
from tests import toy
from tests.test_context import RestoresTo, make_loop


class Counter(loopkit.Hook):
  needs_state = False

  def __init__(self, hook_name=None):
    super().__init__()
    self.calls = 0
    if hook_name is not None:
      self.hook_name = hook_name

  def after_each_call(self, info):
    self.calls += 1

  def checkpoint_state(self):
    return {"calls": self.calls}

  def restore_checkpoint_state(self, d):
    self.calls = d["calls"]


def test_hook_names_are_stable_and_unique():
  hooks = [Counter(), loopkit.NanCheckHook(), Counter(), Counter("mine")]
  assert hook_names(hooks) == ["Counter", "NanCheckHook", "Counter#2", "mine"]
  with pytest.raises(ValueError, match="two hooks are named 'mine'"):
    hook_names([Counter("mine"), Counter("mine")])
  with pytest.raises(ValueError, match="hook_name must be"):
    hook_names([Counter("3:Counter")])


def test_old_positional_keys_match_by_index_then_by_unique_class():
  hooks = [loopkit.NanCheckHook(), Counter(), Counter(), loopkit.LoggingHook()]
  names = hook_names(hooks)
  matched, unmatched = match_hook_states(
      {"1:Counter": "a", "Counter#2": "b", "2:LoggingHook": "c", "0:Counter": "d", "x": "e"},
      hooks, names)
  # index 1 is a Counter (the old rule); LoggingHook moved but is the only one; "0:Counter"
  # names an index holding another class and Counter is not unique: unmatched.
  assert matched == {1: "a", 2: "b", 3: "c"}
  assert sorted(unmatched) == ["0:Counter", "x"]


def test_unmatched_restored_hook_states_are_logged(caplog):
  at8 = make_loop([]).run(toy.init_state(), toy.batches(8), num_steps=8)
  hook = RestoresTo(at8, Ledger(step=8), 8)
  object.__setattr__(hook, "restore", loopkit.core.Restore(at8, Ledger(step=8), 8,
                                                      {"Gone": {"calls": 1}}))
  with caplog.at_level(logging.WARNING, logger="loopkit"):
    make_loop([hook]).run(toy.init_state(), toy.batches(12), num_steps=12)
  assert "Gone match no hook" in caplog.text
