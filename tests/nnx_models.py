"""A small NNX CNN (Conv, BatchNorm, Dropout, Rngs) and Flax-MNIST-style steps for the NNX tests."""

from functools import partial

import jax
import numpy as np
import optax
from flax import nnx


class CNN(nnx.Module):
  """Flax's examples/mnist CNN, shrunk: [B, 8, 8, 1] -> [B, 10]."""

  def __init__(self, rngs: nnx.Rngs, axis_name: str | None = None):
    self.conv1 = nnx.Conv(1, 4, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm1 = nnx.BatchNorm(4, axis_name=axis_name, rngs=rngs)
    self.dropout1 = nnx.Dropout(rate=0.25)
    self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
    self.linear1 = nnx.Linear(64, 10, rngs=rngs)

  def __call__(self, x, rngs: nnx.Rngs | None):
    x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
    return self.linear1(x.reshape(x.shape[0], -1))


def loss_fn(model, batch, rngs):
  logits = model(batch["image"], rngs)
  loss = optax.softmax_cross_entropy_with_integer_labels(
      logits=logits, labels=batch["label"]).mean()
  return loss, logits


@nnx.jit
def train_step(model, optimizer, metrics, batch, rngs):
  """An in-place NNX train step in the form Flax's examples/mnist uses (nnx.jit, MultiMetric)."""
  grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
  (loss, logits), grads = grad_fn(model, batch, rngs)
  metrics.update(loss=loss, logits=logits, labels=batch["label"])
  optimizer.update(model, grads)


def per_device_train_step(model, optimizer, metrics, batch, rngs, axis="data"):
  """The same step for step_style='per_device': gradients averaged over the data axis."""
  grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
  (loss, logits), grads = grad_fn(model, batch, rngs)
  grads = jax.lax.pmean(grads, axis)
  metrics.update(loss=loss, logits=logits, labels=batch["label"])
  optimizer.update(model, grads)


@nnx.jit
def eval_step(model, metrics, batch):
  """An in-place NNX eval step in the form Flax's examples/mnist uses."""
  loss, logits = loss_fn(model, batch, None)
  metrics.update(loss=loss, logits=logits, labels=batch["label"])


def make(seed: int = 0, axis_name: str | None = None):
  """(model, optimizer, metrics, rngs) as in Flax's examples/mnist train_and_evaluate."""
  model = CNN(rngs=nnx.Rngs(seed), axis_name=axis_name)
  optimizer = nnx.Optimizer(model, optax.sgd(0.1, 0.9), wrt=nnx.Param)
  metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
  return model, optimizer, metrics, nnx.Rngs(seed + 1)


def batches(n: int, batch_size: int = 16, seed: int = 0):
  rng = np.random.default_rng(seed)
  return [{"image": rng.normal(size=(batch_size, 8, 8, 1)).astype(np.float32),
           "label": rng.integers(0, 10, size=(batch_size,)).astype(np.int32)}
          for _ in range(n)]


def arrays(objects) -> list[np.ndarray]:
  """Every array of the objects' state (typed keys as their key data), in leaf order."""
  state = nnx.to_pure_dict(nnx.state(objects))
  return [np.asarray(jax.random.key_data(x)) if jax.dtypes.issubdtype(x.dtype,
                                                                      jax.dtypes.prng_key)
          else np.asarray(x) for x in jax.tree.leaves(state)]
