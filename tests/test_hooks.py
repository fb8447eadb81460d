"""The hook protocol (loopkit.core.hooks.check_hooks): C58, a hook method the loop would never call
(loopkit 0.1's names, a misspelt name) is refused when the loop is built or when run starts,
named with the nearest hook method; hooks' own public helpers pass."""

import importlib

import jax
import pytest

import loopkit
from loopkit.core.hooks import HOOK_METHODS, _never_called
from tests import toy


class Collector(loopkit.Hook):
  """A user's metric collector, written for loopkit 0.1 (observe was 0.2's after_each_call)."""

  needs_state = False

  def __init__(self):
    super().__init__()
    self.seen = []

  def observe(self, info):
    self.seen.append(info.end_step)


class OnTrigger01(loopkit.Hook):
  def after_call(self, info, state):  # 0.1's name of on_trigger
    return None


class Misspelt(loopkit.Hook):
  def on_run_started(self, ctx, state):
    return None


class AfterEachStep(loopkit.Hook):
  def after_each_step(self, info):
    return None


class Duck:
  """Not a Hook subclass: the same rule holds for any object passed as a hook."""

  trigger = loopkit.Trigger()
  needs_state = False

  def on_run_start(self, ctx, state):
    return None

  def after_each_call(self, info):
    return None

  def on_trigger(self, info, state):
    return None

  def on_run_end(self, ctx, state):
    return None

  def observe(self, info):
    return None


class FromABase(Misspelt):
  """The method comes from a base class: the message names both."""


NEVER_CALLED = [
    (Collector, r"hook Collector defines observe\(\), which the loop never calls: observe\(\) is "
                r"loopkit 0\.1's name: since 0\.2 the loop calls after_each_call\(info\) instead"),
    (OnTrigger01, r"hook OnTrigger01 defines after_call\(\), which the loop never calls: "
                  r"after_call\(\) is loopkit 0\.1's name: since 0\.2 the loop calls "
                  r"on_trigger\(info, state\) instead"),
    (Misspelt, r"hook Misspelt defines on_run_started\(\), which the loop never calls: it is not "
               r"a hook method \(the nearest is on_run_start\)"),
    (AfterEachStep, r"hook AfterEachStep defines after_each_step\(\), which the loop never "
                    r"calls: it is not a hook method \(the nearest is after_each_call\)"),
    (Duck, r"hook Duck defines observe\(\), which the loop never calls: observe\(\) is loopkit "
           r"0\.1's name"),
    (FromABase, r"hook FromABase \(from Misspelt\) defines on_run_started\(\), which the loop "
                r"never calls: it is not a hook method \(the nearest is on_run_start\)"),
]


@pytest.mark.parametrize("cls,match", NEVER_CALLED, ids=lambda x: getattr(x, "__name__", ""))
def test_c58_a_method_the_loop_never_calls_is_refused_when_the_loop_is_built(cls, match):
  with pytest.raises(TypeError, match=match) as e:
    loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=2, hooks=[cls()])
  # the message lists the hook methods, 0.1's renames, and the way to keep a method of one's own
  assert "(the hook methods: on_run_start, adjust_ledger, after_each_call, on_trigger, " in str(
      e.value)
  assert ("loopkit 0.1's observe(info) is after_each_call(info), its after_call(info, state) is "
          "on_trigger(info, state))") in str(e.value)
  assert f"list it in {cls.__qualname__}.not_hook_methods" in str(e.value)


def test_c58_a_hook_added_after_the_loop_was_built_is_refused_when_run_starts():
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=2)
  loop.hooks.append(Collector())
  state = toy.init_state()
  with pytest.raises(TypeError, match=r"hook Collector defines observe\(\)"):
    loop.run(state, iter(toy.batches(4)), num_steps=4)
  assert loop.ledger is None  # no step ran; the state was not taken (not donated)
  assert not any(x.is_deleted() for x in jax.tree.leaves(state))


class Helpers(loopkit.LoggingHook):
  """A subclass of a built-in hook with public helpers, one of them named like a hook method."""

  not_hook_methods = ("on_best",)

  def rows(self):
    return [s for s, _ in self.records]

  def on_best(self, fn):  # registers a callback: the hook's own API, the loop never calls it
    self.best_fn = fn

  @property
  def after_count(self):  # a property is not a method
    return len(self.records)

  def _after_row(self):  # private
    return None


class Renamed(loopkit.Hook):
  """Collector, ported to 0.2."""

  needs_state = False

  def __init__(self):
    super().__init__(every_steps=4)
    self.seen, self.fired = [], []

  def after_each_call(self, info):
    self.seen.append(info.end_step)

  def on_trigger(self, info, state):
    self.fired.append(info.end_step)


def test_c58_public_helpers_and_the_renamed_methods_pass_and_are_called():
  helpers, renamed = Helpers(every_steps=2), Renamed()
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=3,
                           hooks=[helpers, renamed])
  loop.run(toy.init_state(), iter(toy.batches(5)), num_steps=5)
  assert helpers.rows() == [2, 4, 5] and helpers.after_count == 3
  assert renamed.seen == [2, 4, 5] and renamed.fired == [4, 5]  # calls cut at 2, 4, 5


def test_c58_every_hook_class_of_loopkit_passes_the_rule():
  """The built-in hooks have no public method the rule would refuse."""
  for module in ("loopkit.checkpoint", "loopkit.nnx", "loopkit.observe", "loopkit.evaluation",
                 "loopkit.tools.tune"):
    importlib.import_module(module)
  classes, todo = [], [loopkit.Hook]
  while todo:
    cls = todo.pop()
    todo += cls.__subclasses__()
    if cls.__module__.startswith("loopkit."):
      classes.append(cls)
  names = {c.__name__ for c in classes}
  assert names >= {"LoggingHook", "ProgressHook", "NanCheckHook", "CallbackHook", "EvalHook",
                   "GoodputHook", "ProfilerHook", "CheckpointHook", "_BoundaryClock"}, names
  assert [c.__name__ for c in classes if _never_called(c)] == []
  assert _never_called(Misspelt) is not None  # (the same function refuses)
  assert set(HOOK_METHODS) >= {"on_run_start", "after_each_call", "on_trigger", "on_run_end"}


def test_c58_nnx_train_loop_refuses_it_when_built():
  nnx_models = pytest.importorskip("nnx_models")
  import loopkit.nnx
  model, optimizer, metrics, rngs = nnx_models.make()
  with pytest.raises(TypeError, match=r"hook Collector defines observe\(\), which the loop never "
                                      r"calls: observe\(\) is loopkit 0\.1's name"):
    loopkit.nnx.NnxTrainLoop(nnx_models.train_step, model, optimizer, metrics, extra=(rngs,),
                             iterations_per_loop=2, hooks=[Collector()])
