"""The front door and the layout: loopkit's top-level names, each namespace's ``__all__``, the
version, and the import layering (no module imports a layer above its own)."""

import ast
import importlib
import pathlib
import tomllib

import pytest

import loopkit

ROOT = pathlib.Path(loopkit.__file__).parent
NAMESPACES = ["loopkit", "loopkit.core", "loopkit.data", "loopkit.observe", "loopkit.checkpoint",
              "loopkit.training"]
# Lower layers never import higher ones; the same rank may import each other only inside one
# package (observe and checkpoint are both rank 4 and import neither each other nor anything
# above core).
RANKS = {"_internal": 0, "metrics": 1, "conv_layout": 1, "data": 2, "core": 3, "observe": 4,
         "checkpoint": 4, "evaluation": 5, "training": 5, "nnx": 6, "tools": 7}


def _part(module: str) -> str:
  """The layer a module belongs to: 'core' for loopkit.core.run, 'nnx' for loopkit.nnx."""
  return module.split(".")[1]


def _imports(path: pathlib.Path, module: str) -> set[str]:
  """Every loopkit module ``path`` imports, at run time or for type checking."""
  out = set()
  package = module if path.name == "__init__.py" else module.rpartition(".")[0]
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      out |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = package.split(".")
        base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
      out |= {f"{base}.{a.name}" for a in node.names} | {base}
  return {m for m in out if m.startswith("loopkit.")}


def _modules() -> dict[str, pathlib.Path]:
  mods = {}
  for path in ROOT.rglob("*.py"):
    rel = path.relative_to(ROOT.parent).with_suffix("")
    mods[".".join(rel.parts).removesuffix(".__init__")] = path
  return mods


def test_front_door_is_small_sorted_and_every_name_resolves():
  names = loopkit.__all__
  assert len(names) <= 30, len(names)
  assert names == sorted(names) and len(set(names)) == len(names)
  for name in names:
    assert getattr(loopkit, name) is not None, name
  for internal in ("MultiStepProgram", "next_call_length", "tfds_split_for_process", "Ledger",
                   "JsonlWriter", "plan_calls"):
    assert internal not in names
    with pytest.raises(AttributeError, match=internal):
      getattr(loopkit, internal)


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_each_namespace_all_is_sorted_and_resolves(namespace):
  module = importlib.import_module(namespace)
  assert module.__all__ == sorted(module.__all__), namespace
  for name in module.__all__:
    assert getattr(module, name) is not None, f"{namespace}.{name}"


def test_a_name_has_one_public_home():
  """A class or function exported by two namespaces is the same object (no copies)."""
  seen = {}
  for namespace in NAMESPACES:
    module = importlib.import_module(namespace)
    for name in module.__all__:
      obj = getattr(module, name)
      assert seen.setdefault(name, obj) is obj, name


def test_version_matches_pyproject():
  meta = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())
  assert loopkit.__version__ == meta["project"]["version"]


def test_no_module_imports_a_layer_above_its_own():
  bad = []
  mods = _modules()
  assert len(mods) > 40, sorted(mods)
  for module, path in mods.items():
    if module == "loopkit":
      assert not any(_part(t) == "tools" for t in _imports(path, module))
      continue
    here = _part(module)
    for target in _imports(path, module):
      there = _part(target)
      if there == here:
        continue
      if RANKS[there] > RANKS[here] or (RANKS[there] == RANKS[here]):
        bad.append(f"{module} -> {target}")
  assert not bad, bad


def test_the_layering_check_sees_an_upward_import(tmp_path):
  """The walk above finds a relative and an absolute import that go up (so it can fail)."""
  core = tmp_path / "core.py"
  core.write_text("from loopkit.observe import writers\nfrom ..tools import aot\n")
  assert _imports(core, "loopkit.core.x") >= {"loopkit.observe.writers", "loopkit.tools.aot"}


# Every name loopkit 0.1's loopkit/__init__.py exported or bound (its __all__, its lazy names, the
# modules it imported), from `git show 7e5a7ca^:loopkit/__init__.py`.
NAMES_01 = """
ArraySource AsyncWriter BatchLayoutWarning Bucket CallbackHook CheckpointError CheckpointHook
CheckpointWarning ConsoleWriter DataExhaustedWarning DeviceDataState DeviceDataset EvalHook
EvalResult Evaluator FlaxSummaryWriter GoodputHook GoodputSummary Hook JsonlWriter Ledger
LedgerAdjustment LoggingHook LoopInfo MetricWriter MultiStepProgram MultiWriter NanCheckHook
NonFiniteError NonFiniteWarning NullWriter PreemptionWatcher ProfilerHook ProgressHook Restore
RestoredCheckpoint RunContext TensorBoardWriter TfDataSource TimeBasedK TrainLoop Trigger
accumulate as_writer batch_arrays create_default_writer data_parallel_mesh
eval_batches_per_process evaluate grain_shard_for_process grain_shard_options metrics
next_call_length per_example plan_calls process_shard_bounds shard_for_process step_key
steps_per_epoch_of tfds_split_for_process aot conv_layout goodput nnx testing tune
accumulation checks context device_data evaluation hooks ledger loop planner preemption profiler
program progress rng sources triggers writers
""".split()


def _resolve(path: str):
  module, _, name = path.rpartition(".")
  try:
    return importlib.import_module(path)
  except ImportError:
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("name", NAMES_01)
def test_c58_a_name_of_loopkit_01_is_here_or_says_where_it_lives_now(name):
  from loopkit._internal.moved import INTERNAL, MOVED, MOVED_MODULES
  if name in loopkit.__all__:
    assert getattr(loopkit, name) is not None
    return
  if name in INTERNAL:
    want = f"loopkit.{name} is internal since loopkit 0.2; its public name is {INTERNAL[name]}"
    where = INTERNAL[name]
  elif name in MOVED_MODULES:
    where = MOVED_MODULES[name]
    want = f"loopkit.{name} moved in loopkit 0.2: it is {where} (import {where})"
  else:
    where = MOVED[name]
    home, _, short = where.rpartition(".")
    want = f"loopkit.{name} moved in loopkit 0.2: it is {where} (from {home} import {short})"
  assert _resolve(where) is not None  # the new home exists
  with pytest.raises(AttributeError) as e:
    getattr(loopkit, name)
  assert str(e.value) == want
  assert not hasattr(loopkit, name)
  with pytest.raises(ImportError) as e:  # `from loopkit import X`: Python would drop the message
    exec(f"from loopkit import {name}", {})
  assert str(e.value) == want


def test_c58_an_unknown_name_is_a_plain_attribute_error():
  with pytest.raises(AttributeError, match=r"^module 'loopkit' has no attribute 'JsonWriter'$"):
    loopkit.JsonWriter  # noqa: B018
  with pytest.raises(ImportError, match=r"^cannot import name 'JsonWriter' from 'loopkit'"):
    exec("from loopkit import JsonWriter", {})
