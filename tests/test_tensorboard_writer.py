"""TensorBoardWriter (loopkit.observe.tensorboard_writer): scalars, images, histograms, texts and
hparams read back with TensorBoard's reader; writing does not import TensorFlow. Every writer
against the others: tests/test_writers.py."""

import os
import subprocess

import jax.numpy as jnp
import numpy as np
import pytest

# TensorBoard's reader uses TensorFlow when it is installed (see tests/test_writers.py).
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import loopkit
from tests import bootstrap
from tests.test_writers import read_tb


def test_tensorboard_writer_round_trip(tmp_path):
  w = loopkit.observe.TensorBoardWriter(tmp_path)
  w.write_scalars(3, {"loss": np.float32(0.1234567), "acc": 0.5})
  w.write_scalars(7, {"loss": jnp.float32(2.5)})
  w.close()
  got = read_tb(tmp_path)
  assert got["loss"] == [(3, float(np.float32(0.1234567))), (7, 2.5)]
  assert got["acc"] == [(3, 0.5)]


def test_tensorboard_writer_does_not_import_tensorflow(tmp_path):
  code = ("import sys, loopkit\n"
          f"w = loopkit.observe.create_default_writer({str(tmp_path)!r}, console=False)\n"
          "w.write_scalars(1, {'a': 1.0}); w.close()\n"
          "assert 'tensorflow' not in sys.modules, 'tensorflow was imported'\n"
          "print('ok')\n")
  out = subprocess.run(bootstrap.command("-c", code, devices=8), capture_output=True, text=True,
                       env=bootstrap.env(), timeout=120)
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == "ok"
  assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path))


def read_tb_all(logdir):
  acc = EventAccumulator(str(logdir), size_guidance={"images": 0, "histograms": 0, "tensors": 0,
                                                     "scalars": 0})
  acc.Reload()
  return acc


def test_tensorboard_writer_images_histograms_texts_hparams_round_trip(tmp_path):
  import io

  from PIL import Image
  from tensorboard.plugins.hparams import plugin_data_pb2
  img = np.arange(4 * 5 * 3, dtype=np.uint8).reshape(4, 5, 3)
  gray = (np.arange(2 * 4 * 5) % 5 / 4).reshape(2, 4, 5, 1)  # two float images in [0, 1]
  w = loopkit.observe.TensorBoardWriter(tmp_path)
  w.write_hparams({"lr": 0.1, "opt": "adam", "batch_size": np.int64(32), "layers": (1, 2)})
  w.write_images(3, {"img": img, "gray": jnp.asarray(gray)})
  w.write_histograms(4, {"w": np.arange(1000.0)}, num_buckets={"w": 10})
  w.write_histograms(4, {"v": jnp.arange(10.0)})
  w.write_texts(5, {"note": "hello **world**"})
  w.write_scalars(5, {"tag": "a string scalar"})
  with pytest.raises(ValueError, match=r"image 'bad' must be .* got shape \(4, 5\)"):
    w.write_images(6, {"bad": np.zeros((4, 5))})
  w.close()
  acc = read_tb_all(tmp_path)

  e = acc.Images("img")[0]
  assert (e.step, e.width, e.height) == (3, 5, 4)
  np.testing.assert_array_equal(np.asarray(Image.open(io.BytesIO(e.encoded_image_string))), img)
  e = acc.Images("gray")[0]  # N images tiled side by side
  assert (e.step, e.width, e.height) == (3, 10, 4)
  tiles = np.asarray(Image.open(io.BytesIO(e.encoded_image_string)).convert("L"))
  expected = np.floor(gray[0, ..., 0] * 255).astype(np.uint8)  # 0, 63, 127, 191, 255
  np.testing.assert_array_equal(tiles[:, :5], expected)

  h = acc.Histograms("w")[0]
  hv = h.histogram_value
  assert (h.step, hv.num, hv.sum, hv.min, hv.max) == (4, 1000, 499500.0, 0.0, 999.0)
  assert [c for c in hv.bucket if c] == [100.0] * 10
  hv = acc.Histograms("v")[0].histogram_value
  assert (hv.num, hv.sum, sum(hv.bucket)) == (10, 45.0, 10.0)

  assert [(t.step, t.tensor_proto.string_val) for t in acc.Tensors("note")] == [
      (5, [b"hello **world**"])]
  assert acc.Tensors("tag")[0].tensor_proto.string_val == [b"a string scalar"]

  content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
  hp = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
  assert hp["lr"].number_value == 0.1
  assert hp["opt"].string_value == "adam"
  assert hp["batch_size"].number_value == 32
  assert hp["layers"].string_value == "(1, 2)"


def test_event_files_opened_within_a_second_are_read_in_the_order_written(tmp_path):
  """Twelve writers in a row, one event file each, within about a second: TensorBoard reads a
  directory's files in name order, so the 10th file must sort after the 9th (before, the
  counter in the name was not padded and "...10" sorted before "...2")."""
  for i in range(12):
    w = loopkit.observe.TensorBoardWriter(tmp_path)
    w.write_scalars(i, {"a": float(i)})
    w.close()
  assert read_tb(tmp_path)["a"] == [(i, float(i)) for i in range(12)]
