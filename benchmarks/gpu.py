r"""Accelerator speed of the MoDDiffy-par step and of diff composition.

Measures, on whatever device JAX sees first (meant for one GPU):

* the device's bf16 matmul ceiling (an 8192^3 product, median of ``--repeats``),
  the denominator of the measured-peak MFU;
* for each ``--dtypes`` entry, the MoDDiffy-par train step (task step plus one
  adversarial diff step per attribute, one compiled program) and a plain
  fine-tuning step on BERT-base shapes (random weights, synthetic batches of
  ``--batch`` x ``--length`` tokens): compile time, median step time,
  examples/s, the model FLOPs of the step and MFU against the datasheet peak
  and against the measured ceiling, each step timed alone (blocking) and the
  same steps dispatched back to back (``*_pipelined``: the training loop's
  rate, host work overlapped); the step's ratio to three fine-tuning
  steps (its floor: three forward-backward passes); with ``--trace DIR``, a
  profile of three more steps, dispatched back to back, and where their
  device time goes
  (``trace_summary.py``);
* composing core + one and two 1%-dense diffs (``apply_diffs``, jitted) on
  BERT-base parameters.

    MODDIFFY_MODEL_DIR=<dir with MiniLM's tokenizer files> \
        python benchmarks/gpu.py --out results_gpu.jsonl

Model FLOPs per forward-backward pass count the encoder's matmuls only
(embeddings are lookups): ``6 * N_matmul * tokens + 12 * layers * hidden *
length * tokens`` (attention scores and values, forward and backward); the
MoDDiffy-par step does three such passes (its optimizer and gate work is not
counted: MFU here is model FLOPs, as is usual). Every row is appended to ``--out`` as a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_steps  # noqa: E402
from bench_routing import median_time  # noqa: E402

# Dense bf16 tensor-core peak from NVIDIA's datasheets (TFLOP/s, no sparsity).
DATASHEET_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def datasheet_peak(device_kind: str) -> float | None:
    for name, tflops in DATASHEET_BF16_TFLOPS.items():
        if name in device_kind:
            return tflops
    return None


def matmul_ceiling(n: int = 8192, repeats: int = 10) -> float:
    """Measured bf16 matmul rate (TFLOP/s) of an n^3 product."""
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    a = jax.random.normal(k1, (n, n), jnp.bfloat16)
    b = jax.random.normal(k2, (n, n), jnp.bfloat16)
    mm = jax.jit(jnp.matmul)
    return 2 * n**3 / median_time(lambda: mm(a, b), repeats) / 1e12


def model_flops_per_pass(cfg: dict, batch: int, length: int) -> float:
    """Matmul FLOPs of one forward-backward pass of a BERT encoder."""
    h, f, n_layers = (
        cfg["hidden_size"],
        cfg["intermediate_size"],
        cfg["num_hidden_layers"],
    )
    per_layer = 4 * h * h + 2 * h * f  # q, k, v, out; two feed-forward dots
    n_matmul = n_layers * per_layer + h * h  # + pooler
    tokens = batch * length
    return 6.0 * n_matmul * tokens + 12.0 * n_layers * h * length * tokens


def step_row(
    method,
    batch,
    length,
    steps,
    dtype,
    peak,
    trace_dir=None,
    step_jit="step",
    scan_layers=False,
    attention="xla",
    attention_dropout=-1.0,
    compiler_options=None,
) -> dict:
    row = bench_steps.run_one(
        method,
        "bert-base",
        batch,
        length,
        steps,
        dtype,
        "adversarial",
        step_jit=step_jit,
        trace_dir=trace_dir,
        scan_layers=scan_layers,
        attention=attention,
        attention_dropout=attention_dropout,
        compiler_options=compiler_options,
    )
    with open(os.path.join(bench_steps._bert_base_dir(), "config.json")) as f:
        cfg = json.load(f)
    passes = len(row["substeps"])
    flops = passes * model_flops_per_pass(cfg, batch, length)
    achieved = flops / row["step_s_median"] / 1e12
    row |= {
        "model_tflop_per_step": round(flops / 1e12, 3),
        "achieved_tflops": round(achieved, 1),
        "mfu_datasheet": round(achieved / peak, 3) if peak else None,
    }
    # Back-to-back steps (the training loop's rate; bench_steps.run_one).
    pipelined = flops / row["step_s_pipelined"] / 1e12
    row |= {
        "achieved_tflops_pipelined": round(pipelined, 1),
        "mfu_datasheet_pipelined": round(pipelined / peak, 3) if peak else None,
    }
    if trace_dir:
        import trace_summary

        try:
            summary = trace_summary.summarize(trace_summary.find_trace(trace_dir))
        except (OSError, ValueError, KeyError) as e:
            summary = {"error": repr(e)}
        row["trace"] = summary
    return row


def compose_rows(keep: float, repeats: int) -> list[dict]:
    """Time core + 1 and + 2 diffs of ``keep`` density on BERT-base params."""
    from moddiffy_jax.models import bert_model
    from moddiffy_jax.subnets import diffs as diffs_lib

    with open(os.path.join(bench_steps._bert_base_dir(), "config.json")) as f:
        fields = json.load(f)
    config = bert_model.BertConfig(**fields)
    params = bert_model.init_params(config, jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    diffs = []
    for _ in range(2):
        dense = jax.tree.map(
            lambda x: rng.normal(scale=1e-2, size=x.shape).astype(np.float32),
            params,
        )
        diffs.append(diffs_lib.prune_to_sparsity(dense, keep=keep))
    compose = jax.jit(diffs_lib.apply_diffs)
    n = sum(int(np.size(x)) for x in jax.tree.leaves(params))
    rows = []
    for k in (1, 2):
        t = median_time(lambda k=k: compose(params, diffs[:k]), repeats)
        rows.append(
            {
                "what": f"compose core + {k} diff(s)",
                "params": n,
                "keep": keep,
                "nnz_per_diff": diffs[0].nnz(),
                "ms_median": round(1e3 * t, 3),
            }
        )
    return rows


def parse_attention(entry: str) -> tuple[str, float]:
    """``"cudnn:0"`` -> ("cudnn", 0.0); ``"xla"`` -> ("xla", -1.0) (the model's
    own attention dropout)."""
    kernel, _, dropout = entry.partition(":")
    return kernel, float(dropout) if dropout else -1.0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--methods", default="moddiffy_par,finetune")
    parser.add_argument("--keep", type=float, default=0.01)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--matmul_n", type=int, default=8192)
    parser.add_argument("--no_compose", action="store_true")
    parser.add_argument(
        "--step_jit", default="step", help="config.train.step_jit: step or substeps"
    )
    parser.add_argument(
        "--scan_layers",
        default="0",
        help="comma list of config.model.scan_layers values to measure (0, 1)",
    )
    parser.add_argument(
        "--attention",
        default="xla",
        help="comma list of KERNEL[:DROPOUT] (config.model.attention and "
        "attention_dropout), e.g. xla,xla:0,cudnn:0",
    )
    parser.add_argument(
        "--trace", default="", help="folder for a jax.profiler trace of each step"
    )
    parser.add_argument(
        "--compiler_option",
        action="append",
        default=[],
        help="KEY=VALUE, an XLA DebugOptions field for the train step's compile "
        "(repeatable), e.g. xla_gpu_command_buffer_update_mode=1: in jax 0.11.2 "
        "that field is not an XLA_FLAGS flag, and its enum takes numbers",
    )
    parser.add_argument("--out", default="benchmarks/results_gpu.jsonl")
    args = parser.parse_args()
    options = {
        k: {"true": True, "false": False}.get(v.lower(), v)
        for k, v in (o.split("=", 1) for o in args.compiler_option)
    }

    stamp, machine = bench_steps.stamp_and_machine()
    kind = jax.devices()[0].device_kind
    peak = datasheet_peak(kind)

    def emit(row):
        print(json.dumps(row), flush=True)
        bench_steps.append_jsonl(args.out, row | {"date": stamp, "machine": machine})

    for row in [] if args.no_compose else compose_rows(args.keep, args.repeats):
        emit(row)
    steps, ceiling = [], None
    variants = [
        (dtype, bool(int(scan)), *parse_attention(att))
        for dtype in args.dtypes.split(",")
        for scan in args.scan_layers.split(",")
        for att in args.attention.split(",")
    ]
    for dtype, scan, attention, dropout in variants:
        by_method = {}
        tag = f"{'_scan' if scan else ''}_{attention}" + (
            f"{dropout:g}" if dropout >= 0 else ""
        )
        for method in args.methods.split(","):
            label = f"{method} {dtype}{tag}"
            print(f"{time.strftime('%H:%M:%S')} {label}: building", flush=True)
            trace_dir = (
                os.path.join(args.trace, f"{method}_{dtype}_{args.batch}{tag}")
                if args.trace
                else None
            )
            try:
                row = step_row(
                    method,
                    args.batch,
                    args.length,
                    args.steps,
                    dtype,
                    peak,
                    trace_dir,
                    args.step_jit,
                    scan,
                    attention,
                    dropout,
                    options or None,
                )
            except Exception as e:  # report and go on to the next configuration
                print(f"{label} failed: {e!r}", flush=True)
                continue
            by_method[method] = row
            steps.append(row)
            emit(row)
        if {"moddiffy_par", "finetune"} <= by_method.keys():
            ratio = by_method["moddiffy_par"]["step_s_median"] / (
                3 * by_method["finetune"]["step_s_median"]
            )
            print(f"{label}: MoDDiffy-par step / (3 x finetune) = {ratio:.2f}")
        if ceiling is None:
            # The matmul ceiling after the first dtype's steps: other
            # processes sharing the device (compile probes) are done by then.
            with bench_steps.device_turn():  # alone on the device (PAIR)
                ceiling = matmul_ceiling(args.matmul_n)
            emit(
                {
                    "what": "device",
                    "device": kind,
                    "backend": jax.default_backend(),
                    "jax": jax.__version__,
                    "bf16_matmul_tflops_measured": round(ceiling, 1),
                    "bf16_tflops_datasheet": peak,
                }
            )
    for row in steps:
        print(
            f"{row['method']} {row['dtype']} batch {row['batch']}"
            f"{' scan' if row.get('scan_layers') else ''} "
            f"{row.get('attention', 'xla')}:{row.get('attention_dropout', -1)}: "
            f"{row['achieved_tflops'] / ceiling:.3f} of the measured ceiling",
            flush=True,
        )


if __name__ == "__main__":
    main()
