"""A decoder-only Transformer language model over bytes, in Flax NNX, annotated for sharding.

Pre-norm blocks (Vaswani et al. 2017 "Attention Is All You Need"; RMSNorm, Zhang & Sennrich
2019) of causal multi-head attention with rotary position embeddings (Su et al. 2021
"RoFormer") and a GELU MLP, built from Flax's own layers: ``nnx.Embed``,
``nnx.MultiHeadAttention``, ``nnx.Linear``, ``nnx.RMSNorm``.
The vocabulary is the 256 byte values, so no tokenizer is needed.

**Sharding.** Each weight's initializer is wrapped in ``nnx.with_partitioning(init, names)``
with *logical* axis names (``"embed"``, ``"mlp"``, ``"heads"``, ``"vocab"``), as in Flax's
sharding guide and its lm1b example. :data:`LOGICAL_AXIS_RULES` maps them to the axes of the
``("data", "fsdp", "tensor")`` mesh: created under ``jax.set_mesh(mesh)`` and
``nnx.logical_axis_rules(LOGICAL_AXIS_RULES)``, every parameter is placed where its names say
(``train.create_model``):

* ``embed`` -> ``fsdp``: every matrix is split along its model dimension (FSDP / ZeRO-3: XLA
  gathers a weight where it is used and reduce-scatters its gradient);
* ``mlp``, ``heads``, ``vocab`` -> ``tensor``: the MLP's hidden units, the attention heads and the
  vocabulary are split (Megatron-style tensor parallelism);
* ``kv`` and the norms' scales: not split.

The batch is split over ``("data", "fsdp")`` by the loop (``data_axis``); XLA propagates the
activations' shardings from the parameters' and the batch's.

**Initial values.** Byte embeddings ``N(0, 1)``, other matrices LeCun normal, norm scales 1; the
output projection starts at 0, so the untrained model predicts the uniform distribution over
the 256 bytes: loss ``ln 256`` = 5.545 nats, perplexity 256.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

VOCAB_SIZE = 256  # bytes

# Logical axis -> mesh axis of the ("data", "fsdp", "tensor") mesh (None: not split).
LOGICAL_AXIS_RULES = (
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("vocab", "tensor"),
    ("kv", None),
)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Sizes of the Transformer.

  Attributes:
    num_layers: blocks.
    d_model: width of the residual stream.
    num_heads: attention heads (a multiple of the ``tensor`` axis size).
    head_dim: width of each head.
    mlp_dim: hidden units of each MLP (a multiple of the ``tensor`` axis size).
    dtype: compute dtype (parameters stay float32; logits are returned as float32).
    remat: recompute each block's activations in the backward pass (``nnx.remat``).
  """

  num_layers: int
  d_model: int
  num_heads: int
  head_dim: int
  mlp_dim: int
  dtype: Any = jnp.float32
  remat: bool = False


def _sharded(init: Any, names: tuple[str | None, ...]) -> Any:
  return nnx.with_partitioning(init, names)


def _rotate(x: jax.Array) -> jax.Array:
  """Rotary position embedding of queries or keys ``[B, L, H, D]``: the pair of features
  ``(i, i + D/2)`` at position ``p`` turned by the angle ``p / 10000^(2i / D)``."""
  length, dim = x.shape[-3], x.shape[-1]
  angles = jnp.arange(length)[:, None] * 10_000.0 ** (-jnp.arange(0, dim, 2) / dim)
  cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).astype(x.dtype)


def rotary_attention(query: jax.Array, key: jax.Array, value: jax.Array, **kwargs) -> jax.Array:
  """``nnx.dot_product_attention`` with rotary position embeddings on the queries and keys
  (``nnx.MultiHeadAttention``'s ``attention_fn``)."""
  return nnx.dot_product_attention(_rotate(query), _rotate(key), value, **kwargs)


class Block(nnx.Module):
  """Pre-norm block: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``; ``[B, L, d]``."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, dense = cfg.d_model, nnx.initializers.lecun_normal()
    self.attn_norm = nnx.RMSNorm(d, dtype=cfg.dtype, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(
        num_heads=cfg.num_heads, in_features=d, qkv_features=cfg.num_heads * cfg.head_dim,
        use_bias=False, decode=False, dtype=cfg.dtype, keep_rngs=False, rngs=rngs,
        attention_fn=rotary_attention,
        kernel_init=_sharded(dense, ("embed", "heads", "kv")),
        out_kernel_init=_sharded(dense, ("heads", "kv", "embed")))
    self.mlp_norm = nnx.RMSNorm(d, dtype=cfg.dtype, rngs=rngs)
    self.mlp_in = nnx.Linear(d, cfg.mlp_dim, use_bias=False, dtype=cfg.dtype, rngs=rngs,
                             kernel_init=_sharded(dense, ("embed", "mlp")))
    self.mlp_out = nnx.Linear(cfg.mlp_dim, d, use_bias=False, dtype=cfg.dtype, rngs=rngs,
                              kernel_init=_sharded(dense, ("mlp", "embed")))

  def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
    x = x + self.attn(self.attn_norm(x), mask=mask)
    return x + self.mlp_out(nnx.gelu(self.mlp_in(self.mlp_norm(x))))


class Transformer(nnx.Module):
  """Byte-level decoder-only Transformer: ``tokens [B, L] int -> logits [B, L, 256] float32``.

  Position ``i``'s logits predict byte ``i + 1`` from bytes ``0..i`` (a causal mask).

  Args:
    cfg: the sizes (:class:`ModelConfig`).
    rngs: ``nnx.Rngs`` for the initializers.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d = cfg.d_model
    self.embed = nnx.Embed(VOCAB_SIZE, d, dtype=cfg.dtype, rngs=rngs, embedding_init=_sharded(
        nnx.initializers.normal(1.0), ("vocab", "embed")))
    self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.final_norm = nnx.RMSNorm(d, dtype=cfg.dtype, rngs=rngs)
    self.head = nnx.Linear(d, VOCAB_SIZE, use_bias=False, dtype=cfg.dtype, rngs=rngs,
                           kernel_init=_sharded(nnx.initializers.zeros_init(), ("embed", "vocab")))
    self.remat = cfg.remat

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = self.embed(tokens)
    mask = nnx.make_causal_mask(tokens)
    for block in self.blocks:
      x = nnx.remat(Block.__call__)(block, x, mask) if self.remat else block(x, mask)
    return self.head(self.final_norm(x)).astype(jnp.float32)
