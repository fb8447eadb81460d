"""Warm start (issue 38): a run's state from chosen leaves of another run's checkpoint.

One source run (a two-layer model trained 6 steps with CheckpointHook, module fixture) is
read into fresh states: its params only (fresh optimizer, ledger at 0), renamed keys, a new
head (shape mismatch error naming the leaf, then excluded), added leaves, a dtype cast, a
plain Orbax params checkpoint (StandardCheckpointer, and a CheckpointManager's item as
Flax's examples write), another mesh, and the hook's ``init_from`` (resumes from its own
checkpoints after the first run, never from the source again).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import loopkit
from loopkit.checkpoint import CheckpointHook, WarmStart, WarmStartError, warm_start

TX = optax.adam(0.05)


def init(seed=1, classes=2, body="body", extra=False, dtype=jnp.float32):
  k1, k2 = jax.random.split(jax.random.key(seed))
  params = {body: {"kernel": (jax.random.normal(k1, (8, 4)) * 0.5).astype(dtype)},
            "head": {"kernel": (jax.random.normal(k2, (4, classes)) * 0.5).astype(dtype),
                     "bias": jnp.zeros((classes,), dtype)}}
  if extra:
    params["extra"] = {"scale": jnp.full((4,), 7.0, dtype)}
  return {"params": params, "opt": TX.init(params), "step": jnp.zeros((), jnp.int32)}


def train_step(state, batch):
  def loss_fn(p):
    body = next(v for k, v in p.items() if k not in ("head", "extra"))
    h = jnp.tanh(batch["x"] @ body["kernel"])
    logits = h @ p["head"]["kernel"] + p["head"]["bias"]
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), batch["y"]))
  loss, grads = jax.value_and_grad(loss_fn)(state["params"])
  updates, opt = TX.update(grads, state["opt"], state["params"])
  return ({"params": optax.apply_updates(state["params"], updates), "opt": opt,
           "step": state["step"] + 1}, {"loss": loss})


def batches(n, classes=2, seed=0):
  rng = np.random.default_rng(seed)
  return [{"x": rng.normal(size=(8, 8)).astype(np.float32),
           "y": rng.integers(0, classes, size=(8,)).astype(np.int32)} for _ in range(n)]


def assert_equal(a, b):
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
  """``(checkpoint directory, the state saved at its latest step 6)`` of a 6-step run."""
  directory = tmp_path_factory.mktemp("source") / "checkpoints"
  hook = CheckpointHook(directory, every_steps=3)
  state = loopkit.TrainLoop(train_step, iterations_per_loop=3, hooks=[hook]).run(
      init(seed=0), batches(6), num_steps=6)
  assert hook.all_steps() == [3, 6]
  return directory, jax.device_get(state)


def test_params_only_fresh_optimizer_and_ledger_at_zero(source, tmp_path):
  """The default: the source's params, the fresh state's optimizer state and step; a hook's
  warm-started run counts from step 0 and equals a run from warm_start's state, bitwise."""
  directory, saved = source
  fresh = init()
  state = warm_start(fresh, directory)
  assert_equal(state["params"], saved["params"])
  assert_equal(state["opt"], fresh["opt"])
  assert int(state["step"]) == 0

  hook = CheckpointHook(tmp_path / "tune", init_from=directory)
  loop = loopkit.TrainLoop(train_step, iterations_per_loop=2, hooks=[hook])
  tuned = loop.run(init(), batches(3, seed=1), num_steps=3)
  assert (hook.restored_step, hook.saved_steps, loop.ledger.step) == (None, [3], 3)
  assert hook.warm_started.startswith(f"warm start from {directory / '6' / 'state'} step 6: "
                                      "3 leaves read, 8 kept as they were")
  assert int(tuned["opt"][0].count) == 3  # a fresh optimizer: 3 updates, not 6 + 3
  straight = loopkit.TrainLoop(train_step, iterations_per_loop=2).run(
      state, batches(3, seed=1), num_steps=3)
  assert_equal(tuned, straight)


def test_a_killed_warm_started_run_resumes_from_its_own_checkpoint(source, tmp_path):
  """Run twice on one directory: the second run restores step 4 of its own (not the source's
  params), and ends bitwise where one uninterrupted warm-started run ends."""
  directory, saved = source
  data = batches(8, seed=2)
  first = CheckpointHook(tmp_path / "tune", every_steps=4, init_from=directory)
  loopkit.TrainLoop(train_step, iterations_per_loop=2, hooks=[first]).run(
      init(), data, num_steps=4)   # stands in for a run killed after its save at 4
  assert first.warm_started is not None and first.saved_steps == [4]
  again = CheckpointHook(tmp_path / "tune", every_steps=4, init_from=directory)
  back = again.restore(init())
  assert back.step == 4
  assert not np.array_equal(back.state["params"]["body"]["kernel"],
                            saved["params"]["body"]["kernel"])
  loop = loopkit.TrainLoop(train_step, iterations_per_loop=2, hooks=[again])
  resumed = loop.run(init(), data, num_steps=8)
  assert (again.restored_step, again.warm_started, again.saved_steps) == (4, None, [8])
  straight = loopkit.TrainLoop(train_step, iterations_per_loop=2).run(
      warm_start(init(), directory), data, num_steps=8)
  assert_equal(resumed, straight)


def test_reading_the_step_counter_starts_the_ledger_at_the_source_step(source, tmp_path):
  """select=None reads every leaf, the step counter too: the run continues at step 6."""
  directory, saved = source
  hook = CheckpointHook(tmp_path / "cont", init_from=WarmStart(directory, select=None))
  loop = loopkit.TrainLoop(train_step, iterations_per_loop=2, hooks=[hook])
  state = loop.run(init(), batches(2, seed=3), num_steps=8)
  assert (hook.saved_steps, loop.ledger.step, int(state["opt"][0].count)) == ([8], 8, 8)


def test_a_renamed_key_is_listed_with_a_rename_that_maps_it(source):
  directory, saved = source
  with pytest.raises(WarmStartError) as e:
    warm_start(init(body="encoder"), directory)
  text = str(e.value)
  assert text.startswith(f"warm start from {directory / '6' / 'state'} (step 6): 1 leaf of "
                         "the train state cannot be taken from the source\n"
                         "  1 not in the source (map each to a source path with rename=")
  assert "    params/encoder/kernel  float32[8,4]\n" in text
  assert ("  source leaves under params that no train-state leaf takes (1):\n"
          "    params/body/kernel  float32[8,4]\n") in text
  assert text.endswith("  perhaps: rename={'params/encoder': 'params/body'}")
  state = warm_start(init(body="encoder"), directory, rename={"params/encoder": "params/body"})
  assert_equal(state["params"]["encoder"], saved["params"]["body"])
  with pytest.raises(ValueError, match=r"rename pattern 'params/decoder' matches no chosen"):
    warm_start(init(body="encoder"), directory, rename={"params/decoder": "params/body"})


def test_a_new_head_is_refused_by_shape_then_kept_fresh_with_exclude(source):
  directory, saved = source
  fresh = init(classes=5)
  with pytest.raises(WarmStartError) as e:
    warm_start(fresh, directory)
  text = str(e.value)
  assert ("  2 with another shape in the source (keep the fresh value with "
          "exclude='params/head', or rename it to a source leaf of its shape):\n"
          "    params/head/bias  float32[5] in the train state, params/head/bias  float32[2] "
          "in the source\n"
          "    params/head/kernel  float32[4,5] in the train state, params/head/kernel  "
          "float32[4,2] in the source") in text
  state = warm_start(fresh, directory, exclude="params/head")
  assert_equal(state["params"]["body"], saved["params"]["body"])
  assert_equal(state["params"]["head"], fresh["params"]["head"])


def test_two_leaves_may_take_one_source_leaf(source):
  """A layer copied into two (many-to-one rename), each in its own dtype and sharding."""
  directory, saved = source
  mesh = jax.make_mesh((8,), ("a",), devices=jax.devices()[:8])
  live = {"params": {"a": jnp.zeros((8, 4)),
                     "b": jax.device_put(jnp.zeros((8, 4), jnp.bfloat16),
                                         NamedSharding(mesh, P("a", None)))}}
  state = warm_start(live, directory, rename={"params/(a|b)": "params/body/kernel"})
  body = saved["params"]["body"]["kernel"]
  assert_equal(state["params"], {"a": body, "b": body.astype(jnp.bfloat16)})
  assert state["params"]["b"].dtype == jnp.bfloat16
  assert state["params"]["b"].sharding == live["params"]["b"].sharding


def test_an_added_leaf_needs_missing_keep(source):
  directory, saved = source
  fresh = init(extra=True)
  with pytest.raises(WarmStartError, match=r"1 not in the source .*\n    params/extra/scale  "
                     r"float32\[4\]"):
    warm_start(fresh, directory)
  state = warm_start(fresh, directory, missing="keep")
  assert_equal(state["params"]["extra"], fresh["params"]["extra"])
  assert_equal(state["params"]["head"], saved["params"]["head"])


def test_dtypes_are_cast_unless_cast_false(source):
  directory, saved = source
  state = warm_start(init(dtype=jnp.bfloat16), directory)
  assert state["params"]["body"]["kernel"].dtype == jnp.bfloat16
  assert_equal(state["params"], jax.tree.map(lambda x: x.astype(jnp.bfloat16), saved["params"]))
  with pytest.raises(WarmStartError, match=r"3 with another dtype in the source .*\n    "
                     r"params/body/kernel  bfloat16\[8,4\] in the train state, "
                     r"params/body/kernel  float32\[8,4\] in the source"):
    warm_start(init(dtype=jnp.bfloat16), directory, cast=False)


def test_a_pattern_that_matches_nothing_names_the_leaves(source):
  directory, _ = source
  with pytest.raises(ValueError, match=r"select pattern 'parms' matches no leaf of the train "
                     r"state \(its leaves: opt/0/count, .*params/body/kernel"):
    warm_start(init(), directory, select="parms")


def test_plain_orbax_params_checkpoints(source, tmp_path):
  """What Flax's examples and other trainers write: params alone through StandardCheckpointer
  (read with rename={"params": ""}), and a whole state as a CheckpointManager's item."""
  _, saved = source
  params_dir = tmp_path / "params"
  with ocp.StandardCheckpointer() as c:
    c.save(params_dir, saved["params"])
  with pytest.raises(WarmStartError, match=r"perhaps: rename=\{'params': ''\}$"):
    warm_start(init(), params_dir)
  state = warm_start(init(), params_dir, rename={"params": ""})
  assert_equal(state["params"], saved["params"])

  with ocp.CheckpointManager(tmp_path / "managed") as m:
    m.save(6, args=ocp.args.StandardSave(saved))
    m.wait_until_finished()
  state = warm_start(init(), tmp_path / "managed")  # its step 6, its only item "default"
  assert_equal(state["params"], saved["params"])
  assert int(state["step"]) == 0
  state = warm_start(init(), tmp_path / "managed", step=6, item="default")
  assert_equal(state["params"], saved["params"])
  with pytest.raises(FileNotFoundError, match=r"no checkpoint 5 in .*managed \(found \[6\]\)"):
    warm_start(init(), tmp_path / "managed", step=5)
  with pytest.raises(ValueError, match=r"step=5 chooses a step directory .*params is one "):
    warm_start(init(), params_dir, step=5)


def test_a_tree_in_memory_is_a_source_too(source):
  """E.g. what flax.training.checkpoints.restore_checkpoint(path, target=None) returns: numpy
  leaves, cast and placed like the ones read from a directory."""
  _, saved = source
  state = warm_start(init(dtype=jnp.bfloat16), {"model": saved["params"]},
                     rename={"params": "model"})
  assert state["params"]["head"]["kernel"].dtype == jnp.bfloat16
  assert isinstance(state["params"]["head"]["kernel"], jax.Array)
  assert_equal(state["params"], jax.tree.map(lambda x: x.astype(jnp.bfloat16), saved["params"]))


def test_a_flax_nnx_state_saved_as_flax_examples_save_it(tmp_path):
  """Flax NNX's examples save ``nnx.split(model)[1]`` with StandardCheckpointer: each array under
  its Variable's ``value``. Read into plain dicts (``nnx.to_pure_dict``), the error suggests the
  rename, and with it the params and BatchNorm statistics come back."""
  from flax import nnx

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.linear = nnx.Linear(3, 4, rngs=rngs)
      self.bn = nnx.BatchNorm(4, rngs=rngs)
      self.dropout = nnx.Dropout(0.1, rngs=rngs)

  model = Net(nnx.Rngs(0))
  model.bn.mean[...] = jnp.arange(4.0)  # statistics that are not the fresh ones
  with ocp.StandardCheckpointer() as c:
    c.save(tmp_path / "state", nnx.split(model)[1])
  fresh = Net(nnx.Rngs(1))
  live = {"params": nnx.to_pure_dict(nnx.state(fresh, nnx.Param)),
          "batch_stats": nnx.to_pure_dict(nnx.state(fresh, nnx.BatchStat)),
          "step": jnp.zeros((), jnp.int32)}
  with pytest.raises(WarmStartError, match=r"perhaps: rename=\{'params/\(\.\*\)': "
                     r"r'\\1/value'\}$"):
    warm_start(live, tmp_path / "state")
  state = warm_start(live, tmp_path / "state", select=("params", "batch_stats"),
                     rename={"(params|batch_stats)/(.*)": r"\2/value"})
  assert_equal(state["params"], nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  assert_equal(state["batch_stats"], nnx.to_pure_dict(nnx.state(model, nnx.BatchStat)))
  np.testing.assert_array_equal(state["batch_stats"]["bn"]["mean"], np.arange(4.0))


def test_read_onto_another_mesh(source):
  """Saved on one device by the source run; read onto 8 devices with the body's kernel
  sharded by rows, then onto a (2, 4) mesh sharded on both axes: each leaf keeps the live
  leaf's sharding, and its values are the source's."""
  directory, saved = source
  for shape, spec in (((8,), P("a", None)), ((2, 4), P("a", "b"))):
    mesh = jax.make_mesh(shape, ("a", "b")[:len(shape)], devices=jax.devices()[:8])
    fresh = init()
    live = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P())), fresh)
    live["params"]["body"]["kernel"] = jax.device_put(fresh["params"]["body"]["kernel"],
                                                      NamedSharding(mesh, spec))
    state = warm_start(live, directory)
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(live), strict=True):
      assert got.sharding == want.sharding
    assert state["params"]["body"]["kernel"].sharding.spec == spec
    assert_equal(state["params"], saved["params"])


def test_a_resume_into_a_changed_model_points_to_init_from(source):
  """Resuming a directory into a model whose head changed is refused, naming every differing
  leaf in the syntax warm-start patterns are written in, and the init_from that starts the
  changed model from it (excluding the changed params: WarmStart reads params)."""
  directory, _ = source
  with pytest.raises(ValueError) as e:
    CheckpointHook(directory).restore(init(classes=5))
  assert str(e.value) == "\n".join([
      f"checkpoint 6 in {directory} does not match the train state in 6 leaves:",
      *[f"  leaf {name} has shape {a} in the checkpoint, {b} in the train state"
        for name, a, b in (("opt/0/mu/head/bias", "(2,)", "(5,)"),
                           ("opt/0/mu/head/kernel", "(4, 2)", "(4, 5)"),
                           ("opt/0/nu/head/bias", "(2,)", "(5,)"),
                           ("opt/0/nu/head/kernel", "(4, 2)", "(4, 5)"),
                           ("params/head/bias", "(2,)", "(5,)"),
                           ("params/head/kernel", "(4, 2)", "(4, 5)"))],
      "To start a changed model from it (fine-tuning), give the run a new directory with "
      f"init_from=loopkit.checkpoint.WarmStart('{directory}', exclude='params/head') "
      "(docs/checkpointing.md, Warm start)"])
  fine_tune = CheckpointHook(directory.parent / "fine-tune",
                             init_from=WarmStart(directory, exclude="params/head"))
  state = loopkit.TrainLoop(train_step, iterations_per_loop=3, hooks=[fine_tune]).run(
      init(classes=5), batches(3, classes=5), num_steps=3)  # what the message suggests, works
  assert int(state["step"]) == 3


@pytest.mark.parametrize("given,written", [("path", "'{directory}'"), ("WarmStart", "...")])
def test_an_init_from_error_suggests_the_hooks_own_argument(source, tmp_path, given, written):
  """warm_start's error suggests its own arguments (exclude=...); the same error reached
  through CheckpointHook(init_from=...) suggests init_from=WarmStart(..., exclude=...), the
  argument the user wrote."""
  directory, _ = source
  with pytest.raises(WarmStartError, match=r"keep the fresh value with exclude='params/head',"):
    warm_start(init(classes=5), directory)
  init_from = directory if given == "path" else WarmStart(directory)
  hook = CheckpointHook(tmp_path / "tune", init_from=init_from)
  loop = loopkit.TrainLoop(train_step, iterations_per_loop=3, hooks=[hook])
  with pytest.raises(WarmStartError) as e:
    loop.run(init(classes=5), batches(3, classes=5), num_steps=3)
  spelled = written.format(directory=directory)
  assert ("  2 with another shape in the source (keep the fresh value with init_from=loopkit."
          f"checkpoint.WarmStart({spelled}, exclude='params/head'), or rename it to a source "
          "leaf of its shape):\n    params/head/bias  float32[5] in the train state, "
          "params/head/bias  float32[2] in the source\n    params/head/kernel  float32[4,5] in "
          "the train state, params/head/kernel  float32[4,2] in the source") in str(e.value)
  assert " exclude=" not in str(e.value).replace("WarmStart(" + spelled + ", exclude=", "")


def test_a_missing_init_from_source_is_refused_when_the_hook_is_built(source, tmp_path):
  """Not at run start: when the hook is built. A directory with its own checkpoint resumes
  from it and needs no source (a fine-tune restarted after the source was removed)."""
  missing = tmp_path / "no-such-run"
  for init_from in (missing, WarmStart(missing, select="params")):
    with pytest.raises(FileNotFoundError, match=(
        rf"^CheckpointHook\(init_from=...\): the warm-start source {missing} does not exist, "
        rf"and {tmp_path / 'tune'} holds no checkpoint to resume from instead$")):
      CheckpointHook(tmp_path / "tune", init_from=init_from)
  with pytest.raises(FileNotFoundError, match=r"source .* does not exist$"):
    CheckpointHook(tmp_path / "tune", init_from=missing, restore=False)
  directory, _ = source
  hook = CheckpointHook(directory, init_from=missing)  # resumes from its own step 6
  assert hook.latest_step() == 6


def test_every_state_the_loop_takes_flax_train_state_python_scalars_nnx(source, tmp_path):
  """``TrainState.create`` sets ``step=0``, a Python int; a dict may hold a Python float; an
  NNX state a Variable of a Python int. warm_start reads into each (a chosen Python scalar
  comes back an array of the loop's dtype, a kept one as it was), the loop trains the result,
  and CheckpointHook.restore takes the fresh TrainState as its ``like``."""
  from flax import nnx
  from flax.training import train_state
  directory, saved = source
  fresh = init()
  ts = train_state.TrainState.create(apply_fn=None, params=fresh["params"], tx=TX)
  assert ts.step == 0 and type(ts.step) is int
  got = warm_start(ts, directory, select="params")
  assert_equal(got.params, saved["params"])
  assert_equal(got.opt_state, ts.opt_state)
  assert got.step == 0 and type(got.step) is int  # kept as it was
  got = warm_start(ts, directory, select=("params", "step"))
  assert got.step.dtype == jnp.int32 and int(got.step) == 6  # read: the loop's int32

  def ts_step(state, batch):
    grads = jax.grad(lambda p: train_step({"params": p, "opt": TX.init(p), "step": 0},
                                          batch)[1]["loss"])(state.params)
    return state.apply_gradients(grads=grads), {}
  hook = CheckpointHook(tmp_path / "ts", every_steps=3)
  trained = loopkit.TrainLoop(ts_step, iterations_per_loop=3, step_of=lambda s: s.step,
                              hooks=[hook]).run(warm_start(ts, directory), batches(3),
                                                num_steps=3)
  restored = hook.restore(ts)
  assert restored.step == 3 and int(restored.state.step) == 3
  assert_equal(restored.state.params, trained.params)

  plain = {"params": fresh["params"], "scale": 1.0, "step": 0}
  got = warm_start(plain, {"params": saved["params"], "scale": np.float32(2.0)}, select=None,
                   missing="keep")
  assert got["scale"].dtype == jnp.float32 and float(got["scale"]) == 2.0 and got["step"] == 0

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.linear = nnx.Linear(3, 4, rngs=rngs)
      self.count = nnx.Variable(0)

  graphdef, state = nnx.split(Net(nnx.Rngs(0)))
  source_state = nnx.split(Net(nnx.Rngs(1)))[1]
  got = warm_start(state, source_state, select="linear")
  assert_equal(nnx.to_pure_dict(got)["linear"], nnx.to_pure_dict(source_state)["linear"])
  assert nnx.merge(graphdef, got).count.get_value() == 0


def test_a_warm_started_state_and_its_input_are_not_both_run(source):
  """warm_start keeps the leaves it does not read (the same arrays, as a functional update
  does): after a run of the input (which donates them), a run of the result is refused before
  it starts, naming those leaves; the arrays it read are its own."""
  directory, saved = source
  old = init()
  new = warm_start(old, directory)
  assert all(a is b for a, b in zip(jax.tree.leaves(new["opt"]), jax.tree.leaves(old["opt"])))
  assert not any(a is b for a, b in zip(jax.tree.leaves(new["params"]),
                                        jax.tree.leaves(old["params"])))
  loop = loopkit.TrainLoop(train_step, iterations_per_loop=3)
  loop.run(old, batches(3), num_steps=3)
  with pytest.raises(ValueError, match=r"^the train state has 8 deleted arrays \(opt/0/count, "
                     r"opt/0/mu/body/kernel, (opt/[^,]*, ){5}step\): a run donates"):
    loop.run(new, batches(3), num_steps=3)
  assert_equal(new["params"], saved["params"])  # not donated: still readable


def test_c78_an_abstract_state_is_read_where_the_source_gives_every_leaf(source, tmp_path):
  """``warm_start`` and ``init_from`` take ``jax.eval_shape(init)`` (shardings with it) where
  they read every leaf: the leaves come out on their shardings, bitwise a concrete state's,
  and a run warm-started so is bitwise one warm-started from an initialised state. A leaf not
  read (``select="params"``: the optimizer state) is refused, naming the leaves, before any
  read."""
  directory, saved = source
  mesh = jax.make_mesh((2, 4), ("a", "b"), devices=jax.devices()[:8])
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                         sharding=NamedSharding(mesh, P())),
                          jax.eval_shape(init))
  abstract["params"]["body"]["kernel"] = jax.ShapeDtypeStruct(
      (8, 4), jnp.float32, sharding=NamedSharding(mesh, P("a", "b")))
  state = warm_start(abstract, directory, select=None)
  for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(abstract), strict=True):
    assert isinstance(got, jax.Array) and got.sharding == want.sharding
  assert_equal(state, saved)
  with pytest.raises(WarmStartError) as e:
    warm_start(abstract, directory)
  assert str(e.value) == (
      f"warm start from {directory}/6/state (step 6): 8 leaves of the train state are abstract "
      "(jax.ShapeDtypeStruct) and not read from the source: opt/0/count int32[], "
      "opt/0/mu/body/kernel float32[8,4], opt/0/mu/head/bias float32[2], ... (8 in all). An "
      "abstract leaf takes its value from the source: choose it (select=None reads every "
      "leaf) or give it a value to keep")
  runs = []
  for start in (jax.eval_shape(init), init()):  # (no sharding: replicated)
    hook = CheckpointHook(tmp_path / str(len(runs)), init_from=WarmStart(directory, select=None))
    loop = loopkit.TrainLoop(train_step, iterations_per_loop=2, hooks=[hook])
    runs.append(loop.run(start, batches(2, seed=3), num_steps=8))
    assert (hook.saved_steps, loop.ledger.step) == ([8], 8)
  assert_equal(runs[0], jax.device_get(runs[1]))
