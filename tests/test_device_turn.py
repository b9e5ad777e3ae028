"""benchmarks/bench_steps.device_turn: processes that share a device wait for
each other's compiles, then time their steps one at a time (gpu_lease.sh's
PAIR)."""

import subprocess
import sys
import time
from pathlib import Path

_BENCH = Path(__file__).resolve().parents[1] / "benchmarks"

# A stand-in for a benchmark process: "compiles" for a given time, then holds
# its turn for a while, writing when it entered and left.
_CHILD = """
import sys, time
sys.path.insert(0, {bench!r})
import bench_steps
compile_s, hold_s, out = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
time.sleep(compile_s)
compiled = time.time()
with bench_steps.device_turn():
    entered = time.time()
    time.sleep(hold_s)
    left = time.time()
with open(out, "w") as f:
    f.write(f"{{compiled}} {{entered}} {{left}}")
"""


def _run(tmp_path, env_turn, timings):
    script = tmp_path / "child.py"
    script.write_text(_CHILD.format(bench=str(_BENCH)))
    env = {"PATH": "/usr/bin:/bin"}
    if env_turn:
        env["BENCH_TURN"] = env_turn
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(c), str(h), str(tmp_path / f"out{i}")],
            env=env,
        )
        for i, (c, h) in enumerate(timings)
    ]
    for p in procs:
        assert p.wait(timeout=60) == 0
    return [
        [float(x) for x in (tmp_path / f"out{i}").read_text().split()]
        for i in range(len(timings))
    ]


def test_turns_start_after_every_compile_and_do_not_overlap(tmp_path):
    # The first process compiles fast, the second slowly: the first still
    # waits for the second's compile before its timed part.
    (a, b) = _run(tmp_path, f"{tmp_path / 'turn'},2", [(0.1, 1.0), (1.5, 1.0)])
    last_compile = max(a[0], b[0])
    assert a[1] >= last_compile - 0.05 and b[1] >= last_compile - 0.05
    first, second = sorted([a, b], key=lambda r: r[1])
    assert second[1] >= first[2] - 0.01, (a, b)  # one turn after the other


def test_without_the_variable_nothing_waits(tmp_path):
    start = time.time()
    (a, b) = _run(tmp_path, None, [(0.1, 1.0), (0.1, 1.0)])
    assert a[1] - a[0] < 0.5 and b[1] - b[0] < 0.5
    assert time.time() - start < 10
