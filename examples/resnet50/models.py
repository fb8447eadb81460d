"""ResNet v1.5 family (ResNet-18/34/50/101/152/200) in Flax NNX.

The architecture of He et al. 2016, "Deep Residual Learning for Image
Recognition", in the "v1.5" variant used by the MLPerf reference, NVIDIA's and
torchvision's ResNet-50 and the Flax ImageNet example: in the bottleneck block
the stride sits in the 3x3 convolution, not the first 1x1. Details:

* Convolutions have no bias (a BatchNorm follows each).
* Two choices that change the function, not just the speed, set by the
  configs (``config.model.padding`` / ``config.model.kernel_init``):

  - ``padding="symmetric"`` (torchvision, the MLPerf reference): every
    convolution and the 3x3/2 max-pool pad ``(k - 1) // 2`` on both sides.
    ``padding="same"`` (the Flax ImageNet example): the 3x3 and 1x1
    convolutions and the max-pool use XLA's ``SAME`` padding, whose total
    ``max((ceil(n / s) - 1) * s + k - n, 0)`` puts the odd pixel at the end:
    on the even sizes of a 224x224 input the strided 3x3 convolutions and the
    max-pool pad ``(0, 1)``, not ``(1, 1)`` (stride-1 convolutions and the 1x1
    projections pad the same either way); the 7x7 stem keeps ``(3, 3)`` in
    both, as Flax's example sets it explicitly.
  - ``kernel_init="he_fan_out"`` (torchvision, MLPerf): convolution kernels
    He-normal with fan_out (He et al. 2015, "Delving Deep into Rectifiers"),
    the dense kernel N(0, 0.01^2). ``kernel_init="lecun_normal"`` (Flax's
    default for ``Conv`` and ``Linear``, used by its ImageNet example): every
    kernel truncated normal with variance 1 / fan_in.
* The last BatchNorm of every residual block starts with scale 0, so each block
  starts as the identity (Goyal et al. 2017, "Accurate, Large Minibatch SGD",
  section 5.1).
* Parameters are float32; ``dtype=jnp.bfloat16`` runs convolutions, matmuls and
  normalisation outputs in bfloat16 (BatchNorm statistics are still computed in
  float32 by Flax) and the logits are returned as float32.
* BatchNorm synchronisation: in loopkit's ``"global"`` step style the model sees
  the global batch ``[B, H, W, C]`` sharded over the ``data`` mesh axis, so the
  batch mean/variance are means over all B examples of all devices: the
  statistics are synchronised across the data axis by construction (XLA inserts
  the all-reduce). In the ``"per_device"`` (pmap) style pass
  ``axis_name="data"`` so BatchNorm ``pmean``s its statistics over the devices.

For 1000 classes ResNet-50 has 25,557,032 trainable parameters (the count of
torchvision's ``resnet50``), asserted in ``resnet50_test.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

# (convolution kernel init, dense kernel init) per ``kernel_init`` choice; biases start at 0.
KERNEL_INITS: dict[str, tuple[Any, Any]] = {
    # He et al. 2015 fan_out normal for convolutions, N(0, 0.01^2) for the dense layer:
    # torchvision's and the MLPerf reference ResNet.
    "he_fan_out": (nnx.initializers.variance_scaling(2.0, "fan_out", "normal"),
                   nnx.initializers.normal(0.01)),
    # Flax's default kernel init (truncated normal, variance 1 / fan_in) for both.
    "lecun_normal": (nnx.initializers.lecun_normal(), nnx.initializers.lecun_normal()),
}
PADDINGS = ("symmetric", "same")

# (block kind, blocks per stage) per depth, from He et al. 2016, Table 1.
STAGE_SIZES: dict[int, tuple[str, tuple[int, ...]]] = {
    18: ("basic", (2, 2, 2, 2)),
    34: ("basic", (3, 4, 6, 3)),
    50: ("bottleneck", (3, 4, 6, 3)),
    101: ("bottleneck", (3, 4, 23, 3)),
    152: ("bottleneck", (3, 8, 36, 3)),
    200: ("bottleneck", (3, 24, 36, 3)),
}


class _Norm:
  """Builds BatchNorm layers with the model's shared settings."""

  def __init__(self, *, dtype: Any, axis_name: str | None, momentum: float, epsilon: float):
    self.kw = dict(dtype=dtype, param_dtype=jnp.float32, axis_name=axis_name,
                   momentum=momentum, epsilon=epsilon)

  def __call__(self, features: int, *, rngs: nnx.Rngs, zero_scale: bool = False) -> nnx.BatchNorm:
    init = nnx.initializers.zeros if zero_scale else nnx.initializers.ones
    return nnx.BatchNorm(features, scale_init=init, rngs=rngs, **self.kw)


def _symmetric(kernel: int) -> tuple[tuple[int, int], tuple[int, int]]:
  pad = (kernel - 1) // 2
  return ((pad, pad), (pad, pad))


class _ConvMaker:
  """Builds the model's convolutions (no bias; the model's padding and kernel init)."""

  def __init__(self, *, dtype: Any, padding: str, kernel_init: Any):
    self.dtype = dtype
    self.padding = padding
    self.kernel_init = kernel_init

  def __call__(self, in_f: int, out_f: int, kernel: int, stride: int, *,
               rngs: nnx.Rngs, padding: Any = None) -> nnx.Conv:
    if padding is None:
      padding = "SAME" if self.padding == "same" else _symmetric(kernel)
    return nnx.Conv(in_f, out_f, (kernel, kernel), strides=(stride, stride),
                    padding=padding, use_bias=False, dtype=self.dtype,
                    param_dtype=jnp.float32, kernel_init=self.kernel_init, rngs=rngs)


class BasicBlock(nnx.Module):
  """Two 3x3 convolutions (ResNet-18/34): ``[B, H, W, in_f] -> [B, H/s, W/s, f]``."""

  expansion = 1

  def __init__(self, in_f: int, f: int, stride: int, *, conv: _ConvMaker, norm: _Norm,
               rngs: nnx.Rngs):
    self.conv1 = conv(in_f, f, 3, stride, rngs=rngs)
    self.bn1 = norm(f, rngs=rngs)
    self.conv2 = conv(f, f, 3, 1, rngs=rngs)
    self.bn2 = norm(f, rngs=rngs, zero_scale=True)
    if stride != 1 or in_f != f:
      self.proj_conv = conv(in_f, f, 1, stride, rngs=rngs)
      self.proj_bn = norm(f, rngs=rngs)
    else:
      self.proj_conv = self.proj_bn = None

  def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
    ura = not train
    y = nnx.relu(self.bn1(self.conv1(x), use_running_average=ura))
    y = self.bn2(self.conv2(y), use_running_average=ura)
    if self.proj_conv is not None:
      x = self.proj_bn(self.proj_conv(x), use_running_average=ura)
    return nnx.relu(x + y)


class BottleneckBlock(nnx.Module):
  """1x1 -> 3x3 (stride here: v1.5) -> 1x1 x4 (ResNet-50 and deeper).

  ``[B, H, W, in_f] -> [B, H/s, W/s, 4 f]``.
  """

  expansion = 4

  def __init__(self, in_f: int, f: int, stride: int, *, conv: _ConvMaker, norm: _Norm,
               rngs: nnx.Rngs):
    out_f = f * self.expansion
    self.conv1 = conv(in_f, f, 1, 1, rngs=rngs)
    self.bn1 = norm(f, rngs=rngs)
    self.conv2 = conv(f, f, 3, stride, rngs=rngs)  # v1.5: stride in the 3x3
    self.bn2 = norm(f, rngs=rngs)
    self.conv3 = conv(f, out_f, 1, 1, rngs=rngs)
    self.bn3 = norm(out_f, rngs=rngs, zero_scale=True)
    if stride != 1 or in_f != out_f:
      self.proj_conv = conv(in_f, out_f, 1, stride, rngs=rngs)
      self.proj_bn = norm(out_f, rngs=rngs)
    else:
      self.proj_conv = self.proj_bn = None

  def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
    ura = not train
    y = nnx.relu(self.bn1(self.conv1(x), use_running_average=ura))
    y = nnx.relu(self.bn2(self.conv2(y), use_running_average=ura))
    y = self.bn3(self.conv3(y), use_running_average=ura)
    if self.proj_conv is not None:
      x = self.proj_bn(self.proj_conv(x), use_running_average=ura)
    return nnx.relu(x + y)


class ResNet(nnx.Module):
  """ResNet v1.5: ``[B, H, W, C]`` normalised images -> ``[B, num_classes]`` logits.

  Stem: 7x7/2 convolution (``num_filters`` channels), BatchNorm, ReLU, 3x3/2
  max-pool; then four stages of residual blocks (the first block of stages 2-4
  has stride 2) with ``num_filters * 2**i`` base channels; global average pool;
  a dense layer. The spatial size shrinks by 32 (224 -> 7, 32 -> 1).

  Args:
    depth: 18, 34, 50, 101, 152 or 200 (see :data:`STAGE_SIZES`).
    num_classes: number of logits (1000 for ImageNet).
    num_filters: channels of the stem and the first stage (64 in the paper).
    in_channels: channels of the input images (3 for RGB).
    dtype: compute dtype (``jnp.float32`` or ``jnp.bfloat16``); parameters and
      BatchNorm statistics are always float32.
    axis_name: mapped axis over which BatchNorm averages its statistics in a
      per-device (pmap/shard_map) step; None in the global step style, where
      the statistics are global by construction (see the module docstring).
    bn_momentum: running-average decay of BatchNorm statistics (0.9, the Flax
      ImageNet example and the MLPerf reference).
    bn_epsilon: BatchNorm epsilon (1e-5, the Flax ImageNet example and torchvision).
    padding: ``"symmetric"`` or ``"same"`` (see the module docstring).
    kernel_init: ``"he_fan_out"`` or ``"lecun_normal"`` (see :data:`KERNEL_INITS`).
    rngs: initialisation RNGs (``nnx.Rngs(params=seed)``).

  Raises:
    ValueError: ``depth``, ``padding`` or ``kernel_init`` is not one of the choices.
  """

  def __init__(self, depth: int, *, num_classes: int, rngs: nnx.Rngs, num_filters: int = 64,
               in_channels: int = 3, dtype: Any = jnp.float32, axis_name: str | None = None,
               bn_momentum: float = 0.9, bn_epsilon: float = 1e-5,
               padding: str = "symmetric", kernel_init: str = "he_fan_out"):
    if depth not in STAGE_SIZES:
      raise ValueError(f"depth must be one of {sorted(STAGE_SIZES)}, got {depth}")
    if padding not in PADDINGS:
      raise ValueError(f"padding must be one of {PADDINGS}, got {padding!r}")
    if kernel_init not in KERNEL_INITS:
      raise ValueError(f"kernel_init must be one of {tuple(KERNEL_INITS)}, got {kernel_init!r}")
    conv_init, dense_init = KERNEL_INITS[kernel_init]
    kind, stage_sizes = STAGE_SIZES[depth]
    block_cls = BasicBlock if kind == "basic" else BottleneckBlock
    norm = _Norm(dtype=dtype, axis_name=axis_name, momentum=bn_momentum, epsilon=bn_epsilon)
    conv = _ConvMaker(dtype=dtype, padding=padding, kernel_init=conv_init)
    self.depth = depth
    self.dtype = dtype
    # "SAME" for the 3x3/2 max-pool; symmetric (1, 1) otherwise. Static (not a pytree leaf).
    self.pool_padding = "SAME" if padding == "same" else _symmetric(3)
    self.stem_conv = conv(in_channels, num_filters, 7, 2, rngs=rngs, padding=_symmetric(7))
    self.stem_bn = norm(num_filters, rngs=rngs)
    blocks = []
    in_f = num_filters
    for i, n in enumerate(stage_sizes):
      for j in range(n):
        stride = 2 if i > 0 and j == 0 else 1
        f = num_filters * 2 ** i
        blocks.append(block_cls(in_f, f, stride, conv=conv, norm=norm, rngs=rngs))
        in_f = f * block_cls.expansion
    self.blocks = nnx.List(blocks)
    self.head = nnx.Linear(in_f, num_classes, dtype=dtype, param_dtype=jnp.float32,
                           kernel_init=dense_init, rngs=rngs)

  def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
    """Logits.

    Args:
      x: float ``[B, H, W, in_channels]`` normalised images (cast to ``dtype``).
      train: use batch statistics in BatchNorm and update the running averages
        (True), or use the running averages (False, evaluation).

    Returns:
      float32 ``[B, num_classes]`` logits.
    """
    x = jnp.asarray(x, self.dtype)
    x = nnx.relu(self.stem_bn(self.stem_conv(x), use_running_average=not train))
    x = nnx.max_pool(x, (3, 3), strides=(2, 2), padding=self.pool_padding)
    for block in self.blocks:
      x = block(x, train=train)
    x = jnp.mean(x.astype(jnp.float32), axis=(1, 2)).astype(self.dtype)
    return self.head(x).astype(jnp.float32)


ResNet18 = functools.partial(ResNet, 18)
ResNet34 = functools.partial(ResNet, 34)
ResNet50 = functools.partial(ResNet, 50)
ResNet101 = functools.partial(ResNet, 101)
ResNet152 = functools.partial(ResNet, 152)
ResNet200 = functools.partial(ResNet, 200)


def param_count(model_or_state: Any) -> int:
  """Number of trainable parameters (``nnx.Param`` leaves; BatchNorm statistics excluded).

  Args:
    model_or_state: an ``nnx.Module`` (possibly abstract, from ``nnx.eval_shape``).

  Returns:
    The total element count of the parameters.
  """
  params = nnx.state(model_or_state, nnx.Param)
  return sum(int(x.size) for x in jax.tree.leaves(params))


def stage_sizes(depth: int) -> Sequence[int]:
  """Blocks per stage for ``depth`` (e.g. ``(3, 4, 6, 3)`` for ResNet-50)."""
  return STAGE_SIZES[depth][1]
