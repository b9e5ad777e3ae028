r"""Command line: ``python -m moddiffy_jax.main --config=configs/X.py --workdir=DIR``.

The only module with flags. ``--config`` is an ml_collections config file
(``path/to/file.py[:arg]``); fields can be overridden with
``--config.train.l0_steps=50``. Re-running the same command resumes from the
last checkpoint in ``--workdir``.
"""

from __future__ import annotations

import json
import math

from absl import app, flags, logging
from ml_collections import config_flags

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
    "config", None, "Experiment config file.", lock_config=True
)
flags.DEFINE_string("workdir", None, "Run directory (created; resumed if it exists).")
flags.DEFINE_bool(
    "distributed",
    False,
    "Call jax.distributed.initialize() first (multi-host GPU / TPU pod slices).",
)
flags.mark_flags_as_required(["config", "workdir"])


def format_results(results: dict) -> str:
    """A plain-text table of a run's final results."""
    lines = []
    synthetic = " (SYNTHETIC data)" if results.get("synthetic") else ""
    lines.append(f"method {results['method']} on {results['dataset']}{synthetic}")
    rows = results["composition"]
    leakage = results.get("leakage", {})
    attrs = results.get("attributes", []) if leakage else []
    cols = sorted({k for r in rows.values() for k in r})
    labels = list(rows) + [k for k in leakage if k not in rows]
    width = max(len(r) for r in labels) + 2
    head = [c.rjust(14) for c in cols]
    for a in attrs:
        head += [f"{a} leakage".rjust(18), f"{a} lin".rjust(12)]
    lines.append("configuration".ljust(width) + "  ".join(head))
    for label in labels:
        cells = [
            f"{rows[label][c]:14.4f}" if label in rows else "-".rjust(14) for c in cols
        ]
        for a in attrs:
            leak = leakage.get(label, {}).get(a)
            cells.append(_leak(leak).rjust(18))
            lin = (leak or {}).get("linear", {}).get("test_balanced_accuracy")
            cells.append((f"{lin:.3f}" if lin is not None else "n/a").rjust(12))
        lines.append(label.ljust(width) + "  ".join(cells))
    floors = results.get("floors", {})
    for what in ("floor", "chance") if floors else ():
        cells = ["".rjust(14)] * len(cols)
        for a in attrs:
            value = f"{floors[a][what]:.3f}" if a in floors else "n/a"
            cells += [value.rjust(18), value.rjust(12)]
        lines.append(f"({what})".ljust(width) + "  ".join(cells))
    if leakage:
        lines.append(
            "leakage: test balanced accuracy of fresh attacker probe ensembles on "
            "frozen CLS representations (mean ± std over probe seeds; lin: a "
            "class-balanced linear probe; lower is better). floor: what the gold task "
            "label alone gives; INLP rows use the task head on projected "
            "representations"
        )
    for name, info in results.get("diffs", {}).items():
        lines.append(
            f"diff {name}: {info['nnz']:,} of {info['num_selected']:,} entries kept "
            f"({100 * info['density']:.3f}%), file {info['file_bytes'] / 1e6:.2f} MB"
        )
    lines.append(f"core params: {results['core_params']:,}")
    if "wall_time_s" in results:
        lines.append(f"wall time: {results['wall_time_s']:.0f} s")
    if "eval_report" in results:
        lines.append(f"full report: {results['eval_report']}")
    return "\n".join(lines)


def _leak(entry) -> str:
    mean = (entry or {}).get("mean")
    if mean is None or math.isnan(mean):
        return "n/a"
    std = entry.get("std")
    has_std = std is not None and not math.isnan(std)
    return f"{mean:.3f}" + (f" ± {std:.3f}" if has_std else "")


def main(argv):
    del argv
    if not FLAGS["verbosity"].present:
        # Orbax and JAX log every checkpoint at INFO; -v 0 brings them back.
        logging.set_verbosity(logging.WARNING)
    import jax

    if FLAGS.distributed:
        jax.distributed.initialize()
    from moddiffy_jax import train

    logging.info("JAX devices: %s", jax.devices())
    results = train.train_and_evaluate(FLAGS.config, FLAGS.workdir)
    if jax.process_index() == 0:
        print(format_results(results))
        logging.info("results: %s", json.dumps(results, indent=2))
        print(f"results: {FLAGS.workdir}/results.json")


if __name__ == "__main__":
    app.run(main)
