"""The package type-checks: mypy (strict optional, its default) reports no error in loopkit/.

Installed by the ``test`` extra (Python 3.11 CI environment); skipped where mypy is
absent (the newest-JAX environment). Options live in pyproject.toml's ``[tool.mypy]``.
"""

import os
import subprocess
import sys

import pytest

pytest.importorskip("mypy")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_mypy_reports_no_error_in_the_package():
  r = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental"], cwd=REPO,
                     capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
  assert "Success: no issues found" in r.stdout
