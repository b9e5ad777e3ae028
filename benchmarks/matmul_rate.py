r"""The float32 matmul rate of this machine at MiniLM's shapes, XLA beside torch.

A MoDDiffy-par step is three forward-backward passes, so its matmuls alone
set a floor no other saving can cross. This script times the dots of one
MiniLM forward-backward pass at batch 32 x 32 (1,024 tokens) one by one in
JAX (XLA's CPU dot, as the library's steps use it) and, when
``--torch_python`` names a torch venv, the same dots in torch (oneDNN / MKL,
as the official code uses them), and prints the rate of each and the
seconds the pass's matmuls take at that rate (``--dtypes float32,bfloat16``
for bf16 inputs too). Measured, never asserted::

    python benchmarks/matmul_rate.py --torch_python /path/torch-venv/bin/python

Run the script itself with ``--framework torch`` under the torch venv to
time torch alone (what ``--torch_python`` does in a subprocess).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

TOKENS, HIDDEN, FFN, LAYERS = 1024, 384, 1536, 6


def pass_dots() -> list[tuple[int, int, int, int]]:
    """``(count, m, k, n)`` of one MiniLM layer's dense dots in a
    forward-backward pass (forward, input gradient, weight gradient); the
    attention's batched 32 x 32 dots are left out (about 1% of the FLOPs)."""
    t, h, f = TOKENS, HIDDEN, FFN
    return [
        # forward: q, k, v, attention output (h -> h), up (h -> f), down (f -> h)
        (4, t, h, h),
        (1, t, h, f),
        (1, t, f, h),
        # input gradients: dX = dY W^T
        (4, t, h, h),
        (1, t, f, h),
        (1, t, h, f),
        # weight gradients: dW = X^T dY
        (4, h, t, h),
        (1, h, t, f),
        (1, f, t, h),
    ]


def _median_seconds(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_dots(framework: str, repeats: int, dtype: str = "float32") -> dict:
    import numpy as np

    rng = np.random.default_rng(0)
    shapes = sorted({(m, k, n) for _, m, k, n in pass_dots()})
    seconds = {}
    if framework == "jax":
        import jax
        import jax.numpy as jnp

        dot = jax.jit(jnp.matmul)
        for m, k, n in shapes:
            a = jnp.asarray(rng.standard_normal((m, k), np.float32), dtype)
            b = jnp.asarray(rng.standard_normal((k, n), np.float32), dtype)
            seconds[(m, k, n)] = _median_seconds(
                lambda a=a, b=b: dot(a, b).block_until_ready(), repeats
            )
        version = f"jax {jax.__version__}"
    else:
        import torch

        torch.set_num_threads(os.cpu_count())  # as ref_bench.py: every core
        for m, k, n in shapes:
            a = torch.from_numpy(rng.standard_normal((m, k), np.float32))
            b = torch.from_numpy(rng.standard_normal((k, n), np.float32))
            a, b = a.to(getattr(torch, dtype)), b.to(getattr(torch, dtype))
            seconds[(m, k, n)] = _median_seconds(lambda a=a, b=b: a @ b, repeats)
        version = f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    flops = sum(2 * c * m * k * n for c, m, k, n in pass_dots()) * LAYERS
    pass_s = sum(c * seconds[(m, k, n)] for c, m, k, n in pass_dots()) * LAYERS
    return {
        "framework": f"{version}, {dtype}",
        "pass_gflop": flops / 1e9,
        "pass_matmul_s": pass_s,
        "gflops": flops / pass_s / 1e9,
        "per_shape_gflops": {
            f"{m}x{k}x{n}": 2 * m * k * n / s / 1e9 for (m, k, n), s in seconds.items()
        },
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--framework", default="jax", choices=("jax", "torch"))
    parser.add_argument("--torch_python", default="")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument(
        "--dtypes", default="float32", help="comma-separated: float32,bfloat16"
    )
    parser.add_argument("--json", action="store_true", help="one JSON line only")
    args = parser.parse_args()
    dtypes = args.dtypes.split(",")
    rows = [time_dots(args.framework, args.repeats, d) for d in dtypes]
    if args.json:
        print(json.dumps(rows))
        return
    if args.torch_python:
        out = subprocess.run(
            [args.torch_python, __file__, "--framework=torch", "--json"]
            + [f"--repeats={args.repeats}", f"--dtypes={args.dtypes}"],
            capture_output=True,
            text=True,
            check=True,
        )
        rows += json.loads(out.stdout.strip().splitlines()[-1])
    print(
        "| framework | GFLOP per pass | matmul s per pass | GFLOP/s | x 3 passes (s) |"
    )
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['framework']} | {r['pass_gflop']:.1f} | {r['pass_matmul_s']:.3f} "
            f"| {r['gflops']:.0f} | {3 * r['pass_matmul_s']:.3f} |"
        )
    for r in rows:
        shapes = ", ".join(f"{k} {v:.0f}" for k, v in r["per_shape_gflops"].items())
        print(f"{r['framework']}: GFLOP/s per shape: {shapes}")


if __name__ == "__main__":
    main()
