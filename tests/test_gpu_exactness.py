"""benchmarks/gpu_exactness.py: where an HLO module's while loops are, and the verdicts drawn from
the workers' digests (no model runs: the script's measurements need a GPU, or its --tiny run)."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import gpu_exactness as ge  # noqa: E402

# The shape of XLA's optimized HLO text, cut down: a step loop in the entry computation, and the
# same loop moved into a command-buffer computation (what +WHILE would do).
HOST_LOOP = """HloModule jit__loop, is_scheduled=true

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]) parameter(0)
  ROOT %t = (s32[], f32[4]) tuple(%a, %b)
}

%cond (p.1: (s32[], f32[4])) -> pred[] {
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main.9 (Arg_0.1: f32[4], Arg_1.2: s32[]) -> f32[4] {
  %while.5 = (s32[], f32[4]) while(%tuple.3), condition=%cond, body=%body
  ROOT %gte = f32[4] get-tuple-element(%while.5), index=1
}
"""
CAPTURED = HOST_LOOP.replace(
    "ENTRY %main.9 (Arg_0.1: f32[4], Arg_1.2: s32[]) -> f32[4] {\n"
    "  %while.5 = (s32[], f32[4]) while(%tuple.3), condition=%cond, body=%body\n",
    "%command_buffer (p.2: (s32[], f32[4])) -> (s32[], f32[4]) {\n"
    "  ROOT %while.5 = (s32[], f32[4]) while(%p.2), condition=%cond, body=%body\n"
    "}\n\n"
    "ENTRY %main.9 (Arg_0.1: f32[4], Arg_1.2: s32[]) -> f32[4] {\n"
    "  %call = (s32[], f32[4]) call(%tuple.3), to_apply=%command_buffer\n")


def test_graph_summary_tells_a_host_loop_from_a_captured_one():
  assert ge.graph_summary(HOST_LOOP) == {
      "command_buffer_computations": 0, "whiles_in_command_buffers": 0, "whiles_elsewhere": 1,
      "entry_whiles": 1, "step_loop_in_command_buffer": False}
  assert ge.graph_summary(CAPTURED) == {
      "command_buffer_computations": 1, "whiles_in_command_buffers": 1, "whiles_elsewhere": 0,
      "entry_whiles": 0, "step_loop_in_command_buffer": True}


def _rows(setting, digests):
  return [{"setting": setting, "model": "resnet", "run": i, "k": k, "digest": d,
           "leaves_differ_from_run0": int(d != digests[0]),
           "max_abs_diff_from_run0": 0.0 if d == digests[0] else 3e-9}
          for i, (k, d) in enumerate(zip(ge.RUN_KS, digests))]


def test_verdicts_need_all_four_runs_equal_and_compare_processes():
  results = [{"setting": "default", "rows": _rows("default", ["a", "b", "c", "d"])},
             {"setting": "deterministic", "rows": _rows("deterministic", ["e"] * 4)},
             {"setting": "deterministic-2", "rows": _rows("deterministic-2", ["e"] * 3)}]
  v = {r["setting"]: r for r in ge.verdicts(results)}
  assert v["default"]["k_invariant"] is False and v["default"]["k1_twice_equal"] is False
  assert v["default"]["leaves_differ"] == 1 and v["default"]["max_abs_diff"] == 3e-9
  assert v["deterministic"]["k_invariant"] is True and v["deterministic"]["k1_twice_equal"]
  # A worker cut off after 3 runs proves nothing either way about the fourth.
  assert v["deterministic-2"]["k_invariant"] is None
  assert v["deterministic-2"]["k1_twice_equal"] is None
  assert ge.across(results, "deterministic", "deterministic-2") == {"lm": None, "resnet": True}
  assert ge.across(results, "default", "deterministic") == {"lm": None, "resnet": False}
