"""What the hosts deliver: images/s per process, the tf.data path and the Grain path side by side.

Both pipelines of ``examples/resnet50/input_pipeline.py`` read the same local
JPEG dataset (scikit-learn's digits upscaled to ``--source-size`` pixels and
JPEG-encoded, as a TFDS dataset built once as TFRecords and once as ArrayRecord
files) and run the same training preprocessing at 224 x 224: JPEG decode of the
Inception random-resized crop window, bicubic resize, random flip, uint8 out.

Rows (each after a warm-up of ``--warmup`` batches, which includes starting Grain's
worker processes):
  * tf.data: :class:`TrainBatches` (``num_parallel_calls=AUTOTUNE``: tf.data's own
    threads on every core);
  * Grain, W workers x T threads: :func:`grain_train_source` (a
    ``loopkit.data.GrainSource``) with ``worker_count`` W in ``--workers`` (0: read
    in the calling process) and ``read_threads`` T in ``--threads`` (threads reading
    whole batches; TF's image ops release the GIL); chunks of ``--k`` steps via
    ``chunk_at``, as the feeder reads them.

Usage (from the repository root)::

  python benchmarks/input.py                       # 1,797 images, batch 64, workers 0 1 2
  python benchmarks/input.py --batches 40 --workers 1 2 4 --out /tmp/input.json

Needs TensorFlow, TFDS, Grain and array_record (the ``data`` extra). The
numbers are per process; a host of a pod slice runs one process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _builder_class(source_size: int):
  import numpy as np
  import tensorflow_datasets as tfds

  class DigitsJpeg(tfds.core.GeneratorBasedBuilder):
    """The 1,797 digits upscaled to ``source_size`` x ``source_size`` RGB, JPEG-encoded."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
      return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
          "image": tfds.features.Image(shape=(source_size, source_size, 3),
                                       encoding_format="jpeg"),
          "label": tfds.features.ClassLabel(num_classes=10)}))

    def _split_generators(self, dl_manager):
      del dl_manager
      from sklearn.datasets import load_digits
      data = load_digits()
      return {"train": self._generate_examples(data)}

    def _generate_examples(self, data):
      import tensorflow as tf

      for i, (image, label) in enumerate(zip(data.images, data.target)):
        x = np.round(image * (255.0 / 16.0)).astype(np.uint8)[..., None]
        x = tf.image.resize(np.repeat(x, 3, -1), [source_size, source_size], "bilinear")
        yield i, {"image": np.asarray(tf.cast(tf.round(x), tf.uint8)), "label": int(label)}

  return DigitsJpeg


def _rate(take, batches: int, batch: int) -> float:
  t0 = time.perf_counter()
  take(batches)
  return batches * batch / (time.perf_counter() - t0)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--batch", type=int, default=64, help="images per batch (one process)")
  p.add_argument("--batches", type=int, default=24, help="timed batches per row")
  p.add_argument("--warmup", type=int, default=4, help="untimed batches first")
  p.add_argument("--k", type=int, default=4, help="steps per chunk_at (Grain rows)")
  p.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
  p.add_argument("--threads", type=int, nargs="+", default=[1, 4],
                 help="Grain read threads per worker (per process with 0 workers)")
  p.add_argument("--image-size", type=int, default=224)
  p.add_argument("--source-size", type=int, default=256, help="stored JPEG height and width")
  p.add_argument("--data-dir", default="", help="where to build the two datasets (default: tmp)")
  p.add_argument("--out", default="", help="write the results as JSON here")
  args = p.parse_args(argv)

  sys.path.insert(0, ROOT)
  from examples.resnet50 import input_pipeline

  data_dir = args.data_dir or tempfile.mkdtemp(prefix="loopkit-input-")
  builder_cls = _builder_class(args.source_size)
  builders = {}
  for fmt in ("tfrecord", "array_record"):
    t0 = time.perf_counter()
    builders[fmt] = builder_cls(data_dir=os.path.join(data_dir, fmt), file_format=fmt)
    builders[fmt].download_and_prepare()
    print(f"{fmt}: prepared in {time.perf_counter() - t0:.1f} s", flush=True)
  prep = input_pipeline.Preprocessing(image_size=args.image_size)
  rows = []

  tf_src = input_pipeline.TrainBatches(
      builders["tfrecord"], split="train", num_examples=1797, global_batch_size=args.batch,
      preprocessing=prep, seed=0, shuffle_buffer=2048, process_index=0, process_count=1)
  it = iter(tf_src)
  for _ in range(args.warmup):
    next(it)
  rate = _rate(lambda n: [next(it) for _ in range(n)], args.batches, args.batch)
  rows.append({"pipeline": "tf.data (AUTOTUNE threads)", "workers": None, "images_per_s": rate})
  print(f"{rows[-1]['pipeline']:<28} {rate:8.1f} images/s", flush=True)

  for workers, threads in [(w, t) for w in args.workers for t in args.threads]:
    src = input_pipeline.grain_train_source(
        builders["array_record"], split="train", global_batch_size=args.batch,
        preprocessing=prep, seed=0, worker_count=workers, read_threads=threads,
        process_index=0, process_count=1)
    step = 0

    def take(n, src=src):
      nonlocal step
      for _ in range(0, n, args.k):
        src.chunk_at(step, args.k)
        step += args.k

    t0 = time.perf_counter()
    take(args.warmup)
    start_s = time.perf_counter() - t0
    rate = _rate(take, args.batches, args.batch)
    src.close()
    rows.append({"pipeline": f"Grain, {workers} workers x {threads} threads",
                 "workers": workers, "threads": threads, "images_per_s": rate,
                 "warmup_s": start_s})
    print(f"{rows[-1]['pipeline']:<28} {rate:8.1f} images/s (warm-up {start_s:.1f} s)",
          flush=True)

  out = {"batch": args.batch, "batches": args.batches, "image_size": args.image_size,
         "source_size": args.source_size, "cpu_count": os.cpu_count(),
         "load_average": os.getloadavg(), "rows": rows}
  if args.out:
    with open(args.out, "w") as f:
      json.dump(out, f, indent=2)
  return out


if __name__ == "__main__":
  main()
