"""Convolutions relaid out into canonical order inside the loop body (loopkit.conv_layout)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import loopkit
from loopkit import conv_layout
from tests import bootstrap, toy

CANONICAL_2D = "b01f_01io->b01f"

# (lhs shape, kernel shape, dimension numbers, keyword arguments)
CONVS = [
    ((4, 9, 9, 3), (3, 3, 3, 5), ("NHWC", "HWIO", "NHWC"), dict(window_strides=(1, 1),
                                                               padding="SAME")),
    ((4, 9, 9, 3), (3, 3, 3, 5), ("NHWC", "HWIO", "NHWC"), dict(window_strides=(2, 2),
                                                               padding="SAME")),
    ((4, 3, 9, 9), (5, 3, 3, 3), ("NCHW", "OIHW", "NCHW"), dict(window_strides=(1, 2),
                                                               padding="VALID")),
    ((4, 9, 9, 4), (3, 3, 2, 6), ("NHWC", "HWIO", "NHWC"), dict(
        window_strides=(1, 1), padding="SAME", rhs_dilation=(2, 2), feature_group_count=2)),
    ((4, 11, 3), (3, 3, 5), ("NWC", "WIO", "NWC"), dict(window_strides=(2,), padding="SAME")),
    ((2, 5, 6, 7, 2), (2, 2, 2, 2, 3), ("NDHWC", "DHWIO", "NDHWC"), dict(window_strides=(1, 1, 1),
                                                                        padding="SAME")),
]


def _inputs(lhs_shape, rhs_shape):
  kx, kw = jax.random.split(jax.random.key(0))
  return jax.random.normal(kx, lhs_shape), jax.random.normal(kw, rhs_shape) * 0.3


@pytest.mark.parametrize("lhs_shape,rhs_shape,dn,kw", CONVS)
def test_rewritten_gradients_equal_the_plain_ones(lhs_shape, rhs_shape, dn, kw):
  x, w = _inputs(lhs_shape, rhs_shape)

  def loss(x, w):
    return jnp.sum(jnp.tanh(lax.conv_general_dilated(x, w, dimension_numbers=dn, **kw)))

  closed = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w)
  rewritable, unreached = conv_layout.count_convs(closed)
  assert unreached == 0
  assert rewritable >= 2  # the input gradient and the kernel gradient at least
  plain = jax.jit(jax.extend.core.jaxpr_as_fun(closed))(x, w)
  canonical = jax.jit(conv_layout.canonicalize_convs(closed))(x, w)
  for p, c in zip(plain, canonical):
    assert p.shape == c.shape and p.dtype == c.dtype
    np.testing.assert_allclose(np.asarray(c), np.asarray(p), rtol=1e-5, atol=1e-5)


def test_nhwc_gradients_are_bitwise_equal_and_counted():
  x, w = _inputs((4, 9, 9, 3), (3, 3, 3, 5))

  def loss(x, w):
    y = lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jnp.sum(y ** 2)

  closed = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w)
  # The forward conv is canonical; the kernel and input gradients are not.
  assert conv_layout.count_convs(closed) == (2, 0)
  plain = jax.jit(jax.extend.core.jaxpr_as_fun(closed))(x, w)
  canonical = jax.jit(conv_layout.canonicalize_convs(closed))(x, w)
  for p, c in zip(plain, canonical):
    np.testing.assert_array_equal(np.asarray(c), np.asarray(p))


def test_nested_jit_is_inlined_and_other_primitives_are_counted_unreached():
  x, w = _inputs((4, 9, 9, 3), (3, 3, 3, 5))
  conv = jax.jit(lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                                       dimension_numbers=("NHWC", "HWIO", "NHWC")))
  grad = jax.grad(lambda x, w: jnp.sum(conv(x, w) ** 2), argnums=(0, 1))
  closed = jax.make_jaxpr(jax.jit(grad))(x, w)
  assert conv_layout.count_convs(closed) == (2, 0)
  in_cond = jax.make_jaxpr(lambda x, w: lax.cond(True, grad, grad, x, w))(x, w)
  assert conv_layout.count_convs(in_cond) == (0, 4)  # two in each branch: left as they are
  out = jax.jit(conv_layout.canonicalize_convs(closed))(x, w)
  ref = jax.jit(grad)(x, w)
  for p, c in zip(ref, out):
    np.testing.assert_allclose(np.asarray(c), np.asarray(p), rtol=1e-6, atol=1e-6)


def test_a_function_without_convolutions_is_evaluated_unchanged():
  closed = jax.make_jaxpr(lambda a: jnp.sin(a) * 2)(jnp.ones(3))
  assert conv_layout.count_convs(closed) == (0, 0)
  assert conv_layout.canonicalize_convs(closed)(jnp.ones(3))[0].tolist() == pytest.approx(
      [2 * np.sin(1.0)] * 3)


# -- in the multi-step program -----------------------------------------------------

TX = optax.sgd(0.05)


def _cnn_params(seed=0):
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  return {"c1": jax.random.normal(k1, (3, 3, 2, 4)) * 0.3,
          "c2": jax.random.normal(k2, (3, 3, 4, 4)) * 0.3,
          "d": jax.random.normal(k3, (4 * 4 * 4, 3)) * 0.1}


def _cnn_loss(p, batch):
  dn = ("NHWC", "HWIO", "NHWC")
  h = jax.nn.relu(lax.conv_general_dilated(batch["x"], p["c1"], (2, 2), "SAME",
                                           dimension_numbers=dn))
  h = jax.nn.relu(lax.conv_general_dilated(h, p["c2"], (1, 1), "SAME", dimension_numbers=dn))
  logits = h.reshape(h.shape[0], -1) @ p["d"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def _cnn_step(state, batch):
  loss, grads = jax.value_and_grad(_cnn_loss)(state["params"], batch)
  updates, opt = TX.update(grads, state["opt"], state["params"])
  return ({"params": optax.apply_updates(state["params"], updates), "opt": opt,
           "step": state["step"] + 1}, {"loss": loss})


def _cnn_state():
  p = _cnn_params()
  return {"params": p, "opt": TX.init(p), "step": jnp.zeros((), jnp.int32)}


def _cnn_batches(n, b=8):
  rng = np.random.default_rng(0)
  return [{"x": rng.normal(size=(b, 8, 8, 2)).astype(np.float32),
           "y": rng.integers(0, 3, size=(b,)).astype(np.int32)} for _ in range(n)]


def _conv_labels(program, state, batches):
  chunk = jax.tree.map(lambda *xs: np.stack(xs), *batches[:program.iterations_per_loop])
  state = program.place_state(state)
  hlo = program._jitted.lower(state, jax.device_put(chunk, program.batch_sharding),
                              jax.device_put(np.int32(1), program.replicated)).compile().as_text()
  return re.findall(r"convolution\(.*?dim_labels=([^,]+)", hlo)


@pytest.mark.parametrize("canonical", [True, False])
def test_program_on_cpu_compiles_only_canonical_convolutions(canonical):
  program = loopkit.core.MultiStepProgram(_cnn_step, iterations_per_loop=3,
                                     mesh=loopkit.data_parallel_mesh(),
                                     canonical_convs=canonical)
  labels = _conv_labels(program, _cnn_state(), _cnn_batches(3))
  assert len(labels) == 5  # 2 forward, 2 kernel gradients, 1 input gradient
  if canonical:
    assert labels == [CANONICAL_2D] * 5
  else:  # what XLA:CPU keeps inside a loop body without the rewrite (jax-ml/jax#12868)
    assert any(label != CANONICAL_2D for label in labels)


def test_default_is_on_for_a_cpu_mesh():
  program = loopkit.core.MultiStepProgram(_cnn_step, iterations_per_loop=2,
                                     mesh=loopkit.data_parallel_mesh())
  assert program.canonical_convs is True
  loop = loopkit.TrainLoop(_cnn_step, iterations_per_loop=2, canonical_convs=False)
  assert loop.program.canonical_convs is False


@pytest.mark.parametrize("style", ["global", "per_device"])
def test_cnn_final_params_bitwise_equal_across_k_and_close_to_a_jit_loop(style):
  n = 10
  data = _cnn_batches(n, b=16)
  step = _cnn_step
  if style == "per_device":
    def step(state, batch):
      loss, grads = jax.value_and_grad(_cnn_loss)(state["params"], batch)
      grads, loss = jax.lax.pmean((grads, loss), "data")
      updates, opt = TX.update(grads, state["opt"], state["params"])
      return ({"params": optax.apply_updates(state["params"], updates), "opt": opt,
               "step": state["step"] + 1}, {"loss": loss})
  finals = {}
  for k in (1, 3, 4, n):
    loop = loopkit.TrainLoop(step, iterations_per_loop=k, step_style=style, prefetch=0)
    assert loop.program.canonical_convs
    finals[k] = jax.device_get(loop.run(_cnn_state(), iter(data), num_steps=n))
    assert loop.program.compile_count() == 1
    assert int(finals[k]["step"]) == n
  for k in (3, 4, n):
    jax.tree.map(np.testing.assert_array_equal, finals[k], finals[1])
  mesh = loopkit.data_parallel_mesh()
  jitted = jax.jit(_cnn_step, in_shardings=(NamedSharding(mesh, P()),
                                            NamedSharding(mesh, P("data"))))
  state = _cnn_state()
  for b in data:
    state, _ = jitted(state, b)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               finals[1]["params"], jax.device_get(state["params"]))


@pytest.mark.parametrize("size,kernel,stride,pad", [(8, 3, 1, 1), (8, 3, 2, 1), (7, 3, 2, 1),
                                                    (32, 7, 2, 3), (8, 1, 2, 0), (9, 1, 1, 0)])
def test_resnet_convolutions_bitwise_on_one_device_and_under_explicit_sharding(
    size, kernel, stride, pad):
  """The ResNet's convolutions (stem, 3x3, strided, 1x1 projections), plain vs rewritten."""
  dn = ("NHWC", "HWIO", "NHWC")

  def loss(x, w):
    y = lax.conv_general_dilated(x, w, (stride, stride), ((pad, pad), (pad, pad)),
                                 dimension_numbers=dn)
    return jnp.sum(jnp.sin(y))

  x = jax.random.normal(jax.random.key(0), (16, size, size, 5))
  w = jax.random.normal(jax.random.key(1), (kernel, kernel, 5, 6))
  grad = jax.value_and_grad(loss, (0, 1))
  ref = jax.jit(grad)(x, w)
  got = jax.jit(conv_layout.with_canonical_convs(grad))(x, w)
  jax.tree.map(np.testing.assert_array_equal, ref, got)
  mesh = jax.make_mesh((8,), ("data",))  # jax's default: Explicit axes
  xs = jax.device_put(x, NamedSharding(mesh, P("data")))
  ws = jax.device_put(w, NamedSharding(mesh, P()))
  closed = jax.make_jaxpr(grad)(xs, ws)
  assert conv_layout.count_convs(closed)[0] >= 1
  sharded = jax.jit(conv_layout.canonicalize_convs(closed))(xs, ws)
  for want, have in zip(jax.tree.leaves(ref), sharded, strict=True):
    np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-4)
  assert sharded[2].sharding.is_fully_replicated  # the kernel gradient, all-reduced


# -- float32, float16, bfloat16: the loop equals the per-step program bitwise (case C51) -------
#
# XLA:CPU computes a bfloat16 convolution in float32 and, under its default excess precision,
# hands a user that converts the result to float32 the unrounded value (the kernel gradient of a
# bfloat16 conv layer with float32 parameters). The rewrite used to put its transpose back
# between the two, which rounded it: measured 2026-12-01 (jax 0.10.2) on _Net below, 3 steps,
# 1.4e-4 against jit on 1 device and 1.2e-4 against pmap on 4; float32 and float16 were equal.

FLOATS = pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16],
                                 ids=["float32", "float16", "bfloat16"])
ROOT = Path(__file__).resolve().parent.parent


@FLOATS
def test_c51_conv_layer_gradients_bitwise_equal_in_every_float_dtype(dtype):
  """A conv layer computing in ``dtype`` with float32 parameters, as Flax's ``nn.Conv(dtype=)``."""
  x, w = _inputs((4, 9, 9, 3), (3, 3, 3, 5))

  def loss(w, x):
    y = lax.conv_general_dilated(x.astype(dtype), w.astype(dtype), (1, 1), "SAME",
                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jnp.sum(jnp.tanh(y.astype(jnp.float32)))

  grad = jax.grad(loss, argnums=(0, 1))
  closed = jax.make_jaxpr(grad)(w, x)
  assert conv_layout.count_convs(closed) == (2, 0)
  toy.assert_bitwise(jax.jit(grad)(w, x),
                     tuple(jax.jit(conv_layout.canonicalize_convs(closed))(w, x)))


def test_c51_conv_layer_gradients_bitwise_without_excess_precision_too():
  """The test above with ``--xla_allow_excess_precision=false`` (XLA then rounds every bfloat16
  result): the rewrite rounds where the plain program does under either setting."""
  env = {**os.environ, "XLA_FLAGS": "--xla_allow_excess_precision=false", "PYTHONPATH": str(ROOT)}
  out = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{__file__}::"
       "test_c51_conv_layer_gradients_bitwise_equal_in_every_float_dtype"],
      capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
  assert "3 passed" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]


def test_c51_convert_outside_a_nested_jit_is_applied_before_the_transpose_back():
  dn = ("NHWC", "HWIO", "NHWC")
  conv = jax.jit(lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                                       dimension_numbers=dn))

  def loss(w, x):  # the casts outside the jit: the kernel gradient's convert is outside too
    return jnp.sum(conv(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)).astype(jnp.float32) ** 2)

  x, w = _inputs((4, 9, 9, 3), (3, 3, 3, 5))
  grad = jax.grad(loss)
  closed = jax.make_jaxpr(grad)(w, x)
  assert conv_layout.count_convs(closed) == (1, 0)  # the kernel gradient, in a nested jit
  toy.assert_bitwise(jax.jit(grad)(w, x), jax.jit(conv_layout.canonicalize_convs(closed))(w, x)[0])


class _Net(nn.Module):
  """3x3 conv -> ReLU -> 3x3/2 conv -> mean pool -> dense(3), computing in ``dtype``."""

  dtype: Any

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(8, (3, 3), dtype=self.dtype)(x))
    x = nn.Conv(4, (3, 3), strides=2, dtype=self.dtype)(x)
    return nn.Dense(3, dtype=self.dtype)(jnp.mean(x, axis=(1, 2)))


NET_STEPS = 3


def _net(dtype, axis=None):
  """(state, step, batches) for _Net; float32 parameters; the step pmeans over ``axis`` if set."""
  model = _Net(dtype)
  tx = optax.sgd(0.1, momentum=0.9)
  rng = np.random.default_rng(0)
  data = [{"x": rng.normal(size=(16, 8, 8, 3)).astype(np.float32),
           "y": rng.integers(0, 3, 16).astype(np.int32)} for _ in range(NET_STEPS)]
  params = model.init(jax.random.key(0), data[0]["x"][:1])["params"]

  def step(state, batch):
    def loss_fn(p):
      logits = model.apply({"params": p}, batch["x"]).astype(jnp.float32)
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    if axis is not None:
      grads, loss = lax.pmean((grads, loss), axis)
    updates, opt = tx.update(grads, state["opt"], state["params"])
    return ({"params": optax.apply_updates(state["params"], updates), "opt": opt,
             "step": state["step"] + 1}, {"loss": loss})

  return {"params": params, "opt": tx.init(params), "step": jnp.zeros((), jnp.int32)}, step, data


def _per_step_jit(state, step, data, mesh):
  """The final state (on the host) of ``step`` under a per-step ``jit`` over ``data``, the state
  replicated and the batch on the mesh's data axis."""
  jitted = jax.jit(step, in_shardings=(NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))))
  for batch in data:
    state, _ = jitted(state, batch)
  return jax.device_get(state)


@FLOATS
@pytest.mark.parametrize("ndev", [1, 4])
def test_c51_loop_at_k1_equals_jit_bitwise_in_every_float_dtype(dtype, ndev):
  state, step, data = _net(dtype)
  mesh = loopkit.data_parallel_mesh(devices=jax.devices()[:ndev])
  loop = loopkit.TrainLoop(step, iterations_per_loop=1, mesh=mesh, prefetch=0)
  assert loop.program.canonical_convs
  got = jax.device_get(loop.run(jax.tree.map(jnp.copy, state), iter(data), num_steps=NET_STEPS))
  toy.assert_bitwise(got, _per_step_jit(state, step, data, mesh))


@FLOATS
def test_c51_per_device_loop_at_k1_equals_pmap_bitwise_in_every_float_dtype(dtype):
  ndev = 4
  state, step, data = _net(dtype, "data")
  loop = loopkit.TrainLoop(step, iterations_per_loop=1, step_style="per_device", prefetch=0,
                           mesh=loopkit.data_parallel_mesh(devices=jax.devices()[:ndev]))
  got = jax.device_get(loop.run(jax.tree.map(jnp.copy, state), iter(data), num_steps=NET_STEPS))
  pmapped = jax.pmap(step, axis_name="data", devices=jax.devices()[:ndev])
  replicas = jax.tree.map(lambda x: np.stack([np.asarray(x)] * ndev), state)
  for batch in data:
    replicas, _ = pmapped(replicas, jax.tree.map(
        lambda x: x.reshape(ndev, -1, *x.shape[1:]), batch))
  toy.assert_bitwise(got, jax.tree.map(lambda x: x[0], jax.device_get(replicas)))


_NATIVE_ISA_CODE = """
import json
import jax, jax.numpy as jnp, numpy as np
import loopkit
from tests import test_conv_layout as t
state, step, data = t._net(jnp.float32)
mesh = loopkit.data_parallel_mesh()
runs = {}
for k in (1, 3):
  loop = loopkit.TrainLoop(step, iterations_per_loop=k, mesh=mesh, prefetch=0)
  runs[k] = jax.device_get(loop.run(jax.tree.map(jnp.copy, state), iter(data),
                                    num_steps=t.NET_STEPS))
want = t._per_step_jit(state, step, data, mesh)
print(json.dumps({
    "k_equal": all(np.array_equal(a, b) for a, b in zip(*map(jax.tree.leaves, runs.values()))),
    "diff": [[float(np.max(np.abs(a - b))), float(np.max(np.abs(b)))]
             for a, b in zip(jax.tree.leaves(runs[1]), jax.tree.leaves(want))]}))
"""


def test_native_isa_k_invariant_and_within_a_bound_of_jit():
  """The suite caps XLA:CPU's code at AVX2 (conftest.py); here the net of the C51 tests runs on
  4 devices with the machine's own instruction set. On an AVX-512 x86 CPU with jax 0.12 the loop
  program's step and a per-step ``jit`` round differently in the last bits (measured on an AMD
  EPYC, 2026-12-04: 6 of 13 leaves off after 3 steps, at most 3.0e-8 in values up to 0.87;
  jax 0.10.2 there: none); K = 1 and K = 3 stay bitwise equal to each other everywhere, and
  the distance to ``jit`` stays at float32 rounding (within 1e-6 of each leaf's largest
  value)."""
  flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                   if not f.startswith("--xla_cpu_max_isa"))
  out = subprocess.run(bootstrap.command("-c", _NATIVE_ISA_CODE, devices=4),
                       env=bootstrap.env(XLA_FLAGS=flags), capture_output=True, text=True,
                       cwd=ROOT, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  got = json.loads(out.stdout.splitlines()[-1])
  assert got["k_equal"]
  assert len(got["diff"]) == 13  # 6 parameters, their 6 momenta, the step
  for diff, scale in got["diff"]:
    assert diff <= 1e-6 * max(scale, 1e-3), got
