"""Peak compute rates of accelerator chips, for MFU (model FLOPs utilization).

:data:`PEAKS` maps a ``jax.Device.device_kind`` (the string JAX reports: ``"TPU v5 lite"``,
``"NVIDIA H100 80GB HBM3"``) to a :class:`Peak`: the chip's published dense peak rate per JAX
device in bfloat16 and in float32, in FLOP/s, with the page the numbers come from. MFU is a
program's FLOPs per second on one device over that peak
(:class:`~loopkit.observe.LoggingHook`'s ``throughput/mfu``; the AOT report's compute bound uses
the bfloat16 peak of the same table through :mod:`loopkit.tools.topology`).

How the numbers were read (each entry's comment quotes its page):

* TPUs: Google Cloud's "System architecture" page of each generation gives the peak bf16 compute
  per chip; JAX runs one device per chip on these generations (v4 and v5p as megacore). The
  pages give no float32 rate, so ``f32_flops`` is None (no float32 MFU on TPUs).
* NVIDIA GPUs: the data sheets give "BFLOAT16 Tensor Core" with 2:4 structured sparsity for
  Hopper (footnote "With sparsity"); the dense rate, used here, is half of it (the A100 data sheet
  gives both). ``f32_flops`` is the sheet's "FP32" row: the CUDA cores' rate, without tensor
  cores. XLA may run float32 matmuls on TF32 tensor cores (JAX's default matmul precision on
  Ampere and later), which is faster than that row, so a float32 MFU above 1 can happen there.

A device kind not in the table (CPUs, other chips) has no MFU; ``LoggingHook`` takes
``peak_flops_per_device=`` for those.

Thread-safe (constants).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

__all__ = ["PEAKS", "PEAK_DTYPES", "Peak", "peak_dtype_name", "peak_flops"]


@dataclasses.dataclass(frozen=True)
class Peak:
  """One chip's published dense peak compute per JAX device.

  Attributes:
    bf16_flops: peak bfloat16 FLOP/s (matrix units, dense).
    f32_flops: peak float32 FLOP/s, or None where the vendor publishes none.
    source: the vendor page the numbers are from.
  """

  bf16_flops: float
  f32_flops: float | None
  source: str

  def flops(self, dtype: str) -> float | None:
    """The peak for ``"bfloat16"`` or ``"float32"`` (see :func:`peak_dtype_name`)."""
    return self.bf16_flops if peak_dtype_name(dtype) == "bfloat16" else self.f32_flops


_TPU_V4 = "https://cloud.google.com/tpu/docs/v4"
_TPU_V5E = "https://cloud.google.com/tpu/docs/v5e"
_TPU_V5P = "https://cloud.google.com/tpu/docs/v5p"
_TPU_V6E = "https://cloud.google.com/tpu/docs/v6e"
_A100 = ("https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
         "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf")
_H100 = "https://www.nvidia.com/en-us/data-center/h100/"
_H200 = "https://www.nvidia.com/en-us/data-center/h200/"

# Read on 2026-12-01. Keys are jax.Device.device_kind as JAX reports it (CUDA's device name for
# NVIDIA GPUs: the H100 SXM reports "NVIDIA H100 80GB HBM3", the H200 SXM "NVIDIA H200").
PEAKS: dict[str, Peak] = {
    # "Peak compute per chip (bf16) 275 TFLOPs".
    "TPU v4": Peak(275e12, None, _TPU_V4),
    # "Peak compute per chip (bf16) 197 TFLOPs".
    "TPU v5 lite": Peak(197e12, None, _TPU_V5E),
    # v5p: "Peak compute per chip (bf16) 459 TFLOPs".
    "TPU v5": Peak(459e12, None, _TPU_V5P),
    # v6e: "Peak compute per chip (bf16) 918 TFLOPs".
    "TPU v6 lite": Peak(918e12, None, _TPU_V6E),
    # A100 (SXM4 and PCIe, 40 and 80 GB): "BFLOAT16 Tensor Core 312 TFLOPS | 624 TFLOPS*"
    # (* with sparsity), "FP32 19.5 TFLOPS".
    "NVIDIA A100-SXM4-40GB": Peak(312e12, 19.5e12, _A100),
    "NVIDIA A100-SXM4-80GB": Peak(312e12, 19.5e12, _A100),
    "NVIDIA A100-PCIE-40GB": Peak(312e12, 19.5e12, _A100),
    "NVIDIA A100 80GB PCIe": Peak(312e12, 19.5e12, _A100),
    # H100 SXM: "BFLOAT16 Tensor Core 1,979 teraFLOPS*" (* with sparsity), "FP32 67 teraFLOPS".
    "NVIDIA H100 80GB HBM3": Peak(1979e12 / 2, 67e12, _H100),
    # H100 PCIe: "BFLOAT16 Tensor Core 1,513 teraFLOPS*", "FP32 51 teraFLOPS".
    "NVIDIA H100 PCIe": Peak(1513e12 / 2, 51e12, _H100),
    # H100 NVL: "BFLOAT16 Tensor Core 1,671 teraFLOPS*", "FP32 60 teraFLOPS".
    "NVIDIA H100 NVL": Peak(1671e12 / 2, 60e12, _H100),
    # H200 SXM: "BFLOAT16 Tensor Core 1,979 TFLOPS*" (* with sparsity), "FP32 67 TFLOPS".
    "NVIDIA H200": Peak(1979e12 / 2, 67e12, _H200),
    # H200 NVL: "BFLOAT16 Tensor Core 1,671 TFLOPS*", "FP32 60 TFLOPS".
    "NVIDIA H200 NVL": Peak(1671e12 / 2, 60e12, _H200),
}

PEAK_DTYPES = ("bfloat16", "float32")
"""The dtypes :data:`PEAKS` has a column for."""


def peak_dtype_name(dtype: Any) -> str:
  """``"bfloat16"`` or ``"float32"`` for a dtype given by name or as a NumPy/JAX dtype.

  Raises:
    ValueError: any other dtype (the message names it and the two accepted).
  """
  try:
    name = jnp.dtype(dtype).name
  except (TypeError, ValueError):
    name = str(dtype)
  if name not in PEAK_DTYPES:
    raise ValueError(f"peak_dtype {dtype!r} has no column in loopkit.observe.peaks.PEAKS; "
                     f"use one of {PEAK_DTYPES} (the dtype of the program's matmuls)")
  return name


def peak_flops(device_kind: str, dtype: Any = "bfloat16") -> float | None:
  """The published dense peak FLOP/s of one device of ``device_kind`` in ``dtype``.

  Args:
    device_kind: ``jax.Device.device_kind``, e.g. ``"TPU v5 lite"``.
    dtype: ``"bfloat16"`` or ``"float32"`` (a name or a dtype).

  Returns:
    FLOP/s, or None where :data:`PEAKS` has no entry for the kind or no number for the dtype.

  Raises:
    ValueError: a dtype other than bfloat16 or float32.
  """
  name = peak_dtype_name(dtype)
  peak = PEAKS.get(device_kind)
  return None if peak is None else peak.flops(name)
