"""benchmarks/runner.py, the core both benchmark runners share: interleaved rounds, the worker
environment, and the CPU line-up as data (the systems it builds are the rows the committed
results.json measured, in the same order)."""

import json
import os

import pytest

from benchmarks import run, runner, systems, workloads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _measured_names(workload, devices):
  with open(os.path.join(ROOT, "benchmarks", "results.json")) as f:
    saved = json.load(f)
  return [r["system"] for res in saved["results"] for r in res["rows"]
          if (r["workload"], r["devices"]) == (workload, devices)]


@pytest.mark.parametrize("name,devices", [("mlp", 1), ("mlp", 8), ("cnn", 1), ("cnn", 8)])
def test_the_lineup_builds_the_measured_systems_in_their_order(name, devices):
  w = workloads.get(name, 4)
  measured = _measured_names(name, devices)
  assert measured[-1] == "Keras spe=100"  # built where KERAS_BACKEND=jax is set before Keras
  assert run.LINEUP[-1] == runner.entry("KerasFit", optional="Keras")
  built = systems.build(run.LINEUP, w, workloads.make_data(w), leave_out=("KerasFit",),
                        devices=devices)
  assert [s.name for s in built] == measured[:-1]


def test_a_lineup_entry_without_a_system_class_is_named():
  w = workloads.get("mlp", 4)
  with pytest.raises(ValueError, match="'Nope' is no system"):
    systems.build((runner.entry("Nope", k=1),), w, workloads.make_data(w))


class _Fake:
  def __init__(self, name, secs, order):
    self.name, self.secs, self.order = name, secs, order

  def timed(self):
    self.order.append(self.name)
    return self.secs.pop(0)


def test_rounds_interleave_reverse_and_keep_each_rounds_best_run():
  order = []
  a = _Fake("a", [0.3, 0.2, 0.4, 0.1], order)
  b = _Fake("b", [1.0, 2.0], order)
  got = runner.time_interleaved([a, b], repeats=2, min_round_secs=0.45, compiles=lambda: 7,
                                num_steps=10)
  # a repeats its run until 0.45 s are spent; b's one run is longer; round 2 runs b first.
  assert order == ["a", "a", "b", "b", "a", "a"]
  assert got["a"]["times"] == [0.3, 0.2, 0.4, 0.1] and got["a"]["round_times"] == [0.2, 0.1]
  assert got["b"]["round_times"] == [1.0, 2.0] and got["b"]["timed_compiles"] == 0
  assert len(got["a"]["cpu"]) == 4 and got["a"]["peak_rss_mb"] > 0


def test_worker_env_replaces_the_dropped_xla_flags(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_keep=1")
  monkeypatch.setenv("PYTHONPATH", "/elsewhere")
  monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
  env = runner.worker_env(drop_xla=["xla_force_host_platform_device_count"],
                          add_xla=["--xla_force_host_platform_device_count=1"],
                          set_env={"JAX_PLATFORMS": "cpu"},
                          default_env={"TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": "x"})
  assert env["XLA_FLAGS"] == "--xla_keep=1 --xla_force_host_platform_device_count=1"
  assert env["JAX_PLATFORMS"] == "cpu" and env["TF_CPP_MIN_LOG_LEVEL"] == "3"
  assert env["PYTHONPATH"] == ROOT + os.pathsep + "/elsewhere"
  assert runner.parse("RESULT " + json.dumps({"x": 1}), "RESULT ") == {"x": 1}
  assert runner.parse("other", "RESULT ") is None
