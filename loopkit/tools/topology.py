"""TPU chips and topologies for ahead-of-time compilation (see :mod:`loopkit.tools.aot`).

:data:`CHIPS` holds each chip's HBM, peak bf16 rate and bandwidth (with their
sources); :func:`parse_topology` reads names like ``"v5e:2x2"`` or ``"v4-32"``;
:func:`topology_devices` makes ``libtpu``'s compile-only devices for one.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

import jax

from loopkit.observe.peaks import PEAKS

__all__ = ["CHIPS", "Chip", "GiB", "chip_of", "known_topologies", "parse_topology",
           "topology_devices"]

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
  """One TPU chip generation as Google Cloud documents it (one JAX device per chip).

  Attributes:
    name: short name used in topology names, e.g. ``"v5e"``.
    device_kind: ``jax.Device.device_kind`` of its devices, e.g. ``"TPU v5 lite"``.
    hbm_bytes: HBM per chip in bytes, as documented (the runtime reserves a
      little of it, so the usable amount is slightly lower).
    peak_bf16_flops: peak bf16 compute per chip, FLOP/s (from
      :data:`loopkit.observe.peaks.PEAKS`, the table MFU uses).
    hbm_bytes_per_sec: HBM bandwidth per chip, bytes/s.
    cores_per_chip: TensorCores per chip (the ``-N`` of a Cloud accelerator
      type counts cores for v4/v5p, chips for v5e/v6e).
    chip_config_name: libtpu's chip configuration (``"megacore"``: the chip's
      two TensorCores are one device, as JAX runs v4 and v5p).
    source: the Google Cloud TPU documentation page of the numbers.
  """

  name: str
  device_kind: str
  hbm_bytes: int
  peak_bf16_flops: float
  hbm_bytes_per_sec: float
  cores_per_chip: int
  chip_config_name: str
  source: str


# The numbers of each chip's "System architecture" table, read on 2026-12-01 (the peak bf16
# rates live in loopkit.observe.peaks.PEAKS, with the same sources, so MFU and the AOT report's
# compute bound use one number).
# Units as the pages print them: v4 and v5e give GiB; v5p and v6e give "GB", taken here as
# 1e9 bytes (the smaller reading, so the headroom is not overstated).
CHIPS: dict[str, Chip] = {c.name: c for c in (
    # https://cloud.google.com/tpu/docs/v4: 275 TFLOP/s (bf16), HBM2 32 GiB, 1200 GBps.
    Chip("v4", "TPU v4", 32 * GiB, PEAKS["TPU v4"].bf16_flops, 1200e9, 2, "megacore",
         "https://cloud.google.com/tpu/docs/v4"),
    # https://cloud.google.com/tpu/docs/v5e: 197 TFLOP/s (bf16), HBM 16 GiB, 819 GBps.
    Chip("v5e", "TPU v5 lite", 16 * GiB, PEAKS["TPU v5 lite"].bf16_flops, 819e9, 1, "default",
         "https://cloud.google.com/tpu/docs/v5e"),
    # https://cloud.google.com/tpu/docs/v5p: 459 TFLOP/s (bf16), HBM2e 95 GB, 2765 GBps.
    Chip("v5p", "TPU v5", 95 * 10**9, PEAKS["TPU v5"].bf16_flops, 2765e9, 2, "megacore",
         "https://cloud.google.com/tpu/docs/v5p"),
    # https://cloud.google.com/tpu/docs/v6e: 918 TFLOP/s (bf16), HBM 32 GB, 1640 GBps.
    Chip("v6e", "TPU v6 lite", 32 * 10**9, PEAKS["TPU v6 lite"].bf16_flops, 1640e9, 1, "default",
         "https://cloud.google.com/tpu/docs/v6e"),
)}
_ALIASES = {"v5litepod": "v5e"}

# Slice shapes of the Cloud accelerator types (the pages above, "Supported configurations").
_SHAPES = {
    "v4": ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8"),
    "v5p": ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8"),
    "v5e": ("2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
    "v6e": ("2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
}


def _accelerator_types() -> dict[str, str]:
  """``"v4-32" -> "v4:2x2x4"``, ``"v5e-32"``/``"v5litepod-32" -> "v5e:4x8"``, ..."""
  names = {}
  for chip, shapes in _SHAPES.items():
    for shape in shapes:
      n = math.prod(int(d) for d in shape.split("x")) * CHIPS[chip].cores_per_chip
      names[f"{chip}-{n}"] = f"{chip}:{shape}"
      if chip == "v5e":
        names[f"v5litepod-{n}"] = f"{chip}:{shape}"
  return names


ACCELERATOR_TYPES: dict[str, str] = _accelerator_types()


def known_topologies() -> str:
  """A one-line description of the topology names :func:`topology_devices` accepts."""
  return (f"'CHIP:SHAPE' with CHIP one of {sorted(CHIPS) + sorted(_ALIASES)} (e.g. 'v5e:2x2', "
          f"'v5e:4x8', 'v4:2x2x4', 'v5p:2x2x2', 'v6e:4x4'), or a Cloud accelerator type: "
          f"{', '.join(sorted(ACCELERATOR_TYPES, key=_type_key))}")


def _type_key(name: str) -> tuple[str, int]:
  chip, n = name.rsplit("-", 1)
  return chip, int(n)


def parse_topology(topology: str) -> tuple[Chip, str]:
  """Resolves a topology name to its chip and libtpu's ``"chip:AxBxC"`` name.

  Args:
    topology: ``"v5e:4x8"`` (libtpu's form) or an accelerator type ``"v4-32"``.

  Returns:
    ``(chip, name)``, e.g. ``(CHIPS["v4"], "v4:2x2x4")`` for ``"v4-32"``.

  Raises:
    ValueError: the name is malformed or its chip is not in :data:`CHIPS` (the
      message lists the known names).
  """
  name = ACCELERATOR_TYPES.get(topology, topology)
  m = re.fullmatch(r"([a-z0-9]+):(\d+(?:x\d+){1,2})", name)
  chip = m and _ALIASES.get(m.group(1), m.group(1))
  if not m or chip not in CHIPS:
    raise ValueError(f"unknown TPU topology {topology!r}; known: {known_topologies()}")
  return CHIPS[chip], f"{chip}:{m.group(2)}"


def topology_devices(topology: str) -> list[jax.Device]:
  """Compile-only devices of a TPU topology (one per chip), from ``libtpu``.

  No TPU is needed: libtpu describes the topology and compiles for it.
  Setting ``ALLOW_MULTIPLE_LIBTPU_LOAD=1`` (unless set) lets several processes
  load libtpu at once (it otherwise takes ``/tmp/libtpu_lockfile``); the
  default JAX backend is unchanged (CPU stays CPU).

  Args:
    topology: see :func:`parse_topology`.

  Returns:
    The devices, in libtpu's order (``len`` = chips in the slice).

  Raises:
    ValueError: unknown topology name, or one libtpu refuses (its message
      included).
    ImportError: libtpu is not installed.
  """
  chip, name = parse_topology(topology)
  try:
    import libtpu  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  except ImportError as e:
    raise ImportError("compiling for a TPU topology needs libtpu: pip install 'loopkit[tpu]' "
                      "(jax[tpu])") from e
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  try:
    devices = topologies.get_topology_desc(name, "tpu",
                                           chip_config_name=chip.chip_config_name).devices
  except jax.errors.JaxRuntimeError as e:
    raise ValueError(f"libtpu refused the TPU topology {topology!r} ({name}): {e}; "
                     f"known: {known_topologies()}") from None
  return list(devices)


def chip_of(device: jax.Device) -> Chip | None:
  """The :class:`Chip` of a device (by ``device_kind``), or None (CPU, GPU, unknown TPU)."""
  for c in CHIPS.values():
    if device.device_kind == c.device_kind:
      return c
  return None
