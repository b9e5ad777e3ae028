"""Host memory settings (moddiffy_jax/hostmem.py): applied on import, can be
turned off, and leave computed numbers alone."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from moddiffy_jax import hostmem

_PROBE = """
import json
import moddiffy_jax, moddiffy_jax.hostmem as h
import jax, jax.numpy as jnp
# XLA temporaries of 2 x 32 MB per execution.
f = jax.jit(lambda x: jnp.sum(jnp.cumsum(jnp.sin(x) * 2.0)[::-1] * jnp.cos(x)))
x = jnp.arange(8 * 2**20, dtype=jnp.float32) / 2**20
print(json.dumps({"applied": h._applied, "value": [float(f(x)) for _ in range(3)]}))
"""


def _probe(env_value):
    env = dict(os.environ)
    env.pop("GLIBC_TUNABLES", None)
    if env_value is None:
        env.pop(hostmem.ENV, None)
    else:
        env[hostmem.ENV] = env_value
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_env_switch():
    assert hostmem.enabled_by_env({})
    assert hostmem.enabled_by_env({hostmem.ENV: "1"})
    for off in ("0", "false", "No", " off "):
        assert not hostmem.enabled_by_env({hostmem.ENV: off})


@pytest.mark.skipif(
    platform.system() != "Linux" or not platform.libc_ver()[0] == "glibc",
    reason="glibc's mallopt only",
)
def test_import_keeps_freed_memory_and_the_numbers():
    """On import the settings are applied (not when the environment turns
    them off) and the numbers computed are the same either way. (What they
    save is measured in benchmarks/, docs/speed.md "Host memory".)"""
    on, off = _probe(None), _probe("0")
    assert on["applied"] is True and off["applied"] is None
    assert on["value"] == off["value"]
    assert hostmem.keep_freed_memory() is hostmem.keep_freed_memory()
