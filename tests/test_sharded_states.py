"""Model-parallel states (issue 37, item 2): a Flax NNX MLP whose kernels and biases are sharded
over the ``fsdp`` and ``tensor`` axes of a ``("data", "fsdp", "tensor")`` mesh (``nnx.
with_partitioning``; the Adam moments sharded alike), the batch on ``("data", "fsdp")``.

The state's shardings, whether the arrays carry them or ``TrainLoop(state_shardings=...)`` gives
them (``PartitionSpec``s from Flax linen's logical axis rules), are kept across every K, saved
by ``CheckpointHook`` and restored onto other mesh shapes, (2, 2, 2) -> (1, 4, 2) -> (8, 1, 1) ->
one device: each hop's restored values are bitwise the last run's, each leaf's spec is its
annotation's, on the new mesh. A sharding that does not fit the new mesh is refused before step
1, naming the leaf.
"""

import gc
import math
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import loopkit
from loopkit.tools import aot
from tests import toy

nnx = pytest.importorskip("flax.nnx")

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")
SPECS = {  # (layer, parameter) -> the PartitionSpec its annotation gives, on every mesh
    ("up", "kernel"): P("fsdp", "tensor"), ("up", "bias"): P("tensor"),
    ("down", "kernel"): P("tensor", "fsdp"), ("down", "bias"): P("fsdp")}


def mesh_of(shape):
  """A ``("data", "fsdp", "tensor")`` mesh of ``shape`` over the first devices (Auto axes)."""
  n = int(np.prod(shape))
  return jax.make_mesh(shape, AXES, devices=jax.devices()[:n],
                       axis_types=(jax.sharding.AxisType.Auto,) * 3)


class MLP(nnx.Module):
  """[B, d] -> [B, d]: a Transformer's MLP block, its parameters annotated for FSDP + tensor
  parallelism (``up`` column-split over ``tensor``, ``down`` row-split; ``d`` over ``fsdp``)."""

  def __init__(self, d: int, rngs: nnx.Rngs):
    def part(init, axes):
      return nnx.with_partitioning(init, axes)
    lecun, zeros = nnx.initializers.lecun_normal(), nnx.initializers.zeros_init()
    self.up = nnx.Linear(d, 16, kernel_init=part(lecun, SPECS["up", "kernel"]),
                         bias_init=part(zeros, SPECS["up", "bias"]), rngs=rngs)
    self.down = nnx.Linear(16, d, kernel_init=part(lecun, SPECS["down", "kernel"]),
                           bias_init=part(zeros, SPECS["down", "bias"]), rngs=rngs)

  def __call__(self, x):
    return self.down(jax.nn.relu(self.up(x)))


def create(mesh, seed=0, d=8):
  """The model and its Adam optimizer, their arrays placed on ``mesh`` as their annotations say
  (``nnx.get_named_sharding``; the moments inherit their parameter's annotation)."""
  with nnx.use_eager_sharding(False):  # made on one device, then placed (no compile per mesh)
    model = MLP(d, nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  state = nnx.state((model, optimizer))
  nnx.update((model, optimizer), jax.device_put(state, nnx.get_named_sharding(state, mesh)))
  return model, optimizer


def train_step(model, optimizer, batch):
  def loss_fn(m):
    return jnp.mean((m(batch["x"]) - batch["y"]) ** 2)
  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return {"loss": loss}


def data(d=8, n=64):
  rng = np.random.default_rng(0)
  return {"x": rng.normal(size=(n, d)).astype(np.float32),
          "y": rng.normal(size=(n, d)).astype(np.float32)}


def nnx_loop(mesh, k, hooks=(), seed=0):
  model, optimizer = create(mesh, seed)
  return loopkit.nnx.NnxTrainLoop(train_step, model, optimizer, iterations_per_loop=k,
                                  mesh=mesh, data_axis=BATCH_AXES, hooks=hooks)


def expected_spec(path) -> P:
  """The spec a state leaf should have: its layer's annotation (parameters and both Adam
  moments), else replicated (the step counters)."""
  keys = tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path)
  return SPECS.get(keys[-2:], P())


def specs(state) -> dict:
  return {jax.tree_util.keystr(p): x.sharding.spec
          for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}


def expected_specs(state) -> dict:
  return {jax.tree_util.keystr(p): expected_spec(p)
          for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]}


def assert_on(state, mesh):
  """Every leaf on ``mesh`` (a ``NamedSharding`` over its devices) with its expected spec."""
  for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
    name = jax.tree_util.keystr(path)
    assert isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh, (name, x.sharding)
  assert specs(state) == expected_specs(state)


def host(state):
  return jax.tree.map(np.asarray, state)


def assert_bitwise(a, b):
  la, lb = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)
  assert len(la) == len(lb)
  for (path, x), y in zip(la, lb):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), jax.tree_util.keystr(path)


# -- kept across K --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def on_222(tmp_path_factory):
  """6 steps on (2, 2, 2) at K = 1 and at K = 3 (2 calls), the latter saving a checkpoint at 6."""
  mesh, d = mesh_of((2, 2, 2)), tmp_path_factory.mktemp("on_222") / "ckpt"
  out = {"mesh": mesh, "dir": d}
  for k in (1, 3):
    model, optimizer = create(mesh)
    loop = loopkit.nnx.NnxTrainLoop(train_step, model, optimizer, iterations_per_loop=k,
                                    mesh=mesh, data_axis=BATCH_AXES,
                                    hooks=[loopkit.CheckpointHook(d)] if k == 3 else [])
    state = loop.run(loopkit.ArraySource(data(), 16), num_steps=6)
    out[k] = {"state": state, "status": loop.status, "compiles": loop.program.compile_count(),
              "model": model}
  return out


def test_every_k_keeps_the_annotated_shardings_and_the_same_bits(on_222):
  for k in (1, 3):
    assert on_222[k]["status"] == "completed" and on_222[k]["compiles"] == 1
    assert_on(on_222[k]["state"], on_222["mesh"])
    assert on_222[k]["model"].up.kernel.get_value().sharding.spec == P("fsdp", "tensor")
  state = on_222[3]["state"]
  on = {a: sum(a in jax.tree.leaves(tuple(s)) for s in specs(state).values())
        for a in ("fsdp", "tensor")}
  assert on == {"fsdp": 9, "tensor": 9}  # 3 copies (param, mu, nu) of 3 leaves on each axis
  assert int(state["optimizer"]["step"]) == 6
  assert_bitwise(on_222[1]["state"], on_222[3]["state"])


# -- saved and restored onto other mesh shapes ---------------------------------------------


def test_a_checkpoint_hops_across_mesh_shapes_keeping_values_and_annotations(on_222, tmp_path):
  """(2, 2, 2) -> (1, 4, 2) -> (8, 1, 1) -> 1 device. On each new mesh the model is created
  there, from another seed (its arrays say the new mesh); the hook restores the checkpoint into
  those shardings: a 0-step run gives the restored state, bitwise the last run's final state;
  then 2 more steps are trained (one compilation) and saved. ``P("fsdp", "tensor")`` stays so
  where both axes have size 1."""
  d = tmp_path / "ckpt"
  shutil.copytree(on_222["dir"], d)  # the checkpoint at step 6, saved on (2, 2, 2)
  source = loopkit.ArraySource(data(), 16)
  previous, step = host(on_222[3]["state"]), 6
  for seed, (shape, k) in enumerate([((1, 4, 2), 1), ((8, 1, 1), 2), ((1, 1, 1), None)], 1):
    mesh = mesh_of(shape)
    ckpt = loopkit.CheckpointHook(d)
    loop = nnx_loop(mesh, k or 1, hooks=[ckpt], seed=seed)
    restored = loop.run(source, num_steps=step)
    assert ckpt.restored_step == step and loop.program.compile_count() == 0, shape
    assert_on(restored, mesh)
    assert_bitwise(restored, previous)
    if k is None:
      break
    step += 2
    out = loop.run(source, num_steps=step)
    assert loop.status == "completed" and ckpt.saved_steps == [step], shape
    assert loop.program.compile_count() == 1
    assert_on(out, mesh)
    previous = host(out)
  assert step == 10 and ckpt.all_steps() == [6, 8, 10]


# -- given as PartitionSpecs: linen's logical axis rules ------------------------------------

RULES = (("embed", "fsdp"), ("mlp", "tensor"))  # logical axis -> mesh axis (lm1b's form)


def linen_model(d=8, h=16):
  """A linen MLP (``d -> h -> d``) with logical partitioning (lm1b's way), its Adam step, its
  init and the state's PartitionSpecs from ``RULES`` (mesh-independent: ``nn.logical_to_mesh``)."""
  nn = pytest.importorskip("flax.linen")

  def part(init, axes):
    return nn.with_logical_partitioning(init, axes)

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Dense(h, kernel_init=part(nn.initializers.lecun_normal(), ("embed", "mlp")),
                   bias_init=part(nn.initializers.zeros, ("mlp",)))(x)
      return nn.Dense(d, kernel_init=part(nn.initializers.lecun_normal(), ("mlp", "embed")),
                      bias_init=part(nn.initializers.zeros, ("embed",)))(nn.relu(x))

  model, tx = Block(), optax.adam(1e-2)

  def init(key):
    params = model.init(key, jnp.zeros((1, d)))["params"]
    return {"params": params, "opt": tx.init(params), "step": jnp.zeros((), jnp.int32)}

  def step(state, batch):
    def loss_fn(p):
      return jnp.mean((model.apply({"params": p}, batch["x"]) - batch["y"]) ** 2)
    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    updates, opt = tx.update(grads, state["opt"], state["params"])
    return ({"params": optax.apply_updates(state["params"], updates), "opt": opt,
             "step": state["step"] + 1}, {"loss": loss})

  abstract = jax.eval_shape(init, jax.random.key(0))
  state_specs = nn.logical_to_mesh(nn.get_partition_spec(abstract), RULES)
  return nn, init, step, state_specs


def test_partition_specs_from_logical_rules_place_a_host_state_and_restore_it_elsewhere(
    tmp_path):
  """``state_shardings=`` the state's PartitionSpecs (linen's logical axis rules): a state
  initialised unsharded is placed by them; the same specs restore its checkpoint onto another
  mesh shape into a differently initialised state, bitwise."""
  nn, init, step, state_specs = linen_model()
  d = str(tmp_path / "ckpt")
  source = loopkit.ArraySource(data(), 16)
  outs = {}
  for shape, seed, num_steps in [((2, 2, 2), 0, 2), ((1, 4, 2), 1, 2)]:
    mesh, ckpt = mesh_of(shape), loopkit.CheckpointHook(d)
    state = nn.meta.unbox(init(jax.random.key(seed)))  # on one device: no sharding of its own
    loop = loopkit.TrainLoop(step, iterations_per_loop=2, mesh=mesh, data_axis=BATCH_AXES,
                             state_shardings=state_specs, hooks=[ckpt])
    outs[shape] = out = loop.run(state, source, num_steps=num_steps)
    for path, x in jax.tree_util.tree_flatten_with_path(out)[0]:
      assert x.sharding.mesh == mesh, jax.tree_util.keystr(path)
    got = specs(out)
    assert got == {jax.tree_util.keystr(p): spec
                   for p, spec in jax.tree_util.tree_flatten_with_path(state_specs)[0]}
    assert got["['params']['Dense_0']['kernel']"] == P("fsdp", "tensor")
    assert got["['opt'][0].nu['Dense_1']['bias']"] == P("fsdp")
    assert got["['step']"] == P()
    assert sum("tensor" in jax.tree.leaves(tuple(s)) for s in got.values()) == 9
  assert ckpt.restored_step == 2 and loop.program.compile_count() == 0  # nothing to run
  assert_bitwise(outs[(1, 4, 2)], host(outs[(2, 2, 2)]))


def device_bytes(arrays=None) -> int:
  """Bytes ``arrays`` (default: the live arrays) hold on the devices, a replicated leaf once
  per device (read from the shardings: ``addressable_shards`` would make arrays)."""
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
             * len(x.sharding.device_set)
             for x in (jax.live_arrays() if arrays is None else arrays))


class BytesProbe(loopkit.Hook):
  """Records :func:`device_bytes` at ``on_run_start`` (where it stands in the hook order)."""

  def __init__(self):
    super().__init__(at_end=False)
    self.seen = None

  def on_run_start(self, ctx, state):
    self.seen = device_bytes()


def test_c78_an_abstract_state_resumes_on_another_mesh_in_one_copy(tmp_path):
  """C78: ``run`` given ``jax.eval_shape(init)`` with ``state_shardings`` resumes a (2, 2, 2)
  checkpoint on (1, 4, 2) bitwise as from an initialised state, each leaf on its spec, and
  allocates only the restored arrays: none before the restore (an initialised state: a whole
  copy), one state's bytes after it (an initialised state: two). A 1.6 MB model (Adam)."""
  nn, init, step, state_specs = linen_model(d=64, h=1024)
  source = loopkit.ArraySource(data(64), 16)
  saved = {**nn.meta.unbox(init(jax.random.key(0))), "step": jnp.asarray(2, jnp.int32)}
  saved = jax.device_put(saved, jax.tree.map(lambda p: NamedSharding(mesh_of((2, 2, 2)), p),
                                             state_specs))
  hook = loopkit.CheckpointHook(tmp_path / "ckpt")
  hook.save(2, saved, ledger=loopkit.core.Ledger(step=2), data_position=2)
  hook.close()
  mesh = mesh_of((1, 4, 2))
  outs, seen = {}, {}
  for kind in ("abstract", "concrete"):
    shutil.copytree(tmp_path / "ckpt", tmp_path / kind)
    state = (jax.eval_shape(init, jax.random.key(1)) if kind == "abstract"
             else init(jax.random.key(1)))  # another seed: the checkpoint wins
    state = nn.meta.unbox(state)
    before, after = BytesProbe(), BytesProbe()
    loop = loopkit.TrainLoop(step, iterations_per_loop=2, mesh=mesh, data_axis=BATCH_AXES,
                             state_shardings=state_specs,
                             hooks=[before, loopkit.CheckpointHook(tmp_path / kind), after])
    gc.collect()
    start = device_bytes()
    outs[kind] = loop.run(state, source, num_steps=4)
    seen[kind] = (before.seen - start, after.seen - start)
    assert loop.hooks[1].restored_step == 2 and loop.program.compile_count() == 1
  one_copy = device_bytes(jax.tree.leaves(outs["abstract"]))
  assert 1_500_000 < one_copy < 1_700_000
  # (the run's own scalars, a few bytes: < 64)
  copies = {kind: tuple(round(b / one_copy, 3) for b in got) for kind, got in seen.items()}
  assert copies == {"abstract": (0, 1), "concrete": (1, 2)}, seen
  assert seen["abstract"][0] == 0 and 0 <= seen["abstract"][1] - one_copy < 64, seen
  assert specs(outs["abstract"]) == specs(outs["concrete"]) == {
      jax.tree_util.keystr(p): spec
      for p, spec in jax.tree_util.tree_flatten_with_path(state_specs)[0]}
  assert all(x.sharding.mesh == mesh for x in jax.tree.leaves(outs["abstract"]))
  assert_bitwise(outs["abstract"], host(outs["concrete"]))


def test_c78_an_abstract_state_without_a_checkpoint_is_refused_naming_its_leaves(tmp_path):
  """Without a checkpoint to restore (an empty directory, ``restore=False``, no hook), the
  error says an abstract state needs one, naming the leaves, before any step."""
  nn, init, step, state_specs = linen_model()
  abstract = nn.meta.unbox(jax.eval_shape(init, jax.random.key(0)))
  for hooks in ([loopkit.CheckpointHook(tmp_path / "empty")], []):
    loop = loopkit.TrainLoop(step, iterations_per_loop=2, mesh=mesh_of((2, 2, 2)),
                             data_axis=BATCH_AXES, state_shardings=state_specs, hooks=hooks)
    with pytest.raises(ValueError) as error:
      loop.run(abstract, loopkit.ArraySource(data(), 16), num_steps=2)
    assert str(error.value).startswith(
        "TrainLoop.run was given an abstract state and no hook restored it: its leaves "
        "opt/0/count (int32[]), opt/0/mu/Dense_0/bias (float32[16]), "
        "opt/0/mu/Dense_0/kernel (float32[8, 16]), ... (14 in all) are abstract "
        "(jax.ShapeDtypeStruct). An abstract state (jax.eval_shape(init), with shardings or "
        "state_shardings=) needs a checkpoint that restores every leaf: a CheckpointHook whose"
        " directory holds a checkpoint"), str(error.value)
    assert loop.program.compile_count() == 0 and loop.ledger.step == 0


def test_c78_a_hook_that_returns_an_abstract_state_is_refused_naming_it():
  """Only the state given to ``run`` may be abstract: a hook's replacement needs values."""
  hook = loopkit.CallbackHook(lambda info, state: jax.eval_shape(lambda s: s, state),
                              every_steps=2)
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=2, hooks=[hook])
  with pytest.raises(ValueError, match=r"^CallbackHook returned a state without values: its "
                     r"leaves opt/0/count \(int32\[\]\), .* are abstract"):
    loop.run(toy.init_state(), toy.batches(4), num_steps=4)
  assert loop.ledger.step == 2 and int(loop.last_state["step"]) == 2


def test_named_shardings_as_jit_was_given_them_are_taken_as_they_are():
  """lm1b's ``state_sharding`` (``nn.logical_to_mesh_sharding``), what its ``jax.jit`` train
  step took as ``in_shardings``, is a ``state_shardings=`` too; a prefix applies to a subtree."""
  nn, init, step, state_specs = linen_model()
  mesh = mesh_of((2, 2, 2))
  abstract = jax.eval_shape(init, jax.random.key(0))
  named = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, RULES)
  state = nn.meta.unbox(init(jax.random.key(0)))
  prefix = {"params": named["params"], "opt": named["opt"], "step": None}
  for given in (named, prefix):
    loop = loopkit.TrainLoop(step, iterations_per_loop=2, mesh=mesh, data_axis=BATCH_AXES,
                             state_shardings=given)
    placed = loop.program.place_state(state)
    assert specs(placed) == {jax.tree_util.keystr(p): s.spec
                             for p, s in jax.tree_util.tree_flatten_with_path(named)[0]}
    assert jax.tree.leaves(placed)[0].sharding.mesh == mesh


def test_state_shardings_move_a_state_from_another_mesh():
  """A state on the (2, 2, 2) mesh given to a loop on (1, 4, 2) with PartitionSpecs is placed
  on the new mesh (without them it would be refused: C60), values unchanged."""
  nn, init, step, state_specs = linen_model()
  old, new = mesh_of((2, 2, 2)), mesh_of((1, 4, 2))
  state = jax.device_put(nn.meta.unbox(init(jax.random.key(0))),
                         jax.tree.map(lambda p: NamedSharding(old, p), state_specs))
  loop = loopkit.TrainLoop(step, iterations_per_loop=2, mesh=new, data_axis=BATCH_AXES,
                           state_shardings=state_specs)
  placed = loop.program.place_state(state)
  assert all(x.sharding.mesh == new for x in jax.tree.leaves(placed))
  assert specs(placed) == specs(state) and specs(state)["['params']['Dense_0']['kernel']"] == P(
      "fsdp", "tensor")
  assert_bitwise(placed, host(state))


# -- refused before step 1, naming the leaf ------------------------------------------------


def test_a_spec_that_does_not_divide_a_dimension_on_the_new_mesh_names_the_leaf():
  """A width of 12 splits over fsdp=2 of (2, 2, 2) but not over fsdp=8 of (1, 8, 1)."""
  nn, init, step, state_specs = linen_model(d=12)
  abstract = nn.meta.unbox(jax.eval_shape(init, jax.random.key(0)))
  state = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract)  # refused before use
  loop = loopkit.TrainLoop(step, iterations_per_loop=2, mesh=mesh_of((1, 8, 1)),
                           data_axis=BATCH_AXES, state_shardings=state_specs)
  with pytest.raises(ValueError) as error:
    loop.run(state, loopkit.ArraySource(data(12), 16), num_steps=2)
  assert str(error.value) == (
      "state leaf opt/0/mu/Dense_0/kernel (shape (12, 16)) cannot be sharded as "
      f"{P('fsdp', 'tensor')} on the mesh {{'data': 1, 'fsdp': 8, 'tensor': 1}} over "
      "devices 0-7: its dimension 0 (size 12) would be split over fsdp=8 = 8 devices, which "
      "does not divide it. Shard that leaf over other axes on this mesh (state_shardings=, or "
      "the logical axis rules that make its sharding), or pick a mesh whose axes divide it")
  assert loop.ledger is None and loop.program.compile_count() == 0
  assert not any(x.is_deleted() for x in jax.tree.leaves(state))  # not donated


BAD_GIVEN = {
    "an axis the mesh lacks": (
        lambda specs, other: {**specs, "step": P("model")}, ValueError,
        f"state_shardings gives state leaf step the PartitionSpec {P('model')}, "
        "which names the axis 'model' that the loop's mesh {'data': 2, 'fsdp': 2, 'tensor': 2}"
        " over devices 0-7 lacks"),
    "a key the state lacks": (
        lambda specs, other: {**specs, "optim": None}, ValueError,
        "state_shardings has an entry at optim, which is not a subtree of the state"),
    "a subtree left out": (
        lambda specs, other: {"params": specs["params"], "step": P()}, ValueError,
        "state leaf opt/0/count has no entry in state_shardings"),
    "another mesh": (
        lambda specs, other: {**specs, "step": NamedSharding(other, P())}, ValueError,
        f"state_shardings gives state leaf step the sharding {P()} on the mesh "
        "{'data': 4, 'model': 2} over devices 0-7, but the loop's mesh is {'data': 2, 'fsdp': 2,"
        " 'tensor': 2} over devices 0-7: give shardings on the loop's mesh, or PartitionSpecs"),
    "not a sharding": (
        lambda specs, other: {**specs, "step": "fsdp"}, TypeError,
        "state_shardings gives state leaf step 'fsdp' (str): each entry must be a "
        "PartitionSpec, a NamedSharding or None"),
}


@pytest.mark.parametrize("case", sorted(BAD_GIVEN))
def test_bad_state_shardings_are_refused_naming_the_leaf(case):
  make, error, text = BAD_GIVEN[case]
  nn, init, step, state_specs = linen_model()
  other = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  state = nn.meta.unbox(init(jax.random.key(0)))
  loop = loopkit.TrainLoop(step, iterations_per_loop=2, mesh=mesh_of((2, 2, 2)),
                           data_axis=BATCH_AXES, state_shardings=make(state_specs, other))
  with pytest.raises(error) as raised:
    loop.run(state, loopkit.ArraySource(data(), 16), num_steps=2)
  assert text in str(raised.value), str(raised.value)
  assert loop.ledger is None and loop.program.compile_count() == 0


def test_a_sharded_state_in_the_per_device_style_is_refused_with_state_shardings_too():
  nn, init, step, state_specs = linen_model()
  loop = loopkit.TrainLoop(step, iterations_per_loop=2, mesh=mesh_of((2, 2, 2)),
                           data_axis=BATCH_AXES, step_style="per_device",
                           state_shardings=state_specs)
  with pytest.raises(ValueError, match=r"state leaf opt/0/mu/Dense_0/bias "
                     r"\(shape \(16,\)\) is sharded as (P|PartitionSpec)\('tensor',\) on the "
                     r"mesh .*step_style='per_device' keeps the state replicated"):
    loop.run(nn.meta.unbox(init(jax.random.key(0))), loopkit.ArraySource(data(), 16),
             num_steps=2)


def test_c60_an_nnx_model_sharded_on_its_mesh_and_a_loop_without_mesh_is_refused():
  """C60 with Flax NNX objects: the NnxTrainLoop's default mesh would replicate the model."""
  model, optimizer = create(mesh_of((2, 2, 2)))
  loop = loopkit.nnx.NnxTrainLoop(train_step, model, optimizer, iterations_per_loop=2)
  with pytest.raises(ValueError) as error:
    loop.run(loopkit.ArraySource(data(), 16), num_steps=2)
  message = str(error.value)
  assert message.startswith(
      f"state leaf model/down/bias (shape (8,)) is sharded as {P('fsdp')} "
      "on the mesh {'data': 2, 'fsdp': 2, 'tensor': 2} over devices 0-7, but the loop's mesh "
      "is {'data': 8} over devices 0-7 (the default of a TrainLoop built without mesh=): the "
      "loop would replicate it (12 of 14 state leaves would lose their sharding). Build the "
      "loop on the state's mesh: TrainLoop(..., mesh=<that mesh>"), message
  assert "state_shardings=<a pytree of PartitionSpecs>" in message
  assert loop.ledger is None and model.up.kernel.get_value().sharding.spec == P("fsdp", "tensor")


def test_aot_compiles_with_the_loops_state_shardings_on_the_target_mesh():
  """``compile_for`` builds the target program with the loop's ``state_shardings`` (as
  PartitionSpecs on the target mesh): an abstract state without shardings compiles sharded."""
  nn, init, step, state_specs = linen_model()
  loop = loopkit.TrainLoop(step, iterations_per_loop=2, mesh=mesh_of((2, 2, 2)),
                           data_axis=BATCH_AXES, state_shardings=state_specs)
  target = mesh_of((1, 4, 2))
  abstract = nn.meta.unbox(jax.eval_shape(init, jax.random.key(0)))
  batch = {k: jax.ShapeDtypeStruct((16, 8), jnp.float32) for k in ("x", "y")}
  report = aot.compile_for(loop, abstract, batch, mesh=target)
  got = report.train.executable.input_shardings[0][0]  # (state, chunk, num_steps)'s state
  assert got["params"]["Dense_0"]["kernel"] == NamedSharding(target, P("fsdp", "tensor"))
  assert got["opt"][0].mu["Dense_1"]["kernel"].spec == P("tensor", "fsdp")
  assert loop.program.compile_count() == 0
