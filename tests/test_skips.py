"""Skipping data steps and rewinding at loss spikes (loopkit.core.skips, LossSpikeHook).

Data step s is the s-th batch of the source (batch_at(s - 1)); the global step stays the
updates applied. The spike is a batch scaled by 100 at data step 37: run A watches the loss,
rewinds to checkpoint 30 and skips data steps 31..40 (margin 3); run B is given
skip_steps=[(31, 40)] and watches nothing. They must end bitwise equal.
"""

import glob
import io
import json
import logging
import re
import struct
import time

import jax.numpy as jnp
import numpy as np
import pytest
import toy

import loopkit
from loopkit.checkpoint import CheckpointHook, LossSpikeError, LossSpikeHook
from loopkit.core import skips
from loopkit.observe import goodput
from loopkit.observe.goodput import GoodputHook
from loopkit.observe.writers import JsonlWriter, create_default_writer
from loopkit.training import EarlyStopping

TRUE_W = np.random.default_rng(1).normal(size=(4, 2)).astype(np.float32)
SPIKE = 37  # the data step whose batch blows the loss up


class Steps:
  """A step-indexed source (batch_at) that records which batches it was asked for."""

  def __init__(self, spike_at=SPIKE, process_index=0, process_count=1):
    self.spike_at = spike_at
    self.read: list[int] = []
    self.rows = slice(16 // process_count * process_index, 16 // process_count * (process_index
                                                                                  + 1))

  def batch_at(self, i):
    self.read.append(i)
    return batch(i, self.spike_at, self.rows)


def batch(i, spike_at=SPIKE, rows=slice(None)):
  x = np.random.default_rng([7, i]).normal(size=(16, 4)).astype(np.float32)
  if i + 1 == spike_at:
    x = x * 100
  return {"x": x[rows], "y": (x @ TRUE_W)[rows]}


class Listed:
  """A re-iterable plain source (a counted skip on resume) that counts the batches drawn."""

  def __init__(self, n=80):
    self.batches = [batch(i) for i in range(n)]
    self.drawn = 0

  def __iter__(self):
    for b in self.batches:
      self.drawn += 1
      yield b


class Calls(loopkit.Hook):
  """Records every call's (start_step, end_step, skipped_steps, data_step)."""

  needs_state = False

  def __init__(self):
    super().__init__()
    self.calls = []

  def after_each_call(self, info):
    self.calls.append((info.start_step, info.end_step, info.skipped_steps, info.data_step))


class Rows:
  """A writer that keeps each row's (step, loss)."""

  def __init__(self):
    self.rows = []

  def write_scalars(self, step, scalars):
    self.rows.append((step, float(scalars["loss"])))

  def flush(self):
    pass

  def close(self):
    pass


def train(directory, *, spike=False, k=4, skip_steps=None, num_steps=50, source=None,
          every_steps=10, max_rewinds=10):
  """One run; ``directory`` None: no checkpoints."""
  writer = Rows()
  calls = Calls()
  hooks = [calls, loopkit.LoggingHook(writer, every_steps=5, throughput=False)]
  ckpt = None
  if directory is not None:
    ckpt = CheckpointHook(directory, every_steps=every_steps, async_save=False)
    hooks.append(ckpt)
  watch = None
  if spike:
    watch = LossSpikeHook(ckpt, factor=10, window=5, margin=3, max_rewinds=max_rewinds)
    hooks.append(watch)
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=k, hooks=hooks)
  source = Steps() if source is None else source
  state = loop.run(toy.init_state(), source, num_steps=num_steps, skip_steps=skip_steps)
  return {"loop": loop, "state": state, "rows": writer.rows, "watch": watch, "ckpt": ckpt,
          "source": source, "calls": calls.calls}


def same_ledger(a, b):
  """The accounting a rewind must leave as a run given the range has it."""
  fields = ("step", "examples_seen", "loop_index", "skipped_steps", "skip_steps", "data_step")
  return {f: getattr(a, f) for f in fields} == {f: getattr(b, f) for f in fields}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """Run A (spike at data step 37, K=4) and run B (skip_steps=[(31, 40)], K=4)."""
  a = train(tmp_path_factory.mktemp("a"), spike=True)
  b = train(tmp_path_factory.mktemp("b"), skip_steps=[(31, 40)])
  return a, b


@pytest.mark.parametrize("bad, says", [
    ([(0, 3)], "skip_steps entry (0, 3): data steps count from 1 (the first batch), got first=0"),
    ([(-5, 3)], "got first=-5"),
    ([(5, 3)], "skip_steps entry (5, 3): last=3 is before first=5"),
    ([(10, 20), (15, 25)], "skip_steps entry (15, 25) overlaps the entry (10, 20) before it"),
    ([(10, 20), (1, 2)], "skip_steps entry (1, 2) comes before the entry (10, 20) before it"),
    ([(1.5, 2)], "skip_steps entry (1.5, 2) is not a pair (first, last) of int data steps"),
    ([(True, 2)], "skip_steps entry (True, 2) is not a pair"),
    ([(1, 2, 3)], "skip_steps entry (1, 2, 3) is not a pair"),
    ("31-40", "skip_steps must be a list of (first, last) data-step pairs, got '31-40'"),
])
def test_bad_skip_steps_are_refused_before_the_state_is_taken(bad, says):
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=2)
  state = toy.init_state()
  with pytest.raises(ValueError) as e:
    loop.run(state, Steps(), num_steps=4, skip_steps=bad)
  assert says in str(e.value)
  assert not state["params"]["w"].is_deleted()  # not donated: nothing was lost


def test_ranges_merge_and_cut_calls_where_they_start():
  assert skips.merge_ranges([(31, 40)], [(41, 41), (60, 62)], [(35, 45)]) == ((31, 45), (60, 62))
  # from update 30 at data step 40 (10 skipped): data 50 is update 40, data 63 update 52
  assert skips.cut_steps(((31, 40), (51, 55), (64, 64)), 30, 40) == [40, 48]
  assert skips.cut_steps(((31, 40),), 30, 30) == []  # the range starts at the next batch
  assert skips.skip_count(((31, 40), (41, 45)), 30) == 10  # (merged ranges: 15)
  assert list(loopkit.core.plan_calls(0, iterations_per_loop=4, num_steps=12, triggers=[
      loopkit.Trigger(at_steps=skips.cut_steps(((7, 9),), 0, 0), at_end=False)])) == [4, 2, 4, 2]


def test_a_spike_rewinds_to_the_last_checkpoint_and_ends_as_a_run_given_the_skip_range(runs):
  a, b = runs
  toy.assert_bitwise(a["state"], b["state"])
  la, lb = a["loop"].ledger, b["loop"].ledger
  assert same_ledger(la, lb), (la, lb)
  assert (la.step, la.skipped_steps, la.skip_steps, la.data_step) == (50, 10, ((31, 40),), 60)
  assert la.examples_seen == 50 * 16  # updates x B: the skipped batches trained nothing
  # K=4 with rows every 5: the spike's call ran steps 36..39, seen when 40 was dispatched
  assert (la.lost_steps, lb.lost_steps) == (10, 0)
  assert a["watch"].rewinds == [{"step": 37, "data_step": 37, "value": a["watch"].rewinds[0][
      "value"], "median": a["watch"].rewinds[0]["median"], "restored_step": 30}]
  assert a["watch"].rewinds[0]["value"] > 10 * a["watch"].rewinds[0]["median"]
  # rows: the same up to 30, A's row 35 of the thrown-away steps, then B's rows exactly
  assert [s for s, _ in b["rows"]] == [5, 10, 15, 20, 25, 30, 35, 40, 45, 50]
  assert a["rows"][:6] == b["rows"][:6] and a["rows"][7:] == b["rows"][6:]
  assert a["rows"][6][0] == 35 and a["rows"][6] != b["rows"][6]
  # run B never read the batches of data steps 31..40 (a step-indexed source steps over them)
  assert sorted(set(b["source"].read)) == list(range(30)) + list(range(40, 60))
  assert a["loop"].status == b["loop"].status == "completed"
  # hooks see the skip: the call after step 30 starts at data step 41
  assert (29, 30, 0, 30) in b["calls"] and (30, 34, 10, 44) in b["calls"]
  assert a["calls"][-6:] == b["calls"][-6:]


def test_a_spike_in_the_last_call_rewinds_and_trains_on_to_the_target(tmp_path):
  """num_steps=37, K=7: the spike's call (35, 37] is the run's last; its boundary rewinds and
  the run goes on, as one with the range from the start (K=1, no checkpoints)."""
  a = train(tmp_path / "last", spike=True, k=7, num_steps=37)
  b = train(None, k=1, skip_steps=[(31, 40)], num_steps=37)
  toy.assert_bitwise(a["state"], b["state"])
  assert (a["calls"][-1], b["calls"][-1]) == ((35, 37, 10, 47), (36, 37, 10, 47))
  assert (a["loop"].ledger.lost_steps, a["loop"].status) == (7, "completed")
  assert a["ckpt"].all_steps() == [10, 20, 30, 37]


class PreemptedAtTheRewind(LossSpikeHook):
  """Preempts the run as it rewinds: it stops before the next checkpoint holds the range."""

  def rewind(self, ctx, request, like):
    ctx.preemption.request()
    return super().rewind(ctx, request, like)


def test_a_run_stopped_right_after_a_rewind_meets_the_spike_again_when_resumed(runs, tmp_path):
  _, b = runs
  ckpt = CheckpointHook(tmp_path / "p", every_steps=10, async_save=False)
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4, hooks=[
      ckpt, PreemptedAtTheRewind(ckpt, factor=10, window=5, margin=3)])
  loop.run(toy.init_state(), Steps(), num_steps=50)
  assert (loop.status, loop.ledger.step, loop.ledger.skip_steps) == ("preempted", 30, ((31, 40),))
  assert ckpt.all_steps() == [10, 20, 30]  # 30 was there: the range is in no checkpoint
  resumed = train(tmp_path / "p", spike=True)
  assert [(r["step"], r["restored_step"]) for r in resumed["watch"].rewinds] == [(37, 30)]
  toy.assert_bitwise(resumed["state"], b["state"])
  assert resumed["loop"].ledger.skip_steps == ((31, 40),)


def test_the_skip_range_is_saved_with_the_checkpoints_after_the_rewind(runs):
  a, _ = runs
  ckpt = a["ckpt"]
  like = a["state"]
  assert ckpt.all_steps() == [10, 20, 30, 40, 50]
  saved = {s: ckpt.restore(like, step=s) for s in (30, 40)}
  assert (saved[30].ledger.skip_steps, saved[30].ledger.skipped_steps) == ((), 0)
  assert (saved[40].ledger.skip_steps, saved[40].ledger.skipped_steps) == (((31, 40),), 10)
  assert (saved[30].data_position, saved[40].data_position) == (30, 50)  # batch_at's next index
  windows = [saved[s].hook_states["LossSpikeHook"]["history"] for s in (30, 40)]
  assert [len(w) for w in windows] == [5, 5] and windows[0] != windows[1]
  assert max(windows[1]) < a["watch"].rewinds[0]["value"]  # the spike never entered the window


def test_skips_do_not_depend_on_k(runs):
  _, b = runs
  for k in (1, 7):
    other = train(None, k=k, skip_steps=[(31, 40)])
    toy.assert_bitwise(other["state"], b["state"])
    lo, lb = other["loop"].ledger, b["loop"].ledger
    assert (lo.step, lo.skipped_steps, lo.skip_steps, lo.examples_seen) == (
        lb.step, lb.skipped_steps, lb.skip_steps, lb.examples_seen)
    assert other["rows"] == b["rows"]


def test_a_resume_keeps_the_ranges_and_refuses_one_already_trained(runs, tmp_path):
  _, b = runs
  first = train(tmp_path / "r", skip_steps=[(31, 40)], num_steps=20)
  assert first["loop"].ledger.skip_steps == ((31, 40),)
  resumed = train(tmp_path / "r", num_steps=50)  # no skip_steps given: the checkpoint's kept
  assert resumed["ckpt"].restored_step == 20
  assert resumed["loop"].ledger.skip_steps == ((31, 40),)
  toy.assert_bitwise(resumed["state"], b["state"])
  assert resumed["rows"] == b["rows"][4:]
  with pytest.raises(ValueError) as e:  # data steps 45..60 were trained on
    train(tmp_path / "r", skip_steps=[(45, 65)], num_steps=60)
  assert ("skip_steps entry (45, 65) starts at or before data step 60, where the run is "
          "(step 50 + 10 skipped): the batches of data steps 45..60 were trained on already"
          in str(e.value))
  again = train(tmp_path / "r", skip_steps=[(31, 40), (61, 61)], num_steps=51)  # given again: fine
  assert again["loop"].ledger.skip_steps == ((31, 40), (61, 61))
  assert again["loop"].ledger.data_step == 62


def test_a_plain_iterable_reads_and_drops_the_skipped_batches_and_rewinds(runs, tmp_path):
  _, b = runs
  listed = Listed()
  a = train(tmp_path / "l", spike=True, k=3, source=listed)
  toy.assert_bitwise(a["state"], b["state"])
  assert a["loop"].data_position == 60  # a count: 50 trained + 10 drawn and dropped
  assert a["loop"].ledger.skip_steps == ((31, 40),)
  assert [r["restored_step"] for r in a["watch"].rewinds] == [30]


def test_a_grain_iterator_drops_the_skipped_batches_and_is_set_back_at_a_rewind(runs, tmp_path):
  """A Grain dataset iterator (get_state / set_state): the rewind sets it back to checkpoint
  30's state, the ten batches are drawn and dropped, and the run ends as run B."""
  grain = pytest.importorskip("grain")
  _, b = runs
  dataset = grain.MapDataset.range(80).map(lambda i: batch(int(i))).to_iter_dataset()
  a = train(tmp_path / "grain", spike=True, source=iter(dataset))
  toy.assert_bitwise(a["state"], b["state"])
  assert a["loop"].data_position == {"next_index": 60}
  assert [r["restored_step"] for r in a["watch"].rewinds] == [30]


def test_a_one_shot_iterator_cannot_be_rewound(tmp_path):
  ckpt = CheckpointHook(tmp_path / "g")
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=2,
                           hooks=[ckpt, LossSpikeHook(ckpt)])
  state = toy.init_state()
  with pytest.raises(ValueError, match=r"LossSpikeHook may rewind the run to an earlier "
                     r"checkpoint, but the batches are a one-shot builtins\.generator"):
    loop.run(state, (batch(i) for i in range(10)), num_steps=4)
  assert loop.ledger.step == 0 and ckpt.all_steps() == []


class NanAt(Steps):
  def batch_at(self, i):
    b = super().batch_at(i)
    return {"x": b["x"] * np.float32("nan"), "y": b["y"]} if i + 1 == 3 else b


@pytest.mark.parametrize("source, says", [
    (Steps(spike_at=7), r"loss [0-9.e+]+ at step 7 \(data step 7\) > 10 x the median "
     r"[0-9.e+-]+ of the last 5 steps"),
    (NanAt(spike_at=None), r"loss nan at step 3 \(data step 3\) is not finite"),
])
@pytest.mark.filterwarnings("ignore::loopkit.NonFiniteWarning")  # the NaN case warns too
def test_a_spike_before_any_checkpoint_raises_naming_it(tmp_path, source, says):
  with pytest.raises(LossSpikeError, match=says + r", and .* holds no checkpoint before step "
                     r"\d+ to rewind to"):
    train(tmp_path / "n", spike=True, source=source, every_steps=50)


def test_a_run_that_keeps_spiking_stops_after_max_rewinds(tmp_path):
  class Twice(Steps):
    def batch_at(self, i):
      b = super().batch_at(i)
      return {k: v * 100 for k, v in b.items()} if i + 1 == 22 else b

  with pytest.raises(LossSpikeError, match=r"loss [0-9.e+]+ at step 17 \(data step 22\) > 10 "
                     r"x the median .*, after 1 rewinds in this run \(max_rewinds=1\)"):
    train(tmp_path / "m", spike=True, source=Twice(spike_at=12), every_steps=5, max_rewinds=1,
          num_steps=30)


def test_two_processes_rewind_together_when_one_sees_the_spike(tmp_path):
  """Only process 1's rule sees the spike (a host-local decision): the agreement carries its
  request, both processes rewind at the same boundary (none saves the spiked state) and end
  as run B."""
  from loopkit.tools import testing  # pylint: disable=g-import-not-at-top
  p0, p1 = testing.run_processes("tests.skip_workers:rewind_agreed", num_processes=2,
                                 devices_per_process=1,
                                 args=(str(tmp_path / "a"), str(tmp_path / "b")),
                                 env=toy.compilation_cache_env(tmp_path / "cache"),
                                 timeout_s=240)
  for p in (p0, p1):
    assert p["a"]["restored"] == [30]
    assert p["a"]["params"] == p["b"]["params"] == p0["b"]["params"]
    assert p["a"]["ledger"][:4] == (50, 10, ((31, 40),), 15)  # calls cut at every 10
    assert p["b"]["ledger"][:4] == (50, 10, ((31, 40),), 13)  # cut at 30 only
    assert (p["a"]["ledger"][4], p["b"]["ledger"][4]) == (10, 0)
    assert p["a"]["saved"] == [10, 20, 30, 40, 50]


# -- C71, C79, C80: a rewind is a resume inside the process -------------------------------------

C71_BAD = 23  # the data step whose batch is bad (x1e3, or NaN)
RESTORE_SECS = 100.0  # what the rewind's restore takes on the run's clock (Clock)


class Bad(Steps):
  """Data step 23 scaled by 1e3 (``how="x1e3"``) or NaN (``how="nan"``)."""

  def __init__(self, how):
    super().__init__(spike_at=None)
    self.how = how

  def batch_at(self, i):
    b = super().batch_at(i)
    if i + 1 == C71_BAD:
      scale = np.float32(1e3 if self.how == "x1e3" else "nan")
      b = {"x": b["x"] * scale, "y": b["y"] * scale}
    return b


class Clock:
  """The run's clock (``loopkit.core.run.time`` in the test): ``perf_counter`` reads ``t``,
  which only :class:`Busy` and :class:`SlowRestore` move, so every time bucket is exact."""

  def __init__(self):
    self.t = 0.0

  def perf_counter(self):
    return self.t


class Busy(loopkit.Hook):
  """Productive host time (the ``hooks`` bucket): 1 s on the clock per step of each call;
  keeps goodput's job time at every boundary."""

  needs_state = False

  def __init__(self, clock):
    super().__init__()
    self.clock = clock
    self.job_secs = []

  def on_run_start(self, ctx, state):
    self.ctx = ctx

  def after_each_call(self, info):
    self.clock.t += info.num_steps
    self.job_secs.append(goodput.summarize(self.ctx.ledger).job_secs)


class SlowRestore(LossSpikeHook):
  """A restore that takes RESTORE_SECS on the clock (time of the checkpoint bucket)."""

  def __init__(self, clock, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.clock = clock

  def rewind(self, ctx, request, like):
    self.clock.t += RESTORE_SECS
    return super().rewind(ctx, request, like)


def eval_loss(state, batch):
  pred = batch["x"] @ state["params"]["w"] + state["params"]["b"]
  return {"loss": jnp.mean((pred - batch["y"]) ** 2, axis=-1)}


def tensorboard_scalars(logdir):
  """{tag: [(step, value)]} as TensorBoard shows the event files in ``logdir``: read record by
  record (tensorboardX's Event proto, no TensorFlow), a ``SessionLog.START`` at step ``s``
  (a purge_step) hiding the earlier events at steps ``>= s``."""
  from tensorboardX.proto import event_pb2
  out: dict = {}
  for path in sorted(glob.glob(f"{logdir}/events*")):
    data, i = open(path, "rb").read(), 0
    while i < len(data):  # TFRecord: length (u64), its crc, the record, its crc
      n = struct.unpack("<Q", data[i:i + 8])[0]
      e = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
      i += 16 + n
      if e.HasField("session_log") and e.session_log.status == e.session_log.START:
        out = {tag: [(s, v) for s, v in rows if s < e.step] for tag, rows in out.items()}
      for v in e.summary.value:
        out.setdefault(v.tag, []).append((e.step, v.simple_value))
  return out


def observed(directory, clock, *, k, how="x1e3", skip_steps=None):
  """The C71 run: 40 steps, a checkpoint every 5, an evaluation every 2 (and EarlyStopping
  on it), per-step and every-4 rows into create_default_writer's files (metrics.jsonl and
  TensorBoard's, written on a background thread), goodput rows every 2 steps into
  goodput.jsonl, plain progress lines; with ``skip_steps`` None a LossSpikeHook(factor=10,
  window=5, margin=2) watches the loss, else the run is given the range from the start."""
  writer = create_default_writer(directory, console=False)  # TensorBoard + metrics.jsonl
  goodput_rows = JsonlWriter(directory / "goodput.jsonl", flush_secs=0)
  logging_hook = loopkit.LoggingHook(writer, every_steps=4, throughput=False, per_step=True)
  evals = loopkit.EvalHook(loopkit.Evaluator(eval_loss), [batch(i) for i in range(100, 102)],
                           every_steps=2, writer=writer)
  stop = EarlyStopping(evals, "loss", patience=1000)
  progress = loopkit.ProgressHook(stream=io.StringIO(), log_every_secs=0.0, clock=lambda: 0.0)
  goodput = GoodputHook(goodput_rows, workdir=directory, every_steps=2, log_summary=False)
  ckpt = CheckpointHook(directory / "ckpt", every_steps=5, async_save=False)
  hooks = [Busy(clock), logging_hook, evals, stop, progress, goodput, ckpt]
  if skip_steps is None:
    hooks.append(SlowRestore(clock, ckpt, factor=10, window=5, margin=2))
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=k, hooks=hooks)
  clock.t = 0.0
  state = loop.run(toy.init_state(), Bad(how), num_steps=40, skip_steps=skip_steps)
  wall = clock.t
  writer.close()
  goodput_rows.close()
  return {"loop": loop, "state": state, "wall": wall, "logging": logging_hook, "evals": evals,
          "stop": stop, "progress": progress, "hooks": hooks,
          "tensorboard": tensorboard_scalars(directory),
          "rows": (directory / "metrics.jsonl").read_text().splitlines(),
          "goodput_steps": [json.loads(line)["step"] for line in
                            (directory / "goodput.jsonl").read_text().splitlines()]}


@pytest.mark.parametrize("k, how", [(1, "x1e3"), (3, "x1e3"), (7, "nan")])
@pytest.mark.filterwarnings("ignore::loopkit.NonFiniteWarning")  # the NaN case warns too
def test_after_a_rewind_every_row_record_and_history_is_the_skip_runs(tmp_path, caplog,
                                                                     monkeypatch, k, how):
  """C71, C79, C80: the rewind to 20 skipping (21, 25) leaves what the run given
  skip_steps=[(21, 25)] from the start holds: metrics.jsonl and TensorBoard line for line
  (train, per-step and eval rows), LoggingHook.records, EvalHook.results,
  EarlyStopping.history, the goodput rows' steps; on the run's clock (Clock) the time of the
  thrown-away steps is exactly goodput's lost, the restore's its checkpoint, and the
  productive time the skip run's; one log line says it all."""
  clock = Clock()
  monkeypatch.setattr(loopkit.core.run, "time", clock)
  with caplog.at_level(logging.WARNING, logger="loopkit"):
    a = observed(tmp_path / "a", clock, k=k, how=how)
  b = observed(tmp_path / "b", clock, k=k, how=how, skip_steps=[(21, 25)])
  toy.assert_bitwise(a["state"], b["state"])
  la, lb = a["loop"].ledger, b["loop"].ledger
  assert same_ledger(la, lb) and la.skip_steps == ((21, 25),), (la, lb)
  spike = a["hooks"][-1]
  assert [(r["step"], r["restored_step"]) for r in spike.rewinds] == [(23, 20)]
  # the rows: each step once, with the skip run's values (bitwise: the same JSON text)
  assert a["rows"] == b["rows"]
  assert a["tensorboard"] == b["tensorboard"] and a["tensorboard"]["eval/loss"][10][0] == 22
  steps = [json.loads(line)["step"] for line in a["rows"]]
  assert steps.count(22) == 2 and steps.count(23) == 1  # per-step + eval at 22; per-step at 23
  assert a["logging"].records == b["logging"].records
  assert a["logging"].first_steps == b["logging"].first_steps
  assert [s for s, _ in a["logging"].records] == list(range(4, 41, 4))
  assert [(s, r.metrics) for s, r in a["evals"].results] == [
      (s, r.metrics) for s, r in b["evals"].results]
  assert [s for s, _ in a["evals"].results] == list(range(2, 41, 2))
  assert a["stop"].history == b["stop"].history and len(a["stop"].history) == 20
  assert a["goodput_steps"] == b["goodput_steps"] == list(range(2, 41, 2))
  # C79: the steps trained past 20 and their time are lost; the restore is checkpoint time.
  # The spike's call ends at `end` (its hooks ran), the next call was dispatched (to 24).
  end = int(re.search(r"rewound from step (\d+)", "".join(a["progress"].lines)).group(1))
  assert la.lost_steps == 4 and end in (23, 24)
  ga, gb = goodput.summarize(la), goodput.summarize(lb)
  assert (gb.job_secs, gb.productive_secs, gb.lost_secs, gb.checkpoint_secs) == (40, 40, 0, 0)
  # The checkpoint at 20 holds the total ticked before its boundary's hooks: Busy's seconds
  # of the call that ended at 20 (1 step at K=1, else 2: the evaluations cut calls at even
  # steps) are in its `hooks`, not in its `total`; the lost time counts from that total, as
  # a resume's job time does (a crash's resume misses those seconds in its job time).
  stale = 1 if k == 1 else 2
  assert (ga.lost_secs, ga.lost_steps, ga.checkpoint_secs) == (
      end - 20 + stale, 4, RESTORE_SECS)
  assert ga.job_secs == a["wall"] == 40 + (end - 20) + RESTORE_SECS
  assert ga.productive_secs == gb.productive_secs - stale
  job = a["hooks"][0].job_secs  # goodput's job time never goes back
  assert job == sorted(job), job
  # C80: one line with the spike's step, the restored step and the range
  lines = [r.getMessage() for r in caplog.records if "rewinding" in r.getMessage()]
  assert len(lines) == 1, lines
  assert re.search(r"^SlowRestore: loss \S+ at step 23 \(data step 23\) .*; rewinding from step 23 "
                   r"to step 20, skipping data steps 21\.\.25 \(skip_steps now \[\(21, 25\)\]\); "
                   r"the 4 steps trained past step 20 are thrown away$", lines[0]), lines[0]
  # the progress lines: those of the skip run, with the thrown-away ones and a rewind between
  pa, pb = a["progress"].lines, b["progress"].lines
  at = next(i for i, line in enumerate(pa) if "rewound" in line)
  assert re.fullmatch(r"step 20/40: rewound from step (\d+) to step 20 \(skip_steps "
                      r"\[\(21, 25\)\]\)", pa[at]), pa[at]
  upto20 = pb.index(next(line for line in pb if line.startswith("step 20/40 ")))
  assert pa[:upto20 + 1] == pb[:upto20 + 1] and pa[at + 1:] == pb[upto20 + 1:]
  assert all(int(line.split()[1].split("/")[0]) in range(21, 29) for line in pa[upto20 + 1:at])
