"""Metric writers: JSONL, console, multi, async, process 0 only, every writer against the same
conformance test (TensorBoard read back with TensorBoard's reader); per-step traces at their
true steps. TensorBoardWriter's own tests: tests/test_tensorboard_writer.py."""

import json
import logging
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# TensorBoard's reader uses TensorFlow when it is installed (the test extra has it). No
# 'tensorboard.compat.notf' marker here: it would make TensorBoard's summary ops (used by
# Flax's SummaryWriter in tests/test_writer_adapters.py) fail for the rest of the session.
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import loopkit
from loopkit.observe import writers as writers_lib


def read_tb(logdir):
  """{tag: [(step, value), ...]} from the event files in ``logdir``."""
  acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
  acc.Reload()
  return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def counting_step(state, batch):
  """Metrics known exactly: ``s`` is the global step (1-based) of each step."""
  step = state["step"] + 1
  return ({"w": state["w"] + jnp.sum(batch["x"]), "step": step},
          {"s": step.astype(jnp.float32), "x0": jnp.mean(batch["x"])})


def int_batches(n, b=8):
  return [{"x": np.full((b, 1), i + 0.25, np.float32)} for i in range(n)]


def init():
  return {"w": jnp.zeros((), jnp.float32), "step": jnp.zeros((), jnp.int32)}


class Recorder:
  def __init__(self):
    self.rows = []
    self.flushed = 0
    self.closed = False

  def write_scalars(self, step, scalars):
    self.rows.append((step, dict(scalars)))

  def flush(self):
    self.flushed += 1

  def close(self):
    self.closed = True


def test_loop_writes_tensorboard_and_per_step_traces_at_true_steps(tmp_path):
  """K=4, 10 steps: reports at [4, 8, 10] (means of the calls' steps), per-step values at 1..10."""
  writer = loopkit.observe.create_default_writer(tmp_path, console=False)
  loop = loopkit.TrainLoop(counting_step, iterations_per_loop=4,
                           hooks=[loopkit.LoggingHook(writer, per_step=True)])
  loop.run(init(), int_batches(10), num_steps=10)
  writer.close()
  got = read_tb(tmp_path)
  assert got["s"] == [(4, 2.5), (8, 6.5), (10, 9.5)]
  assert got["per_step/s"] == [(s, float(s)) for s in range(1, 11)]
  assert got["per_step/x0"] == [(s, s - 1 + 0.25) for s in range(1, 11)]
  assert got["examples_seen"] == [(4, 32.0), (8, 64.0), (10, 80.0)]
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  reports = [r for r in rows if "per_step/s" not in r]
  assert [(r["step"], r["s"], r["x0"]) for r in reports] == [
      (4, 2.5, 1.75), (8, 6.5, 5.75), (10, 9.5, 8.75)]
  per_step = [(r["step"], r["per_step/s"]) for r in rows if "per_step/s" in r]
  assert per_step == [(s, float(s)) for s in range(1, 11)]


def test_jsonl_writer_rows(tmp_path):
  w = loopkit.observe.JsonlWriter(tmp_path / "sub" / "m.jsonl")
  w.write_scalars(1, {"a": np.float32(0.5), "n": np.int64(3), "ok": True})
  w.write_scalars(2, {"a": float("nan")})
  w.close()
  lines = open(tmp_path / "sub" / "m.jsonl").read().splitlines()
  assert lines[0] == '{"step": 1, "a": 0.5, "n": 3, "ok": true}'
  assert lines[1] == '{"step": 2, "a": NaN}'


def test_writers_reject_arrays_and_a_step_column(tmp_path):
  w = loopkit.observe.JsonlWriter(tmp_path / "m.jsonl")
  with pytest.raises(ValueError, match=r"scalars, got an array of shape \(2,\)"):
    w.write_scalars(1, {"a": np.zeros(2)})
  with pytest.raises(ValueError, match="named 'step'"):
    w.write_scalars(1, {"step": 1.0})


def test_console_writer_lines(caplog):
  with caplog.at_level(logging.INFO, logger="loopkit"):
    loopkit.observe.ConsoleWriter().write_scalars(12, {"loss": np.float32(0.25), "n": 3,
                                               "bad": float("nan")})
  assert caplog.messages == ["step 12: loss=0.25, n=3, bad=nan"]


def test_format_row_makes_a_wide_row_a_short_aligned_table():
  row = {"loss": 0.52341, "accuracy": 0.91, "epoch": 3, "examples_seen": 192000,
         "throughput/steps_per_sec": 12.345, "throughput/examples_per_sec": 790.08,
         "throughput/secs_per_call": 40.3, "throughput/loop_secs_per_call": 40.1,
         "throughput/hook_secs": 0.4, "throughput/goodput": np.float32(0.5)}
  assert writers_lib.format_row(100, row).splitlines() == [
      "step 100: loss=0.52341, accuracy=0.91, epoch=3, examples_seen=192000",
      "  throughput/ steps_per_sec       12.345   examples_per_sec    790.08   secs_per_call"
      "         40.3",
      "              loop_secs_per_call    40.1   hook_secs              0.4   goodput"
      "                0.5"]
  one_line = writers_lib.format_row(100, row, line_width=None)
  assert one_line.startswith("step 100: loss=0.52341, accuracy=0.91, ") and "\n" not in one_line
  assert one_line.endswith(", throughput/hook_secs=0.4, throughput/goodput=0.5")
  # Names without a prefix that do not fit the first line form a block of their own.
  wide = {f"metric_{i}": float(i) for i in range(12)}
  assert writers_lib.format_row(5, wide, line_width=60).splitlines() == [
      "step 5:",
      "  metric_0    0   metric_1    1   metric_2    2",
      "  metric_3    3   metric_4    4   metric_5    5",
      "  metric_6    6   metric_7    7   metric_8    8",
      "  metric_9    9   metric_10  10   metric_11  11"]
  assert writers_lib.format_row(5, {"a": 1, "b/c": 2}) == "step 5: a=1, b/c=2"  # fits: a line


def test_c68_goodput_rows_are_a_table_on_the_console_and_keep_their_keys_in_files(
    tmp_path, caplog):
  """C68: the goodput/* row (15 keys) is a few aligned lines on the console, no wider than 100
  characters, every key in them; metrics.jsonl has the same row under its full keys."""
  writer = loopkit.observe.create_default_writer(tmp_path, tensorboard=False)
  loop = loopkit.TrainLoop(counting_step, iterations_per_loop=2,
                           hooks=[loopkit.observe.GoodputHook(writer, log_summary=False)])
  with caplog.at_level(logging.INFO, logger="loopkit"):
    loop.run({"w": jnp.zeros(()), "step": jnp.zeros((), jnp.int32)}, int_batches(6),
             num_steps=6)
  writer.close()
  [row] = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  keys = [k for k in row if k != "step"]
  assert row["step"] == 6 and len(keys) == 15 and all(k.startswith("goodput/") for k in keys)
  [text] = [m for m in caplog.messages if m.startswith("step 6:")]
  lines = text.splitlines()
  assert lines[0] == "step 6:"
  assert lines[1].startswith("  goodput/ job_secs ")
  assert all(line.startswith(" " * 11) and line[11] != " " for line in lines[2:])
  assert 1 + 5 <= len(lines) <= 1 + 8  # 3 (or, for values 10+ characters wide, 2) per line
  assert max(len(line) for line in lines) <= 100
  assert len({len(line) for line in lines[1:-1]}) == 1 and len(lines[-1]) <= len(lines[1])
  cells = " ".join(line[11:] for line in lines[1:]).split()
  shown = dict(zip(cells[::2], cells[1::2]))
  assert list(shown) == [k.removeprefix("goodput/") for k in keys]
  for k in keys:
    assert float(shown[k.removeprefix("goodput/")]) == pytest.approx(row[k], rel=1e-5)


def test_multi_writer_fans_out_in_order():
  a, b = Recorder(), Recorder()
  m = loopkit.observe.MultiWriter([a, b])
  m.write_scalars(5, {"x": 1.0})
  m.flush()
  m.close()
  assert a.rows == b.rows == [(5, {"x": 1.0})]
  assert a.flushed == b.flushed == 1 and a.closed and b.closed


class SlowRecorder(Recorder):
  def __init__(self, delay):
    super().__init__()
    self.delay = delay
    self.threads = set()

  def write_scalars(self, step, scalars):
    time.sleep(self.delay)
    self.threads.add(threading.current_thread().name)
    super().write_scalars(step, scalars)


def test_async_writer_does_not_block_and_keeps_order():
  slow = SlowRecorder(0.05)
  w = loopkit.observe.AsyncWriter(slow)
  t0 = time.perf_counter()
  for s in range(1, 6):
    w.write_scalars(s, {"v": jnp.float32(s)})  # a device value: converted off-thread
  enqueue = time.perf_counter() - t0
  assert enqueue < 0.05, enqueue  # five writes of 50 ms each did not wait
  w.flush()
  assert [r[0] for r in slow.rows] == [1, 2, 3, 4, 5]
  assert slow.flushed == 1
  assert slow.threads == {"loopkit-writer"}
  w.close()
  assert slow.closed
  with pytest.raises(RuntimeError, match="closed"):
    w.write_scalars(6, {"v": 1.0})


def test_async_writer_surfaces_errors():
  class Broken(Recorder):
    def write_scalars(self, step, scalars):
      raise OSError("disk full")

  w = loopkit.observe.AsyncWriter(Broken())
  w.write_scalars(1, {"v": 1.0})
  with pytest.raises(RuntimeError, match="disk full"):
    w.flush()
  w.close()


def test_only_process_zero_writes(tmp_path, monkeypatch):
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  w = loopkit.observe.create_default_writer(tmp_path / "p1")
  assert isinstance(w, writers_lib.NullWriter)
  tb = loopkit.observe.TensorBoardWriter(tmp_path / "tb")
  js = loopkit.observe.JsonlWriter(tmp_path / "j" / "m.jsonl")
  for x in (w, tb, js):
    x.write_scalars(1, {"a": 1.0})
    x.close()
  assert not (tmp_path / "p1").exists()
  assert not (tmp_path / "tb").exists()
  assert not (tmp_path / "j").exists()


def test_default_writer_console_only(caplog):
  w = loopkit.observe.create_default_writer(None)
  assert isinstance(w, loopkit.observe.ConsoleWriter)
  with caplog.at_level(logging.INFO, logger="loopkit"):
    w.write_scalars(2, {"a": 1.5})
  assert caplog.messages == ["step 2: a=1.5"]


def _jsonl_rows(d, log):
  return [json.loads(line) for line in open(d / "m.jsonl")]


_ROWS = [{"step": 1, "a": 1.0, "b": 2.0, "c": 3, "d": 4}]


@pytest.mark.parametrize("make,read,want", [
    (lambda d: loopkit.observe.TensorBoardWriter(d / "tb"), lambda d, log: read_tb(d / "tb"),
     {"a": [(1, 1.0)], "b": [(1, 2.0)], "c": [(1, 3.0)], "d": [(1, 4.0)]}),
    (lambda d: loopkit.observe.JsonlWriter(d / "m.jsonl"), _jsonl_rows, _ROWS),
    (lambda d: loopkit.observe.ConsoleWriter(), lambda d, log: log.messages,
     ["step 1: a=1, b=2, c=3, d=4"]),
    (lambda d: loopkit.observe.MultiWriter([loopkit.observe.JsonlWriter(d / "m.jsonl")]),
     _jsonl_rows, _ROWS),
    (lambda d: loopkit.observe.AsyncWriter(loopkit.observe.JsonlWriter(d / "m.jsonl")),
     _jsonl_rows, _ROWS),
    (lambda d: writers_lib.NullWriter(), lambda d, log: os.listdir(d) + log.messages, []),
], ids=["tensorboard", "jsonl", "console", "multi", "async", "null"])
def test_writer_conformance(tmp_path, caplog, make, read, want):
  """Every writer takes python/numpy/JAX scalars at int steps, flushes, closes twice, and what
  it wrote reads back (TensorBoard's reader, the JSONL lines, the console's log records)."""
  with caplog.at_level(logging.INFO, logger="loopkit"):
    w = make(tmp_path)
    w.write_scalars(1, {"a": 1.0, "b": np.float32(2.0), "c": jnp.int32(3), "d": np.int64(4)})
    w.flush()
    w.close()
    w.close()
  assert read(tmp_path, caplog) == want


@pytest.mark.parametrize("kind,lines", [("none", 1), ("jsonl", 1), ("console", 1),
                                        ("default", 1), ("async_multi_console", 1)])
def test_logging_hook_logs_each_boundary_once(kind, lines, tmp_path, caplog):
  """A writer that prints to the console replaces the hook's own log line, never doubles it."""
  writer = {"none": None,
            "jsonl": writers_lib.JsonlWriter(tmp_path / "m.jsonl"),
            "console": writers_lib.ConsoleWriter(),
            "default": writers_lib.create_default_writer(tmp_path),
            "async_multi_console": writers_lib.AsyncWriter(writers_lib.MultiWriter(
                [writers_lib.ConsoleWriter(), writers_lib.NullWriter()]))}[kind]

  def step(state, batch):
    return {"step": state["step"] + 1}, {"loss": jnp.mean(batch["x"])}

  hook = loopkit.LoggingHook(writer, every_steps=2)
  with caplog.at_level(logging.INFO, logger="loopkit"):
    loopkit.TrainLoop(step, iterations_per_loop=2, hooks=[hook]).run(
        {"step": jnp.zeros((), jnp.int32)}, [{"x": np.full((8, 1), i, np.float32)}
                                              for i in range(4)], num_steps=4)
    if writer is not None:
      writer.close()
  at_4 = [m for m in caplog.messages if m.startswith("step 4: loss=2.5")]
  assert len(at_4) == lines, caplog.messages


# -- beyond scalars (CLU's write_images / write_histograms / write_texts / write_hparams) ------


def test_jsonl_and_console_record_texts_and_hparams_and_skip_the_rest(tmp_path, caplog):
  j = loopkit.observe.JsonlWriter(tmp_path / "m.jsonl")
  c = loopkit.observe.ConsoleWriter()
  with caplog.at_level(logging.DEBUG, logger="loopkit"):
    for w in (j, c):
      w.write_hparams({"lr": np.float32(0.5), "opt": "sgd"})
      w.write_texts(2, {"note": "hi"})
      w.write_images(2, {"img": np.zeros((2, 2, 3))})
      w.write_histograms(2, {"w": np.zeros(3)})
  j.close()
  assert open(tmp_path / "m.jsonl").read().splitlines() == [
      '{"hparams": {"lr": 0.5, "opt": "sgd"}}', '{"step": 2, "note": "hi"}']
  infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
  assert infos == ["hparams: lr=0.5, opt=sgd", "step 2: note=hi"]
  debugs = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
  assert debugs == [
      "JsonlWriter does not record images; skipped ['img'] at step 2",
      "JsonlWriter does not record histograms; skipped ['w'] at step 2",
      "ConsoleWriter does not record images; skipped ['img'] at step 2",
      "ConsoleWriter does not record histograms; skipped ['w'] at step 2"]


class FullRecorder(Recorder):
  def write_texts(self, step, texts):
    self.rows.append((step, ("texts", dict(texts))))

  def write_images(self, step, images):
    self.rows.append((step, ("images", sorted(images))))

  def write_histograms(self, step, arrays, num_buckets=None):
    self.rows.append((step, ("histograms", sorted(arrays), num_buckets)))

  def write_hparams(self, hparams):
    self.rows.append((None, ("hparams", dict(hparams))))


@pytest.mark.parametrize("wrap", ["multi", "async"])
def test_multi_and_async_fan_out_every_method_and_skip_writers_without_it(wrap):
  full, scalars_only = FullRecorder(), Recorder()
  inner = loopkit.observe.MultiWriter([full, scalars_only])
  w = inner if wrap == "multi" else loopkit.observe.AsyncWriter(inner)
  w.write_hparams({"lr": 0.1})
  w.write_scalars(1, {"a": 1.0})
  w.write_texts(1, {"t": "x"})
  w.write_images(2, {"i": np.zeros((1, 1, 1))})
  w.write_histograms(3, {"h": np.zeros(2)}, num_buckets={"h": 4})
  w.close()
  assert full.rows == [(None, ("hparams", {"lr": 0.1})), (1, {"a": 1.0}),
                       (1, ("texts", {"t": "x"})), (2, ("images", ["i"])),
                       (3, ("histograms", ["h"], {"h": 4}))]
  assert scalars_only.rows == [(1, {"a": 1.0})]
  nw = writers_lib.NullWriter()
  nw.write_images(1, {}), nw.write_histograms(1, {}), nw.write_texts(1, {}), nw.write_hparams({})
