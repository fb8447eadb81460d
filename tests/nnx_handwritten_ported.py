"""A hand-written Flax NNX training script laid out like Flax's MNIST example, and its port.

``tests/nnx_handwritten_loop.py`` is loopkit's own code, not a copy: it keeps the shape of Flax's
``examples/mnist/train.py`` (github.com/google/flax, commit 18f8f311) that a port touches (an
in-place ``train_step`` and ``eval_step`` under ``nnx.jit``, a per-epoch loop over the batches,
``metrics.compute()`` and ``metrics.reset()``, one summary row per epoch), and trains a small CNN
on scikit-learn's handwritten digits (8x8 images, real data that ships with the package).
``tests/nnx_handwritten_ported.py`` is the same file ported to
:class:`loopkit.nnx.NnxTrainLoop`; ``tests/test_port.py`` measures the port with difflib
(docs/migrating.md). Not test modules.
"""

import ml_collections
import numpy as np
import optax
import tensorboardX
from flax import nnx
from sklearn import datasets

import loopkit.nnx


class DigitsCNN(nnx.Module):
  """conv 3x3 -> BatchNorm -> relu -> 2x2 average pool -> dropout -> dense, for 8x8 images."""

  def __init__(self, rngs: nnx.Rngs, features: int = 8):
    self.conv = nnx.Conv(1, features, kernel_size=(3, 3), rngs=rngs)
    self.norm = nnx.BatchNorm(features, rngs=rngs)
    self.dropout = nnx.Dropout(rate=0.1)
    self.dense = nnx.Linear(features * 4 * 4, 10, rngs=rngs)

  def __call__(self, images, rngs: nnx.Rngs | None):
    h = nnx.relu(self.norm(self.conv(images)))
    h = nnx.avg_pool(h, window_shape=(2, 2), strides=(2, 2))
    h = self.dropout(h.reshape(h.shape[0], -1), rngs=rngs)
    return self.dense(h)


def loss_and_logits(model, batch, rngs):
  logits = model(batch["image"], rngs)
  labels = batch["label"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), logits


@nnx.jit
def train_step(model, optimizer, metrics, batch, rngs):
  grad_fn = nnx.value_and_grad(loss_and_logits, has_aux=True)
  (loss, logits), grads = grad_fn(model, batch, rngs)
  metrics.update(loss=loss, logits=logits, labels=batch["label"])
  optimizer.update(model, grads)


@nnx.jit
def eval_step(model, metrics, batch):
  loss, logits = loss_and_logits(model, batch, None)
  metrics.update(loss=loss, logits=logits, labels=batch["label"])


def get_datasets(config: ml_collections.ConfigDict) -> tuple[list, list]:
  """Full batches of ``config.batch_size`` digits: the first ``config.num_train`` images for
  training (shuffled once with ``config.seed``), the rest for testing."""
  digits = datasets.load_digits()
  images = (digits.images / 16.0).astype(np.float32)[..., None]  # [N, 8, 8, 1] in [0, 1]
  labels = digits.target.astype(np.int32)
  order = np.random.default_rng(config.seed).permutation(len(labels))
  images, labels = images[order], labels[order]
  b = config.batch_size

  def batches(lo, hi):
    return [{"image": images[i:i + b], "label": labels[i:i + b]} for i in range(lo, hi - b + 1, b)]

  return batches(0, config.num_train), batches(config.num_train, len(labels))


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> nnx.Module:
  """Trains for ``config.num_epochs`` epochs, evaluating and writing a row after each."""
  train_batches, test_batches = get_datasets(config)
  model = DigitsCNN(rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.sgd(config.learning_rate, config.momentum),
                            wrt=nnx.Param)
  metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
  writer = tensorboardX.SummaryWriter(workdir)
  rngs = nnx.Rngs(dropout=1)
  loop = loopkit.nnx.NnxTrainLoop(train_step, model, optimizer, metrics, extra=(rngs,),
                                  iterations_per_loop=config.iterations_per_loop)
  steps_per_epoch = len(train_batches)

  for epoch in range(1, config.num_epochs + 1):
    model.train()
    loop.run(train_batches, num_steps=epoch * steps_per_epoch)
    train_metrics = metrics.compute()
    metrics.reset()

    model.eval()
    for batch in test_batches:
      eval_step(model, metrics, batch)
    test_metrics = metrics.compute()
    metrics.reset()

    for split, values in (("train", train_metrics), ("test", test_metrics)):
      for name, value in values.items():
        writer.add_scalar(f"{split}_{name}", float(value), epoch)
  writer.close()
  return model
