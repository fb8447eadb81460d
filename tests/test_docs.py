"""The documentation site builds with Sphinx, warnings as errors (what `nox -s docs` runs)."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_docs_build_without_warnings(tmp_path):
  pytest.importorskip("sphinx")
  pytest.importorskip("myst_parser")
  out = subprocess.run(
      [sys.executable, "-m", "sphinx", "-W", "-q", "-E", "-b", "html",
       os.path.join(REPO, "docs"), str(tmp_path / "html")],
      capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  for page in ["index", "concepts", "getting_started", "tuning", "observability",
               "checkpointing", "data", "multihost", "migrating", "resnet50", "api"]:
    assert (tmp_path / "html" / f"{page}.html").exists(), page
  api = (tmp_path / "html" / "api.html").read_text()
  for name in ["TrainLoop", "CheckpointHook", "Evaluator", "run_processes", "plan_calls"]:
    assert name in api, name
