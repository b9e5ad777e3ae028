r"""The backward pass of an embedding lookup (a scatter-add), variant by variant.

Stop 30's GPU trace of the BERT-base fine-tuning step (batch 256 x 128,
bf16) put 63 ms of its 119 ms of device time in one scatter fusion: the
gradient of a row lookup, where one row (padding, or token type 0) takes
tens of thousands of the updates. This times the gradient of ``sum(take(table,
ids) * g)`` with respect to ``table`` (a [rows, hidden] table, ids of shape
``--batch x --length``) for:

* ``ids`` as the main job pads them (``--pad_share`` of them the pad id 0) or
  all 0 (token types) or uniform (no heavy row);
* the table read in bf16 (cast, then gathered: the scatter adds bf16) or in
  float32 (gathered, then cast: the scatter adds float32);
* padding's updates dropped (sent out of range): exact wherever padding's
  gradient is zero, as in a masked encoder.

    python benchmarks/embed_backward.py [--batch 256 --length 128]

Each row: median milliseconds of the jitted gradient (``--repeats``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_routing import median_time  # noqa: E402


def lookup_grad(gather_dtype, drop_pad: bool):
    """d/d table of sum(take(table, ids) * g), the lookup read in
    ``gather_dtype`` (cast before the gather) and padding's updates dropped
    when ``drop_pad``."""

    def loss(table, ids, valid, g):
        t = table.astype(gather_dtype)
        if drop_pad:
            ids = jnp.where(valid, ids, table.shape[0])  # out of range: dropped
            rows = jnp.take(t, ids, axis=0, mode="fill", fill_value=0)
        else:
            rows = jnp.take(t, ids, axis=0)
        return jnp.sum(rows.astype(g.dtype) * g)

    return jax.jit(jax.grad(loss))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=30522)
    parser.add_argument("--pad_share", type=float, default=0.7)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    shape = (args.batch, args.length)
    real = rng.integers(1000, args.vocab, size=shape)
    keep = np.arange(args.length)[None, :] < int(args.length * (1 - args.pad_share))
    cases = {
        "padded words": (np.where(keep, real, 0), keep, args.vocab),
        "uniform words": (real, np.ones(shape, bool), args.vocab),
        "token types (all 0)": (np.zeros(shape, np.int64), np.ones(shape, bool), 2),
    }
    g = jax.random.normal(
        jax.random.PRNGKey(0), shape + (args.hidden,), jnp.bfloat16
    ).astype(jnp.bfloat16)
    for case, (ids, valid, rows) in cases.items():
        table = jnp.zeros((rows, args.hidden), jnp.float32)
        ids, valid = jnp.asarray(ids, jnp.int32), jnp.asarray(valid)
        for gather_dtype in (jnp.bfloat16, jnp.float32):
            for drop in (False, True) if case == "padded words" else (False,):
                fn = lookup_grad(gather_dtype, drop)
                ms = 1e3 * median_time(
                    lambda a=(fn, table, ids, valid): a[0](*a[1:], g), args.repeats
                )
                row = {
                    "what": "embedding backward",
                    "case": case,
                    "gather": jnp.dtype(gather_dtype).name,
                    "drop_pad": drop,
                    "ms_median": round(ms, 3),
                    "device": jax.devices()[0].device_kind,
                    "shape": list(shape) + [args.hidden],
                }
                print(json.dumps(row), flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
