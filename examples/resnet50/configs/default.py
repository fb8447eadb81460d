"""The ResNet-50 ImageNet settings every config starts from: each value with its source.

Not meant to be run as is on a particular machine, and not one published
recipe: a 90-epoch schedule after Goyal et al. 2017 with the MLPerf
reference's label smoothing and initialisation. ``imagenet_flax.py`` (the Flax
ImageNet example's recipe, step for step, the one with published accuracy),
``imagenet_tpu.py`` (a faster batch-4096 variant, not run), ``cpu.py`` (digits
on this CPU), ``cpu_resnet50.py`` and ``smoke.py`` start from it. Sources cited:

* [He16]    He, Zhang, Ren, Sun 2016, "Deep Residual Learning for Image Recognition".
* [Goyal17] Goyal et al. 2017, "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour".
* [Szegedy15/16] "Going Deeper with Convolutions" / "Rethinking the Inception Architecture".
* [Tricks19] He et al. 2019, "Bag of Tricks for Image Classification with CNNs".
* [Flax]    the Flax ImageNet example (``examples/imagenet`` at Flax commit 18f8f311;
            its recipe is ``imagenet_flax.py``).
* [MLPerf]  the MLPerf Training ResNet-50 v1.5 reference.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  """ResNet-50 v1.5 on ImageNet for 90 epochs (see the module docstring for sources)."""
  config = ml_collections.ConfigDict()
  config.seed = 0

  # -- data ---------------------------------------------------------------------
  config.dataset = "imagenet2012"      # TFDS name; prepared in data_dir beforehand
  config.data_dir = ""                 # "": $TFDS_DATA_DIR or ~/tensorflow_datasets
  config.train_split = "train"         # 1,281,167 images
  config.eval_split = "validation"     # 50,000 images
  config.num_classes = 1000
  config.num_train_examples = 0        # 0: from the TFDS metadata
  config.num_eval_examples = 0
  config.mock_data = False             # wrap the run in tfds.testing.mock_data (smoke tests)
  config.mock_num_examples = 0
  config.image_size = 224              # [He16]
  config.random_resized_crop = True    # Inception crop [Szegedy15], as [Flax], [MLPerf]
  config.area_range = (0.08, 1.0)      # [Szegedy15] via [Flax]/[MLPerf]
  config.aspect_ratio_range = (3 / 4, 4 / 3)  # [Szegedy15] via [Flax]/[MLPerf]
  config.flip = True                   # random horizontal flip [He16]
  config.crop_fraction = 0.875         # eval: center crop 224 of 256 [Flax], [MLPerf]
  config.resize_method = "bicubic"     # [Flax]
  config.shuffle_buffer = 16_384       # examples per process; [Flax] uses 16 x batch
  # "tfdata": TFRecords via tf.data (resumes by skipping the epoch's consumed records);
  # "grain": ArrayRecord via tfds.data_source + Grain (loopkit.data.GrainSource: O(1)
  # resume, the same global batches on any process count).
  config.input_pipeline = "tfdata"
  config.grain_workers = 0             # Grain worker processes (decode + augment)

  # -- model --------------------------------------------------------------------
  config.model = ml_collections.ConfigDict()
  config.model.depth = 50              # ResNet-50 v1.5 [He16], [MLPerf]
  config.model.num_filters = 64        # [He16]
  config.model.bn_momentum = 0.9       # running-average decay of BN statistics [Flax], [MLPerf]
  # Symmetric (k - 1) // 2 padding of every convolution and the max-pool [MLPerf] (torchvision);
  # [Flax] pads "SAME" instead (see models.py).
  config.model.padding = "symmetric"
  # He-normal fan_out convolutions, N(0, 0.01^2) dense kernel [MLPerf] (torchvision);
  # [Flax] uses lecun_normal for both.
  config.model.kernel_init = "he_fan_out"
  config.half_precision = True         # bfloat16 compute, float32 params [Flax] (TPU)

  # -- optimisation -------------------------------------------------------------
  config.global_batch_size = 1024      # [Flax] TPU config; lr scales with it [Goyal17]
  config.num_epochs = 90               # [He16], [Goyal17] ([Flax] trains 100)
  config.num_train_steps = -1          # > 0 overrides num_epochs (smoke tests)
  config.base_learning_rate = 0.1      # per 256 examples: lr = 0.1 * B / 256 [Goyal17]
  config.warmup_epochs = 5             # linear warmup from 0 [Goyal17]
  # After warmup: cosine decay to 0 [Tricks19], [Flax] (He16/Goyal17 used steps at 30/60/80).
  config.momentum = 0.9                # [He16], [Goyal17]
  config.nesterov = True               # Nesterov momentum [Goyal17], [Flax]
  # L2 1e-4 [He16], [Goyal17]; not on BN [Goyal17] nor on biases [Tricks19].
  config.weight_decay = 1e-4
  config.label_smoothing = 0.1         # [Szegedy16], [Tricks19], [MLPerf]

  # -- loopkit ------------------------------------------------------------------
  config.step_style = "global"         # BN statistics over the global batch (see models.py)
  config.iterations_per_loop = 100     # K: train steps per device call
  config.prefetch = 2                  # input chunks [K, B, ...] prepared ahead
  config.log_every_steps = 100
  config.progress_every_secs = 30.0
  config.eval_every_epochs = 1         # 0: only at the end
  config.eval_batch_size = 1024
  config.eval_iterations_per_loop = 16  # eval batches per device call
  config.checkpoint_every_epochs = 1   # 0 and checkpoint_every_steps 0: no checkpoints
  config.checkpoint_every_steps = 0
  config.max_checkpoints_to_keep = 3
  # -- warm start (fine-tuning) ----------------------------------------------------
  # A loopkit checkpoint directory (e.g. /tmp/resnet-cpu/checkpoints) whose latest params and
  # batch_stats start this run (fresh optimizer, step 0), while the workdir has no checkpoint
  # of its own (train.warm_start_of); "": from scratch.
  config.init_from = ""
  config.init_exclude = ""             # a pattern of leaves kept fresh: "params/head" (new head)
  config.label_modulo = 0              # > 0: learn label % label_modulo (a relabelled task)
  config.platform = ""                 # JAX's platform: "" = JAX picks (TPU, GPU, else CPU)
  config.distributed = False           # call jax.distributed.initialize() (multi-host)
  return config
