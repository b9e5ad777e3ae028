r"""Command line: ``python -m moddiffy_jax.main --config=configs/X.py --workdir=DIR``.

The only module with flags. ``--config`` is an ml_collections config file
(``path/to/file.py[:arg]``); fields can be overridden with
``--config.train.l0_steps=50``. Re-running the same command resumes from the
last checkpoint in ``--workdir``.
"""

from __future__ import annotations

import ast
import json
import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from absl import app, flags, logging
from ml_collections import config_flags


def define_flags(fv: flags.FlagValues, argv: list[str] | None = None) -> None:
    """Defines the command line's flags on ``fv`` (``argv``: where the config
    flag reads its ``--config.<key>`` overrides; default ``sys.argv``)."""
    config_flags.DEFINE_config_file(
        "config",
        None,
        "Experiment config file.",
        flag_values=fv,
        lock_config=True,
        sys_argv=argv,
    )
    flags.DEFINE_string(
        "workdir",
        None,
        "Run directory (created; resumed if it exists).",
        flag_values=fv,
    )
    flags.DEFINE_bool(
        "distributed",
        False,
        "Call jax.distributed.initialize() first (multi-host GPU / TPU pod slices).",
        flag_values=fv,
    )
    flags.DEFINE_string(
        "coordinator_address",
        None,
        "With --distributed: host:port of process 0's coordinator (omit where "
        "JAX detects the cluster: TPU pods, SLURM, Open MPI).",
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "num_processes",
        None,
        "With --distributed: the number of processes.",
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "process_id",
        None,
        "With --distributed: this process's index, 0 .. num_processes - 1.",
        flag_values=fv,
    )
    flags.DEFINE_string(
        "compilation_cache",
        None,
        "Directory of JAX's persistent compilation cache, so that a resumed or "
        "repeated run loads its compiled steps instead of compiling them again "
        "(default: $JAX_COMPILATION_CACHE_DIR, else $XDG_CACHE_HOME/moddiffy_jax/"
        "jax or ~/.cache/moddiffy_jax/jax; '' turns it off).",
        flag_values=fv,
    )
    flags.DEFINE_bool(
        "break_lock",
        False,
        "Take over the run directory's lock left by a process on another host.",
        flag_values=fv,
    )
    flags.DEFINE_bool(
        "allow_changed_inputs",
        False,
        "Resume although the base model, tokenizer or data changed since the run "
        "started (a warning instead of an error).",
        flag_values=fv,
    )
    flags.DEFINE_bool(
        "debug",
        False,
        "Show the Python traceback of an error in the input.",
        flag_values=fv,
    )
    flags.mark_flags_as_required(["config", "workdir"], flag_values=fv)


FLAGS = flags.FLAGS
define_flags(FLAGS)


# Errors in what the user gave (config, data, files, run directory): one
# message naming the problem and the fix, exit status 2, no traceback unless
# --debug. Anything else is a bug and keeps its traceback.
def user_errors() -> tuple[type[BaseException], ...]:
    from moddiffy_jax.workdir import RunLocked

    return (ValueError, OSError, RunLocked, FloatingPointError)


def _time_split(results: Mapping[str, Any]) -> str:
    """Where the wall time went (results "timings", runs since stop 61):
    " (setup 8 s, training 500 s (its first steps, which compile: 95 s),
    export and table 77 s, report 300 s)"; empty for older runs."""
    timings = results.get("timings")
    if not timings:
        return ""
    phases = timings.get("phases", {}).values()
    parts = [f"setup {timings['setup_s']:.0f} s"]
    if phases:
        steps = sum(p.get("seconds", 0.0) for p in phases)
        compiling = sum(p.get("first_step_s", 0.0) for p in phases)
        parts.append(
            f"training {steps:.0f} s (its first steps, which compile: "
            f"{compiling:.0f} s)"
        )
    if "export_and_table_s" in timings:
        parts.append(f"export and table {timings['export_and_table_s']:.0f} s")
    if "report_s" in timings:
        parts.append(f"report {timings['report_s']:.0f} s")
    return " (" + ", ".join(parts) + ")"


def format_results(results: dict) -> str:
    """A plain-text table of a run's final results."""
    lines = []
    synthetic = " (SYNTHETIC data)" if results.get("synthetic") else ""
    lines.append(f"method {results['method']} on {results['dataset']}{synthetic}")
    if "objective_choice" in results:
        from moddiffy_jax.eval.report import objective_line

        lines.append(objective_line(results["objective_choice"]))
    if "task_guard" in results:
        from moddiffy_jax.eval.report import guard_line

        lines.append(guard_line(results["task_guard"]))
    if "composition" not in results:  # FFW on images: its own before/after table
        lines += format_ffw(results)
        if "wall_time_s" in results:
            lines.append(f"wall time: {results['wall_time_s']:.0f} s")
        return "\n".join(lines)
    rows = results["composition"]
    leakage = results.get("leakage", {})
    attrs = results.get("attributes", []) if leakage else []
    cols = sorted({k for r in rows.values() for k in r})
    labels = list(rows) + [k for k in leakage if k not in rows]
    width = max(len(r) for r in labels) + 2
    head = [c.rjust(14) for c in cols]
    has_mlp = any(
        "mlp" in (row.get(a) or {}) for row in leakage.values() for a in attrs
    )
    for a in attrs:
        head += [f"{a} leakage".rjust(18), f"{a} lin".rjust(12)]
        head += [f"{a} mlp".rjust(12)] * has_mlp
    lines.append("configuration".ljust(width) + "  ".join(head))
    for label in labels:
        cells = [
            f"{rows[label][c]:14.4f}" if label in rows else "-".rjust(14) for c in cols
        ]
        for a in attrs:
            leak = leakage.get(label, {}).get(a)
            cells.append(_leak(leak).rjust(18))
            for kind in ("linear", "mlp")[: 1 + has_mlp]:
                value = (leak or {}).get(kind, {}).get("test_balanced_accuracy")
                cells.append((f"{value:.3f}" if value is not None else "n/a").rjust(12))
        lines.append(label.ljust(width) + "  ".join(cells))
    floors = results.get("floors", {})
    for what in ("floor", "chance") if floors else ():
        cells = ["".rjust(14)] * len(cols)
        for a in attrs:
            value = f"{floors[a][what]:.3f}" if a in floors else "n/a"
            cells += [value.rjust(18)] + [value.rjust(12)] * (1 + has_mlp)
        lines.append(f"({what})".ljust(width) + "  ".join(cells))
    from moddiffy_jax.eval.report import task_lost

    core_acc = rows.get("core", {}).get("test_task_acc")
    for label, row in rows.items():
        lost = task_lost(core_acc, row.get("test_task_acc"))
        if lost is not None and label != "core":
            lines.append(
                f"task lost: {label} reads {lost:.1f} points of test accuracy under "
                "the core; its leakage says nothing about removal"
            )
    if leakage:
        # Results written before stop 23 have no "probe_whiten": standardized.
        metric = (
            "whitened with the train split's covariance"
            if results.get("probe_whiten", False)
            else "standardized per feature"
        )
        lines.append(
            "leakage: test balanced accuracy of fresh attacker probe ensembles on "
            f"frozen CLS representations, {metric} "
            + (
                "(one probe seed: one ensemble; "
                if len(results.get("probe_seeds", (0, 1))) == 1
                else "(mean ± std over probe seeds; "
            )
            + "lin: a class-balanced linear probe; "
            + ("mlp: an MLP probe trained to convergence; " if has_mlp else "")
            + "lower is better). floor: what the gold task "
            "label alone gives; INLP rows use the task head on projected "
            "representations"
            + (
                "; core decision: the core head's logits probed (what its own "
                "decision carries); core+bottleneck: the CLS vector cut to the "
                "few coordinates the head reads most, with a refit head (keeps "
                "only the task; a baseline)"
                if "core decision" in leakage
                else ""
            )
            + (
                "; core+discriminant(a): the CLS vector projected onto the "
                "task's discriminant directions, penalized for attribute a "
                "inside each task class (written into a sparse diff of the "
                "last layer where the model allows: eval/report.md says)"
                if any(k.startswith("core+discriminant(") for k in leakage)
                else ""
            )
        )
    chosen = results.get("selected", {})
    if chosen.get("scope") == "diff":  # train.select_scope="diff"
        steps = ", ".join(
            f"{a} at step {d['step']} ({d['row']} dev {d['score']:.4f})"
            for a, d in chosen["diffs"].items()
        )
        lines.append(f"best dev, each diff on its own: {steps}")
    for name, info in results.get("diffs", {}).items():
        lines.append(
            f"diff {name}: {info['nnz']:,} of {info['num_selected']:,} entries kept "
            f"({100 * info['density']:.3f}%), file {info['file_bytes'] / 1e6:.2f} MB"
        )
    lines.append(f"core params: {results['core_params']:,}")
    if "wall_time_s" in results:
        lines.append(f"wall time: {results['wall_time_s']:.0f} s{_time_split(results)}")
    if "eval_report" in results:
        lines.append(f"full report: {results['eval_report']}")
    return "\n".join(lines)


def format_ffw(results: dict) -> list[str]:
    """FFW's rows: the vanilla model, the soft-gated net at the last gate
    epoch's temperature, and the hard prunings (final, best intermediate)."""
    rows = [("vanilla", results.get("vanilla"))]
    soft = results.get("final_soft")
    if soft:
        rows.append((f"soft gates (T={soft['temperature']:.0e})", soft))
    rows += [
        ("pruned (final gates)", results.get("final")),
        ("pruned (best intermediate)", results.get("best_intermediate")),
    ]
    attrs = results.get("attributes", [])
    width = max(len(label) for label, _ in rows) + 2
    cols = ["test acc", "unbiased", "conflicting", "bias acc", "MI", "pruned"]
    lines = ["configuration".ljust(width) + "".join(c.rjust(13) for c in cols)]
    for label, entry in rows:
        if not entry:
            continue
        test = entry["eval"].get("test", {})

        def mean_of(suffix, test=test):
            vals = [test[f"{a}/{suffix}"] for a in attrs if f"{a}/{suffix}" in test]
            return sum(vals) / len(vals) if vals else None

        leak = entry.get("leakage", {})
        cells = [
            test.get("accuracy"),
            mean_of("unbiased_accuracy"),
            mean_of("conflicting_accuracy"),
            leak.get("mean_bias_acc"),
            leak.get("mean_mi"),
            entry.get("pruned_fraction", 0.0 if label == "vanilla" else None),
        ]
        lines.append(
            label.ljust(width)
            + "".join(("-" if v is None else f"{v:.3f}").rjust(13) for v in cells)
        )
    lines.append(
        "test acc: accuracy on the test split; unbiased / conflicting: mean "
        "accuracy over (task, bias) groups / on bias-conflicting examples; bias "
        "acc and MI: a bias head trained afresh on each network, on gate-val "
        f"(vanilla: PH0). Stopped: {results.get('stop_reason')} after "
        f"{results.get('num_gate_epochs')} gate epochs."
    )
    tolerance = results.get("best_task_tolerance", -1.0)
    if results.get("best_intermediate") is None and results.get("temperature_decays"):
        if tolerance is not None and tolerance >= 0:
            lines.append(
                "No best intermediate: no scored pruning kept the "
                f"{results.get('gate_val_split', 'validation')} task accuracy "
                f"within {tolerance:g} of the vanilla model's "
                f"({results.get('vanilla_val_task_acc', float('nan')):.3f}); "
                "config.ffw.best_task_tolerance."
            )
    return lines


def _leak(entry) -> str:
    mean = (entry or {}).get("mean")
    if mean is None or math.isnan(mean):
        return "n/a"
    std = entry.get("std")
    has_std = std is not None and not math.isnan(std)
    return f"{mean:.3f}" + (f" ± {std:.3f}" if has_std else "")


def _load_config_module(spec: str):
    """The config of ``--config=path[:arg]`` without overrides, or None."""
    import importlib.util

    path, _, arg = spec.partition(":")
    try:
        module_spec = importlib.util.spec_from_file_location("_user_config", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        return module.get_config(arg) if arg else module.get_config()
    except Exception:  # noqa: BLE001 - only used to explain another error
        return None


# Config maps keyed by attribute names: the command line sets them whole.
_NAME_MAPS = (
    "data.attr_classes",
    "data.attr_label_files",
    "data.attr_bins",
    "data.columns.attributes",
    "data.synthetic.attr_task_correlation",
)


def explain_flag_error(argv: list[str], error: Exception) -> str:
    """A message for a flag or config that failed to parse, naming the fix."""
    specs = [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    if specs and not Path(specs[-1].partition(":")[0]).is_file():
        return (
            f"--config={specs[-1]}: no such config file. The configs are in "
            "configs/ (e.g. --config=configs/moddiffy_par.py)."
        )
    base = _load_config_module(specs[-1]) if specs else None
    if base is not None:
        for a in argv:
            if not a.startswith("--config."):
                continue
            key = a[len("--config.") :].split("=", 1)[0]
            node = base
            parts = key.split(".")
            for i, part in enumerate(parts):
                if not hasattr(node, "keys") or part not in node:
                    where = ".".join(["config", *parts[:i]])
                    if ".".join(parts[:i]) in _NAME_MAPS:
                        value = a.split("=", 1)[1] if "=" in a else "..."
                        try:
                            ast.literal_eval(value)
                        except (ValueError, SyntaxError):
                            value = repr(value)  # a bare word: a string
                        return (
                            f"--config.{key}: {where} is keyed by attribute "
                            "name, and a locked config takes no new key from "
                            f"the command line; set the whole map: --config."
                            f"{'.'.join(parts[:i])}=\"{{'{part}': {value}}}\"."
                        )
                    valid = sorted(node.keys()) if hasattr(node, "keys") else []
                    return (
                        f"--config.{key}: {where} has no field {part!r}. The config "
                        f"is locked, so a misspelled key is an error; fields of "
                        f"{where}: {', '.join(valid)}."
                    )
                node = node[part]
    text = str(error)
    if "Traceback (most recent call last)" in text:  # a get_config error, wrapped
        last = [line for line in text.splitlines() if line.strip()][-1]
        text = f"the config file failed: {last}"
    return (
        f"{text} (in the flags or the config; check --config=FILE[:key=value,...] "
        "and each --config.<key>=<value>; --debug shows the traceback)"
    )


def parse_flags(argv: list[str], fv: flags.FlagValues = FLAGS) -> list[str]:
    """``app.run``'s flag parser: a bad flag or config is one line, exit 2."""
    try:
        rest = fv(argv)
        fv.config.keys()  # a config file that failed to load raises here
        return rest
    except Exception as e:  # noqa: BLE001 - every parse failure is the user's input
        if "--debug" in argv:
            raise
        print(f"error: {explain_flag_error(argv, e)}", file=sys.stderr)
        sys.exit(2)


_CACHE_MAX_BYTES = 2 << 30


def compilation_cache_dir(flag: str | None, env=None) -> str:
    """The persistent compilation cache directory ('' for none): the flag,
    else ``JAX_COMPILATION_CACHE_DIR``, else the user cache directory."""
    import os

    env = os.environ if env is None else env
    if flag is not None:
        return flag
    if env.get("JAX_COMPILATION_CACHE_DIR"):
        return env["JAX_COMPILATION_CACHE_DIR"]
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "moddiffy_jax", "jax")


def keep_command_line_swaps(fv: flags.FlagValues) -> None:
    """Names in ``config.method.auto_keep`` the swap recipe's fields that
    ``--config.<field>=`` set, so ``objective=auto`` keeps them as set
    (config_lib.swap_preset), also where the value equals the default."""
    config = fv.config
    if "auto_keep" not in config.get("method", {}):
        return
    from moddiffy_jax import config_lib

    given = config_flags.get_override_values(fv["config"])
    kept = [f for f in config_lib.SWAP_PRESET_FIELDS if f in given]
    if kept and "method.auto_keep" not in given:
        config.method.auto_keep = ",".join(kept)


def run(fv: flags.FlagValues = FLAGS) -> int:
    """Trains and evaluates from the parsed flags; returns the exit status."""
    keep_command_line_swaps(fv)
    if "verbosity" not in FLAGS or not FLAGS["verbosity"].present:
        # Orbax and JAX log every checkpoint at INFO; -v 0 brings them back.
        logging.set_verbosity(logging.WARNING)
    import jax

    if fv.distributed:
        jax.distributed.initialize(
            coordinator_address=fv.coordinator_address,
            num_processes=fv.num_processes,
            process_id=fv.process_id,
        )
    from moddiffy_jax import train

    cache = compilation_cache_dir(fv.compilation_cache)
    if cache and jax.config.values.get("jax_compilation_cache_dir") != cache:
        jax.config.update("jax_compilation_cache_dir", cache)
        if jax.config.values.get("jax_compilation_cache_max_size", -1) < 0:
            jax.config.update("jax_compilation_cache_max_size", _CACHE_MAX_BYTES)
    logging.info("JAX devices: %s", jax.devices())
    try:
        results = train.train_and_evaluate(
            fv.config,
            fv.workdir,
            break_lock=fv.break_lock,
            allow_changed_inputs=fv.allow_changed_inputs,
        )
    except train.Preempted as e:
        print(f"{e} (--workdir={fv.workdir})")
        return 0
    except Exception as e:
        if fv.debug or not isinstance(e, user_errors()):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1 if isinstance(e, FloatingPointError) else 2
    if jax.process_index() == 0:
        print(format_results(results))
        logging.info("results: %s", json.dumps(results, indent=2))
        print(f"results: {fv.workdir}/results.json")
    return 0


def cli(argv: list[str]) -> int:
    """The command line in this process (tests, notebooks): ``argv`` without
    the program name; fresh flags each call. Returns the exit status."""
    argv = ["moddiffy_jax.main", *argv]
    fv = flags.FlagValues()
    define_flags(fv, argv)
    try:
        parse_flags(argv, fv)
    except SystemExit as e:
        return int(e.code or 0)
    return run(fv)


def main(argv):
    del argv
    return run()


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
