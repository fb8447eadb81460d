"""TrainLoop invariants: same result for every K, one compile, exact ledger, clear errors."""

import logging
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loopkit
from loopkit.core import RecompileWarning
from tests import toy

N = 14


def run(k, *, style="global", hooks=(), n=N, data=None, **kw):
  step = toy.make_global_step() if style == "global" else toy.make_per_device_step()
  loop = loopkit.TrainLoop(step, iterations_per_loop=k, step_style=style, hooks=hooks, **kw)
  state = loop.run(toy.init_state(), iter(data or toy.batches(n)), num_steps=n)
  return loop, state


def params_of(state):
  return [np.asarray(x) for x in jax.tree.leaves(state["params"])]


def reference_params(n=N):
  """A plain per-step jit loop, Flax-example style."""
  step = jax.jit(toy.make_global_step())
  state = toy.init_state()
  for b in toy.batches(n):
    state, _ = step(state, b)
  return params_of(state)


@pytest.mark.parametrize("style", ["global", "per_device"])
def test_bitwise_equal_across_k(style):
  results = {}
  for k in [1, 2, 3, 4, 7, N]:
    loop, state = run(k, style=style)
    results[k] = params_of(state)
    assert loop.ledger.step == N == int(state["step"]) == toy.opt_count(state)
    assert loop.program.compile_count() == 1
    assert loop.program.trace_count == 1
  for k, p in results.items():
    for a, b in zip(results[1], p):
      np.testing.assert_array_equal(a, b, err_msg=f"K={k} differs from K=1")
  for a, b in zip(reference_params(), results[1]):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("style", ["global", "per_device"])
def test_hook_cadences_that_do_not_divide_k_keep_result(style):
  _, base = run(4, style=style)
  seen = []
  hooks = [loopkit.CallbackHook(lambda i, s: seen.append(i.end_step), every_steps=5),
           loopkit.CallbackHook(lambda i, s: None, needs_state=False, at_steps=[3, 11])]
  loop, state = run(4, style=style, hooks=hooks)
  assert seen == [5, 10, 14]
  assert loop.program.compile_count() == 1
  for a, b in zip(params_of(base), params_of(state)):
    np.testing.assert_array_equal(a, b)


def test_global_and_per_device_agree():
  _, g = run(3, style="global")
  _, p = run(3, style="per_device")
  for a, b in zip(params_of(g), params_of(p)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_state_shardings_pinned_and_donated():
  loop, state = run(4)
  for leaf, sh in zip(jax.tree.leaves(state), jax.tree.leaves(loop.program.state_shardings)):
    assert leaf.sharding.is_equivalent_to(sh, leaf.ndim)
  before = toy.init_state()
  placed = loop.program.place_state(before)
  with warnings.catch_warnings():
    warnings.simplefilter("error", RecompileWarning)  # a chunk as the run handed it
    loop.program(placed, *_one_chunk(loop, placed=False))
  assert all(x.is_deleted() for x in jax.tree.leaves(placed))  # donated
  assert loop.program.compile_count() == 1


class _Started(loopkit.Hook):
  def __init__(self):
    super().__init__()
    self.starts = 0

  def on_run_start(self, ctx, state):
    self.starts += 1


def test_a_state_with_a_donated_leaf_is_refused_naming_each_leaf_before_any_hook():
  """A run donates its state. The same state run again, or a state that shares arrays with it
  (a functional update keeps the leaves it does not change: warm_start, TrainState.replace),
  is refused before any hook starts, naming every deleted leaf by its one name."""
  hook = _Started()
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=2, hooks=[hook])
  first = toy.init_state()
  shares = {**first, "params": toy.init_state(seed=1)["params"]}  # new params, the same opt
  loop.run(first, toy.batches(4), num_steps=4)
  assert hook.starts == 1
  opt = "opt/0/count, opt/0/mu/b, opt/0/mu/w, opt/0/nu/b, opt/0/nu/w"
  for state, deleted in ((first, f"8 deleted arrays ({opt}, params/b, params/w, step)"),
                         (shares, f"6 deleted arrays ({opt}, step)")):
    with pytest.raises(ValueError) as e:
      loop.run(state, toy.batches(4), num_steps=4)
    assert str(e.value).startswith(
        f"the train state has {deleted}: a run donates the state it is given"), e.value
    assert hook.starts == 1  # refused before anything started
  fresh = {**shares, "opt": toy.TX.init(shares["params"]), "step": jnp.zeros((), jnp.int32)}
  assert int(loop.run(fresh, toy.batches(4), num_steps=4)["step"]) == 4 and hook.starts == 2


def _one_chunk(loop, placed=True):
  """One chunk of 4 steps: placed on the batch sharding, or numpy (as a run on CPU
  devices of one process hands it to the call)."""
  sh = loop.program.batch_sharding
  b = toy.batches(4)
  stacked = {k: np.stack([x[k] for x in b]) for k in b[0]}
  if placed:
    stacked = {k: jax.device_put(v, sh) for k, v in stacked.items()}
  return stacked, jax.device_put(np.int32(4), loop.program.replicated)


def test_a_run_on_cpu_devices_hands_numpy_chunks_to_the_call_and_ends_bitwise_equal():
  """On one process of CPU devices the feeder leaves the transfer to the jitted call
  (loopkit.data.placement.call_places_numpy); under a transfer guard, or on a mesh with
  an Explicit axis, it places first.
  Both paths give the same bits, each compiles once, and the recompile warning of a
  call that mixes them names the host array."""
  got = {}
  explicit = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  for guard, mesh in (("allow", None), ("disallow", None), ("allow", explicit)):
    loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4, mesh=mesh,
                             hooks=[loopkit.NanCheckHook()])
    seen = []
    state = loop.program.place_state(toy.init_state())  # builds the jitted program
    jitted = loop.program._jitted

    def spy(s, batches, n, jitted=jitted, seen=seen):
      seen.append({"placed" if isinstance(x, jax.Array) else type(x).__name__
                   for x in jax.tree.leaves(batches)})
      return jitted(s, batches, n)

    loop.program._jitted = spy
    with jax.transfer_guard(guard):
      state = loop.run(state, iter(toy.batches(10)), num_steps=10)
    assert loop.ledger.step == 10
    # An Explicit mesh axis: placed first (a numpy argument would be traced unsharded).
    handed = "ndarray" if guard == "allow" and mesh is None else "placed"
    assert seen == [{handed}] * 3  # calls of 4, 4, 2
    assert loop.program.compile_count() == 1
    got[guard, mesh is None] = state
  for a, b in zip(jax.tree.leaves(got["allow", True]), jax.tree.leaves(got["disallow", True])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # A placed chunk after numpy ones: JAX compiles again, and the warning says why.
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4)
  state = loop.run(toy.init_state(), iter(toy.batches(4)), num_steps=4)
  with pytest.warns(RecompileWarning, match=r"batch leaf x has .* sharding .*the first "
                    r"call had .*a host \(numpy\) array, placed by the call"):
    loop.program(state, *_one_chunk(loop))


def test_sharded_state_kept_in_global_style():
  mesh = jax.make_mesh((8,), ("data",))
  state = toy.init_state()
  w_sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, None))
  state["params"]["w"] = jax.device_put(state["params"]["w"], w_sh)
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=3, mesh=mesh)
  out = loop.run(state, iter(toy.batches(6)), num_steps=6)
  assert out["params"]["w"].sharding.is_equivalent_to(w_sh, 2)


def test_metrics_traces_and_one_loop_late_fetch():
  infos = []
  loop, state = run(4, hooks=[loopkit.CallbackHook(lambda i, s: infos.append(i),
                                                   needs_state=False)])
  assert [i.end_step for i in infos] == [4, 8, 12, 14]
  assert [len(i.traces["loss"]) for i in infos] == [4, 4, 4, 2]
  # per-call metric is the mean of the per-step trace
  for i in infos:
    assert i.metrics["loss"] == pytest.approx(float(np.mean(i.traces["loss"])), rel=1e-6)
  # the per-step trace equals the reference loop's per-step loss
  step = jax.jit(toy.make_global_step())
  s = toy.init_state()
  ref = []
  for b in toy.batches(N):
    s, m = step(s, b)
    ref.append(float(m["loss"]))
  got = np.concatenate([i.traces["loss"] for i in infos])
  np.testing.assert_allclose(got, ref, rtol=1e-5)


def test_under_transfer_guard():
  step = toy.make_global_step()
  loop = loopkit.TrainLoop(step, iterations_per_loop=4, hooks=[loopkit.NanCheckHook()])
  state = loop.program.place_state(toy.init_state())
  with jax.transfer_guard("disallow"):
    state = loop.run(state, iter(toy.batches(10)), num_steps=10)
  assert loop.ledger.step == 10


def test_examples_seen_and_loop_index():
  loop, _ = run(4, hooks=[loopkit.Hook(every_steps=5)])
  assert loop.ledger.examples_seen == N * 16
  assert loop.ledger.loop_index == 5  # calls of 4,1,4,1,4 -> [4,5,9,10,14]


def test_second_run_continues_same_loop():
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4)
  data = iter(toy.batches(N))
  state = loop.run(toy.init_state(), data, num_steps=6)
  state = loop.run(state, data, num_steps=N)
  assert loop.ledger.step == N and loop.ledger.loop_index == 2 + 2
  assert loop.program.compile_count() == 1
  _, ref = run(4)
  for a, b in zip(params_of(ref), params_of(state)):
    np.testing.assert_array_equal(a, b)


def test_hook_replaces_state():
  def zero(info, state):
    return jax.tree.map(jnp.zeros_like, state) | {"step": state["step"]}
  loop, state = run(4, hooks=[loopkit.CallbackHook(zero, at_steps=[8], at_end=False)])
  assert loop.ledger.step == N
  # restart from zeros at step 8: equals training the zero state on batches 8..13
  manual = jax.tree.map(jnp.zeros_like, toy.init_state()) | {"step": jnp.int32(8)}
  step = jax.jit(toy.make_global_step())
  for b in toy.batches(N)[8:]:
    manual, _ = step(manual, b)
  for a, b in zip(params_of(manual), params_of(state)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


# -- errors -------------------------------------------------------------------


@pytest.mark.parametrize("k", [0, -3, 2.5, "4", True])
def test_bad_iterations_per_loop(k):
  with pytest.raises(ValueError, match=f"iterations_per_loop must be .*got {k!r}"):
    loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=k)


def test_batch_shape_change_names_leaf_and_step():
  data = toy.batches(10)
  data[6] = dict(data[6], y=data[6]["y"][:, :1])
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4, prefetch=0)
  with pytest.raises(ValueError, match=r"step 7 .*leaf y has shape \(16, 1\), expected \(16, 2\)"):
    loop.run(toy.init_state(), iter(data), num_steps=10)


def test_batch_dtype_change_names_leaf():
  data = toy.batches(10)
  data[2] = dict(data[2], x=data[2]["x"].astype(np.float64))
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4)
  with pytest.raises(ValueError, match=r"leaf x has dtype float64, expected float32"):
    loop.run(toy.init_state(), iter(data), num_steps=10)


def test_step_changing_state_structure_or_dtype():
  base = toy.make_global_step()

  def bad_dtype(state, batch):
    new, m = base(state, batch)
    new["params"]["b"] = new["params"]["b"].astype(jnp.bfloat16)
    return new, m

  def bad_tree(state, batch):
    new, m = base(state, batch)
    new["extra"] = jnp.zeros(())
    return new, m

  loop = loopkit.TrainLoop(bad_dtype, iterations_per_loop=2)
  with pytest.raises(ValueError, match=r"leaf params/b has dtype bfloat16, expected float32"):
    loop.run(toy.init_state(), iter(toy.batches(4)), num_steps=4)
  loop = loopkit.TrainLoop(bad_tree, iterations_per_loop=2)
  with pytest.raises(ValueError, match="tree structure differs"):
    loop.run(toy.init_state(), iter(toy.batches(4)), num_steps=4)


def test_step_counter_not_incremented():
  base = toy.make_global_step()

  def frozen(state, batch):
    new, m = base(state, batch)
    return new | {"step": state["step"]}, m

  loop = loopkit.TrainLoop(frozen, iterations_per_loop=3)
  with pytest.raises(ValueError, match="step counter is 0 after device call 0 .*steps 1..3"):
    loop.run(toy.init_state(), iter(toy.batches(6)), num_steps=6)


def test_data_runs_out_stops_at_last_full_step():
  seen = []
  ckpt_like = loopkit.CallbackHook(lambda i, s: seen.append((i.end_step, int(s["step"]))),
                                   every_steps=4)
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4, hooks=[ckpt_like])
  with pytest.warns(loopkit.DataExhaustedWarning, match="ran out at step 9 before num_steps=20"):
    state = loop.run(toy.init_state(), iter(toy.batches(9)), num_steps=20)
  assert loop.status == "data_exhausted"
  assert loop.ledger.step == 9 == int(state["step"]) == toy.opt_count(state)
  assert seen == [(4, 4), (8, 8), (9, 9)]  # final (at_end) firing at the last real step


def test_data_runs_out_on_call_boundary_fires_at_end_hooks():
  seen = []
  hook = loopkit.CallbackHook(lambda i, s: seen.append(i.end_step), every_steps=100)
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4, hooks=[hook])
  with pytest.warns(loopkit.DataExhaustedWarning):
    loop.run(toy.init_state(), iter(toy.batches(8)), num_steps=20)
  assert seen == [8] and loop.ledger.step == 8


def test_nan_check_names_step():
  base = toy.make_global_step()

  def nan_at_6(state, batch):
    new, m = base(state, batch)
    m["loss"] = jnp.where(new["step"] == 6, jnp.nan, m["loss"])
    return new, m

  loop = loopkit.TrainLoop(nan_at_6, iterations_per_loop=4, hooks=[loopkit.NanCheckHook()])
  with pytest.raises(loopkit.NonFiniteError, match=r"'loss' is nan at step 6 .*steps 5..8"):
    loop.run(toy.init_state(), iter(toy.batches(12)), num_steps=12)


def test_hook_replacing_with_wrong_shape_names_leaf():
  def bad(info, state):
    return state | {"params": {"w": jnp.zeros((3, 2)), "b": state["params"]["b"]}}
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4,
                           hooks=[loopkit.CallbackHook(bad, at_steps=[4])])
  with pytest.raises(ValueError, match=r"CallbackHook .*params/w has shape \(3, 2\)"):
    loop.run(toy.init_state(), iter(toy.batches(8)), num_steps=8)


def test_no_warning_when_data_is_exact():
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    loop, _ = run(4, n=8)
  assert loop.status == "completed"


def test_source_exception_surfaces():
  def gen():
    yield from toy.batches(5)
    raise RuntimeError("disk on fire")
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4)
  with pytest.raises(RuntimeError, match="disk on fire"):
    loop.run(toy.init_state(), gen(), num_steps=10)


def test_non_scalar_metric_names_key():
  base = toy.make_global_step()

  def step(state, batch):
    new, m = base(state, batch)
    return new, m | {"err": batch["y"][:, 0]}

  loop = loopkit.TrainLoop(step, iterations_per_loop=2)
  with pytest.raises(ValueError,
                     match=r"metric 'err': metric values must be scalars, got shape \(16,\)"):
    loop.run(toy.init_state(), iter(toy.batches(4)), num_steps=4)


@pytest.mark.parametrize("n", [20.5, "20", -1, True])
def test_bad_num_steps(n):
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=2)
  with pytest.raises(ValueError, match=f"num_steps must be an int >= 0, got {n!r}"):
    loop.run(toy.init_state(), iter(toy.batches(4)), num_steps=n)


def test_float_step_counter_rejected():
  state = toy.init_state() | {"step": jnp.zeros((), jnp.float32)}
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=2)
  with pytest.raises(ValueError, match="step counter must be a scalar integer array, got shape "
                                       r"\(\) dtype float32"):
    loop.run(state, iter(toy.batches(4)), num_steps=4)


def test_hook_not_implementing_protocol():
  class Boom:
    pass
  with pytest.raises(TypeError, match="lacks trigger, needs_state.*subclass loopkit.Hook"):
    loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=2, hooks=[Boom()])


def test_num_steps_below_state_step_is_logged(caplog):
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=2)
  state = loop.run(toy.init_state(), iter(toy.batches(4)), num_steps=4)
  with caplog.at_level("WARNING", logger="loopkit"):
    state = loop.run(state, iter(toy.batches(4)), num_steps=2)
  assert "nothing to run: the state is at step 4 and num_steps is 2" in caplog.text
  assert int(state["step"]) == 4 and loop.ledger.step == 4


def test_a_run_already_at_its_target_says_so_without_a_warning(caplog):
  """Running a finished run again (the examples' way to only evaluate) is not a mistake: an
  INFO line, no WARNING; the at_end hooks fire once."""
  fired = []

  class AtEnd(loopkit.Hook):
    def on_trigger(self, info, state):
      fired.append(info.end_step)

  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=2,
                           hooks=[AtEnd(every_steps=100, at_end=True)])
  state = loop.run(toy.init_state(), iter(toy.batches(4)), num_steps=4)
  with caplog.at_level("INFO", logger="loopkit"):
    state = loop.run(state, iter(toy.batches(4)), num_steps=4)
  assert [r.levelname for r in caplog.records if "nothing to" in r.getMessage()] == ["INFO"]
  assert "the run is already complete at step 4 (num_steps=4)" in caplog.text
  assert fired == [4, 4] and int(state["step"]) == 4


def test_per_device_step_without_pmean_is_caught_after_the_first_call():
  """Forgetting lax.pmean trains each device's copy apart: an error names the leaf."""
  def no_pmean(state, batch):
    loss, grads = jax.value_and_grad(toy.loss_fn)(state["params"], batch)
    updates, opt = toy.TX.update(grads, state["opt"], state["params"])
    return ({"params": optax.apply_updates(state["params"], updates), "opt": opt,
             "step": state["step"] + 1}, {"loss": loss})

  loop = loopkit.TrainLoop(no_pmean, iterations_per_loop=3, step_style="per_device")
  with pytest.raises(ValueError, match=r"first device call \(steps 1\.\.3\) the devices' copies "
                     r"of state leaves opt/0/mu/b.*lax\.pmean\(grads, 'data'\)"):
    loop.run(toy.init_state(), toy.batches(9), num_steps=9)
  assert loop.ledger.step == 3  # stopped after the first call, not at the end of the run


def test_replica_check_accepts_keys_bools_ints_and_nans_that_agree():
  def step(state, batch):
    del batch
    return ({**state, "step": state["step"] + 1}, {"loss": jnp.float32(0)})

  state = {"key": jax.random.key(3), "flag": jnp.array([True, False]),
           "nan": jnp.array([jnp.nan, 1.0]), "step": jnp.zeros((), jnp.int32)}
  loop = loopkit.TrainLoop(step, iterations_per_loop=2, step_style="per_device")
  out = loop.run(state, toy.batches(4), num_steps=4)
  assert int(out["step"]) == 4
  assert loop.program.diverged_leaves(out) == []


def test_a_state_sharing_one_array_in_two_leaves_is_donated_safely():
  """{"params": p, "ema": p}: the same buffer twice would be donated twice (XLA refuses)."""
  p = toy.init_state()["params"]
  p = jax.device_put(p, jax.NamedSharding(loopkit.data_parallel_mesh(), jax.P()))

  def step(state, batch):
    new, metrics = toy.make_global_step()({k: state[k] for k in ("params", "opt", "step")},
                                          batch)
    ema = jax.tree.map(lambda e, q: 0.9 * e + 0.1 * q, state["ema"], new["params"])
    return {**new, "ema": ema}, metrics

  state = {**toy.init_state(), "params": p, "ema": p}
  out = loopkit.TrainLoop(step, iterations_per_loop=2).run(state, toy.batches(4), num_steps=4)
  assert int(out["step"]) == 4
  assert not np.array_equal(np.asarray(out["params"]["w"]), np.asarray(out["ema"]["w"]))


def test_data_exhausted_with_num_epochs_names_the_epochs_and_how_to_repeat():
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4, steps_per_epoch=6)
  with pytest.warns(loopkit.DataExhaustedWarning,
                    match=r"ran out at step 6 before num_epochs=2 \(x steps_per_epoch=6 = 12 "
                          r"steps\).*repeat"):
    state = loop.run(toy.init_state(), toy.batches(6), num_epochs=2)
  assert int(state["step"]) == 6 and loop.status == "data_exhausted"


def test_gpu_mesh_warns_once_that_k_invariance_needs_deterministic_ops(monkeypatch, caplog):
  """On a GPU mesh TrainLoop says once how to keep the bitwise promise, unless XLA_FLAGS chose."""
  from loopkit.core import loop as loop_mod

  class FakeMesh:  # only what the check reads: the devices' platform
    def __init__(self, platform):
      self.devices = np.array([types.SimpleNamespace(platform=platform)] * 2)

  def warnings_after(platform, flags):
    monkeypatch.setattr(loop_mod, "_GPU_WARNED", [])
    monkeypatch.setenv("XLA_FLAGS", flags)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="loopkit"):
      loop_mod._warn_gpu_determinism(FakeMesh(platform))
      loop_mod._warn_gpu_determinism(FakeMesh(platform))
    return [r.getMessage() for r in caplog.records if "xla_gpu_deterministic_ops" in r.getMessage()]

  got = warnings_after("gpu", "--xla_gpu_autotune_level=4")
  assert len(got) == 1 and "XLA_FLAGS=--xla_gpu_deterministic_ops=true" in got[0]
  assert warnings_after("cuda", "") and len(warnings_after("cuda", "")) == 1
  assert warnings_after("gpu", "--xla_gpu_deterministic_ops=false") == []
  assert warnings_after("gpu", "--xla_gpu_deterministic_ops=true") == []
  assert warnings_after("cpu", "") == [] and warnings_after("tpu", "") == []
