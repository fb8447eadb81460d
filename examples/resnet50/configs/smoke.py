"""Smoke test of the ImageNet code path on mock data (tests, and a quick local check).

Run (from the repository root; no data needed):

  python -m examples.resnet50.main --workdir /tmp/resnet-smoke \\
      --config examples/resnet50/configs/smoke.py

The ``imagenet2012`` pipeline (JPEG decode-and-crop, Inception crop, flip,
uint8 to the device, exact padded eval) on ``tfds.testing.mock_data``: 40
random JPEGs per split, 1000 classes, a bottleneck ResNet-50 with 8 base
filters at 32x32 in bfloat16, 2 device calls of K = 2 steps at global batch 16
and an exact eval of the 40 mock validation images in batches of 32 (the
second padded). Loss and accuracy are meaningless; it checks that everything
runs, the ledger, and the counts.
"""

from examples.resnet50.configs import default


def get_config():
  """ImageNet recipe, shrunk: mock data, 32x32, ResNet-50/8 filters, 4 steps, K = 2."""
  config = default.get_config()
  config.mock_data = True
  config.mock_num_examples = 40
  config.num_train_examples = 40       # mock_data has no split metadata
  config.num_eval_examples = 40
  config.image_size = 32
  config.shuffle_buffer = 64
  config.model.num_filters = 8
  config.global_batch_size = 16        # 2 per fake device
  config.num_train_steps = 4
  config.iterations_per_loop = 2       # 2 device calls
  config.warmup_epochs = 1
  config.log_every_steps = 2
  config.eval_every_epochs = 0         # only at the end
  config.eval_batch_size = 32
  config.eval_iterations_per_loop = 2
  config.checkpoint_every_epochs = 0
  config.checkpoint_every_steps = 2
  return config
