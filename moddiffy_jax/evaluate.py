r"""``python -m moddiffy_jax.evaluate --workdir=DIR``: the composition matrix of a run.

Reads only the run directory (config, exported core, head and diffs), so it
works on runs trained elsewhere. Writes ``DIR/eval/results.json`` and
``DIR/eval/report.md`` and prints the report. Examples::

    python -m moddiffy_jax.evaluate --workdir=runs/moddiffy_par
    python -m moddiffy_jax.evaluate --workdir=runs/par --weight=gender=0.5 \
        --seeds=0,1,2,3,4
    python -m moddiffy_jax.evaluate --aggregate runs/par_s0 runs/par_s1 runs/par_s2

``--aggregate`` reads the evaluated runs of one experiment (different training
seeds) and prints mean ± std over runs per configuration.
"""

from __future__ import annotations

import argparse
import sys


def _weights(items):
    out = {}
    for item in items or ():
        name, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"error: --weight takes NAME=VALUE, got {item!r}")
        out[name] = float(value)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", help="run directory")
    parser.add_argument(
        "--aggregate", nargs="+", metavar="RUN", help="evaluated runs to aggregate"
    )
    parser.add_argument("--weight", action="append", help="NAME=VALUE per diff")
    parser.add_argument("--seeds", default="0,1,2", help="probe seeds")
    parser.add_argument("--max-epochs", type=int, default=40)
    parser.add_argument("--max-subset-size", type=int, default=None)
    parser.add_argument("--no-inlp", action="store_true")
    parser.add_argument("--no-linear", action="store_true")
    args = parser.parse_args(argv)

    from moddiffy_jax.eval import aggregate, composition, probes

    if args.aggregate:
        try:
            agg = aggregate.aggregate_runs(args.aggregate)
        except (FileNotFoundError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(aggregate.format_aggregate(agg))
        return 0
    if not args.workdir:
        parser.error("--workdir (or --aggregate RUN...) is required")

    config = probes.ProbeConfig(
        seeds=tuple(int(s) for s in args.seeds.split(",")), max_epochs=args.max_epochs
    )
    try:
        results = composition.evaluate_run(
            args.workdir,
            probe_config=config,
            weights=_weights(args.weight),
            max_subset_size=args.max_subset_size,
            inlp=not args.no_inlp,
            linear=not args.no_linear,
        )
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(composition.format_report(results))
    print(f"written: {args.workdir}/eval/results.json, {args.workdir}/eval/report.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
