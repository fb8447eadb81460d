"""A ~1B-parameter byte-level LM for a TPU v5p slice (v5p-32: 16 chips).

Train it on the slice (every worker runs the same command; ``config.distributed`` makes
``main.py`` call ``jax.distributed.initialize()``):

  gcloud compute tpus tpu-vm ssh $TPU_NAME --zone=$ZONE --worker=all --command="
    cd ~/loopkit && python3 -m examples.lm.main --config=examples/lm/configs/pod.py \\
      --workdir=gs://$BUCKET/lm/run1"

The model: 20 layers, d_model 2048, 16 heads of 128, MLP 8192: 1,007,765,504 parameters (the
shape of a GPT-3 XL-sized model, Brown et al. 2020, at 20 instead of 24 layers), bytes as tokens,
sequences of 2048 bytes, global batch 256 sequences (524,288 bytes per step), bfloat16 compute
with float32 parameters and AdamW moments, each block rematerialised in the backward pass.

Mesh (data, fsdp, tensor) = (2, 4, 2) over the 16 chips: every matrix split 4 ways along its
model dimension (FSDP) and 2 ways along heads / MLP units / vocabulary (tensor parallelism); the
batch split 8 ways over ("data", "fsdp").
``lm_test.py::test_the_pod_config_compiles_for_a_v5p_slice`` (slow, needs libtpu) compiles its
train program for that slice ahead of time from a CPU. The corpus (the stdlib's sources,
4.3 MB) is far too small for a model this size: point ``config.data_dir`` at a larger
directory of text files to train it for real.
"""

from examples.lm.configs import default


def get_config():
  """~1.0B parameters, sequences of 2048 bytes, batch 256, mesh (2, 4, 2) on v5p-32, K = 10."""
  config = default.get_config()
  config.seq_len = 2048
  config.model.num_layers = 20
  config.model.d_model = 2048
  config.model.num_heads = 16
  config.model.head_dim = 128
  config.model.mlp_dim = 8192
  config.model.remat = True
  config.half_precision = True
  config.global_batch_size = 256
  config.num_train_steps = 20_000
  config.learning_rate = 3e-4
  config.warmup_steps = 1_000
  config.mesh_shape = (2, 4, 2)
  config.iterations_per_loop = 10
  config.log_every_steps = 100
  config.eval_every_steps = 1_000
  config.eval_windows = 64
  config.eval_batch_size = 64
  config.eval_iterations_per_loop = 1
  config.checkpoint_every_steps = 1_000
  config.prompt = "def main():\n"
  config.sample_bytes = 200
  config.platform = ""            # JAX picks the TPU
  config.distributed = True
  return config
