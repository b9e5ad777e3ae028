r"""Per-example routing against separate forwards, MiniLM, eval mode.

A batch of B examples, each routed to one of K random 1%-dense diffs (global
budget over the encoder, as MoDDiffy's) or to the core alone, in equal
shares. Two ways to serve it, both jitted and warmed up:

* routed: one ``routing.encode`` call (the core matmuls once, the diffs'
  sparse contributions per example);
* separate: per route, compose ``core + D_k`` (``apply_diffs``) and run the
  encoder on that route's rows (K + 1 forwards of B / (K + 1) rows, and K
  compositions).

    python benchmarks/bench_routing.py --batch=32 --length=32 --diffs=1,2,4

Prints examples per second of each and their ratio, median of ``--repeats``.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from moddiffy_jax import routing
from moddiffy_jax.models import bert
from moddiffy_jax.subnets import diffs as diffs_lib


def _random_diff(params, seed, keep):
    rng = np.random.default_rng(seed)
    dense = jax.tree.map(
        lambda x: rng.normal(scale=1e-2, size=x.shape).astype(np.float32), params
    )
    return diffs_lib.prune_to_sparsity(dense, keep=keep)


def median_time(fn, repeats):
    """Median seconds of ``fn()`` (blocked until ready) after one warm-up call."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--diffs", default="1,2,4")
    parser.add_argument("--keep", type=float, default=0.01)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()

    config, core = bert.load_pretrained()
    rng = np.random.default_rng(0)
    b, n = args.batch, args.length
    batch = {
        "input_ids": jnp.asarray(rng.integers(1000, 20000, size=(b, n)), jnp.int32),
        "attention_mask": jnp.ones((b, n), jnp.int32),
        "token_type_ids": jnp.zeros((b, n), jnp.int32),
    }
    forward = jax.jit(lambda p, x: bert.encode(config, p, x).pooler_output)
    compose = jax.jit(diffs_lib.apply_diffs)
    routed_fn = jax.jit(
        lambda r, w, x: routing.encode(config, core, r, w, x).pooler_output
    )
    print(f"MiniLM, batch {b} x {n} tokens, diffs {args.keep:.0%} dense, eval mode")
    print(
        "K | routed, sparse kernels (ex/s) | routed, dense kernels (ex/s) | "
        "separate (ex/s) | sparse / separate | dense / separate"
    )
    for k in (int(x) for x in args.diffs.split(",")):
        diffs = [_random_diff(core, s, args.keep) for s in range(k)]
        route = np.arange(b) % (k + 1)  # 0: core, i: diff i
        weights = np.zeros((b, k), np.float32)
        for i in range(1, k + 1):
            weights[route == i, i - 1] = 1.0
        routed = routing.RoutedDiffs.build(core, diffs)
        routed_dense = routing.RoutedDiffs.build(core, diffs, kernels="dense")
        groups = [
            {key: v[np.flatnonzero(route == r)] for key, v in batch.items()}
            for r in range(k + 1)
        ]
        one_hot = [jnp.asarray(np.eye(k, dtype=np.float32)[i]) for i in range(k)]

        def separate(diffs=diffs, groups=groups, one_hot=one_hot):
            outs = [forward(core, groups[0])]
            for i in range(len(one_hot)):
                outs.append(forward(compose(core, diffs, one_hot[i]), groups[i + 1]))
            return outs

        t_routed = median_time(
            lambda routed=routed, weights=weights: routed_fn(routed, weights, batch),
            args.repeats,
        )
        t_dense = median_time(
            lambda r=routed_dense, weights=weights: routed_fn(r, weights, batch),
            args.repeats,
        )
        t_sep = median_time(separate, args.repeats)
        print(
            f"{k} | {b / t_routed:.1f} | {b / t_dense:.1f} | {b / t_sep:.1f} | "
            f"{t_sep / t_routed:.2f}x | {t_sep / t_dense:.2f}x"
        )


if __name__ == "__main__":
    main()
