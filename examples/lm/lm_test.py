"""The LM example on 8 fake CPU devices, mesh (data, fsdp, tensor) = (2, 2, 2), tiny config.

One straight run (K = 4, 8 steps, checkpoints and evaluations at steps 4 and 8) is the
reference; a K = 1 run and a run preempted at step 4 then resumed from its checkpoint must give
its final state bit for bit, and every state leaf must keep the sharding its logical axes give.
"""

import json
import math
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import loopkit
from examples.lm import input_pipeline, models, train
from examples.lm.configs import tiny

pytest.importorskip("orbax.checkpoint")
pytest.importorskip("grain")


# Held-out perplexity of the tiny config after 4 and 8 steps, measured, by corpus (the sha256
# prefix of its files and bytes: the stdlib differs between Python versions).
MEASURED = {
    "6adabe1b3d9f": (113.067, 60.7505),  # CPython 3.11.7 (168 files), jax 0.10.2
    "d0a6fc447618": (126.858, 75.4927),  # CPython 3.12.1 (164 files), jax 0.12
}


def _leaves(state):
  return [np.asarray(x) for x in jax.tree.leaves(state)]


def _bitwise_equal(a, b) -> bool:
  la, lb = _leaves(a), _leaves(b)
  return len(la) == len(lb) and all(x.dtype == y.dtype and np.array_equal(x, y)
                                    for x, y in zip(la, lb))


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """The reference: K = 4, 8 steps, checkpoints and evaluations at steps 4 and 8."""
  config = tiny.get_config()
  config.generate_bytes = 0  # test_the_greedy_continuation_is_the_models_argmax
  return train.train_and_evaluate(config, str(tmp_path_factory.mktemp("k4")))


def test_the_state_keeps_its_fsdp_and_tensor_shardings_across_a_k4_run(straight):
  state = straight["state"]
  assert straight["status"] == "completed" and straight["step"] == 8
  assert straight["compile_count"] == 1 and straight["device_calls"] == 2
  specs = {k: v.sharding.spec for k, v in state.params.items()}
  # the logical axes, through LOGICAL_AXIS_RULES: vocab -> tensor, embed -> fsdp, heads and mlp
  # -> tensor, layers / kv / norm not split
  assert specs["embedding"] == P("tensor", "fsdp")
  assert specs["head"] == P("fsdp", "tensor")
  assert specs["query"] == P(None, "fsdp", "tensor", None)
  assert specs["out"] == P(None, "tensor", None, "fsdp")
  assert specs["mlp_in"] == P(None, "fsdp", "tensor")
  assert specs["mlp_out"] == P(None, "tensor", "fsdp")
  for name in ("final_norm", "attn_norm"):  # not split: the spec as made, (None, ...)
    assert set(specs[name]) <= {None} and state.params[name].sharding.is_fully_replicated, name
  mesh = state.params["embedding"].sharding.mesh
  assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
  # the embedding's 256 x 32 table: each device holds a 128 x 16 block
  assert state.params["embedding"].addressable_shards[0].data.shape == (128, 16)
  # every leaf (params, AdamW's moments, counts, the step) has the sharding the state was made
  # with: the moments their parameter's, the scalars replicated
  _, _, expected = train.state_shardings(tiny.get_config(), mesh, train.create_optimizer(
      tiny.get_config(), train.learning_rate_schedule(tiny.get_config())))
  got = jax.tree.map(lambda x: x.sharding, state)
  assert jax.tree.structure(got) == jax.tree.structure(expected)
  for x, e in zip(jax.tree.leaves(state), jax.tree.leaves(expected)):
    assert isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh
    assert x.sharding.is_equivalent_to(e, x.ndim)
  mu = state.opt_state[1][0].mu
  assert mu["embedding"].sharding.spec == P("tensor", "fsdp")
  # 8 params split, their mu and nu
  assert sum(not s.is_fully_replicated for s in jax.tree.leaves(got)) == 3 * 8


def test_k1_and_k4_give_the_same_bits(straight, tmp_path):
  config = tiny.get_config()
  config.iterations_per_loop = 1
  config.checkpoint_every_steps = 0
  config.eval_every_steps = 0  # the end only
  config.generate_bytes = 0
  k1 = train.train_and_evaluate(config, str(tmp_path))
  assert k1["device_calls"] == 8 and k1["compile_count"] == 1
  assert _bitwise_equal(k1["state"], straight["state"])
  assert k1["eval_loss"] == straight["eval_loss"]


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
  config.generate_bytes = 0
  first = train.train_and_evaluate(config, str(tmp_path), extra_hooks=[_PreemptAt(4)])
  assert first["status"] == "preempted" and first["step"] == 4
  assert first["eval_history"] == [(4, straight["eval_history"][0][1])]
  second = train.train_and_evaluate(config, str(tmp_path))
  assert second["restored_step"] == 4 and second["status"] == "completed"
  assert second["step"] == 8 and second["ledger"]["examples_seen"] == 8 * 16
  assert _bitwise_equal(second["state"], straight["state"])
  assert second["eval_history"][-1] == straight["eval_history"][-1]
  assert second["state"].params["query"].sharding.spec == P(None, "fsdp", "tensor", None)


def test_eval_only_evaluates_each_checkpoint_as_the_training_run_did(straight):
  """--config.eval_only=True on the straight run's workdir: checkpoints 4 and 8 evaluated once
  on the (2, 2, 2) mesh, their rows bitwise the rows EvalHook wrote in the run."""
  config = tiny.get_config()
  config.eval_only = True
  config.follow_poll_secs = 0.1
  r = train.evaluate_beside(config, straight["workdir"])
  assert r["status"] == "complete" and r["skipped"] == []
  assert [s for s, _ in r["evaluated"]] == [4, 8]
  assert r["evaluated"] == straight["eval_history"]  # the same perplexities, exactly

  def rows(path):
    with open(path) as f:
      return [row for row in map(json.loads, f) if "eval/loss" in row]

  ran = rows(os.path.join(straight["workdir"], "metrics.jsonl"))
  assert [row["step"] for row in ran] == [4, 8]
  assert rows(r["rows_path"]) == ran  # every key (perplexity, num_examples, ...), same bits
def test_a_warm_start_reads_the_params_onto_another_mesh(straight):
  """config.init_from's warm start (CheckpointHook(init_from=...) in a run): the straight
  run's step-8 params read into a fresh state on a (1, 4, 2) mesh keep their values and take
  that mesh's shardings; AdamW's state and the step stay fresh."""
  from loopkit.checkpoint import WarmStart

  config = tiny.get_config()
  config.mesh_shape = (1, 4, 2)
  mesh = train.make_mesh(config)
  tx = train.create_optimizer(config, train.learning_rate_schedule(config))
  # the state's tree and shardings on the new mesh, with other values (no init program)
  _, abstract, _ = train.state_shardings(config, mesh, tx)
  rng = np.random.default_rng(0)

  def other_values(a):  # floats random, counters (the step, Adam's count) 0
    x = rng.normal(size=a.shape) if jnp.issubdtype(a.dtype, jnp.floating) else np.zeros(a.shape)
    return jax.device_put(np.asarray(x, a.dtype), a.sharding)

  fresh = jax.tree.map(other_values, abstract)
  state = WarmStart(os.path.join(straight["workdir"], "checkpoints")).apply(fresh)
  assert _bitwise_equal(state.params, straight["state"].params)
  assert _bitwise_equal(state.opt_state, fresh.opt_state) and int(state.step) == 0
  for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(fresh), strict=True):
    assert got.sharding == want.sharding
  assert state.params["query"].sharding.mesh.shape["fsdp"] == 4
  assert state.params["query"].sharding.spec == P(None, "fsdp", "tensor", None)


def test_held_out_perplexity_starts_at_256_and_drops(straight):
  setup = train.build(tiny.get_config())
  untrained = setup.evaluator.evaluate(setup.state, setup.eval_batches)
  # the output projection starts at 0: the uniform distribution over 256 bytes
  assert untrained.num_examples == 32
  assert untrained.metrics["perplexity"] == pytest.approx(256.0, rel=1e-6)
  assert untrained.metrics["bits_per_byte"] == pytest.approx(8.0, rel=1e-6)
  (s4, p4), (s8, p8) = straight["eval_history"]
  assert (s4, s8) == (4, 8) and math.isfinite(p8)
  assert p8 < p4 < 200
  measured = MEASURED.get(straight["corpus"]["sha256"])
  if measured is not None:  # a known corpus: the values measured on it
    assert (p4, p8) == pytest.approx(measured, rel=1e-3)
  assert straight["eval_perplexity"] == p8 == pytest.approx(math.exp(straight["eval_loss"]))


def test_the_greedy_continuation_is_the_models_argmax(straight):
  params = straight["state"].params
  graphdef = train.state_shardings(
      tiny.get_config(), params["head"].sharding.mesh,
      train.create_optimizer(tiny.get_config(), train.learning_rate_schedule(tiny.get_config()))
  )[0]
  generate = train.make_generate(graphdef)
  again = train.continue_text(generate, params, b"import ", 8, 32)
  assert len(again) == 8 and again == train.continue_text(generate, params, b"import ", 8, 32)
  # each byte is the argmax of the model's logits after the bytes before it: one causal
  # forward pass over the prompt and the continuation gives all of them
  text = np.frombuffer(b"import " + again, np.uint8).astype(np.int32)[None]
  logits = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t, shard_activations=False))(
      params, text)
  assert bytes(np.argmax(np.asarray(logits[0, 6:-1]), -1).astype(np.uint8).tolist()) == again
  with pytest.raises(ValueError, match="0 < num_bytes < 32, got b'x' and 32"):
    train.continue_text(generate, params, b"x", 32, 32)


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


def test_param_count_and_logical_spec():
  cfg = train.model_config(tiny.get_config())
  model = models.abstract_model(cfg)
  assert models.param_count(cfg) == sum(
      math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model)))
  assert models.logical_spec(("batch", "length", "mlp")) == P(("data", "fsdp"), None, "tensor")
  with pytest.raises(KeyError, match="logical axis 'hidden' has no rule"):
    models.logical_spec(("hidden",))
  from examples.lm.configs import pod
  assert models.param_count(train.model_config(pod.get_config())) == 1_007_765_504


# -- the whole example ------------------------------------------------------------------------

README = os.path.join(os.path.dirname(__file__), "README.md")
QUICKSTART = "$ /usr/bin/time python -m examples.lm.main --workdir /tmp/lm-cpu"


def readme_measured() -> dict:
  """The README's "Measured on this machine" figures: the Quickstart command's printed lines
  (``line``: its summary line, ``continuation``: its greedy continuation line) and the table's
  figures (``table``: ``{row name: value text}``)."""
  with open(README) as f:
    text = f.read()
  block = text.split(QUICKSTART + "\n", 1)[1].split("```", 1)[0].splitlines()
  table = dict(row.split(" | ")[:2] for row in
               (r.strip("| ") for r in text.split("| | value |", 1)[1].split("\n\n", 1)[0]
                .splitlines()[2:]))
  return {"line": next(x for x in block if x.startswith("byte-level LM")),
          "continuation": next(x for x in block if x.startswith("greedy continuation")),
          "table": table}


def without_timings(line: str) -> str:
  """A summary line less what the machine's speed decides (wall seconds, tokens/s): every
  figure the model computes stays."""
  line = re.sub(r"; [\d.]+ s wall", "; <wall>", line)
  return re.sub(r"; [\d,]+ train tokens/s \(steady state\)", "; <tokens/s>", line)


def table_figures(line: str) -> dict:
  """The table rows' figures implied by a summary line (perplexity, bits, % of next bytes)."""
  ppl, bits, acc = re.search(r"held-out perplexity ([\d.]+) \(([\d.]+) bits/byte, next-byte "
                             r"accuracy ([\d.]+)\)", line).groups()
  return {"held-out perplexity, step 150 / 300": (
      f"/ **{ppl}** ({bits} bits per byte, {100 * float(acc):.1f}% of next bytes right)")}


def test_the_readme_figures_agree_with_its_quickstart_line():
  """The fast twin of the slow test below: the README's table and its warm-start paragraph
  repeat the Quickstart line's figures (perplexity, bits per byte, accuracy as a percentage),
  and that line's model figures are this config's (parameters, batch, K, calls, mesh)."""
  measured = readme_measured()
  line, table = measured["line"], measured["table"]
  for row, tail in table_figures(line).items():
    assert table[row].endswith(tail), (row, table[row], tail)
  ppl = re.search(r"held-out perplexity ([\d.]+)", line).group(1)
  with open(README) as f:
    assert f"(held-out perplexity {ppl} at step 300 on mesh (2, 2, 2)" in f.read()
  from examples.lm.configs import default
  config = default.get_config()
  steps, k, batch = config.num_train_steps, config.iterations_per_loop, config.global_batch_size
  assert (f"byte-level LM, {models.param_count(train.model_config(config)):,} parameters: "
          in line)
  assert (f"at step {steps} (batch {batch}, iterations_per_loop={k}, {steps // k} device "
          "calls, mesh {'data': 2, 'fsdp': 2, 'tensor': 2}, 1 train compilation); status "
          "completed; <wall>; <tokens/s>") in without_timings(line)


@pytest.mark.slow(held_by="examples/lm/lm_test.py::"
                  "test_the_state_keeps_its_fsdp_and_tensor_shardings_across_a_k4_run",
                  reason="the CPU default config end to end in a subprocess, then the README's "
                         "warm start from it: 66 s + 67 s measured on 2 cores at a load "
                         "average of 5 (278 s + 127 s at 15)")
def test_the_cpu_default_run_prints_its_held_out_perplexity(tmp_path):
  """The Quickstart command prints the README's figures (C85): its summary and continuation
  lines but for the machine's speed, the table's perplexities, bits, accuracy and training
  losses, the corpus's sizes; then the README's warm-start command, from this run's
  checkpoints, prints the perplexity, bits and accuracy the README gives, and logs its account
  of the leaves read."""
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # main.py sets its 8 devices itself
  cwd = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
  out = subprocess.run([sys.executable, "-m", "examples.lm.main", "--workdir", str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=1200, cwd=cwd)
  assert out.returncode == 0, out.stderr[-3000:]
  line = next(x for x in out.stdout.splitlines() if x.startswith("byte-level LM"))
  ppl = float(line.split("held-out perplexity ")[1].split()[0])
  assert 4 < ppl < 10, line  # measured: see README.md
  assert "status completed" in line and "1 train compilation" in line
  assert "mesh {'data': 2, 'fsdp': 2, 'tensor': 2}" in line
  assert "greedy continuation of '    def __init__(self': " in out.stdout
  with open(tmp_path / "results.json") as f:
    results = json.load(f)
  assert results["step"] == 300 and results["eval_perplexity"] == pytest.approx(ppl, abs=1e-3)
  # C85: every figure the README's "Measured on this machine" prints is the one printed today
  # (on the corpus it names: CPython 3.11.7's), all but the machine's speed
  if results["corpus"]["sha256"] != "6adabe1b3d9f":
    pytest.skip(f"the README's figures are CPython 3.11.7's corpus; this is "
                f"{results['corpus']['sha256']}")
  readme = readme_measured()
  assert without_timings(line) == without_timings(readme["line"])
  c = results["corpus"]
  with open(README) as f:
    assert (f"CPython 3.11.7: {c['train_files']} training files ({c['train_bytes']:,} bytes), "
            f"{c['heldout_files']} held-out\nfiles ({c['heldout_bytes']:,} bytes)") in f.read()
  assert next(x for x in out.stdout.splitlines()
              if x.startswith("greedy continuation")) == readme["continuation"]
  with open(tmp_path / "metrics.jsonl") as f:
    rows = [json.loads(x) for x in f]
  ppl_150 = next(r["eval/perplexity"] for r in rows if r["step"] == 150 and "eval/perplexity" in r)
  losses = [next(r["loss"] for r in rows if r["step"] == s and "loss" in r)
            for s in (50, 150, 300)]
  table = readme["table"]
  assert table["held-out perplexity, step 150 / 300"] == (
      f"{ppl_150:.3f} " + table_figures(line)["held-out perplexity, step 150 / 300"])
  assert table["training loss (nats/byte), steps 50 / 150 / 300"] == " / ".join(
      f"{x:.3f}" for x in losses)
  # the warm start's command (README, "Fine-tuning from another run"), from this run
  ft = tmp_path / "ft"
  out = subprocess.run([sys.executable, "-m", "examples.lm.main", "--workdir", str(ft),
                        f"--config.init_from={tmp_path}/checkpoints",
                        "--config.learning_rate=1e-3", "--config.num_train_steps=100",
                        "--config.mesh_shape=(1,4,2)"], capture_output=True, text=True,
                       env=env, timeout=1200, cwd=cwd)
  assert out.returncode == 0, out.stderr[-3000:]
  line = next(x for x in out.stdout.splitlines() if x.startswith("byte-level LM"))
  got = re.search(r"held-out perplexity ([\d.]+) \(([\d.]+) bits/byte, next-byte accuracy "
                  r"([\d.]+)\) on 256 sequences of 128 bytes at step 100", line).groups()
  account = re.search(r"warm start from \S+/checkpoints/300/state step 300: [^\n]*",
                      out.stderr).group(0).replace(str(tmp_path), "/tmp/lm-cpu")
  with open(README) as f:
    prose = " ".join(f.read().split())
  assert (f"`{account}`" in prose and f"reached held-out perplexity **{got[0]}** ({got[1]} bits "
          f"per byte, {100 * float(got[2]):.1f}% of next bytes right) at step 100" in prose), (
              account, got)


@pytest.mark.slow(held_by="tests/test_aot.py::test_eval_program_with_the_train_program",
                  reason="the ~1B-parameter pod config's train program compiled for 16 v5p chips "
                         "through libtpu: 131 s measured on 2 cores at a load average of 5")
def test_the_pod_config_compiles_for_a_v5p_slice():
  pytest.importorskip("libtpu")
  from examples.lm.configs import pod
  config = pod.get_config()
  report = train.compile_only(config, "v5p:2x2x4", with_eval=False)
  assert report.mesh_shape == {"data": 2, "fsdp": 4, "tensor": 2} and report.num_devices == 16
  t = report.train
  assert (t.global_batch_size, t.per_device_batch) == (256, 32)
  assert t.headroom_bytes > 0
  # the state (1.008e9 parameters and two AdamW moments, float32) split 8 ways (fsdp x tensor)
  # and replicated over data, donated and aliased to the new state
  assert t.alias_bytes == pytest.approx(3 * 4 * 1_007_765_504 / 8, rel=0.01)
  # XLA counts every layer (unrolled): its FLOPs agree with the hand count
  hand = models.train_flops_per_step(train.model_config(config), 256, 2048) / 16
  assert t.flops_per_step == pytest.approx(hand, rel=0.05)
