"""ResNet-18 on scikit-learn's digits through TFDS, on this CPU (the Quickstart).

Run (from the repository root):

  python -m examples.resnet50.main --workdir /tmp/resnet-cpu

The same model code, recipe and loop as the ImageNet run, and the input path
a pod slice uses: the digits are built as a TFDS ArrayRecord dataset and read by
random access through ``tfds.data_source`` and Grain
(:class:`loopkit.data.GrainSource`: one global order, O(1) resume; decode in a
Grain worker process; uint8 images normalised on the device). The 1,437/360
digits split is upscaled from 8x8 to 32x32, with 8 fake CPU devices and K = 11
steps per device call. It should reach >= 95% accuracy on the
360 held-out digits in about 3-5 minutes on 2 CPU cores (measured numbers in
``examples/resnet50/README.md``).

Changed from the ImageNet recipe (``default.py``), and why:
* ResNet-18 at 32x32 (ResNet-50 runs ~29 images/s here, too slow for minutes).
* No random-resized crop and no flip: a 6 is not a mirrored 6, and crops of an
  8x8 digit lose strokes.
* 6 epochs of batch 128 with 1 warmup epoch (11 steps per epoch): the linear
  scaling rule and cosine decay are kept, lr = 0.1 * 128 / 256 = 0.05 peak.
* float32 compute (bfloat16 convolutions are slow on CPU).
"""

from examples.resnet50.configs import default


def get_config():
  """ResNet-18 on digits at 32x32, 8 fake CPU devices, K = 11."""
  config = default.get_config()
  config.dataset = "sklearn_digits"    # generated into data_dir at first use (digits_tfds.py)
  config.train_split = "train"         # 1,437 digits
  config.eval_split = "test"           # 360 digits, never trained on
  config.num_classes = 10
  config.image_size = 32
  config.random_resized_crop = False
  config.flip = False
  config.crop_fraction = 1.0
  config.input_pipeline = "grain"      # ArrayRecord + Grain, as on a pod ("tfdata": TFRecords)
  config.grain_workers = 1             # one Grain worker process (decode and resize)
  config.shuffle_buffer = 2048         # the whole training set (tf.data only)
  config.model.depth = 18
  config.half_precision = False
  config.global_batch_size = 128       # 16 per fake device; 11 steps per epoch
  config.num_epochs = 6
  config.warmup_epochs = 1
  config.iterations_per_loop = 11      # one device call per epoch
  config.log_every_steps = 11
  config.progress_every_secs = 15.0
  config.eval_every_epochs = 2
  config.eval_batch_size = 360         # the test set in one (padded) batch
  config.eval_iterations_per_loop = 1
  config.checkpoint_every_epochs = 2
  config.platform = "cpu"              # no TPU/GPU probe (its failures would be printed)
  return config
