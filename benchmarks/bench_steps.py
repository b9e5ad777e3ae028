r"""Train-step speed and memory of every method (measured, never asserted).

For each method and model size this runs, in a fresh subprocess, the method's
first-phase train step (e.g. MoDDiffy-par: task step + one adversarial diff
step per attribute) on synthetic batches and reports compile time, median
steady-state step time, steps/s, examples/s and the process's peak RSS.

    python benchmarks/bench_steps.py --models tiny,minilm --batch 32 --length 32
    python benchmarks/bench_steps.py --methods moddiffy_par --models minilm --steps 10

``--models bert-base`` builds BERT-base shapes with random weights (for GPUs;
no download is needed). Results are printed as a Markdown table and appended
as JSON lines to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys
import time

# Methods that need another run's outputs beyond a core (a mask run).
NEEDS_OTHER_RUNS = ("srnets_retrain",)


def default_methods() -> tuple[str, ...]:
    """Every registered method that runs the step loop (FFW has its own driver)."""
    from moddiffy_jax.methods import registry

    return tuple(
        name
        for name, m in sorted(registry.METHODS.items())
        if m.driver is None and name not in NEEDS_OTHER_RUNS
    )


def _core_run(ctx) -> str:
    """A temporary finetune-run directory holding the pretrained encoder and a
    fresh head: the frozen core of post-hoc methods (same shapes, same step)."""
    import tempfile

    import jax

    from moddiffy_jax import checkpoints

    d = tempfile.mkdtemp(prefix="core_run_")
    export = os.path.join(d, "export")
    head = ctx.model.init_task_head(jax.random.PRNGKey(0))
    checkpoints.save_params(os.path.join(export, "core.safetensors"), ctx.pretrained)
    checkpoints.save_params(os.path.join(export, "task_head.safetensors"), head)
    # A finished run's export carries its manifest (read back on load).
    from pathlib import Path

    from moddiffy_jax import manifest
    from moddiffy_jax.subnets import sparse_diff

    manifest.write_manifest(
        Path(export), fingerprint=sparse_diff.fingerprint(ctx.pretrained)
    )
    return d


def _minilm_dir():
    from moddiffy_jax.models import bert

    return bert.resolve_model_dir(None)


def _bert_base_dir() -> str:
    """A directory with only a BERT-base config.json (random weights)."""
    import tempfile

    d = tempfile.mkdtemp(prefix="bert_base_")
    cfg = {
        "model_type": "bert",
        "vocab_size": 30522,
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "intermediate_size": 3072,
        "hidden_act": "gelu",
        "max_position_embeddings": 512,
        "type_vocab_size": 2,
    }
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


def run_one(
    method: str,
    model: str,
    batch: int,
    length: int,
    steps: int,
    dtype: str,
    objective: str = "",
    step_jit: str = "step",
    trace_dir: str | None = None,
    scan_layers: bool = False,
    attention: str = "xla",
    attention_dropout: float = -1.0,
    compiler_options: dict | None = None,
):
    """Measures one configuration in this process; returns a dict.

    With ``trace_dir``, three more steps run under ``jax.profiler.trace``
    after the timed ones (a Perfetto trace there; see trace_summary.py).

    ``objective`` (methods that remove an attribute only): "adversarial" for
    the paper's (and the reference code's) removal step, "mmd" or "" for the
    library's default recipe. ``attention`` and ``attention_dropout`` are
    ``config.model``'s (the kernel; a negative dropout keeps the model's).
    ``compiler_options``: XLA DebugOptions fields for the step's compile
    (``jax.jit(..., compiler_options=...)``; some, such as
    ``xla_gpu_command_buffer_update_mode``, are not ``XLA_FLAGS`` flags).
    """
    import jax

    from moddiffy_jax import train
    from moddiffy_jax.config_lib import experiment_config
    from moddiffy_jax.methods import common, registry

    arg = "data=synthetic"
    if objective and registry.get_method(method).debias != "none":
        arg += f",objective={objective}"
    config = experiment_config(method, arg)
    with config.unlocked():
        config.train.batch_size = batch
        config.data.max_length = length
        config.data.trim_padding = False  # the shape asked for, padding and all
        config.model.dtype = dtype
        config.train.step_jit = step_jit
        config.model.scan_layers = scan_layers
        config.model.attention = attention
        config.model.attention_dropout = attention_dropout
        config.data.synthetic.num_train = max(4 * batch, 256)
        if model == "tiny":
            config.model.init = "random"
        elif model == "bert-base":
            config.model.init = "random"
            config.model.dir = _bert_base_dir()
            config.model.tokenizer_dir = str(_minilm_dir())
    ctx = train.build_context(config)
    try:
        trainable, frozen = ctx.method.init(ctx, jax.random.PRNGKey(0))
    except ValueError as e:  # a post-hoc method: give it a core run
        if "core_run" not in str(e):
            raise
        with config.unlocked():
            config.method.core_run = _core_run(ctx)
        ctx = train.build_context(config)
        trainable, frozen = ctx.method.init(ctx, jax.random.PRNGKey(0))
    phase = ctx.method.phases_of(config)[0]
    substeps = ctx.method.substeps(ctx, phase, trainable)
    state = common.TrainState(
        step=common.jnp_zero_step(),
        trainable=trainable,
        opt_states=common.init_opt_states(substeps, trainable),
    )
    from moddiffy_jax.data import TrainIterator

    it = TrainIterator(ctx.data.splits["train"], batch_size=batch, seed=0)
    if compiler_options:
        step = jax.jit(
            common.make_train_step(substeps),
            donate_argnums=(0,),
            compiler_options=compiler_options,
        )
    else:
        step = train.compile_step(config, substeps)
    rng = jax.random.PRNGKey(1)
    t0 = time.perf_counter()
    state, metrics = step(state, frozen, next(it), rng)
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - t0
    row = {
        "method": method,
        "model": model,
        "batch": batch,
        "length": length,
        "dtype": dtype,
        "objective": str(config.method.get("objective", "")),
        "step_jit": step_jit,
        "scan_layers": scan_layers,
        "attention": attention,
        "attention_dropout": attention_dropout,
        "compiler_options": compiler_options or {},
        "substeps": [s.name for s in substeps],
        "compile_s": round(compile_s, 2),
        # Set when other processes compiled at the same time (device_turn).
        "compiled_beside": os.environ.get("BENCH_TURN", ""),
    }
    with device_turn():
        return row | _timed(ctx, config, step, state, frozen, it, rng, steps, trace_dir)


@contextlib.contextmanager
def device_turn():
    """Waits for this process's turn on a device shared with others.

    With ``BENCH_TURN=DIR,N`` (gpu_lease.sh's PAIR: N processes compile at
    once, each its own variant), a process that has compiled marks it in DIR
    and waits until all N have (or 300 s), so no timed step runs beside
    another's compile on the host; then the processes time their steps one
    at a time under a lock in DIR (which starts empty: marks left from an
    earlier call would count). Without it, nothing waits.
    """
    spec = os.environ.get("BENCH_TURN", "")
    if not spec:
        yield
        return
    import fcntl

    folder, n = spec.rsplit(",", 1)
    os.makedirs(folder, exist_ok=True)
    open(os.path.join(folder, f"compiled.{os.getpid()}"), "w").close()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if sum(f.startswith("compiled.") for f in os.listdir(folder)) >= int(n):
            break
        time.sleep(1)
    with open(os.path.join(folder, "lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _timed(ctx, config, step, state, frozen, it, rng, steps, trace_dir) -> dict:
    """The timed steps of :func:`run_one`, after its compile."""
    import resource

    import jax
    import numpy as np

    times = []
    for _ in range(steps):
        b = next(it)
        t = time.perf_counter()
        state, metrics = step(state, frozen, b, rng)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t)
    median = float(np.median(times))
    # The same steps dispatched back to back, as the training loop does (it
    # reads metrics only every log_every steps): the host prepares the next
    # batch while the device runs, so per-step host gaps drop out.
    t = time.perf_counter()
    for _ in range(steps):
        state, metrics = step(state, frozen, next(it), rng)
    jax.block_until_ready((state, metrics))
    pipelined = (time.perf_counter() - t) / steps
    if trace_dir:
        # Traced as the training loop runs: three steps dispatched back to
        # back, then one wait (stop 47's blocking trace could not say what
        # holds a pipelined step back).
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(3):
                state, metrics = step(state, frozen, next(it), rng)
            jax.block_until_ready((state, metrics))
    n_params = sum(int(np.size(x)) for x in jax.tree.leaves(ctx.pretrained))
    return {
        "params": n_params,
        "step_s_median": round(median, 4),
        "step_s_min": round(float(np.min(times)), 4),
        "step_s_pipelined": round(pipelined, 4),
        "steps_per_s": round(1.0 / median, 3),
        "examples_per_s": round(config.train.batch_size / median, 1),
        "peak_rss_gib": round(
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2
        ),
        "device": str(jax.devices()[0].device_kind),
        "num_devices": jax.device_count(),
    }


def stamp_and_machine() -> tuple[str, str]:
    """The UTC time (seconds) and a one-line description of this machine."""
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    cpu = platform.processor() or platform.machine()
    return stamp, f"{platform.node()} {cpu}, {os.cpu_count()} cores"


def append_jsonl(path: str, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def measure(
    method: str,
    model: str,
    batch: int,
    length: int,
    steps: int,
    dtype: str = "float32",
    objective: str = "",
    step_jit: str = "step",
    scan_layers: bool = False,
) -> dict | None:
    """:func:`run_one` in a fresh subprocess (its own compile cache and peak
    RSS); None, with the subprocess's error on stderr, if it failed."""
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--one",
        "--methods",
        method,
        "--models",
        model,
        "--batch",
        str(batch),
        "--length",
        str(length),
        "--steps",
        str(steps),
        "--dtype",
        dtype,
        "--objective",
        objective,
        "--step-jit",
        step_jit,
    ] + (["--scan_layers"] if scan_layers else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        print(f"{method}/{model} failed:\n{out.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(line[7:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", default="")
    parser.add_argument("--models", default="tiny,minilm")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--objective",
        default="",
        help="removal objective of debiasing methods (adversarial: the paper's)",
    )
    parser.add_argument(
        "--step-jit",
        default="step",
        help="config.train.step_jit: step (one program) or substeps",
    )
    parser.add_argument(
        "--scan_layers",
        action="store_true",
        help="config.model.scan_layers: the encoder's layers under lax.scan",
    )
    parser.add_argument("--out", default="benchmarks/results.jsonl")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        result = run_one(
            args.methods,
            args.models,
            args.batch,
            args.length,
            args.steps,
            args.dtype,
            args.objective,
            args.step_jit,
            scan_layers=args.scan_layers,
        )
        print("RESULT " + json.dumps(result))
        return
    methods = args.methods or ",".join(default_methods())
    rows = []
    stamp, machine = stamp_and_machine()
    for model in args.models.split(","):
        for method in methods.split(","):
            result = measure(
                method,
                model,
                args.batch,
                args.length,
                args.steps,
                args.dtype,
                args.objective,
                args.step_jit,
                args.scan_layers,
            )
            if result is None:
                continue
            row = result | {"date": stamp, "machine": machine}
            rows.append(row)
            append_jsonl(args.out, row)
            print(
                f"{method:16s} {model:7s} compile {row['compile_s']:7.1f}s  "
                f"step {row['step_s_median']:.3f}s  {row['examples_per_s']:7.1f} ex/s  "
                f"rss {row['peak_rss_gib']:.2f} GiB",
                flush=True,
            )
    print(f"\n{machine}, {stamp}\n")
    print(
        "| method | model | sub-steps | compile (s) | step (s, median) | steps/s | examples/s | peak RSS (GiB) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['method']} | {r['model']} | {len(r['substeps'])} | {r['compile_s']} | "
            f"{r['step_s_median']} | {r['steps_per_s']} | {r['examples_per_s']} | {r['peak_rss_gib']} |"
        )


if __name__ == "__main__":
    main()
