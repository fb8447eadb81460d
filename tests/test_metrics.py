"""loopkit.metrics' protocol: a user's own metric kind (no change to loopkit) is reduced over the
K steps of a call and over the devices, merged and logged by LoggingHook, and checkpointed."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
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


# -- C66: sum-valued metrics (Flax's lm1b) as a weighted mean -----------------------------------

V, D, L, LM_B, WINDOW = 32, 8, 12, 8, 6
LM_TX = optax.adam(0.05)


def _lm_batches(n, seed=0):
  """Token batches [B, L] padded with 0 to a random length each: the denominators vary."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    lengths = rng.integers(2, L + 1, size=LM_B)
    tokens = rng.integers(1, V, size=(LM_B, L))
    out.append({"inputs": np.where(np.arange(L) < lengths[:, None], tokens, 0).astype(np.int32)})
  return out


def _lm_init():
  k1, k2 = jax.random.split(jax.random.key(0))
  params = {"embed": 0.3 * jax.random.normal(k1, (V, D)),
            "out": 0.3 * jax.random.normal(k2, (D, V))}
  return {"params": params, "opt": LM_TX.init(params), "step": jnp.zeros((), jnp.int32)}


def _compute_metrics(logits, labels, weights):
  """Flax lm1b's compute_metrics (without its psum): token sums and their denominator."""
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels) * weights
  acc = (jnp.argmax(logits, -1) == labels) * weights
  return {"loss": loss.sum(), "accuracy": acc.sum(), "denominator": weights.sum()}


def _lm1b_step(state, batch):
  """Flax lm1b's train_step in miniature: next-token loss, mean over real tokens."""
  inputs = batch["inputs"]
  targets = jnp.concatenate([inputs[:, 1:], jnp.zeros_like(inputs[:, :1])], axis=1)
  weights = (targets > 0).astype(jnp.float32)

  def loss_fn(params):
    logits = jnp.tanh(params["embed"][inputs]) @ params["out"]  # [B, L, V]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets) * weights
    return loss.sum() / weights.sum(), logits

  (_, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
  updates, opt = LM_TX.update(grads, state["opt"], state["params"])
  new = {"params": optax.apply_updates(state["params"], updates), "opt": opt,
         "step": state["step"] + 1}
  return new, _compute_metrics(logits, targets, weights)


def _ported_step(state, batch):
  """The port: each sum becomes a weighted mean over the step's denominator."""
  state, m = _lm1b_step(state, batch)
  return state, {"loss": metrics.Mean(m["loss"], m["denominator"]),
                 "accuracy": metrics.Mean(m["accuracy"], m["denominator"])}


@pytest.fixture(scope="module")
def lm1b_rows():
  """Flax lm1b's own loop: one jitted step per batch; every WINDOW steps, the stacked sums over
  the window divided by the summed denominator (its train_summary)."""
  data, step, state = _lm_batches(3 * WINDOW), jax.jit(_lm1b_step), _lm_init()
  rows, window, sums_seen = [], [], []
  for i, batch in enumerate(data):
    state, m = step(state, batch)
    window.append(m)
    if (i + 1) % WINDOW == 0:
      stacked = jax.tree.map(lambda *x: np.stack(x), *jax.device_get(window))
      sums = jax.tree.map(jnp.sum, stacked)
      denominator = sums.pop("denominator")
      rows.append((i + 1, {k: float(v / denominator) for k, v in sums.items()}))
      sums_seen.append(stacked)
      window = []
  return data, rows, sums_seen


@pytest.mark.parametrize("k", [1, 4])  # K = 4 does not divide the 6-step window: 2 or 6 calls
def test_c66_sums_over_a_denominator_log_flax_lm1b_numbers(lm1b_rows, k):
  data, want, sums = lm1b_rows
  log = loopkit.LoggingHook(every_steps=WINDOW, throughput=False)
  loop = loopkit.TrainLoop(_ported_step, iterations_per_loop=k, hooks=[log],
                           mesh=loopkit.data_parallel_mesh(devices=jax.devices()[:1]))
  loop.run(_lm_init(), iter(data), num_steps=3 * WINDOW)
  assert loop.ledger.loop_index == {1: 18, 4: 6}[k]
  assert [s for s, _ in log.records] == [s for s, _ in want] == [6, 12, 18]
  for (step, row), (_, flax_row), window in zip(log.records, want, sums, strict=True):
    # the row is sum(loss sums) / sum(denominators) over the window's steps, as Flax logs it
    total = np.add.accumulate(window["loss"])[-1]  # loopkit's order: a left fold in float32
    count = np.add.accumulate(window["denominator"])[-1]
    assert row["loss"] == float(total) / float(count), step
    assert np.float32(row["loss"]) == np.float32(flax_row["loss"]), (step, row, flax_row)
    assert np.float32(row["accuracy"]) == np.float32(flax_row["accuracy"]), (step, row, flax_row)
    assert 2.0 < row["loss"] < 4.0 and 0.0 <= row["accuracy"] < 0.5
    # averaging the sums over steps (0.2's reading of plain scalars) is what the case logged
    assert float(np.mean(window["loss"])) > 20 * row["loss"]
