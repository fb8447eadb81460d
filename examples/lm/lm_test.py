"""The LM example on 8 fake CPU devices, mesh (data, fsdp, tensor) = (2, 2, 2), tiny config.

One straight run (K = 4, 8 steps, checkpoints and evaluations at steps 4 and 8) is the
reference; a K = 1 run and a run preempted at step 4 then resumed from its checkpoint must give
its final model and optimizer bit for bit, and every array must keep the sharding its logical
axes give. The README's figures are the ones its command prints (a slow test runs it).
"""

import math
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import loopkit
from examples.lm import input_pipeline, models, train
from examples.lm.configs import tiny

pytest.importorskip("orbax.checkpoint")
pytest.importorskip("grain")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

# Held-out loss (nats per byte) of the tiny config after 4 and 8 steps, measured, by corpus (the
# sha256 prefix of its files and bytes: the stdlib differs between Python versions).
MEASURED = {
    "6adabe1b3d9f": (4.716723442077637, 4.089548587799072),  # CPython 3.11.7, jax 0.10.2
}


def _bitwise_equal(a, b) -> bool:
  la, lb = [np.asarray(x) for x in jax.tree.leaves(a)], [np.asarray(x) for x in jax.tree.leaves(b)]
  return len(la) == len(lb) and all(x.dtype == y.dtype and np.array_equal(x, y)
                                    for x, y in zip(la, lb))


def _state(results):
  return nnx.state((results["model"], results["optimizer"]))


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """The reference: K = 4, 8 steps, checkpoints and evaluations at steps 4 and 8."""
  return train.train_and_evaluate(tiny.get_config(), str(tmp_path_factory.mktemp("k4")))


def test_the_state_keeps_its_fsdp_and_tensor_shardings_across_a_k4_run(straight):
  assert straight["status"] == "completed" and straight["step"] == 8
  assert straight["compile_count"] == 1 and straight["device_calls"] == 2
  model, optimizer = straight["model"], straight["optimizer"]
  block = model.blocks[0]
  # the logical axes through LOGICAL_AXIS_RULES: vocab, heads, mlp -> tensor, embed -> fsdp
  specs = {"embed": model.embed.embedding, "head": model.head.kernel,
           "query": block.attn.query.kernel, "out": block.attn.out.kernel,
           "mlp_in": block.mlp_in.kernel, "mlp_out": block.mlp_out.kernel}
  specs = {k: v.get_value().sharding.spec for k, v in specs.items()}
  assert specs == {"embed": P("tensor", "fsdp"), "head": P("fsdp", "tensor"),
                   "query": P("fsdp", "tensor", None), "out": P("tensor", None, "fsdp"),
                   "mlp_in": P("fsdp", "tensor"), "mlp_out": P("tensor", "fsdp")}
  assert model.final_norm.scale.get_value().sharding.is_fully_replicated
  table = model.embed.embedding.get_value()
  assert dict(table.sharding.mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
  assert table.addressable_shards[0].data.shape == (128, 16)  # 256 x 32, split 2 x 2
  # every array (params, AdamW's moments and counts, the step) has the sharding a fresh model
  # and optimizer are made with: the moments their parameter's, the scalars replicated
  with jax.set_mesh(table.sharding.mesh), nnx.logical_axis_rules(models.LOGICAL_AXIS_RULES):
    fresh = nnx.state(train.create_model(tiny.get_config()))
  got = _state(straight)
  assert jax.tree.structure(got) == jax.tree.structure(fresh)
  for x, e in zip(jax.tree.leaves(got), jax.tree.leaves(fresh), strict=True):
    assert x.sharding.is_equivalent_to(e.sharding, x.ndim)
  mu = optimizer.opt_state[1][0].mu["embed"]["embedding"].get_value()
  assert mu.sharding.spec == P("tensor", "fsdp")
  split = sum(not x.sharding.is_fully_replicated for x in jax.tree.leaves(got))
  assert split == 3 * (2 + 2 * 6)  # embedding, head, 6 matrices a block; each, mu and nu


def test_k1_and_k4_give_the_same_bits(straight, tmp_path):
  config = tiny.get_config()
  config.iterations_per_loop = 1
  config.checkpoint_every_steps = 0
  config.eval_every_steps = 0  # the end only
  config.sample_bytes = 0
  k1 = train.train_and_evaluate(config, str(tmp_path))
  assert k1["device_calls"] == 8 and k1["compile_count"] == 1
  assert _bitwise_equal(_state(k1), _state(straight))
  assert k1["eval"] == straight["eval"]
  assert [step for step, _ in k1["eval_history"]] == [8]  # 0: at the end only, not every call


class _PreemptAt(loopkit.Hook):
  """Requests a preemption (as a SIGTERM would) at a step."""

  needs_state = False

  def __init__(self, step):
    super().__init__(at_steps=[step], at_end=False)
    self._ctx = None

  def on_run_start(self, ctx, state):
    self._ctx = ctx

  def on_trigger(self, info, state):
    self._ctx.preemption.request()


def test_a_run_preempted_at_step_4_resumes_to_the_same_bits(straight, tmp_path):
  config = tiny.get_config()
  first = train.train_and_evaluate(config, str(tmp_path), extra_hooks=[_PreemptAt(4)])
  assert first["status"] == "preempted" and first["step"] == 4 and first["sample"] == ""
  assert first["eval_history"] == straight["eval_history"][:1]
  second = train.train_and_evaluate(config, str(tmp_path))
  assert second["restored_step"] == 4 and second["status"] == "completed"
  assert second["step"] == 8 and second["device_calls"] == 2  # the ledger's, since step 0
  assert _bitwise_equal(_state(second), _state(straight))
  assert second["eval"] == straight["eval"] and second["sample"] == straight["sample"]
  query = second["model"].blocks[1].attn.query.kernel.get_value()
  assert query.sharding.spec == P("fsdp", "tensor", None)


def test_a_rerun_of_a_finished_run_prints_the_same_figures(straight):
  """The command run again on a finished workdir restores step 8, trains nothing, and reports
  what the run reported: the held-out figures (evaluated again) and the sample."""
  again = train.train_and_evaluate(tiny.get_config(), straight["workdir"])
  assert again["restored_step"] == 8 and again["status"] == "completed"
  assert again["eval"] == straight["eval"] and again["sample"] == straight["sample"]
  assert train.summary(tiny.get_config(), again)[::2] == train.summary(tiny.get_config(),
                                                                      straight)[::2]


def test_held_out_perplexity_starts_at_256_and_drops(straight):
  config = tiny.get_config()
  mesh = train.make_mesh(config)
  with jax.set_mesh(mesh), nnx.logical_axis_rules(models.LOGICAL_AXIS_RULES):
    model, _ = train.create_model(config)
  corpus = input_pipeline.load_corpus(heldout_every=config.heldout_every)
  batches = input_pipeline.EvalBatches(corpus, seq_len=config.seq_len,
                                       num_windows=config.eval_windows,
                                       global_batch_size=config.eval_batch_size)
  untrained = train.create_evaluator(config, model, mesh).evaluate(batches)
  # the output projection starts at 0: the uniform distribution over 256 bytes
  assert float(untrained["loss"]) == pytest.approx(math.log(256), rel=1e-6)
  (s4, l4), (s8, l8) = straight["eval_history"]
  assert (s4, s8) == (4, 8) and l8 < l4 < math.log(200)
  measured = MEASURED.get(input_pipeline.load_corpus().digest)
  if measured is not None:  # a known corpus: the values measured on it
    assert (l4, l8) == pytest.approx(measured, rel=1e-5)
  ev = straight["eval"]
  assert ev["loss"] == l8 and ev["perplexity"] == pytest.approx(math.exp(l8))
  assert 0.1 < ev["accuracy"] < 0.5


def test_sampling_is_the_models_choice_and_repeats_with_its_seed(straight):
  model = straight["model"]
  assert len(straight["sample"].encode("utf-8", "replace")) >= 8
  config = tiny.get_config()
  again = train.sample(model, b"import ", 8, max_len=32, seed=config.seed,
                       temperature=config.temperature, top_k=config.top_k)
  assert again.decode("utf-8", "replace") == straight["sample"]
  greedy = train.sample(model, b"import ", 8, max_len=32)
  # each greedy byte is the argmax of the model's logits after the bytes before it: one causal
  # forward pass over the prompt and the continuation gives all of them
  text = np.frombuffer(b"import " + greedy, np.uint8).astype(np.int32)[None]
  logits = nnx.jit(lambda m, t: m(t))(model, text)
  assert np.argmax(np.asarray(logits[0, 6:-1]), -1).astype(np.uint8).tobytes() == greedy
  # top-k 1 is greedy whatever the temperature and seed
  assert train.sample(model, b"import ", 8, max_len=32, seed=3, temperature=2.0,
                      top_k=1) == greedy
  with pytest.raises(ValueError, match="0 < num_bytes < 32, got b'x' and 32"):
    train.sample(model, b"x", 32, max_len=32)


def test_every_matrix_names_logical_axes_the_rules_map():
  config = tiny.get_config()
  with nnx.use_eager_sharding(False):  # the names alone, no mesh
    model = nnx.eval_shape(lambda: models.Transformer(train.model_config(config),
                                                      rngs=nnx.Rngs(0)))
  rules = dict(models.LOGICAL_AXIS_RULES)
  for path, param in nnx.iter_graph(model):
    if isinstance(param, nnx.Param) and param.ndim > 1:
      names = param.get_metadata().get("out_sharding") or param.get_metadata().get("sharding")
      assert names is not None and len(names) == param.ndim, path
      assert all(n in rules for n in names), (path, names)


# -- data ------------------------------------------------------------------------------------


def test_the_corpus_is_the_sorted_stdlib_and_the_split_is_by_file():
  names = input_pipeline.source_files()
  root = input_pipeline.stdlib_dir()
  assert names == sorted(n for n in os.listdir(root) if n.endswith(".py")
                         and os.path.isfile(os.path.join(root, n)))
  corpus = input_pipeline.load_corpus(heldout_every=16)
  assert corpus.heldout_files == names[15::16]
  assert set(corpus.train_files).isdisjoint(corpus.heldout_files)
  assert sorted(corpus.train_files + corpus.heldout_files) == names
  expected = b"".join(open(os.path.join(root, n), "rb").read() + b"\0"
                      for n in corpus.heldout_files)
  assert corpus.heldout_text.tobytes() == expected
  assert len(corpus.train_text) + len(corpus.heldout_text) == sum(
      os.path.getsize(os.path.join(root, n)) + 1 for n in names)
  again = input_pipeline.load_corpus(heldout_every=16)
  assert again.digest == corpus.digest and np.array_equal(again.train_text, corpus.train_text)
  with pytest.raises(ValueError, match="heldout_every must be >= 2, got 1"):
    input_pipeline.split_files(names, 1)


def test_training_batches_are_a_pure_function_of_the_step_and_resume_in_o1():
  corpus = input_pipeline.load_corpus(heldout_every=16)
  a = input_pipeline.train_source(corpus, seq_len=32, global_batch_size=16, seed=0)
  b = input_pipeline.train_source(corpus, seq_len=32, global_batch_size=16, seed=0)
  chunk = a.chunk_at(0, 3)["tokens"]
  assert chunk.shape == (3, 16, 33) and chunk.dtype == np.uint8
  assert np.array_equal(b.chunk_at(2, 1)["tokens"][0], chunk[2])  # read step 2 alone
  assert not np.array_equal(chunk[0], chunk[1])
  # every row is a window of the training text, at the record Grain's shuffle chose
  text = corpus.train_text
  for row, rec in zip(chunk[1], a.record_indices_at(1)):
    assert np.array_equal(row, text[rec * 33:(rec + 1) * 33])
  assert a.steps_per_epoch == (len(text) // 33) // 16
  assert a.position_at(5)["grain_step"] == 5  # the checkpointed data position is the step
  other = input_pipeline.train_source(corpus, seq_len=32, global_batch_size=16, seed=1)
  assert not np.array_equal(other.chunk_at(0, 1)["tokens"][0], chunk[0])


def test_eval_batches_are_held_out_windows_the_same_every_time():
  corpus = input_pipeline.load_corpus(heldout_every=16)
  ev = input_pipeline.EvalBatches(corpus, seq_len=32, num_windows=40, global_batch_size=16)
  first, second = list(ev), list(ev)
  assert [len(x["tokens"]) for x in first] == [16, 16, 8]
  assert all(np.array_equal(x["tokens"], y["tokens"]) for x, y in zip(first, second))
  stride = (len(corpus.heldout_text) // 33) // 40
  rows = np.concatenate([x["tokens"] for x in first])
  for j in (0, 1, 39):
    assert rows[j].tobytes() == corpus.heldout_text[j * stride * 33:(j * stride + 1) * 33].tobytes()
  # process 1 of 2 gets rows 8-15 of each global batch
  p1 = list(input_pipeline.EvalBatches(corpus, seq_len=32, num_windows=40, global_batch_size=16,
                                       process_index=1, process_count=2))
  assert np.array_equal(p1[0]["tokens"], first[0]["tokens"][8:16]) and len(p1[2]["tokens"]) == 0
  with pytest.raises(ValueError, match="fewer than num_windows=100000"):
    input_pipeline.EvalBatches(corpus, seq_len=32, num_windows=100_000, global_batch_size=16)


# -- the README's figures ----------------------------------------------------------------------

_TIMES = re.compile(r"\d[\d,]*\.?\d* (s)\b")


def _masked(lines):
  """The summary lines with their times and rates (which the machine's load sets) masked."""
  return [_TIMES.sub(r"# \1", line) for line in lines]


def readme_output() -> tuple[str, list[str]]:
  """The Quickstart's measured command and the lines it printed (the README's first
  ``$ python -m examples.lm.main`` block)."""
  path = os.path.join(HERE, "README.md")
  with open(path) as f:
    text = f.read()
  block = re.search(r"```\n\$ (?:/usr/bin/time )?(python -m examples\.lm\.main[^\n]*)\n"
                    r"(.*?)\n```", text, re.S)
  assert block is not None, f"{path} has no measured block of the command"
  return block.group(1), [x for x in block.group(2).splitlines()
                          if not x.startswith(("$", " ")) and " wall, " not in x]


def test_the_summary_prints_the_runs_figures_as_the_readme_quotes_them(straight):
  config = tiny.get_config()
  lines = train.summary(config, straight)
  ev = straight["eval"]
  assert lines[0] == (
      f"byte-level LM, {straight['num_params']:,} parameters, mesh (2, 2, 2), K=4: step 8 "
      f"(completed), held-out loss {ev['loss']:.4f} nats/byte, perplexity "
      f"{ev['perplexity']:.3f}, accuracy {ev['accuracy']:.4f} (32 x 32 bytes)")
  assert _masked(lines[1:2]) == ["2 device calls, 1 train compilation(s), # s of training "
                                 "(throughput: metrics.jsonl)"]
  assert lines[2] == f"sample (temperature 0.7, top-k 10, seed 0): 'import ' + " \
                     f"{straight['sample']!r}"
  # the README quotes the default config's lines in the same form
  command, quoted = readme_output()
  assert command == "python -m examples.lm.main --workdir /tmp/lm-cpu"
  assert len(quoted) == 3 and quoted[0].startswith("byte-level LM, ") and "K=10: step 600 " \
      "(completed)" in quoted[0]
  assert _masked(quoted[1:2]) == ["60 device calls, 1 train compilation(s), # s of training "
                                  "(throughput: metrics.jsonl)"]
  assert quoted[2].startswith("sample (temperature 0.7, top-k 10, seed 0): "
                              "'    def __init__(self' + ")


@pytest.mark.slow(held_by="examples/lm/lm_test.py::"
                  "test_the_summary_prints_the_runs_figures_as_the_readme_quotes_them",
                  reason="the CPU default config end to end in a subprocess: minutes on 2 cores")
def test_the_readme_figures_are_what_its_command_prints(tmp_path):
  command, quoted = readme_output()
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # as the README's command runs: main.py sets its 8 devices
  out = subprocess.run([sys.executable, *command.split()[1:-1], str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=3000, cwd=ROOT)
  assert out.returncode == 0, out.stderr[-3000:]
  printed = out.stdout.splitlines()[-3:]
  assert _masked(printed) == _masked(quoted), (printed, quoted)


@pytest.mark.slow(held_by="tests/test_aot.py::test_eval_program_with_the_train_program",
                  reason="the ~1B-parameter pod config's train program compiled for 16 v5p chips "
                         "through libtpu: minutes on 2 cores")
def test_the_pod_config_compiles_for_a_v5p_slice():
  pytest.importorskip("libtpu")
  from examples.lm.configs import pod
  from loopkit.tools import aot, topology

  config = pod.get_config()
  mesh = train.make_mesh(config, topology.topology_devices("v5p:2x2x4"))
  # the model and optimizer as shapes with their shardings: nothing allocated
  with jax.set_mesh(mesh), nnx.logical_axis_rules(models.LOGICAL_AXIS_RULES):
    model, optimizer = nnx.eval_shape(lambda: train.create_model(config))
  loop = loopkit.nnx.NnxTrainLoop(train.make_train_step(config), model, optimizer,
                                  iterations_per_loop=config.iterations_per_loop, mesh=mesh,
                                  data_axis=train.BATCH_AXES)
  tokens = jax.ShapeDtypeStruct((config.global_batch_size, config.seq_len + 1), np.uint8)
  report = aot.compile_for(loop.loop, loop.state(), {"tokens": tokens}, topology="v5p:2x2x4",
                           mesh=mesh)
  assert report.mesh_shape == {"data": 2, "fsdp": 4, "tensor": 2} and report.num_devices == 16
  t = report.train
  assert (t.global_batch_size, t.per_device_batch) == (256, 32) and t.headroom_bytes > 0
  # the params and AdamW's two moments, float32, split 8 ways (fsdp x tensor), donated
  params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert t.alias_bytes == pytest.approx(3 * 4 * params / 8, rel=0.01)
