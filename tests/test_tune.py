"""K tuner: a tiny sweep measures every K, recommends the smallest within 2% of the best,
writes a PNG; the command line works on the built-in demo and on a module:function."""

import logging

import jax.numpy as jnp
import numpy as np
import pytest

import loopkit
from loopkit.tools import tune
from tests import toy


def small_target():
  """A user target for the CLI test: the toy linear model (batch 16: x [16,4], y [16,2])."""
  return toy.make_global_step(), toy.init_state(), lambda: toy.batches(64)


def row(k, sps):
  return tune.TuneRow(k, sps, 0.5, 0.1, 0, 0.0)


def test_recommend_smallest_within_tolerance():
  rows = [row(1, 50.0), row(2, 97.9), row(4, 98.0), row(8, 100.0), row(16, 99.0)]
  assert tune.recommend(rows) == 4  # 98.0 >= 0.98 * 100; 97.9 is not
  assert tune.recommend(rows, tolerance=0.0) == 8
  assert tune.recommend(rows, tolerance=0.5) == 1
  with pytest.raises(ValueError, match="at least one row"):
    tune.recommend([])
  with pytest.raises(ValueError, match="tolerance"):
    tune.recommend(rows, tolerance=1.0)


def test_tiny_sweep(tmp_path):
  png = tmp_path / "k.png"
  target = tune.demo_target(batch_size=8, dim=4, hidden=8)
  result = tune.sweep(target, ks=(1, 2, 4), calls=2, plot_path=str(png))
  assert [r.iterations_per_loop for r in result.rows] == [1, 2, 4]
  # x [8, 4] + y [8, 1] float32 = 160 bytes per batch, K batches per call.
  assert [r.input_bytes_per_call for r in result.rows] == [160, 320, 640]
  for r in result.rows:
    assert r.steps_per_sec > 0 and r.secs_per_call > 0
    assert 0.0 <= r.host_overhead <= 1.0
    assert r.compile_secs > 0
  assert result.recommended == tune.recommend(result.rows)
  table = result.table().splitlines()
  assert table[0] == ("| K | steps/s | spread | s/call | host overhead | compile s | "
                      "input bytes/call |")
  assert len(table) == 2 + 3 + 2 + result.at_largest
  assert table[6].startswith(f"recommended iterations_per_loop = {result.recommended} ")
  assert all(r.repeat_steps_per_sec == () for r in result.rows)  # one repeat: no spread
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_measure_runs_at_least_the_asked_calls():
  step, state, batches = small_target()
  r = tune.measure(step, state, batches, iterations_per_loop=3, calls=4, warmup_calls=2)
  assert r.iterations_per_loop == 3
  assert r.input_bytes_per_call == 3 * (16 * 4 * 4 + 16 * 2 * 4)
  with pytest.raises(ValueError, match="ran out"):
    tune.measure(step, state, lambda: toy.batches(5), iterations_per_loop=3, calls=4)
  with pytest.raises(ValueError, match="re-iterable"):
    tune.sweep((step, state, iter(toy.batches(64))), ks=(1,))


def test_cli_on_a_user_target(tmp_path, capsys):
  png = tmp_path / "cli.png"
  result = tune.main(["tests.test_tune:small_target", "--ks", "1,2", "--calls", "2",
                      "--min-secs", "0", "--plot", str(png)])
  out = capsys.readouterr().out
  assert "target tests.test_tune:small_target on 8 cpu device(s)" in out
  assert "| K | steps/s | spread | s/call | host overhead | compile s | input bytes/call |" in out
  assert f"recommended iterations_per_loop = {result.recommended} " in out
  assert png.exists()


def test_cli_default_target_out_of_the_box(tmp_path, capsys):
  png = tmp_path / "demo.png"
  tune.main(["--ks", "1,4", "--calls", "1", "--min-secs", "0", "--plot", str(png)])
  out = capsys.readouterr().out
  assert "target loopkit.tools.tune:demo_target" in out
  assert png.exists()


def test_cli_bad_arguments():
  with pytest.raises(SystemExit, match="module:function"):
    tune.main(["nocolon", "--plot", ""])
  with pytest.raises(SystemExit, match="comma-separated integers"):
    tune.main(["--ks", "1,x", "--plot", ""])


def test_exported():
  assert loopkit.tools.tune is tune


def test_sweep_checks_a_sized_source_before_measuring_anything():
  calls = []

  def step(state, batch):
    calls.append(1)  # traced only if a K were measured
    return {"step": state["step"] + 1}, {"loss": jnp.mean(batch["x"])}

  state = {"step": jnp.zeros((), jnp.int32)}
  batches = [{"x": np.zeros((8, 1), np.float32)}] * 20
  with pytest.raises(ValueError, match=r"sweep needs at least 64 batches \(\(warmup_calls=1 \+ "
                     r"calls=3\) x the largest K=16\); the source has 20"):
    loopkit.tools.tune.sweep((step, state, batches), ks=(1, 4, 16))
  assert calls == []


def test_sweep_shows_the_spread_and_warns_when_the_largest_k_wins(monkeypatch, caplog):
  """Fake measurements: K=4 is fastest in both repeats, so the sweep may have ended early."""
  sps = {(1, 0): 100.0, (2, 0): 190.0, (4, 0): 300.0,
         (1, 1): 80.0, (2, 1): 200.0, (4, 1): 270.0}
  calls = iter([(k, rep) for rep in (0, 1) for k in (1, 2, 4)])

  def fake_measure(train_step, init_state, batches, *, iterations_per_loop, **kw):
    k, rep = next(calls)
    assert k == iterations_per_loop
    return tune.TuneRow(k, sps[k, rep], 0.5, 1.0, 10 * k, k / sps[k, rep])

  monkeypatch.setattr(tune, "measure", fake_measure)
  step, state, batches = small_target()
  with caplog.at_level(logging.WARNING, logger="loopkit"):
    result = tune.sweep((step, state, batches), ks=(1, 2, 4), repeats=2)
  assert [r.steps_per_sec for r in result.rows] == [100.0, 200.0, 300.0]
  assert [r.repeat_steps_per_sec for r in result.rows] == [(100.0, 80.0), (190.0, 200.0),
                                                           (300.0, 270.0)]
  assert [round(r.spread, 6) for r in result.rows] == [0.2, 0.05, 0.1]
  assert result.recommended == 4 and result.at_largest
  table = result.table().splitlines()
  assert table[2] == "| 1 | 100 | 20.0% | 0.01 | 0.50 | 1.00 | 10 |"
  assert table[4] == "| 4 * | 300 | 10.0% | 0.01333 | 0.50 | 1.00 | 40 |"
  assert table[-1] == ("warning: K=4 is the largest K tried; throughput may still grow with K "
                       "(try larger values, e.g. --ks ...,8,16)")
  assert caplog.messages == [table[-1]]


def test_no_warning_when_a_smaller_k_is_within_tolerance():
  rows = [tune.TuneRow(k, s, 0.0, 0.0, 0, 0.0) for k, s in [(1, 50.), (2, 99.), (4, 100.)]]
  result = tune.TuneResult(rows=rows, recommended=tune.recommend(rows), tolerance=0.02)
  assert result.recommended == 2 and not result.at_largest and result.warning() is None
  assert "warning" not in result.table()
