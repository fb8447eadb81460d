"""Fine-tunes the Quickstart's digits ResNet-18 with a new 5-class head (warm start).

Run after the Quickstart (``configs/cpu.py``, which leaves its checkpoints in
``/tmp/resnet-cpu/checkpoints``), from the repository root:

  python -m examples.resnet50.main --workdir /tmp/resnet-ft \\
      --config examples/resnet50/configs/finetune.py

(``--config.init_from=W/checkpoints`` for a Quickstart run in another workdir W.)

The task is relabelled: each digit's class is the digit mod 5 (0 and 5 are class
0, 1 and 6 class 1, ...), 5 classes, on the same 1,437/360 split. The run starts
from the parameters and BatchNorm statistics of the Quickstart's latest checkpoint
(:class:`loopkit.checkpoint.WarmStart`, through ``CheckpointHook(init_from=...)``),
except the head (``params/head``: 512 x 5 now, 512 x 10 there), which is freshly
initialised; the optimizer state is fresh and the run counts from step 0. One
epoch (11 steps), the learning rate from the Quickstart's peak (0.05) down to 0
by cosine decay, no warmup; accuracy on the 360 test digits after it: see
``examples/resnet50/README.md`` (Fine-tuning from a checkpoint). A rerun with the
same workdir resumes from its own checkpoint, not from the Quickstart's.
"""

from examples.resnet50.configs import cpu


def get_config():
  """configs/cpu.py, warm-started from its checkpoint, with a 5-class head, for 1 epoch."""
  config = cpu.get_config()
  config.init_from = "/tmp/resnet-cpu/checkpoints"
  config.init_exclude = "params/head"  # a new head: its shape differs from the source's
  config.num_classes = 5
  config.label_modulo = 5              # the digit mod 5
  config.num_epochs = 1
  config.warmup_epochs = 0
  config.eval_every_epochs = 1
  config.checkpoint_every_epochs = 1
  return config
