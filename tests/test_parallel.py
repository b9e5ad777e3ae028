"""Data parallelism: a sharded step equals the single-device step."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent


@pytest.mark.parametrize("method", ["moddiffy_par"])
def test_sharded_step_equals_single_device_step(method):
    env = dict(os.environ)
    out = subprocess.run(
        [sys.executable, str(HERE / "sharding_check.py"), method],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    match = re.search(r"MAXDIFF (\S+) LOSSDIFF (\S+) UPDATE (\S+)", out.stdout)
    assert match, out.stdout
    maxdiff, lossdiff, update = (float(x) for x in match.groups())
    assert update > 1e-6  # the step really changed the params
    assert maxdiff < 1e-5, maxdiff
    assert lossdiff < 1e-5, lossdiff


def test_batch_not_divisible_by_devices_is_refused():
    import types

    import numpy as np

    from moddiffy_jax import parallel

    assert parallel.check_batch_size(8, parallel.make_mesh(1)) == 8
    four = types.SimpleNamespace(devices=np.empty((4,), object))  # a 4-device mesh
    assert parallel.check_batch_size(8, four) == 8
    with pytest.raises(ValueError, match="batch size 6 is not divisible by the 4"):
        parallel.check_batch_size(6, four)


def test_more_devices_than_visible_is_refused():
    from moddiffy_jax import parallel

    with pytest.raises(ValueError, match="num_devices=10000.*visible"):
        parallel.make_mesh(10_000)
