"""loopkit.metrics' protocol: a user's own metric kind (no change to loopkit) is reduced over the
K steps of a call and over the devices, merged and logged by LoggingHook, and checkpointed."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import loopkit
from loopkit import metrics
from tests import toy


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RootMeanSquare(metrics.Metric):
  """sqrt(sum of squares / count): not a mean of per-step or per-device values."""

  sum_sq: jax.Array
  count: jax.Array

  def reduce_devices(self, axis_name):
    return RootMeanSquare(jax.lax.psum(self.sum_sq, axis_name),
                          jax.lax.psum(self.count, axis_name))

  def merge(self, other):
    return RootMeanSquare(self.sum_sq + other.sum_sq, self.count + other.count)

  def compute(self):
    return float(np.sqrt(self.sum_sq / self.count))


class _Rows:
  def __init__(self):
    self.rows = []

  def write_scalars(self, step, scalars):
    self.rows.append((step, dict(scalars)))


def _with_rms(step):
  def wrapped(state, batch):
    state, m = step(state, batch)
    x = batch["x"]
    return state, {**m, "rms": RootMeanSquare(jnp.sum(x * x), jnp.asarray(x.size, jnp.float32))}
  return wrapped


@pytest.mark.parametrize("style", ["global", "per_device"])
@pytest.mark.parametrize("k", [1, 3])
def test_user_metric_is_reduced_over_steps_and_devices_and_logged(style, k):
  steps = 10
  data = toy.batches(steps)
  step = toy.make_global_step() if style == "global" else toy.make_per_device_step()
  writer = _Rows()
  log = loopkit.LoggingHook(writer, every_steps=4, per_step=True, throughput=False)
  loop = loopkit.TrainLoop(_with_rms(step), iterations_per_loop=k, step_style=style,
                           hooks=[log])
  loop.run(toy.init_state(), iter(data), num_steps=steps)
  # rows at 4, 8 and the end (10), each over the steps since the previous row
  assert [s for s, _ in log.records] == [4, 8, 10]
  for (row_step, row), first in zip(log.records, [0, 4, 8]):
    xs = np.concatenate([d["x"].ravel() for d in data[first:row_step]]).astype(np.float64)
    assert row["rms"] == pytest.approx(np.sqrt(np.mean(xs ** 2)), rel=1e-6)
  # per step (the [K] traces, the metric's compute_traces): each step's own value
  per_step = {s: r["per_step/rms"] for s, r in writer.rows if "per_step/rms" in r}
  want = {i + 1: np.sqrt(np.mean(d["x"].astype(np.float64) ** 2)) for i, d in enumerate(data)}
  assert sorted(per_step) == sorted(want)
  for s in want:
    assert per_step[s] == pytest.approx(want[s], rel=1e-6)


def test_user_metric_checkpoint_json_round_trips_bitwise():
  m = RootMeanSquare(np.float32(12.5), np.float32(3.0))
  d = metrics.to_json(m)
  assert d["kind"] == f"{__name__}.RootMeanSquare"
  back = metrics.from_json(d)
  assert type(back) is RootMeanSquare
  assert back.sum_sq.tobytes() == m.sum_sq.tobytes() and back.count.tobytes() == m.count.tobytes()
  assert metrics.merge(m, back).compute() == pytest.approx(np.sqrt(25.0 / 6.0))


def test_metric_kind_that_is_not_a_pytree_is_refused_by_name():
  class Loose(metrics.Metric):
    pass

  with pytest.raises(ValueError, match="Loose is not a pytree"):
    metrics.as_metric(Loose())
