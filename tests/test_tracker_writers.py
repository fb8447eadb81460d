"""MlflowWriter and WandbWriter: a loop's LoggingHook and EvalHook rows, read back from an
MLflow file store and a W&B offline run, equal the JSONL writer's rows (step, key, value)."""

import glob
import json
import logging
import os
import shutil
import signal
import struct
import subprocess
import time

import jax.numpy as jnp
import pytest
import toy

import loopkit
from loopkit.observe import writers as writers_lib
from loopkit.observe.tracker_writers import (
  ID_FILE,
  JOURNAL_FILE,
  MLFLOW_ID_FILE,
  _Names,
  mlflow_name,
)
from tests import bootstrap

HPARAMS = {"lr": 0.05, "batch_size": 16, "model": "linear", "nesterov": False}


def _step(state, batch):
  """toy's step and a metric whose name MLflow refuses ('@')."""
  state, metrics = toy.make_global_step()(state, batch)
  return state, {**metrics, "acc@1": jnp.sqrt(metrics["loss"])}


def _train(tracker, tmp_path):
  """7 steps, K=3: LoggingHook every 2 steps, EvalHook every 3 (and at the end), both writing to
  ``tracker`` and a JsonlWriter; hparams and a text row too. Returns the JSONL rows."""
  jsonl = writers_lib.JsonlWriter(tmp_path / "metrics.jsonl")
  writer = writers_lib.MultiWriter([jsonl, tracker])
  writer.write_hparams(HPARAMS)

  def eval_step(state, batch):
    return {"err": (batch["x"] @ state["params"]["w"] - batch["y"])[:, 0] ** 2}

  loop = loopkit.TrainLoop(_step, iterations_per_loop=3, hooks=[
      loopkit.LoggingHook(writer, every_steps=2, throughput=False),
      loopkit.EvalHook(loopkit.Evaluator(eval_step), toy.batches(2), writer=writer,
                       every_steps=3)])
  loop.run(toy.init_state(), toy.batches(7), num_steps=7)
  writer.write_texts(7, {"note": "done"})
  writer.close()
  return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def _points(rows):
  """{(step, key): value} of the numeric values of the JSONL rows, values as floats."""
  out = {}
  for r in rows:
    for k, v in r.items():
      if k not in ("step", "hparams") and not isinstance(v, str):
        assert (r["step"], k) not in out
        out[(r["step"], k)] = float(v)
  return out


def test_mlflow_names_map_forbidden_characters_and_refuse_clashes():
  assert mlflow_name("throughput/steps_per_sec") == "throughput/steps_per_sec"
  assert mlflow_name("eval/top-1 acc:v2.0") == "eval/top-1 acc:v2.0"
  assert mlflow_name("acc@1") == "acc_1"
  assert mlflow_name("loss[0]") == "loss_0_"
  with pytest.raises(ValueError, match=r"'eval//err' is not a plain path"):
    mlflow_name("eval//err")
  with pytest.raises(ValueError, match=r"'x{251}' is 251 characters long"):
    mlflow_name("x" * 251)
  names = _Names(mlflow_name)
  assert names("acc@1") == names("acc@1") == "acc_1"
  with pytest.raises(ValueError, match=r"'acc@1' and 'acc\[1' are both 'acc_1'"):
    names("acc[1")


def test_mlflow_writer_rows_equal_the_jsonl_rows(tmp_path, monkeypatch):
  pytest.importorskip("mlflow")
  from mlflow.tracking import MlflowClient
  monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3: the file store is opt-in
  uri = (tmp_path / "mlruns").as_uri()
  tracker = loopkit.observe.MlflowWriter(experiment="loopkit-test", run_name="toy",
                                         tracking_uri=uri)
  rows = _train(tracker, tmp_path)
  want = _points(rows)
  assert sorted({s for s, _ in want}) == [2, 3, 4, 6, 7]
  assert want[(7, "eval/num_examples")] == 32.0 and (6, "acc@1") in want

  client = MlflowClient(uri)
  run = client.get_run(tracker.run_id)
  assert run.info.status == "FINISHED" and run.info.run_name == "toy"
  got = {}
  for key in {k for _, k in want}:
    for m in client.get_metric_history(tracker.run_id, mlflow_name(key)):
      assert (m.step, key) not in got
      got[(m.step, key)] = m.value
  assert got == want  # every (step, key, value), exactly
  assert set(run.data.metrics) == {mlflow_name(k) for _, k in want}
  assert run.data.params == {"lr": "0.05", "batch_size": "16", "model": "linear",
                             "nesterov": "False"}
  assert rows[0] == {"hparams": HPARAMS}
  text = client.download_artifacts(tracker.run_id, "texts/note/step_7.txt", str(tmp_path))
  assert open(text).read() == "done"


def _wandb_records(run_dir):
  """The records of a run's ``.wandb`` file: W&B's header (":W&B", 2 magic bytes, version),
  then LevelDB log records in 32 KiB blocks (crc32c, length, type: 1 full, 2 first, 3 middle,
  4 last), each a ``wandb_internal_pb2.Record``. (wandb 0.31 ships no Python reader.)"""
  from wandb.proto import wandb_internal_pb2
  paths = glob.glob(f"{run_dir}/run-*.wandb")
  if not paths:  # not made yet
    return []
  [path] = paths
  data = open(path, "rb").read()
  if len(data) < 7:  # not written yet
    return []
  assert data[:4] == b":W&B"
  pos, block, out, buf = 7, 32768, [], b""
  while pos + 7 <= len(data):
    if block - pos % block < 7:  # a block's tail too short for a header is padding
      pos += block - pos % block
      continue
    _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
    if pos + 7 + n > len(data):  # being written
      break
    if kind == 0:
      pos += block - pos % block
      continue
    buf = data[pos + 7:pos + 7 + n] if kind in (1, 2) else buf + data[pos + 7:pos + 7 + n]
    pos += 7 + n
    if kind in (1, 4):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(buf)
      out.append(record)
  return out


def _wandb_history(run_dir):
  """{(step, key): value} of the run's history rows (W&B's own `_` keys left out), and the
  config's updates {key: value}. ``run.finish()`` returns before W&B's service process has
  written the file (seen: 1 in 5 times, only the header there): this waits for its last
  record, the run's exit."""
  deadline = time.monotonic() + 30
  while not any(r.WhichOneof("record_type") == "exit" for r in _wandb_records(run_dir)):
    assert time.monotonic() < deadline, "W&B wrote no exit record in 30 s"
    time.sleep(0.05)
  history, config = {}, {}
  for r in _wandb_records(run_dir):
    kind = r.WhichOneof("record_type")
    if kind == "history":
      for item in r.history.item:
        key = item.key or "/".join(item.nested_key)
        if not key.startswith("_"):
          assert (r.history.step.num, key) not in history
          history[(r.history.step.num, key)] = json.loads(item.value_json)
    elif kind in ("config", "run"):
      updates = r.config.update if kind == "config" else r.run.config.update
      config.update({i.key: json.loads(i.value_json) for i in updates if i.key != "_wandb"})
  return history, config


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
  wandb = pytest.importorskip("wandb")
  for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
    monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
  monkeypatch.setenv("WANDB_SILENT", "true")
  return dict(project="loopkit-test", dir=tmp_path / "work", mode="offline",
              settings=wandb.Settings(console="off"))


def test_wandb_writer_rows_equal_the_jsonl_rows(tmp_path, wandb_offline):
  tracker = loopkit.observe.WandbWriter(**wandb_offline)
  run_id = tracker.run.id
  rows = _train(tracker, tmp_path)
  assert (tmp_path / "work" / ID_FILE).read_text() == run_id + "\n"
  [run_dir] = glob.glob(f"{tmp_path}/work/wandb/offline-run-*-{run_id}")
  history, config = _wandb_history(run_dir)
  want = _points(rows)
  want[(7, "note")] = "done"
  assert sorted({s for s, _ in want}) == [2, 3, 4, 6, 7]
  assert {k: (v if isinstance(v, str) else float(v)) for k, v in history.items()} == want
  assert config == HPARAMS


def test_wandb_writer_keeps_the_first_rows_of_a_step_written_again(tmp_path, wandb_offline,
                                                                   caplog):
  """W&B's steps only increase: after keep_through(2) the rewrites at 4 and 6 are not sent
  (one WARNING naming them), the row at 8 is; a second writer in the same dir has the same id."""
  tracker = loopkit.observe.WandbWriter(**wandb_offline)
  for s in (2, 4, 6):
    tracker.write_scalars(s, {"loss": float(s)})
  writers_lib.keep_rows_through(tracker, 2)
  with caplog.at_level(logging.WARNING, "loopkit"):
    for s in (4, 6, 8):
      tracker.write_scalars(s, {"loss": s + 0.5})
  assert [r.getMessage() for r in caplog.records if r.name == "loopkit"] == [
      f"W&B run {tracker.run.id} already holds steps up to 6 (its steps only increase): the "
      "rows at steps 4..6 were not sent again; W&B keeps the earlier ones"]
  tracker.close()
  [run_dir] = glob.glob(f"{tmp_path}/work/wandb/offline-run-*-{tracker.run.id}")
  history, _ = _wandb_history(run_dir)
  assert history == {(2, "loss"): 2.0, (4, "loss"): 4.0, (6, "loss"): 6.0, (8, "loss"): 8.5}
  again = loopkit.observe.WandbWriter(**wandb_offline)  # a restarted job in the same workdir
  assert again.run.id == tracker.run.id
  again.close()


def test_mlflow_writer_writes_to_the_active_run_and_leaves_it_open(tmp_path, monkeypatch):
  mlflow = pytest.importorskip("mlflow")
  monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
  monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
  with mlflow.start_run() as active:
    writer = loopkit.observe.MlflowWriter()
    assert writer.run_id == active.info.run_id
    writer.write_scalars(3, {"loss": 0.5, "eval/acc@1": 1})
    writer.close()
    client = mlflow.tracking.MlflowClient()
    assert client.get_run(active.info.run_id).info.status == "RUNNING"
  history = client.get_metric_history(active.info.run_id, "eval/acc_1")
  assert [(m.step, m.value) for m in history] == [(3, 1.0)]
  assert client.get_run(active.info.run_id).info.status == "FINISHED"


def test_mlflow_warns_once_for_the_steps_it_already_holds_whatever_rows_share_them(
    tmp_path, monkeypatch, caplog):
  """A resumed run writes steps 14..16 again in two rows a step (a LoggingHook's and an
  EvalHook's), one of them with a name the run lacks: the held points are not sent, the new
  name is, and one WARNING names 14..16 (two did: a row sent at 16 reported the steps so far)."""
  pytest.importorskip("mlflow")
  monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
  uri = (tmp_path / "mlruns").as_uri()
  first = loopkit.observe.MlflowWriter(experiment="e", tracking_uri=uri, dir=tmp_path)
  for step in (12, 14, 16):
    first.write_scalars(step, {"loss": step, "eval/loss": -step})
  again = loopkit.observe.MlflowWriter(experiment="e", tracking_uri=uri, dir=tmp_path)
  with caplog.at_level(logging.WARNING, "loopkit"):
    for step in (14, 16, 18):
      again.write_scalars(step, {"loss": step + 0.5, **({"lr": 1} if step == 16 else {})})
      again.write_scalars(step, {"eval/loss": -step - 0.5})
    again.close()
  assert [r.getMessage() for r in caplog.records if r.name == "loopkit"] == [
      f"MLflow run {again.run_id} already holds these metrics up to step 16: the points at "
      "steps 14..16 were not logged again; MLflow keeps the earlier ones"]
  assert _mlflow_points(again.client, again.run_id) == {
      **{(s, "loss"): s for s in (12, 14, 16)}, **{(s, "eval/loss"): -s for s in (12, 14, 16)},
      (16, "lr"): 1, (18, "loss"): 18.5, (18, "eval/loss"): -18.5}


def test_trackers_on_other_processes_write_and_import_nothing(tmp_path, monkeypatch):
  import sys

  import jax
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  monkeypatch.setitem(sys.modules, "mlflow", None)  # importing it would raise
  monkeypatch.setitem(sys.modules, "wandb", None)
  for w in (loopkit.observe.MlflowWriter(experiment="x"),
            loopkit.observe.WandbWriter(project="x", dir=tmp_path / "w", mode="offline")):
    w.write_hparams({"lr": 0.1})
    w.write_scalars(1, {"loss": 1.0})
    w.write_texts(1, {"note": "x"})
    w.flush()
    w.close()
  assert list(tmp_path.iterdir()) == []


def _wandb_points(workdir, run_id):
  """{(step, key): value} of the history rows of every offline directory of W&B run ``run_id``
  under ``workdir/wandb`` (a killed attempt's, whose file W&B left as it was, and finished
  ones'), each (step, key) asserted once across them; and the finished ones' exit codes."""
  points, exits = {}, []
  for run_dir in sorted(glob.glob(f"{workdir}/wandb/offline-run-*-{run_id}")):
    for r in _wandb_records(run_dir):
      kind = r.WhichOneof("record_type")
      if kind == "history":
        for item in r.history.item:
          key = item.key or "/".join(item.nested_key)
          if not key.startswith("_"):
            assert (r.history.step.num, key) not in points, (run_dir, r.history.step.num, key)
            points[(r.history.step.num, key)] = json.loads(item.value_json)
      elif kind == "exit":
        exits.append(r.exit.exit_code)
  return points, exits


def _mlflow_points(client, run_id):
  """{(step, name): value} of an MLflow run's metrics, each (step, name) asserted once."""
  got = {}
  for name in client.get_run(run_id).data.metrics:
    for m in client.get_metric_history(run_id, name):
      assert (m.step, name) not in got, (m.step, name)
      got[(m.step, name)] = m.value
  return got


def _tracker_loop(writer, tmp_path, raise_at=None):
  """toy, K=2, 20 steps: a LoggingHook every 2 steps and an EvalHook every 4 writing to
  ``writer``, a checkpoint every 6; a hook raising once at ``raise_at``."""
  def eval_step(state, batch):
    return {"err": (batch["x"] @ state["params"]["w"] - batch["y"])[:, 0] ** 2}

  armed = [raise_at is not None]

  def fail(info, state):
    if armed[0]:
      armed[0] = False
      raise RuntimeError("boom")

  return loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=2, hooks=[
      loopkit.LoggingHook(writer, every_steps=2, throughput=False),
      loopkit.EvalHook(loopkit.Evaluator(eval_step), toy.batches(2), writer=writer,
                       every_steps=4),
      loopkit.CheckpointHook(tmp_path / "ckpt", every_steps=6, async_save=False),
      loopkit.CallbackHook(fail, at_steps=[raise_at or 20], at_end=False)])


def test_trackers_hold_each_step_once_after_a_rerun_in_the_same_process(
    tmp_path, wandb_offline, monkeypatch, caplog):
  """C73: a hook raises at 16 (checkpoint at 12), ``run`` is called again in the same process:
  MLflow and W&B hold each (step, key) once, with the values of metrics.jsonl; the MLflow run is
  FAILED after the first run and FINISHED after the second; W&B's run exits with code 0."""
  pytest.importorskip("mlflow")
  pytest.importorskip("orbax.checkpoint")
  from mlflow.tracking import MlflowClient
  monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
  uri = (tmp_path / "mlruns").as_uri()
  mlflow_writer = loopkit.observe.MlflowWriter(experiment="rerun", tracking_uri=uri,
                                               dir=tmp_path / "work")
  wandb_writer = loopkit.observe.WandbWriter(**wandb_offline)
  writer = writers_lib.MultiWriter([writers_lib.JsonlWriter(tmp_path / "metrics.jsonl"),
                                    mlflow_writer, wandb_writer])
  client = MlflowClient(uri)
  loop = _tracker_loop(writer, tmp_path, raise_at=16)
  with pytest.raises(RuntimeError, match="boom"):
    loop.run(toy.init_state(), toy.batches(20), num_steps=20)
  assert client.get_run(mlflow_writer.run_id).info.status == "FAILED"
  with caplog.at_level(logging.WARNING, "loopkit"):
    loop.run(toy.init_state(), toy.batches(20), num_steps=20)
  assert loop.status == "completed"
  assert client.get_run(mlflow_writer.run_id).info.status == "FINISHED"
  assert sorted(r.getMessage() for r in caplog.records if r.name == "loopkit" and
                r.levelno == logging.WARNING) == [
      f"MLflow run {mlflow_writer.run_id} already holds these metrics up to step 16: the "
      "points at steps 14..16 were not logged again; MLflow keeps the earlier ones",
      f"W&B run {wandb_writer.run.id} already holds steps up to 16 (its steps only increase): "
      "the rows at steps 14..16 were not sent again; W&B keeps the earlier ones"]
  writer.close()
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  want = _points(rows)
  assert sorted({s for s, _ in want}) == list(range(2, 21, 2))
  assert _mlflow_points(client, mlflow_writer.run_id) == want
  assert client.get_run(mlflow_writer.run_id).info.status == "FINISHED"
  [run_dir] = glob.glob(f"{tmp_path}/work/wandb/offline-run-*-{wandb_writer.run.id}")
  history, _ = _wandb_history(run_dir)
  assert {k: float(v) for k, v in history.items()} == want
  assert _wandb_points(tmp_path / "work", wandb_writer.run.id)[1] == [0]
  journal = [json.loads(line) for line in (tmp_path / "work" / JOURNAL_FILE).read_text().split(
      "\n") if line]
  assert journal == rows  # the rows file is metrics.jsonl's twin


def test_a_restarted_wandb_writer_sends_only_the_rows_its_run_lacks(tmp_path, wandb_offline):
  """A preempted process (rows 2..6, "interrupted": exit code 1) and its restart from step 6
  (rows 8, 10) in the same dir: the restart reads the first offline directory's file (it holds
  2..6), so the rows file's rows there are not sent again; the W&B run's directories hold each
  step once. With the first directory's file gone (as a kill leaves it: no row), the restart
  sends the rows file's rows through 6 first."""
  first = loopkit.observe.WandbWriter(**wandb_offline)
  for s in (2, 4, 6):
    first.write_scalars(s, {"loss": float(s)})
  writers_lib.mark_run_outcome(first, status="preempted")
  first.close()
  _wandb_history(glob.glob(f"{tmp_path}/work/wandb/offline-run-*-{first.run.id}")[0])
  for lost in (False, True):
    if lost:  # no second attempt, and the first attempt's file as a kill leaves it
      first_dir, second_dir = sorted(  # offline-run-TIME-ID: the attempts in order
          glob.glob(f"{tmp_path}/work/wandb/offline-run-*-{first.run.id}"))
      shutil.rmtree(second_dir)
      with open(glob.glob(f"{first_dir}/*.wandb")[0], "r+b") as f:
        f.truncate(7)
    # W&B names an offline directory offline-run-YYYYmmdd_HHMMSS-ID: an attempt started in the
    # same second as the last one would share its directory (flaky here under load, 1 in 3)
    time.sleep(1.0 - time.time() % 1.0 + 0.01)
    again = loopkit.observe.WandbWriter(**wandb_offline)
    assert again.run.id == first.run.id
    writers_lib.keep_rows_through(again, 6)
    for s in (8, 10):
      again.write_scalars(s, {"loss": float(s)})
    again.close()
    _wandb_history(sorted(glob.glob(f"{tmp_path}/work/wandb/offline-run-*-{first.run.id}"))[-1])
    points, exits = _wandb_points(tmp_path / "work", first.run.id)
    assert points == {(s, "loss"): float(s) for s in (2, 4, 6, 8, 10)}
    assert exits == ([0] if lost else [1, 0])


def test_mlflow_writer_marks_how_training_ended(tmp_path, monkeypatch):
  """FINISHED / KILLED / FAILED as the hooks tell (mark_run_outcome), RUNNING again when a run
  of the loop starts; a run given by hand is ended too (close in a ``finally`` while an error
  is raised: FAILED), the id file makes the next writer continue the same run."""
  pytest.importorskip("mlflow")
  from mlflow.tracking import MlflowClient
  monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
  uri = (tmp_path / "mlruns").as_uri()
  client = MlflowClient(uri)
  writer = loopkit.observe.MlflowWriter(experiment="marks", tracking_uri=uri, dir=tmp_path)
  status = lambda: client.get_run(writer.run_id).info.status  # noqa: E731
  assert (tmp_path / MLFLOW_ID_FILE).read_text() == writer.run_id + "\n"
  for how, want in [({"status": "completed"}, "FINISHED"), ({"status": "preempted"}, "KILLED"),
                    ({"status": "time limit"}, "KILLED"), ({"status": "early stopped"},
                                                           "FINISHED"),
                    ({"error": RuntimeError()}, "FAILED"), ({"error": KeyboardInterrupt()},
                                                            "KILLED")]:
    writers_lib.keep_rows_through(writer, 0)  # a run of the loop starts
    assert status() == "RUNNING"
    assert writers_lib.mark_run_outcome(writer, **how) == {
        "FINISHED": "completed", "KILLED": "interrupted", "FAILED": "failed"}[want]
    assert status() == want, how
  background = writers_lib.AsyncWriter(writers_lib.MultiWriter([writer]))  # passed on, in order
  writers_lib.keep_rows_through(background, 0)
  writers_lib.mark_run_outcome(background, status="preempted")
  background.flush()
  assert status() == "KILLED"
  with pytest.raises(ValueError, match="outcome 'done' is not one of"):
    writer.mark_outcome("done")
  again = loopkit.observe.MlflowWriter(experiment="marks", tracking_uri=uri, dir=tmp_path)
  assert again.run_id == writer.run_id and status() == "RUNNING"  # a restart continues it
  again.close()
  assert status() == "FINISHED"
  by_hand = loopkit.observe.MlflowWriter(run=writer.run_id, tracking_uri=uri)
  assert status() == "RUNNING"
  with pytest.raises(RuntimeError):
    try:
      raise RuntimeError("training failed")
    finally:
      by_hand.close()
  assert status() == "FAILED"
  assert len(client.search_runs([client.get_run(writer.run_id).info.experiment_id])) == 1


def test_a_wandb_writer_in_a_child_of_a_wandb_process_uses_its_own_service(tmp_path,
                                                                          wandb_offline):
  """C83: this process called wandb.init, so WANDB_SERVICE is in its children's environment;
  a child's WandbWriter starts a W&B service of its own (a killed run's id would stay in use in
  the shared one)."""
  loopkit.observe.WandbWriter(**{**wandb_offline, "dir": tmp_path / "parent"}).close()
  assert os.environ.get("WANDB_SERVICE")
  code = ("import os, sys, wandb; from loopkit.observe import WandbWriter; "
          "from wandb.sdk import wandb_setup; "
          "w = WandbWriter(project='c83', dir=sys.argv[1], mode='offline', "
          "settings=wandb.Settings(console='off')); "
          "print('OWN', wandb_setup._singleton._connection.owns_service); w.close()")
  out = subprocess.run(bootstrap.command("-c", code, tmp_path / "child", devices=1),
                       env=bootstrap.env(), capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "OWN True" in out.stdout


WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_tracker_worker.py")


@pytest.mark.slow(
    held_by="tests/test_tracker_writers.py::"
            "test_trackers_hold_each_step_once_after_a_rerun_in_the_same_process",
    reason="two processes with MLflow and W&B (about 25 s); the in-process rerun holds the "
           "same steps-once rule, the child test holds C83's own service")
def test_trackers_hold_every_step_once_after_a_kill_and_a_restart(tmp_path, wandb_offline,
                                                                   monkeypatch):
  """C72, C73, C83: tests/_tracker_worker.py (checkpoints every 6 steps, rows every 2, evals
  every 4, to JSONL, MLflow and W&B offline) SIGKILLed at step 16, in a child of this process,
  which called wandb.init (WANDB_SERVICE set), then restarted: W&B's killed attempt kept no
  row in its file (its service writes 32 KiB blocks), the rows file the rows through the
  checkpoint at 12; after the restart, MLflow's one run (FINISHED) and the W&B run's offline
  directories hold each (step, key) of metrics.jsonl once, with its values."""
  pytest.importorskip("mlflow")
  pytest.importorskip("orbax.checkpoint")
  from mlflow.tracking import MlflowClient
  monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
  loopkit.observe.WandbWriter(**{**wandb_offline, "dir": tmp_path / "parent"}).close()
  assert os.environ.get("WANDB_SERVICE")  # the children inherit it (C83)
  work = tmp_path / "work"

  def worker(*args):
    return subprocess.run(bootstrap.command(WORKER, "--dir", work, *args, devices=1),
                          env=bootstrap.env(),
                          capture_output=True, text=True, timeout=120)

  killed = worker("--kill-at", "16")
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
  [ids] = [line.split()[1:] for line in killed.stdout.splitlines() if line.startswith("RUN")]
  mlflow_id, wandb_id = ids
  client = MlflowClient((work / "mlruns").as_uri())
  assert client.get_run(mlflow_id).info.status == "RUNNING"
  assert max(s for s, _ in _mlflow_points(client, mlflow_id)) == 16
  assert _wandb_points(work, wandb_id) == ({}, [])  # W&B's file: no row reached the disk
  journal = [json.loads(line) for line in (work / JOURNAL_FILE).read_text().splitlines()]
  assert [r["step"] for r in journal] == [2, 4, 4, 6, 8, 8, 10, 12, 12]

  resumed = worker()
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "STATUS completed 20" in resumed.stdout
  assert f"RUN {mlflow_id} {wandb_id}" in resumed.stdout  # the same runs
  rows = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
  want = _points(rows)
  assert sorted({s for s, _ in want}) == list(range(2, 21, 2))
  assert _mlflow_points(client, mlflow_id) == want
  assert client.get_run(mlflow_id).info.status == "FINISHED"
  [experiment] = [e for e in client.search_experiments() if e.name == "loopkit-kill"]
  assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [mlflow_id]
  _wandb_history(sorted(glob.glob(f"{work}/wandb/offline-run-*-{wandb_id}"))[-1])  # its exit
  points, exits = _wandb_points(work, wandb_id)
  assert {k: float(v) for k, v in points.items()} == want
  assert exits == [0]
