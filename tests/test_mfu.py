"""MFU (issue 37, item 4): FLOPs per step from the compiled train program's own cost analysis,
``throughput/tflops_per_device`` and ``throughput/mfu`` rows, the peaks table.

The model is a dense two-layer MLP whose FLOPs are known: per step and device (``b`` rows of the
``B / 8`` slice), the forward matmuls are ``2 b (IN HID + HID OUT)``, and the backward pass
computes the weight gradients (the same again) and the hidden activations' gradient
``2 b HID OUT``; the input's gradient is not needed (the input is data), so the total is
``2 b (2 IN HID + 3 HID OUT)``, a little under 3x the forward. XLA adds the elementwise work (the
ReLU, the loss, the SGD update: about ``2 (IN HID + HID OUT)``, 1/(3b) of the matmuls): the
reported count is within 10% above the matmuls.
"""

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import loopkit
from loopkit._internal.compat import lowering_count
from loopkit.observe import peaks
from loopkit.tools import topology
from tests import toy

B, IN, HID, OUT = 128, 64, 128, 32
DEVICES = 8
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
ANALYTIC = 2 * (B // DEVICES) * (2 * IN * HID + 3 * HID * OUT)  # matmul FLOPs per step, device


def _loss(params, batch):
  h = jax.nn.relu(batch["x"] @ params["w1"])
  return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


def _global_step(state, batch):
  loss, grads = jax.value_and_grad(_loss)(state["params"], batch)
  params = jax.tree.map(lambda p, g: p - 0.01 * g, state["params"], grads)
  return {"params": params, "step": state["step"] + 1}, {"loss": loss}


def _per_device_step(state, batch):
  loss, grads = jax.value_and_grad(_loss)(state["params"], batch)
  grads = jax.lax.pmean(grads, "data")
  params = jax.tree.map(lambda p, g: p - 0.01 * g, state["params"], grads)
  return {"params": params, "step": state["step"] + 1}, {"loss": jax.lax.pmean(loss, "data")}


def _state():
  k1, k2 = jax.random.split(jax.random.key(0))
  return {"params": {"w1": jax.random.normal(k1, (IN, HID)) * 0.1,
                     "w2": jax.random.normal(k2, (HID, OUT)) * 0.1},
          "step": jnp.zeros((), jnp.int32)}


def _batches(n):
  rng = np.random.default_rng(0)
  return [{"x": rng.normal(size=(B, IN)).astype(np.float32),
           "y": rng.normal(size=(B, OUT)).astype(np.float32)} for _ in range(n)]


class Recorder:
  def __init__(self):
    self.rows = []

  def write_scalars(self, step, scalars):
    self.rows.append((step, dict(scalars)))


@pytest.mark.parametrize("style", ["global", "per_device"])
def test_flops_per_step_are_the_mlps_for_every_k_and_compile_nothing(style):
  """K = 1 and K = 3 report one step's FLOPs (XLA counts the loop body once), within 10% above
  the analytic matmul count; reading them lowers, traces and compiles nothing."""
  step = _global_step if style == "global" else _per_device_step
  flops = {}
  for k in (1, 3):
    loop = loopkit.TrainLoop(step, iterations_per_loop=k, step_style=style)
    assert loop.program.flops_per_step() is None  # nothing compiled yet
    loop.run(_state(), _batches(6), num_steps=6)
    before = lowering_count()
    flops[k] = loop.program.flops_per_step()
    assert lowering_count() == before  # the cached lowering and executable: no compile
    assert loop.program.flops_per_step() == flops[k]  # cached
    assert loop.program.compile_count() == 1 and loop.program.trace_count == 1
    assert loop.program.cost_analysis()["flops"] == flops[k]
  assert ANALYTIC <= flops[1] < 1.1 * ANALYTIC, (flops, ANALYTIC)
  # equal up to the reductions of the [K] metric traces after the loop (measured: 42 FLOPs)
  assert abs(flops[3] - flops[1]) < 1e-3 * ANALYTIC, flops


def test_flops_per_step_of_a_sharded_state_are_one_devices_share():
  """Parameters split over a ``model`` axis, the batch over ``data`` ((4, 2) mesh): each device
  computes a quarter of the batch through half of each layer, 1/8 of the step like the
  data-parallel run; the cost is read from the cached executable all the same."""
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  state = _state()
  specs = {"w1": P(None, "model"), "w2": P("model", None)}
  state["params"] = {k: jax.device_put(v, NamedSharding(mesh, specs[k]))
                     for k, v in state["params"].items()}
  loop = loopkit.TrainLoop(_global_step, iterations_per_loop=2, mesh=mesh, data_axis="data")
  state = loop.run(state, _batches(4), num_steps=4)
  assert state["params"]["w1"].sharding.spec == P(None, "model")
  before = lowering_count()
  flops = loop.program.flops_per_step()
  assert lowering_count() == before and loop.program.compile_count() == 1
  assert ANALYTIC <= flops < 1.1 * ANALYTIC, (flops, ANALYTIC)


def test_a_cache_miss_gives_no_flops_instead_of_a_second_compile():
  """With JAX's caches cleared, reading the cost would compile the program again: loopkit
  lowers (and finds the miss), compiles nothing, and reports no FLOPs."""
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, secs, **kw: compiles.append(event) if event == BACKEND_COMPILE else None)
  loop = loopkit.TrainLoop(_global_step, iterations_per_loop=2)
  loop.run(_state(), _batches(2), num_steps=2)
  jax.clear_caches()
  del compiles[:]
  assert loop.program.flops_per_step() is None and loop.program.cost_analysis() is None
  assert compiles == [] and loop.program.compile_count() == 1


def _throughput_run(monkeypatch, hooks, k=2, steps=12):
  clock = toy.FakeClock()
  loop = loopkit.TrainLoop(_global_step, iterations_per_loop=k,
                           hooks=[toy.Tick(clock, 0.5)] + [h(clock) for h in hooks])
  loop.run(_state(), _batches(steps), num_steps=steps)
  assert loop.program.compile_count() == 1 and loop.program.trace_count == 1
  return loop


def test_tflops_and_mfu_rows_are_the_flops_over_the_loop_seconds_and_the_peak(monkeypatch):
  """A peak registered for this machine's device kind (the table is keyed by
  ``jax.Device.device_kind``): each row's TFLOP/s is FLOPs per step x the window's steps over
  its loop seconds (``loop_secs_per_call x calls``, from the row); MFU divides by the bf16 or
  float32 peak as asked, or by ``peak_flops_per_device``."""
  kind = jax.devices()[0].device_kind
  monkeypatch.setitem(peaks.PEAKS, kind, peaks.Peak(2e12, 0.5e12, "test"))
  recs = {"bf16": Recorder(), "f32": Recorder(), "given": Recorder()}
  loop = _throughput_run(monkeypatch, [
      lambda c: loopkit.LoggingHook(recs["bf16"], every_steps=4, clock=c),
      lambda c: loopkit.LoggingHook(recs["f32"], every_steps=4, clock=c, peak_dtype=jnp.float32),
      lambda c: loopkit.LoggingHook(recs["given"], every_steps=4, clock=c,
                                    peak_flops_per_device=4e12)])
  flops = loop.program.flops_per_step()
  assert ANALYTIC <= flops < 1.1 * ANALYTIC
  for name, peak in (("bf16", 2e12), ("f32", 0.5e12), ("given", 4e12)):
    rows = dict(recs[name].rows)
    assert sorted(rows) == [4, 8, 12]
    for step in (4, 8, 12):
      row = rows[step]
      calls = 2  # 4 steps per row at K = 2
      tflops = flops * 4 / (row["throughput/loop_secs_per_call"] * calls) / 1e12
      assert row["throughput/tflops_per_device"] == tflops
      assert row["throughput/mfu"] == tflops * 1e12 / peak
      # the fake clock: 0.5 s per step, less the hooks' (real) microseconds
      assert flops * 4 / 2.0 / 1e12 <= tflops < 1.05 * flops * 4 / 2.0 / 1e12


def test_cpu_rows_have_tflops_but_no_mfu_and_say_why_once(monkeypatch, caplog):
  rec = Recorder()
  with caplog.at_level(logging.INFO, logger="loopkit"):
    loop = _throughput_run(monkeypatch, [lambda c: loopkit.LoggingHook(rec, every_steps=4,
                                                                      clock=c)])
  rows = dict(rec.rows)
  assert sorted(rows) == [4, 8, 12]
  for step in (4, 8, 12):
    assert rows[step]["throughput/tflops_per_device"] > 0
    assert "throughput/mfu" not in rows[step]
  why = [r.getMessage() for r in caplog.records if "no throughput/mfu" in r.getMessage()]
  assert len(why) == 1, why  # once per run, not per row
  assert f"device kind {jax.devices()[0].device_kind!r} is not in loopkit.observe.peaks.PEAKS" \
      in why[0] and "peak_flops_per_device" in why[0]
  assert f"{loop.program.flops_per_step():.6g} FLOPs per step per device" in why[0]


def test_a_known_chip_without_a_float32_peak_says_so(monkeypatch, caplog):
  """A TPU entry has no float32 number (Google publishes none): no MFU row in float32."""
  kind = jax.devices()[0].device_kind
  monkeypatch.setitem(peaks.PEAKS, kind, peaks.PEAKS["TPU v5 lite"])
  rec = Recorder()
  with caplog.at_level(logging.INFO, logger="loopkit"):
    _throughput_run(monkeypatch, [lambda c: loopkit.LoggingHook(
        rec, every_steps=4, clock=c, peak_dtype="float32")], steps=8)
  assert all("throughput/mfu" not in r and "throughput/tflops_per_device" in r
             for _, r in rec.rows[1:])
  assert f"device kind {kind!r} has no float32 peak" in caplog.text


@pytest.mark.parametrize("bad", ["float16", "bf16", None])
def test_peak_dtype_other_than_bf16_or_f32_is_refused(bad):
  with pytest.raises(ValueError, match=f"peak_dtype {bad!r} has no column"):
    loopkit.LoggingHook(peak_dtype=bad)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), "1e12"])
def test_peak_flops_per_device_must_be_positive(bad):
  with pytest.raises(ValueError, match=re.escape(f"got {bad!r}")):
    loopkit.LoggingHook(peak_flops_per_device=bad)


def test_peaks_table_and_the_aot_chips_share_their_numbers():
  """One number per chip: the AOT report's compute bound and MFU use the same bf16 peak."""
  for chip in topology.CHIPS.values():
    peak = peaks.PEAKS[chip.device_kind]
    assert chip.peak_bf16_flops == peak.bf16_flops and chip.source == peak.source
    assert peak.f32_flops is None  # Google's pages give no float32 rate
  assert peaks.peak_flops("NVIDIA H100 80GB HBM3") == 989.5e12  # 1,979 with sparsity, halved
  assert peaks.peak_flops("NVIDIA H200", jnp.float32) == 67e12
  assert peaks.peak_flops("NVIDIA A100-SXM4-80GB", "bfloat16") == 312e12
  assert peaks.peak_flops("cpu") is None
