"""loopkit._internal.compat: each private JAX / Orbax API is found on the installed releases
(the probe), does
what loopkit needs, and its fallback keeps the caller correct. CI runs this file on the pyproject
floors (Python 3.11) and on the newest JAX, Flax and Orbax (Python 3.12): a release that moves one
of them fails here by name, not somewhere downstream as a slow path or a lost source line."""

import pathlib
import re
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import loopkit
from loopkit._internal import compat
from loopkit.data import feeding

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_only_compat_uses_private_jax_or_orbax():
  """No module but compat.py imports ``jax._src`` or reaches into Orbax's private attributes."""
  private = re.compile(r"jax\._src|_async_manager|_commit_futures|_addressable_device_assignment"
                       r"|_cache_size\(|xla_bridge")
  offenders = []
  for path in sorted((ROOT / "loopkit").glob("*.py")):
    if path.name == "compat.py":
      continue
    for n, line in enumerate(path.read_text().splitlines(), 1):
      code = line.split("#")[0]
      if private.search(code):
        offenders.append(f"{path.name}:{n}: {line.strip()}")
  assert offenders == []


# -- batched_device_put / addressable_devices ------------------------------------------


def _reversed_mesh_sharding():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4][::-1]), ("data",))
  return NamedSharding(mesh, P(None, "data"))


def test_addressable_devices_is_the_order_jax_places_shards_in():
  sharding = _reversed_mesh_sharding()
  placed = jax.device_put(np.zeros((2, 8), np.float32), sharding)
  got = compat.addressable_devices(sharding)
  assert got == [s.device for s in placed.addressable_shards]
  assert got == jax.devices()[:4][::-1]
  private = getattr(sharding, "_addressable_device_assignment", None)
  if private is not None:  # JAX's own answer, where it still has it
    assert got == list(private)


def test_batched_device_put_probe_builds_the_array_device_put_builds():
  assert compat.batched_device_put is not None, "JAX moved pxla.batched_device_put"
  sharding = _reversed_mesh_sharding()
  x = np.arange(16, dtype=np.float32).reshape(2, 8)
  ref = jax.device_put(x, sharding)
  devices = compat.addressable_devices(sharding)
  index_map = sharding.addressable_devices_indices_map(x.shape)
  got = compat.batched_device_put(ref.aval, sharding, [x[index_map[d]] for d in devices], devices)
  assert got.sharding == ref.sharding and got.aval == ref.aval and got.committed
  np.testing.assert_array_equal(np.asarray(got), x)
  assert [s.device for s in got.addressable_shards] == [s.device for s in ref.addressable_shards]


def test_feeder_without_batched_device_put_places_with_jax_device_put(monkeypatch):
  """The fallback: the feeder's placer never takes the fast path, chunks are the same."""
  monkeypatch.setattr(compat, "batched_device_put", None)
  mesh = loopkit.data_parallel_mesh(devices=jax.devices()[:2])
  source = [{"x": np.array([2 * i, 2 * i + 1], np.float32)} for i in range(6)]
  feeder = feeding.ChunkFeeder(iter(source), iter([2, 2, 2]), iterations_per_loop=2,
                               batch_sharding=NamedSharding(mesh, P(None, "data")),
                               replicated=NamedSharding(mesh, P()), data_parallel_size=2,
                               prefetch=0)
  chunks = [feeder.next() for _ in range(3)]
  feeder.close()
  assert feeder._place._fast is False
  np.testing.assert_array_equal(np.asarray(chunks[2].batches["x"]), [[8, 9], [10, 11]])


# -- source_info_context ------------------------------------------------------------------


def _rebound_name_stack(x):
  def f(x):
    with jax.named_scope("outer"):
      return jnp.sin(x)

  eqn = jax.make_jaxpr(f)(x).jaxpr.eqns[0]

  def rebind(x):
    with compat.source_info_context(eqn):
      return eqn.primitive.bind(x, **eqn.params)

  return str(jax.make_jaxpr(rebind)(x).jaxpr.eqns[0].source_info.name_stack)


def test_source_info_context_keeps_the_equations_name_stack():
  assert compat._user_context is not None, "JAX moved source_info_util.user_context"
  assert _rebound_name_stack(jnp.ones(3)) == "outer"


def test_source_info_context_fallback_is_a_null_context(monkeypatch):
  monkeypatch.setattr(compat, "_user_context", None)
  assert _rebound_name_stack(jnp.ones(3)) == ""  # metadata lost, nothing else


# -- backends_initialized -------------------------------------------------------------------


def test_backends_initialized_before_and_after_the_first_device_query():
  assert compat._backends_are_initialized is not None, "JAX moved backends_are_initialized"
  jax.devices()
  assert compat.backends_initialized() is True
  code = ("import jax; from loopkit._internal import compat; a = compat.backends_initialized(); "
          "jax.devices(); print(a, compat.backends_initialized())")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       cwd=ROOT, env={"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
                                      "PATH": "/usr/bin:/bin"})
  assert out.stdout.split() == ["False", "True"]


def test_backends_initialized_fallback_says_initialized(monkeypatch):
  monkeypatch.setattr(compat, "_backends_are_initialized", None)
  assert compat.backends_initialized() is True


# -- lowering_count ---------------------------------------------------------------------------


def test_lowering_count_counts_each_compile_once():
  f = jax.jit(lambda x: x * 3 + 1)
  x5, x6, x4 = (jax.device_put(np.ones(n, np.float32)) for n in (5, 6, 4))  # no lowering
  before = compat.lowering_count()
  f(x5).block_until_ready()
  assert compat.lowering_count() == before + 1
  f(x5).block_until_ready()  # cached: no lowering
  assert compat.lowering_count() == before + 1
  f(x6).block_until_ready()  # a new shape compiles again
  assert compat.lowering_count() == before + 2
  # AOT: lower() is the lowering; compile() adds none
  lowered = jax.jit(lambda x: x - 2).lower(x4)
  assert compat.lowering_count() == before + 3
  lowered.compile()
  assert compat.lowering_count() == before + 3


# -- Orbax ------------------------------------------------------------------------------------


def test_orbax_commit_futures_probe_finds_the_writes_of_a_save(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  manager = ocp.CheckpointManager(
      tmp_path, options=ocp.CheckpointManagerOptions(enable_async_checkpointing=True),
      item_handlers={"state": ocp.StandardCheckpointHandler()})
  state = {"w": jnp.arange(1024.0)}
  manager.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
  futures = compat.orbax_commit_futures(manager)
  assert futures is not None, "Orbax moved CheckpointManager._checkpointer._async_manager"
  assert len(futures) >= 1 and all(hasattr(f, "result") for f in futures)  # the save in flight
  compat.wait_for_orbax_writers(manager, timeout_s=60)
  manager.wait_until_finished()
  assert manager.all_steps() == [1]
  manager.close()


def test_wait_for_orbax_writers_fallback_waits_with_the_public_call():
  class Manager:  # an Orbax without the private attributes
    waited = 0

    def wait_until_finished(self):
      Manager.waited += 1
      raise RuntimeError("the save failed")  # already raised to the caller: dropped

  assert compat.orbax_commit_futures(Manager()) is None
  start = time.monotonic()
  compat.wait_for_orbax_writers(Manager())
  assert Manager.waited == 1 and time.monotonic() - start < 5


# -- CLU's writers ------------------------------------------------------------------------------

CLU_PROBE = """\
import os, sys, types
import clu
# CLU's writer modules without clu/metric_writers/__init__.py (it imports TensorFlow).
pkg = types.ModuleType("clu.metric_writers")
pkg.__path__ = [os.path.join(os.path.dirname(clu.__file__), "metric_writers")]
sys.modules["clu.metric_writers"] = pkg
from clu.metric_writers import async_writer, logging_writer, multi_writer
from loopkit._internal import compat
log = logging_writer.LoggingWriter()

def leaves(writer):
  inner = compat.clu_wrapped_writers(writer)
  return [writer] if inner is None else [x for w in inner for x in leaves(w)]

for outer in (async_writer.AsyncMultiWriter([log]), multi_writer.MultiWriter([log]),
              async_writer.AsyncWriter(log)):
  assert compat.clu_wrapped_writers(outer) is not None, (
      f"CLU moved {type(outer).__name__}'s wrapped writers")
  assert leaves(outer) == [log], leaves(outer)  # AsyncMultiWriter: an AsyncWriter each
assert compat.clu_wrapped_writers(log) is None
print("found")
"""


def test_clu_wrapped_writers_probe_finds_what_clus_writers_wrap():
  """CLU's MultiWriter / AsyncMultiWriter keep their writers in ``_writers``, AsyncWriter in
  ``_writer`` (loopkit.observe.prints_to_console looks for a LoggingWriter there). A fresh
  interpreter: CLU's writer modules are loaded as a user's script would have them."""
  pytest.importorskip("clu")
  out = subprocess.run([sys.executable, "-c", CLU_PROBE], capture_output=True, text=True,
                       cwd=ROOT, env={**__import__("os").environ, "PYTHONPATH": str(ROOT),
                                      "JAX_PLATFORMS": "cpu"}, timeout=120)
  assert out.returncode == 0 and out.stdout.strip() == "found", out.stderr


def test_clu_wrapped_writers_fallback_is_none_for_other_writers():
  """Without CLU's modules loaded, or for any other object: None (the hooks then log their
  rows themselves)."""
  class MultiWriter:  # a look-alike: not CLU's class
    _writers = (loopkit.observe.ConsoleWriter(),)

  assert compat.clu_wrapped_writers(MultiWriter()) is None
  assert compat.clu_wrapped_writers(loopkit.observe.MultiWriter([])) is None
  assert not loopkit.observe.prints_to_console(MultiWriter())
