"""steps_per_epoch="auto": inferred from a sized source (len, tf.data cardinality, Grain,
ArraySource), with a clear error when the source cannot tell."""

import pytest
import toy

import loopkit
from loopkit.data.sources import steps_per_epoch_of

pytestmark = pytest.mark.tf
tf = pytest.importorskip("tensorflow")  # collection imports this module even where deselected


def _arrays(n):
  b = toy.batches(1, batch_size=n)[0]
  return b


def test_sources_that_know_their_length():
  grain = pytest.importorskip("grain")
  data = _arrays(22)
  assert steps_per_epoch_of(toy.batches(5)) == 5
  ds = tf.data.Dataset.from_tensor_slices(data).batch(4, drop_remainder=True)
  assert steps_per_epoch_of(ds) == 5
  assert steps_per_epoch_of(tf.data.Dataset.from_tensor_slices(data).batch(4)) == 6
  assert steps_per_epoch_of(loopkit.TfDataSource(ds)) == 5
  assert steps_per_epoch_of(loopkit.ArraySource(data, 4)) == 5
  assert steps_per_epoch_of(grain.MapDataset.source(list(range(22))).batch(4)) == 6


@pytest.mark.parametrize("source,match", [
    (lambda: tf.data.Dataset.range(8).batch(2).repeat(), "repeats forever"),
    (lambda: tf.data.Dataset.range(8).filter(lambda x: x > 2).batch(2), "assert_cardinality"),
    (lambda: iter(toy.batches(3)), r"needs a sized source, got a builtins\.list_iterator"),
    (lambda: (b for b in toy.batches(3)), "generator"),
    (lambda: [], "has 0 batches"),
])
def test_unknown_length_is_a_clear_error(source, match):
  with pytest.raises(ValueError, match=match):
    steps_per_epoch_of(source())


def test_train_loop_auto_lands_epoch_ends():
  fired = []
  hook = loopkit.CallbackHook(lambda info, s: fired.append((info.end_step, info.epoch)),
                              needs_state=False, every_epochs=1)
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4,
                           steps_per_epoch="auto", hooks=[hook])
  state = loop.run(toy.init_state(), toy.batches(5), num_epochs=1)
  assert loop.steps_per_epoch == 5 and int(state["step"]) == 5 and fired == [(5, 0)]
  ds = tf.data.Dataset.from_tensor_slices(_arrays(48)).batch(16, drop_remainder=True)
  state = loop.run(state, loopkit.TfDataSource(ds), num_epochs=2)  # 3 steps per epoch now
  assert loop.steps_per_epoch == 3 and int(state["step"]) == 6 and fired[-1] == (6, 1)
  with pytest.raises(ValueError, match="steps_per_epoch"):
    loop.run(state, iter(toy.batches(3)), num_epochs=3)
  with pytest.raises(ValueError, match="'auto'"):
    loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=2, steps_per_epoch=0)
