"""Ahead-of-time compilation for TPU topologies through libtpu, on this CPU machine."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import loopkit
from loopkit.tools import aot, topology

# A matmul model whose FLOPs are known: per step and device, the forward
# x[b, N] @ w[N, M] and the gradient of w (x^T @ dy) are 2 * b * N * M each.
N, M = 512, 256


def _train_step(state, batch):
  def loss(w):
    return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)
  value, grad = jax.value_and_grad(loss)(state["w"])
  return {"step": state["step"] + 1, "w": state["w"] - 0.1 * grad}, {"loss": value}


def _state():
  return {"step": jax.ShapeDtypeStruct((), jnp.int32), "w": jax.ShapeDtypeStruct((N, M),
                                                                                jnp.float32)}


def _batch(b):
  return {"x": jax.ShapeDtypeStruct((b, N), jnp.bfloat16),
          "y": jax.ShapeDtypeStruct((b, M), jnp.float32)}


@pytest.mark.parametrize("style", ["global", "per_device"])
def test_flops_are_one_step_per_device_for_every_k(style):
  """XLA's cost analysis counts the while loop's body once: the same FLOPs for K = 1 and 3
  (but for the reductions of the [K] metric traces after the loop), those of one step on
  one device's slice of the batch."""
  step = _train_step
  if style == "per_device":
    def step(state, batch):
      value, grad = jax.value_and_grad(
          lambda w: jnp.mean((batch["x"] @ w - batch["y"]) ** 2))(state["w"])
      grad = jax.lax.pmean(grad, "data")
      return {"step": state["step"] + 1, "w": state["w"] - 0.1 * grad}, {"loss": value}
  flops = []
  for k in (1, 3):
    loop = loopkit.TrainLoop(step, iterations_per_loop=k, step_style=style)
    r = aot.compile_for(loop, _state(), _batch(64), topology="v5e:2x2")
    assert r.train.trace_count == 1 and loop.program.compile_count() == 0
    # the chunk a run feeds: K = 1 has a zero second slot (feeding.py), [max(K, 2), B/D, ...]
    assert r.train.chunk_bytes == max(k, 2) * (64 // 4) * (N * 2 + M * 4)  # x bf16, y f32
    flops.append(r.train.flops_per_step)
    # the compute bound's MFU: 1 unless XLA's HBM traffic estimate at peak bandwidth is longer
    t = r.train
    assert t.mfu_ceiling == min(1.0, t.compute_bound_secs / t.memory_secs) and (
        0 < t.mfu_ceiling <= 1)
    assert (f"a measured step of t ms runs at MFU {t.step_secs * 1e3:.4g} ms / t; at most "
            f"{t.mfu_ceiling * 100:.3g}% if XLA's HBM traffic estimate is real") in str(r)
  matmuls = 2 * (2 * (64 // 4) * N * M)
  assert abs(flops[0] - flops[1]) < 100  # only the reductions of the [K] metric traces differ
  assert matmuls <= flops[0] < 1.2 * matmuls, (flops, matmuls)


def test_eval_program_with_the_train_program():
  def eval_step(state, batch):
    return {"err": jnp.sum((batch["x"] @ state["w"] - batch["y"]) ** 2, -1)}

  loop = loopkit.TrainLoop(_train_step, iterations_per_loop=2)
  ev = loopkit.Evaluator(eval_step, iterations_per_loop=3, prefetch=1)
  r = aot.compile_for(loop, _state(), _batch(16), topology="v5e:2x2", evaluator=ev,
                      eval_batch=_batch(32))
  assert set(r.programs) == {"train", "eval"}
  e = r.programs["eval"]
  assert (e.trace_count, e.iterations_per_loop, e.global_batch_size, e.per_device_batch,
          e.prefetch_chunks) == (1, 3, 32, 8, 1)
  assert e.chunk_bytes == 3 * 8 * (N * 2 + M * 4 + 1)  # x bf16, y f32, the bool mask
  assert e.alias_bytes == 0  # the evaluator does not donate the state
  assert e.argument_bytes >= N * M * 4 + e.chunk_bytes
  assert 2 * 8 * N * M <= e.flops_per_step < 1.2 * 2 * 8 * N * M  # one batch, one device
  assert ev.compile_count() == 0 and ev.trace_count == 0  # the given evaluator is untouched


def test_local_devices_report_without_chip():
  loop = loopkit.TrainLoop(_train_step, iterations_per_loop=2, prefetch=1)
  r = aot.compile_for(loop, _state(), _batch(16))
  assert (r.topology, r.chip, r.num_devices, r.mesh_shape) == ("local", None, 8, {"data": 8})
  t = r.train
  assert t.per_device_batch == 2 and t.prefetch_chunks == 1
  assert t.hbm_bytes is None and t.headroom_bytes is None and t.step_secs is None
  assert t.mfu_ceiling is None and "MFU" not in str(r)  # no chip, no peak
  assert t.alias_bytes == N * M * 4 + 4  # w and step, donated
  assert loop.program.compile_count() == 0


def test_unknown_topology_lists_the_known_ones():
  with pytest.raises(ValueError, match=r"unknown TPU topology 'v9z:2x2'; known: .*v5e:4x8"
                                       r".*v4-32"):
    aot.compile_for(loopkit.TrainLoop(_train_step, iterations_per_loop=2), _state(),
                    _batch(16), topology="v9z:2x2")
  with pytest.raises(ValueError, match=r"unknown TPU topology 'v5e'"):
    topology.topology_devices("v5e")
  with pytest.raises(ValueError, match=r"libtpu refused the TPU topology 'v5e:3x3'"):
    topology.topology_devices("v5e:3x3")
  assert topology.parse_topology("v4-32") == (topology.CHIPS["v4"], "v4:2x2x4")
  assert topology.parse_topology("v5litepod-32") == (topology.CHIPS["v5e"], "v5e:4x8")
  assert len(topology.topology_devices("v4-32")) == 16  # megacore: one device per chip
  assert {d.process_index for d in topology.topology_devices("v5e:4x8")} == set(range(8))


def test_does_not_fit_names_the_numbers():
  loop = loopkit.TrainLoop(_train_step, iterations_per_loop=2)
  with pytest.raises(aot.ProgramDoesNotFitError,
                     match=r"the train program does not fit on v5e:2x2: it needs .* per device "
                           r"\(arguments .*\) but the device has 4096 bytes of HBM: .* over, at "
                           r"K=2 and batch 64 \(16 per device\)"):
    aot.compile_for(loop, _state(), _batch(64), topology="v5e:2x2", hbm_bytes=4096)
  # an absurd batch against the real 16 GiB of a v5e chip: 2 slots x 2^21 x 512 bf16 = 4 GiB
  # of x per chunk and device, 3 chunks live with the default prefetch of 2
  with pytest.raises(aot.ProgramDoesNotFitError, match=r"GiB of HBM"):
    aot.compile_for(loop, _state(), _batch(4 * 2**21), topology="v5e:2x2")
  r = aot.compile_for(loop, _state(), _batch(64), topology="v5e:2x2", hbm_bytes=4096,
                      check_fits=False)
  assert r.train.headroom_bytes == 4096 - r.train.used_bytes < 0


def test_bad_batch_specs():
  loop = loopkit.TrainLoop(_train_step, iterations_per_loop=2)
  with pytest.raises(ValueError, match=r"global batch size 6 is not divisible by the "
                                       r"data-parallel size 4"):
    aot.compile_for(loop, _state(), _batch(6), topology="v5e:2x2")
  ragged = {"x": jax.ShapeDtypeStruct((8, N), jnp.bfloat16),
            "y": jax.ShapeDtypeStruct((4, M), jnp.float32)}
  with pytest.raises(ValueError, match=r"same leading batch dimension.*\{'x': 8, 'y': 4\}"):
    aot.compile_for(loop, _state(), ragged, topology="v5e:2x2")
  with pytest.raises(ValueError, match="needs eval_batch"):
    aot.compile_for(loop, _state(), _batch(8), evaluator=loopkit.Evaluator(lambda s, b: {}))


def test_arrays_and_kept_shardings():
  """Concrete arrays work as specs; a sharded state leaf keeps its PartitionSpec on the target."""
  mesh = loopkit.data_parallel_mesh()
  w = jax.device_put(np.zeros((N, M), np.float32),
                     jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
  state = {"step": jnp.zeros((), jnp.int32), "w": w}
  loop = loopkit.TrainLoop(_train_step, iterations_per_loop=2, mesh=mesh)
  batch = {k: np.zeros(v.shape, v.dtype) for k, v in _batch(16).items()}
  r = aot.compile_for(loop, state, batch, topology="v5e:2x2")
  # w split over the 4 chips (replicated it would be 4x more), the step a padded scalar
  assert N * M * 4 // 4 <= r.train.alias_bytes < N * M * 4 // 4 + 4096


def test_scanned_layers_flops_count_every_layer():
  """Layers in a ``lax.scan`` (XLA counts its body once): the report's FLOPs and compute bound
  count all L layers, as :meth:`loopkit.core.MultiStepProgram.flops_per_step` does."""
  layers, b = 6, 64

  def step(state, batch):
    def loss(ws):
      h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), batch["x"], ws)
      return jnp.mean(h ** 2)
    value, grad = jax.value_and_grad(loss)(state["ws"])
    return {"step": state["step"] + 1, "ws": state["ws"] - 0.1 * grad}, {"loss": value}

  state = {"step": jax.ShapeDtypeStruct((), jnp.int32),
           "ws": jax.ShapeDtypeStruct((layers, N, N), jnp.float32)}
  loop = loopkit.TrainLoop(step, iterations_per_loop=2)
  r = aot.compile_for(loop, state, {"x": jax.ShapeDtypeStruct((b, N), jnp.float32)},
                      topology="v5e:2x2")
  # per device (b / 4 rows): forward, weight gradient and activation gradient of every layer
  matmuls = 3 * layers * 2 * (b // 4) * N * N
  t = r.train  # (XLA's own count: about 1/L of this)
  assert matmuls <= t.flops_per_step < 1.05 * matmuls, (t.flops_per_step, matmuls)
  assert t.compute_bound_secs == t.flops_per_step / topology.CHIPS["v5e"].peak_bf16_flops
