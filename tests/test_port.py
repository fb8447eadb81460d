"""The port guide's numbers (docs/migrating.md): a hand-written NNX script, ported, runs and
matches.

tests/nnx_handwritten_loop.py is loopkit's own NNX training script in the layout of Flax's
examples/mnist/train.py (an in-place step under nnx.jit, a per-epoch loop, metrics.compute /
reset, a row per epoch); tests/nnx_handwritten_ported.py is the same file on
loopkit.nnx.NnxTrainLoop. Both train on scikit-learn's digits, with tensorboardX's writer
replaced by a recorder.
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

HERE = Path(__file__).parent


def _changed_lines(a: str, b: str) -> list[str]:
  return [line for line in difflib.unified_diff(a.splitlines(), b.splitlines(), lineterm="", n=0)
          if line[:1] in "+-" and not line.startswith(("+++", "---"))]


def test_port_changes_six_lines_of_the_training_function():
  original, ported = (importlib.import_module(m) for m in ("nnx_handwritten_loop",
                                                           "nnx_handwritten_ported"))
  fn = _changed_lines(inspect.getsource(original.train_and_evaluate),
                      inspect.getsource(ported.train_and_evaluate))
  assert len(fn) == 6, fn  # docs/migrating.md: 4 lines added, 2 removed
  assert sum(line.startswith("+") for line in fn) == 4, fn
  whole = _changed_lines((HERE / "nnx_handwritten_loop.py").read_text(),
                         (HERE / "nnx_handwritten_ported.py").read_text())
  assert len(whole) == 8, whole  # and `import loopkit.nnx` with its blank line


class _Recorder:
  """tensorboardX.SummaryWriter's scalar interface, recording rows ``(step, {tag: value})``."""

  def __init__(self):
    self.rows = []

  def add_scalar(self, tag, value, step):
    if not self.rows or self.rows[-1][0] != step:
      self.rows.append((step, {}))
    self.rows[-1][1][tag] = value

  def close(self):
    pass


def _train(module_name, monkeypatch, tmp_path, **overrides):
  module = importlib.import_module(module_name)
  writers = []
  monkeypatch.setattr(module.tensorboardX, "SummaryWriter",
                      lambda workdir: writers.append(_Recorder()) or writers[-1])
  # The fields of Flax's MNIST config, plus the one line the port adds (iterations_per_loop),
  # plus this script's data fields.
  config = ml_collections.ConfigDict({
      "learning_rate": 0.1, "momentum": 0.9, "batch_size": 32, "num_epochs": 2,
      "iterations_per_loop": 3, "seed": 0, "num_train": 320, **overrides})
  module.train_and_evaluate(config, str(tmp_path))
  return writers[0].rows


def test_ported_script_runs_and_logs_what_the_original_logs(monkeypatch, tmp_path):
  want = _train("nnx_handwritten_loop", monkeypatch, tmp_path)
  got = _train("nnx_handwritten_ported", monkeypatch, tmp_path)
  assert [(s, sorted(r)) for s, r in got] == [(s, sorted(r)) for s, r in want]
  assert [s for s, _ in got] == [1, 2]  # a row per epoch, 4 scalars each
  assert sorted(got[0][1]) == ["test_accuracy", "test_loss", "train_accuracy", "train_loss"]
  # 8 devices (the default mesh) vs the original's one: allclose, not bitwise.
  for (_, g), (_, w) in zip(got, want):
    np.testing.assert_allclose([g[k] for k in sorted(g)], [w[k] for k in sorted(w)], rtol=1e-5)
  assert got[-1][1]["test_accuracy"] > 0.5  # it learns: 10 classes, chance is 0.1
  assert jax.device_count() == 8 and loopkit.data_parallel_mesh().size == 8


def test_ported_script_on_one_device_is_bitwise_the_original(monkeypatch, tmp_path):
  """On one device the port's rows and the original's are the same bits, for K = 1 and 3."""
  one = loopkit.data_parallel_mesh(devices=jax.devices()[:1])
  module = importlib.import_module("nnx_handwritten_ported")
  real = module.loopkit.nnx.NnxTrainLoop
  monkeypatch.setattr(module.loopkit.nnx, "NnxTrainLoop",
                      lambda *a, **kw: real(*a, mesh=one, **kw))
  want = _train("nnx_handwritten_loop", monkeypatch, tmp_path, num_epochs=1)
  for k in (1, 3):
    got = _train("nnx_handwritten_ported", monkeypatch, tmp_path, num_epochs=1,
                 iterations_per_loop=k)
    assert got == want, (k, got, want)


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
