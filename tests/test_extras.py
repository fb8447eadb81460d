"""Every optional dependency, when missing, fails with an ImportError naming the loopkit extra.

The checks run in a fresh interpreter whose import system refuses the optional packages
(a meta-path finder), so this process's modules stay untouched."""

import subprocess
import sys
from pathlib import Path

import pytest

from loopkit._internal import extras

REPO = Path(__file__).parent.parent

SCRIPT = r'''
import importlib.abc, sys
BLOCKED = set(sys.argv[1].split(","))
class Refuse(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path, target=None):
    if name.split(".")[0] in BLOCKED:
      raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Refuse())
import loopkit
def message(fn):
  try:
    fn()
  except ImportError as e:
    return str(e)
  return "no error"
import numpy as np
results = {
  "CheckpointHook": message(lambda: loopkit.CheckpointHook),
  "loopkit.checkpoint": message(lambda: __import__("loopkit.checkpoint")),
  "nnx": message(lambda: loopkit.nnx),
  "TensorBoardWriter": message(lambda: loopkit.observe.TensorBoardWriter("/tmp/unused-loopkit-tb")),
  "grain_shard_options": message(lambda: loopkit.data.grain_shard_options()),
  "tfds_split_for_process": message(lambda: loopkit.data.tfds_split_for_process("train")),
  "TfDataSource": message(lambda: iter(loopkit.TfDataSource(None))),
  "MlflowWriter": message(lambda: loopkit.observe.MlflowWriter()),
  "WandbWriter": message(lambda: loopkit.observe.WandbWriter()),
}
for k, v in results.items():
  print(f"{k}|{v}")
'''


def test_missing_optional_packages_name_their_extra():
  blocked = "orbax,etils,flax,tensorboardX,grain,tensorflow_datasets,mlflow,wandb"
  out = subprocess.run([sys.executable, "-c", SCRIPT, blocked], capture_output=True, text=True,
                       cwd=REPO, timeout=300, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin",
                                                   "JAX_PLATFORMS": "cpu"})
  assert out.returncode == 0, out.stderr[-3000:]
  got = dict(line.split("|", 1) for line in out.stdout.splitlines() if "|" in line)
  want = {"CheckpointHook": "checkpoint", "loopkit.checkpoint": "checkpoint", "nnx": "nnx",
          "TensorBoardWriter": "observability", "grain_shard_options": "data",
          "tfds_split_for_process": "data", "TfDataSource": "data", "MlflowWriter": "mlflow",
          "WandbWriter": "wandb"}
  for feature, extra in want.items():
    assert f"pip install 'loopkit[{extra}]'" in got[feature], (feature, got[feature])
  assert got["CheckpointHook"].startswith("loopkit.CheckpointHook needs orbax-checkpoint")
  assert got["MlflowWriter"].startswith("loopkit.observe.MlflowWriter needs mlflow-skinny")


@pytest.mark.parametrize("module,extra", [("tqdm", "observability"),
                                          ("matplotlib", "observability"),
                                          ("optax", "nnx"), ("tensorflow", "data")])
def test_every_optional_module_has_an_extra(module, extra):
  err = ModuleNotFoundError(f"No module named {module!r}", name=module)
  assert f"pip install 'loopkit[{extra}]'" in str(extras.missing(err, "feature"))


def test_every_extra_named_exists_in_pyproject():
  import tomllib
  declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
      "optional-dependencies"]
  for package, extra in extras.EXTRAS.values():
    assert extra in declared, extra
    assert any(req.lower().startswith(package.lower()) for req in declared[extra]), (package,
                                                                                    extra)
