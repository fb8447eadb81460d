"""The local checkpoint tier (loopkit/checkpoint/local_tier.py): in one process, and across
real processes killed with SIGKILL, with a local directory deleted before the restart.

Each process run is tests/local_tier_workers.py's ``train_tiers`` under ``jax.distributed``
(localhost, gloo); the restarted run also trains the same run uninterrupted in the same
processes, and the two final states must be bitwise equal.
"""

import random
import shutil
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import loopkit
from loopkit.checkpoint import CheckpointHook, LocalCheckpointHook
from loopkit.checkpoint import local_tier
from loopkit.tools import testing
from tests import local_tier_workers as workers
from tests import toy

# -- one process ---------------------------------------------------------------------------


def _odd_state():
  """Leaves of every kind the tier packs: sharded, replicated, typed key, bf16, int8, bool,
  zero-size, 0-d."""
  mesh = jax.make_mesh((8,), ("data",))
  put = lambda x, spec=P(): jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
  return {"w": put(jnp.arange(32, dtype=jnp.float32).reshape(8, 4) - 7.5, P("data")),
          "neg0": put(jnp.array([-0.0, 0.0, jnp.nan], jnp.float32)),
          "key": put(jax.random.key(3)), "half": put(jnp.array([1.5, -2.25], jnp.bfloat16)),
          "i8": put(jnp.array([-128, 127], jnp.int8)), "flag": put(jnp.array(True)),
          "empty": put(jnp.zeros((0, 3))), "step": put(jnp.array(5, jnp.int32))}


def _bits(state):
  return [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(
      x.dtype, jax.dtypes.prng_key) else x).tobytes() for x in jax.tree.leaves(state)]


def test_pack_unpack_is_bitwise_for_every_leaf_kind_and_keeps_shardings():
  state = _odd_state()
  words, layout = local_tier._pack(state)
  assert words.dtype == np.uint32 and layout == local_tier._layout(state)
  assert words.size == local_tier._word_counts(state)[0]  # from the shardings alone
  assert local_tier._pack(state, words.size + 3)[0][:words.size].tobytes() == words.tobytes()
  back = local_tier._unpack(words, state)
  assert _bits(back) == _bits(state)  # -0.0 and nan payloads too
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state), strict=True):
    assert a.dtype == b.dtype and a.sharding == b.sharding
  assert jax.random.key_impl(back["key"]) == jax.random.key_impl(state["key"])


def _loop(hook, k=3):
  return loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=k, hooks=[hook])


def test_one_process_resumes_from_the_newer_tier_and_never_from_an_unfinished_step(tmp_path):
  """Local steps 3, 6, 9; persistent 5, 10 (at 12 the run ends). A restart to 15: the
  newest is persistent 12. With steps 10 and 12 gone from the persistent tier and local 9's
  commit file removed (a kill before Orbax committed it), local 6 wins over persistent 5."""
  batches = toy.batches(15)

  def tiers():
    return LocalCheckpointHook(tmp_path / "local", CheckpointHook(tmp_path / "p", every_steps=5),
                               every_steps=3, max_to_keep=3)

  first = tiers()
  _loop(first).run(toy.init_state(), batches, num_steps=12)
  assert first.saved_steps == [3, 6, 9] and first.persistent.saved_steps == [5, 10, 12]
  local = tmp_path / "local" / "process_0"
  assert sorted(int(p.name) for p in local.iterdir()) == [3, 6, 9]
  again = tiers()
  _loop(again).run(toy.init_state(), batches, num_steps=12)
  assert (again.restored_step, again.restored_from) == (12, "persistent")

  for s in (10, 12):
    shutil.rmtree(tmp_path / "p" / str(s))
  (local / "9" / "commit_success.txt").unlink()
  resumed = tiers()
  loop = _loop(resumed)
  final = loop.run(toy.init_state(), batches, num_steps=15)
  assert (resumed.restored_step, resumed.restored_from) == (6, "local")
  assert resumed.saved_steps == [9, 12] and resumed.persistent.saved_steps == [10, 15]
  assert loop.ledger.step == 15 and loop.ledger.examples_seen == 15 * 16
  reference = _loop(loopkit.CallbackHook(lambda i, s: None)).run(
      toy.init_state(), batches, num_steps=15)
  assert _bits(final) == _bits(reference)


def test_persistent_at_its_marks_and_at_a_preemption_local_otherwise(tmp_path):
  """Local every 3, persistent every 5, preempted after step 7 (K=1): the planner lands on both
  tiers' marks; 5 and the preemption's 7 go to the persistent tier, 3 and 6 stay local."""
  tiers = LocalCheckpointHook(tmp_path / "l", CheckpointHook(tmp_path / "p", every_steps=5),
                              every_steps=3)
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4, hooks=[
      tiers, loopkit.CallbackHook(lambda i, s: loop.preemption.request(), at_steps=[7])])
  loop.run(toy.init_state(), toy.batches(20), num_steps=20)
  assert loop.status == "preempted" and loop.ledger.step == 7
  assert tiers.saved_steps == [3, 6] and tiers.persistent.saved_steps == [5, 7]
  assert tiers.trigger.next_step(0) == 3 and tiers.trigger.next_step(4) == 5


def test_plan_takes_the_newest_step_every_process_can_read_each_from_its_own_copy_first():
  """Identical views: every process reads its own copy (not the first equal view's)."""
  plan = local_tier._plan
  same = {"steps": {"6": ["A", 40], "9": ["A", 40]}, "need": "A", "persistent": None}
  assert plan([same, dict(same), dict(same), dict(same)]) == (9, [0, 1, 2, 3], {0: 40, 1: 40,
                                                                                  2: 40, 3: 40})
  # Process 2 lost its disk, process 1's write of 9 was cut: 9 from peers, own copies first.
  lost = {"steps": {}, "need": "A", "persistent": None}
  cut = {"steps": {"6": ["A", 40]}, "need": "A", "persistent": None}
  assert plan([same, cut, lost, same]) == (9, [0, 0, 0, 3], {0: 40, 3: 40})
  # Shards held by one process only (fingerprints differ): 9 is nowhere else, 6 everywhere.
  mine = [{"steps": {"6": [f"P{i}", 8], "9": [f"P{i}", 8]}, "need": f"P{i}",
           "persistent": None} for i in range(2)]
  del mine[1]["steps"]["9"]
  assert plan(mine) == (6, [0, 1], {0: 8, 1: 8})
  # A persistent step newer than every complete local step wins; an equal one does not.
  mine[0]["persistent"] = 7
  assert plan(mine) is None
  mine[0]["persistent"] = 6
  assert plan(mine) == (6, [0, 1], {0: 8, 1: 8})
  assert plan([lost, lost]) is None


def test_bad_arguments_are_refused_naming_the_value(tmp_path):
  p = CheckpointHook(tmp_path / "p", every_steps=5)
  with pytest.raises(ValueError, match="needs a local cadence"):
    LocalCheckpointHook(tmp_path / "l", p)
  with pytest.raises(ValueError, match="max_to_keep must be >= 1, got 0"):
    LocalCheckpointHook(tmp_path / "l", p, every_steps=2, max_to_keep=0)
  with pytest.raises(TypeError, match="got str"):
    LocalCheckpointHook(tmp_path / "l", str(tmp_path), every_steps=2)
  with pytest.raises(ValueError, match="every_secs=60"):
    LocalCheckpointHook(tmp_path / "l", CheckpointHook(tmp_path / "q", every_secs=60),
                        every_steps=2)
  state = toy.init_state()
  state["lr"] = 0.1  # a Python float leaf
  with pytest.raises(TypeError, match=r"leaf \['lr'\] is a float"):
    local_tier._check_leaves(state)


# -- real processes ------------------------------------------------------------------------


def _run_killed(tmp_path: Path, *, num_processes: int, k: int, wait_for_step: int,
                delay_s: float, layout: str = "replicated", num_steps: int = 24,
                sleep_s: float = 0.05) -> float:
  """Trains until every process committed local step ``wait_for_step``, waits ``delay_s``
  and SIGKILLs every process. Returns the seconds it took."""
  marker = tmp_path / "marker"
  marker.mkdir(exist_ok=True)
  t0 = time.monotonic()
  with testing.ProcessGroup(
      workers.train_tiers, num_processes=num_processes, devices_per_process=2,
      args=(str(tmp_path / "local"), str(tmp_path / "persistent"), k, num_steps),
      kwargs={"layout": layout, "sleep_s": sleep_s, "marker": str(marker)}) as group:
    want = [marker / f"saved_{i}_{wait_for_step}" for i in range(num_processes)]
    while not all(m.exists() for m in want):
      assert all(c is None for c in group.poll()), group.check(group.wait(1))
      assert time.monotonic() - t0 < 180, f"local step {wait_for_step} never saved"
      time.sleep(0.01)
    time.sleep(delay_s)
    killed = group.kill()
  assert killed, "the run ended before the kill"
  return time.monotonic() - t0


def _resume(tmp_path: Path, *, num_processes: int, k: int, layout: str = "replicated",
            num_steps: int = 24) -> list[dict]:
  return testing.run_processes(
      workers.train_tiers, num_processes=num_processes,
      devices_per_process=2,
      args=(str(tmp_path / "local"), str(tmp_path / "persistent"), k, num_steps),
      kwargs={"layout": layout, "reference": True}, timeout_s=300)


def _check_resume(runs: list[dict], *, layout: str, num_steps: int = 24) -> list[str]:
  """Every process resumed at the same step, the one the tiers held before the restart (the
  newest local step some process's copy gives everyone, or every process its own with the
  sharded layout, if at least as new as the persistent newest; else that), each from its own
  copy where it had one; and ended bitwise equal to the uninterrupted run."""
  steps = {r["restored_step"] for r in runs}
  assert len(steps) == 1, runs  # agreed
  for r in runs:
    assert r["status"] == "completed" and r["step"] == num_steps
    assert r["digest"] == r["reference"], r  # bitwise the uninterrupted run
    assert r["compiles"] == 1
  owns = [set(r["own_before"]) for r in runs]
  readable = set.union(*owns) if layout == "replicated" else set.intersection(*owns)
  newest_local = max(readable, default=None)
  newest_persistent = max(runs[0]["persistent_before"], default=None)
  froms = [r["restored_from"] for r in runs]
  if newest_local is not None and (newest_persistent is None
                                   or newest_local >= newest_persistent):
    assert steps == {newest_local}, runs
    assert froms == ["local" if newest_local in own else "peer" for own in owns], runs
  else:
    assert steps == {newest_persistent}, runs
    assert froms == (["persistent"] if newest_persistent is not None else [None]) * len(runs)
  return froms


def test_sigkill_and_a_lost_local_directory_resume_from_a_peer_bitwise(tmp_path):
  """2 processes x 2 devices, K=4, local every 3 steps, persistent every 10: SIGKILL once
  local step 12 is committed everywhere, process 0's local directory deleted (a replaced
  host). Process 1 resumes from its own copy, process 0 from process 1's, at the same step
  (12 or 15: newer than persistent 10); the end state is bitwise the uninterrupted run's."""
  took = _run_killed(tmp_path, num_processes=2, k=4, wait_for_step=12, delay_s=0.0)
  shutil.rmtree(tmp_path / "local" / "process_0")
  t0 = time.monotonic()
  runs = _resume(tmp_path, num_processes=2, k=4)
  print(f"killed run {took:.1f} s, resume + reference {time.monotonic() - t0:.1f} s")
  assert _check_resume(runs, layout="replicated") == ["peer", "local"]
  assert runs[0]["own_before"] == [] and runs[0]["restored_step"] in (12, 15)
  restored = runs[0]["restored_step"]
  assert runs[1]["local_saved"] == [s for s in (15, 18, 21) if s > restored]
  assert runs[0]["persistent_saved"] == [20, 24]


KILL_MATRIX = [(n, k, deleted, "replicated") for n in (2, 4) for k in (1, 4, 7)
               for deleted in (False, True)] + [(2, 4, True, "sharded")]


@pytest.mark.slow(held_by="tests/test_checkpoint_local_tier.py::"
                          "test_sigkill_and_a_lost_local_directory_resume_from_a_peer_bitwise",
                  reason="13 kill-and-resume pairs of 2 and 4 processes, about 40 s each")
@pytest.mark.parametrize("num_processes,k,deleted,layout", KILL_MATRIX)
def test_sigkill_at_a_random_moment_resumes_bitwise(tmp_path, num_processes, k, deleted,
                                                    layout):
  rng = random.Random(f"{num_processes}-{k}-{deleted}-{layout}")
  delay = rng.uniform(0.0, 1.0)  # after local step 3: anywhere in the next ~20 steps
  _run_killed(tmp_path, num_processes=num_processes, k=k, wait_for_step=3, delay_s=delay,
              layout=layout)
  if deleted:
    shutil.rmtree(tmp_path / "local" / f"process_{num_processes - 1}", ignore_errors=True)
  runs = _resume(tmp_path, num_processes=num_processes, k=k, layout=layout)
  froms = _check_resume(runs, layout=layout)
  if deleted:
    assert runs[-1]["own_before"] == []
  print(f"{num_processes} processes, K={k}, deleted={deleted}, {layout}: killed "
        f"{delay:.2f} s after step 3, resumed at {runs[0]['restored_step']} from {froms}")
