"""Tests of the ResNet example: model, recipe, input pipeline, and short runs of the configs.

The default tests take about 3-5 minutes on 2 shared CPU cores (8 fake devices); the
``slow`` ones (bitwise resume, the CLI, the GPU benchmark's ``--tiny`` mode,
ResNet-50 at 224) several more.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import loopkit
from examples.resnet50 import config_checks, input_pipeline, models, train
from examples.resnet50.configs import (
  cpu as cpu_config,
  cpu_resnet50,
  default as default_config,
  finetune as finetune_config,
  imagenet_flax,
  imagenet_tpu as tpu_config,
  smoke as smoke_config,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_HERE = "examples/resnet50/resnet50_test.py"  # held_by= names (tests/budget.py)


def _abstract(depth, num_classes=1000, **kw):
  return nnx.eval_shape(lambda: models.ResNet(depth, num_classes=num_classes,
                                              rngs=nnx.Rngs(0), **kw))


# -- model --------------------------------------------------------------------


def test_resnet50_has_25557032_trainable_parameters():
  assert models.param_count(_abstract(50)) == 25_557_032


@pytest.mark.parametrize("depth,count", [(18, 11_689_512), (34, 21_797_672),
                                         (101, 44_549_160), (152, 60_192_808)])
def test_family_parameter_counts_match_torchvision(depth, count):
  assert models.param_count(_abstract(depth)) == count


# Initialisation with JAX's "rbg" keys, where the tests below do not depend on which random
# numbers the parameters got: eager NNX initialisation compiles one program per parameter
# shape, and XLA:CPU compiles a threefry draw (JAX's default) about 4 times as slowly (a
# ResNet-18 smoke run initialised in 23.3 s with threefry and 5.9 s with rbg, 2026-12-04). The
# example itself keeps threefry (the slow CLI tests run it as shipped).
_FAST_INIT = "rbg"


# Real (initialised) small models, built once.
@pytest.fixture(scope="module")
def small_models():
  with jax.default_prng_impl(_FAST_INIT):
    return {(50, jnp.float32): models.ResNet(50, num_classes=7, num_filters=4,
                                             rngs=nnx.Rngs(0)),
            (18, jnp.bfloat16): models.ResNet(18, num_classes=7, num_filters=4,
                                              dtype=jnp.bfloat16, rngs=nnx.Rngs(0))}


def test_resnet50_v1_5_stride_in_3x3_and_zero_init_last_bn(small_models):
  m = _abstract(50)
  first_of_stage2 = m.blocks[3]  # stages (3, 4, 6, 3): block 3 opens stage 2
  assert first_of_stage2.conv1.strides == (1, 1)
  assert first_of_stage2.conv2.strides == (2, 2)
  assert first_of_stage2.proj_conv.strides == (2, 2)
  for block in small_models[18, jnp.bfloat16].blocks:
    np.testing.assert_array_equal(block.bn2.scale[...], 0.0)  # last BN of the block
    np.testing.assert_array_equal(block.bn1.scale[...], 1.0)
  for block in small_models[50, jnp.float32].blocks:
    np.testing.assert_array_equal(block.bn3.scale[...], 0.0)
    np.testing.assert_array_equal(block.bn2.scale[...], 1.0)


def test_output_shapes_dtypes_and_batch_stats(small_models):
  # one program per call (eager calls compile each layer's ops: twice the time here)
  forward = nnx.jit(lambda m, x, train: m(x, train=train), static_argnames="train")
  for m in small_models.values():
    before = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(m, nnx.BatchStat)))
    x = jax.random.normal(jax.random.PRNGKey(1), (3, 64, 64, 3))
    y_eval = forward(m, x, train=False)
    after_eval = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(m, nnx.BatchStat)))
    y_train = forward(m, x, train=True)
    after_train = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(m, nnx.BatchStat)))
    assert y_eval.shape == y_train.shape == (3, 7)
    assert y_eval.dtype == y_train.dtype == jnp.float32
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nnx.state(m, nnx.Param)))
    jax.tree.map(np.testing.assert_array_equal, before, after_eval)  # eval: stats untouched
    changed = jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.any(a != b)), before,
                                           after_train))
    assert all(changed)  # train: every running mean/var moved
  r50 = small_models[50, jnp.float32]
  # 32 / 32 = 1x1 at the end
  assert forward(r50, jnp.zeros((2, 32, 32, 3)), train=False).shape == (2, 7)


def test_unknown_depth_raises():
  with pytest.raises(ValueError, match="depth must be one of"):
    models.ResNet(42, num_classes=10, rngs=nnx.Rngs(0))


# -- recipe -------------------------------------------------------------------


def test_learning_rate_schedule_linear_scaling_warmup_cosine():
  config = default_config.get_config()
  config.global_batch_size = 4096
  spe = 312
  schedule = train.learning_rate_schedule(config, spe)
  peak = 0.1 * 4096 / 256
  assert float(schedule(0)) == 0.0
  np.testing.assert_allclose(float(schedule(5 * spe // 2)), peak / 2, rtol=1e-6)
  np.testing.assert_allclose(float(schedule(5 * spe)), peak, rtol=1e-6)
  mid = 5 * spe + (90 - 5) * spe // 2  # halfway through the cosine
  np.testing.assert_allclose(float(schedule(mid)), peak / 2, rtol=1e-4)
  assert float(schedule(90 * spe)) == 0.0


def test_weight_decay_only_on_kernels_and_nesterov_sgd(small_models):
  config = default_config.get_config()
  tx = train.create_optimizer(config, optax.constant_schedule(1.0))
  _, state = train.create_train_state(small_models[18, jnp.bfloat16], tx)
  zero = jax.tree.map(jnp.zeros_like, state.params)
  updates, _ = jax.jit(tx.update)(zero, state.opt_state, state.params)  # one program
  # With zero gradients, lr 1 and an empty momentum buffer, Nesterov SGD's update is
  # -(1 + momentum) * weight_decay * w on decayed leaves and 0 elsewhere.
  flat = jax.tree_util.tree_flatten_with_path(updates)[0]
  params = dict(jax.tree_util.tree_flatten_with_path(state.params)[0])
  decayed = []
  for path, u in flat:
    name = jax.tree_util.keystr(path)
    w = params[path]
    if w.ndim > 1:
      np.testing.assert_allclose(u, -(1 + 0.9) * 1e-4 * w, rtol=1e-6, atol=1e-12)
      decayed.append(name)
    else:
      np.testing.assert_array_equal(u, 0.0)
      assert "bn" in name or "bias" in name
  assert any("kernel" in n and "head" in n for n in decayed)
  assert config.nesterov and config.momentum == 0.9 and config.label_smoothing == 0.1


def test_train_step_uint8_images_normalised_on_device_and_metrics():
  config = cpu_config.get_config()
  config.model.num_filters = 4
  schedule = optax.constant_schedule(0.05)
  tx = train.create_optimizer(config, schedule)
  with jax.default_prng_impl(_FAST_INIT):
    graphdef, state = train.create_train_state(train.create_model(config), tx)
  step = jax.jit(train.make_train_step(graphdef, tx, schedule, num_classes=10,
                                       label_smoothing=0.1))
  batch = {"image": np.random.default_rng(0).integers(0, 256, (8, 32, 32, 3), dtype=np.uint8),
           "label": np.arange(8, dtype=np.int32)}
  new, metrics = step(state, batch)
  assert int(new.step) == 1
  assert float(metrics["loss"].count) == 8.0
  assert math.isfinite(float(metrics["loss"].total))
  assert float(metrics["learning_rate"].value) == np.float32(0.05)
  x = input_pipeline.normalize(jnp.asarray(batch["image"]))
  assert x.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(x[..., 0]),
                             (batch["image"][..., 0] - 0.485 * 255) / (0.229 * 255), rtol=1e-5)


def test_config_values_and_tpu_k_divides_an_epoch():
  d = default_config.get_config()
  assert (d.num_epochs, d.warmup_epochs, d.base_learning_rate, d.weight_decay) == (90, 5, 0.1,
                                                                                  1e-4)
  t = tpu_config.get_config()
  for processes in (4, 8):  # v4-32, v5e-32
    local = t.global_batch_size // processes
    spe = input_pipeline.shard_size(1_281_167, processes - 1, processes) // local
    assert spe == 312 and spe % t.iterations_per_loop == 0
  assert t.eval_iterations_per_loop == math.ceil(50_000 / t.eval_batch_size)
  assert t.distributed


# -- input pipeline -----------------------------------------------------------


def _digits_builder(data_dir):
  from examples.resnet50 import digits_tfds
  return digits_tfds.ensure_prepared(data_dir)


@pytest.mark.tf  # TFDS
def test_building_the_digits_says_so_and_tfds_stays_quiet(tmp_path, capfd, caplog):
  """C70: the first build logs what it builds, where, and how long it took; TFDS's own output
  ("Downloading and preparing dataset Unknown size ...", its progress bars, "Dataset ...
  downloaded and prepared") is not printed. A prepared dataset is read without a word."""
  from examples.resnet50 import digits_tfds
  capfd.readouterr()
  with caplog.at_level(logging.INFO, logger="absl"):
    builder = digits_tfds.ensure_prepared(str(tmp_path), file_format="array_record")
    digits_tfds.ensure_prepared(str(tmp_path), file_format="array_record")
  out, err = capfd.readouterr()
  for fragment in ("Downloading", "prepar", "Generating", "Shuffling", "examples/s"):
    assert fragment not in out + err, out + err
  ours = [r.getMessage() for r in caplog.records if r.pathname.endswith("digits_tfds.py")]
  assert len(ours) == 2, ours
  assert ours[0] == ("building the sklearn_digits dataset (scikit-learn's 1,797 digits, no "
                     f"download) as array_record files in {builder.data_dir}")
  assert re.fullmatch(r"built sklearn_digits in \d+\.\d s: 1,437 train and 360 test examples in "
                      + re.escape(builder.data_dir), ours[1]), ours[1]


@pytest.mark.tf  # imports TensorFlow
def test_main_pins_the_cpu_config_to_the_cpu_and_quiets_tensorflow():
  """C70: a CPU config never probes for a TPU (libtpu is installed here: its probe prints
  libtpu's errors and "Unable to initialize backend 'tpu'"), and TensorFlow's C++ INFO lines
  at import ("All log messages before absl::InitializeLog()", "This TensorFlow binary is
  optimized ...", "oneDNN custom operations are on", which TF_CPP_MIN_LOG_LEVEL does not
  stop on a CPU with AVX512_VNNI, such as an AMD EPYC here) are off, for child processes too
  (the environment says so). The absl filter main.py installs drops Orbax's and TFDS's INFO records
  (a line per save, per dataset step) and keeps their warnings and everything else."""
  code = ("import importlib.util, logging, os\n"
          "from examples.resnet50 import main\n"
          "from examples.resnet50.configs import cpu\n"
          "main.use_platform(cpu.get_config().platform)\n"
          "import jax, tensorflow as tf\n"
          "print(jax.devices()[0].platform, float(tf.constant(1.0) + 1))\n"
          "print(os.environ['JAX_PLATFORMS'], os.environ['TF_CPP_MIN_LOG_LEVEL'],\n"
          "      os.environ['TF_ENABLE_ONEDNN_OPTS'])\n"
          "paths = [importlib.util.find_spec(m).origin for m in\n"
          "         ('orbax.checkpoint', 'tensorflow_datasets', 'loopkit.evaluation', 'grain')]\n"
          "for level in (logging.INFO, logging.WARNING):\n"
          "  print(*[main._quiet_libraries(logging.LogRecord('absl', level, path, 1, 'm', (),\n"
          "                                                None)) for path in paths])\n")
  env = {k: v for k, v in os.environ.items()
         if k not in ("JAX_PLATFORMS", "TF_CPP_MIN_LOG_LEVEL", "TF_ENABLE_ONEDNN_OPTS",
                      "XLA_FLAGS")}
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.splitlines() == ["cpu 2.0", "cpu 1 0", "False False True True",
                                     "True True True True"], out.stdout
  assert out.stderr == "", out.stderr


def test_config_platform_is_checked():
  config = cpu_config.get_config()
  assert config.platform == "cpu" and default_config.get_config().platform == ""
  config.platform = "cpu,tpu"
  assert config_checks.problems(config) == []
  for wrong in ("cpus", "CPU", "cpu,"):
    config.platform = wrong
    assert config_checks.problems(config) == [
        "config.platform must be '' (JAX picks) or one or more of ['cpu', 'cuda', 'gpu', "
        f"'rocm', 'tpu'] separated by commas, got {wrong!r}"]


@pytest.mark.tf  # TFDS (the digits TFDS build, tfds.testing.mock_data)
def test_digits_tfds_splits(digits_dir):
  import tensorflow_datasets as tfds
  builder = tfds.builder("sklearn_digits", data_dir=digits_dir)  # the imagenet2012 code path
  assert builder.info.splits["train"].num_examples == 1437
  assert builder.info.splits["test"].num_examples == 360
  labels = [int(x["label"]) for x in tfds.as_numpy(builder.as_dataset(split="test"))]
  assert collections.Counter(labels) == collections.Counter(
      {0: 36, 1: 36, 2: 35, 3: 37, 4: 36, 5: 37, 6: 36, 7: 36, 8: 35, 9: 36})


@pytest.mark.tf  # TFDS (the digits TFDS build, tfds.testing.mock_data)
def test_train_batches_deterministic_resumable_and_reshuffled(digits_dir):
  builder = _digits_builder(digits_dir)
  p = input_pipeline.Preprocessing(image_size=16, random_resized_crop=True, flip=True)
  src = input_pipeline.TrainBatches(builder, split="train", num_examples=1437,
                                    global_batch_size=512, preprocessing=p, seed=3,
                                    process_index=0, process_count=1)
  assert src.steps_per_epoch == 2
  it = iter(src)
  first = [next(it) for _ in range(5)]  # crosses two epoch ends
  assert it.get_state() == {"batches": 5}
  for b in first:
    assert b["image"].dtype == np.uint8 and b["image"].shape == (512, 16, 16, 3)
    assert b["label"].dtype == np.int32 and b["label"].shape == (512,)
  again = iter(src)
  for a, b in zip(first, [next(again) for _ in range(5)], strict=True):
    np.testing.assert_array_equal(a["image"], b["image"])  # same seed, same batches
  resumed = iter(src)
  resumed.set_state({"batches": 3})  # mid-epoch (epoch 1, second batch)
  np.testing.assert_array_equal(next(resumed)["image"], first[3]["image"])
  np.testing.assert_array_equal(next(resumed)["label"], first[4]["label"])
  assert not np.array_equal(first[0]["label"], first[2]["label"])  # epochs differ


@pytest.mark.tf  # TFDS (the digits TFDS build, tfds.testing.mock_data)
def test_eval_batches_per_process_shards_are_exact(digits_dir):
  builder = _digits_builder(digits_dir)
  p = input_pipeline.Preprocessing(image_size=8, crop_fraction=1.0)
  everything = []
  sizes, num_batches = [], set()
  for index in range(7):  # 360 over 7 processes: 52, 52, 52, 51, 51, 51, 51
    ev = input_pipeline.EvalBatches(builder, split="test", num_examples=360,
                                    global_batch_size=7 * 16, preprocessing=p,
                                    process_index=index, process_count=7)
    labels = np.concatenate([b["label"] for b in ev])
    sizes.append(len(labels))
    num_batches.add(ev.num_batches)
    everything.append(labels)
  assert sizes == [52, 52, 52, 51, 51, 51, 51]
  assert num_batches == {4}  # ceil(52 / 16) for every process
  single = input_pipeline.EvalBatches(builder, split="test", num_examples=360,
                                      global_batch_size=16, preprocessing=p,
                                      process_index=0, process_count=1)
  np.testing.assert_array_equal(np.concatenate(everything),
                                np.concatenate([b["label"] for b in single]))


# -- runs ---------------------------------------------------------------------


def _metrics_rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


_CACHE_OPTIONS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")


@pytest.fixture(scope="module")
def compilation_cache(tmp_path_factory):
  """A persistent compilation cache for this module's runs (as main.py sets one up).

  The resume test's run loads the train and eval programs that ``smoke_run`` compiled
  instead of compiling them again; its ledger's compile seconds are then the cache load (> 0).
  The previous settings come back after the module.
  """
  from jax.experimental.compilation_cache import compilation_cache as cc
  old = {name: getattr(jax.config, name) for name in _CACHE_OPTIONS}
  jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("jax_cache")))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
  cc.reset_cache()
  yield
  for name, value in old.items():
    jax.config.update(name, value)
  cc.reset_cache()


def _smoke_config():
  """configs/smoke.py with a ResNet-18 (8 filters) in place of its ResNet-50.

  The ImageNet path is the same (mock JPEGs, crops, uint8 to the device, padded exact eval);
  the bottleneck ResNet-50's train and eval programs take about 4 times as long to compile, and
  smoke.py's own ResNet-50 programs compile in the slow
  ``test_smoke_config_compiles_for_v5e_2x2``. ResNet-50's blocks are held in the default
  suite by ``test_output_shapes_dtypes_and_batch_stats`` and recipe_test.py's reference update.
  """
  config = smoke_config.get_config()
  config.model.depth = 18
  return config


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory, compilation_cache):
  workdir = str(tmp_path_factory.mktemp("smoke"))
  with jax.default_prng_impl(_FAST_INIT):
    return workdir, train.train_and_evaluate(_smoke_config(), workdir)


@pytest.mark.tf  # TFDS (the digits TFDS build, tfds.testing.mock_data)
def test_smoke_two_loops_on_mock_imagenet(smoke_run):
  workdir, r = smoke_run
  assert r["step"] == 4 and r["ledger"]["step"] == 4
  assert r["device_calls"] == 2 and r["ledger"]["loop_index"] == 2
  assert r["ledger"]["examples_seen"] == 4 * 16
  # loopkit.core.ledger.epoch_of: after step 4 of 2 per epoch, the last step done is in epoch 1
  # (0-based), with 2 steps done in it: 2 epochs complete.
  assert r["steps_per_epoch"] == 2 and r["ledger"]["epoch"] == 1
  assert r["ledger"]["step_in_epoch"] == 2
  assert r["compile_count"] == 1 and r["eval_compile_count"] == 1
  # one evaluation, at the end: 40 mock images, padded to 2 x 32
  assert r["eval_count"] == 40 and [step for step, _ in r["eval_history"]] == [4]
  assert r["status"] == "completed" and r["restored_step"] is None
  assert r["num_params"] > 0 and r["model"] == "ResNet-18"
  train_rows = [row for row in _metrics_rows(workdir) if "loss" in row]
  assert [row["step"] for row in train_rows] == [2, 4]
  assert all(math.isfinite(row["loss"]) for row in train_rows)
  assert os.path.isdir(os.path.join(workdir, "checkpoints", "4"))
  assert any(f.startswith("events.out.tfevents") for f in os.listdir(workdir))
  assert json.load(open(os.path.join(workdir, "results.json")))["step"] == 4
  lines = train.summary(_smoke_config(), r, wall_secs=12.34)  # what main.py prints
  assert lines[0] == (
      f"ResNet-18: eval accuracy {r['eval_accuracy']:.4f} on 40 imagenet2012/validation "
      "examples at step 4 (2 epochs of 2 steps, batch 16, iterations_per_loop=2, 2 device calls, "
      "8 devices, 1 train compilation); status completed; 12.3 s wall")
  assert lines[1:] == [f"results (JSON):        {workdir}/results.json",
                       f"metrics (JSONL, TB):   {workdir}/metrics.jsonl (tensorboard --logdir "
                       f"{workdir})", f"checkpoints (Orbax):   {workdir}/checkpoints"]


class LedgerAtStart(loopkit.Hook):
  """Copies the ledger's time buckets when the run starts, after the checkpoint's restore."""

  needs_state = False

  def on_run_start(self, ctx, state):
    del state
    self.seconds = dict(ctx.ledger.seconds)


@pytest.mark.tf  # TFDS (the digits TFDS build, tfds.testing.mock_data)
def test_resume_from_checkpoint_continues_at_the_right_step(smoke_run):
  workdir, first = smoke_run
  config = _smoke_config()
  config.num_train_steps = 6
  at_start = LedgerAtStart()
  with jax.default_prng_impl(_FAST_INIT):  # as smoke_run
    # same workdir: resumes from step 4
    r = train.train_and_evaluate(config, workdir, extra_hooks=[at_start])
  assert r["restored_step"] == 4
  assert r["step"] == 6 and r["ledger"]["step"] == 6
  assert r["ledger"]["loop_index"] == 3  # one more device call of K = 2
  assert r["ledger"]["examples_seen"] == 6 * 16
  # the restored ledger's time buckets are the first run's; this run's compile seconds (the
  # persistent cache's load here) come on top
  compile_secs = lambda seconds: seconds.get("compile", 0.0)
  assert compile_secs(at_start.seconds) == pytest.approx(
      compile_secs(first["ledger"]["seconds"]), abs=2e-3)
  assert compile_secs(r["ledger"]["seconds"]) > compile_secs(at_start.seconds) > 0
  train_rows = [row for row in _metrics_rows(workdir) if "loss" in row]
  assert [row["step"] for row in train_rows] == [2, 4, 6]
  assert sorted(int(s) for s in os.listdir(os.path.join(workdir, "checkpoints"))
                if s.isdigit())[-1] == 6
  # The same command again: nothing left to train; it restores step 6 and evaluates it (the
  # EvalHook's at_end), reporting what the run that got there reported.
  with jax.default_prng_impl(_FAST_INIT):
    again = train.train_and_evaluate(config, workdir)
  assert (again["restored_step"], again["step"], again["device_calls"]) == (6, 6, 3)
  assert again["status"] == "completed" and again["eval_count"] == 40
  assert again["eval_history"] == r["eval_history"] and again["eval_loss"] == r["eval_loss"]
  assert [step for step, _ in r["eval_history"]] == [6]


def _few_steps(config, data_dir, num_steps, checkpoint_every_steps=0):
  """``config`` cut to ``num_steps`` steps of K = 2 on the digits in ``data_dir``, logging
  every call, checkpointing every ``checkpoint_every_steps`` (0: never)."""
  config.data_dir = data_dir
  config.num_train_steps = num_steps
  config.iterations_per_loop = 2
  config.log_every_steps = 2
  config.checkpoint_every_epochs = 0
  config.checkpoint_every_steps = checkpoint_every_steps
  return config


@pytest.mark.slow(held_by=[f"{_HERE}::test_resume_from_checkpoint_continues_at_the_right_step",
                           f"{_HERE}::test_grain_pipeline_same_global_batches_on_any_process_count",
                           "tests/test_grain_source.py::test_a_resume_reads_no_record_before_its_step"],
                  reason="two ResNet-18 runs with evaluation: 80 s alone")
@pytest.mark.tf  # TFDS (the digits built as ArrayRecord), TF image functions in Grain
def test_cpu_config_on_grain_runs_and_resumes_bitwise(tmp_path, digits_array_record_dir,
                                                     compilation_cache):
  """The Quickstart's config (Grain, one worker process) for 4 steps, saving at 2 and 4;
  then a new run in another workdir resumes from a copy of that step-2 checkpoint (a new
  source and worker, at step 2) and reaches the same state at 4, bitwise."""
  config = _few_steps(cpu_config.get_config(), digits_array_record_dir, 4,
                      checkpoint_every_steps=2)
  assert config.input_pipeline == "grain" and config.grain_workers == 1
  whole = str(tmp_path / "whole")
  r = train.train_and_evaluate(config, whole)
  assert r["step"] == 4 and r["device_calls"] == 2 and r["steps_per_epoch"] == 11
  assert r["eval_count"] == 360 and r["compile_count"] == 1
  assert r["model"] == "ResNet-18" and r["num_params"] == 11_181_642
  losses = [row["loss"] for row in _metrics_rows(whole) if "loss" in row]
  assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
  split = tmp_path / "split"
  shutil.copytree(os.path.join(whole, "checkpoints", "2"), split / "checkpoints" / "2")
  resumed = train.train_and_evaluate(config, str(split))
  assert resumed["restored_step"] == 2 and resumed["step"] == 4
  assert [row["loss"] for row in _metrics_rows(str(split)) if "loss" in row] == losses[1:]
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(r["state"]),
               jax.device_get(resumed["state"]))


@pytest.mark.tf  # TFDS (the digits built as ArrayRecord), TF image functions in Grain
def test_grain_pipeline_same_global_batches_on_any_process_count(digits_array_record_dir):
  from examples.resnet50 import digits_tfds

  builder = digits_tfds.ensure_prepared(digits_array_record_dir, file_format="array_record")
  p = input_pipeline.Preprocessing(image_size=16, random_resized_crop=True, flip=True)
  make = lambda i, n: input_pipeline.grain_train_source(
      builder, split="train", global_batch_size=32, preprocessing=p, seed=3,
      process_index=i, process_count=n)
  one = make(0, 1)
  assert one.steps_per_epoch == 1437 // 32
  chunk = one.chunk_at(43, 3)  # crosses the end of epoch 0
  assert chunk["image"].dtype == np.uint8 and chunk["image"].shape == (3, 32, 16, 16, 3)
  assert chunk["label"].dtype == np.int32 and chunk["label"].shape == (3, 32)
  halves = [make(i, 2).chunk_at(43, 3) for i in range(2)]
  for key in chunk:  # rows [0, 16) from process 0, [16, 32) from process 1: the same bytes
    assert np.concatenate([h[key] for h in halves], axis=1).tobytes() == chunk[key].tobytes()
  assert one.chunk_at(44, 1)["image"].tobytes() == chunk["image"][1:2].tobytes()
  evals = input_pipeline.GrainEvalBatches(builder, split="test", global_batch_size=100,
                                          preprocessing=p, process_index=1, process_count=2)
  assert evals.num_batches == 4 and [len(b["label"]) for b in evals] == [50, 50, 50, 30]
  with pytest.raises(ValueError, match="was built as 'array_record', but 'tfrecord' was asked"):
    digits_tfds.ensure_prepared(digits_array_record_dir, file_format="tfrecord")


@pytest.mark.tf
def test_each_pipeline_refuses_a_dataset_built_in_the_other_format(
    digits_array_record_dir, digits_dir):
  config = cpu_config.get_config()
  config.input_pipeline = "grain"
  config.data_dir = digits_dir  # the TFRecord build
  with pytest.raises(ValueError, match="built as 'tfrecord', but 'array_record' was asked") as e:
    input_pipeline.create_datasets(config)
  assert os.path.join(digits_dir, "sklearn_digits") in str(e.value)  # where it looked
  assert "--config.data_dir=DIR" in str(e.value)
  assert "--config.input_pipeline=tfdata" in str(e.value)
  config.input_pipeline = "tfdata"
  config.data_dir = digits_array_record_dir
  with pytest.raises(ValueError, match="built as 'array_record', but 'tfrecord' was asked"):
    input_pipeline.create_datasets(config)
  config.input_pipeline = "dali"
  with pytest.raises(ValueError, match="input_pipeline must be one of"):
    input_pipeline.create_datasets(config)


@pytest.mark.slow(held_by=f"{_HERE}::test_smoke_two_loops_on_mock_imagenet",
                  reason="the tf.data pipeline trains ResNet-18: ~3 min of compiles")
def test_cpu_config_on_the_tfdata_pipeline_runs(tmp_path, digits_dir):
  config = _few_steps(cpu_config.get_config(), digits_dir, 4)
  config.input_pipeline = "tfdata"
  r = train.train_and_evaluate(config, str(tmp_path))
  assert r["step"] == 4 and r["device_calls"] == 2 and r["steps_per_epoch"] == 11
  assert r["eval_count"] == 360 and r["compile_count"] == 1
  losses = [row["loss"] for row in _metrics_rows(str(tmp_path)) if "loss" in row]
  assert len(losses) == 2 and all(math.isfinite(v) for v in losses)


@pytest.mark.slow(held_by=f"{_HERE}::test_resume_from_checkpoint_continues_at_the_right_step",
                  reason="four more smoke runs (smoke_run's ResNet-18: 323 s with smoke.py's "
                         "ResNet-50 in a loaded CI run)")
def test_resume_and_k_do_not_change_the_final_state(tmp_path):
  """6 steps at K = 2 straight; cut at step 4 and resumed; and at K = 3 and K = 1: the same
  final state, bitwise (params, BatchNorm statistics, optimizer state, step). Batches of 8
  make epochs of 5 steps (a call ends at an epoch's end): K = 2 runs calls of 2, 2, 1, 1
  (checkpoints every 2 steps), K = 3 of 3, 2, 1."""
  config = _smoke_config()
  config.global_batch_size = 8
  config.num_train_steps = 6
  with jax.default_prng_impl(_FAST_INIT):  # as smoke_run
    whole = train.train_and_evaluate(config, str(tmp_path / "whole"))
    config.num_train_steps = 4
    train.train_and_evaluate(config, str(tmp_path / "split"))
    config.num_train_steps = 6
    resumed = train.train_and_evaluate(config, str(tmp_path / "split"))
    config.checkpoint_every_steps, config.log_every_steps = 0, 6  # no cut inside the calls
    others = []
    for k in (3, 1):
      config.iterations_per_loop = k
      others.append(train.train_and_evaluate(config, str(tmp_path / f"k{k}")))
  assert resumed["restored_step"] == 4 and whole["steps_per_epoch"] == 5
  assert [r["device_calls"] for r in (whole, resumed, *others)] == [4, 4, 3, 6]
  for r in (resumed, *others):
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(whole["state"]),
                 jax.device_get(r["state"]))


@pytest.mark.slow(held_by=f"{_HERE}::test_main_refuses_wrong_config_values_before_it_starts",
                  reason="main.py end to end in a subprocess: compiles the ResNet again")
def test_main_cli_smoke(tmp_path):
  """main.py with configs/smoke.py, its model overridden on the command line to smoke_run's
  ResNet-18 (ResNet-50 took 140 s of a loaded CI run; its programs compile in
  test_smoke_config_compiles_for_v5e_2x2)."""
  out = subprocess.run(
      [sys.executable, "-m", "examples.resnet50.main", f"--workdir={tmp_path}",
       "--config=examples/resnet50/configs/smoke.py", "--config.model.depth=18"], cwd=REPO,
      env={**os.environ, "JAX_DEFAULT_PRNG_IMPL": _FAST_INIT},  # as smoke_run
      capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "eval accuracy" in out.stdout and str(tmp_path) in out.stdout
  results = json.load(open(tmp_path / "results.json"))
  assert (results["step"], results["model"]) == (4, "ResNet-18")


def test_main_refuses_wrong_config_values_before_it_starts(tmp_path):
  """Mistyped --config values: every one named, no traceback, nothing written, and TensorFlow
  never imported (the check runs before the backend, the data and the workdir)."""
  workdir = tmp_path / "run"
  out = subprocess.run(
      [sys.executable, "-X", "importtime", "-m", "examples.resnet50.main",
       f"--workdir={workdir}", "--config.input_pipeline=grian",
       "--config.iterations_per_loop=0", "--config.global_batch_size=-8",
       "--config.num_epochs=0"], cwd=REPO, capture_output=True, text=True, timeout=300)
  assert out.returncode == 1, out.stderr[-3000:]
  for line in ("config.input_pipeline must be one of ['grain', 'tfdata'], got 'grian'",
               "config.iterations_per_loop must be an integer > 0, got 0",
               "config.global_batch_size must be an integer > 0, got -8",
               "config.num_epochs must be > 0 (or config.num_train_steps > 0), got "
               "num_epochs=0, num_train_steps=-1"):
    assert line in out.stderr, out.stderr[-3000:]
  assert "Traceback" not in out.stderr
  assert not workdir.exists()
  imported = {row.split("|")[-1].strip() for row in out.stderr.splitlines()
              if row.startswith("import time:")}
  assert "examples.resnet50.config_checks" in imported and "tensorflow" not in imported


def test_the_shipped_configs_pass_the_checks():
  for module in (cpu_config, cpu_resnet50, default_config, finetune_config, imagenet_flax,
                 tpu_config, smoke_config):
    assert config_checks.problems(module.get_config()) == [], module.__name__
  config = finetune_config.get_config()
  config.label_modulo = 6
  assert config_checks.problems(config) == [
      "config.label_modulo must be <= config.num_classes (the labels 0..label_modulo - 1 need "
      "as many logits), got 6 > 5"]


def test_finetune_config_warm_starts_a_new_head_from_a_checkpoint(tmp_path):
  """configs/finetune.py on a checkpoint of configs/cpu.py's model (4 filters here): the
  source's params and BatchNorm statistics, a fresh 5-class head, a fresh optimizer at step 0;
  the task's labels are the digits mod 5, in the train and the eval step alike."""
  from loopkit.checkpoint import CheckpointHook
  from loopkit.core import Ledger

  config = finetune_config.get_config()
  config.model.num_filters = 4
  config.init_from = str(tmp_path / "quickstart")
  tx = train.create_optimizer(config, optax.constant_schedule(0.05))
  # The model's state tree with random values (initialising it compiles for minutes here).
  rng = np.random.default_rng(0)
  fresh = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape), a.dtype),
                       jax.eval_shape(lambda: train.create_train_state(
                           train.create_model(config), tx)[1]))
  # the Quickstart's state: other values, a 10-class head
  params = jax.tree.map(lambda x: x + 1, fresh.params)
  params["head"] = {"kernel": jnp.ones((32, 10)), "bias": jnp.ones((10,))}
  source = train.TrainState(step=jnp.int32(66), params=params,
                            batch_stats=jax.tree.map(lambda x: x + 2, fresh.batch_stats),
                            opt_state=tx.init(params))
  hook = CheckpointHook(tmp_path / "quickstart", async_save=False)
  hook.save(66, source, ledger=Ledger(step=66))
  hook.close()

  state = train.warm_start_of(config).apply(fresh)
  assert state.params["head"]["kernel"].shape == (32, 5)
  np.testing.assert_array_equal(state.params["head"]["kernel"], fresh.params["head"]["kernel"])
  body = {k: v for k, v in state.params.items() if k != "head"}
  jax.tree.map(np.testing.assert_array_equal, body,
               {k: v for k, v in source.params.items() if k != "head"})
  jax.tree.map(np.testing.assert_array_equal, state.batch_stats, source.batch_stats)
  jax.tree.map(np.testing.assert_array_equal, state.opt_state, fresh.opt_state)
  assert int(state.step) == 0
  labels = jnp.arange(10, dtype=jnp.int32)
  assert train.relabel(labels, 5).tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4]
  assert train.relabel(labels, 0).tolist() == list(range(10))
  assert train.warm_start_of(cpu_config.get_config()) is None
  schedule = train.learning_rate_schedule(config, 11)  # no warmup: from the peak, cosine
  reference = optax.warmup_cosine_decay_schedule(0.0, 0.05, 0, 11, 0.0)
  assert [float(schedule(s)) for s in range(12)] == [float(reference(s)) for s in range(12)]
  assert float(schedule(0)) == np.float32(0.05) and float(schedule(11)) == 0.0


def _own_module_names() -> set[str]:
  """The file names of this example's and loopkit's modules (absl's log lines name them)."""
  names = {f for f in os.listdir(os.path.dirname(__file__)) if f.endswith(".py")}
  for _, _, files in os.walk(os.path.join(REPO, "loopkit")):
    names |= {f for f in files if f.endswith(".py")}
  return names


# absl's line: level, date, time, thread, file:line] message.
ABSL_LINE = re.compile(r"([IWEF])\d{4} (\d\d):(\d\d):(\d\d\.\d+) +\d+ (\S+?):\d+\] (.*)")
# The goodput summary's table (the lines after "goodput summary:").
GOODPUT_TABLE = re.compile(r"goodput [\d.]+% at step \d+ .*|bucket +seconds +share|"
                           r" *[a-z_ ]+? +[\d.]+ +[\d.]+%")
# What other libraries print on a first run (C70): TFDS, the TPU probe, TensorFlow's C++ start-up
# lines, Python warnings.
NOT_OURS = ("Downloading", "Unable to initialize backend", "libtpu", "TPU_", "InitGoogle",
            "absl::InitializeLog", "oneDNN", "This TensorFlow binary", "cpu_feature_guard",
            "Warning:", "warn(")


def console_records(stderr: str) -> list[tuple[float, str, str]]:
  """``(seconds since midnight, file, message)`` of each absl record on ``stderr``; the lines
  of a multi-line record (a console row wider than 100 columns, the goodput summary) are
  checked to be that record's and joined to it. Any other line fails the test."""
  records: list[tuple[float, str, str]] = []
  for line in stderr.splitlines():
    m = ABSL_LINE.fullmatch(line)
    if m:
      h, mi, sec = int(m.group(2)), int(m.group(3)), float(m.group(4))
      records.append((3600 * h + 60 * mi + sec, m.group(5), m.group(6)))
      continue
    assert records, line
    t, file, message = records[-1]
    if re.fullmatch(r"step \d+:", message.split("\n")[0]):  # a wide row: indented cells
      assert line.startswith("  "), line
    else:
      assert message.startswith("goodput summary:") and GOODPUT_TABLE.fullmatch(line), line
    records[-1] = (t, file, message + "\n" + line)
  return records


@pytest.mark.slow(held_by="tests/test_logs.py::test_a_first_run_says_what_it_waits_for_first",
                  reason="the whole Quickstart example, cut to 2 steps (100 s on 2 busy cores)")
@pytest.mark.tf  # TFDS, TensorFlow in the Grain worker
def test_a_first_run_prints_only_its_own_lines(tmp_path):
  """C70: the Quickstart's command on a fresh machine (no dataset, no JAX_PLATFORMS,
  TF_CPP_MIN_LOG_LEVEL, TF_ENABLE_ONEDNN_OPTS or XLA_FLAGS; libtpu installed here), cut to 2
  steps of a small ResNet-18, a checkpoint and the final evaluation: every stderr line is a
  log record of this example or of loopkit, stdout holds only the run's summary, nothing of
  TFDS, the TPU probe or TensorFlow's start-up shows, and each long wait is announced, in
  order, before it: the first call's line before the data wait and compile that the run's
  goodput row counts, the eval line before the evaluation's seconds."""
  env = {k: v for k, v in os.environ.items()
         if k not in ("JAX_PLATFORMS", "TF_CPP_MIN_LOG_LEVEL", "TF_ENABLE_ONEDNN_OPTS",
                      "XLA_FLAGS")}
  workdir = tmp_path / "run"
  out = subprocess.run(
      [sys.executable, "-m", "examples.resnet50.main", f"--workdir={workdir}",
       f"--config.data_dir={tmp_path / 'tfds'}", "--config.num_train_steps=2",
       "--config.iterations_per_loop=2", "--config.log_every_steps=2",
       "--config.model.num_filters=4", "--config.image_size=8",
       "--config.global_batch_size=16", "--config.checkpoint_every_epochs=0",
       "--config.checkpoint_every_steps=2"], cwd=REPO, env=env, capture_output=True, text=True,
      timeout=900)
  assert out.returncode == 0, out.stderr[-3000:]
  check_first_run_console(out.stdout, out.stderr, workdir)


def check_first_run_console(stdout: str, stderr: str, workdir) -> None:
  """The checks of :func:`test_a_first_run_prints_only_its_own_lines` on a run's console."""
  for fragment in NOT_OURS:
    assert fragment not in stderr + stdout, (fragment, stderr)
  records = console_records(stderr)
  own = _own_module_names()
  assert [r for r in records if r[1] not in own] == [], stderr
  assert [line.split(":")[0] for line in stdout.splitlines()] == [
      "ResNet-18", "results (JSON)", "metrics (JSONL, TB)", "checkpoints (Orbax)"], stdout
  messages = [r[2] for r in records]
  announced = ["JAX process 0/1, 8 devices (8 local) x cpu",
               "importing TensorFlow (the input pipeline), Flax and the training code",
               "building the sklearn_digits dataset", "built sklearn_digits in",
               "initialising the ResNet-18 parameters (seed 0)", "ResNet-18: 45,102 parameters",
               "step 0/2: waiting for the first batches, then compiling the first device call",
               "step 2: accuracy=", "saving checkpoint 2 in",
               "evaluation: waiting for the first batches, then compiling the eval program "
               "(batch 360, 1 per device call)", "step 2: eval/accuracy="]
  at = [next((i for i, msg in enumerate(messages) if msg.startswith(a)), None)
        for a in announced]
  assert None not in at and at == sorted(at), list(zip(announced, at))
  # The waits lie after their lines: the time to the next record covers the goodput ledger's
  # seconds of the wait (the row at the end of the run).
  with open(workdir / "metrics.jsonl") as f:
    goodput = [row for row in map(json.loads, f) if "goodput/compile_secs" in row][-1]
  gap = lambda i: records[i + 1][0] - records[i][0]
  first_call = goodput["goodput/data_wait_secs"] + goodput["goodput/compile_secs"]
  assert gap(at[6]) >= first_call - 0.01, (gap(at[6]), goodput)
  assert gap(at[9]) >= 0.9 * goodput["goodput/eval_secs"] - 0.01, (gap(at[9]), goodput)


def compile_for_topology(config, topology: str, *, with_eval: bool = True):
  """The run's train (and eval) programs compiled for a TPU topology, without a TPU or data.

  The same steps, K, batch shapes (``{"image": uint8 [B, S, S, 3], "label": int32 [B]}``),
  shardings and donation as ``train.train_and_evaluate``, from abstract state, through
  :func:`loopkit.tools.aot.compile_for` (docs/aot.md): how the README's TPU reports were made.
  """
  from loopkit.tools import aot, topology as topology_lib

  mesh = train.make_mesh(topology_lib.topology_devices(topology))
  axis_name = "data" if config.step_style == "per_device" else None
  dtype = train.compute_dtype(config)
  schedule = train.learning_rate_schedule(config, 1)  # its constants, not the program's shapes
  tx = train.create_optimizer(config, schedule)
  create = lambda: train.create_train_state(train.create_model(config, axis_name=axis_name), tx)
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: train.create_model(config, axis_name=axis_name)))
  state = jax.eval_shape(lambda: create()[1])

  def batch(b):
    size = config.image_size
    return {"image": jax.ShapeDtypeStruct((b, size, size, 3), jnp.uint8),
            "label": jax.ShapeDtypeStruct((b,), jnp.int32)}

  evaluator = loopkit.Evaluator(train.make_eval_step(graphdef, dtype=dtype),
                                iterations_per_loop=config.eval_iterations_per_loop, mesh=mesh,
                                step_style=config.step_style,
                                global_batch_size=config.eval_batch_size,
                                prefetch=config.prefetch)
  program = loopkit.core.MultiStepProgram(
      train.make_train_step(graphdef, tx, schedule, num_classes=config.num_classes,
                            label_smoothing=config.label_smoothing, dtype=dtype,
                            axis_name=axis_name),
      iterations_per_loop=config.iterations_per_loop, mesh=mesh, style=config.step_style)
  return aot.compile_for(program, state, batch(config.global_batch_size), topology=topology,
                         mesh=mesh, evaluator=evaluator if with_eval else None,
                         eval_batch=batch(config.eval_batch_size), prefetch=config.prefetch)


@pytest.mark.slow(held_by="tests/test_aot.py::test_eval_program_with_the_train_program",
                  reason="ResNet-50 train and eval programs compiled for a TPU topology")
def test_smoke_config_compiles_for_v5e_2x2():
  """configs/smoke.py's ResNet-50 at 32x32, K = 4, train + eval, for 4 v5e chips."""
  from loopkit.tools import topology

  config = smoke_config.get_config()
  config.iterations_per_loop = 4
  report = compile_for_topology(config, "v5e:2x2")
  v5e = topology.CHIPS["v5e"]
  assert (report.topology, report.chip, report.num_devices, report.num_processes,
          report.mesh_shape) == ("v5e:2x2", v5e, 4, 1, {"data": 4})
  assert set(report.programs) == {"train", "eval"}
  assert report.programs["eval"].trace_count == 1
  t = report.train
  assert t.trace_count == 1 and t.executable is not None  # one train executable, traced once
  assert (t.iterations_per_loop, t.global_batch_size, t.per_device_batch) == (4, 16, 4)
  # chunk [K, B/D, 32, 32, 3] uint8 + labels [K, B/D] int32, per device
  assert t.chunk_bytes == 4 * 4 * (32 * 32 * 3 + 4)
  assert t.prefetch_chunks == config.prefetch
  assert t.device_chunk_bytes == (config.prefetch + 3) * t.chunk_bytes  # what a run checks
  # the donated state (replicated: all of it on each device) is aliased to the new state;
  # TPU layouts pad small dimensions to tiles, so on the chip it takes more than its bytes
  state = jax.eval_shape(lambda: train.create_train_state(
      train.create_model(config), train.create_optimizer(
          config, train.learning_rate_schedule(config, 2)))[1])
  state_bytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(state))
  assert state_bytes <= t.alias_bytes <= min(t.output_bytes, t.argument_bytes)
  assert t.argument_bytes >= state_bytes + t.chunk_bytes
  assert t.generated_code_bytes > 0 and t.temp_bytes >= 0  # XLA:TPU reports 0 for this tiny
  # model (measured); ImageNet at 224x224 needs GiB of them (README)
  assert t.peak_bytes == t.argument_bytes + t.output_bytes - t.alias_bytes + t.temp_bytes
  assert t.used_bytes == t.peak_bytes + t.prefetch_chunks * t.chunk_bytes
  assert t.hbm_bytes == v5e.hbm_bytes == 16 * 2**30
  assert t.headroom_bytes == t.hbm_bytes - t.used_bytes > 0
  assert t.flops_per_step > 0 and t.bytes_accessed_per_step > 0
  assert t.compute_bound_secs == t.flops_per_step / v5e.peak_bf16_flops
  assert t.memory_secs == t.bytes_accessed_per_step / v5e.hbm_bytes_per_sec
  assert t.step_secs == t.compute_bound_secs and t.examples_per_sec == 16 / t.step_secs
  assert t.mfu_ceiling == t.compute_bound_secs / max(t.compute_bound_secs, t.memory_secs)
  text = str(report)
  assert "v5e:2x2" in text and "headroom" in text and v5e.source in text
  assert (f"MFU (bf16 peak): 100% at the compute bound; a measured step of t ms runs at MFU "
          f"{t.step_secs * 1e3:.4g} ms / t; at most {t.mfu_ceiling * 100:.3g}%") in text
  assert report.to_dict()["programs"]["train"]["flops_per_step"] == t.flops_per_step
  assert jax.default_backend() == "cpu" and jax.devices()[0].platform == "cpu"


@pytest.mark.slow(held_by="tests/test_gpu_bench.py::test_ratios_and_mfu_come_from_the_measured_rows",
                  reason="the GPU benchmark script end to end")
def test_gpu_bench_tiny_runs_on_cpu():
  """The script's --tiny CPU check, cut to a ResNet-18 and 8 timed steps at K = 1 and 4 (its
  defaults, ResNet-50 and K = 100, run 400 steps: 120 s of a loaded CI run)."""
  out = subprocess.run([sys.executable, "examples/resnet50/gpu_bench.py", "--tiny", "--depth=18",
                        "--ks=1,4", "--timed_steps=8"], cwd=REPO,
                       capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stderr[-3000:]
  rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
  assert [row["iterations_per_loop"] for row in rows] == [1, 4]
  assert [row["timed_steps"] for row in rows] == [8, 8]
  assert {row["model"] for row in rows} == {"ResNet-18/8 filters"}
  assert all(row["images_per_sec"] > 0 and row["compile_count"] == 1 for row in rows)
