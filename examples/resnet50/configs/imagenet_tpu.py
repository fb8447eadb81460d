"""A faster pod-slice variant: ResNet-50 v1.5, ImageNet, global batch 4096, 90 epochs. Not run.

Not a published recipe, and not run yet: no accuracy is known for it. The
recipe with published accuracy is ``imagenet_flax.py`` (Flax's ImageNet
example: batch 1024, 100 epochs, 76.4-76.7% top-1 reported by Flax). This one
trades it for 4x fewer, larger steps: global batch 4096 with the peak learning
rate scaled linearly (0.1 x 4096 / 256 = 1.6) after 5 warmup epochs, the
linear scaling rule and warmup of Goyal et al. 2017 ("Accurate, Large
Minibatch SGD"), who match small-batch accuracy up to batch 8k with a step
schedule; with ``default.py``'s 90 epochs, cosine decay, label smoothing 0.1
(Szegedy et al. 2016; the MLPerf reference), He-normal fan_out convolutions,
N(0, 0.01^2) dense kernel and symmetric padding (torchvision, MLPerf).

Launch (every worker runs the same command; see README.md for the full
recipe, data preparation and where ``data_dir`` lives):

  gcloud compute tpus tpu-vm ssh $TPU_NAME --zone=$ZONE --worker=all --command="
    cd ~/loopkit && python3 -m examples.resnet50.main \\
      --config=examples/resnet50/configs/imagenet_tpu.py \\
      --config.data_dir=gs://$BUCKET/tensorflow_datasets \\
      --workdir=gs://$BUCKET/resnet50/run1"

Sized for a v4-32 (16 chips, 4 hosts) or v5e-32 (32 chips, 8 hosts) slice; any
slice whose device count divides 4096 works unchanged. ``main.py`` calls
``jax.distributed.initialize()`` (``config.distributed``); each host reads its
own 1/P of the TFRecords (``tfds.split_for_jax_process``). The workdir must be
shared by all hosts (GCS) for the Orbax checkpoints; rerunning the same
command resumes from the latest one (also after a preemption: SIGTERM saves
at the next device-call boundary).

Expected accuracy: unknown, no run exists. For orientation only, not for this
config: Goyal et al. 2017 report 76.3% top-1 (ResNet-50, 90 epochs, batch 8k,
step schedule, no label smoothing) and MLPerf's ResNet target is 75.9%.
Throughput on TPU is NOT measured yet either.

Choices (beyond ``default.py``):
* Global batch 4096 (256 per v4 chip, 128 per v5e chip): lr = 0.1 * 4096 / 256
  = 1.6 with 5 warmup epochs, inside the range where Goyal et al. 2017 match
  small-batch accuracy (up to 8k).
* steps_per_epoch = floor(1,281,167 / P) // (4096 / P) = 312 for P = 4 or 8
  hosts (each host drops its shard's remainder, so all run the same steps).
* iterations_per_loop K = 26: 312 = 12 x 26, so every epoch is exactly 12
  device calls with no short tail call (a call never crosses an epoch end;
  a K that does not divide 312 leaves one short call per epoch that still
  transfers K slots of input). K is bounded by memory, not by overhead: a
  chunk is [K, B, 224, 224, 3] uint8 = K x 616 MB globally, i.e. K x 38.5 MB
  per v4 chip (K x 19 MB per v5e chip), and with ``prefetch = 2`` three chunks
  can be live: at K = 26 about 3 GB of a v4 chip's 32 GB HBM (1.5 GB of a v5e
  chip's 16 GB), leaving the rest for ResNet-50's activations. One call is
  26 steps (a few seconds), so the host's per-call work (dispatch, one metric
  fetch, hooks) is far below 1% of the time; a larger K would gain nothing
  measurable and cost HBM.
* Eval every 4 epochs (as the MLPerf ResNet rules) on all 50,000 validation
  images, exact: batches of 4096, the last one padded and masked
  (13 batches, one device call with eval K = 13).
* Checkpoint every 2 epochs (at most ~2 epochs lost to a crash; a preemption
  saves on SIGTERM anyway), keep 3; asynchronous Orbax writes.
* TensorBoard + JSONL metrics in the workdir (process 0 writes), train metrics
  every 104 steps (every 4 calls), goodput summary at the end.
"""

from examples.resnet50.configs import default


def get_config():
  """ResNet-50, ImageNet, global batch 4096 on a TPU pod slice, K = 26."""
  config = default.get_config()
  config.distributed = True            # jax.distributed.initialize() before anything else
  config.data_dir = ""                 # set --config.data_dir=gs://BUCKET/tensorflow_datasets
  config.half_precision = True         # bfloat16 compute, float32 params and BN statistics
  config.global_batch_size = 4096
  config.iterations_per_loop = 26      # divides the 312 steps of an epoch (see above)
  config.prefetch = 2
  config.log_every_steps = 104
  config.progress_every_secs = 60.0
  config.eval_every_epochs = 4         # MLPerf ResNet evaluation cadence
  config.eval_batch_size = 4096
  config.eval_iterations_per_loop = 13  # ceil(50,000 / 4096): the whole eval in one call
  config.checkpoint_every_epochs = 2
  config.max_checkpoints_to_keep = 3
  config.shuffle_buffer = 16_384       # per host
  return config
