"""docs/*.md and README.md parse as intended under CommonMark (markdown-it-py): every code fence is
closed by a bare fence line, and no fence swallows another (`sphinx -W` does not see either)."""

import glob
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = sorted(glob.glob(os.path.join(REPO, "docs", "*.md"))) + [os.path.join(REPO, "README.md")]


def fence_problems(text: str) -> list[str]:
  """Line-numbered descriptions of the fences that do not parse as written."""
  from markdown_it import MarkdownIt
  lines = text.splitlines()
  problems = []
  for tok in MarkdownIt("commonmark").parse(text):
    if tok.type != "fence":
      continue
    start, end = tok.map
    marker = tok.markup
    last = lines[end - 1].strip() if end - start >= 2 else ""
    if not (last.startswith(marker) and set(last) == {marker[0]}):
      problems.append(f"line {start + 1}: the {marker} fence is never closed")
    for i, line in enumerate(lines[start + 1:end - 1], start + 2):
      if line.lstrip().startswith(marker[0] * 3):
        problems.append(f"line {i}: {line.strip()[:40]!r} sits inside the fence opened at "
                        f"line {start + 1} (a closing fence takes no text after it)")
  return problems


def test_the_checker_finds_the_faults_it_is_for():
  pytest.importorskip("markdown_it")
  ok = "text\n\n```python\nx = 1\n```\n\nmore\n"
  assert fence_problems(ok) == []
  assert fence_problems("```\na\n``` trailing words\n\n```python\nb\n```\n") == [
      "line 3: '``` trailing words' sits inside the fence opened at line 1 (a closing fence "
      "takes no text after it)",
      "line 5: '```python' sits inside the fence opened at line 1 (a closing fence takes no "
      "text after it)"]
  assert fence_problems("a\n\n```\nnever closed\n") == ["line 3: the ``` fence is never closed"]


@pytest.mark.parametrize("path", PAGES, ids=os.path.basename)
def test_fences_parse_as_written(path):
  pytest.importorskip("markdown_it")
  with open(path) as f:
    assert fence_problems(f.read()) == [], path
