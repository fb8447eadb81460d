"""The metric writer protocol and what every writer shares (see :mod:`loopkit.observe.writers`).

:class:`MetricWriter` is the protocol (CLU's ``clu.metric_writers`` method names
and signatures); :class:`NullWriter` writes nothing (processes other than 0).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Protocol

import jax
import numpy as np

log = logging.getLogger("loopkit")


class MetricWriter(Protocol):
  """What a metric writer provides. Steps are global steps (optimizer updates).

  The optional methods of CLU's interface (``write_texts(step, texts)``,
  ``write_images(step, images)``, ``write_histograms(step, arrays,
  num_buckets=None)``, ``write_hparams(hparams)``) are provided by every writer
  of this module; a user writer may omit them.
  """

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    """Writes ``scalars`` (name -> number; numpy/JAX scalars allowed) at ``step``."""
    ...

  def flush(self) -> None:
    """Makes everything written so far durable (on disk / emitted)."""
    ...

  def close(self) -> None:
    """Flushes and releases resources; later writes are errors or no-ops."""
    ...


def _is_writer_process() -> bool:
  return jax.process_index() == 0


def _to_python(value: Any) -> Any:
  """A JSON-friendly Python scalar: numpy / JAX scalars become int, float or bool."""
  if isinstance(value, (bool, int, float, str)) or value is None:
    return value
  arr = np.asarray(value)  # a jax.Array is fetched here (on the writer's thread)
  if arr.ndim != 0:
    raise ValueError(f"metric writers take scalars, got an array of shape {arr.shape}")
  return arr.item()


def _hparam_value(value: Any) -> bool | int | float | str:
  """An hparam as TensorBoard takes it: bool, int, float or str (else its ``str``)."""
  if isinstance(value, (bool, int, float, str)):
    return value
  if isinstance(value, (np.generic, np.ndarray)) and np.ndim(value) == 0:
    return np.asarray(value).item()
  return str(value)


def _skip(writer: Any, what: str, step: int, names: Any) -> None:
  log.debug("%s does not record %s; skipped %s at step %d", type(writer).__name__, what,
            sorted(names), step)


class NullWriter:
  """Discards everything (the writer of processes other than 0)."""

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    del step, scalars

  def write_texts(self, step: int, texts: Mapping[str, str]) -> None:
    del step, texts

  def write_images(self, step: int, images: Mapping[str, Any]) -> None:
    del step, images

  def write_histograms(self, step: int, arrays: Mapping[str, Any],
                       num_buckets: Mapping[str, int] | None = None) -> None:
    del step, arrays, num_buckets

  def write_hparams(self, hparams: Mapping[str, Any]) -> None:
    del hparams

  def flush(self) -> None:
    pass

  def close(self) -> None:
    pass
