"""Chunks formed on the devices and full calls with a static trip count (issue 49's CPU part).

The two accelerator paths (``chunk_assembly="device"``: each batch placed as it comes and the
chunk assembled on the mesh; ``full_call_loop="static"``: full calls on a second executable
whose step loop has a static trip count) are the defaults on GPUs only. Here they are forced on
the 8 fake CPU devices and held to the promises of the default path: bitwise K-invariance with
calls cut by hooks, epoch ends and skip ranges, resume equality, both executables compiled at
the first call, and, for device assembly, no host array of the chunk's size and a K whose
chunks do not fit refused before step 1.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

import loopkit
from loopkit.core.program import MultiStepProgram
from loopkit.data import assembly as assembly_lib
from loopkit.data import feeding

STEPS = 20
BATCH = 32  # 4 examples per device on the 8-device mesh


class _Net(nn.Module):
  """3x3 conv -> BatchNorm -> ReLU -> mean pool -> dense(10): conv gradients and batch stats."""

  axis_name: str | None = None

  @nn.compact
  def __call__(self, x):
    x = nn.Conv(4, (3, 3), use_bias=False)(x)
    x = nn.BatchNorm(use_running_average=False, momentum=0.9, axis_name=self.axis_name)(x)
    return nn.Dense(10)(jnp.mean(nn.relu(x), axis=(1, 2)))


def _setup(style="global"):
  model = _Net("data" if style == "per_device" else None)
  variables = model.init(jax.random.key(0), jnp.ones((1, 6, 6, 3)))
  tx = optax.adam(1e-2)
  state = {"params": variables["params"], "batch_stats": variables["batch_stats"],
           "opt": tx.init(variables["params"]), "step": jnp.zeros((), jnp.int32)}

  def step(state, batch):
    def loss_fn(params):
      logits, new = model.apply({"params": params, "batch_stats": state["batch_stats"]},
                                batch["image"].astype(jnp.float32) / 255.0,
                                mutable=["batch_stats"])
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
      return loss, new["batch_stats"]

    (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    if style == "per_device":
      grads, loss, stats = jax.lax.pmean((grads, loss, stats), "data")
    updates, opt = tx.update(grads, state["opt"], state["params"])
    return ({"params": optax.apply_updates(state["params"], updates), "batch_stats": stats,
             "opt": opt, "step": state["step"] + 1}, {"loss": loss})

  return state, step


def _batches(n=STEPS + 6):
  """uint8 images and int32 labels, as a host image pipeline gives them."""
  rng = np.random.default_rng(0)
  return [{"image": rng.integers(0, 256, (BATCH, 6, 6, 3), np.uint8),
           "label": rng.integers(0, 10, (BATCH,), np.int32)} for _ in range(n)]


def _train(k, *, assembly="host", full="traced", style="global", skip_steps=None, prefetch=2,
           hooks=()):
  state, step = _setup(style)
  seen = []
  loop = loopkit.TrainLoop(step, iterations_per_loop=k, steps_per_epoch=9, step_style=style,
                           chunk_assembly=assembly, full_call_loop=full, prefetch=prefetch,
                           hooks=[loopkit.CallbackHook(lambda i, s: seen.append(i.end_step),
                                                       every_steps=5), *hooks])
  out = loop.run(state, _batches(), num_steps=STEPS, skip_steps=skip_steps)
  return jax.device_get(out), loop, seen


def _assert_bitwise(a, b):
  for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
    assert np.array_equal(x, y), jax.tree_util.keystr(path)


@pytest.fixture(scope="module")
def reference():
  return _train(1)


@pytest.mark.parametrize("k, assembly, full", [
    (1, "device", "static"), (3, "device", "static"), (7, "device", "static"),
    (3, "host", "static"), (7, "device", "traced")])
def test_device_assembly_and_static_full_calls_are_bitwise_the_default_path(
    reference, k, assembly, full):
  ref_state, _, ref_seen = reference
  state, loop, seen = _train(k, assembly=assembly, full=full)
  _assert_bitwise(ref_state, state)
  assert seen == ref_seen == [5, 10, 15, 20]
  assert int(state["step"]) == loop.ledger.step == STEPS
  assert loop.program.compile_count() == (2 if full == "static" else 1)
  assert loop.program.static_full_calls == (full == "static")


def test_per_device_style_with_both_paths():
  ref, _, _ = _train(1, style="per_device")
  state, loop, _ = _train(3, assembly="device", full="static", style="per_device")
  _assert_bitwise(ref, state)


def test_skip_ranges_with_device_assembly(reference):
  ref, _, _ = _train(1, skip_steps=[(4, 6)])
  state, loop, _ = _train(3, assembly="device", full="static", skip_steps=[(4, 6)])
  _assert_bitwise(ref, state)
  assert loop.ledger.skipped_steps == 3
  with pytest.raises(AssertionError):  # the skip changed the result: the test can tell
    _assert_bitwise(reference[0], state)


def test_resume_from_an_array_source_with_both_paths():
  """Stopped at 7 and run again to 20 (a step-indexed source resumes at its step) equals
  one uninterrupted run, with device assembly and static full calls."""
  arrays = {"image": np.concatenate([b["image"] for b in _batches(12)]),
            "label": np.concatenate([b["label"] for b in _batches(12)])}
  results = []
  for cuts in ([STEPS], [7, STEPS]):
    state, step = _setup()
    loop = loopkit.TrainLoop(step, iterations_per_loop=3, chunk_assembly="device",
                             full_call_loop="static")
    for end in cuts:
      source = loopkit.ArraySource(arrays, global_batch_size=BATCH, seed=1)
      state = loop.run(state, source, num_steps=end)
    results.append(jax.device_get(state))
  state, step = _setup()
  plain = loopkit.TrainLoop(step, iterations_per_loop=1)
  results.append(jax.device_get(plain.run(
      state, loopkit.ArraySource(arrays, global_batch_size=BATCH, seed=1), num_steps=STEPS)))
  _assert_bitwise(results[0], results[1])
  _assert_bitwise(results[0], results[2])


def test_device_assembly_makes_no_host_chunk(monkeypatch):
  """The chunk is never stacked on the host: the host path's buffer and stacking raise."""
  def refuse(*args, **kwargs):
    raise AssertionError("a host chunk buffer was made")

  monkeypatch.setattr(feeding.ChunkFeeder, "_empty_leaf", refuse)
  monkeypatch.setattr(feeding.ChunkFeeder, "_stack", refuse)
  state, loop, _ = _train(7, assembly="device", full="traced")
  assert int(state["step"]) == STEPS
  with pytest.raises(AssertionError, match="host chunk buffer"):
    _train(7, assembly="host", full="traced", prefetch=0)


@pytest.mark.filterwarnings("error")
def test_feeder_device_chunks_are_the_host_chunks():
  """Same values, dtypes and sharding, zero padding slots: a short call and K = 1, and a
  float64 leaf (float32 on the devices without x64, as the host path places it, no warning)."""
  mesh = loopkit.data_parallel_mesh()
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "data"))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  for k, plan in ((4, [4, 2]), (1, [1, 1])):
    chunks = {}
    for assembly in ("host", "device"):
      batches = [dict(b, weight=np.full((BATCH,), i, np.float64))
                 for i, b in enumerate(_batches(6))]
      feeder = feeding.ChunkFeeder(batches, iter(plan), iterations_per_loop=k,
                                   batch_sharding=sharding, replicated=replicated, prefetch=0,
                                   assembly=assembly)
      assert feeder.assembly == assembly
      chunks[assembly] = [feeder.next() for _ in plan]
      feeder.close()
    for host, device in zip(chunks["host"], chunks["device"]):
      assert host.length == device.length and host.position == device.position
      for h, d in zip(jax.tree.leaves(host.batches), jax.tree.leaves(device.batches)):
        assert isinstance(d, jax.Array) and d.sharding == sharding and d.dtype == h.dtype
        assert d.shape == (max(k, 2),) + h.shape[1:]
        np.testing.assert_array_equal(np.asarray(h), np.asarray(d))
        assert not np.asarray(d)[device.length:].any()


def test_static_full_call_runs_k_trips_and_both_compile_at_the_first_call():
  state, step = _setup()
  mesh = loopkit.data_parallel_mesh()
  prog = MultiStepProgram(step, iterations_per_loop=3, mesh=mesh, full_call_loop="static")
  chunk = jax.device_put({k: np.stack([b[k] for b in _batches(3)]) for k in ("image", "label")},
                         prog.batch_sharding)
  one = jax.device_put(np.int32(1), prog.replicated)
  # a partial call first: both executables compile there, before any step runs
  out, _ = prog(prog.place_state(state), chunk, one, length=1)
  assert prog.compile_count() == 2 and int(out["step"]) == 1
  # length == K takes the static-trip executable: K trips whatever num_steps says
  out, _ = prog(out, chunk, one, length=3)
  assert int(out["step"]) == 4 and prog.compile_count() == 2
  traced = MultiStepProgram(step, iterations_per_loop=3, mesh=mesh, full_call_loop="traced")
  out, _ = traced(traced.place_state(_setup()[0]), chunk, one, length=3)
  assert int(out["step"]) == 1 and traced.compile_count() == 1


def test_auto_resolves_by_platform_and_bad_values_are_named():
  mesh = loopkit.data_parallel_mesh()
  state, step = _setup()
  loop = loopkit.TrainLoop(step, iterations_per_loop=2)
  assert loop.program.static_full_calls is False  # CPU devices: the traced loop
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "data"))
  assert assembly_lib.resolve_chunk_assembly("auto", sharding) == "host"
  with pytest.raises(ValueError, match="chunk_assembly='gpu'"):
    loopkit.TrainLoop(step, iterations_per_loop=2, chunk_assembly="gpu")
  with pytest.raises(ValueError, match="full_call_loop='scan'"):
    loopkit.TrainLoop(step, iterations_per_loop=2, full_call_loop="scan")


def test_chunks_that_do_not_fit_are_refused_before_step_1(monkeypatch):
  k, prefetch = 7, 2
  # per device: 7 slots x 4 examples x (6*6*3 uint8 + one int32 label)
  chunk = k * (BATCH // 8) * (6 * 6 * 3 + 4)
  state, _ = _setup()
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))  # replicated: whole per device
  need = 5 * chunk + state_bytes
  monkeypatch.setattr(assembly_lib, "device_memory_limit", lambda device: need - 1)
  before = []
  state, step = _setup()
  loop = loopkit.TrainLoop(step, iterations_per_loop=k, chunk_assembly="device",
                           prefetch=prefetch,
                           hooks=[loopkit.CallbackHook(lambda i, s: before.append(i.end_step),
                                                       every_steps=1)])
  with pytest.raises(ValueError) as e:
    loop.run(state, _batches(), num_steps=STEPS)
  message = str(e.value)
  assert "iterations_per_loop=7" in message and "5 chunks in flight (prefetch=2 + 3)" in message
  assert f"{chunk} bytes per chunk on each device + {state_bytes} bytes of state" in message
  assert before == [] and loop.ledger.step == 0
  monkeypatch.setattr(assembly_lib, "device_memory_limit", lambda device: need)
  state, step = _setup()
  loop = loopkit.TrainLoop(step, iterations_per_loop=k, chunk_assembly="device",
                           prefetch=prefetch)
  assert int(loop.run(state, _batches(), num_steps=STEPS)["step"]) == STEPS
