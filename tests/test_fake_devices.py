"""Fake CPU devices (loopkit.tools.fake_devices, through loopkit.tools.testing): in this
process (8, see conftest.py), the cpu_devices fixture, and a fresh process whose XLA_FLAGS
already name another count (the one subprocess test that writes that flag by hand)."""

import os
import subprocess
import sys

import jax
import pytest

from loopkit.tools import testing
from loopkit.tools.testing import cpu_devices  # noqa: F401  (the fixture)


def test_fake_cpu_devices_in_this_process():
  assert len(jax.devices()) == 8  # conftest.py
  assert testing.fake_cpu_devices(8) == jax.devices()
  assert testing.fake_cpu_devices(3) == jax.devices()[:3]
  testing.set_cpu_device_count(8)  # already so: nothing to do
  with pytest.raises(RuntimeError, match=r"already initialised with 8 CPU device\(s\); 16 are"):
    testing.fake_cpu_devices(16)
  with pytest.raises(RuntimeError, match="set_cpu_device_count\\(3\\) at the top of conftest"):
    testing.set_cpu_device_count(3)
  with pytest.raises(ValueError, match="must be >= 1, got 0"):
    testing.fake_cpu_devices(0)


@pytest.mark.parametrize("cpu_devices", [2], indirect=True)
def test_cpu_devices_fixture(cpu_devices):  # noqa: F811
  assert cpu_devices == jax.devices()[:2]


def test_fake_cpu_devices_in_a_fresh_process():
  code = ("import jax; from loopkit.tools import testing; testing.set_cpu_device_count(3); "
          "a = jax.device_count(); d = testing.fake_cpu_devices(2); "
          "print(a, len(d), jax.devices()[0].platform)")
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120, check=True)
  assert out.stdout.split() == ["3", "2", "cpu"]  # the flag in XLA_FLAGS was replaced
