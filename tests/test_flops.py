"""FLOPs per step of steps with inner loops (layers in a ``lax.scan``): XLA's cost analysis
counts a while loop's body once, so a scanned model's step was reported about L times low;
loopkit counts the step's jaxpr (:mod:`loopkit.core.flops`) and, where XLA's count is lower,
adds the matmul FLOPs of the inner loops' other trips.

The model: ``x @ w_in``, then L = 6 ReLU layers ``W x W`` (stacked ``[L, W, W]`` applied by a
``lax.scan``, or L separate arrays applied in turn), then ``@ w_out``. Per step and device
(``b = B / 8`` rows), the matmul FLOPs are ``2 b (2 IN W + 3 L W W + 3 W OUT)``: forward and weight
gradient of every matmul, and the activations' gradient of all but the input layer (the input is
data).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import loopkit
from loopkit._internal.compat import lowering_count
from loopkit.core.flops import jaxpr_flops, step_flops

B, IN, W, OUT, L = 512, 32, 64, 16, 6
DEVICES = 8
ANALYTIC = 2 * (B // DEVICES) * (2 * IN * W + 3 * L * W * W + 3 * W * OUT)


def _forward(params, x, scanned):
  h = x @ params["w_in"]
  if scanned:
    h, _ = jax.lax.scan(lambda h, w: (jax.nn.relu(h @ w), None), h, params["layers"])
  else:
    for w in params["layers"]:  # L separate [W, W] arrays
      h = jax.nn.relu(h @ w)
  return h @ params["w_out"]


def _step(scanned):
  def step(state, batch):
    def loss_fn(p):
      return jnp.mean((_forward(p, batch["x"], scanned) - batch["y"]) ** 2)
    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    params = jax.tree.map(lambda p, g: p - 0.01 * g, state["params"], grads)
    return {"params": params, "step": state["step"] + 1}, {"loss": loss}
  return step


def _state(scanned=True):
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  layers = jax.random.normal(k2, (L, W, W)) * 0.1  # stacked for the scan, else a list
  return {"params": {"w_in": jax.random.normal(k1, (IN, W)) * 0.1,
                     "layers": layers if scanned else list(layers),
                     "w_out": jax.random.normal(k3, (W, OUT)) * 0.1},
          "step": jnp.zeros((), jnp.int32)}


def _batches(n):
  rng = np.random.default_rng(0)
  return [{"x": rng.normal(size=(B, IN)).astype(np.float32),
           "y": rng.normal(size=(B, OUT)).astype(np.float32)} for _ in range(n)]


def _run(scanned, k=2, mesh=None, state=None, **kw):
  loop = loopkit.TrainLoop(_step(scanned), iterations_per_loop=k, mesh=mesh, **kw)
  loop.run(_state(scanned) if state is None else state, _batches(2 * k), num_steps=2 * k)
  assert loop.program.compile_count() == 1 and loop.program.trace_count == 1
  return loop.program


def test_scanned_layers_count_as_many_flops_as_unrolled_ones():
  """XLA counts the scanned model's layer loop once (well under half the unrolled count);
  flops_per_step adds the matmul FLOPs of the loop's other trips (the jaxpr's count less its
  count with loop bodies once) and is within 1% of the unrolled model's (XLA's count, whose
  elementwise work is all counted, the scanned loop's only once)."""
  scanned, unrolled = _run(True), _run(False)
  xla_scanned = scanned.cost_analysis()["flops"]
  xla_unrolled = unrolled.cost_analysis()["flops"]
  assert xla_scanned < 0.5 * xla_unrolled, (xla_scanned, xla_unrolled)  # the undercount
  before = lowering_count()
  got_scanned, got_unrolled = scanned.flops_per_step(), unrolled.flops_per_step()
  assert lowering_count() == before  # nothing lowered or compiled to answer
  assert scanned.step_jaxpr_flops == unrolled.step_jaxpr_flops == ANALYTIC
  assert unrolled.step_jaxpr_flops_once == ANALYTIC
  # one trip of the forward and of the backward layer scan
  once = 2 * (B // DEVICES) * (2 * IN * W + 3 * W * W + 3 * W * OUT)
  assert scanned.step_jaxpr_flops_once == once
  assert got_scanned == xla_scanned + ANALYTIC - once
  assert got_unrolled == xla_unrolled  # no inner loop: XLA's count as it is
  assert ANALYTIC <= got_unrolled < 1.05 * ANALYTIC, (got_unrolled, ANALYTIC)
  assert abs(got_scanned / got_unrolled - 1) < 0.01, (got_scanned, got_unrolled, xla_scanned)


def test_flops_per_step_is_the_same_for_k_1_and_k_4():
  one, four = _run(True, k=1), _run(True, k=4)
  # up to the reductions of the [K] metric traces after the loop (a few FLOPs per slot)
  assert abs(one.flops_per_step() - four.flops_per_step()) < 1e-4 * ANALYTIC
  assert ANALYTIC <= one.flops_per_step() < 1.05 * ANALYTIC
  assert one.cost_analysis()["flops"] < 0.5 * ANALYTIC  # XLA's own count


def test_sharded_2x2x2_mesh_counts_one_devices_share():
  """Batch over ("data", "fsdp"), layers split over "tensor": each device computes 1/8 of the
  step; the jaxpr's global count divided by the 8 devices is that share."""
  mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 3)
  state = _state()
  specs = {"w_in": P(None, "tensor"), "layers": P(None, None, "tensor"),
           "w_out": P("tensor", None)}
  state["params"] = {k: jax.device_put(v, NamedSharding(mesh, specs[k]))
                     for k, v in state["params"].items()}
  program = _run(True, mesh=mesh, state=state, data_axis=("data", "fsdp"))
  assert program.step_jaxpr_flops == ANALYTIC
  assert program.cost_analysis()["flops"] < 0.5 * ANALYTIC
  assert ANALYTIC <= program.flops_per_step() < 1.05 * ANALYTIC


def test_per_device_style_counts_its_own_slice():
  def step(state, batch):
    def loss_fn(p):
      return jnp.mean((_forward(p, batch["x"], True) - batch["y"]) ** 2)
    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    grads = jax.lax.pmean(grads, "data")
    params = jax.tree.map(lambda p, g: p - 0.01 * g, state["params"], grads)
    return {"params": params, "step": state["step"] + 1}, {"loss": jax.lax.pmean(loss, "data")}
  loop = loopkit.TrainLoop(step, iterations_per_loop=2, step_style="per_device")
  loop.run(_state(), _batches(2), num_steps=2)
  assert loop.program.step_jaxpr_flops == ANALYTIC
  assert ANALYTIC <= loop.program.flops_per_step() < 1.05 * ANALYTIC


def test_dense_and_conv_counts_are_exact():
  x, w = jnp.zeros((B, IN)), jnp.zeros((IN, OUT))
  assert jaxpr_flops(jax.make_jaxpr(lambda x, w: x @ w)(x, w)) == 2 * B * IN * OUT
  # batched dot: [4, 8, 16] x [4, 16, 32]
  a, b = jnp.zeros((4, 8, 16)), jnp.zeros((4, 16, 32))
  assert jaxpr_flops(jax.make_jaxpr(jnp.matmul)(a, b)) == 2 * 4 * 8 * 16 * 32
  # conv NHWC [2, 10, 10, 6], kernel HWIO [3, 3, 3, 8] in 2 groups, SAME: 2 x out x 3 x 3 x 3
  img, ker = jnp.zeros((2, 10, 10, 6)), jnp.zeros((3, 3, 3, 8))
  conv = jax.make_jaxpr(lambda i, k: jax.lax.conv_general_dilated(
      i, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
      feature_group_count=2))(img, ker)
  assert jaxpr_flops(conv) == 2 * (2 * 10 * 10 * 8) * (3 * 3 * 3)


def test_scan_cond_and_while_nesting():
  x, w = jnp.zeros((8, 16)), jnp.zeros((16, 16))
  dot = 2 * 8 * 16 * 16

  def scanned(x, w):  # 3 x (2 x 5 dots), a jit and a remat inside
    def inner(h, _):
      return jax.checkpoint(lambda h: h @ w)(h), None

    def outer(h, _):
      h, _ = jax.lax.scan(inner, h, None, length=5)
      return jax.jit(lambda h: h @ w)(h) @ w, None
    return jax.lax.scan(outer, x, None, length=3)[0]
  assert jaxpr_flops(jax.make_jaxpr(scanned)(x, w)) == 3 * (5 + 2) * dot
  # static fori_loop is a scan; cond counts its costliest branch
  fori = jax.make_jaxpr(lambda x, w: jax.lax.fori_loop(0, 4, lambda i, h: h @ w, x))(x, w)
  assert jaxpr_flops(fori) == 4 * dot
  cond = jax.make_jaxpr(lambda p, x, w: jax.lax.cond(p, lambda x: x @ w @ w, lambda x: x, x))(
      True, x, w)
  assert jaxpr_flops(cond) == 2 * dot
  # a while loop with a traced trip count: unknown; without matmuls inside: counted
  n = jnp.int32(3)
  loop = jax.make_jaxpr(lambda n, x, w: jax.lax.fori_loop(0, n, lambda i, h: h @ w, x))(n, x, w)
  assert jaxpr_flops(loop) is None
  cheap = jax.make_jaxpr(lambda n, x, w: jax.lax.fori_loop(0, n, lambda i, h: h + 1, x) @ w)(
      n, x, w)
  assert jaxpr_flops(cheap) == dot


def test_a_shard_map_body_counts_for_every_device_it_maps_over():
  mesh = jax.make_mesh((DEVICES,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  x, w = jnp.zeros((B, IN)), jnp.zeros((IN, OUT))
  mapped = jax.shard_map(lambda x, w: x @ w, mesh=mesh, in_specs=(P("data"), P()),
                         out_specs=P("data"))
  assert jaxpr_flops(jax.make_jaxpr(mapped)(x, w)) == 2 * B * IN * OUT


@pytest.mark.parametrize("xla, own, once, want", [
    (100.0, 90.0, 90.0, 100.0),  # no inner loop: XLA's
    (650.0, 600.0, 100.0, 650.0),  # XLA unrolled the loop: its count covers the jaxpr's
    (130.0, 600.0, 100.0, 630.0),  # a loop counted once: + 500 for its other trips
    (100.0, None, None, 100.0), (None, 50.0, 10.0, 50.0), (0.0, None, None, None),
    (None, None, None, None)])
def test_step_flops_adds_the_inner_loops_other_trips_only_above_xlas(xla, own, once, want):
  assert step_flops(xla, own, once) == want
