"""Builds the docs with Sphinx, warnings as errors, and checks the pages it must produce.

Usage: ``python .ci/docs.py [OUTDIR]`` (default: a new temporary directory), with the ``docs``
extra installed. .ci/run's docs step and ``nox -s docs`` run it. It runs
``sphinx -W -q -E -b html docs OUTDIR`` with the environment of the tests (8 fake CPU devices,
``JAX_PLATFORMS=cpu``, as the root conftest.py sets them: autodoc imports loopkit), then checks that
every page of the site was written and that the API page documents the main classes and functions.
Exits non-zero, saying what is wrong, if the build fails or a check does not hold.
"""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGES = ["index", "concepts", "getting_started", "tuning", "observability", "checkpointing",
         "data", "multihost", "aot", "migrating", "resnet50", "api"]
API_NAMES = ["TrainLoop", "CheckpointHook", "Evaluator", "run_processes", "plan_calls"]


def problems(html: Path) -> list[str]:
  """What is missing from a built site in ``html``: pages, then names on the API page."""
  out = [f"{page}.html was not written" for page in PAGES if not (html / f"{page}.html").exists()]
  if (html / "api.html").exists():
    api = (html / "api.html").read_text()
    out += [f"api.html does not mention {name}" for name in API_NAMES if name not in api]
  return out


def main(argv: list[str]) -> int:
  html = Path(argv[0]) if argv else Path(tempfile.mkdtemp(prefix="loopkit-docs-")) / "html"
  env = dict(os.environ)
  flag = "--xla_force_host_platform_device_count=8"
  if flag not in env.get("XLA_FLAGS", ""):
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flag).strip()
  env.setdefault("JAX_PLATFORMS", "cpu")
  cmd = [sys.executable, "-m", "sphinx", "-W", "-q", "-E", "-b", "html", str(REPO / "docs"),
         str(html)]
  r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
  if r.returncode != 0:
    print(r.stdout[-3000:] + r.stderr[-3000:], end="")
    print(f".ci/docs.py: sphinx exited {r.returncode}: {' '.join(cmd[1:])}")
    return 1
  found = problems(html)
  for p in found:
    print(f".ci/docs.py: {p}")
  if found:
    return 1
  print(f".ci/docs.py: docs built with -W into {html}: {len(PAGES)} pages, API page checked")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
