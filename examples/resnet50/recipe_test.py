"""Tests that ``configs/imagenet_flax.py`` is the Flax ImageNet example's recipe, choice by choice.

The recipe (Flax ``examples/imagenet`` at commit 18f8f311): ResNet-50 v1.5 with ``SAME``
padding and lecun_normal kernels, plain cross-entropy, SGD Nesterov 0.9, L2 1e-4 on kernels,
lr 0.1 x B / 256 with 5 linear warmup epochs then cosine, batch 1024, 100 epochs of 1,251 steps.
Each choice is read from what the config builds (the lowered program, initialised values, the
train step's numbers), not from the config's fields. The full ResNet-50 is only traced,
lowered or initialised here; what runs is the recipe's train step with 4 base filters at
32x32, on ResNet-18's basic blocks in the default suite and on ResNet-50 in a slow test.
"""

from __future__ import annotations

import json
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from examples.resnet50 import input_pipeline, models, train
from examples.resnet50.configs import imagenet_flax, imagenet_tpu

STEPS_PER_EPOCH = 1251   # 1,281,167 // 1024
TOTAL_STEPS = 125_100    # Flax's README: 125,100 steps for each TPU run
PEAK_LR = 0.1 * 1024 / 256
WARMUP_STEPS = 5 * STEPS_PER_EPOCH


def _recipe():
  return imagenet_flax.get_config()


def test_recipe_config_is_batch_1024_for_100_epochs_with_k_dividing_an_epoch():
  c = _recipe()
  assert (c.global_batch_size, c.num_epochs, c.warmup_epochs) == (1024, 100, 5)
  assert (c.base_learning_rate, c.momentum, c.nesterov, c.weight_decay) == (0.1, 0.9, True, 1e-4)
  assert c.label_smoothing == 0.0 and c.half_precision and c.eval_every_epochs == 1
  for processes in (1, 2, 4, 8, 16):  # each host drops its own shard's remainder
    local = c.global_batch_size // processes
    spe = input_pipeline.shard_size(1_281_167, processes - 1, processes) // local
    assert spe == STEPS_PER_EPOCH and spe % c.iterations_per_loop == 0
  assert train.num_train_steps(c, STEPS_PER_EPOCH) == TOTAL_STEPS
  assert c.eval_iterations_per_loop == math.ceil(50_000 / c.eval_batch_size)


def test_recipe_resnet50_has_25557032_parameters():
  model = nnx.eval_shape(lambda: train.create_model(_recipe()))
  assert model.depth == 50 and models.param_count(model) == 25_557_032


# -- padding, read from the lowered program ---------------------------------------------------

_CONV = re.compile(r"stablehlo\.convolution.*?stride = \[(\d+), (\d+)\], "
                   r"pad = \[\[(\d+), (\d+)\], \[(\d+), (\d+)\]\].*"
                   r": \(tensor<[0-9x]+x\w+>, tensor<(\d+)x(\d+)x\d+x\d+x\w+>\)")
_POOL = re.compile(r"stablehlo\.reduce_window.*padding = dense<(\[\[.*?\]\])>")


def _lowered_paddings(config):
  """``({(kernel, stride): {pad, ...}}, [max-pool paddings])`` of the eval forward at 224x224."""
  graphdef, state = nnx.split(nnx.eval_shape(lambda: train.create_model(config)))
  images = jax.ShapeDtypeStruct((2, 224, 224, 3), train.compute_dtype(config))
  text = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x, train=False)).lower(state, images).as_text()
  convs: dict[tuple[int, int], set] = {}
  count = 0
  for line in text.splitlines():
    if "stablehlo.convolution" not in line:
      continue
    m = _CONV.search(line)
    assert m, line
    sh, sw, top, bottom, left, right, kh, kw = map(int, m.groups())
    assert (sh, kh) == (sw, kw)
    convs.setdefault((kh, sh), set()).add(((top, bottom), (left, right)))
    count += 1
  assert count == 53  # ResNet-50: stem + 16 blocks x 3 + 4 projections
  pools = _POOL.findall(text)
  return convs, pools


def test_recipe_pads_strided_3x3_and_max_pool_same_and_fast_config_symmetric():
  convs, pools = _lowered_paddings(_recipe())
  # XLA's SAME on the even sizes 56, 28, 14 (3x3/2) and 112 (the pool): the odd pixel at the end.
  assert convs[(3, 2)] == {((0, 1), (0, 1))}
  assert pools == ["[[0, 0], [0, 1], [0, 1], [0, 0]]"]
  assert convs[(7, 2)] == {((3, 3), (3, 3))}  # the stem, explicit in Flax's model too
  assert convs[(3, 1)] == {((1, 1), (1, 1))}
  assert convs[(1, 1)] == convs[(1, 2)] == {((0, 0), (0, 0))}
  fast_convs, fast_pools = _lowered_paddings(imagenet_tpu.get_config())
  assert fast_convs[(3, 2)] == {((1, 1), (1, 1))}
  assert fast_pools == ["[[0, 0], [1, 1], [1, 1], [0, 0]]"]
  assert {k: v for k, v in fast_convs.items() if k != (3, 2)} == {
      k: v for k, v in convs.items() if k != (3, 2)}


# -- initialisation ---------------------------------------------------------------------------

_PICKED = {  # name: (kernel shape, fan_in, fan_out)
    "stem 7x7": ((7, 7, 3, 64), 7 * 7 * 3, 7 * 7 * 64),
    "3x3 (last block)": ((3, 3, 512, 512), 9 * 512, 9 * 512),
    "1x1 (last block, 2048 -> 512)": ((1, 1, 2048, 512), 2048, 512),
    "dense": ((2048, 1000), 2048, 1000),
}


def _picked_kernels(config) -> dict[str, np.ndarray]:
  def init():
    m = train.create_model(config)
    last = m.blocks[-1]
    return {"stem 7x7": m.stem_conv.kernel[...], "3x3 (last block)": last.conv2.kernel[...],
            "1x1 (last block, 2048 -> 512)": last.conv1.kernel[...],
            "dense": m.head.kernel[...]}
  # jit: only the returned kernels' random numbers are computed (the rest is dead code).
  return jax.tree.map(np.asarray, jax.jit(init)())


def test_recipe_kernels_have_lecun_normal_truncated_std():
  """Sample std = sqrt(1 / fan_in) within 5 standard errors, and truncated at 2 std.

  lecun_normal draws a normal truncated to [-2, 2] and rescales it (by 1 / 0.8796) so that
  its std is exactly sqrt(1 / fan_in). For n samples the sample std's relative standard
  error is sqrt((kurtosis - 1) / (4 n)) <= sqrt(2 / (4 n)) (the truncated normal's kurtosis,
  2.37, is below the normal's 3): 5 of those is 3.6% for the stem's 9,408 values and
  0.35% or less for the other three (>= 1M values). A He fan_out init misses by 50% or more,
  an untruncated or unrescaled one by the truncation bound or 12%.
  """
  kernels = _picked_kernels(_recipe())
  for name, (shape, fan_in, _) in _PICKED.items():
    w = kernels[name].astype(np.float64)
    assert w.shape == shape and kernels[name].dtype == np.float32, name
    sigma = math.sqrt(1.0 / fan_in)
    tol = 5 * math.sqrt(2 / (4 * w.size))
    assert abs(w.std() / sigma - 1) < tol, (name, w.std(), sigma, tol)
    assert abs(w.mean()) < 5 * sigma / math.sqrt(w.size), name
    assert np.abs(w).max() <= 2 * sigma / 0.87962566103423978 * (1 + 1e-6), name
  fast = _picked_kernels(imagenet_tpu.get_config())
  _, fan_in, fan_out = _PICKED["stem 7x7"]
  np.testing.assert_allclose(fast["stem 7x7"].std(), math.sqrt(2 / fan_out), rtol=0.036)
  np.testing.assert_allclose(fast["dense"].std(), 0.01, rtol=0.004)
  assert abs(fast["stem 7x7"].std() / math.sqrt(1 / fan_in) - 1) > 0.5


# -- schedule ---------------------------------------------------------------------------------


def _recipe_lr(t: int) -> float:
  """Flax's schedule as a formula (float64): linear 0 -> peak over 5 epochs, then cosine to 0."""
  if t < WARMUP_STEPS:
    return PEAK_LR * t / WARMUP_STEPS
  return PEAK_LR * 0.5 * (1 + math.cos(math.pi * (t - WARMUP_STEPS) / (TOTAL_STEPS - WARMUP_STEPS)))


@pytest.mark.parametrize("t", [0, 1, WARMUP_STEPS - 1, WARMUP_STEPS, WARMUP_STEPS + 1,
                               (WARMUP_STEPS + TOTAL_STEPS) // 2, TOTAL_STEPS - 1, TOTAL_STEPS])
def test_recipe_schedule_matches_the_formula(t):
  # t: updates done before this one; t = TOTAL_STEPS - 1 is the 125,100th (last) update.
  schedule = train.learning_rate_schedule(_recipe(), STEPS_PER_EPOCH)
  # float32: relative 1e-6, and near 0 (the last steps) a few ulps of the peak, the rounding
  # of 1 + cos(x) near x = pi.
  np.testing.assert_allclose(float(schedule(t)), _recipe_lr(t), rtol=1e-6,
                             atol=4 * PEAK_LR * 2.0 ** -24)


# -- the train step against a reference written here ------------------------------------------

_STAGES = {18: (2, 2, 2, 2), 50: (3, 4, 6, 3)}  # blocks per stage (He et al. 2016, Table 1)
_MEAN_RGB = np.array([0.485, 0.456, 0.406], np.float32) * 255
_STD_RGB = np.array([0.229, 0.224, 0.225], np.float32) * 255


def _ref_conv(x, w, stride, padding="SAME"):
  return jax.lax.conv_general_dilated(x, w, (stride, stride), padding,
                                      dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _ref_bn(x, p, stats, new_stats):
  """Train-mode BatchNorm (batch statistics, epsilon 1e-5); running averages with 0.9."""
  s = stats[len(new_stats)]  # the running averages in forward order
  mean, var = x.mean((0, 1, 2)), x.var((0, 1, 2))
  new_stats.append({"mean": 0.9 * s["mean"] + 0.1 * mean, "var": 0.9 * s["var"] + 0.1 * var})
  return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def _ref_forward(depth, params, stats, images):
  """The recipe's ResNet v1.5 forward (train mode), written with lax: ``(logits, stats)``.

  ``depth`` 50: bottleneck blocks (1x1, 3x3 with the stage's stride, 1x1); 18: basic blocks
  (3x3 with the stride, 3x3). ``stats``: the BatchNorm running averages as a list in forward
  order (:func:`_flat_stats`).
  """
  new = []
  x = (images.astype(jnp.float32) - _MEAN_RGB) / _STD_RGB
  x = _ref_conv(x, params["stem_conv"]["kernel"], 2, ((3, 3), (3, 3)))
  x = jax.nn.relu(_ref_bn(x, params["stem_bn"], stats, new))
  x = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "SAME")
  i = 0
  for stage, blocks in enumerate(_STAGES[depth]):
    for j in range(blocks):
      p = params["blocks"][i]
      stride = 2 if stage > 0 and j == 0 else 1
      if depth == 50:
        y = jax.nn.relu(_ref_bn(_ref_conv(x, p["conv1"]["kernel"], 1), p["bn1"], stats, new))
        y = jax.nn.relu(_ref_bn(_ref_conv(y, p["conv2"]["kernel"], stride), p["bn2"], stats,
                                new))
        y = _ref_bn(_ref_conv(y, p["conv3"]["kernel"], 1), p["bn3"], stats, new)
      else:
        y = jax.nn.relu(_ref_bn(_ref_conv(x, p["conv1"]["kernel"], stride), p["bn1"], stats,
                                new))
        y = _ref_bn(_ref_conv(y, p["conv2"]["kernel"], 1), p["bn2"], stats, new)
      if "proj_conv" in p:
        x = _ref_bn(_ref_conv(x, p["proj_conv"]["kernel"], stride), p["proj_bn"], stats, new)
      x = jax.nn.relu(x + y)
      i += 1
  logits = x.mean((1, 2)) @ params["head"]["kernel"] + params["head"]["bias"]
  return logits, new


def _ref_step_fn(depth, sgd):
  """One update of the recipe: cross-entropy + 1e-4 / 2 |kernels|^2, then ``sgd``."""

  def step(params, stats, opt_state, batch):
    def loss_fn(p):
      logits, new_stats = _ref_forward(depth, p, stats, batch["image"])
      labels = jax.nn.one_hot(batch["label"], logits.shape[-1])
      ce = -jnp.mean(jnp.sum(labels * jax.nn.log_softmax(logits), -1))
      kernels = [w for w in jax.tree.leaves(p) if w.ndim > 1]
      l2 = sum(jnp.vdot(w, w) for w in kernels)
      return ce + 1e-4 / 2 * l2, (ce, new_stats)

    (_, (ce, new_stats)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = sgd.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), new_stats, opt_state, ce

  return step


def _flat_stats(stats):
  """The model's batch-stat dict in the reference's order (stem, then blocks, conv order)."""
  out = [stats["stem_bn"]]
  for b in (stats["blocks"][i] for i in sorted(stats["blocks"])):
    out += [b[k] for k in ("bn1", "bn2", "bn3", "proj_bn") if k in b]
  return out


_STEP_SPE = 2  # a short epoch: the 3 steps' learning rates are 0, 0.04, 0.08 (peak 0.4 at 10)


def _three_steps(depth):
  """Three train steps of the recipe at ``depth`` (float32, 4 filters, 10 classes, 32x32).

  Same initial variables and batches for the example's step and the reference. Each is
  ``[(state, loss, learning rate)]`` and ``[(params, batch stats, cross-entropy)]``.
  """
  config = _recipe()
  config.half_precision = False
  config.num_classes = 10
  config.model.depth = depth
  config.model.num_filters = 4
  schedule = train.learning_rate_schedule(config, _STEP_SPE)
  tx = train.create_optimizer(config, schedule)
  # Initialised in one compiled program (eager NNX init compiles one per parameter shape),
  # from "rbg" keys: XLA:CPU compiles threefry draws about 4 times as slowly, and any initial
  # values serve here (the same for both updates; the recipe's init is checked above).
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: train.create_model(config)))
  with jax.default_prng_impl("rbg"):
    state = jax.jit(lambda: train.create_train_state(train.create_model(config), tx)[1])()
  step = jax.jit(train.make_train_step(graphdef, tx, schedule, num_classes=10,
                                       label_smoothing=config.label_smoothing,
                                       dtype=train.compute_dtype(config)))
  warmup = 5 * _STEP_SPE
  sgd = optax.sgd(lambda t: PEAK_LR * t / warmup, momentum=0.9, nesterov=True)
  ref_step = jax.jit(_ref_step_fn(depth, sgd))
  rng = np.random.default_rng(0)
  batches = [{"image": rng.integers(0, 256, (16, 32, 32, 3), dtype=np.uint8),
              "label": rng.integers(0, 10, (16,), dtype=np.int32)} for _ in range(3)]
  params, stats = state.params, _flat_stats(state.batch_stats)
  ref_opt = sgd.init(params)
  ours, ref = [], []
  for batch in batches:
    state, metrics = step(state, batch)
    ours.append((state, float(metrics["loss"].total / metrics["loss"].count),
                 float(metrics["learning_rate"].value)))
    params, new_stats, ref_opt, ce = ref_step(params, stats, ref_opt, batch)
    stats = new_stats
    ref.append((params, stats, float(ce)))
  return ours, ref


@pytest.fixture(scope="module")
def three_steps():
  """The recipe's train step with the recipe's blocks swapped for ResNet-18's basic blocks: the
  loss, weight decay, optimizer, schedule and BatchNorm are the recipe's. Compiling the
  ResNet-50 step and its reference takes about 2.5 times as long (53 convolutions against 21);
  ``test_recipe_resnet50_train_step_matches_reference_update`` (slow) runs it."""
  return _three_steps(18)


def _assert_plain_cross_entropy(ours, ref):
  for (_, loss, _), (_, _, ce) in zip(ours, ref, strict=True):
    # no smoothing: label smoothing 0.1 would add ~0.1 x (mean(-log p) - CE) ~ 0.01 here
    assert abs(loss - ce) < 1e-5 * abs(ce), (loss, ce)
  np.testing.assert_allclose([lr for _, _, lr in ours], [0.0, 0.04, 0.08], rtol=1e-6)


def _assert_reference_update(ours, ref, bound):
  worst = 0.0
  for (state, _, _), (params, stats, _) in zip(ours, ref, strict=True):
    diffs = jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))),
                         state.params, params)
    worst = max(worst, max(jax.tree.leaves(diffs)))
    for a, b in zip(_flat_stats(state.batch_stats), stats, strict=True):
      np.testing.assert_allclose(a["mean"], b["mean"], rtol=1e-5, atol=1e-6)
      np.testing.assert_allclose(a["var"], b["var"], rtol=1e-5, atol=1e-6)
  moved = max(jax.tree.leaves(jax.tree.map(
      lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))),
      ours[-1][0].params, ours[0][0].params)))
  assert moved > 1e-3       # the steps changed the parameters ...
  print(f"max |params - reference| over 3 steps: {worst:.3g}; largest move {moved:.3g}")
  assert worst < bound, worst  # ... identically up to float32 rounding


def test_recipe_loss_is_plain_cross_entropy(three_steps):
  _assert_plain_cross_entropy(*three_steps)


def test_recipe_train_step_matches_reference_update(three_steps):
  # ResNet-18 from rbg keys: 5.9e-7 (jax 0.10.2) and 1.06e-6 (jax 0.12) measured 2026-12-04; one
  # step without weight decay moves a kernel of 0.1 by 0.04 x 1e-4 x 0.1 = 4e-7 per step, and
  # test_weight_decay_only_on_kernels_and_nesterov_sgd holds the decay exactly.
  _assert_reference_update(*three_steps, bound=2e-6)


@pytest.mark.slow(held_by=["examples/resnet50/recipe_test.py::test_recipe_train_step_matches_reference_update",
                           "examples/resnet50/recipe_test.py::test_recipe_loss_is_plain_cross_entropy"],
                  reason="the same three steps with the recipe's own ResNet-50 (bottleneck "
                         "blocks): 2.5 times the compile time of the ResNet-18 twins")
def test_recipe_resnet50_train_step_matches_reference_update():
  ours, ref = _three_steps(50)
  _assert_plain_cross_entropy(ours, ref)
  _assert_reference_update(ours, ref, bound=1e-6)


# -- the recipe's CPU smoke run ---------------------------------------------------------------


@pytest.mark.slow(held_by=["examples/resnet50/recipe_test.py::test_recipe_train_step_matches_reference_update",
                           "examples/resnet50/resnet50_test.py::test_smoke_two_loops_on_mock_imagenet"],
                  reason="the recipe's ResNet-50 trained and evaluated: 45 s alone")
@pytest.mark.tf  # TFDS (the digits as a TFDS dataset)
def test_recipe_config_trains_and_evaluates_every_epoch_on_digits(tmp_path, digits_dir):
  """The recipe shrunk to this CPU: digits at 32x32, 4 filters, 2-step epochs, K = 2.

  Kept from the recipe: SAME padding, lecun_normal, no smoothing, Nesterov SGD, weight decay,
  bfloat16, warmup + cosine, evaluation after every epoch.
  """
  config = _recipe()
  config.distributed = False
  config.dataset, config.data_dir = "sklearn_digits", digits_dir
  config.train_split, config.eval_split = "train", "test"
  config.num_classes = 10
  config.num_train_examples = 32       # epochs of 2 steps of 16
  config.image_size = 32
  config.random_resized_crop, config.flip, config.crop_fraction = False, False, 1.0
  config.shuffle_buffer = 64
  config.model.num_filters = 4
  config.global_batch_size = 16
  config.num_epochs = 2
  config.warmup_epochs = 1
  config.iterations_per_loop = 2       # one call per epoch
  config.log_every_steps = 2
  config.eval_batch_size = 64          # 360 test digits: 6 batches, the last padded
  config.eval_iterations_per_loop = 3
  config.checkpoint_every_epochs = 0
  r = train.train_and_evaluate(config, str(tmp_path))
  assert r["steps_per_epoch"] == 2 and r["num_train_steps"] == 4
  assert r["step"] == 4 and r["device_calls"] == 2 and r["ledger"]["examples_seen"] == 64
  assert [s for s, _ in r["eval_history"]] == [2, 4]  # after each epoch
  assert r["eval_count"] == 360 and r["compile_count"] == 1 and r["eval_compile_count"] == 1
  assert r["status"] == "completed" and r["model"] == "ResNet-50"
  assert r["num_params"] == models.param_count(nnx.eval_shape(lambda: train.create_model(config)))
  with open(os.path.join(str(tmp_path), "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  train_rows = [row for row in rows if "loss" in row and "step" in row and "eval/loss" not in row]
  assert [row["step"] for row in train_rows] == [2, 4]
  assert all(math.isfinite(row["loss"]) for row in train_rows)
  # lr of the last update (step 3 of 4, 2 warmup steps): 0.1 x 16 / 256 x 0.5 x (1 + cos(pi / 2))
  np.testing.assert_allclose(train_rows[-1]["learning_rate"], 0.1 * 16 / 256 * 0.5, rtol=1e-6)
