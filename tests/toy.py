"""A tiny linear-regression model shared by the core tests (plain pytrees + optax)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import loopkit

TX = optax.adam(0.05)


def init_state(seed: int = 0, tx=TX):
  k = jax.random.key(seed)
  params = {"w": jax.random.normal(k, (4, 2)) * 0.1, "b": jnp.zeros((2,))}
  return {"params": params, "opt": tx.init(params), "step": jnp.zeros((), jnp.int32)}


def loss_fn(params, batch):
  pred = batch["x"] @ params["w"] + params["b"]
  return jnp.mean((pred - batch["y"]) ** 2)


def make_global_step(tx=TX):
  def step(state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
    updates, opt = tx.update(grads, state["opt"], state["params"])
    return ({"params": optax.apply_updates(state["params"], updates), "opt": opt,
             "step": state["step"] + 1}, {"loss": loss})
  return step


def make_per_device_step(tx=TX, axis="data"):
  def step(state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
    grads = jax.lax.pmean(grads, axis)
    updates, opt = tx.update(grads, state["opt"], state["params"])
    return ({"params": optax.apply_updates(state["params"], updates), "opt": opt,
             "step": state["step"] + 1}, {"loss": jax.lax.pmean(loss, axis)})
  return step


def batches(n: int, batch_size: int = 16, seed: int = 0):
  rng = np.random.default_rng(seed)
  true_w = rng.normal(size=(4, 2)).astype(np.float32)
  out = []
  for _ in range(n):
    x = rng.normal(size=(batch_size, 4)).astype(np.float32)
    out.append({"x": x, "y": (x @ true_w).astype(np.float32)})
  return out


def opt_count(state) -> int:
  return int(state["opt"][0].count)


class SetPosition(loopkit.Hook):
  """Plays the checkpoint hook's part in a restore: returns the state, ledger and position."""

  needs_state = False

  def __init__(self):
    super().__init__(at_end=False)
    self.position = None

  def on_run_start(self, ctx, state):
    return loopkit.core.Restore(state, ctx.ledger.copy(), self.position)


class FakeClock:
  """A clock for ``time_fn=``-style injection; :class:`Tick` advances it."""

  def __init__(self):
    self.t = 0.0

  def __call__(self):
    return self.t


class Tick(loopkit.Hook):
  """Advances a :class:`FakeClock` by the cost of each observed call's steps.

  ``secs_per_step`` is seconds per step, or a function of the (1-based) global
  step giving that step's cost. The call lengths seen are kept in ``lengths``.
  """

  needs_state = False

  def __init__(self, clock, secs_per_step):
    super().__init__()
    self.clock = clock
    self.cost = secs_per_step if callable(secs_per_step) else (lambda _: secs_per_step)
    self.lengths = []

  def after_each_call(self, info):
    for s in range(info.start_step + 1, info.end_step + 1):
      self.clock.t += self.cost(s)
    self.lengths.append(info.num_steps)


def assert_bitwise(a, b):
  """Same tree; every leaf the same dtype, shape and bytes (names the first that is not)."""
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b),
                          strict=True):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape, jax.tree_util.keystr(path)
    assert x.tobytes() == y.tobytes(), jax.tree_util.keystr(path)


def compilation_cache_env(cache_dir) -> dict:
  """Environment variables for a worker process: JAX's persistent compilation cache in
  ``cache_dir`` for every program (no minimum compile time or entry size), so the worker
  processes of one test load each other's compiled programs (the same executables, so the
  same results) instead of compiling them again."""
  return {"JAX_COMPILATION_CACHE_DIR": str(cache_dir),
          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
          "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
