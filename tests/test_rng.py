"""Per-step keys (loopkit.core.rng.step_key): fold_in of the global step (and, per device, of the
device index), so a step's randomness depends on the base key and the step only."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import loopkit
from loopkit._internal.mesh import data_parallel_mesh
from loopkit.core.rng import step_key


def _bits(key):
  return np.asarray(jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
                    else key)


def test_step_key_is_fold_in_of_the_step_for_typed_and_raw_keys():
  for key in (jax.random.key(0), jax.random.PRNGKey(0)):
    got = step_key(key, 7)
    assert got.dtype == key.dtype and got.shape == key.shape
    np.testing.assert_array_equal(_bits(got), _bits(jax.random.fold_in(key, 7)))
    np.testing.assert_array_equal(_bits(step_key(key, jnp.int32(7))), _bits(got))
    assert not np.array_equal(_bits(step_key(key, 8)), _bits(got))
  assert loopkit.step_key is step_key  # the front door's name


def test_step_key_under_jit_equals_eager():
  key = jax.random.key(3)
  np.testing.assert_array_equal(_bits(jax.jit(step_key)(key, 5)), _bits(step_key(key, 5)))


def test_per_device_keys_fold_in_the_device_index():
  mesh = data_parallel_mesh(devices=jax.devices()[:4])
  key = jax.random.key(1)

  def draw(k):
    return jax.random.uniform(step_key(k, 2, axis_name="data"), (1,))

  per_device = jax.jit(jax.shard_map(draw, mesh=mesh, in_specs=P(), out_specs=P("data")))(key)
  want = [jax.random.uniform(jax.random.fold_in(jax.random.fold_in(key, 2), i), (1,))[0]
          for i in range(4)]
  np.testing.assert_array_equal(np.asarray(per_device), np.asarray(want))
  assert len(set(np.asarray(per_device).tolist())) == 4  # devices draw different numbers
