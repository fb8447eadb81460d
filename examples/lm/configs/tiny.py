"""The tests' configuration (``lm_test.py``): a 2-layer, 32-wide model, 8 steps of batch 16.

  python -m examples.lm.main --workdir /tmp/lm-tiny --config examples/lm/configs/tiny.py

The same code path as ``default.py`` (mesh (2, 2, 2), batch on ``("data", "fsdp")``, Grain,
checkpoints, evaluation, a sampled continuation) at a size that compiles and runs in seconds.
"""

from examples.lm.configs import default


def get_config():
  """2 layers x 32 wide, 2 heads, sequences of 32 bytes, 8 steps of batch 16, K = 4."""
  config = default.get_config()
  config.seq_len = 32
  config.eval_windows = 32
  config.model.num_layers = 2
  config.model.d_model = 32
  config.model.num_heads = 2
  config.model.head_dim = 16
  config.model.mlp_dim = 64
  config.global_batch_size = 16
  config.num_train_steps = 8
  config.learning_rate = 1e-2
  config.warmup_steps = 2
  config.iterations_per_loop = 4
  config.log_every_steps = 4
  config.eval_every_steps = 4
  config.eval_batch_size = 16
  config.eval_iterations_per_loop = 2
  config.checkpoint_every_steps = 4
  config.prompt = "import "
  config.sample_bytes = 8
  return config
