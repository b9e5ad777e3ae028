r"""Plots the fresh-probe removal snapshots of runs trained with ``eval.probe_during``.

Each run's ``metrics.jsonl`` holds, at the end of the L0 phase, right after
the cut to the budget and at the end of training, the dev balanced accuracy
of fresh class-balanced linear probes for the core and each single diff
(keys ``probe/<configuration>/<attribute>/linear_dev_bacc``). One panel per
attribute; one line per run (its own diff), with the core as a dashed line.

Usage::

    python benchmarks/plot_removal.py --out docs/results/removal_snapshots.png \
        NAME=RUN_DIR [NAME=RUN_DIR ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def snapshots(run: Path) -> list[tuple[str, dict[str, float]]]:
    """``[(moment, {key: value})]`` in the order they were written."""
    out, seen_l0_end = [], False
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        probes = {k: v for k, v in record.items() if k.startswith("probe/")}
        if not probes:
            continue
        if record["phase"] == "l0":
            moment, seen_l0_end = "end of L0 (dense or gradual)", True
        elif seen_l0_end and not any(m == "after the cut" for m, _ in out):
            moment = "after the cut"
        else:
            moment = f"step {record['step']}"
        out.append((moment, probes))
    return out


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="NAME=RUN_DIR")
    parser.add_argument("--out", required=True)
    parser.add_argument("--floor", action="append", default=[], help="ATTR=VALUE")
    args = parser.parse_args()
    runs = [tuple(r.split("=", 1)) for r in args.runs]
    floors = dict(f.split("=", 1) for f in args.floor)
    data = {name: snapshots(Path(path)) for name, path in runs}
    attrs = sorted(
        {k.split("/")[2] for snaps in data.values() for _, p in snaps for k in p}
    )
    fig, axes = plt.subplots(1, len(attrs), figsize=(6 * len(attrs), 4), squeeze=False)
    for ax, attr in zip(axes[0], attrs, strict=True):
        for i, (name, snaps) in enumerate(data.items()):
            xs = [m for m, _ in snaps]
            own = [p.get(f"probe/core+{attr}/{attr}/linear_dev_bacc") for _, p in snaps]
            core = [p.get(f"probe/core/{attr}/linear_dev_bacc") for _, p in snaps]
            (line,) = ax.plot(xs, own, marker="o", label=f"{name}: core+{attr}")
            if i == 0:
                ax.plot(xs, core, ls="--", color="gray", label="core")
        if attr in floors:
            ax.axhline(float(floors[attr]), color="k", lw=0.8, ls=":", label="floor")
        ax.axhline(0.5, color="k", lw=0.5, label="chance")
        ax.set_title(f"{attr}: fresh linear probe, dev balanced accuracy")
        ax.set_ylim(0.45, 1.0)
        ax.tick_params(axis="x", labelsize=7)
        ax.legend(fontsize=7)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
