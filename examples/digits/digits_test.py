"""Tests of the digits example: the data pipeline, a short training run, K-invariance, main.

Runs with 8 fake CPU devices (the repository's root ``conftest.py``).
"""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from examples.digits import input_pipeline, train
from examples.digits.configs import default

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(**overrides):
  config = default.get_config()
  config.update(overrides)
  return config


def _rows(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


def test_splits_are_fixed_disjoint_and_stratified():
  train_a, test_a = input_pipeline.load_splits(test_size=360, split_seed=0)
  train_b, test_b = input_pipeline.load_splits(test_size=360, split_seed=0)
  assert (len(train_a), len(test_a)) == (1437, 360)
  np.testing.assert_array_equal(test_a.images, test_b.images)
  np.testing.assert_array_equal(test_a.labels, test_b.labels)
  # No test image appears in the training split.
  train_rows = {row.tobytes() for row in train_a.images}
  assert not any(row.tobytes() in train_rows for row in test_a.images)
  # Stratified: 36 test examples of every digit (+-1).
  counts = np.bincount(test_a.labels, minlength=10)
  assert counts.min() >= 35 and counts.max() <= 37, counts
  assert test_a.images.dtype == np.float32 and test_a.labels.dtype == np.int32
  assert 0.0 <= test_a.images.min() and test_a.images.max() == 1.0


def test_batches_are_a_function_of_seed_and_step():
  train_split, _ = input_pipeline.load_splits(test_size=360, split_seed=0)
  batches = input_pipeline.TrainBatches(train_split, batch_size=64, seed=3)
  again = input_pipeline.TrainBatches(train_split, batch_size=64, seed=3)
  assert batches.steps_per_epoch == 22  # 1437 // 64, remainder dropped
  for step in (0, 21, 22, 500):
    b = batches.batch_at(step)
    assert b["image"].shape == (64, 64) and b["label"].shape == (64,)
    np.testing.assert_array_equal(b["image"], again.batch_at(step)["image"])
  # One epoch visits 22 * 64 distinct examples; the next epoch is reshuffled.
  epoch0 = np.concatenate([batches.permutation(0)[:22 * 64]])
  assert len(np.unique(epoch0)) == 22 * 64
  assert not np.array_equal(batches.permutation(0), batches.permutation(1))
  assert not np.array_equal(batches.batch_at(0)["label"], batches.batch_at(22)["label"])


def test_short_training_learns_and_reports_exact_steps(tmp_path):
  config = _config(num_epochs=3, eval_every_epochs=1)
  results = train.train_and_evaluate(config, str(tmp_path))
  state = results.pop("state")
  # 3 epochs of 22 steps, cut by K=20 at every epoch end: calls of 20 and 2 steps.
  assert results["step"] == results["ledger_step"] == 66
  assert results["device_calls"] == 6
  assert results["compile_count"] == 1
  assert results["num_devices"] == 8
  assert results["status"] == "completed"
  adam_state = state.opt_state[0]
  assert int(adam_state.count) == 66  # optimizer count == ledger step == state step
  # Exact accuracy over all 360 held-out digits; chance is 0.1.
  assert results["test_count"] == 360
  assert results["test_accuracy"] == results["test_correct"] / 360
  assert results["test_accuracy"] > 0.85
  rows = _rows(tmp_path / "metrics.jsonl")
  train_rows = [r for r in rows if "loss" in r]
  test_rows = [r for r in rows if "test/accuracy" in r]
  assert [r["step"] for r in train_rows] == [22, 44, 66]
  assert [r["examples_seen"] for r in train_rows] == [22 * 64, 44 * 64, 66 * 64]
  assert [r["epoch"] for r in train_rows] == [0, 1, 2]
  assert [r["step"] for r in test_rows] == [22, 44, 66]
  assert [r["test/num_examples"] for r in test_rows] == [360, 360, 360]
  assert train_rows[-1]["loss"] < train_rows[0]["loss"]
  assert test_rows[-1]["test/accuracy"] == results["test_accuracy"]
  assert results["eval_compile_count"] == 1
  with open(tmp_path / "results.json") as f:
    assert json.load(f)["test_correct"] == results["test_correct"]

  # Same seed with K = 7 (calls 7,7,7,1 per epoch): bitwise the same parameters, since dropout
  # keys come from (seed, step) and the batches from (seed, step), not from how calls are cut.
  other = train.train_and_evaluate(_config(num_epochs=3, eval_every_epochs=3,
                                           iterations_per_loop=7), str(tmp_path / "k7"))
  assert (other["step"], other["device_calls"], other["compile_count"]) == (66, 12, 1)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params),
               jax.device_get(other["state"].params))
  assert other["test_correct"] == results["test_correct"]


def test_main_prints_where_results_went(tmp_path):
  workdir = tmp_path / "wd"
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # main.py sets 8 fake devices itself
  proc = subprocess.run(
      [sys.executable, "-m", "examples.digits.main", f"--workdir={workdir}",
       "--config.num_epochs=1", "--config.hidden_sizes=(32,)"],
      cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f"metrics (JSON lines): {workdir}/metrics.jsonl" in proc.stdout
  assert f"summary (JSON):       {workdir}/results.json" in proc.stdout
  with open(workdir / "results.json") as f:
    results = json.load(f)
  assert (results["step"], results["device_calls"], results["num_devices"]) == (22, 2, 8)


@pytest.mark.slow(held_by="examples/digits/digits_test.py::test_short_training_learns_and_reports_exact_steps",
                  reason="660 steps to the accuracy the README states")
def test_default_config_reaches_97_percent(tmp_path):
  results = train.train_and_evaluate(_config(), str(tmp_path))
  assert results["step"] == 660
  assert results["test_accuracy"] >= 0.97, results["test_correct"]


def test_readme_usage_snippet_runs(tmp_path):
  """The top-level README's usage snippet stays true to the code (its asserts run here)."""
  import re

  with open(os.path.join(REPO_ROOT, "README.md")) as f:
    readme = f.read()
  code = re.search(r"## Usage\n\n```python\n(.*?)```", readme, re.S).group(1)
  exec(compile(code.replace("/tmp/loopkit-usage", str(tmp_path)), "README.md", "exec"), {})
  assert [r["step"] for r in _rows(tmp_path / "metrics.jsonl")] == [25, 50, 75, 100]
