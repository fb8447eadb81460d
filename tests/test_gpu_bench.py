"""benchmarks/gpu.py: the budget arithmetic, the ratios and the non-fatal paths (no model runs).

The script's measurements need an accelerator (or a 1-2 minute CPU smoke run,
``python benchmarks/gpu.py --tiny``); these tests check what it computes from
measured rows and that skipped and failed variants become rows of the report.
"""

import dataclasses
import os
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import gpu  # noqa: E402


def test_timed_steps_are_whole_calls_with_at_least_two_calls_for_k_above_one():
  plan = gpu.H200
  assert [gpu.timed_steps(plan, v) for v in ("per-step", "K=1", "K=26", "K=100", "limit")] == [
      100, 100, 104, 200, 200]
  assert gpu.chunk_bytes(plan, 100) == 100 * 256 * (224 * 224 * 3 + 4)


def test_expected_seconds_count_compile_steps_and_fill():
  plan = gpu.H200
  est = gpu.Estimates(setup_s=10.0, compile_s=30.0, step_s=0.05, mlp_s=20.0)
  assert est.expected_s(plan, "mlp") == 20.0
  assert est.expected_s(plan, "per-step") == pytest.approx(30.0 + 1.1 * 105 * 0.05)
  fill = 2 * gpu.chunk_bytes(plan, 100) / plan.host_bytes_per_s
  assert est.expected_s(plan, "K=100") == pytest.approx(30.0 + 1.1 * 205 * 0.05 + fill)
  # The limit reuses the K=100 program when a loopkit K=100 variant built it: no compile.
  assert est.expected_s(plan, "limit", frozenset({100})) == pytest.approx(
      1.1 * 205 * 0.05 + plan.est_limit_extra_s)
  assert est.timeout_s(plan, "limit", frozenset({100})) == plan.min_timeout_s
  assert est.timeout_s(plan, "K=100") == pytest.approx(2.5 * est.expected_s(plan, "K=100"))


def _row(variant, flag, steps, secs, calls, **kw):
  return {"variant": variant, "flag": flag, "status": "ok", "steps": steps, "secs": secs,
          "calls": calls, "cpu_s": 0.5 * calls, "warm_s": 9.0, "executables": 1,
          "system": variant, **kw}


def test_ratios_and_mfu_come_from_the_measured_rows():
  plan = dataclasses.replace(gpu.H200, batch=256)
  rows = [_row("per-step", "on", 100, 8.0, 100, compiled_flops=6.0e12),
          _row("K=100", "on", 200, 12.0, 2, steady_steps_per_s=17.5),
          _row("limit", "on", 200, 11.0, 2),
          _row("K=100", "off", 200, 20.0, 2),
          {"variant": "per-step", "flag": "off", "status": "failed: RuntimeError: boom"}]
  by = {(e["variant"], e["flag"]): e for e in gpu.summarize_resnet(rows, plan, 989e12)}
  k100 = by["K=100", "on"]
  assert k100["images_per_s"] == pytest.approx(200 * 256 / 12.0)
  assert k100["vs_per_step"] == pytest.approx((200 / 12.0) / (100 / 8.0))
  assert k100["vs_limit"] == pytest.approx(11.0 / 12.0)
  assert k100["mfu"] == pytest.approx(6.0e12 * (200 / 12.0) / 989e12)
  assert k100["steady_images_per_s"] == pytest.approx(17.5 * 256)
  assert k100["cpu_s_per_call"] == pytest.approx(0.5)
  # No per-step or limit row of the same flag setting: no ratio, not another flag's.
  assert by["K=100", "off"]["vs_per_step"] is None and by["K=100", "off"]["vs_limit"] is None
  assert by["per-step", "off"]["status"].startswith("failed")
  table = gpu.render_resnet(rows, plan, 989e12).splitlines()
  assert len(table) == 2 + 5 and all(line.count("|") == 15 for line in table)
  assert table[3].endswith("| failed: RuntimeError: boom |")  # per-step off, after on
  lines = gpu.resnet_headlines(rows, plan, 989e12)
  assert lines[0].startswith("- deterministic on: K=100 4,267 images/s = 1.33x per-step, "
                             "0.92x the limit, MFU 10.1%")


def test_the_smoke_plan_never_writes_the_accelerator_results():
  with pytest.raises(SystemExit):
    gpu.parse_args(["--tiny", "--out", "benchmarks/RESULTS_gpu.md"])
  assert gpu.parse_args(["--tiny", "--out", "x/RESULTS_gpu_cpu_smoke.md"]).config == "cpu_smoke"


def test_no_time_left_skips_every_variant_and_says_so():
  plan = dataclasses.replace(gpu.CPU_SMOKE, budget_s=1.0)
  res = gpu.run_all(plan, ["on", "off"], None)
  assert len(res["rows"]) == 12
  assert all(r["status"].startswith("skipped") for r in res["rows"])
  report = gpu.render_report(res, plan, {"date": "d", "command": "c", "versions": {},
                                         "machine": {"nproc": 1, "cpu": "x", "ram": "y",
                                                     "python": "3"}})
  assert "0 of 12 variants measured" in report


def test_a_worker_past_its_deadline_records_skips_not_failures():
  plan = gpu.CPU_SMOKE
  t0 = time.time()
  got = gpu.launch_worker(plan, "off", ["K=100", "mlp"], deadline=t0, hard_deadline=t0 + 120,
                          estimates=None)
  assert got.done and got.returncode == 0 and got.meta["platform"] == "cpu"
  assert [r["variant"] for r in got.rows] == ["K=100", "mlp"]
  assert all(r["status"].startswith("skipped") for r in got.rows)


def test_the_accelerator_plan_on_a_cpu_fails_its_variants_at_once():
  t0 = time.time()
  got = gpu.launch_worker(gpu.H200, "on", ["mlp", "per-step"], deadline=t0 + 100,
                          hard_deadline=t0 + 120, estimates=None)
  assert got.done and got.meta["platform"] == "cpu"
  assert gpu.DETERMINISTIC_FLAG in got.meta["xla_flags"].split()  # the "on" flag by default
  assert [r["status"] for r in got.rows] == [
      "failed: no accelerator: JAX sees only cpu devices (plan h200)"] * 2


def test_an_autotune_cache_flag_xla_rejects_is_dropped_and_noted(monkeypatch):
  # XLA aborts on an unknown flag before JAX is up; the parent retries without it.
  monkeypatch.setattr(gpu, "AUTOTUNE_CACHE_FLAG", "--xla_gpu_no_such_flag_for_this_test")
  res = gpu.run_all(gpu.H200, ["off"], ["mlp"], autotune_cache=True)
  assert [r["status"] for r in res["rows"]] == [
      "failed: no accelerator: JAX sees only cpu devices (plan h200)"]
  assert res["notes"] == ["XLA does not know --xla_gpu_no_such_flag_for_this_test: ran without "
                          "a shared autotuning cache"]


def test_mfu_counts_the_steps_jaxpr_before_xlas_gpu_cost_analysis():
  """XLA:GPU's cost analysis leaves cuDNN's convolutions out (105.8 GFLOP for a ResNet-50 step
  on the H200); the jaxpr count (7.23 TFLOP) is the one MFU uses when a row has it."""
  rows = [{"variant": "per-step", "status": "ok", "compiled_flops": 105.8e9},
          {"variant": "K=100", "status": "ok", "lowered_flops": None, "jaxpr_flops": 7.23e12}]
  flops, source = gpu.flops_per_step(rows)
  assert flops == 7.23e12 and "jaxpr" in source
  assert gpu.flops_per_step(rows[:1]) == (105.8e9, "compiled per-step executable's "
                                                   "`cost_analysis()`")


def test_steady_rate_runs_from_the_first_mark_to_the_one_before_the_last():
  """Marks come one call late; the last follows the one before it at once, so it is left out
  (the H200 run took it and reported 10,127 images/s above a 6,959 limit)."""
  clock = gpu.BoundaryClock.__new__(gpu.BoundaryClock)
  clock.marks = [(10.0, 26), (11.0, 52)]
  assert clock.steps_per_s() is None  # two marks: no interval that covers whole calls
  clock.marks = [(10.0, 26), (11.0, 52), (12.0, 78), (12.001, 104)]
  assert clock.steps_per_s() == pytest.approx(26.0)
