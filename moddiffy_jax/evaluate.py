r"""``python -m moddiffy_jax.evaluate --workdir=DIR``: the composition matrix of a run.

Reads only the run directory (config, exported core, head and diffs), so it
works on runs trained elsewhere. Writes ``DIR/eval/results.json`` and
``DIR/eval/report.md`` and prints the report. Examples::

    python -m moddiffy_jax.evaluate --workdir=runs/moddiffy_par
    python -m moddiffy_jax.evaluate --workdir=runs/par --weight=gender=0.5 \
        --seeds=0,1,2,3,4
    python -m moddiffy_jax.evaluate --aggregate runs/par_s0 runs/par_s1 runs/par_s2

``--aggregate`` reads the evaluated runs of one experiment (different training
seeds), given as the positional arguments, and prints mean ± std over runs
per configuration. Flags are absl flags, as for ``moddiffy_jax.main``
(``--noinlp``, ``--nolinear``, ``--notask_only``, ``--nodiscriminant`` turn
the INLP rows, the linear probes, the task-only reference rows and the
discriminant rows off).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from absl import flags

FLAGS = flags.FlagValues()
flags.DEFINE_string("workdir", None, "Run directory to evaluate.", flag_values=FLAGS)
flags.DEFINE_bool(
    "aggregate",
    False,
    "Aggregate the evaluated runs given as positional arguments.",
    flag_values=FLAGS,
)
flags.DEFINE_multi_string(
    "weight", [], "NAME=VALUE: the weight of one diff (repeat).", flag_values=FLAGS
)
flags.DEFINE_list("seeds", ["0", "1", "2"], "Probe seeds.", flag_values=FLAGS)
flags.DEFINE_integer("max_epochs", 40, "Probe epochs.", flag_values=FLAGS)
flags.DEFINE_integer(
    "probe_threads",
    2,
    "Probe ensembles trained at once on worker threads while the next rows "
    "are encoded (the same numbers; faster on 2 or more cores).",
    flag_values=FLAGS,
)
flags.DEFINE_bool(
    "whiten",
    True,
    "Attackers read the representations whitened with the train split's "
    "covariance (--nowhiten: standardized per feature, as before stop 23).",
    flag_values=FLAGS,
)
flags.DEFINE_integer(
    "max_subset_size", None, "Largest number of diffs combined.", flag_values=FLAGS
)
flags.DEFINE_bool("inlp", True, "Add the INLP rows.", flag_values=FLAGS)
flags.DEFINE_bool(
    "task_only",
    True,
    "Add the task-only reference rows: the core's decision (its head's logits "
    "probed) and the smallest task bottleneck (eval/bottleneck.py).",
    flag_values=FLAGS,
)
flags.DEFINE_bool(
    "bottleneck",
    None,
    "With the task-only rows, add the task bottleneck's row (--nobottleneck: "
    "the core's decision alone). Default: the run's "
    "config.eval.task_only.bottleneck, else on.",
    flag_values=FLAGS,
)
flags.DEFINE_float(
    "task_only_max_drop",
    None,
    "Points of dev accuracy the task bottleneck may give up; default: the "
    "run's config.eval.task_only.max_drop, else 0.5.",
    flag_values=FLAGS,
)
flags.DEFINE_bool(
    "discriminant",
    True,
    "Add the rows core+discriminant(<attribute>) (and all attributes together): "
    "the core's representation projected onto its attribute-penalized task "
    "discriminant (eval/discriminant.py).",
    flag_values=FLAGS,
)
flags.DEFINE_float(
    "discriminant_max_drop",
    None,
    "Points of dev accuracy the discriminant may give up; default: the run's "
    "config.eval.discriminant.max_drop, else 0.5.",
    flag_values=FLAGS,
)
flags.DEFINE_bool(
    "discriminant_weights",
    None,
    "Write each discriminant into a sparse diff of the core's last layer and "
    "read the encoder with it added (eval/discriminant_diff.py); "
    "--nodiscriminant_weights: the projection of the core's vectors. "
    "Default: the run's config.eval.discriminant.weights, else 'auto' (the "
    "diff where the model allows it).",
    flag_values=FLAGS,
)
flags.DEFINE_bool(
    "token_merge",
    False,
    "Build a token-merge diff per attribute on the core (written to "
    "WORKDIR/token_merge/) and add its rows.",
    flag_values=FLAGS,
)
flags.DEFINE_float(
    "token_merge_max_drop",
    None,
    "Task points a token merge may cost (read on train and dev); default: "
    "the run's config.eval.token_merge.max_drop.",
    flag_values=FLAGS,
)
flags.DEFINE_float(
    "token_merge_target",
    None,
    "Share of the gap between the core's dev leakage and the floor a token "
    "merge closes before it stops merging more (1: on to the floor); "
    "default: the run's config.eval.token_merge.target.",
    flag_values=FLAGS,
)
flags.DEFINE_bool(
    "strength",
    False,
    "Choose each attribute diff's weight on train and dev "
    "(moddiffy_jax.methods.strength) and evaluate with it.",
    flag_values=FLAGS,
)
flags.DEFINE_float(
    "strength_max_drop",
    None,
    "Task points a diff's weight may cost (read on train and dev); default: "
    "the run's config.eval.strength.max_drop.",
    flag_values=FLAGS,
)
flags.DEFINE_bool(
    "linear", True, "Add a linear probe to every entry.", flag_values=FLAGS
)
flags.DEFINE_bool(
    "mlp",
    True,
    "Add a converged MLP probe to every entry (eval/probes.py CONVERGED_MLP).",
    flag_values=FLAGS,
)
flags.DEFINE_bool(
    "allow_changed_inputs",
    False,
    "Evaluate although the data, tokenizer or base model changed since training.",
    flag_values=FLAGS,
)


def _weights(items: Sequence[str]) -> dict[str, float]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--weight takes NAME=VALUE, got {item!r}")
        out[name] = float(value)
    return out


def _step_options(run_eval, name: str, **flagged) -> dict:
    """The keyword arguments of an optional evaluation step (``token_merge``,
    ``strength``): the run's own ``config.eval.<name>`` settings, so that
    re-evaluating a run builds what its end-of-run report built, with the
    flags given on the command line (not None) in their place."""
    section = run_eval.get(name) if run_eval is not None else None
    options = {k: v for k, v in (section or {}).items() if k != "enabled"}
    options.update({k: v for k, v in flagged.items() if v is not None})
    return options


def parse(argv: Sequence[str] | None, flag_values: flags.FlagValues) -> list[str]:
    """Parses ``argv`` (without the program name; default ``sys.argv[1:]``)
    into ``flag_values`` afresh; returns the positional arguments."""
    argv = sys.argv[1:] if argv is None else list(argv)
    flag_values.unparse_flags()
    return flag_values([sys.argv[0]] + argv)[1:]


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the CLI; returns the exit status (2 for a bad run or flag)."""
    try:
        runs = parse(argv, FLAGS)
        weights = _weights(FLAGS.weight)
    except (flags.Error, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from moddiffy_jax.eval import aggregate, composition, probes

    if FLAGS.aggregate:
        try:
            agg = aggregate.aggregate_runs(runs)
        except (FileNotFoundError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(aggregate.format_aggregate(agg))
        return 0
    if not FLAGS.workdir or runs:
        print(
            "error: give --workdir=DIR (or --aggregate RUN...); "
            f"unexpected arguments: {runs}",
            file=sys.stderr,
        )
        return 2
    try:  # the run's own settings, as its report had them
        run_eval = composition.load_run_config(FLAGS.workdir).eval
    except (FileNotFoundError, ValueError, AttributeError):
        run_eval = None  # evaluate_run says what is wrong with the run
    max_dev = run_eval.get("probe_max_dev") if run_eval is not None else None
    config = probes.ProbeConfig(
        seeds=tuple(int(s) for s in FLAGS.seeds),
        max_epochs=FLAGS.max_epochs,
        whiten=FLAGS.whiten,
        max_dev=max_dev,
        threads=FLAGS.probe_threads,
    )
    try:
        results = composition.evaluate_run(
            FLAGS.workdir,
            probe_config=config,
            weights=weights,
            max_subset_size=FLAGS.max_subset_size,
            inlp=FLAGS.inlp,
            linear=FLAGS.linear,
            mlp=FLAGS.mlp,
            allow_changed_inputs=FLAGS.allow_changed_inputs,
            token_merge=(
                _step_options(
                    run_eval,
                    "token_merge",
                    max_drop=FLAGS.token_merge_max_drop,
                    target=FLAGS.token_merge_target,
                )
                if FLAGS.token_merge
                else None
            ),
            strength=(
                _step_options(run_eval, "strength", max_drop=FLAGS.strength_max_drop)
                if FLAGS.strength
                else None
            ),
            task_only=(
                _step_options(
                    run_eval,
                    "task_only",
                    max_drop=FLAGS.task_only_max_drop,
                    bottleneck=FLAGS.bottleneck,
                )
                if FLAGS.task_only
                else None
            ),
            discriminant=(
                {
                    "weights": "auto",
                    **_step_options(
                        run_eval,
                        "discriminant",
                        max_drop=FLAGS.discriminant_max_drop,
                        weights=FLAGS.discriminant_weights,
                    ),
                }
                if FLAGS.discriminant
                else None
            ),
        )
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(composition.format_report(results))
    print(f"written: {FLAGS.workdir}/eval/results.json, {FLAGS.workdir}/eval/report.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
