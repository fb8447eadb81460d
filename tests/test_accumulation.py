"""Gradient accumulation: M microbatches per step equal one step on the whole batch (allclose),
the ledger counts optimizer updates, and K still does not change the result (bitwise)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import toy

import loopkit


def make_step(m, tx=toy.TX):
  def step(state, batch):
    def grads_of(micro):
      loss, grads = jax.value_and_grad(toy.loss_fn)(state["params"], micro)
      return grads, {"loss": loss}
    grads, metrics = loopkit.core.accumulate(grads_of, batch, num_microbatches=m)
    updates, opt = tx.update(grads, state["opt"], state["params"])
    return ({"params": optax.apply_updates(state["params"], updates), "opt": opt,
             "step": state["step"] + 1}, metrics)
  return step


def _run(m, k, n=6):
  loop = loopkit.TrainLoop(make_step(m), iterations_per_loop=k,
                           mesh=loopkit.data_parallel_mesh(devices=jax.devices()[:1]))
  return loop, loop.run(toy.init_state(), toy.batches(n, batch_size=16), num_steps=n)


@pytest.mark.parametrize("m", [2, 4])
def test_microbatches_equal_one_step_on_the_whole_batch(m):
  _, whole = _run(1, 3)
  loop, acc = _run(m, 3)
  for a, b in zip(jax.tree.leaves(acc["params"]), jax.tree.leaves(whole["params"])):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  assert loop.ledger.step == int(acc["step"]) == toy.opt_count(acc) == 6  # updates, not m*6
  assert loop.ledger.examples_seen == 6 * 16


def test_k_does_not_change_an_accumulating_run():
  finals = [_run(4, k)[1] for k in (1, 4)]
  for a, b in zip(jax.tree.leaves(finals[0]), jax.tree.leaves(finals[1])):
    np.testing.assert_array_equal(a, b)


def test_mean_of_outputs_and_dtypes():
  batch = {"x": jnp.arange(8.0, dtype=jnp.bfloat16), "i": jnp.arange(8)}
  out = loopkit.core.accumulate(lambda mb: {"x": mb["x"].sum(), "i": mb["i"].sum()}, batch, 4)
  assert out["x"].dtype == jnp.bfloat16 and float(out["x"]) == 7.0  # (1+5+9+13)/4
  assert out["i"].dtype == batch["i"].dtype and int(out["i"]) == 7


def test_bad_microbatch_counts_are_named():
  with pytest.raises(ValueError, match=r"batch leaf x has shape \(6,\).*num_microbatches=4"):
    loopkit.core.accumulate(lambda mb: mb, {"x": jnp.zeros(6)}, 4)
  with pytest.raises(ValueError, match="int >= 1"):
    loopkit.core.accumulate(lambda mb: mb, {"x": jnp.zeros(6)}, 0)
