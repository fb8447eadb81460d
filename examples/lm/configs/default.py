"""The CPU run: a 0.85M-parameter byte-level LM on the stdlib's sources, minutes on 2 cores.

Run (from the repository root; nothing is downloaded):

  python -m examples.lm.main --workdir /tmp/lm-cpu

8 fake CPU devices on a ``("data", "fsdp", "tensor")`` mesh of shape (2, 2, 2): parameters split
over ``fsdp`` and ``tensor`` by their logical axes, the batch of 32 sequences of 128 bytes over
``("data", "fsdp")`` (8 per slice), K = 10 steps per device call, 600 steps (2,457,600 bytes,
0.57 of an epoch), evaluated on 256 held-out sequences at steps 300 and 600. It prints the
held-out loss, perplexity and accuracy and 80 bytes sampled after ``config.prompt``; the
figures it prints are in ``examples/lm/README.md``.
"""

import ml_collections


def get_config():
  """A 4-layer, 128-wide byte-level Transformer on the stdlib, mesh (2, 2, 2), K = 10."""
  config = ml_collections.ConfigDict()
  config.seed = 0

  # -- data --------------------------------------------------------------------------------
  config.data_dir = ""            # "": the running Python's stdlib directory (its *.py files)
  config.heldout_every = 16       # file i is held out when i % 16 == 15
  config.seq_len = 128            # bytes per sequence
  config.grain_workers = 0        # Grain worker processes (the windows need no decoding)
  config.eval_windows = 256       # held-out sequences evaluated (32,768 bytes)

  # -- model -------------------------------------------------------------------------------
  config.model = ml_collections.ConfigDict()
  config.model.num_layers = 4
  config.model.d_model = 128
  config.model.num_heads = 4
  config.model.head_dim = 32
  config.model.mlp_dim = 512
  config.model.remat = False
  config.half_precision = False   # float32 on CPU (bfloat16 matmuls are slow there)

  # -- optimisation ------------------------------------------------------------------------
  config.global_batch_size = 32
  config.num_train_steps = 600
  config.learning_rate = 3e-3
  config.warmup_steps = 60
  config.b1 = 0.9
  config.b2 = 0.95
  config.weight_decay = 0.1
  config.grad_clip = 1.0

  # -- mesh and loopkit --------------------------------------------------------------------
  config.mesh_shape = (2, 2, 2)   # (data, fsdp, tensor)
  config.iterations_per_loop = 10  # K: train steps per device call
  config.log_every_steps = 100
  config.eval_every_steps = 300   # and at the end
  config.eval_batch_size = 64
  config.eval_iterations_per_loop = 4  # the 4 eval batches in one device call
  config.checkpoint_every_steps = 300
  config.max_checkpoints_to_keep = 2

  # -- the end -----------------------------------------------------------------------------
  config.prompt = "    def __init__(self"
  config.sample_bytes = 80        # bytes sampled after the prompt at the end (0: none)
  config.temperature = 0.7        # 0: greedy
  config.top_k = 10               # sample among the top_k most likely bytes
  config.platform = "cpu"         # no TPU/GPU probe
  config.distributed = False
  return config
