"""Batches over several mesh axes: ``data_axis=("data", "fsdp")`` on a (2, 2, 2) mesh.

The model (tests/data_axes_workers.py) has leaves sharded on ``fsdp`` and ``tensor``; the batch
is split over the product of ``data`` and ``fsdp`` (4 slices, ``data`` major, as
``PartitionSpec(("data", "fsdp"))`` splits it) and replicated over ``tensor``. Every device's
rows are read back from the state (it keeps the last step's ids with the batch's sharding), so
the tests say which examples each device trained on, not only the final values.
"""

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import loopkit
from loopkit._internal.mesh import batch_sharding, check_batch_on_mesh, mesh_process_rows
from loopkit.data import sources
from loopkit.tools import testing
from tests import data_axes_workers as w

# The flattened (data, fsdp) slice of each device of the (2, 2, 2) mesh over devices 0-7:
# device d sits at (data, fsdp, tensor) = (d // 4, d // 2 % 2, d % 2), slice data * 2 + fsdp.
SLICE_OF_DEVICE = {d: d // 2 for d in range(8)}
# 2 x 4 against 1 x 8: the same rows on the same devices, but the cross-process (gloo)
# all-reduces associate the partial sums differently from XLA's in-process ones, as on one axis
# (tests/test_multihost.py). Measured after 7 steps, K = 1 and 3: max |diff| of params and
# momentum 6e-8 (jax 0.12) and 1.2e-7 (jax 0.10.2), of the losses 1.2e-7 and 2.4e-7.
ATOL = 1e-6


def expected_rows(step: int, slice_of_device=SLICE_OF_DEVICE, slices: int = 4) -> dict:
  """``{device: ids}`` of the global batch ``step`` of the workers' ArraySource."""
  ids = sources.ArraySource(w.dataset(), w.GLOBAL_BATCH, seed=5).indices_at(step)
  blocks = np.split(ids, slices)
  return {d: blocks[s].tolist() for d, s in slice_of_device.items()}


@pytest.fixture(scope="module")
def runs():
  """K = 1, 2, 3 over 7 steps (7 divides by none of 2, 3): one compiled program each."""
  return {k: w.train(7, k) for k in (1, 2, 3)}


def test_every_k_is_bitwise_equal_and_keeps_the_shardings(runs):
  ref = runs[1]
  for k, r in runs.items():
    assert r["step"] == r["state_step"] == 7 and r["compiles"] == 1, k
    assert r["params"] == ref["params"] and r["mom"] == ref["mom"], f"K={k} differs from K=1"
    assert r["losses"] == ref["losses"] and len(r["losses"]) == 7
    assert r["specs"] == {"w1": ("fsdp", "tensor"), "b1": ("tensor",), "w2": ("tensor", "fsdp")}
  assert ref["losses"][-1] < 0.8 * ref["losses"][0]  # it trains


def test_each_device_trains_on_its_slice_of_the_batch_data_major(runs):
  # The last step (6)'s 16 rows in 4 slices of 4, slice data * 2 + fsdp, both tensor devices alike.
  assert runs[3]["ids"] == expected_rows(6)
  assert runs[3]["ids"][0] != runs[3]["ids"][2]  # fsdp splits the batch: not replicated on it


def test_the_same_rows_land_where_one_axis_of_the_same_size_puts_them(runs):
  """Batch on ("data", "fsdp") of (2, 2, 2) = batch on "data" of (4, 1, 2): the same devices
  hold the same rows, so the runs see the same global batches (losses agree to rounding:
  the partitioning of the sharded leaves differs)."""
  flat = w.train(7, 3, mesh_shape=(4, 1, 2), data_axis="data")
  assert flat["ids"] == runs[3]["ids"]
  np.testing.assert_allclose(flat["losses"], runs[3]["losses"], rtol=1e-5)
  # ("fsdp", "data"): fsdp is the major axis, slice fsdp * 2 + data.
  swapped = w.train(7, 3, data_axis=("fsdp", "data"))
  assert swapped["ids"] == expected_rows(6, {d: (d // 2 % 2) * 2 + d // 4 for d in range(8)})


def test_a_list_and_a_one_tuple_are_taken_as_the_axes_they_name():
  mesh = w.make_mesh()
  loop = loopkit.TrainLoop(w.global_step, iterations_per_loop=2, mesh=mesh,
                           data_axis=["data", "fsdp"])
  assert loop.program.data_axis == ("data", "fsdp") and loop.data_parallel_size == 4
  assert loop.program.batch_sharding.spec == P(None, ("data", "fsdp"))
  one = loopkit.TrainLoop(w.global_step, iterations_per_loop=2, mesh=mesh, data_axis=("data",))
  assert one.program.data_axis == "data" and one.data_parallel_size == 2


# -- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize("data_axis, error, text", [
    (("data", "model"), ValueError,
     "data_axis 'model' is not an axis of the mesh ('data', 'fsdp', 'tensor') "
     "(data_axis=('data', 'model'))"),
    (("data", "data"), ValueError, "data_axis ('data', 'data') names the mesh axis 'data' twice"),
    ((), ValueError, "data_axis names no mesh axis"),
    (3, TypeError, "data_axis must be a mesh axis name or a tuple of them, got 3"),
    (("data", 0), TypeError, "got ('data', 0)"),
])
def test_bad_data_axes_are_refused_by_every_entry_point(data_axis, error, text):
  mesh = w.make_mesh()
  builders = [
      lambda: loopkit.TrainLoop(w.global_step, iterations_per_loop=1, mesh=mesh,
                                data_axis=data_axis),
      lambda: loopkit.Evaluator(lambda s, b: b, mesh=mesh, data_axis=data_axis),
      lambda: loopkit.data.DeviceDataset(w.dataset(), 16, mesh=mesh, data_axis=data_axis),
  ]
  for build in builders:
    with pytest.raises(error, match=re.escape(text)):
      build()


def test_several_axes_without_a_mesh_are_refused():
  with pytest.raises(ValueError, match=re.escape(
      "data_axis=('data', 'fsdp') names several mesh axes but no mesh was given")):
    loopkit.TrainLoop(w.global_step, iterations_per_loop=1, data_axis=("data", "fsdp"))


_NOT_DIVISIBLE = ("global batch size 6 is not divisible by the data-parallel size 4 (the product "
                  "of the sizes of the mesh axes ('data', 'fsdp'): 2 x 2)")


def test_a_batch_that_does_not_divide_by_the_product_names_the_axes_and_sizes():
  mesh = w.make_mesh()
  with pytest.raises(ValueError, match=re.escape(_NOT_DIVISIBLE)):
    loopkit.TrainLoop(w.global_step, iterations_per_loop=1, mesh=mesh,
                      data_axis=w.BATCH_AXES, global_batch_size=6)
  with pytest.raises(ValueError, match=re.escape(_NOT_DIVISIBLE)):
    loopkit.Evaluator(lambda s, b: b, mesh=mesh, data_axis=w.BATCH_AXES, global_batch_size=6)
  with pytest.raises(ValueError, match=re.escape(_NOT_DIVISIBLE)):
    loopkit.data.DeviceDataset(w.dataset(), 6, mesh=mesh, data_axis=w.BATCH_AXES)
  # at run, from the first batch, before any step: the state is not donated
  loop = loopkit.TrainLoop(w.global_step, iterations_per_loop=2, mesh=mesh,
                           data_axis=w.BATCH_AXES)
  state = w.init_state(mesh)
  with pytest.raises(ValueError, match=re.escape(_NOT_DIVISIBLE)):
    loop.run(state, sources.ArraySource(w.dataset(), 6), num_steps=2)
  assert loop.ledger.step == 0 and not state["params"]["w1"].is_deleted()
  # 8 = 2 x 4 divides by the (data, fsdp) product of 4 and by 2 processes
  check_batch_on_mesh(8, batch_sharding(mesh, w.BATCH_AXES), process_count=2,
                      process_of=lambda d: d.id // 4)


# -- processes: which rows each process's devices hold --------------------------------------------


def test_each_process_feeds_the_rows_its_devices_hold():
  """On 2 processes of 4 devices (process = device id // 4, as jax.devices() orders them)."""
  mesh = w.make_mesh()
  of = lambda d: d.id // 4
  assert mesh_process_rows(mesh, ("data", "fsdp"), 16, process_of=of) == {0: [(0, 8)],
                                                                        1: [(8, 16)]}
  # "fsdp" alone does not split the batch over the processes (data spans them): refused
  with pytest.raises(ValueError, match=re.escape(
      "which puts process 0's devices on rows [0, 16), rows that process 1's devices hold too; "
      "but on 2 processes each process feeds its own B / P = 8 rows, process 0 rows [0, 8): "
      "every mesh axis whose devices span processes must be among the data axes")):
    check_batch_on_mesh(16, batch_sharding(mesh, "fsdp"), process_count=2, process_of=of)


def test_processes_out_of_order_along_the_batch_are_named_in_a_warning(caplog):
  """("fsdp", "data") puts process 0 (data = 0) on slices 0 and 2: it still trains, but a
  global batch's rows sit on other devices than on one process."""
  mesh = w.make_mesh()
  with caplog.at_level(logging.WARNING, logger="loopkit"):
    check_batch_on_mesh(16, batch_sharding(mesh, ("fsdp", "data")), process_count=2,
                        process_of=lambda d: d.id // 4)
  assert ("which puts process 0's devices on rows [0, 4) and [8, 12), not on the rows [0, 8) "
          "it feeds") in caplog.text
  caplog.clear()
  with caplog.at_level(logging.WARNING, logger="loopkit"):
    check_batch_on_mesh(16, batch_sharding(mesh, ("data", "fsdp")), process_count=2,
                        process_of=lambda d: d.id // 4)
  assert caplog.text == ""


# -- sources, evaluation, resume --------------------------------------------------------------


def _ids_on_devices(source, num_steps: int) -> dict:
  """``{device: ids}`` of the last batch a loop on the (2, 2, 2) mesh fed from ``source``."""
  mesh = w.make_mesh()
  loop = loopkit.TrainLoop(lambda s, b: ({"ids": b["id"], "step": s["step"] + 1}, {}),
                           iterations_per_loop=2, mesh=mesh, data_axis=w.BATCH_AXES)
  state = {"ids": jax.device_put(np.zeros(16, np.int32), NamedSharding(mesh, P(w.BATCH_AXES))),
           "step": jnp.zeros((), jnp.int32)}
  return w.shards(loop.run(state, source, num_steps=num_steps)["ids"])


def test_grain_source_rows_land_in_its_global_order():
  pytest.importorskip("grain")
  src = loopkit.data.GrainSource([{"id": np.int32(i)} for i in range(64)], 16, seed=2)
  blocks = np.split(src.record_indices_at(2), 4)
  assert _ids_on_devices(src, 3) == {d: blocks[s].tolist() for d, s in SLICE_OF_DEVICE.items()}


def test_tf_data_source_rows_land_in_its_order():
  tf = pytest.importorskip("tensorflow")
  ds = tf.data.Dataset.range(64).map(lambda i: {"id": tf.cast(i, tf.int32)}).batch(16)
  blocks = np.split(np.arange(32, 48), 4)  # the third batch
  assert _ids_on_devices(loopkit.data.TfDataSource(ds), 3) == {
      d: blocks[s].tolist() for d, s in SLICE_OF_DEVICE.items()}


@pytest.mark.parametrize("style", ["global", "per_device"])
def test_evaluation_over_the_product_is_exact(style):
  mesh = w.make_mesh()
  evaluator = loopkit.Evaluator(lambda s, b: {"id": b["id"], "scaled": s * b["id"]},
                                iterations_per_loop=2, mesh=mesh, data_axis=w.BATCH_AXES,
                                step_style=style, global_batch_size=8)
  state = jax.device_put(np.float32(2.0), NamedSharding(mesh, P()))
  batches = sources.batch_arrays({"id": np.arange(21, dtype=np.float32)}, 8)  # 8, 8, 5
  r = evaluator.evaluate(state, batches)
  assert (r.num_examples, r.num_batches) == (21, 3)
  assert r.totals == {"id": 210.0, "scaled": 420.0} and r.metrics == {"id": 10.0, "scaled": 20.0}
  assert w.evaluate() == {"totals": r.totals, "metrics": r.metrics, "num_examples": 21,
                          "num_batches": 3}


def test_resume_from_a_checkpoint_is_bitwise_and_keeps_the_shardings(tmp_path, runs):
  pytest.importorskip("orbax.checkpoint")
  first = loopkit.CheckpointHook(tmp_path)
  w.train(4, 3, hooks=[first])
  assert first.saved_steps == [4]
  hook = loopkit.CheckpointHook(tmp_path)
  resumed = w.train(7, 2, hooks=[hook], state=w.init_state(w.make_mesh(), seed=9))
  assert hook.restored_step == 4 and resumed["step"] == 7
  assert resumed["params"] == runs[1]["params"] and resumed["mom"] == runs[1]["mom"]
  assert resumed["ids"] == runs[1]["ids"] and resumed["specs"] == runs[1]["specs"]
  assert resumed["losses"] == runs[1]["losses"][4:]


# -- the per-device step style --------------------------------------------------------------------


def test_per_device_steps_reduce_over_the_tuple(runs):
  """pmap style: each device's step sees its 4 rows; pmean over ("data", "fsdp") averages the 4
  slices (the two tensor devices of a slice compute alike)."""
  ks = {k: w.train(7, k, style="per_device") for k in (1, 3)}
  assert ks[1]["params"] == ks[3]["params"] and ks[1]["losses"] == ks[3]["losses"]
  # the same trajectory as the global step on the sharded state, to float32 rounding
  np.testing.assert_allclose(ks[3]["losses"], runs[3]["losses"], rtol=1e-5)
  # each device's first id of step 6, psummed over the tuple: the 4 slices' (not the 8
  # devices') first ids added, 69 + 32 + 82 + 30
  firsts = sum(rows[0] for d, rows in expected_rows(6).items() if d % 2 == 0)
  assert firsts == 213 and ks[3]["ids"] == {d: [firsts] * 16 for d in range(8)}


def test_a_per_device_step_that_averages_over_data_only_is_caught_naming_the_axes():
  with pytest.raises(ValueError, match=re.escape(
      "differ across the axes ('data', 'fsdp'): a step_style='per_device' train_step must keep "
      "the state identical on every device, e.g. average gradients with "
      "jax.lax.pmean(grads, ('data', 'fsdp'))")):
    mesh = w.make_mesh()
    loopkit.TrainLoop(w.make_per_device_step("data"), iterations_per_loop=2, mesh=mesh,
                      data_axis=w.BATCH_AXES, step_style="per_device").run(
        w.init_state(mesh, sharded=False), sources.ArraySource(w.dataset(), 16), num_steps=2)


# -- 2 processes x 4 devices ------------------------------------------------------------------


def test_two_processes_of_four_devices_train_as_one_process_of_eight(runs):
  p0, p1 = testing.run_processes(w.two_process_run, num_processes=2, devices_per_process=4,
                                 timeout_s=120)
  for k_index, k in enumerate((1, 3)):
    a, b = p0["runs"][k_index], p1["runs"][k_index]
    assert (a["process_count"], a["device_count"], a["compiles"], a["step"]) == (2, 8, 1, 7)
    # each process holds its 4 devices' shards: the rows of its half of every global batch
    assert sorted(a["ids"]) == [0, 1, 2, 3] and sorted(b["ids"]) == [4, 5, 6, 7]
    assert {**a["ids"], **b["ids"]} == runs[k]["ids"] == expected_rows(6)
    assert a["specs"] == runs[k]["specs"]
    assert a["losses"] == b["losses"]
    np.testing.assert_allclose(a["losses"], runs[k]["losses"], rtol=0, atol=ATOL)
    for part in ("params", "mom"):
      two = {leaf: {**a[part][leaf], **b[part][leaf]} for leaf in a[part]}
      for leaf, shards in runs[k][part].items():
        assert sorted(two[leaf]) == sorted(shards), leaf
        for device, value in shards.items():
          np.testing.assert_allclose(two[leaf][device], value, rtol=0, atol=ATOL,
                                     err_msg=f"{part} {leaf} on device {device}")
  # K-invariance holds on 2 processes too, bitwise
  assert p0["runs"][0]["params"] == p0["runs"][1]["params"]
  assert p1["runs"][0]["params"] == p1["runs"][1]["params"]
  assert p0["eval"] == p1["eval"] == {"totals": {"id": 210.0, "scaled": 420.0},
                                      "metrics": {"id": 10.0, "scaled": 20.0},
                                      "num_examples": 21, "num_batches": 3}
