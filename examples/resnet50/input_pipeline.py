"""TFDS input pipelines for ImageNet-style classification (``imagenet2012``, ``sklearn_digits``).

Two pipelines, chosen by ``config.input_pipeline``, with the same image
functions: ``"tfdata"`` reads TFRecords with tf.data (:class:`TrainBatches`,
:class:`EvalBatches`); ``"grain"`` reads ArrayRecord files by random access
(``tfds.data_source``) through Grain (:func:`grain_train_source`, a
:class:`loopkit.data.GrainSource`; :class:`GrainEvalBatches`), with Grain
worker processes for decode and augmentation, an O(1) resume and the same
global batches on any process count. :func:`create_datasets` builds a run's
from its config. The rest of this docstring describes the tf.data path.

The image functions (crops, flips, resizing, :func:`normalize`) are in
:mod:`examples.resnet50.preprocess`, re-exported here. JPEG bytes are decoded
only inside the crop window (``tf.io.decode_and_crop_jpeg``); other formats
(the digits' PNGs) are decoded whole and then cropped.

Images leave the pipeline as **uint8** ``[B, S, S, 3]`` (4x fewer bytes to the
device than float32); :func:`normalize` runs on the device inside the train
and eval steps.

Determinism and resume: the training order and augmentation are a pure
function of ``(seed, epoch, process)``: each epoch's file order and shuffle use
a seed derived from them, every example's crop/flip use a stateless seed
``(epoch seed, position in the epoch)``, and tf.data runs deterministically.
:class:`TrainBatches` resumes at any step by rebuilding that epoch's pipeline
and skipping the consumed examples *before* decoding (cheap even for
ImageNet), so a resumed run sees exactly the batches an uninterrupted run
would.

Multi-host: each process reads its own contiguous shard of the split
(``tfds.split_for_jax_process`` / ``tfds.even_splits``: sizes differing by at
most one, case C27). Training drops the shard's remainder so every process runs
the same number of steps per epoch; evaluation keeps every example, and every
process runs the same number of (padded, masked) batches.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from examples.resnet50.config_checks import FILE_FORMATS, file_format
from examples.resnet50.preprocess import (  # noqa: F401  (re-exported: the pipelines' image functions)
  MEAN_RGB,
  STDDEV_RGB,
  Preprocessing,
  normalize,
  preprocess_eval,
  preprocess_train,
)

# -- datasets ------------------------------------------------------------------


def shard_size(num_examples: int, process_index: int, process_count: int) -> int:
  """Examples in a process's shard (``tfds.even_splits``: the first N % P get one more).

  Example:
    >>> [shard_size(10, p, 4) for p in range(4)]
    [3, 3, 2, 2]
  """
  base, extra = divmod(num_examples, process_count)
  return base + (1 if process_index < extra else 0)


def num_examples(builder: Any, split: str, override: int | None = None) -> int:
  """Examples in ``split`` from the builder's metadata (or ``override``).

  Raises:
    ValueError: the metadata has no such split (e.g. under
      ``tfds.testing.mock_data`` without metadata) and no override is given.
  """
  if override:
    return int(override)
  try:
    return int(builder.info.splits[split].num_examples)
  except KeyError:
    raise ValueError(f"the dataset {builder.name!r} has no metadata for split {split!r}; "
                     "prepare it or set config.num_train_examples / num_eval_examples") from None


def _epoch_seed(seed: int, epoch: int, process_index: int) -> int:
  """A 31-bit seed for one epoch of one process, from ``(seed, epoch, process)``."""
  return int(np.random.SeedSequence([seed, epoch, process_index]).generate_state(1)[0] >> 1)


def _read(builder: Any, split: Any, *, shuffle_seed: int | None) -> Any:
  """The raw examples of ``split`` with undecoded image bytes (``tf.data.Dataset``)."""
  import tensorflow as tf
  import tensorflow_datasets as tfds

  read_config = tfds.ReadConfig(shuffle_seed=shuffle_seed, try_autocache=False,
                                skip_prefetch=True)
  ds = builder.as_dataset(split=split, shuffle_files=shuffle_seed is not None,
                          read_config=read_config,
                          decoders={"image": tfds.decode.SkipDecoding()})
  options = tf.data.Options()
  options.deterministic = True
  return ds.with_options(options)


class TrainBatches:
  """Endless, resumable training batches of one process's shard of a TFDS split.

  A loopkit source: ``iter()`` gives an iterator with ``get_state()`` (the
  number of batches consumed, ``{"batches": n}``) and ``set_state()``. Epoch
  ``e`` reads the shard with files and examples shuffled from
  ``(seed, e, process_index)``, drops the remainder
  (``shard_size % local_batch_size``) and yields ``steps_per_epoch`` batches.

  Args:
    builder: a TFDS builder (``tfds.builder("imagenet2012", data_dir=...)``).
    split: the split name, e.g. ``"train"``.
    num_examples: examples in the whole split (all processes).
    global_batch_size: B, divisible by ``process_count``.
    preprocessing: crop/flip settings.
    seed: shuffle and augmentation seed.
    shuffle_buffer: examples in the tf.data shuffle buffer (per process).
    process_index, process_count: this process and P (default JAX's).
    read_once: call ``builder.as_dataset`` once, now, and re-iterate that
      source every epoch (the file order is then not reshuffled per epoch; the
      example shuffle still is). For ``tfds.testing.mock_data``, whose mocked
      ``as_dataset`` redirects ``tf.io.gfile``/``epath`` *process-wide* into a
      temporary directory while it runs: called from the prefetch thread it
      would redirect a concurrent asynchronous checkpoint write.

  Raises:
    ValueError: B not divisible by P, or a shard smaller than one local batch.

  Batches: ``{"image": uint8 [B / P, S, S, 3], "label": int32 [B / P]}``.
  Not thread-safe (one consumer); multi-host-safe.
  """

  def __init__(self, builder: Any, *, split: str, num_examples: int, global_batch_size: int,
               preprocessing: Preprocessing, seed: int, shuffle_buffer: int = 16_384,
               process_index: int | None = None, process_count: int | None = None,
               read_once: bool = False):
    import jax

    self.process_index = jax.process_index() if process_index is None else process_index
    self.process_count = jax.process_count() if process_count is None else process_count
    if global_batch_size % self.process_count:
      raise ValueError(f"global batch size {global_batch_size} is not divisible by the "
                       f"process count {self.process_count}")
    self.builder = builder
    self.split = split
    self.local_batch_size = global_batch_size // self.process_count
    self.preprocessing = preprocessing
    self.seed = seed
    self.shuffle_buffer = shuffle_buffer
    # Every process must run the same number of steps: size by the smallest shard.
    smallest = shard_size(num_examples, self.process_count - 1, self.process_count)
    self.steps_per_epoch = smallest // self.local_batch_size
    if self.steps_per_epoch < 1:
      raise ValueError(f"a shard of {smallest} examples is smaller than one local batch of "
                       f"{self.local_batch_size}")
    self._raw = self._read(seed) if read_once else None

  def _read(self, shuffle_seed: int) -> Any:
    import tensorflow_datasets as tfds

    split = tfds.split_for_jax_process(self.split, process_index=self.process_index,
                                       process_count=self.process_count)
    return _read(self.builder, split, shuffle_seed=shuffle_seed)

  def epoch_dataset(self, epoch: int, skip_batches: int = 0) -> Any:
    """The ``tf.data.Dataset`` of epoch ``epoch`` from batch ``skip_batches`` on."""
    import tensorflow as tf

    p = self.preprocessing
    seed = _epoch_seed(self.seed, epoch, self.process_index)
    ds = self._raw if self._raw is not None else self._read(seed)
    ds = ds.shuffle(self.shuffle_buffer, seed=seed, reshuffle_each_iteration=False)
    ds = ds.take(self.steps_per_epoch * self.local_batch_size).enumerate()
    ds = ds.skip(skip_batches * self.local_batch_size)  # before decoding: cheap

    def prepare(index, example):
      example_seed = tf.stack([tf.constant(seed, tf.int64), index])
      return {"image": preprocess_train(example["image"], example_seed, p),
              "label": tf.cast(example["label"], tf.int32)}

    ds = ds.map(prepare, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    ds = ds.batch(self.local_batch_size, drop_remainder=True)
    return ds.prefetch(tf.data.AUTOTUNE)

  def __iter__(self) -> _TrainIterator:
    return _TrainIterator(self)


class _TrainIterator:
  """Iterator over :class:`TrainBatches`, positioned by a batch count."""

  def __init__(self, source: TrainBatches):
    self._source = source
    self._n = 0
    self._it: Iterator | None = None

  def _epochs(self, n: int) -> Iterator[dict[str, np.ndarray]]:
    import tensorflow_datasets as tfds

    epoch, skip = divmod(n, self._source.steps_per_epoch)
    while True:
      yield from tfds.as_numpy(self._source.epoch_dataset(epoch, skip))
      epoch, skip = epoch + 1, 0

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    if self._it is None:  # opened lazily, so set_state() before next() costs nothing
      self._it = self._epochs(self._n)
    batch = next(self._it)
    self._n += 1
    return batch

  def get_state(self) -> dict[str, int]:
    """``{"batches": n}``: batches consumed from the start of epoch 0."""
    return {"batches": self._n}

  def set_state(self, state: dict[str, int]) -> None:
    """Positions the iterator after ``state["batches"]`` batches.

    Raises:
      ValueError: a position saved by another pipeline (the Grain path's
        ``{"grain_step": ...}``), naming it.
    """
    if not isinstance(state, dict) or "batches" not in state:
      raise ValueError(f"the checkpoint's data position {state!r} was not saved by the tf.data "
                       "pipeline (which saves {'batches': n}): resume with "
                       "input_pipeline='grain', or start in another workdir")
    self._n = int(state["batches"])
    self._it = None


class EvalBatches:
  """One process's shard of an eval split, in order, as a re-iterable of batches.

  Every example is read once; the last batch may be short. Pass
  :attr:`num_batches` to :class:`loopkit.evaluation.Evaluator` so every process
  runs the same number of batches (short processes get fully masked ones).

  Args:
    builder: a TFDS builder.
    split: e.g. ``"validation"``.
    num_examples: examples in the whole split (all processes).
    global_batch_size: B, divisible by ``process_count``.
    preprocessing: crop settings.
    process_index, process_count: default JAX's.
    read_once: call ``builder.as_dataset`` once, now (see :class:`TrainBatches`;
      evaluation runs while an asynchronous checkpoint may be writing).

  Attributes:
    num_examples: N.
    num_batches: ``ceil(ceil(N / P) / (B / P))``, the same on every process.

  Batches: ``{"image": uint8 [b, S, S, 3], "label": int32 [b]}``, ``b <= B / P``.
  """

  def __init__(self, builder: Any, *, split: str, num_examples: int, global_batch_size: int,
               preprocessing: Preprocessing, process_index: int | None = None,
               process_count: int | None = None, read_once: bool = False):
    import jax

    self.process_index = jax.process_index() if process_index is None else process_index
    self.process_count = jax.process_count() if process_count is None else process_count
    if global_batch_size % self.process_count:
      raise ValueError(f"global batch size {global_batch_size} is not divisible by the "
                       f"process count {self.process_count}")
    self.builder = builder
    self.split = split
    self.num_examples = num_examples
    self.local_batch_size = global_batch_size // self.process_count
    self.preprocessing = preprocessing
    self.num_batches = math.ceil(math.ceil(num_examples / self.process_count)
                                 / self.local_batch_size)
    self._raw = self._read() if read_once else None

  def _read(self) -> Any:
    import tensorflow_datasets as tfds

    split = tfds.split_for_jax_process(self.split, process_index=self.process_index,
                                       process_count=self.process_count)
    return _read(self.builder, split, shuffle_seed=None)

  def dataset(self) -> Any:
    """The ``tf.data.Dataset`` of this process's eval batches."""
    import tensorflow as tf

    p = self.preprocessing
    ds = self._raw if self._raw is not None else self._read()
    ds = ds.map(lambda ex: {"image": preprocess_eval(ex["image"], p),
                            "label": tf.cast(ex["label"], tf.int32)},
                num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return ds.batch(self.local_batch_size).prefetch(tf.data.AUTOTUNE)

  def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
    import tensorflow_datasets as tfds

    return iter(tfds.as_numpy(self.dataset()))


# -- the Grain path (ArrayRecord via tfds.data_source, Grain worker processes) ----------


def grain_draw_seed(example: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
  """A Grain ``random_map``: keeps the encoded bytes, draws the example's stateless seed.

  Grain keys ``rng`` by the record's global index, so the crop and flip of an
  example at a step do not depend on the process or worker count. The bytes
  become a 0-d object array so that batching keeps them exact (``np.stack`` of
  ``bytes`` would pad them to one width).
  """
  return {"image": np.array(example["image"], dtype=object),
          "label": np.int32(example["label"]),
          "seed": rng.integers(0, 2**31 - 1, size=2, dtype=np.int64)}


def grain_keep_bytes(example: dict[str, Any]) -> dict[str, Any]:
  """A Grain ``map``: :func:`grain_draw_seed` without a seed (evaluation)."""
  return {"image": np.array(example["image"], dtype=object), "label": np.int32(example["label"])}


class GrainBatchPreprocess:
  """A batch transform: encoded images ``[m]`` -> ``{"image": uint8 [m, S, S, 3], "label"}``.

  The tf.data path's own image functions (:func:`preprocess_train` with each
  row's seed, or :func:`preprocess_eval`), run over the rows by one
  ``tf.function`` (``tf.map_fn``) per read instead of one call per image.
  Row i of the output depends only on row i of the input. Picklable (Grain's
  workers trace their own ``tf.function``).

  Args:
    preprocessing: the crop settings.
    train: the training crop and flip (rows carry a ``"seed"``), else the eval
      center crop.
  """

  def __init__(self, preprocessing: Preprocessing, *, train: bool):
    self.preprocessing = preprocessing
    self.train = train
    self._fn: Any = None

  def __getstate__(self) -> dict[str, Any]:
    return {"preprocessing": self.preprocessing, "train": self.train}

  def __setstate__(self, state: dict[str, Any]) -> None:
    self.preprocessing, self.train, self._fn = state["preprocessing"], state["train"], None

  def _build(self) -> Any:
    import tensorflow as tf

    p = self.preprocessing
    out = tf.TensorSpec([p.image_size, p.image_size, 3], tf.uint8)
    if self.train:
      return tf.function(lambda images, seeds: tf.map_fn(
          lambda a: preprocess_train(a[0], a[1], p), (images, seeds), fn_output_signature=out),
          input_signature=[tf.TensorSpec([None], tf.string), tf.TensorSpec([None, 2], tf.int64)])
    return tf.function(lambda images: tf.map_fn(
        lambda b: preprocess_eval(b, p), images, fn_output_signature=out),
        input_signature=[tf.TensorSpec([None], tf.string)])

  def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
    import tensorflow as tf

    if self._fn is None:
      self._fn = self._build()
    images = tf.constant(list(batch["image"]), tf.string)
    if self.train:
      images = self._fn(images, tf.constant(batch["seed"]))
    else:
      images = self._fn(images)
    return {"image": images.numpy(), "label": np.asarray(batch["label"], np.int32)}


def data_source(builder: Any, split: str) -> Any:
  """``split`` of an ArrayRecord TFDS dataset by random access, image bytes undecoded.

  Raises:
    ValueError: the dataset was built in another file format (naming it).
  """
  import tensorflow_datasets as tfds

  fmt = builder.info.file_format
  fmt = getattr(fmt, "value", fmt)
  if fmt != "array_record":
    raise ValueError(f"the Grain input pipeline reads ArrayRecord files, but the TFDS dataset "
                     f"{builder.name!r} in {builder.data_dir} was built as {fmt!r}: prepare it "
                     "with file_format='array_record' (TFDS), or use input_pipeline='tfdata'")
  return builder.as_data_source(split=split, decoders={"image": tfds.decode.SkipDecoding()})


def grain_train_source(builder: Any, *, split: str, global_batch_size: int,
                       preprocessing: Preprocessing, seed: int, worker_count: int = 0,
                       read_threads: int = 1, process_index: int | None = None,
                       process_count: int | None = None) -> Any:
  """Endless training batches of ``split`` through TFDS ``data_source`` + Grain.

  A :class:`loopkit.data.GrainSource`: the global batch of step ``s`` is a pure
  function of ``(seed, s)`` (Grain's per-epoch shuffle, then the seeds of
  :func:`grain_draw_seed`, keyed by the global index, then
  :class:`GrainBatchPreprocess` once per read); each process reads its
  ``B / P`` rows; the saved position is the step (O(1) resume).

  Batches: ``{"image": uint8 [B / P, S, S, 3], "label": int32 [B / P]}``.
  """
  from loopkit.data import GrainSource

  return GrainSource(data_source(builder, split), global_batch_size, seed=seed,
                     transform=lambda ds: ds.random_map(grain_draw_seed, seed=seed),
                     batch_transform=GrainBatchPreprocess(preprocessing, train=True),
                     worker_count=worker_count, read_threads=read_threads,
                     process_index=process_index,
                     process_count=process_count)


class GrainEvalBatches:
  """One process's contiguous shard of an eval split through Grain, in order.

  The same shard as :class:`EvalBatches` (``loopkit.data.process_shard_bounds``,
  like ``tfds.even_splits``), center-cropped by :class:`GrainBatchPreprocess`;
  the last batch may be short.

  Attributes:
    num_examples: N.
    num_batches: ``ceil(ceil(N / P) / (B / P))``, the same on every process.
  """

  def __init__(self, builder: Any, *, split: str, global_batch_size: int,
               preprocessing: Preprocessing, process_index: int | None = None,
               process_count: int | None = None):
    import grain

    from loopkit.data import eval_batches_per_process, process_shard_bounds

    data = data_source(builder, split)
    self.num_examples = len(data)
    start, stop = process_shard_bounds(self.num_examples, process_index, process_count)
    self.num_batches = eval_batches_per_process(self.num_examples, global_batch_size,
                                                process_count)
    import jax

    local = global_batch_size // (jax.process_count() if process_count is None
                                  else process_count)
    self._dataset = (grain.MapDataset.source(data)[start:stop].map(grain_keep_bytes)
                     .batch(local).map(GrainBatchPreprocess(preprocessing, train=False)))

  def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
    return iter(self._dataset)


# -- from a config (train.py) ----------------------------------------------------


def preprocessing(config: Any) -> Preprocessing:
  """The :class:`Preprocessing` of ``config`` (an ``ml_collections.ConfigDict``)."""
  return Preprocessing(
      image_size=config.image_size, random_resized_crop=config.random_resized_crop,
      area_range=tuple(config.area_range), aspect_ratio_range=tuple(config.aspect_ratio_range),
      flip=config.flip, crop_fraction=config.crop_fraction,
      resize_method=config.resize_method)


def create_datasets(config: Any) -> tuple[Any, Any]:
  """This process's training and eval batches for ``config.dataset``.

  ``config.input_pipeline``: ``"tfdata"`` (TFRecords through ``builder.as_dataset``) or
  ``"grain"`` (ArrayRecord files through ``tfds.data_source`` and Grain, with
  ``config.grain_workers`` worker processes). ``sklearn_digits`` is generated into
  ``config.data_dir`` on first use, in the pipeline's file format; other datasets
  (``imagenet2012``) must already be prepared there (or mocked with ``tfds.testing.mock_data``,
  ``config.mock_data``, tf.data only).

  Raises:
    ValueError: an unknown ``input_pipeline``, or a dataset built in the other file format
      (naming both).
  """
  import tensorflow_datasets as tfds

  fmt = file_format(config)
  if config.dataset == "sklearn_digits":
    from examples.resnet50 import digits_tfds
    builder = digits_tfds.ensure_prepared(config.data_dir or None, file_format=fmt)
  else:
    builder = tfds.builder(config.dataset, data_dir=config.data_dir or None)
  p = preprocessing(config)
  if config.get("input_pipeline", "tfdata") == "grain":
    train = grain_train_source(
        builder, split=config.train_split, global_batch_size=config.global_batch_size,
        preprocessing=p, seed=config.seed, worker_count=config.get("grain_workers", 0))
    evals = GrainEvalBatches(
        builder, split=config.eval_split, global_batch_size=config.eval_batch_size,
        preprocessing=p)
    return train, evals
  built = getattr(builder.info.file_format, "value", builder.info.file_format)
  if not config.mock_data and built != FILE_FORMATS["tfdata"]:
    raise ValueError(f"input_pipeline='tfdata' reads TFRecord files, but the TFDS dataset "
                     f"{builder.name!r} in {builder.data_dir} was built as {built!r}: use "
                     "input_pipeline='grain' (ArrayRecord), or prepare it as TFRecords")
  size = lambda split, n: num_examples(builder, split, n)
  train = TrainBatches(
      builder, split=config.train_split,
      num_examples=size(config.train_split, config.num_train_examples),
      global_batch_size=config.global_batch_size, preprocessing=p, seed=config.seed,
      shuffle_buffer=config.shuffle_buffer, read_once=config.mock_data)
  evals = EvalBatches(
      builder, split=config.eval_split,
      num_examples=size(config.eval_split, config.num_eval_examples),
      global_batch_size=config.eval_batch_size, preprocessing=p, read_once=config.mock_data)
  return train, evals


def mock_data_if_asked(config: Any) -> Any:
  """``tfds.testing.mock_data`` when ``config.mock_data`` (``configs/smoke.py``), else nothing."""
  if not config.get("mock_data", False):
    return contextlib.nullcontext()
  import tensorflow_datasets as tfds
  return tfds.testing.mock_data(num_examples=config.mock_num_examples)
