"""The Markdown report of an evaluated run (``eval/report.md``): the composition
table, each attribute's floor and chance, the share of the core-to-floor gap
each diff closes, and bias / OOD tables."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

SPLITS = ("train", "dev", "test")
#: A task head predicting one class for at least this share of a split is
#: reported as degenerate (a constant predictor).
DEGENERATE_SHARE = 0.99
#: A row whose test task accuracy is more than this under the core's is
#: marked "task lost": its leakage and TPR gap describe a broken model, not
#: a removal (stop 63: an adversarial MoDDiffy-post gender diff that
#: collapsed in its last steps read 0.613 against the core's 0.928, macro-F1
#: 0.528, and showed the table's smallest gender TPR gap).
TASK_LOST = 0.10


def _fmt(mean: float | None, std: float | None = None) -> str:
    if mean is None or (isinstance(mean, float) and math.isnan(mean)):
        return "n/a"
    if std is None or (isinstance(std, float) and math.isnan(std)):
        return f"{mean:.3f}"
    return f"{mean:.3f} ± {std:.3f}"


def _ood_names(results: Mapping[str, Any]) -> list[str]:
    names = list(results.get("ood_sets") or {})
    for row in results["composition"].values():
        names += [n for n in row.get("ood", {}) if n not in names]
    return names


def _bias_splits(results: Mapping[str, Any]) -> list[str]:
    return [
        s
        for s in ("dev", "test")
        if any(f"{s}_bias_aligned_acc" in r for r in results["composition"].values())
    ]


def objective_line(choice: Mapping[str, Any]) -> str:
    """What ``objective=auto`` chose, with each attribute's swap read."""
    reads = "; ".join(
        f"{a}: {r['groups']} of {r['of']} groups"
        + (" and one word one-sided" if "one_sided" in r else "")
        + f" close {r['closed']:.2f} of the gap at {r['cost']:.1f} pts"
        for a, r in choice.get("reads", {}).items()
    )
    chosen = choice["objective"]
    if chosen == "mixed":  # results.json before stop 78 has no "attributes"
        chosen = ", ".join(f"{o} for {a}" for a, o in choice["attributes"].items())
    return f"objective auto -> {chosen}: {choice['reason']}" + (
        f" (bag-of-tokens read on dev; {reads})" if reads else ""
    )


def guard_line(guard: Mapping[str, Any]) -> str:
    """Where the task guard left each diff's removal weight."""
    weights = ", ".join(
        f"{a} {w:.2f}"
        + (" (backed off: its diff trailed the core's task)" if w < 0.99 else "")
        for a, w in guard["final_weight"].items()
    )
    release = guard.get("release", 1.0)  # results.json before stop 52 lacks it
    back = f", returning {release:g}x faster" if release != 1.0 else ""
    return (
        f"task guard (slack {guard['slack']:.2f} of task accuracy, from step "
        f"{guard['start_step']}{back}): removal weight at the end {weights}"
    )


def task_lost(core_acc: Any, acc: Any) -> float | None:
    """Points of test task accuracy a row lost against the core, where more
    than :data:`TASK_LOST` (else None)."""
    if core_acc is None or acc is None:
        return None
    drop = float(core_acc) - float(acc)
    return 100 * drop if drop > TASK_LOST else None


def format_report(results: Mapping[str, Any]) -> str:
    """The composition table as Markdown (one row per configuration).

    Bias-aligned/conflicting accuracies and OOD accuracies (plus PAWS F1) get
    their own columns when present; full OOD breakdowns (HANS per heuristic,
    PAWS F1s) follow in one table per OOD set.
    """
    attrs = results["attributes"]
    rows = results["composition"]
    bias_splits = _bias_splits(results)
    ood_names = _ood_names(results)
    synthetic = " (SYNTHETIC data)" if results.get("synthetic") else ""
    probe = results["probe_config"]
    # Runs evaluated before stop 23 (no "whiten") read standardized features,
    # before stop 12 (no "standardize") the raw ones.
    # Runs evaluated before stop 57 have no converged MLP probe.
    has_mlp = any(
        "mlp" in r["leakage"].get(a, {}) for r in rows.values() for a in attrs
    )
    metric = "whitened" if probe.get("whiten", False) else "standardized"
    if not probe.get("whiten", False) and not probe.get("standardize", False):
        metric = "as they are (not standardized)"
    lines = [
        f"# Composition matrix: {results['method']} on {results['dataset']}{synthetic}",
        "",
        "Task metrics use the run's task head. Leakage is the balanced accuracy of "
        f"attacker probes on frozen CLS representations, {metric} with the train "
        f"split's statistics (test split; ensemble of {probe['members']} probes, "
        + (
            f"one seed, {probe['seeds'][0]}"
            if len(probe["seeds"]) == 1
            else f"mean ± std over seeds {tuple(probe['seeds'])}"
        )
        + "); lower is better, chance "
        "is 1/#classes. `lin` is a linear probe"
        + (
            "; `mlp` an MLP probe trained to convergence (150 epochs, read at "
            "its best dev balanced accuracy; one seed): the attacker stops far "
            "from that and misses what a linear eraser leaves nonlinear."
            if has_mlp
            else "."
        ),
        "",
    ]
    if results.get("objective_choice"):
        lines += [objective_line(results["objective_choice"]), ""]
    if "task_guard" in results:
        lines += [guard_line(results["task_guard"]), ""]
    if bias_splits:
        lines += [
            "`aligned` / `conflicting`: task accuracy on the examples whose "
            "bias-only model prediction is / is not the gold label.",
            "",
        ]
    if ood_names:
        lines += [
            "OOD columns: accuracy on each out-of-distribution set after mapping "
            "the model's classes to the set's (F1: duplicate-class F1 for PAWS).",
            "",
        ]
    has_f1 = {
        n: any("f1" in r.get("ood", {}).get(n, {}) for r in rows.values())
        for n in ood_names
    }
    header = ["configuration", "dev acc", "test acc", "test macro-F1"]
    for s in bias_splits:
        header += [f"{s} aligned acc", f"{s} conflicting acc"]
    for n in ood_names:
        header += [f"{n} acc"] + ([f"{n} F1"] if has_f1[n] else [])
    for a in attrs:
        header += [f"{a} leakage", f"{a} lin"]
        header += [f"{a} mlp"] * has_mlp + [f"{a} RMS TPR gap"]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * len(header))
    core_acc = rows.get("core", {}).get("test_task_acc")
    flagged: list[str] = []
    for label, row in rows.items():
        test = row["task"].get("test", {})
        shown = label + (
            " (degenerate: constant predictor)" if row.get("degenerate") else ""
        )
        lost = task_lost(core_acc, row.get("test_task_acc"))
        if lost is not None and label != "core" and not row.get("degenerate"):
            shown += f" (task lost: {lost:.1f} points under the core)"
            flagged.append(label)
        cells = [
            shown,
            _fmt(row.get("dev_task_acc")),
            _fmt(row.get("test_task_acc")),
            _fmt(test.get("macro_f1")),
        ]
        for s in bias_splits:
            cells.append(_fmt(row.get(f"{s}_bias_aligned_acc")))
            cells.append(_fmt(row.get(f"{s}_bias_conflicting_acc")))
        for n in ood_names:
            m = row.get("ood", {}).get(n, {})
            cells.append(_fmt(m.get("accuracy")))
            if has_f1[n]:
                cells.append(_fmt(m.get("f1")))
        for a in attrs:
            leak = row["leakage"][a]
            cells.append(_fmt(leak["mean"], leak["std"]))
            cells.append(_fmt(leak.get("linear", {}).get("test_balanced_accuracy")))
            if has_mlp:
                cells.append(_fmt(leak.get("mlp", {}).get("test_balanced_accuracy")))
            cells.append(_fmt(test.get(f"{a}/rms_tpr_gap")))
        lines.append("| " + " | ".join(cells) + " |")
    floors = results.get("floors") or {}
    if floors and attrs:
        per_attr = 3 + has_mlp
        for what in ("floor", "chance"):
            cells = [f"*{what}*"] + [""] * (len(header) - 1 - per_attr * len(attrs))
            for a in attrs:
                cells += [_fmt(floors[a][what])] * (per_attr - 1) + [""]
            lines.append("| " + " | ".join(cells) + " |")
        lines += ["", _floor_note()]
        lines += _gap_closed_lines(rows, attrs, floors, has_mlp)
        if has_mlp:
            lines += _linear_only_lines(rows, attrs, floors)
    if flagged:
        lines += [
            "",
            f"*task lost*: {', '.join(flagged)} read(s) more than "
            f"{100 * TASK_LOST:.0f} points of test task accuracy under the core: "
            "the model is broken there, so its leakage and TPR gap say nothing "
            "about removal (a head near one class has a small TPR gap).",
        ]
    lines += _task_only_lines(rows)
    lines += _discriminant_lines(rows)
    lines += _strength_lines(results.get("strength") or {})
    lines += _token_merge_lines(results.get("token_merge") or {})
    lines += _ood_detail_tables(rows, ood_names)
    notes = sorted(
        {n for row in rows.values() for a in attrs for n in row["leakage"][a]["notes"]}
    )
    if notes:
        lines += ["", "Notes:"] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def _strength_lines(strengths: Mapping[str, Any]) -> list[str]:
    """The weight each diff was added with, and the reads that chose it."""
    if not strengths:
        return []
    lines = [
        "",
        "Diff weights, chosen on train + dev (`methods/strength.py`: the "
        "largest weight whose task cost stays within the budget, stopping once "
        "the dev leakage reaches the floor; `w*<attribute>` rows add the diff "
        "with weight w):",
        "",
    ]
    for attr, s in strengths.items():
        reads = "; ".join(
            f"{r['scale']:g}: {r['cost']:.2f} ± {r['se']:.2f} pts"
            + (f", dev leakage {r['leakage']:.3f}" if "leakage" in r else "")
            for r in s["read"]
        )
        lines.append(
            f"- {attr}: weight {s['scale']:g} (dev floor {s['floor']:.3f}; {reads})"
        )
    return lines


def _token_merge_lines(merges: Mapping[str, Any]) -> list[str]:
    """Which tokens each ``merge(<attribute>)`` row merged."""
    if not merges:
        return []
    lines = [
        "",
        "`merge(<attribute>)`: a token-merge diff built on the core after "
        "training (the attribute's most telling tokens, in groups of "
        "counterparts, one per class (`a+b`), given one shared word row, as "
        "many as the task budget allows, stopping once the dev leakage "
        "reaches the stop level: the "
        "floor, or the asked-for share of the gap to it; "
        "`token_merge/<attribute>.safetensors`):",
        "",
    ]
    for attr, m in merges.items():
        words = (
            ["+".join(map(str, g)) for g in m["groups"]]
            if m.get("groups")
            else m["tokens"]
        )
        tokens = ", ".join(str(t) for t in words) or "none within budget"
        line = (
            f"- {attr}: {m['merged']} of {m['candidates']} candidates ({tokens}); "
            f"dev floor {m['dev_floor']:.3f}"
        )
        if m.get("stop_at") is not None:
            line += f", core {m['dev_start']:.3f}, stop at {m['stop_at']:.3f}"
        merged = [r for r in m.get("read", []) if r.get("size") == m["merged"]]
        if merged and "leakage" in merged[0]:
            line += f", reached {merged[0]['leakage']:.3f}"
        if merged and "se" in merged[0]:
            line += (
                f"; task cost read on train + dev {merged[0]['cost']:.2f} "
                f"± {merged[0]['se']:.2f} points"
            )
        lines.append(line)
    return lines


def _task_only_lines(rows: Mapping[str, Any]) -> list[str]:
    """What the task-only reference rows are (eval/bottleneck.py)."""
    kinds = {
        r["task_only"]["kind"]: r["task_only"]
        for r in rows.values()
        if "task_only" in r
    }
    if not kinds:
        return []
    lines = [""]
    if "decision" in kinds:
        lines.append(
            "`core decision`: the core head's logits probed in place of the "
            "representation (task accuracy: the core's). What it leaks above "
            "the floor is what the core's own decision carries of the "
            "attribute: a diff that keeps the core's decisions closes that "
            "part of the gap only by changing them."
        )
    if "bottleneck" in kinds:
        b = kinds["bottleneck"]
        lines.append(
            f"`core+bottleneck`: the CLS vector cut to the {b['k']} "
            "coordinates the core head reads most, every other one held at its "
            "train mean (a last-LayerNorm diff), read by a linear task head refit "
            f"on train: the fewest coordinates whose dev accuracy "
            f"({b['dev_accuracy']:.3f}) is within {b['max_drop']:g} points "
            f"of the core's ({b['reference_dev_accuracy']:.3f}). It keeps only "
            "the task and so removes every attribute at once: a baseline an "
            "attribute's diff should beat at its task cost."
        )
    return lines


def _discriminant_lines(rows: Mapping[str, Any]) -> list[str]:
    """What the discriminant rows are (eval/discriminant.py; written into
    weights: eval/discriminant_diff.py)."""
    found = {k: r["discriminant"] for k, r in rows.items() if "discriminant" in r}
    if not found:
        return []
    first = next(iter(found.values()))
    text = (
        f"`core+discriminant(...)`: the core's representation projected onto "
        f"{first['k']} task direction(s) (the task's classes less one) along "
        "which, inside each task class, the named attributes' groups sit "
        "together: Fisher's discriminant with the attributes' within-class "
        "mean scatter as a penalty. The penalty is the one whose dev leakage "
        "(a Gaussian-mixture reader) is closest to the floor, of those within "
        f"{first['max_drop']:g} points of the core's dev accuracy. It keeps "
        "only the task, so it also lowers other attributes. Chosen penalties: "
        + "; ".join(
            f"{label} {d['penalty']:g} (dev {d['dev_accuracy']:.3f}, core "
            f"{d['reference_dev_accuracy']:.3f})"
            for label, d in found.items()
        )
        + "."
    )
    weights = {k: d.get("weights", {}) for k, d in found.items()}
    written = {k: w for k, w in weights.items() if "entries" in w}
    skipped = [w["skipped"] for w in weights.values() if "skipped" in w]
    if written:
        text += (
            " Each is written into a sparse diff of the core's last layer "
            "(eval/discriminant_diff.py: the last LayerNorm holds every "
            "coordinate but the kept ones at its train mean, and the kept ones "
            "are read from the last FFN's activations by a ridge regression): "
            "the row is the encoder with that diff added, read by the core's "
            "own head; the diff is saved as "
            "`eval/discriminant/<attributes>.diff.safetensors` with the core's "
            "fingerprint. Each attribute set has a diff of its own: the single "
            "diffs do not add up to the joint one. "
            + "; ".join(
                f"{label}: {w['entries']:,} entries, readout R^2 "
                f"{w['readout_r2']:.3f} on train"
                + (
                    f", the projection's test accuracy "
                    f"{w['projection_test_accuracy']:.3f}"
                    if w.get("projection_test_accuracy") is not None
                    else ""
                )
                for label, w in written.items()
            )
            + "."
        )
    else:
        text += (
            " A post-hoc projection of the core's vectors (like INLP), read by "
            "a linear task head refit on train"
            + (f" (not written into weights: {skipped[0]})" if skipped else "")
            + "."
        )
    return ["", text]


def _floor_note() -> str:
    return (
        "*floor*: the balanced accuracy that the gold task label alone gives "
        "(fit on train): a representation that keeps the task leaks at least "
        "this much when the attribute correlates with the task. Removal is read "
        "as the share of the gap between the core's leakage and the floor that "
        "a configuration closes (1 = down to the floor, 0 = nothing removed)."
    )


def gap_closed(core: float, value: float, floor: float) -> float | None:
    """Share of the core-to-floor leakage gap closed (None if there is no gap)."""
    if core is None or value is None or not core - floor > 1e-9:
        return None
    return (core - value) / (core - floor)


def _probe_read(row, a: str, kind: str) -> float | None:
    """A row's test balanced accuracy of attribute ``a`` under probe ``kind``
    (``linear``, ``mlp``), or None where it was not read."""
    return row["leakage"][a].get(kind, {}).get("test_balanced_accuracy")


def _probe_closed(core, row, a: str, kind: str, floor: float) -> float | None:
    """The share of the core-to-floor gap ``row`` closes under probe ``kind``."""
    return gap_closed(_probe_read(core, a, kind), _probe_read(row, a, kind), floor)


def _gap_closed_lines(rows, attrs, floors, has_mlp=False) -> list[str]:
    if "core" not in rows:
        return []
    kinds = ("linear", "mlp") if has_mlp else ("linear",)

    names = ["probes", "lin"] + ["mlp"] * has_mlp
    head = " | ".join(f"{a} gap closed ({n})" for a in attrs for n in names)
    lines = [
        "",
        f"| configuration | {head} |",
        "|---|" + "---|" * len(names) * len(attrs),
    ]
    core = rows["core"]
    for label, row in rows.items():
        if label == "core":
            continue
        cells = [label]
        for a in attrs:
            f = floors[a]["floor"]
            mean = row["leakage"][a]["mean"]
            cells.append(_fmt(gap_closed(core["leakage"][a]["mean"], mean, f)))
            for kind in kinds:
                value = _probe_closed(core, row, a, kind, f)
                cells.append(_fmt(value))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


#: The share of its gap a row must close under the linear probe, and not
#: under the converged MLP, to be named "linear only" (the efficacy bar's).
LINEAR_ONLY_SHARE = 0.5


def linear_only(rows, attrs, floors) -> list[tuple[str, str, float, float]]:
    """``(row, attribute, linear share, mlp share)`` for each row that closes
    at least :data:`LINEAR_ONLY_SHARE` of an attribute's core-to-floor gap
    under the linear probe and less under the converged MLP: a removal a
    nonlinear reader reads back (a linear eraser's; docs/efficacy.md, stop
    57), which the linear column alone would pass."""
    core = rows.get("core")
    if core is None:
        return []

    out = []
    for label, row in rows.items():
        if label == "core":
            continue
        for a in attrs:
            f = floors[a]["floor"]
            lin = _probe_closed(core, row, a, "linear", f)
            mlp = _probe_closed(core, row, a, "mlp", f)
            if lin is None or mlp is None or any(map(math.isnan, (lin, mlp))):
                continue
            if lin >= LINEAR_ONLY_SHARE > mlp:
                out.append((label, a, lin, mlp))
    return out


def _linear_only_lines(rows, attrs, floors) -> list[str]:
    found = linear_only(rows, attrs, floors)
    if not found:
        return []
    named = "; ".join(
        f"{label} ({a}: {lin:.2f} linear, {mlp:.2f} mlp)"
        for label, a, lin, mlp in found
    )
    return [
        "",
        f"*linear only*: {named} close at least {LINEAR_ONLY_SHARE:g} of the "
        "gap under the linear probe and less under the converged MLP: the "
        "removal is linear, and a nonlinear reader reads back the rest.",
    ]


def _ood_detail_tables(rows: Mapping[str, Any], ood_names: Sequence[str]) -> list:
    """One Markdown table per OOD set with metrics beyond accuracy."""
    lines = []
    for n in ood_names:
        keys = []
        for row in rows.values():
            keys += [
                k
                for k in row.get("ood", {}).get(n, {})
                if k not in ("num_examples", "accuracy") and k not in keys
            ]
        if not keys:
            continue
        lines += ["", f"## OOD set {n}", ""]
        lines.append("| configuration | accuracy | " + " | ".join(keys) + " |")
        lines.append("|" + "---|" * (len(keys) + 2))
        for label, row in rows.items():
            m = row.get("ood", {}).get(n)
            if m is None:
                continue
            cells = [label, _fmt(m.get("accuracy"))] + [_fmt(m.get(k)) for k in keys]
            lines.append("| " + " | ".join(cells) + " |")
    return lines
