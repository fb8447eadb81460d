"""Cases C49 and C52 from shared/cases/CASES.md and item 8 of issue 24: a batch layout the loop
can know is wrong is refused before any step; the ledger's run-start fields do not depend on how
the loop was built or on an earlier run; a partial batch's error says what fixes it."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import loopkit
from tests import toy

D, B = 4, 16  # devices, global batch


def _pmap_layout(batch):
  return {k: v.reshape((D, -1) + v.shape[1:]) for k, v in batch.items()}


def _prefetched(batches):
  from flax import jax_utils
  return list(jax_utils.prefetch_to_device(iter([_pmap_layout(b) for b in batches]), 2,
                                           devices=jax.devices()[:D]))


LAYOUTS = {  # name: (batches from global batches [16, ...], what the error must say)
    "pmap_numpy": (lambda bs: [_pmap_layout(b) for b in bs],
                   r"batch leaf x has shape \(4, 4, 4\), y has shape \(4, 4, 2\), but "
                   r"the loop's global_batch_size=16 needs a leading batch axis of \[16, \.\.\.\]"
                   r": this is jax\.pmap's layout .*x\.reshape"),
    "prefetch_to_device": (_prefetched,
                           r"batch leaf x has shape \(4, 4, 4\), y has shape "
                           r"\(4, 4, 2\), .*already on the devices with a leading device axis, "
                           r"as flax\.jax_utils\.prefetch_to_device .*Pass numpy batches"),
    # One leaf wrong, and the first in flattening order: named against B, not the first leaf.
    "one_leaf": (lambda bs: [dict(b, x=b["x"].reshape(D, D, 4)) for b in bs],
                 r"batch leaf x has shape \(4, 4, 4\), but .*jax\.pmap's layout"),
    "one_leaf_on_devices": (lambda bs: [dict(b, y=p["y"]) for b, p in zip(bs, _prefetched(bs))],
                            r"batch leaf y has shape \(4, 4, 2\), but .*prefetch_to_device"),
    "other_size": (lambda bs: [{k: v[:8] for k, v in b.items()} for b in bs],
                   r"batch leaf x has shape \(8, 4\), y has shape \(8, 2\), but the "
                   r"loop's global_batch_size=16 needs a leading batch axis of \[16, \.\.\.\]$"),
}


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_c49_a_batch_unlike_global_batch_size_is_refused_before_any_step(layout, k):
  make, message = LAYOUTS[layout]
  if "device" in layout:
    pytest.importorskip("flax")
  mesh = loopkit.data_parallel_mesh(devices=jax.devices()[:D])
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=k, mesh=mesh,
                           global_batch_size=B)
  state = toy.init_state()
  before = jax.tree.map(np.array, state)
  with pytest.raises(ValueError, match=message):
    loop.run(state, make(toy.batches(6)), num_steps=6)
  assert loop.ledger.step == 0 and loop.ledger.loop_index == 0 and loop.program.compile_count() == 0
  toy.assert_bitwise(jax.tree.map(np.array, state), before)  # not donated, not trained
  # The same loop takes the global batches.
  loop.run(state, toy.batches(6), num_steps=6)
  assert loop.ledger.step == 6 and loop.ledger.examples_seen == 6 * B


def test_c49_without_global_batch_size_the_pmap_layout_only_warns():
  mesh = loopkit.data_parallel_mesh(devices=jax.devices()[:D])
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=3, mesh=mesh)
  with pytest.warns(loopkit.data.BatchLayoutWarning, match=r"looks like jax\.pmap input.*numpy "
                    r"batches rather than the output of flax\.jax_utils\.prefetch_to_device"):
    loop.run(toy.init_state(), LAYOUTS["pmap_numpy"][0](toy.batches(6)), num_steps=6)
  assert loop.ledger.step == 6 and loop.ledger.examples_seen == 6 * D  # what it cannot know


# -- C52 --------------------------------------------------------------------------------------

STEP0, N, BATCH = 50, 10, 8
VARIANTS = {  # constructor arguments -> (steps_per_epoch the run uses)
    "plain": ({}, None),
    "global_batch_size": ({"global_batch_size": BATCH}, None),
    "k3": ({"iterations_per_loop": 3}, None),
    "k3_global_batch_size": ({"iterations_per_loop": 3, "global_batch_size": BATCH}, None),
    "steps_per_epoch": ({"steps_per_epoch": 20}, 20),
    "auto": ({"steps_per_epoch": "auto", "global_batch_size": BATCH}, N),  # len(batches)
    "time_based": ({"iterations_per_loop": "1s", "max_iterations_per_loop": 4}, None),
    "prefetch0": ({"prefetch": 0, "global_batch_size": BATCH}, None),
}


class _Start(loopkit.Hook):
  """Records the ledger as the run starts and the first boundary's fields."""

  needs_state = False

  def __init__(self):
    super().__init__()
    self.starts, self.first = [], []

  def on_run_start(self, ctx, state):
    self.starts.append((ctx.ledger.step, ctx.target_step, ctx.steps_per_epoch))
    self.first.append(None)

  def after_each_call(self, info):
    if self.first[-1] is None:
      self.first[-1] = (info.start_step, info.loop_index, info.examples_seen - info.num_steps
                        * BATCH, info.epoch, info.step_in_epoch - info.num_steps)


def _state_at(step):
  state = toy.init_state()
  state["step"] = jnp.asarray(step, jnp.int32)
  return state


def _fields(ledger):
  return (ledger.step, ledger.examples_seen, ledger.epoch, ledger.step_in_epoch,
          ledger.steps_per_epoch)


def _epoch(step, spe):
  return loopkit.core.ledger.epoch_of(step, spe)


@pytest.mark.parametrize("second", [None, "fresh_state", "continued"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_c52_run_start_fields_do_not_depend_on_the_constructor_or_an_earlier_run(variant, second):
  kwargs, spe = VARIANTS[variant]
  kwargs = {"iterations_per_loop": 4, **kwargs}
  start = _Start()
  loop = loopkit.TrainLoop(toy.make_global_step(), hooks=[start], **kwargs)
  state = loop.run(_state_at(STEP0), toy.batches(N, batch_size=BATCH), num_steps=STEP0 + N)
  first_calls = loop.ledger.loop_index
  step0, seen0, index0 = STEP0, STEP0 * BATCH, 0
  if second == "fresh_state":  # the same loop, another state at step 50 (no checkpoint)
    loop.run(_state_at(STEP0), toy.batches(N, batch_size=BATCH, seed=1), num_steps=STEP0 + N)
  elif second == "continued":  # the first run's state: the loop's ledger goes on
    loop.run(state, toy.batches(N, batch_size=BATCH, seed=1), num_steps=STEP0 + 2 * N)
    step0, seen0, index0 = STEP0 + N, (STEP0 + N) * BATCH, first_calls
  end = step0 + N
  assert _fields(loop.ledger) == (end, end * BATCH, *_epoch(end, spe), spe)
  assert start.starts[-1] == (step0, end, spe)
  epoch, in_epoch = _epoch(step0, spe)
  got = start.first[-1]
  assert got[:3] == (step0, index0, seen0)
  if spe is None or in_epoch < spe:  # the first call ends in the epoch that step0 is in
    assert got[3:] == (epoch, in_epoch), got


# -- issue 24 item 8: a partial last batch ---------------------------------------------------

PARTIAL = r"; a batch of 5 rows after full ones is a dataset's partial last batch: drop it " \
          r"\(tf\.data's \.batch\(B, drop_remainder=True\)"


@pytest.mark.parametrize("last,hint", [
    (lambda b: {k: v[:5] for k, v in b.items()}, True),  # N % B rows
    (lambda b: {"x": b["x"][:5], "y": b["y"]}, False),  # ragged: not a partial batch
    (lambda b: {"x": b["x"][:, :3], "y": b["y"]}, False),  # another feature size
    (lambda b: {k: np.concatenate([v, v]) for k, v in b.items()}, False),  # larger
])
def test_a_partial_last_train_batch_is_named_with_drop_remainder(last, hint):
  batches = toy.batches(4)
  batches[3] = last(batches[3])
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=2)
  with pytest.raises(ValueError, match=r"batch for step 4 differs from the first batch") as e:
    loop.run(toy.init_state(), batches, num_steps=4)
  assert bool(re.search(PARTIAL, str(e.value))) == hint, str(e.value)


def test_a_partial_first_eval_batch_says_global_batch_size():
  def eval_step(state, batch):
    return {"x": jnp.sum(batch["x"], axis=-1)}

  full = toy.batches(2)
  batches = [{k: v[:5] for k, v in full[0].items()}, full[1]]
  mesh = loopkit.data_parallel_mesh(devices=jax.devices()[:1])
  with pytest.raises(ValueError, match=r"an eval batch has 16 examples on this process, more "
                     r"than the static batch of 5 \(global batch 5\); the static batch was taken "
                     r"from the first eval batch: .*give the Evaluator global_batch_size="):
    loopkit.Evaluator(eval_step, mesh=mesh).evaluate({}, batches)
  with pytest.raises(ValueError, match=r"more than the static batch of 8 \(global batch 8\)$"):
    loopkit.Evaluator(eval_step, mesh=mesh, global_batch_size=8).evaluate({}, full)
  # A partial last batch is padded: every example counted once, no drop_remainder needed.
  r = loopkit.Evaluator(eval_step, mesh=mesh).evaluate({}, batches[::-1])
  assert r.num_examples == 21
