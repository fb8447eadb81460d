"""A decoder-only Transformer language model in Flax NNX, annotated for FSDP + tensor parallelism.

The model (pre-norm blocks, causal multi-head attention with rotary position embeddings, a GELU
MLP, RMSNorm; Vaswani et al. 2017 "Attention Is All You Need", Su et al. 2021 "RoFormer", Zhang
& Sennrich 2019 "Root Mean Square Layer Normalization") reads bytes: the vocabulary is the 256
byte values, so no tokenizer is needed.

**Sharding.** Every parameter is made with :func:`flax.nnx.with_partitioning` and *logical* axis
names (``"embed"``, ``"mlp"``, ``"heads"``, ``"vocab"``...); :data:`LOGICAL_AXIS_RULES` maps
them to the axes of a ``("data", "fsdp", "tensor")`` mesh, the layout of Flax's lm1b example
and MaxText:

* ``embed`` -> ``fsdp``: every weight matrix is split along its model dimension over the
  ``fsdp`` axis (ZeRO-3 / FSDP: XLA all-gathers a weight where it is used and reduce-scatters its
  gradient);
* ``mlp``, ``heads``, ``vocab`` -> ``tensor``: the MLP's hidden units, the attention heads and
  the vocabulary are split over the ``tensor`` axis (Megatron-style tensor parallelism);
* ``batch`` -> ``("data", "fsdp")``: activations are split over the product of the two batch
  axes (the same axes loopkit splits the input batch over, ``data_axis=("data", "fsdp")``);
* ``layers``, ``kv``, ``norm``, ``length``, ``act_embed``: not split.

:func:`param_shardings` reads the parameters' ``PartitionSpec`` s through Flax
(``nnx.get_partition_spec`` under ``nnx.logical_axis_rules``); the forward pass pins the
activations' shardings with the same table (:func:`logical_spec`) when the model is built with a
``mesh``.

**Layers.** The ``num_layers`` blocks' parameters are stacked along a leading ``layers`` axis;
the forward pass runs the blocks in a Python loop over it, or as one ``jax.lax.scan``
(``scan_layers=True``: the compiled program's size and compile time do not grow with depth, but
XLA's cost analysis then counts one block's FLOPs); ``remat=True`` recomputes each block's
activations in the backward pass (``jax.checkpoint``).

**Initial values.** Embedding ``N(0, 1)``; every other matrix ``N(0, 1 / fan_in)``; norm scales 1;
the output projection starts at 0, so the untrained model predicts the uniform distribution over
the 256 bytes: loss ``ln 256`` = 5.545 nats, perplexity 256 on any text.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

VOCAB_SIZE = 256  # bytes

# Logical axis -> mesh axis (None: not split). Parameters and activations use the same table.
LOGICAL_AXIS_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("vocab", "tensor"),
    ("kv", None),
    ("layers", None),
    ("norm", None),
    ("length", None),
    ("act_embed", None),
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
    max_len: longest sequence (the rotary table's length).
    dtype: compute dtype (parameters stay float32; logits are returned as float32).
    remat: recompute each block's activations in the backward pass (``jax.checkpoint``).
    scan_layers: run the blocks as one ``jax.lax.scan`` (compile time independent of depth)
      instead of a Python loop over the stacked parameters (the same parameters either way).
      XLA's cost analysis counts a loop body once, so with a scan the FLOPs it reports (loopkit's
      AOT compute bound, ``throughput/tflops_per_device``) are those of one block, not
      ``num_layers``.
  """

  num_layers: int
  d_model: int
  num_heads: int
  head_dim: int
  mlp_dim: int
  max_len: int
  dtype: Any = jnp.float32
  remat: bool = False
  scan_layers: bool = False


def logical_spec(names: tuple[str | None, ...],
                 rules: tuple[tuple[str, Any], ...] = LOGICAL_AXIS_RULES) -> P:
  """The mesh ``PartitionSpec`` of logical axis names under ``rules``.

  Raises:
    KeyError: a name the rules do not know (naming it).
  """
  table = dict(rules)
  missing = [n for n in names if n is not None and n not in table]
  if missing:
    raise KeyError(f"logical axis {missing[0]!r} has no rule in {sorted(table)}")
  return P(*(None if n is None else table[n] for n in names))


def _param(rngs: nnx.Rngs, init: Any, shape: tuple[int, ...], names: tuple[str, ...]
           ) -> nnx.Param:
  return nnx.Param(nnx.with_partitioning(init, names)(rngs.params(), shape))


def _normal(fan_in: int) -> Any:
  return nnx.initializers.normal(stddev=fan_in ** -0.5)


def _rms_norm(x: jax.Array, scale: jax.Array, eps: float = 1e-6) -> jax.Array:
  xf = x.astype(jnp.float32)
  y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return (y * scale).astype(x.dtype)


def _rotary(max_len: int, head_dim: int) -> tuple[jax.Array, jax.Array]:
  """cos and sin tables ``[max_len, head_dim / 2]`` (RoFormer's frequencies, base 10000)."""
  freqs = 1.0 / (10_000.0 ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  angles = jnp.arange(max_len, dtype=jnp.float32)[:, None] * freqs[None, :]
  return jnp.cos(angles), jnp.sin(angles)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotary embedding of ``x`` ``[B, L, H, D]`` (pairs (i, i + D/2)) with tables ``[L, D/2]``."""
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  c, s = cos[None, :, None, :], sin[None, :, None, :]
  return jnp.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1).astype(x.dtype)


class Transformer(nnx.Module):
  """Byte-level decoder-only Transformer: ``tokens [B, L] int32 -> logits [B, L, 256] float32``.

  Args:
    cfg: the sizes (:class:`ModelConfig`).
    rngs: ``nnx.Rngs`` with a ``params`` stream.
    mesh: the mesh whose axes :data:`LOGICAL_AXIS_RULES` name; with it the forward pass
      constrains the activations' shardings (``jax.lax.with_sharding_constraint``); None: no
      constraints (XLA propagates the parameters' and inputs' shardings alone).
    rules: the logical axis rules for the activations.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, mesh: Mesh | None = None,
               rules: tuple[tuple[str, Any], ...] = LOGICAL_AXIS_RULES):
    self.cfg = cfg
    self.mesh = mesh
    self.rules = rules
    n, d, h, k, f = cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.mlp_dim
    self.embedding = _param(rngs, nnx.initializers.normal(stddev=1.0), (VOCAB_SIZE, d),
                            ("vocab", "embed"))
    self.attn_norm = _param(rngs, nnx.initializers.ones, (n, d), ("layers", "norm"))
    self.query = _param(rngs, _normal(d), (n, d, h, k), ("layers", "embed", "heads", "kv"))
    self.key = _param(rngs, _normal(d), (n, d, h, k), ("layers", "embed", "heads", "kv"))
    self.value = _param(rngs, _normal(d), (n, d, h, k), ("layers", "embed", "heads", "kv"))
    self.out = _param(rngs, _normal(h * k), (n, h, k, d), ("layers", "heads", "kv", "embed"))
    self.mlp_norm = _param(rngs, nnx.initializers.ones, (n, d), ("layers", "norm"))
    self.mlp_in = _param(rngs, _normal(d), (n, d, f), ("layers", "embed", "mlp"))
    self.mlp_out = _param(rngs, _normal(f), (n, f, d), ("layers", "mlp", "embed"))
    self.final_norm = _param(rngs, nnx.initializers.ones, (d,), ("norm",))
    self.head = _param(rngs, nnx.initializers.zeros, (d, VOCAB_SIZE), ("embed", "vocab"))

  def _constrain(self, x: jax.Array, names: tuple[str, ...], on: bool) -> jax.Array:
    if self.mesh is None or not on:
      return x
    return jax.lax.with_sharding_constraint(
        x, NamedSharding(self.mesh, logical_spec(names, self.rules)))

  def __call__(self, tokens: jax.Array, *, shard_activations: bool = True) -> jax.Array:
    """Next-byte logits for every position.

    Args:
      tokens: int32 ``[B, L]``, ``L <= max_len``; position ``i`` sees positions ``<= i``.
      shard_activations: constrain the activations to :data:`LOGICAL_AXIS_RULES` (with a
        mesh); False for a batch the batch axes do not divide (greedy decoding of one prompt).

    Returns:
      float32 ``[B, L, 256]``.
    """
    cfg, dt = self.cfg, self.cfg.dtype
    on = shard_activations
    length = tokens.shape[1]
    cos, sin = (t[:length] for t in _rotary(cfg.max_len, cfg.head_dim))
    causal = jnp.tril(jnp.ones((length, length), jnp.bool_))
    # The lookup as a one-hot matmul: with the table split over vocab (tensor) and embed (fsdp),
    # XLA partitions a matmul well and a gather badly (it would replicate the table); for 256
    # bytes the matmul costs 256 * d_model multiply-adds per token.
    x = jax.nn.one_hot(tokens, VOCAB_SIZE, dtype=dt) @ self.embedding[...].astype(dt)
    x = self._constrain(x, ("batch", "length", "act_embed"), on)
    layers = {name: getattr(self, name)[...] for name in (
        "attn_norm", "query", "key", "value", "out", "mlp_norm", "mlp_in", "mlp_out")}

    def block(x, p):
      y = _rms_norm(x, p["attn_norm"])
      q, k, v = (jnp.einsum("bld,dhk->blhk", y, p[n].astype(dt)) for n in ("query", "key",
                                                                            "value"))
      q, k, v = (self._constrain(t, ("batch", "length", "heads", "kv"), on) for t in (q, k, v))
      q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
      scores = jnp.einsum("bqhk,bshk->bhqs", q, k).astype(jnp.float32) * cfg.head_dim ** -0.5
      scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
      probs = jax.nn.softmax(scores, axis=-1).astype(dt)
      attn = jnp.einsum("bhqs,bshk->bqhk", probs, v)
      x = x + jnp.einsum("blhk,hkd->bld", attn, p["out"].astype(dt))
      x = self._constrain(x, ("batch", "length", "act_embed"), on)
      y = _rms_norm(x, p["mlp_norm"])
      hidden = jax.nn.gelu(jnp.einsum("bld,df->blf", y, p["mlp_in"].astype(dt)))
      hidden = self._constrain(hidden, ("batch", "length", "mlp"), on)
      x = x + jnp.einsum("blf,fd->bld", hidden, p["mlp_out"].astype(dt))
      return self._constrain(x, ("batch", "length", "act_embed"), on), None

    if cfg.remat:
      block = jax.checkpoint(block)
    if cfg.scan_layers:
      x, _ = jax.lax.scan(block, x, layers)
    else:
      for i in range(cfg.num_layers):
        x, _ = block(x, {name: p[i] for name, p in layers.items()})
    x = _rms_norm(x, self.final_norm[...])
    logits = jnp.einsum("bld,dv->blv", x, self.head[...].astype(dt)).astype(jnp.float32)
    return self._constrain(logits, ("batch", "length", "vocab"), on)


def abstract_model(cfg: ModelConfig, *, seed: int = 0, mesh: Mesh | None = None
                   ) -> Transformer:
  """The model's structure with ``jax.ShapeDtypeStruct`` leaves (nothing allocated)."""
  with nnx.use_eager_sharding(False):
    return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=seed), mesh=mesh))


def param_specs(model: Transformer,
                rules: tuple[tuple[str, Any], ...] = LOGICAL_AXIS_RULES) -> dict[str, P]:
  """``{param name: PartitionSpec}`` from the parameters' logical names under ``rules``
  (Flax's ``nnx.get_partition_spec`` inside ``nnx.logical_axis_rules``)."""
  with nnx.logical_axis_rules(rules):
    return nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(model, nnx.Param)))


def param_shardings(model: Transformer, mesh: Mesh,
                    rules: tuple[tuple[str, Any], ...] = LOGICAL_AXIS_RULES
                    ) -> dict[str, NamedSharding]:
  """``{param name: NamedSharding}`` on ``mesh`` (:func:`param_specs`)."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(model, rules),
                      is_leaf=lambda x: isinstance(x, P))


def train_flops_per_step(cfg: ModelConfig, batch_size: int, seq_len: int) -> float:
  """Model FLOPs of one train step over the whole batch (all devices), counted by hand.

  Each multiply-add is 2 FLOPs; the backward pass costs twice the forward (Kaplan et al. 2020's
  ``6 N`` per token for the ``N`` matrix parameters). Per layer and sequence the forward pass
  computes ``2 * L * (4 d h k + 2 d f)`` for the projections and ``4 * L^2 * h * k`` for the
  scores and their weighted sum (the full ``L x L`` product: the causal mask does not skip the
  upper half). The lookup (a one-hot matmul) costs its forward pass and the table's gradient,
  the head ``[d, 256]`` its forward pass and two gradients. ``remat`` recomputes each block's
  forward pass in the backward pass except the MLP's output projection, whose result the
  backward pass does not need (XLA removes it: with it the count is 7% above XLA's for the pod
  config, without it 0.4% below). Norms, softmax and the optimizer are left out.
  """
  d, h, k, f, n = cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.mlp_dim, cfg.num_layers
  block = 2 * seq_len * (4 * d * h * k + 2 * d * f) + 4 * seq_len ** 2 * h * k
  recompute = block - 2 * seq_len * d * f if cfg.remat else 0
  lookup_and_head = (2 + 3) * 2 * seq_len * VOCAB_SIZE * d
  return float(batch_size * (n * (3 * block + recompute) + lookup_and_head))


def param_count(cfg: ModelConfig) -> int:
  """Trainable parameters: ``2 * 256 * d`` (embedding, head) ``+ d`` (final norm) plus per layer
  ``4 * d * h * k`` (attention) ``+ 2 * d * f`` (MLP) ``+ 2 * d`` (norms)."""
  d = cfg.d_model
  per_layer = 4 * d * cfg.num_heads * cfg.head_dim + 2 * d * cfg.mlp_dim + 2 * d
  return 2 * VOCAB_SIZE * d + d + cfg.num_layers * per_layer
