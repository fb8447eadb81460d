"""Default configuration of the digits example.

Run (from the repository root):

  python -m examples.digits.main --workdir /tmp/loopkit-digits

It should reach >= 97% test accuracy on the 360 held-out digits in well under
a minute on 2 CPU cores with 8 fake devices (measured numbers in
``examples/digits/README.md``). Override fields with ``--config.<name>=value``,
e.g. ``--config.iterations_per_loop=5``.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  """The default hyperparameters (MLP 64-512-256-10, AdamW, 30 epochs of batch 64)."""
  config = ml_collections.ConfigDict()
  config.seed = 0
  # Data: 1,797 digits; a fixed, stratified test split of 360 (20%).
  config.test_size = 360
  config.split_seed = 0
  # Model.
  config.hidden_sizes = (512, 256)
  config.dropout_rate = 0.2
  # Optimisation: global batch 64 (divisible by 8 devices); 1,437 // 64 = 22 steps per epoch.
  config.global_batch_size = 64
  config.num_epochs = 30
  config.learning_rate = 3e-3
  config.weight_decay = 1e-4
  # loopkit: K = 20 steps per device call; with 22 steps per epoch the planner
  # cuts each epoch into calls of 20 and 2 steps (calls never cross an epoch end).
  config.iterations_per_loop = 20
  config.log_every_epochs = 1
  config.eval_every_epochs = 10
  # Exact evaluation on the 360 test digits: batches of 120 (3 batches, one device call).
  config.eval_batch_size = 120
  config.eval_iterations_per_loop = 4
  # JAX's platform: the CPU (8 fake devices), without probing for a TPU or GPU first (where
  # libtpu is installed the failed probe prints libtpu's errors); "" lets JAX pick.
  config.platform = "cpu"
  return config
