"""Two processes for real: ``jax.distributed`` with two CPU processes on this
machine (local coordinator, gloo collectives), one device each, run the tiny
MoDDiffy-par config through the command line: training, a SIGTERM that both
processes agree on, resume, export and evaluation. The result equals, bit
for bit, one process driving two devices with the same global batch."""

import pathlib
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np

from moddiffy_jax import checkpoints
from moddiffy_jax.subnets import diffs as diffs_lib
from tests.helpers import TINY_PAR_CLI, cli_env

REPO = pathlib.Path(__file__).resolve().parent.parent


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _start_pair(workdir):
    port = _free_port()
    return [
        subprocess.Popen(
            [sys.executable, *TINY_PAR_CLI, f"--workdir={workdir}", "--distributed"]
            + [f"--coordinator_address=localhost:{port}", "--num_processes=2"]
            + [f"--process_id={i}"],
            cwd=REPO,
            env=cli_env(1),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in (0, 1)
    ]


def _finish(procs):
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
        assert "Traceback" not in err
    return [out for out, _ in outs]


def test_two_processes_equal_one_process_on_two_devices(two_device_run, tmp_path):
    one, two = two_device_run, tmp_path / "two"
    procs = _start_pair(two)
    # The preemption notice reaches both once the first checkpoint exists.
    end = time.time() + 300
    while not (two / "metrics.jsonl").exists() and time.time() < end:
        assert all(p.poll() is None for p in procs), procs[0].communicate()[1][-3000:]
        time.sleep(0.01)
    for p in procs:
        p.send_signal(signal.SIGTERM)
    outs = _finish(procs)
    stops = {o.split("Stopped at step ")[1].split()[0] for o in outs}
    assert len(stops) == 1, outs  # both saved the same step
    assert not (two / "results.json").exists()
    outs = _finish(_start_pair(two))  # resume, export, evaluate
    assert "results:" in outs[0] and "results:" not in outs[1]  # the chief prints
    for name in ("core.safetensors", "task_head.safetensors"):
        a, _ = checkpoints.load_params(one / "export" / name)
        b, _ = checkpoints.load_params(two / "export" / name)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_array_equal(x, y)
    diffs = sorted((one / "export" / "diffs").glob("*.safetensors"))
    assert diffs
    for f in diffs:
        a = diffs_lib.load_sparse_diff(f)
        b = diffs_lib.load_sparse_diff(two / "export" / "diffs" / f.name)
        for p in a.indices:
            np.testing.assert_array_equal(a.indices[p], b.indices[p])
            np.testing.assert_array_equal(a.values[p], b.values[p])
    import json

    r1 = json.loads((one / "results.json").read_text())
    r2 = json.loads((two / "results.json").read_text())
    assert r1["composition"] == r2["composition"]
