"""loopkit prints by default in a plain script, once, on process 0 only, whatever absl, Orbax or
CLU did to the root logger; an application's own logging configuration wins
(loopkit._internal.logs).

The fault lives in process-wide logging state, so each case runs a script in a subprocess."""

import io
import json
import logging
import os
import re
import subprocess
import sys

import pytest

from loopkit._internal import logs
from tests import bootstrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_usage_snippet() -> str:
  text = open(os.path.join(ROOT, "README.md")).read()
  usage = text[text.index("## Usage"):]
  return re.search(r"```python\n(.*?)```", usage, re.S).group(1)


def run_script(code: str, tmp_path) -> subprocess.CompletedProcess:
  path = tmp_path / "script.py"
  path.write_text(code)
  return subprocess.run(bootstrap.command(path, devices=8), capture_output=True, text=True,
                        env=bootstrap.env(), cwd=str(tmp_path), timeout=300, check=True)


def test_the_readme_snippet_prints_its_metrics_as_a_plain_script(tmp_path):
  out = run_script(readme_usage_snippet().replace("/tmp/loopkit-usage", str(tmp_path)), tmp_path)
  lines = [line for line in out.stderr.splitlines() if line.startswith("step ")]
  assert [line.split(":")[0] for line in lines] == ["step 25", "step 50", "step 75", "step 100"]
  assert re.match(r"step 25: loss=[0-9.e+-]+, epoch=0, examples_seen=1600$", lines[0]), lines[0]


@pytest.mark.parametrize("config,expected", [
    ("level=logging.WARNING", 0),  # the default format: absl's stand-in looks the same
    ("level=logging.INFO, format='APP %(message)s'", 4)])
def test_a_script_that_configured_logging_gets_its_own_format_once(tmp_path, config, expected):
  code = (f"import logging\nlogging.basicConfig({config})\n"
          + readme_usage_snippet().replace("/tmp/loopkit-usage", str(tmp_path)))
  out = run_script(code, tmp_path)
  lines = [line for line in out.stderr.splitlines() if "step " in line and "loss=" in line]
  assert len(lines) == expected and all(line.startswith("APP step ") for line in lines), lines


def test_only_process_zero_prints_info(monkeypatch, capsys):
  logger = logging.getLogger("test_logs_child")
  handler = logs._DefaultHandler()
  record = logger.makeRecord("loopkit", logging.INFO, __file__, 1, "step %d: x=1", (3,), None)
  warning = logger.makeRecord("loopkit", logging.WARNING, __file__, 1, "careful", (), None)
  monkeypatch.setattr(logging.getLogger(), "handlers", [])  # as in a plain script
  for index, shown in ((0, "step 3: x=1\nloopkit WARNING: careful\n"),
                       (1, "loopkit WARNING: careful\n")):
    monkeypatch.setattr(logs, "_process_index", lambda index=index: index)
    handler.emit(record)
    handler.emit(warning)
    assert capsys.readouterr().err == shown


# A tiny loop: rows every 10 steps, K = 5, one CPU device. {prelude} runs first (the imports and
# logging setup under test), {writer} is the LoggingHook's writer, {hooks} more hooks; with
# {resume}, a second TrainLoop resumes from the checkpoint at 20 and trains to 40.
SCRIPT = """\
{prelude}
import jax.numpy as jnp
import numpy as np
import loopkit

def train_step(state, batch):
  loss = jnp.mean(batch["x"])
  return {{"step": state["step"] + 1, "w": state["w"] + loss}}, {{"loss": loss}}

def eval_step(state, batch):
  return {{"err": batch["x"][:, 0] + state["w"]}}

batches = [{{"x": np.full((8, 2), float(i), np.float32)}} for i in range(40)]

def train(num_steps):
  hooks = [loopkit.LoggingHook({writer}, every_steps=10), {hooks}]
  loop = loopkit.TrainLoop(train_step, iterations_per_loop=5, hooks=hooks)
  loop.run({{"step": jnp.zeros((), jnp.int32), "w": jnp.zeros((), jnp.float32)}}, batches,
           num_steps=num_steps)

def main(argv=()):
  train(20)
  if {resume}:
    train(40)

{main}
"""

CKPT = "loopkit.CheckpointHook(CKPT_DIR, every_steps=10)"
EVAL = "loopkit.EvalHook(loopkit.Evaluator(eval_step), batches[:2], every_steps=20, at_end=False)"
ROW = re.compile(r"step (\d+): loss=")


def loop_script(tmp_path, *, prelude="", writer="None", hooks="", resume=False,
                main="main()") -> subprocess.CompletedProcess:
  code = SCRIPT.format(prelude=prelude, writer=writer, hooks=hooks, resume=resume, main=main)
  path = tmp_path / "script.py"
  path.write_text(code.replace("CKPT_DIR", repr(str(tmp_path / "ckpt"))))
  out = subprocess.run(bootstrap.command(path, devices=1), capture_output=True, text=True,
                       env=bootstrap.env(), cwd=str(tmp_path), timeout=300)
  assert out.returncode == 0, out.stderr
  return out


def row_steps(stderr: str) -> list[int]:
  return [int(m.group(1)) for m in map(ROW.search, stderr.splitlines()) if m]


def has_module(name: str) -> bool:
  try:
    __import__(name)
  except ImportError:
    return False
  return True


needs_orbax = pytest.mark.skipif(not has_module("orbax.checkpoint"), reason="needs orbax")
needs_absl = pytest.mark.skipif(not has_module("absl.logging"), reason="needs absl-py")


CLU_WRITER = ("metric_writers.create_default_writer(just_logging=True)"
              if has_module("clu.metric_writers") else "None")


@needs_orbax
def test_orbax_a_resume_eval_and_clu_print_every_row_once_in_a_plain_script(tmp_path):
  """Orbax's first absl log call installs absl's stand-in root handler (a bare basicConfig);
  CLU's LoggingWriter (where clu is installed) logs through absl at every write, on its writer
  thread. Every row, the eval result and the resume line print once, in loopkit's format."""
  prelude = "import orbax.checkpoint"
  if CLU_WRITER != "None":
    prelude += "\nfrom clu import metric_writers"
  out = loop_script(tmp_path, prelude=prelude, writer=CLU_WRITER, hooks=f"{CKPT}, {EVAL}",
                    resume=True)
  lines = out.stderr.splitlines()
  assert [line for line in lines if line.startswith("step ")] == [
      "step 10: loss=4.5, epoch=0, examples_seen=80",
      "step 20: loss=14.5, epoch=0, examples_seen=160",
      "step 20 eval: err=190.5 (16 examples)",
      "step 30: loss=24.5, epoch=0, examples_seen=240",
      "step 40: loss=34.5, epoch=0, examples_seen=320",
      "step 40 eval: err=780.5 (16 examples)"], out.stderr
  assert row_steps(out.stderr) == [10, 20, 30, 40], out.stderr
  resumed = [line for line in lines if "resumed from checkpoint" in line]
  assert resumed == [f"resumed from checkpoint 20 in {tmp_path / 'ckpt'}"], out.stderr


@needs_absl
def test_absl_before_its_flags_are_parsed_does_not_hide_rows(tmp_path):
  prelude = "from absl import logging as absl_logging\nabsl_logging.info('absl says hello')"
  out = loop_script(tmp_path, prelude=prelude, hooks=EVAL)
  assert [line for line in out.stderr.splitlines() if line.startswith("step ")] == [
      "step 10: loss=4.5, epoch=0, examples_seen=80",
      "step 20: loss=14.5, epoch=0, examples_seen=160",
      "step 20 eval: err=190.5 (16 examples)"], out.stderr


@needs_orbax
def test_basic_config_at_info_after_orbax_shows_each_row_once_in_its_format(tmp_path):
  prelude = ("import orbax.checkpoint\nimport logging\n"
             "logging.basicConfig(level=logging.INFO, force=True)")
  out = loop_script(tmp_path, prelude=prelude, hooks=CKPT, resume=True)
  rows = [line for line in out.stderr.splitlines() if ROW.search(line)]
  assert row_steps(out.stderr) == [10, 20, 30, 40], out.stderr
  assert all(line.startswith("INFO:loopkit:step ") for line in rows), rows
  assert out.stderr.count("resumed from checkpoint 20") == 1, out.stderr


@needs_orbax
def test_absl_app_run_shows_each_row_once_through_absl(tmp_path):
  out = loop_script(tmp_path, prelude="from absl import app\nimport orbax.checkpoint",
                    hooks=CKPT, resume=True, main="app.run(main)")
  rows = [line for line in out.stderr.splitlines() if ROW.search(line)]
  assert row_steps(out.stderr) == [10, 20, 30, 40], out.stderr
  assert all(re.match(r"I\d{4} .*\] step \d+: loss=", line) for line in rows), rows
  assert out.stderr.count("resumed from checkpoint 20") == 1, out.stderr


def fresh_loopkit_logger(monkeypatch) -> logging.Logger:
  """The "loopkit" logger as install_default_handler leaves it, and an empty root at WARNING
  (call it in the test body: pytest adds its capture handlers to the root after the fixtures)."""
  logger, root = logging.getLogger("loopkit"), logging.getLogger()
  monkeypatch.setattr(logger, "handlers", [])
  monkeypatch.setattr(logger, "filters", [])
  monkeypatch.setattr(logger, "level", logging.NOTSET)
  monkeypatch.setattr(logger, "propagate", True)
  monkeypatch.setattr(root, "handlers", [])
  monkeypatch.setattr(root, "level", logging.WARNING)
  monkeypatch.setattr(logs, "_process_index", lambda: 0)
  assert logs.install_default_handler()
  return logger


def bare_basic_config() -> logging.Handler:
  handler = logging.StreamHandler(sys.stderr)  # what logging.basicConfig() adds
  handler.setFormatter(logging.Formatter(logging.BASIC_FORMAT))
  return handler


def test_records_go_to_one_place_in_each_state(monkeypatch, capsys):
  """In process, on the live loggers: each state of the root logger, where a record shows."""
  absl_logging = pytest.importorskip("absl.logging")
  logger, root = fresh_loopkit_logger(monkeypatch), logging.getLogger()
  monkeypatch.setattr(logs, "_absl_flags_parsed", lambda: False)

  def shown() -> str:
    logger.info("step %d: x=1", 3)
    logger.warning("careful")
    return capsys.readouterr().err

  assert shown() == "step 3: x=1\nloopkit WARNING: careful\n"  # nothing configured
  for stand_in in (bare_basic_config(), absl_logging.ABSLHandler(logging.Formatter())):
    monkeypatch.setattr(root, "handlers", [stand_in])  # absl's stand-in: loopkit's handler only
    assert shown() == "step 3: x=1\nloopkit WARNING: careful\n"
  monkeypatch.setattr(root, "handlers", [bare_basic_config()])
  monkeypatch.setattr(logs, "_absl_flags_parsed", lambda: True)  # absl.app.run parsed them
  assert shown() == "WARNING:loopkit:careful\n"  # the application's handler, at its level
  monkeypatch.setattr(logs, "_absl_flags_parsed", lambda: False)
  monkeypatch.setattr(root, "level", logging.INFO)  # the application chose a root level
  assert shown() == "INFO:loopkit:step 3: x=1\nWARNING:loopkit:careful\n"
  monkeypatch.setattr(root, "level", logging.WARNING)
  logger.setLevel(logging.WARNING)  # a level on "loopkit" wins over the stand-in too
  assert shown() == "loopkit WARNING: careful\n"


def test_the_stand_in_probe_tells_absl_apart_from_an_application(monkeypatch):
  """A bare basicConfig handler counts as absl's only while absl is imported with unparsed
  flags and the root is at WARNING; any other handler, format or level is the application's."""
  pytest.importorskip("absl.logging")
  root = logging.getLogger()
  app = logging.StreamHandler(sys.stderr)
  app.setFormatter(logging.Formatter("APP %(message)s"))
  to_file = logging.StreamHandler(io.StringIO())
  to_file.setFormatter(logging.Formatter(logging.BASIC_FORMAT))
  monkeypatch.setattr(root, "level", logging.WARNING)
  monkeypatch.setattr(logs, "_absl_flags_parsed", lambda: False)
  monkeypatch.setattr(root, "handlers", [bare_basic_config()])
  assert logs._absl_stand_in(root)
  for handlers in ([app], [to_file], [bare_basic_config(), app]):
    monkeypatch.setattr(root, "handlers", handlers)
    assert not logs._absl_stand_in(root)
  monkeypatch.setattr(root, "handlers", [bare_basic_config()])
  monkeypatch.setattr(root, "level", logging.INFO)
  assert not logs._absl_stand_in(root)
  monkeypatch.setattr(root, "level", logging.WARNING)
  monkeypatch.setattr(logs, "_absl_flags_parsed", lambda: True)
  assert not logs._absl_stand_in(root)
  monkeypatch.setattr(logs, "_absl_flags_parsed", lambda: False)
  monkeypatch.delitem(sys.modules, "absl.logging")
  assert not logs._absl_stand_in(root)


def test_a_bare_handler_made_before_absl_is_the_applications(monkeypatch):
  """Creation order decides: absl makes its ABSLHandler at import, so a basicConfig handler
  made before it (logging configured at the top of a script) is not absl's stand-in."""
  absl_logging = pytest.importorskip("absl.logging")
  import weakref
  handler = bare_basic_config()
  assert logs._made_after_absl(handler)
  absl_ref = weakref.ref(absl_logging.get_absl_handler())
  monkeypatch.setattr(logging, "_handlerList", [weakref.ref(handler), absl_ref])
  assert not logs._made_after_absl(handler)
  root = logging.getLogger()
  monkeypatch.setattr(root, "handlers", [handler])
  monkeypatch.setattr(root, "level", logging.WARNING)
  monkeypatch.setattr(logs, "_absl_flags_parsed", lambda: False)
  assert not logs._absl_stand_in(root)
  monkeypatch.delattr(logging, "_handlerList")  # another Python: loopkit's own history
  for seen_empty in (False, True):
    monkeypatch.setattr(logs, "_root_seen_empty", seen_empty)
    assert logs._made_after_absl(handler) is seen_empty


# -- rows above a progress bar (C55) ----------------------------------------------------------
# A ProgressHook's bar on a terminal, rows every 50 steps (LoggingHook, EvalHook), a checkpoint
# at each row, a print() at steps 30, 60 and 90. {prelude} is what the script did to logging
# first: Orbax imported (its import installs absl's stand-in root handler), CLU's logging writer
# as the LoggingHook's writer (it logs through absl on its own thread: the stand-in then comes
# while the bar is open), basicConfig at INFO, absl.app.run (ABSLHandler on the root).
BAR_SCRIPT = """\
{prelude}
import jax.numpy as jnp
import numpy as np
import loopkit

def train_step(state, batch):
  loss = jnp.mean(batch["x"])
  return {{"step": state["step"] + 1, "w": state["w"] + loss}}, {{"loss": loss}}

def eval_step(state, batch):
  return {{"err": batch["x"][:, 0] + state["w"]}}

batches = [{{"x": np.full((8, 2), float(i), np.float32)}} for i in range(100)]

def main(argv=()):
  hooks = [loopkit.LoggingHook({writer}, every_steps=50),
           loopkit.EvalHook(loopkit.Evaluator(eval_step), batches[:2], every_steps=50),
           loopkit.CheckpointHook({ckpt!r}, every_steps=50),
           loopkit.CallbackHook(lambda info, state: print(f"print at step {{info.end_step}}"),
                                every_steps=30, at_end=False, needs_state=False),
           loopkit.ProgressHook()]
  loop = loopkit.TrainLoop(train_step, iterations_per_loop=10, hooks=hooks)
  loop.run({{"step": jnp.zeros((), jnp.int32), "w": jnp.zeros((), jnp.float32)}}, batches,
           num_steps=100)

{main}
"""
BAR_ROWS = ["step 50: loss=24.5, epoch=0, examples_seen=400",
            "step 50 eval: err=1225.5 (16 examples)",
            "step 100: loss=74.5, epoch=0, examples_seen=800",
            "step 100 eval: err=4950.5 (16 examples)"]
PRINTS = ["print at step 30", "print at step 60", "print at step 90"]
BAR_PRELUDES = {
    "orbax": ("import orbax.checkpoint", "None", "main()", ""),
    "clu": ("from clu import metric_writers",
            "metric_writers.create_default_writer(just_logging=True)", "main()", ""),
    "basicConfig": ("import logging\nlogging.basicConfig(level=logging.INFO)", "None", "main()",
                    "INFO:loopkit:"),
    "absl.app.run": ("from absl import app", "None", "app.run(main)", r"I\d{4} [^]]*\] "),
}


def bar_script(tmp_path, prelude: str) -> tuple[str, str]:
  """The script for ``prelude`` and the pattern its rows' prefix matches."""
  code, writer, main, prefix = BAR_PRELUDES[prelude]
  if prelude == "clu" and not has_module("clu.metric_writers"):
    pytest.skip("needs clu (and TensorFlow, which its metric_writers import)")
  return BAR_SCRIPT.format(prelude=code, writer=writer, main=main,
                           ckpt=str(tmp_path / "ckpt")), prefix


@needs_orbax
@pytest.mark.parametrize("prelude", list(BAR_PRELUDES))
def test_a_bar_in_a_terminal_shows_every_row_once_above_it(tmp_path, prelude):
  """100 columns: each row, eval line and print is one whole line of the screen, once, in step
  order, above the bar, which ends the screen; none is written onto a frame of the bar."""
  from tests.test_observability import run_in_terminal, screen
  code, prefix = bar_script(tmp_path, prelude)
  raw = run_in_terminal(code, cols=100)
  shown = screen(raw)
  expected = [PRINTS[0], *BAR_ROWS[:2], *PRINTS[1:], *BAR_ROWS[2:]]
  ours = [line for line in shown if any(line.endswith(e) for e in expected)]
  assert len(ours) == len(expected), shown
  for line, e in zip(ours, expected):
    pattern = re.escape(e) if e in PRINTS else prefix + re.escape(e)
    assert re.fullmatch(pattern, line), (line, shown)
    assert raw.count(e) == 1, raw  # printed once (not also by absl's stand-in)
  assert re.fullmatch(r"step 100/100 \|\u2588{20}\| 100%, .*, loss=94\.5", shown[-1]), shown
  assert not [line for line in shown[:-1] if "|" in line and "step " in line], shown


@needs_orbax
@pytest.mark.parametrize("where", ["pipe", "0-column pty"])
def test_without_a_bar_orbax_rows_print_once_as_plain_lines(tmp_path, where):
  code, _ = bar_script(tmp_path, "orbax")
  if where == "pipe":
    out = subprocess.run(bootstrap.command("-c", code, devices=1), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=bootstrap.env(), timeout=300)
    assert out.returncode == 0, out.stdout
    text = out.stdout
  else:
    from tests.test_observability import run_in_terminal
    text = run_in_terminal(code, cols=0).replace("\r\n", "\n")
  assert "\r" not in text and "\u2588" not in text, text
  lines = text.splitlines()
  for e in BAR_ROWS + PRINTS:
    assert lines.count(e) == 1 and text.count(e) == 1, (e, text)
  assert [line for line in lines if line in BAR_ROWS + PRINTS] == [
      PRINTS[0], *BAR_ROWS[:2], *PRINTS[1:], *BAR_ROWS[2:]], text
  assert len([line for line in lines if line.startswith("step 100/100 (100.0%): ")]) == 1, text


def test_lines_above_the_bar_wait_for_their_end_and_every_stream_is_put_back(monkeypatch):
  """In process: a line is written whole, with the bar cleared before and redrawn after; a
  partial line waits; a handler made while the bar is open (absl's stand-in at Orbax's first
  save) writes through the stand-in too; on exit sys.stderr and every handler's stream are the
  console again, and the pending partial line is written."""
  tqdm = pytest.importorskip("tqdm").tqdm
  console, bar_file = io.StringIO(), io.StringIO()
  monkeypatch.setattr(sys, "stderr", console)
  logger = logging.getLogger("test_logs_bar")
  monkeypatch.setattr(logger, "handlers", [logging.StreamHandler(console)])
  monkeypatch.setattr(logger, "propagate", False)
  bar = tqdm(total=10, file=bar_file, bar_format="BAR {n}", mininterval=0)
  frames = bar_file.getvalue().count("BAR 0")
  with logs.console_lines_above_bar(tqdm, bar_file):
    assert sys.stderr is not console and logger.handlers[0].stream is sys.stderr
    logger.addHandler(logging.StreamHandler())  # takes sys.stderr now: the stand-in
    sys.stderr.write("part")
    assert console.getvalue() == "" and bar_file.getvalue().count("BAR 0") == frames
    print("ial", file=sys.stderr)
    assert console.getvalue() == "partial\n"
    assert bar_file.getvalue().count("BAR 0") == frames + 1  # cleared, then redrawn
    logger.warning("row")
    assert console.getvalue() == "partial\nrow\nrow\n"  # once per handler
    sys.stderr.write("tail")
  bar.close()
  assert sys.stderr is console and [h.stream for h in logger.handlers] == [console, console]
  assert console.getvalue() == "partial\nrow\nrow\ntail"


# C70: a user's first run (a plain script, Orbax imported first), whose input takes a while to
# start (a pipeline's workers: 0.5 s of sleep before the first batch, train and eval). The
# "loopkit" handler's filter notes, at each printed line, where the run stands: the ledger's
# data-wait and compile seconds, the train and eval compile counts, the eval batches drawn and
# the checkpoints saved. It prints them as JSON lines on stdout at the end.
FIRST_RUN_SCRIPT = """\
import orbax.checkpoint
import json, logging, time
import jax.numpy as jnp
import numpy as np
import loopkit

def train_step(state, batch):
  loss = jnp.mean(batch["x"])
  return {"step": state["step"] + 1, "w": state["w"] + loss}, {"loss": loss}

def eval_step(state, batch):
  return {"err": batch["x"][:, 0] + state["w"]}

batches = [{"x": np.full((8, 2), float(i), np.float32)} for i in range(20)]
eval_drawn = []

def slow_start(items, drawn=None):
  time.sleep(0.5)
  for item in items:
    if drawn is not None:
      drawn.append(1)
    yield item

evaluator = loopkit.Evaluator(eval_step, global_batch_size=8)
ckpt = loopkit.CheckpointHook(CKPT_DIR, every_steps=10)
hooks = [loopkit.LoggingHook(None, every_steps=10), ckpt,
         loopkit.EvalHook(evaluator, lambda: slow_start(batches[:2], eval_drawn), every_steps=20,
                          at_end=False),
         loopkit.ProgressHook(logger=logging.getLogger("loopkit"), log_every_secs=3600)]
loop = loopkit.TrainLoop(train_step, iterations_per_loop=5, hooks=hooks)
said = []

def snapshot(record):
  seconds = loop.ledger.seconds if loop.ledger is not None else {}
  said.append([record.getMessage(), seconds.get("data_wait", 0.0), seconds.get("compile", 0.0),
               loop.program.compile_count(), evaluator.compile_count(), len(eval_drawn),
               list(ckpt.saved_steps)])
  return True

(handler,) = logging.getLogger("loopkit").handlers  # loopkit's own (no logging configured)
handler.addFilter(snapshot)
loop.run({"step": jnp.zeros((), jnp.int32), "w": jnp.zeros((), jnp.float32)},
         slow_start(batches), num_steps=20)
for s in said:
  print(json.dumps(s))
"""


@needs_orbax
def test_a_first_run_says_what_it_waits_for_first(tmp_path):
  """C70: a first run prints loopkit's lines only, and each wait (the first batches and the
  first compile, each checkpoint save, the first evaluation's batches and compile) is said by
  one line before it starts, and the next line comes after it: at the first call's line the
  ledger holds no data-wait or compile seconds and nothing is compiled, at the next both are
  counted; at the eval line no eval batch is drawn and nothing compiled; at each save's line
  that step is not saved yet."""
  ckpt = tmp_path / "ckpt"
  code = FIRST_RUN_SCRIPT.replace("CKPT_DIR", repr(str(ckpt)))
  out = subprocess.run(bootstrap.command("-c", code, devices=1), capture_output=True, text=True,
                       env=bootstrap.env(), timeout=300)
  assert out.returncode == 0, out.stderr
  said = [json.loads(line) for line in out.stdout.splitlines()]
  assert out.stderr.splitlines() == [s[0] for s in said]  # nothing but loopkit's lines
  first_call = "step 0/20: waiting for the first batches, then compiling the first device call"
  eval_line = ("evaluation: waiting for the first batches, then compiling the eval program "
               "(batch 8, 1 per device call)")
  lines = [s[0] for s in said]
  assert lines[:4] + lines[5:] == [
      f"checkpoints in {ckpt}", first_call,
      "step 10: loss=4.5, epoch=0, examples_seen=80", f"saving checkpoint 10 in {ckpt}",
      "step 20: loss=14.5, epoch=0, examples_seen=160", f"saving checkpoint 20 in {ckpt}",
      eval_line, "step 20 eval: err=190.5 (16 examples)"], out.stderr
  # ProgressHook needs no state: it runs one call late, before the last call's row.
  assert re.fullmatch(r"step 20/20 \(100\.0%\): [\d.]+ steps/s, [\d.]+ examples/s, ETA 0:00:00",
                      lines[4]), lines[4]
  at = {s[0]: s[1:] for s in said}
  # (data_wait s, compile s, train compiles, eval compiles, eval batches drawn, saved steps)
  assert at[first_call] == [0.0, 0.0, 0, 0, 0, []]
  data_wait, compile_secs, train_compiles = at[lines[2]][:3]
  assert data_wait > 0.0 and compile_secs > 0.0 and train_compiles == 1, at[lines[2]]
  assert at[f"saving checkpoint 10 in {ckpt}"][5] == []
  assert at[f"saving checkpoint 20 in {ckpt}"][5] == [10]
  assert at[eval_line][3:5] == [0, 0]
  assert at["step 20 eval: err=190.5 (16 examples)"][3:5] == [1, 2]


@pytest.mark.parametrize("entry", ["loopkit.tools.tune", "loopkit.tools.aot"])
def test_every_entry_point_prints_without_a_train_loop(entry):
  """C74: the handler is loopkit's from its import, not from a TrainLoop: a script (or a
  ``python -m`` command) that imports only the tuner or the AOT tool prints loopkit's INFO
  lines and prefixed warnings, once each, after Orbax's import too (absl's stand-in). The
  follower's command: test_follow.py::test_follow_command_prints_its_rows_and_lines_as_a_
  training_run_does."""
  code = (f"import orbax.checkpoint, logging, {entry}\n"
          "from loopkit.observe.writers import ConsoleWriter\n"
          "ConsoleWriter().write_scalars(3, {'eval/mse': 0.5})\n"
          "logging.getLogger('loopkit').warning('careful')\n")
  out = subprocess.run(bootstrap.command("-c", code, devices=1), capture_output=True, text=True,
                       env=bootstrap.env(), timeout=300)
  assert out.returncode == 0, out.stderr
  lines = [line for line in out.stderr.splitlines()
           if "eval/mse" in line or "careful" in line]
  assert lines == ["step 3: eval/mse=0.5", "loopkit WARNING: careful"], out.stderr
