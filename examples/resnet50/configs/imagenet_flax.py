"""The Flax ImageNet example's ResNet-50 recipe, on a TPU pod slice: batch 1024, 100 epochs.

This is the config with published accuracy. The Flax example
(``examples/imagenet`` at Flax commit 18f8f311) reports, in its README, 76.54%
top-1 on a TPU v3-32, 76.67% on a v2-32 and 76.37% on a v3-8, each after
125,100 steps: 100 epochs of 1,251 steps at global batch 1024
(``configs/tpu.py`` there; 1,281,167 // 1024 = 1,251). loopkit has not run this
config to the end yet; those figures are Flax's, not loopkit's.

Launch (every worker runs the same command; README.md has the data preparation
and the TPU VM setup):

  gcloud compute tpus tpu-vm ssh $TPU_NAME --zone=$ZONE --worker=all --command="
    cd ~/loopkit && python3 -m examples.resnet50.main \\
      --config=examples/resnet50/configs/imagenet_flax.py \\
      --config.data_dir=gs://$BUCKET/tensorflow_datasets \\
      --workdir=gs://$BUCKET/resnet50/flax1"

The recipe, value by value (file names are in Flax's ``examples/imagenet`` at
commit 18f8f311):

* Global batch 1024 (``configs/tpu.py``), 100 epochs and 5 linear warmup
  epochs from 0 (``configs/default.py``), then cosine decay to 0 over the other
  95 (``create_learning_rate_fn`` in ``train.py``); peak learning rate
  0.1 x 1024 / 256 = 0.4 (``train.py``).
* SGD, momentum 0.9, Nesterov (``train.py``); L2 penalty 1e-4 / 2 x |w|^2 on
  every parameter with more than one dimension, i.e. the convolution and dense
  kernels (``train.py``): the same gradient as loopkit's decayed weights.
* Plain softmax cross-entropy, no label smoothing (``train.py``).
* ResNet-50 v1.5 (``models.py``): the same blocks, BatchNorm momentum 0.9 and
  epsilon 1e-5, last scale of each block 0, 25,557,032 parameters as loopkit's
  model; its convolutions and max-pool pad ``SAME`` (so the strided 3x3
  convolutions and the max-pool pad (0, 1) at 224x224; the 7x7 stem (3, 3)),
  and its kernels get Flax's default ``lecun_normal``: ``model.padding =
  "same"``, ``model.kernel_init = "lecun_normal"`` here.
* Inception crop, flip, bicubic resize, 0.875 center crop for eval, ImageNet
  mean/std normalisation (``input_pipeline.py``), as ``default.py``.
* bfloat16 compute on TPU (``configs/tpu.py``), float32 parameters.
* Evaluation after every epoch (``train.py``).

Not step for step with Flax's program (each does not change the recipe):

* Evaluation covers all 50,000 validation images (the last batch padded and
  masked); Flax's covers 48 batches of 1024 = 49,152 of them.
* In bfloat16, loopkit's model averages the last feature map and returns the
  logits in float32; Flax's does both in bfloat16. In float32 the two train
  steps agree to float32 rounding (``recipe_test.py``).
* Initial values and data order come from other random streams (same
  distributions).

loopkit's choices:

* iterations_per_loop K = 139: 1,251 = 9 x 139, so each epoch is exactly 9
  device calls and the per-epoch evaluation falls on a call boundary; the
  other divisors are 9 (139 calls per epoch, more host round trips for
  nothing) and 417 (a chunk of 417 x 1024 uint8 images is 64 GB globally). A
  chunk [139, 1024, 224, 224, 3] uint8 is 21.4 GB globally: 0.67 GB per chip
  on 32 chips, 1.34 GB on 16, three live with ``prefetch = 2``.
* steps_per_epoch: each host drops its own shard's remainder, floor(1,281,167
  / P) // (1024 / P) = 1,251 for P = 1, 2, 4, 8 or 16 hosts, Flax's count.
* The whole evaluation in one device call: eval K = ceil(50,000 / 1024) = 49.
* Checkpoints every 10 epochs (as Flax), 3 kept; a preemption (SIGTERM) saves
  at the next call boundary anyway.
"""

from examples.resnet50.configs import default

STEPS_PER_EPOCH = 1_281_167 // 1024  # 1,251


def get_config():
  """The Flax ImageNet recipe: ResNet-50, batch 1024, 100 epochs, no smoothing, K = 139."""
  config = default.get_config()
  config.distributed = True            # jax.distributed.initialize() before anything else
  config.data_dir = ""                 # set --config.data_dir=gs://BUCKET/tensorflow_datasets
  config.half_precision = True
  config.model.padding = "same"
  config.model.kernel_init = "lecun_normal"
  config.global_batch_size = 1024
  config.num_epochs = 100
  config.warmup_epochs = 5
  config.base_learning_rate = 0.1
  config.momentum = 0.9
  config.nesterov = True
  config.weight_decay = 1e-4
  config.label_smoothing = 0.0
  config.iterations_per_loop = 139     # 9 device calls per epoch of 1,251 steps
  config.prefetch = 2
  config.log_every_steps = 139
  config.progress_every_secs = 60.0
  config.eval_every_epochs = 1
  config.eval_batch_size = 1024
  config.eval_iterations_per_loop = 49  # ceil(50,000 / 1024): the whole eval in one call
  config.checkpoint_every_epochs = 10
  config.max_checkpoints_to_keep = 3
  config.shuffle_buffer = 16_384       # per host: 16 x batch, as Flax's configs/tpu.py
  return config
