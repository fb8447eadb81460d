"""Prints pip constraints that pin every lower bound in pyproject.toml (``name>=X`` -> ``name==X``).

Usage: ``python .ci/floor.py [EXTRA ...] > floor.txt``, then
``pip install -c floor.txt -e '.[EXTRA,...]'``. It covers ``[project] dependencies`` and every
extra that the EXTRAs (default ``test``) reach through ``loopkit[...]``, so the CI environment
built with it has exactly the floors the package declares: a floor that no longer installs or no
longer works fails CI instead of hiding behind newer releases.

``python .ci/floor.py --unpinned EXTRA ...`` prints those requirements as pyproject states them (for
``pip install -r``: the newest releases that satisfy them, without installing loopkit itself).
"""

import re
import sys
import tomllib
from pathlib import Path

_REQ = re.compile(r"^\s*([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*(.*)$")


def _canonical(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def requirements(*extras: str) -> list[str]:
  """The requirement strings that ``pip install '.[extras]'`` installs (loopkit's own extras
  expanded; no extras means ``test``)."""
  project = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]
  table = project["optional-dependencies"]
  reqs, todo, seen = list(project["dependencies"]), list(extras or ["test"]), set()
  while todo:
    name = todo.pop()
    if name in seen:
      continue
    seen.add(name)
    for req in table[name]:
      m = _REQ.match(req)
      if m and _canonical(m.group(1)) == project["name"]:
        todo.extend(e.strip() for e in m.group(2).strip("[]").split(","))
      else:
        reqs.append(req)
  return reqs


def floors(*extras: str) -> dict[str, str]:
  """Returns ``{canonical name: lowest version}`` for the dependencies that ``extras`` install."""
  out: dict[str, str] = {}
  for req in requirements(*extras):
    m = _REQ.match(req)
    if m is None or not m.group(3).startswith(">="):
      raise SystemExit(f"pyproject.toml: {req!r} has no '>=' lower bound to pin")
    version = m.group(3)[2:].split(",")[0].strip()
    name = _canonical(m.group(1))
    if out.setdefault(name, version) != version:
      raise SystemExit(f"pyproject.toml: {name} has two lower bounds, {out[name]} and {version}")
  return out


if __name__ == "__main__":
  if sys.argv[1:2] == ["--unpinned"]:
    print("\n".join(requirements(*sys.argv[2:])))
  else:
    for name, version in sorted(floors(*sys.argv[1:]).items()):
      print(f"{name}=={version}")
