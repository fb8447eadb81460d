"""Every leaf kind survives a checkpoint (case C28): save, SIGKILL, resume in a fresh process.

tests/_leaf_worker.py holds one sub-state per kind: typed PRNG keys (threefry
``key<fry>``, ``rbg``, a batch of keys), bool, int8, uint32, bfloat16, 0-d,
empty (``(0,)``, ``(3, 0)``, zero keys), None leaves, a Flax NNX
``nnx.split((model, nnx.Optimizer(model, tx, wrt=nnx.Param)))`` state with
``nnx.Dropout`` and its ``nnx.Rngs`` stream, and, under ``JAX_ENABLE_X64=1``,
int64 and uint64. For K = 1 and K = 5 a worker saves at step 4 and kills
itself once the save committed; a fresh worker resumes from a *differently*
initialised state (the checkpoint must win) and trains to step 8. Per kind the
restored state must be bitwise the uninterrupted run's state at step 4, and the
final state bitwise its final state, with the same dtypes.

The mismatch checks (the user's tree really changed) run in this process.
"""

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loopkit.checkpoint import CheckpointHook
from loopkit.core.ledger import Ledger
from tests import bootstrap
from tests.toy import compilation_cache_env

WORKER = Path(__file__).parent / "_leaf_worker.py"
ROOT = Path(__file__).parent.parent
KS = (1, 5)
KINDS = ("typed_key", "bool", "int8", "uint32", "int64", "bfloat16", "zero_d", "empty", "none",
         "nnx")


def _launch(phase, d, out, k, x64, cache):
  env = bootstrap.env()  # the worker sets its own device count (bootstrap.start)
  env["JAX_ENABLE_X64"] = "1" if x64 else "0"
  # One persistent compilation cache for the fixture's workers: the resume worker's two runs
  # load the program its save worker compiled (compiling was ~60% of a resume worker's time).
  # Tracing still happens in every run, so trace_count is still checked.
  env.update(compilation_cache_env(cache))
  err = open(str(out) + f".{phase}.err", "w")  # noqa: SIM115  (closed by the caller)
  proc = subprocess.Popen([sys.executable, str(WORKER), "--phase", phase, "--dir", str(d),
                           "--out", str(out), "--k", str(k)],
                          stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=ROOT)
  return proc, err


def _tail(path) -> str:
  return Path(path).read_text()[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """{(k, x64): the resume worker's JSON}; all workers of a phase run at once."""
  root = tmp_path_factory.mktemp("leaf_kinds")
  configs = [(k, x64) for k in KS for x64 in (False, True)]
  paths = {c: (root / f"k{c[0]}_x64{int(c[1])}", root / f"k{c[0]}_x64{int(c[1])}.json")
           for c in configs}
  cache = root / "jax_cache"
  saves = {c: _launch("save", *paths[c], c[0], c[1], cache) for c in configs}
  for c, (proc, err) in saves.items():
    stdout, _ = proc.communicate(timeout=300)
    err.close()
    assert proc.returncode == -signal.SIGKILL, (c, proc.returncode, _tail(err.name))
    assert stdout.strip() == "KILLING at 4 saved [4]", (c, stdout)
  resumes = {c: _launch("resume", *paths[c], c[0], c[1], cache) for c in configs}
  out = {}
  for c, (proc, err) in resumes.items():
    proc.communicate(timeout=300)
    err.close()
    assert proc.returncode == 0, (c, _tail(err.name))
    out[c] = json.loads(paths[c][1].read_text())
  return out


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("kind", KINDS)
def test_leaf_kind_survives_save_kill_resume(runs, kind, k):
  for x64 in (False, True):
    r = runs[(k, x64)]
    assert r["x64"] is x64
    assert r["restored_step"] == 4 and r["status"] == "completed" and r["step"] == 8
    assert r["trace_count"] == 1  # the restored state is traced like the one passed in
    if kind == "int64" and not x64:
      assert kind not in r["final"]  # int64 leaves exist only with x64
      continue
    assert r["init"][kind] != r["other_seed"][kind]  # the resume started from other values
    assert r["restored"][kind] == r["ref_at_save"][kind], (kind, k, x64)
    assert r["final"][kind] == r["ref_final"][kind], (kind, k, x64)
    assert r["final_dtypes"][kind] == r["ref_dtypes"][kind] == r["init_dtypes"][kind]
  if kind == "typed_key":
    assert r["final_dtypes"][kind] == ["key<fry>", "key<fry>", "key<rbg>", "float32"]
  if kind == "nnx":
    assert "key<fry>" in r["final_dtypes"][kind]  # the Dropout's nnx.Rngs key
  if kind == "int64":
    assert r["final_dtypes"][kind] == ["uint64", "int64"]


# -- the tree really changed: the error names the leaf ------------------------------------


def _save(d, state):
  hook = CheckpointHook(d)
  hook.save(0, state, ledger=Ledger(step=0))
  hook.close()
  return hook


def _state():
  return {"key": jax.random.key(0), "keys": jax.random.split(jax.random.key(1), 3),
          "empty": jnp.zeros((3, 0)), "nothing": None, "step": jnp.zeros((), jnp.int32)}


@pytest.mark.parametrize("change,message", [
    (dict(key=jax.random.key(0, impl="rbg")),
     "leaf key has dtype key<fry> (impl threefry2x32) in the checkpoint, key<rbg> (impl "
     "rbg) in the train state"),
    (dict(keys=jax.random.split(jax.random.key(1), 4)),
     "leaf keys has shape (3,) in the checkpoint, (4,) in the train state"),
    (dict(key=jnp.zeros((), jnp.uint32)),
     "leaf key has dtype key<fry> (impl threefry2x32) in the checkpoint, uint32 in the "
     "train state"),
    (dict(keys=jax.random.key_data(jax.random.split(jax.random.key(1), 3))),
     "leaf keys has shape (3,) in the checkpoint, (3, 2) in the train state"),
    (dict(empty=jnp.zeros((2, 0))),
     "leaf empty has shape (3, 0) in the checkpoint, (2, 0) in the train state"),
    (dict(nothing=jnp.zeros(())), "leaf nothing of the train state is not in the checkpoint"),
])
def test_changed_tree_names_the_leaf(tmp_path, change, message):
  hook = _save(tmp_path, _state())
  with pytest.raises(ValueError, match="does not match the train state") as e:
    hook.restore(_state() | change)
  assert message in str(e.value)
  r = hook.restore(_state())  # the unchanged tree still restores
  assert r.state["key"].dtype == jax.random.key(0).dtype and r.state["nothing"] is None
  assert np.array_equal(jax.random.key_data(r.state["keys"]),
                        jax.random.key_data(_state()["keys"]))
  assert r.state["empty"].shape == (3, 0)


def test_checkpoint_without_leaf_record_checks_orbax_metadata(tmp_path):
  """A checkpoint written before the "leaves" item: typed keys checked by their key data."""
  state = {k: v for k, v in _state().items() if k != "empty"}  # Orbax alone cannot hold it
  hook = _save(tmp_path, state)
  shutil.rmtree(tmp_path / "0" / "leaves")
  r = hook.restore(state)
  assert r.state["key"].dtype == state["key"].dtype
  assert np.array_equal(jax.random.key_data(r.state["keys"]), jax.random.key_data(state["keys"]))
  with pytest.raises(ValueError, match=r"leaf keys has shape \(3, 2\) in the checkpoint, "
                                       r"\(4, 2\) in the train state"):
    hook.restore(state | dict(keys=jax.random.split(jax.random.key(1), 4)))
