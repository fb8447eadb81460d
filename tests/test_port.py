"""The port guide's numbers (docs/migrating.md): Flax's NNX MNIST script, ported, runs and matches.

tests/nnx_mnist_original.py is Flax's examples/mnist/train.py; tests/nnx_mnist_ported.py is the
same file on loopkit.nnx.NnxTrainLoop. Both train on the same small synthetic tf.data set here,
with Flax's SummaryWriter replaced by a recorder.
"""

import difflib
import importlib
import inspect
from pathlib import Path

import jax
import ml_collections
import numpy as np
import pytest

import loopkit

pytestmark = pytest.mark.tf
tf = pytest.importorskip("tensorflow")  # collection imports this module even where deselected
HERE = Path(__file__).parent


def _changed_lines(a: str, b: str) -> list[str]:
  return [line for line in difflib.unified_diff(a.splitlines(), b.splitlines(), lineterm="", n=0)
          if line[:1] in "+-" and not line.startswith(("+++", "---"))]


def test_port_changes_six_lines_of_the_training_function():
  original, ported = (importlib.import_module(m) for m in ("nnx_mnist_original",
                                                           "nnx_mnist_ported"))
  fn = _changed_lines(inspect.getsource(original.train_and_evaluate),
                      inspect.getsource(ported.train_and_evaluate))
  assert len(fn) == 6, fn  # docs/migrating.md: 4 lines added, 2 removed
  whole = _changed_lines((HERE / "nnx_mnist_original.py").read_text(),
                         (HERE / "nnx_mnist_ported.py").read_text())
  assert len(whole) == 8, whole  # and `import loopkit.nnx` with its blank line


class _Recorder:
  def __init__(self, workdir):
    self.scalars = []

  def hparams(self, hparams):
    pass

  def scalar(self, tag, value, step):
    self.scalars.append((tag, float(value), step))

  def flush(self):
    pass


def _datasets(config):
  rng = np.random.default_rng(0)
  def ds(n):
    return tf.data.Dataset.from_tensor_slices({
        "image": rng.uniform(size=(n, 28, 28, 1)).astype(np.float32),
        "label": rng.integers(0, 10, size=(n,)).astype(np.int64)})
  return (ds(40).batch(config.batch_size, drop_remainder=True),
          ds(16).batch(config.batch_size, drop_remainder=True))


def _train(module_name, monkeypatch, tmp_path):
  module = importlib.import_module(module_name)
  writers = []
  monkeypatch.setattr(module.tensorboard, "SummaryWriter",
                      lambda d: writers.append(_Recorder(d)) or writers[-1])
  monkeypatch.setattr(module, "get_datasets", _datasets)
  config = ml_collections.ConfigDict(dict(learning_rate=0.1, momentum=0.9, batch_size=8,
                                          num_epochs=2, iterations_per_loop=3))
  module.train_and_evaluate(config, str(tmp_path))
  return writers[0].scalars


def test_ported_script_runs_and_logs_what_the_original_logs(monkeypatch, tmp_path):
  want = _train("nnx_mnist_original", monkeypatch, tmp_path)
  got = _train("nnx_mnist_ported", monkeypatch, tmp_path)
  assert [(t, s) for t, _, s in got] == [(t, s) for t, _, s in want]
  assert len(got) == 8  # 4 tags x 2 epochs
  # 8 devices (the default mesh) vs the original's one: allclose, not bitwise.
  np.testing.assert_allclose([v for _, v, _ in got], [v for _, v, _ in want], rtol=1e-5)
  assert jax.device_count() == 8 and loopkit.data_parallel_mesh().size == 8


def test_unbound_axis_name_gets_a_data_axis_hint():
  import toy
  loop = loopkit.TrainLoop(toy.make_per_device_step(axis="batch"), iterations_per_loop=2,
                           step_style="per_device")
  with pytest.raises(NameError, match=r"unbound axis name: batch(.|\n)*data axis is 'data'"
                                      r"(.|\n)*data_axis="):
    loop.run(toy.init_state(), toy.batches(2), num_steps=2)
  # With the axis named, Flax's pmap-style step runs unchanged.
  loop = loopkit.TrainLoop(toy.make_per_device_step(axis="batch"), iterations_per_loop=2,
                           step_style="per_device", data_axis="batch")
  assert int(loop.run(toy.init_state(), toy.batches(2), num_steps=2)["step"]) == 2


def test_replicated_state_gets_a_hint():
  import toy
  replicated = jax.tree.map(lambda x: np.stack([x] * jax.local_device_count()),
                            toy.init_state())  # what flax.jax_utils.replicate makes
  loop = loopkit.TrainLoop(toy.make_per_device_step(), iterations_per_loop=2,
                           step_style="per_device")
  with pytest.raises(ValueError, match=r"got shape \(8,\).*replicated for pmap.*unreplicate"):
    loop.run(replicated, toy.batches(2), num_steps=2)
