"""K never changes the program: cases C38 (K = 1 compiles like every K) and C39 (one compile).

C38: with K = 1 XLA used to fold the chunk's size-1 slot slice away, hoist the
step's batch-only computations out of the loop and fuse the rest differently
(loopkit/core/slot_loop.py, "The step compiles alike for every K"); in float16 and
bfloat16 that changed final parameters. The model here is the smallest found
that showed it: a Flax linen net whose first layer is a BatchNorm over the input
(batch-only statistics), then conv, BatchNorm, dense; global batch 256, 6 steps.
With the fix reverted (``MIN_SLOTS = 1`` in loopkit/_internal/checks.py) float16 global,
float16 per-device, bfloat16 global and the HLO comparison fail at K = 1;
bfloat16 per-device happens to agree even then and stays as a guard (measured
2026-12-01, jax 0.10.2, XLA:CPU, 8 fake devices). A plain conv net without
the input BatchNorm, and Flax's linen ResNet-18 (num_filters 8, 32x32, batch
64) did not differ in value here, though their K = 1 programs hoisted work too.

C51: the same, bitwise across K, with the convolutions relaid out into canonical order
(``canonical_convs``, on by default on CPU) in float32, float16 and bfloat16
(tests/test_conv_layout.py has the loop against ``jit`` and ``pmap``).

C39: a weak-typed leaf (a Python scalar, Flax's ``DynamicScale()``) used to
compile the program twice; any recompile now warns naming the leaf.
"""

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax.training import dynamic_scale as dynamic_scale_lib

import loopkit
from loopkit.core.program import RecompileWarning
from tests import toy

AXIS = "data"
BATCH = 256
STEPS = 6


class _Net(nn.Module):
  """BatchNorm(input) -> 3x3 conv -> BatchNorm -> ReLU -> mean pool -> dense(10)."""

  dtype: jnp.dtype
  axis_name: str | None

  @nn.compact
  def __call__(self, x):
    norm = functools.partial(nn.BatchNorm, use_running_average=False, momentum=0.9,
                             dtype=self.dtype, axis_name=self.axis_name)
    x = norm()(x)
    x = nn.Conv(4, (3, 3), use_bias=False, dtype=self.dtype)(x)
    x = nn.relu(norm()(x))
    return nn.Dense(10, dtype=self.dtype)(jnp.mean(x, axis=(1, 2)))


def _setup(dtype, style):
  model = _Net(dtype, AXIS if style == "per_device" else None)
  variables = model.init(jax.random.key(0), jnp.ones((1, 8, 8, 3), dtype))
  tx = optax.sgd(0.1, momentum=0.9)
  state = {"params": variables["params"], "batch_stats": variables["batch_stats"],
           "opt": tx.init(variables["params"]), "step": jnp.zeros((), jnp.int32)}

  def step(state, batch):
    def loss_fn(params):
      logits, new = model.apply({"params": params, "batch_stats": state["batch_stats"]},
                                batch["x"], mutable=["batch_stats"])
      labels = jax.nn.one_hot(batch["y"], 10)
      return jnp.mean(optax.softmax_cross_entropy(logits, labels)), new["batch_stats"]

    (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    if style == "per_device":
      grads, loss, stats = jax.lax.pmean((grads, loss, stats), AXIS)
    updates, opt = tx.update(grads, state["opt"], state["params"])
    return ({"params": optax.apply_updates(state["params"], updates), "batch_stats": stats,
             "opt": opt, "step": state["step"] + 1}, {"loss": loss})

  return state, step


def _data(dtype):
  rng = np.random.default_rng(0)
  return [{"x": rng.normal(size=(BATCH, 8, 8, 3)).astype(dtype),
           "y": rng.integers(0, 10, BATCH).astype(np.int32)} for _ in range(STEPS)]


def _program(k, dtype, style, canonical_convs=False):
  state, step = _setup(dtype, style)
  program = loopkit.core.MultiStepProgram(step, iterations_per_loop=k,
                                     mesh=loopkit.data_parallel_mesh(AXIS), data_axis=AXIS,
                                     style=style, canonical_convs=canonical_convs)
  return program, program.place_state(state)


def _chunk(program, batches):
  """Stacks up to K batches into a ``[K, B, ...]`` chunk (padded with the first)."""
  n = len(batches)
  full = batches + [batches[0]] * (program.iterations_per_loop - n)
  chunk = jax.tree.map(lambda *xs: np.stack(xs), *full)
  return (jax.device_put(chunk, program.batch_sharding),
          jax.device_put(np.int32(n), program.replicated))


def _train(k, dtype, style, canonical_convs=False, steps=STEPS):
  program, state = _program(k, dtype, style, canonical_convs)
  data = _data(dtype)[:steps]
  for i in range(0, steps, k):
    state, _ = program(state, *_chunk(program, data[i:i + k]))
  assert program.compile_count() == 1
  return jax.device_get(state)


_C38 = [pytest.param(dtype, style, id=f"{name}-{style}")
        for dtype, name in ((jnp.float16, "float16"), (jnp.bfloat16, "bfloat16"))
        for style in ("global", "per_device")]
_C51 = [pytest.param(jnp.float32, "global", id="float32-global"),
        pytest.param(jnp.float16, "global", id="float16-global"),
        pytest.param(jnp.bfloat16, "global", id="bfloat16-global"),
        pytest.param(jnp.bfloat16, "per_device", id="bfloat16-per_device")]
_HERE = "tests/test_k_invariance.py"


@pytest.mark.parametrize("dtype,style", _C38)
def test_c38_half_precision_batchnorm_final_state_bitwise_equal_for_k_1_and_2(dtype, style):
  """The case: K = 1 (one slot) against K = 2 (3 calls of 2)."""
  finals = {k: _train(k, dtype, style) for k in (1, 2)}
  assert int(finals[1]["step"]) == STEPS
  toy.assert_bitwise(finals[1], finals[2])


@pytest.mark.slow(held_by=f"{_HERE}::test_c38_half_precision_batchnorm_final_state_bitwise_equal_for_k_1_and_2",
                  reason="a third K (2 calls of 3) on the same models: 4 more compiles")
@pytest.mark.parametrize("dtype,style", _C38)
def test_c38_half_precision_batchnorm_final_state_bitwise_equal_for_k_2_and_3(dtype, style):
  finals = {k: _train(k, dtype, style) for k in (2, 3)}
  toy.assert_bitwise(finals[2], finals[3])


@pytest.mark.parametrize("dtype,style", _C51)
def test_c51_canonical_convs_final_state_bitwise_equal_for_k_1_and_2(dtype, style):
  """The same with the convolutions relaid out (the default on CPU), 3 steps: calls of 1 and
  2+1 (a partial call)."""
  finals = {k: _train(k, dtype, style, canonical_convs=True, steps=3) for k in (1, 2)}
  assert int(finals[1]["step"]) == 3
  toy.assert_bitwise(finals[1], finals[2])


@pytest.mark.slow(held_by=f"{_HERE}::test_c51_canonical_convs_final_state_bitwise_equal_for_k_1_and_2",
                  reason="a third K (one call of 3) on the same models: 4 more compiles")
@pytest.mark.parametrize("dtype,style", _C51)
def test_c51_canonical_convs_final_state_bitwise_equal_for_k_2_and_3(dtype, style):
  finals = {k: _train(k, dtype, style, canonical_convs=True, steps=3) for k in (2, 3)}
  toy.assert_bitwise(finals[2], finals[3])


def _while_body(hlo: str) -> list[str]:
  """The optimized while body of a compiled program, with names and numbers blanked."""
  while_line = next(line for line in hlo.splitlines() if " while(" in line)
  body = re.search(r"body=(%[\w.\-]+)", while_line).group(1)
  lines = hlo.splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith(body + " "))
  end = next(i for i in range(start, len(lines)) if lines[i].startswith("}"))
  return [re.sub(r"[.\d]+", "", re.sub(r", metadata=\{.*?\}", "", line))
          for line in lines[start:end]]


def test_c38_k1_compiles_the_same_loop_body_as_k2():
  bodies = []
  for k in (1, 2):
    program, state = _program(k, jnp.float16, "per_device")
    chunk, n = _chunk(program, _data(jnp.float16)[:k])
    bodies.append(_while_body(program._jitted.lower(state, chunk, n).compile().as_text()))
  assert len(bodies[0]) > 50  # the step is in there
  assert bodies[0] == bodies[1]


def test_k1_traces_have_one_slot():
  program, state = _program(1, jnp.float32, "global")
  state, out = program(state, *_chunk(program, _data(np.float32)[:1]))
  assert out.traces["loss"].total.shape == (1,)
  assert out.nonfinite.shape == (1,) and int(out.nonfinite[0]) == 0  # one metric, finite


# -- C39 ----------------------------------------------------------------------------------


def _scale_step(state, batch):
  return ({"step": state["step"] + 1, "scale": state["scale"] * jnp.float32(0.5)},
          {"x": jnp.mean(batch["x"])})


def _scale_program():
  program = loopkit.core.MultiStepProgram(_scale_step, iterations_per_loop=2,
                                     mesh=loopkit.data_parallel_mesh())
  chunk = jax.device_put({"x": np.ones((2, 8), np.float32)}, program.batch_sharding)
  return program, chunk, jax.device_put(np.int32(2), program.replicated)


def test_c39_weak_typed_leaf_compiles_once():
  program, chunk, n = _scale_program()
  weak = jnp.asarray(1.0)
  assert weak.weak_type
  state = program.place_state({"step": jnp.zeros((), jnp.int32), "scale": weak})
  assert not state["scale"].weak_type and state["scale"].dtype == jnp.float32
  with warnings.catch_warnings():
    warnings.simplefilter("error", RecompileWarning)
    for _ in range(3):
      state, _ = program(state, chunk, n)
  assert program.compile_count() == 1 and program.trace_count == 1
  assert float(state["scale"]) == 0.5 ** 6 and int(state["step"]) == 6


def test_c39_python_scalar_leaf_is_placed_strong():
  program, chunk, n = _scale_program()
  state = program.place_state({"step": 0, "scale": 2.0})
  assert state["step"].dtype == jnp.int32 and state["scale"].dtype == jnp.float32
  assert not state["step"].weak_type and not state["scale"].weak_type
  for _ in range(2):
    state, _ = program(state, chunk, n)
  assert program.compile_count() == 1


def test_c39_recompile_warns_naming_the_leaf():
  program, chunk, n = _scale_program()
  state = program.place_state({"step": jnp.zeros((), jnp.int32), "scale": jnp.asarray(1.0)})
  state, _ = program(state, chunk, n)
  # A state that bypasses place_state keeps its weak leaf: a second compilation.
  bypass = {"step": state["step"], "scale": jnp.asarray(3.0)}
  with pytest.warns(RecompileWarning,
                    match=r"compilation 2\): state leaf scale has shape \(\) dtype "
                          r"float32 \(weak-typed\)"):
    state, _ = program(bypass, chunk, n)
  half = jax.device_put({"x": np.ones((2, 8), np.float16)}, program.batch_sharding)
  with pytest.warns(RecompileWarning, match=r"batch leaf x has shape \(2, 8\) dtype "
                                            r"float16 .*the first call had shape \(2, 8\) dtype "
                                            r"float32"):
    program(program.place_state({"step": 0, "scale": 1.0}), half, n)
  assert program.compile_count() == 3


def test_c39_flax_dynamic_scale_in_a_train_loop_compiles_once():
  """Flax's DynamicScale() holds Python scalars (fin_steps=0, scale=65536.0)."""
  tx = optax.sgd(0.1)

  def step(state, batch):
    def loss_fn(w):
      return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)
    ds, is_fin, loss, grads = state["ds"].value_and_grad(loss_fn)(state["w"])
    updates, opt = tx.update(grads, state["opt"], state["w"])
    w = jnp.where(is_fin, optax.apply_updates(state["w"], updates), state["w"])
    return {"w": w, "opt": opt, "ds": ds, "step": state["step"] + 1}, {"loss": loss}

  w = jnp.zeros((4,), jnp.float32)
  state = {"w": w, "opt": tx.init(w), "ds": dynamic_scale_lib.DynamicScale(),
           "step": jnp.zeros((), jnp.int32)}
  rng = np.random.default_rng(0)
  data = [{"x": rng.normal(size=(8, 4)).astype(np.float32),
           "y": rng.normal(size=(8,)).astype(np.float32)} for _ in range(6)]
  loop = loopkit.TrainLoop(step, iterations_per_loop=2, prefetch=0)
  with warnings.catch_warnings():
    warnings.simplefilter("error", RecompileWarning)
    final = loop.run(state, iter(data), num_steps=6)
  assert loop.program.compile_count() == 1 and loop.ledger.step == 6
  assert int(final["step"]) == 6 and final["ds"].scale.dtype == jnp.float32
