"""loopkit prints by default in a plain script, once, on process 0 only (loopkit.logs)."""

import logging
import os
import re
import subprocess
import sys

import pytest

from loopkit import logs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_usage_snippet() -> str:
  text = open(os.path.join(ROOT, "README.md")).read()
  usage = text[text.index("## Usage"):]
  return re.search(r"```python\n(.*?)```", usage, re.S).group(1)


def run_script(code: str, tmp_path) -> subprocess.CompletedProcess:
  path = tmp_path / "script.py"
  path.write_text(code)
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
  env["JAX_PLATFORMS"] = "cpu"
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, env=env,
                        cwd=str(tmp_path), timeout=300, check=True)


def test_the_readme_snippet_prints_its_metrics_as_a_plain_script(tmp_path):
  out = run_script(readme_usage_snippet().replace("/tmp/loopkit-usage", str(tmp_path)), tmp_path)
  lines = [line for line in out.stderr.splitlines() if line.startswith("step ")]
  assert [line.split(":")[0] for line in lines] == ["step 25", "step 50", "step 75", "step 100"]
  assert re.match(r"step 25: loss=[0-9.e+-]+, epoch=0, examples_seen=1600$", lines[0]), lines[0]


@pytest.mark.parametrize("level,expected", [("WARNING", 0), ("INFO", 4)])
def test_a_script_that_configured_logging_gets_its_own_format_once(tmp_path, level, expected):
  code = (f"import logging\nlogging.basicConfig(level=logging.{level}, format='APP %(message)s')\n"
          + readme_usage_snippet().replace("/tmp/loopkit-usage", str(tmp_path)))
  out = run_script(code, tmp_path)
  lines = [line for line in out.stderr.splitlines() if "step " in line and "loss=" in line]
  assert len(lines) == expected and all(line.startswith("APP step ") for line in lines)


def test_only_process_zero_prints_info(monkeypatch, capsys):
  logger = logging.getLogger("test_logs_child")
  handler = logs._DefaultHandler()
  record = logger.makeRecord("loopkit", logging.INFO, __file__, 1, "step %d: x=1", (3,), None)
  warning = logger.makeRecord("loopkit", logging.WARNING, __file__, 1, "careful", (), None)
  monkeypatch.setattr(logging.getLogger(), "handlers", [])  # as in a plain script
  for index, shown in ((0, "step 3: x=1\nloopkit WARNING: careful\n"),
                       (1, "loopkit WARNING: careful\n")):
    monkeypatch.setattr(logs, "_process_index", lambda index=index: index)
    handler.emit(record)
    handler.emit(warning)
    assert capsys.readouterr().err == shown
