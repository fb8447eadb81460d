"""Checks of a run's config that need no devices, data or TensorFlow.

``main`` runs them before it starts JAX's backend, imports TensorFlow or writes anything in
the workdir, so a mistyped ``--config.<name>=value`` fails in about a second, with every
wrong value named, instead of after the start-up and with a traceback. The checks the data
needs (a dataset built in the other file format, a batch that does not divide over the
devices) stay where the data is read (``train.py``).
"""

from __future__ import annotations

from typing import Any

# config.input_pipeline -> the TFDS file format it reads (file_format)
FILE_FORMATS = {"tfdata": "tfrecord", "grain": "array_record"}
STEP_STYLES = ("global", "per_device")
PLATFORMS = ("cpu", "cuda", "gpu", "rocm", "tpu")  # config.platform: "" or comma-separated

# Fields that must be integers > 0, and integers >= 0 (0: off, or "from the metadata").
_POSITIVE = ("global_batch_size", "eval_batch_size", "iterations_per_loop",
             "eval_iterations_per_loop", "image_size", "num_classes")
_NON_NEGATIVE = ("grain_workers", "prefetch", "checkpoint_every_steps",
                 "max_checkpoints_to_keep", "num_train_examples", "num_eval_examples",
                 "label_modulo")
_NON_NEGATIVE_NUMBERS = ("eval_every_epochs", "checkpoint_every_epochs", "warmup_epochs",
                         "progress_every_secs")


def _is_int(x: Any) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def file_format(config: Any) -> str:
  """The TFDS file format ``config.input_pipeline`` reads: ``"tfrecord"`` or ``"array_record"``.

  Raises:
    ValueError: an unknown ``input_pipeline``, naming it and the known ones.
  """
  kind = config.get("input_pipeline", "tfdata")
  if kind not in FILE_FORMATS:
    raise ValueError(f"config.input_pipeline must be one of {sorted(FILE_FORMATS)}, got {kind!r}")
  return FILE_FORMATS[kind]


def problems(config: Any) -> list[str]:
  """What is wrong with ``config`` (an ``ml_collections.ConfigDict``), one line per field.

  Returns:
    An empty list when every checked field is valid; else lines such as
    ``"config.iterations_per_loop must be an integer > 0, got 0"``.
  """
  out = []
  try:
    file_format(config)
  except ValueError as e:
    out.append(str(e))
  style = config.get("step_style", "global")
  if style not in STEP_STYLES:
    out.append(f"config.step_style must be one of {list(STEP_STYLES)}, got {style!r}")
  platform = config.get("platform", "")
  if not isinstance(platform, str) or (
      platform and not set(platform.split(",")) <= set(PLATFORMS)):
    out.append(f"config.platform must be '' (JAX picks) or one or more of {list(PLATFORMS)} "
               f"separated by commas, got {platform!r}")
  for name in _POSITIVE:
    value = config.get(name, 1)
    if not _is_int(value) or value <= 0:
      out.append(f"config.{name} must be an integer > 0, got {value!r}")
  for name in _NON_NEGATIVE:
    value = config.get(name, 0)
    if not _is_int(value) or value < 0:
      out.append(f"config.{name} must be an integer >= 0, got {value!r}")
  for name in _NON_NEGATIVE_NUMBERS:
    value = config.get(name, 0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
      out.append(f"config.{name} must be a number >= 0, got {value!r}")
  modulo, classes = config.get("label_modulo", 0), config.get("num_classes", 1)
  if _is_int(modulo) and _is_int(classes) and modulo > classes:
    out.append(f"config.label_modulo must be <= config.num_classes (the labels "
               f"0..label_modulo - 1 need as many logits), got {modulo} > {classes}")
  steps, epochs = config.get("num_train_steps", -1), config.get("num_epochs", 1)
  if not (_is_int(steps) and steps > 0) and not (
      isinstance(epochs, (int, float)) and not isinstance(epochs, bool) and epochs > 0):
    out.append(f"config.num_epochs must be > 0 (or config.num_train_steps > 0), got "
               f"num_epochs={epochs!r}, num_train_steps={steps!r}")
  return out
