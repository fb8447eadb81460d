"""The digits model: a small multilayer perceptron in Flax NNX."""

from __future__ import annotations

import jax
from flax import nnx


class MLP(nnx.Module):
  """``[B, 64]`` pixels -> ``[B, 10]`` logits: Linear-ReLU-Dropout blocks then a Linear.

  Dropout keeps no RNG state of its own: the caller passes a key per call (the
  train step derives it from the seed and the global step), so the module's
  state is only its parameters.

  Args:
    hidden_sizes: widths of the hidden layers, e.g. ``(512, 256)``.
    dropout_rate: dropout probability after each hidden layer (0 disables).
    num_classes: number of output logits.
    in_features: input width (64 = 8x8 pixels).
    rngs: initialisation RNGs (``nnx.Rngs(params=seed)``).
  """

  def __init__(self, hidden_sizes: tuple[int, ...], *, dropout_rate: float,
               rngs: nnx.Rngs, num_classes: int = 10, in_features: int = 64):
    sizes = (in_features, *hidden_sizes)
    self.hidden = nnx.List([nnx.Linear(a, b, rngs=rngs)
                            for a, b in zip(sizes[:-1], sizes[1:], strict=True)])
    self.dropout = nnx.Dropout(dropout_rate)
    self.head = nnx.Linear(sizes[-1], num_classes, rngs=rngs)

  def __call__(self, x: jax.Array, *, dropout_key: jax.Array | None = None) -> jax.Array:
    """Logits.

    Args:
      x: float32 ``[B, 64]``.
      dropout_key: PRNG key for dropout; None = deterministic (evaluation).

    Returns:
      float32 ``[B, num_classes]`` logits.
    """
    for i, layer in enumerate(self.hidden):
      x = nnx.relu(layer(x))
      if dropout_key is not None:  # one independent mask per layer
        x = self.dropout(x, rngs=jax.random.fold_in(dropout_key, i))
      else:
        x = self.dropout(x, deterministic=True)
    return self.head(x)
