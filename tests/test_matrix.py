"""What a user combines, met in pairs: real scripts in subprocesses over a covering array.

Each cell runs tests/_matrix_worker.py (one user's script: 14 steps, rows every 4 steps,
evaluation every 7 on 21 examples, checkpoints every 6, a callback every 5) with one level of
every factor:

========== ==========================================================================
factor     levels
========== ==========================================================================
logging    none; ``import orbax.checkpoint``; CLU's writer (``LoggingWriter`` in CLU's
           ``AsyncMultiWriter``, beside loopkit's ``JsonlWriter``); ``absl.app.run``;
           ``logging.basicConfig(level=logging.INFO)``
output     a pty of 100 columns; a pty of 0 columns; a pipe; a file (stdout and stderr
           together, as a terminal, ``| tee`` or ``> log 2>&1`` has them)
ending     completes; a hook raises at step 11; SIGINT at step 9 then a resume; SIGKILL
           right after the checkpoint of step 12 then a resume
eval       none; ``EvalHook(loopkit.Evaluator(...))``; ``EvalHook(loopkit.nnx.NnxEvaluator(...))``
loop       ``TrainLoop`` (a pytree state); ``loopkit.nnx.NnxTrainLoop`` (a CNN with BatchNorm,
           Dropout and ``nnx.Rngs``)
k          iterations_per_loop 1; 3 (which divides none of the event steps' gaps)
tracker    none; an ``MlflowWriter`` (a file store in the cell's directory) beside the JSONL
           writer
tiers      one (every checkpoint kept); two (``keep_every_steps=4``: 4, 8, 12 kept for good,
           of the others only the newest)
checkpoint, progress, goodput, profiler, nancheck, callback: each hook off; on
rewind     off; the loss spikes at data step 8 (inputs x 100 for the regression; NaN for
           the CNN, whose BatchNorm normalizes any scale away) and a ``LossSpikeHook``
           (``margin=1``) rewinds to checkpoint 6 and skips data steps 7..9
watchdog   off; a ``Watchdog`` with generous deadlines (it must not fire, whatever the ending)
warm       a fresh init; ``CheckpointHook(init_from=WarmStart(...))`` of the reference's own
           last checkpoint (``params``; the CNN's ``model``)
sidecar    none; a ``CheckpointFollower`` process beside the cell's processes, evaluating
           each new checkpoint once
========== ==========================================================================

(``LoggingHook`` with ``create_default_writer(workdir)``, or CLU's writer, is in every cell.)
Some combinations cannot be run and are not required: without a checkpoint hook, a resume
ending, a rewind, a warm start, a sidecar or a second tier; an ``NnxEvaluator`` in a
``TrainLoop``; and the CNN's NaN spike with a ``NanCheckHook`` (which raises at a NaN before the
rewind is asked for: a triple, so no pair is lost). :func:`covering_array` (a deterministic
greedy algorithm: each new cell starts from an uncovered pair of the first factor pair with one
and takes, factor by factor, the level that covers most uncovered pairs) gives **23 cells**
that cover all **900 allowed pairs of levels of every two of the 18 factors**
(``test_the_cells_cover_every_pair_of_levels`` checks it independently of the generator); 20
is the least any pairwise array can have (logging x output alone has 20 pairs). The full
product would be 3,932,160 cells.

Every cell asserts what a straight run gives (reference processes train each loop kind at
each K straight through: ``test_the_reference_is_the_same_for_every_k``; and at K = 1 from the
warm start, given the rewind's skip range ``skip_steps=[(7, 9)]``, and both, for the cells
with a warm start or a rewind):

* on the console, across the cell's processes: each metric row (``step N: name=...``) and
  each evaluation (``step N eval: ...``, or a ``ConsoleWriter``'s ``step N: eval/...`` row of
  it) exactly once, at the straight run's steps up to where the cell's run got (after a
  rewind, the evaluation at 7 twice: once before the spike); the resume line once; a goodput
  summary once per run that returned; the progress at the run's last step; no traceback but
  the raising hook's;
* on disk: ``metrics.jsonl`` holds exactly the straight run's rows and evaluation rows, in order,
  values exact (time-measured keys, ``throughput/*`` and ``goodput/*``, left out); the complete
  checkpoints are the straight run's steps (plus the preemption's own at step 9 after a SIGINT;
  with two tiers, the permanent ones and the newest); the callback fired once per its steps
  with the state of that step; a profile was written; the watchdog wrote no record;
* the tracker's store, read back, holds exactly the points of ``metrics.jsonl`` (time-measured
  keys included), each (step, key) once, across a kill and a resume; after a rewind the
  evaluation at 7 keeps its first point, the thrown-away run's (a tracker cannot take a point
  back: docs/observability.md, "Every writer across a kill");
* the sidecar's rows: each checkpoint step once, in order (with two tiers, at least the kept
  ones: a temporary one may be deleted before it is read), equal bitwise to the straight run's
  in-run evaluation at that step;
* a rewind: one, in the first process, from the spike at 8 to checkpoint 6, the range kept
  by every process;
* the processes' exit codes and statuses, and a final state bitwise equal to the straight run's
  (or the warm, the skip or the warm skip run's).

Every factor here is process-wide (the logging set-up, the output, a kill), so each cell is its
own process (two with a resume, and a third beside them with a sidecar), and two reference
processes; they run two cells at a time and share a persistent JAX compilation cache, and none
imports TensorFlow. Cost: 162 s of CPU in all (152 s user, 10 s system; the 12-factor matrix
of 20 cells: 112 s, 1.45x, both measured on the same machine and load, 2026-12-05, Python 3.12
with MLflow): about a minute and a half on two idle cores. Without MLflow (the floor
environment) its 7 cells skip.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import fcntl
import glob
import importlib.util
import itertools
import json
import os
import pty
import re
import select
import struct
import subprocess
import termios
import time
from collections.abc import Callable
from unittest import mock

import pytest

from tests import bootstrap, toy

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_matrix_worker.py")

FACTORS: dict[str, list] = {
    "logging": ["none", "orbax", "clu", "absl", "basic"],
    "output": ["pty100", "pty0", "pipe", "file"],
    "ending": ["complete", "raise", "sigint", "sigkill"],
    "eval": ["none", "evaluator", "nnx"],
    "loop": ["train", "nnx"],
    "k": [1, 3],
    "checkpoint": [False, True],
    "progress": [False, True],
    "goodput": [False, True],
    "profiler": [False, True],
    "nancheck": [False, True],
    "callback": [False, True],
    "rewind": [False, True],
    "watchdog": [False, True],
    "tracker": ["none", "mlflow"],
    "tiers": [1, 2],
    "warm": [False, True],
    "sidecar": [False, True],
}
HOOKS = ("checkpoint", "progress", "goodput", "profiler", "nancheck", "callback", "rewind",
         "watchdog", "warm", "sidecar")
NEEDS_CHECKPOINT = ("rewind", "warm", "sidecar")
# The script's schedule: the straight run has rows at 4, 8, 12, 14, evaluations at 7, 14,
# checkpoints at 6, 12, 14, callbacks at 5, 10, and traces steps 3..4.
# A rewind: the loss spikes at data step 8, the run goes back to checkpoint 6 and skips data
# steps 7..9 (margin 1); two tiers keep every 4th step for good.
SCHEDULE = {"steps": 14, "log_every": 4, "eval_every": 7, "ckpt_every": 6, "callback_every": 5,
            "profile_from": 2, "profile_steps": 2, "raise_at": 11, "sigint_at": 9,
            "sigkill_at": 12, "spike_at": 8, "spike_margin": 1, "keep_every": 4,
            "save_steps": [4, 6, 8, 9, 12, 14]}
RESUMES = ("sigint", "sigkill")
PROCESS_TIMEOUT_S = 300


def allowed(levels: dict) -> bool:
  """Whether a (partial) cell can run: a resume, a rewind, a warm start, a sidecar and a second
  tier need a checkpoint; an NnxEvaluator, NNX; the CNN's (NaN) spike is not a NanCheckHook's."""
  if levels.get("checkpoint") is False and (
      levels.get("ending") in RESUMES or levels.get("tiers") == 2
      or any(levels.get(f) for f in NEEDS_CHECKPOINT)):
    return False
  if levels.get("loop") == "nnx" and levels.get("rewind") and levels.get("nancheck"):
    return False
  return not (levels.get("eval") == "nnx" and levels.get("loop") == "train")


def pairs(factors: dict[str, list], cell: dict) -> set[tuple]:
  """The pairs of levels ``(a, level_a, b, level_b)`` a cell covers (a before b in factors)."""
  return {(a, cell[a], b, cell[b]) for a, b in itertools.combinations(factors, 2)}


def required_pairs(factors: dict[str, list], ok: Callable[[dict], bool]) -> set[tuple]:
  return {(a, x, b, y) for a, b in itertools.combinations(factors, 2)
          for x in factors[a] for y in factors[b] if ok({a: x, b: y})}


def covering_array(factors: dict[str, list], ok: Callable[[dict], bool]) -> list[dict]:
  """A pairwise covering array of ``factors`` whose cells satisfy ``ok``, greedily.

  Deterministic: while a pair is uncovered, each uncovered pair of the first factor pair that
  has one seeds a candidate cell, whose other factors take, in order, the allowed level
  covering most uncovered pairs with the levels chosen so far (the first such level on a tie);
  the candidate covering most uncovered pairs (the first on a tie) becomes the next cell.
  ``ok`` must let every allowed partial cell be completed.
  """
  names = list(factors)
  uncovered = required_pairs(factors, ok)
  cells = []
  while uncovered:
    seeds = next(sorted((p for p in uncovered if p[0] == a and p[2] == b), key=repr)
                 for a, b in itertools.combinations(names, 2)
                 if any(p[0] == a and p[2] == b for p in uncovered))
    best, best_gain = None, -1
    for a, x, b, y in seeds:
      cell = {a: x, b: y}
      for f in names:
        if f in cell:
          continue
        def gain(v, f=f, cell=cell):
          return sum(((g, cell[g], f, v) if names.index(g) < names.index(f) else
                      (f, v, g, cell[g])) in uncovered for g in cell)
        cell[f] = max((v for v in factors[f] if ok({**cell, f: v})), key=gain)
      cell = {f: cell[f] for f in names}
      g = len(pairs(factors, cell) & uncovered)
      if g > best_gain:
        best, best_gain = cell, g
    cells.append(best)
    uncovered -= pairs(factors, best)
  return cells


CELLS = covering_array(FACTORS, allowed)


def cell_id(i: int, cell: dict) -> str:
  hooks = "+".join(h for h in HOOKS if cell[h]) or "nohooks"
  return (f"{i:02d}-{cell['loop']}-k{cell['k']}-{cell['ending']}-{cell['output']}-"
          f"{cell['logging']}-eval_{cell['eval']}-{hooks}-tiers{cell['tiers']}-"
          f"{cell['tracker']}")


# -- running a script on a pty, a pipe or a file -----------------------------------------------

@dataclasses.dataclass
class Run:
  """One process of a cell: its exit code, what it printed, its result file (if it returned)."""

  rc: int | None
  console: str
  result: dict | None
  wall_s: float


def run_on(output: str, argv: list[str], env: dict, log_path: str) -> tuple[int | None, str]:
  """Runs ``argv`` with stdout and stderr on ``output``; its exit code (None: killed after
  ``PROCESS_TIMEOUT_S``) and output."""
  if output in ("pipe", "file"):
    with open(log_path, "wb") as f:
      try:
        done = subprocess.run(argv, stdout=subprocess.PIPE if output == "pipe" else f,
                              stderr=subprocess.STDOUT, env=env, timeout=PROCESS_TIMEOUT_S,
                              check=False)
        text, rc = done.stdout, done.returncode
      except subprocess.TimeoutExpired as e:  # the child was killed
        text, rc = e.stdout, None
      if output == "pipe":
        f.write(text or b"")  # kept beside the cell's files, as the file output is
    if output == "file":
      with open(log_path, "rb") as f:
        text = f.read()
    return rc, (text or b"").decode(errors="replace")
  master, slave = pty.openpty()
  columns = int(output[len("pty"):])
  fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
  proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env)
  os.close(slave)
  chunks, deadline = [], time.monotonic() + PROCESS_TIMEOUT_S
  try:
    while time.monotonic() < deadline:
      if not select.select([master], [], [], 1.0)[0]:
        continue
      try:
        chunk = os.read(master, 65536)
      except OSError:  # EIO: every writer of the pty is gone
        break
      if not chunk:
        break
      chunks.append(chunk)
    else:
      proc.kill()
  finally:
    os.close(master)
  rc = proc.wait(timeout=60)
  with open(log_path, "wb") as f:  # kept beside the cell's files
    f.write(b"".join(chunks))
  return (None if time.monotonic() >= deadline else rc,
          b"".join(chunks).decode(errors="replace").replace("\r\n", "\n"))


def run_cell(cell: dict, workdir: str, env: dict, ref_dir: str) -> list[Run]:
  """The cell's first process and, after a SIGINT or SIGKILL, its resume; a sidecar beside
  them (told to finish once they have ended). A warm start waits for its source."""
  os.makedirs(workdir, exist_ok=True)
  base = {**cell, "workdir": workdir, "schedule": SCHEDULE}
  if cell["warm"]:
    base["warm_from"] = os.path.join(ref_dir, f"{cell['loop']}-1")
    deadline = time.monotonic() + PROCESS_TIMEOUT_S
    while not os.path.exists(os.path.join(ref_dir, "warm-ready")):
      assert time.monotonic() < deadline, "the reference wrote no warm-start source"
      time.sleep(0.5)
  sidecar = None
  if cell["sidecar"]:
    sidecar = subprocess.Popen(
        bootstrap.command(WORKER, json.dumps({**base, "mode": "sidecar"}), devices=1), env=env,
        stdout=open(os.path.join(workdir, "console-sidecar.txt"), "wb"),
        stderr=subprocess.STDOUT)
  runs = []
  try:
    for phase in ("first", "resume") if cell["ending"] in RESUMES else ("first",):
      spec = {**base, "phase": phase}
      t0 = time.monotonic()
      rc, console = run_on(cell["output"], bootstrap.command(WORKER, json.dumps(spec),
                                                             devices=1),
                           env, os.path.join(workdir, f"console-{phase}.txt"))
      path = os.path.join(workdir, f"result-{phase}.json")
      result = None
      if os.path.exists(path):
        with open(path) as f:
          result = json.load(f)
      runs.append(Run(rc, console, result, time.monotonic() - t0))
  finally:
    if sidecar is not None:
      open(os.path.join(workdir, "sidecar-stop"), "a").close()
      try:
        sidecar.wait(timeout=PROCESS_TIMEOUT_S)
      except subprocess.TimeoutExpired:
        sidecar.kill()
        sidecar.wait()
  return runs


def missing_modules(cell: dict) -> list[str]:
  need = {"clu": ["clu", "absl"], "absl": ["absl"]}.get(cell["logging"], [])
  need += ["mlflow"] if cell["tracker"] == "mlflow" else []
  return [m for m in need if importlib.util.find_spec(m) is None]


@pytest.fixture(scope="module")
def matrix(request, tmp_path_factory):
  """The reference and every selected cell, run two processes at a time: ``(reference,
  {cell index: [Run, ...]})``."""
  selected = sorted({item.callspec.params["index"] for item in request.session.items
                     if getattr(item, "module", None) is request.module  # doctests have none
                     and hasattr(item, "callspec") and "index" in item.callspec.params})
  selected = [i for i in selected if not missing_modules(CELLS[i])]
  root = tmp_path_factory.mktemp("matrix")
  env = bootstrap.env(COLUMNS="", LINES="", MLFLOW_ALLOW_FILE_STORE="true",
                      **toy.compilation_cache_env(root / "jax-cache"))
  ref_dir = str(root / "reference")
  os.makedirs(ref_dir)
  # Two reference processes: the straight runs (the warm start's source first), and the
  # variants (a rewind's skip range, the warm start) at K = 1, the same for every K.
  variants = [[loop, 1, v] for v in ("skip", "warm", "warm+skip") for loop in FACTORS["loop"]]
  straight = [[loop, k, ""] for k in FACTORS["k"] for loop in FACTORS["loop"]]

  def reference(refs, name):
    spec = {"mode": "reference", "workdir": ref_dir, "schedule": SCHEDULE, "refs": refs,
            "name": name}
    out = subprocess.run(bootstrap.command(WORKER, json.dumps(spec), devices=1), env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         timeout=PROCESS_TIMEOUT_S)
    assert out.returncode == 0, out.stdout.decode(errors="replace")
    with open(os.path.join(ref_dir, f"{name}.json")) as f:
      return json.load(f)

  # The longest first (NNX, a resume), so that the two workers end together; a warm start
  # after the others (it waits for the reference's first runs).
  order = sorted(selected, key=lambda i: (CELLS[i]["warm"], CELLS[i]["loop"] != "nnx",
                                          CELLS[i]["ending"] not in RESUMES, i))
  with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
    refs = [pool.submit(reference, straight, "reference"),
            pool.submit(reference, variants, "variants")]
    runs = {i: pool.submit(run_cell, CELLS[i], str(root / cell_id(i, CELLS[i])), env, ref_dir)
            for i in order}
    return ({**refs[0].result(), **refs[1].result()}, {i: f.result() for i, f in runs.items()},
            root)


# -- reading what a cell left -------------------------------------------------------------------

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# "step N: name=..." (LoggingHook's row; a ConsoleWriter's row, whose names after the first line
# may form an aligned table below a bare "step N:"), or "step N eval: ..." (EvalHook's line);
# not a log line that names a step in words ("warm start from ... step 14: 8 leaves read").
RECORD = re.compile(r"\bstep (\d+)(:| eval:)(?: ([^\s=]+)=|$)")
GOODPUT = re.compile(r"\bgoodput [0-9.]+% at step (\d+)")
TIMED = ("throughput/", "goodput/")


def segments(console: str) -> list[str]:
  """The console's lines, also split at carriage returns (progress-bar frames), ANSI codes out."""
  return [ANSI.sub("", s) for s in re.split(r"[\r\n]", console)]


def printed(consoles: list[str]) -> dict[str, list[int]]:
  """The steps of the metric rows, evaluations and goodput rows printed, sorted.

  An evaluation is EvalHook's line or a ConsoleWriter's row of ``eval/*`` names; a goodput row
  a ConsoleWriter's row of ``goodput/*`` names; any other ``step N: name=...`` is a metric row.
  """
  out: dict[str, list[int]] = {"row": [], "eval": [], "goodput": []}
  for console in consoles:
    lines = segments(console)
    for i, line in enumerate(lines):
      for m in RECORD.finditer(line):
        if m.group(2) == " eval:":
          kind = "eval"
        else:
          first = m.group(3) or (lines[i + 1].strip() if i + 1 < len(lines) else "")
          kind = next((k for k in ("eval", "goodput") if first.startswith(k + "/")), "row")
        out[kind].append(int(m.group(1)))
  return {k: sorted(v) for k, v in out.items()}


def found(pattern: re.Pattern, consoles: list[str]) -> list[int]:
  return sorted(int(m) for c in consoles for s in segments(c) for m in pattern.findall(s))


def disk_rows(workdir: str) -> list[dict]:
  """``metrics.jsonl``'s rows without their time-measured keys (rows left empty dropped)."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  rows = []
  with open(path) as f:
    for line in f:
      row = {k: v for k, v in json.loads(line).items() if not k.startswith(TIMED)}
      if set(row) != {"step"}:
        rows.append(row)
  return rows


def checkpoint_steps(workdir: str) -> list[int]:
  """Steps of the complete checkpoints: step directories holding Orbax's commit file."""
  return sorted(int(os.path.basename(d)) for d in glob.glob(os.path.join(workdir, "ckpt", "*"))
                if os.path.basename(d).isdigit()
                and os.path.exists(os.path.join(d, "commit_success.txt")))


def ref_key(cell: dict) -> str:
  """The straight run a cell is held to: its loop at its K; a warm start's or a rewind's
  (given the skip range) at K = 1 (the same for every K)."""
  variant = "+".join(v for v, on in (("warm", cell["warm"]), ("skip", cell["rewind"])) if on)
  return f"{cell['loop']}/{cell['k']}" if not variant else f"{cell['loop']}/1/{variant}"


def eval_rows(evals: list, reached: int) -> list[tuple[int, int, dict]]:
  return [(step, 1, {"step": step, **{f"eval/{k}": v for k, v in metrics.items()},
                     "eval/num_examples": n}) for step, metrics, n in evals if step <= reached]


def expected(cell: dict, ref: dict, straight: dict) -> dict:
  """What the straight run (``ref``) gives for the steps this cell's run got to; after a
  rewind, ``straight`` is the run without it (what was evaluated before the spike)."""
  s = SCHEDULE
  reached = s["raise_at"] if cell["ending"] == "raise" else s["steps"]
  rows = [(step, 0, {"step": step, **scalars}) for step, scalars in ref["rows"]
          if step <= reached]
  evals, thrown = [], []
  if cell["eval"] != "none":
    evals = eval_rows(ref["evals"][cell["eval"]], reached)
    if cell["rewind"]:  # evaluated between checkpoint 6 and the spike, then thrown away
      thrown = [r for r in eval_rows(straight["evals"][cell["eval"]], reached)
                if s["ckpt_every"] < r[0] < s["spike_at"]]
  jsonl = [r for _, _, r in sorted(rows + evals, key=lambda t: t[:2])]
  if cell["logging"] == "clu" and thrown:
    # CLU's AsyncMultiWriter passes no keep_through to the JsonlWriter in it: the thrown-away
    # rows stay, before the rewind's (docs/observability.md, "Every writer across a kill").
    at = next(i for i, r in enumerate(jsonl) if r["step"] == thrown[0][0])
    jsonl[at:at] = [r for _, _, r in thrown]
  saved = []  # the steps saved, by the cell's processes together
  if cell["checkpoint"]:
    saved = [c for c in ref["checkpoints"] if c <= reached]
    if cell["ending"] == "sigint":  # a preemption saves where it stopped
      saved = sorted({*saved, s["sigint_at"]})
  checkpoints = saved
  if cell["tiers"] == 2:  # every keep_every-th step for good; of the others, the newest
    saved = sorted({*saved, *range(s["keep_every"], reached + 1, s["keep_every"])})
    checkpoints = [c for c in saved if c % s["keep_every"] == 0 or c == saved[-1]]
  returned = {"complete": [s["steps"]], "raise": [], "sigint": [s["sigint_at"], s["steps"]],
              "sigkill": [s["steps"]]}[cell["ending"]]
  printed_evals = sorted([step for step, _, _ in evals + thrown])
  at_saves = {step: {"step": step, **{f"eval/{k}": v for k, v in metrics.items()},
                     "eval/num_examples": n} for step, metrics, n in ref["at_saves"]}
  return {"row_steps": [step for step, _, _ in rows],
          "eval_steps": printed_evals,
          "jsonl": jsonl, "thrown": [r for _, _, r in thrown],
          "checkpoints": checkpoints, "saved": saved,
          "sidecar": {c: at_saves[c] for c in saved},
          "callback": [c for c in ref["callback"] if c[0] <= reached],
          "returned": returned}


def tracker_points(workdir: str) -> list[tuple[int, str, float]]:
  """Every point of the cell's MLflow run (file store ``workdir/mlruns``), read back."""
  from mlflow.tracking import MlflowClient
  with open(os.path.join(workdir, "mlflow-run-id")) as f:
    run_id = f.read().strip()
  with mock.patch.dict(os.environ, MLFLOW_ALLOW_FILE_STORE="true"):  # MLflow 3: opt-in
    client = MlflowClient("file://" + os.path.join(workdir, "mlruns"))
    return sorted((m.step, key, m.value) for key in client.get_run(run_id).data.metrics
                  for m in client.get_metric_history(run_id, key))


def jsonl_points(workdir: str) -> list[tuple[int, str, float]]:
  """``metrics.jsonl``'s every (step, MLflow name, value), time-measured keys included."""
  from loopkit.observe.tracker_writers import mlflow_name
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return sorted((r["step"], mlflow_name(k), float(v)) for r in rows for k, v in r.items()
                if k != "step" and isinstance(v, (int, float)))


# -- the tests ----------------------------------------------------------------------------------

def test_the_cells_cover_every_pair_of_levels():
  """Checked here pair by pair, apart from the generator; the docstring's numbers hold."""
  required = required_pairs(FACTORS, allowed)
  covered = set().union(*(pairs(FACTORS, c) for c in CELLS))
  assert required - covered == set()
  assert all(allowed(c) and set(c) == set(FACTORS) for c in CELLS)
  assert all(c[f] in FACTORS[f] for c in CELLS for f in FACTORS)
  assert (len(CELLS), len(required), len(FACTORS)) == (23, 900, 18)
  assert f"**{len(CELLS)} cells**" in __doc__ and f"**{len(required)} allowed pairs" in __doc__
  assert len({json.dumps(c, sort_keys=True) for c in CELLS}) == len(CELLS)  # no cell twice
  # The generator is deterministic, and the constraint drops exactly the impossible pairs.
  assert covering_array(FACTORS, allowed) == CELLS
  total = sum(len(FACTORS[a]) * len(FACTORS[b]) for a, b in itertools.combinations(FACTORS, 2))
  # (sigint, no checkpoint), (sigkill, ...), (no checkpoint, rewind / sidecar / 2 tiers /
  # warm), (nnx eval, train); the NaN spike with a NanCheckHook is a triple: no pair goes.
  assert total - len(required) == 7
  assert not allowed({"loop": "nnx", "rewind": True, "nancheck": True})
  assert allowed({"loop": "train", "rewind": True, "nancheck": True, "checkpoint": True})


def test_the_reference_is_the_same_for_every_k(matrix):
  """The straight runs: K = 1 and K = 3 give the same rows, evaluations, checkpoints and final
  state (bitwise); both evaluators evaluate 21 examples at 7 and 14; the warm, skip and warm
  skip runs differ from it and from each other."""
  ref = matrix[0]
  for loop in FACTORS["loop"]:
    one, three = ref[f"{loop}/1"], ref[f"{loop}/3"]
    assert one == three
    assert one["status"] == "completed"
    assert [step for step, _ in one["rows"]] == [4, 8, 12, 14]
    assert one["checkpoints"] == [6, 12, 14] and one["callback"] == [[5, 5], [10, 10]]
    kinds = ["evaluator", "nnx"] if loop == "nnx" else ["evaluator"]
    assert sorted(one["evals"]) == kinds
    for kind in kinds:
      assert [(step, n) for step, _, n in one["evals"][kind]] == [(7, 21), (14, 21)]
    assert [step for step, _, _ in one["at_saves"]] == SCHEDULE["save_steps"]
    # The variants at K = 1: each ends elsewhere (the warm start and the skip range count),
    # with the same rows, evaluations and checkpoints; the skip run's first 6 steps are the
    # straight run's (the range starts after them).
    digests = {v: ref[f"{loop}/1/{v}"]["digest"] for v in ("warm", "skip", "warm+skip")}
    assert len({one["digest"], *digests.values()}) == 4
    for v in digests:
      var = ref[f"{loop}/1/{v}"]
      assert var["status"] == "completed" and var["checkpoints"] == one["checkpoints"]
      assert [step for step, _ in var["rows"]] == [4, 8, 12, 14]
    skip, warm_skip = ref[f"{loop}/1/skip"], ref[f"{loop}/1/warm+skip"]
    assert skip["rows"][0] == one["rows"][0] and skip["rows"][1] != one["rows"][1]
    assert warm_skip["rows"][0] == ref[f"{loop}/1/warm"]["rows"][0]


@pytest.mark.parametrize("index", range(len(CELLS)), ids=[cell_id(i, c) for i, c in
                                                          enumerate(CELLS)])
def test_cell(matrix, index):
  cell = CELLS[index]
  if missing_modules(cell):
    pytest.skip(f"needs {', '.join(missing_modules(cell))}")
  ref, outcomes, root = matrix
  runs = outcomes[index]
  workdir = str(root / cell_id(index, cell))
  want = expected(cell, ref[ref_key(cell)], ref[ref_key({**cell, "rewind": False})])
  consoles = [r.console for r in runs]
  problems = []

  def check(ok: bool, what: str) -> None:
    if not ok:
      problems.append(what)

  # The processes.
  s = SCHEDULE
  first_rc = {"complete": 0, "raise": 1, "sigint": 0, "sigkill": -9}[cell["ending"]]
  check(runs[0].rc == first_rc, f"first process: exit code {runs[0].rc}, want {first_rc}")
  if len(runs) > 1:
    check(runs[1].rc == 0, f"resumed process: exit code {runs[1].rc}, want 0")
  results = [r.result for r in runs]
  returned = [r for r in results if r is not None]
  check([r["step"] for r in returned] == want["returned"],
        f"runs returned at steps {[r['step'] for r in returned]}, want {want['returned']}")
  for r in returned:
    check(not r["tensorflow"], "TensorFlow was imported")
  if results[-1] is not None and cell["ending"] != "raise":
    final = results[-1]
    check(final["status"] == "completed", f"final status {final['status']!r}")
    check(final["digest"] == ref[ref_key(cell)]["digest"],
          f"the final state differs from the straight run's ({ref_key(cell)})")
    if cell["ending"] in RESUMES:
      at = s[cell["ending"] + "_at"]
      check(final["restored_step"] == at, f"resumed from {final['restored_step']}, want {at}")
  if cell["ending"] == "sigint" and results[0] is not None:
    check((results[0]["status"], results[0]["step"]) == ("preempted", s["sigint_at"]),
          f"after SIGINT: {results[0]['status']!r} at step {results[0]['step']}")

  if cell["rewind"]:  # one rewind, in the first process; the range kept to the end
    rewinds = [r["rewinds"] for r in results if r is not None]
    want_rewinds = [[[s["spike_at"], s["ckpt_every"]]] if i == 0 else []
                    for i, r in enumerate(results) if r is not None]
    check(rewinds == want_rewinds, f"rewinds (spike step, restored step) per process "
          f"{rewinds}, want {want_rewinds}")
    skips = [r["skip_steps"] for r in results if r is not None]
    rng = [s["ckpt_every"] + 1, s["spike_at"] + s["spike_margin"]]
    check(all(k == [rng] for k in skips), f"skip ranges {skips}, want {rng} in each")
  if cell["watchdog"]:
    check(not os.path.exists(os.path.join(workdir, "watchdog.jsonl")), "the watchdog fired")

  # The console, all processes together.
  shown = printed(consoles)
  check(shown["row"] == want["row_steps"],
        f"rows printed at steps {shown['row']}, want each of {want['row_steps']} once")
  check(shown["eval"] == want["eval_steps"],
        f"evaluations printed at {shown['eval']}, want each of {want['eval_steps']} once")
  if cell["ending"] in RESUMES:
    line = f"resumed from checkpoint {s[cell['ending'] + '_at']} in {workdir}/ckpt"
    check(sum(c.count(line) for c in consoles) == 1, f"'{line}' not printed once")
  tracebacks = sum(c.count("Traceback (most recent call last)") for c in consoles)
  if cell["ending"] == "raise":
    check(tracebacks == 1 and "Boom: the matrix's hook raises at step 11" in consoles[0],
          f"{tracebacks} tracebacks, want 1, the hook's (Boom at step 11)")
  else:
    check(tracebacks == 0, f"{tracebacks} tracebacks printed")
  if cell["goodput"]:
    check(found(GOODPUT, consoles) == want["returned"],
          f"goodput summaries at {found(GOODPUT, consoles)}, want {want['returned']}")
  if cell["progress"]:
    for run in runs:
      if run.result is not None:
        end = run.result["step"]
        check(re.search(rf"\bstep {end}/{s['steps']}\b", ANSI.sub("", run.console)) is not None,
              f"no progress at step {end}/{s['steps']}")

  # On disk.
  rows = disk_rows(workdir)
  if [(r["step"], sorted(r)) for r in rows] != [(r["step"], sorted(r)) for r in want["jsonl"]]:
    check(False, "metrics.jsonl rows (step, first key) "
          f"{[(r['step'], sorted(r)[0]) for r in rows]}, want the straight run's "
          f"{[(r['step'], sorted(r)[0]) for r in want['jsonl']]}")
  elif rows != want["jsonl"]:
    check(False, "metrics.jsonl values differ from the straight run's: (row, want) "
          + str(next((r, w) for r, w in zip(rows, want["jsonl"]) if r != w)))
  check(checkpoint_steps(workdir) == want["checkpoints"],
        f"checkpoints {checkpoint_steps(workdir)}, want {want['checkpoints']}")
  if cell["callback"]:
    with open(os.path.join(workdir, "callback.txt")) as f:
      fired = [list(map(int, line.split())) for line in f]
    check(fired == want["callback"], f"callback fired (step, state step) {fired}, "
          f"want {want['callback']}")
  if cell["tracker"] == "mlflow":
    held, rows_all = tracker_points(workdir), jsonl_points(workdir)
    if want["thrown"]:
      # A tracker cannot take a point back (docs/observability.md, "Every writer across a
      # kill"): the evaluations between checkpoint 6 and the spike keep their first points,
      # the thrown-away run's.
      from loopkit.observe.tracker_writers import mlflow_name
      gone = {r["step"] for r in want["thrown"]}
      rows_all = sorted([p for p in rows_all if p[0] not in gone]
                        + [(r["step"], mlflow_name(k), float(v)) for r in want["thrown"]
                           for k, v in r.items() if k != "step"])
    twice = sorted({(st, k) for st, k, _ in held if sum(1 for h in held if h[:2] == (st, k)) > 1})
    check(not twice, f"MLflow holds (step, key) {twice} more than once")
    if held != rows_all:
      only = sorted(set(held) - set(rows_all))[:4], sorted(set(rows_all) - set(held))[:4]
      check(False, f"MLflow's points differ from metrics.jsonl's: only in MLflow {only[0]}, "
            f"only in the file {only[1]}")
  if cell["sidecar"]:
    side = disk_rows(os.path.join(workdir, "sidecar"))
    steps = [r["step"] for r in side]
    # One tier keeps every checkpoint; with two a temporary one may go before it is read.
    must = want["saved"] if cell["tiers"] == 1 else want["checkpoints"]
    check(steps == sorted(set(steps)) and set(must) <= set(steps) <= set(want["saved"]),
          f"the sidecar evaluated steps {steps}, want each of {must} once (of {want['saved']})")
    wrong = [r for r in side if r != want["sidecar"].get(r["step"])]
    check(not wrong, f"sidecar rows differ from the in-run evaluation's: {wrong[:1]}, want "
          f"{[want['sidecar'].get(r['step']) for r in wrong[:1]]}")
  if cell["profiler"]:
    traces = glob.glob(os.path.join(workdir, "plugins", "profile", "*", "*.xplane.pb"))
    check(len(traces) == 1, f"{len(traces)} profiles written, want 1")

  if problems:
    tail = "\n".join(f"--- process {i} (exit {r.rc}, {r.wall_s:.1f} s), last lines:\n"
                     + "\n".join(segments(r.console)[-25:]) for i, r in enumerate(runs))
    pytest.fail(f"cell {cell}:\n" + "\n".join(problems) + "\n" + tail, pytrace=False)
