"""Data parallelism: meshes and batch sizes. (A run on two devices equals
the one-device run, and two processes equal one: tests/test_par_runs.py.)"""

import pathlib

import pytest

HERE = pathlib.Path(__file__).resolve().parent


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
