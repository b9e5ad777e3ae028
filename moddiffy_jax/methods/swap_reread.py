"""Choosing each attribute's swap groups again from its own trained diff.

methods/swap_budget.py chooses an attribute's counterpart groups before
training, from a bag-of-tokens read of each prefix of its groups. The
trained diffs do not follow that read one to one (docs/efficacy.md, "Stop
42": MoDDiffy-par's gender diffs removed 0.96-1.33 times what the read of
their prefix promised, the age diffs 0.63-0.93 times, at costs from 1.5
points under the read's to 0.6 over).

With ``method.swap_reread_at`` > 0, at that share of the run's steps the
training loop reads each attribute's diff on the dev split: its task
accuracy against the core's, and the balanced accuracy of a fresh
class-balanced linear probe (fit on the first ``swap_reread_train`` training
rows) against the core's and the floor. The prefix reads are scaled to
that measurement (:func:`swap_budget.calibrated`) and the groups chosen
again on them (:func:`swap_budget.choose_count`, ``swap_target`` within
``swap_reread_max_drop`` points). The rest of the run swaps the new groups:
the tables are inputs of the train step (``frozen["swap_tables"]``), so no
step compiles again.

With ``method.swap_reread_mode="decision"`` the read decides instead
whether each attribute keeps the core's decision for the rest of the run:
a diff that has closed at least ``swap_keep_above`` of its gap on dev
(1: down to its floor) is removing what the words tell the task, not only
the attribute (docs/efficacy.md, "Stop 44": gender's par diffs went past
their floor at up to 3.7 points, and keeping the core's decision stopped
them at 0.6-0.9 of the gap within 1.4 points, while it took age's
removal, which was short of the floor). From then on that attribute's
twin distance leaves out the head's decision directions
(``swap_keep_task``) and its debias step adds the KL to the core's
prediction (weight ``swap_keep_distill``). The switches are step inputs
too (``frozen["swap_keep"]``, 0 or 1 per attribute).

With ``method.swap_reread_mode="weight"`` the read sets each attribute's
swap weight for the rest of the run instead: a diff that has closed at
least ``swap_keep_above`` of its gap on dev has its swap term scaled by
``swap_weight_down`` (past the floor the swaps take task evidence, and a
lighter pull lets the task term win some of it back); one that has closed
less than ``swap_raise_below`` at a dev cost within
``swap_reread_max_drop`` points by ``swap_weight_up`` (it has task points
to spend on more removal); the others keep theirs. Gender and age needed
opposite strengths of the same term on the same run (docs/efficacy.md,
"Stop 44"); this chooses them per attribute from the diff's own read. The
scales are step inputs as well (``frozen["swap_scale"]``, 1 before the
read).

The choice is written to ``swap_reread.json`` in the run directory before
the next step. A run resumed at or past that step swaps what was chosen; one
resumed before it reads again at the same step (the read is deterministic,
and the file is then rewritten with the same choice).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moddiffy_jax import objectives
from moddiffy_jax.eval.removal import fresh_linear_leakage
from moddiffy_jax.methods import swap_budget

FILE = "swap_reread.json"
FROZEN_KEY = "swap_tables"
KEEP_KEY = "swap_keep"
SCALE_KEY = "swap_scale"
MODES = ("groups", "decision", "weight")
#: The step-input switches each mode adds to ``frozen`` and their value
#: before the read.
_SWITCHES = {"decision": (KEEP_KEY, 0.0), "weight": (SCALE_KEY, 1.0)}


def check_config(method_cfg) -> None:
    """A ValueError naming the field when the re-read settings are invalid."""
    at = float(method_cfg.get("swap_reread_at", 0.0))
    if not 0.0 <= at < 1.0:
        raise ValueError(
            "config.method.swap_reread_at is the share of the run's steps at "
            f"which the swap groups are chosen again, in [0, 1) (0: off); got {at}."
        )
    if not float(method_cfg.get("swap_reread_max_drop", 1.5)) >= 0.0:
        raise ValueError(
            "config.method.swap_reread_max_drop must be >= 0 task points, got "
            f"{method_cfg.swap_reread_max_drop}."
        )
    mode = method_cfg.get("swap_reread_mode", "groups")
    if mode not in MODES:
        raise ValueError(
            f"config.method.swap_reread_mode={mode!r} is not one of {MODES} "
            "(what the re-read decides: the swap groups, which attributes "
            "keep the core's decision, or each attribute's swap weight)."
        )
    if mode == "groups" and at > 0.0 and method_cfg.get("swap_one_sided", False):
        raise ValueError(
            "config.method.swap_reread_at > 0 chooses whole swap groups again "
            "mid-run and would drop the one-sided step swap_one_sided=True "
            "chose: set swap_one_sided=False, or swap_reread_at=0."
        )
    if mode in _SWITCHES and at == 0.0:
        raise ValueError(
            f"config.method.swap_reread_mode={mode!r} switches attributes at "
            "the re-read; set config.method.swap_reread_at (e.g. 0.3333) too."
        )
    if not float(method_cfg.get("swap_keep_above", 1.0)) > 0.0:
        raise ValueError(
            "config.method.swap_keep_above is a share of the gap to the floor, "
            f"> 0 (1: the floor), got {method_cfg.swap_keep_above}."
        )
    if not float(method_cfg.get("swap_keep_distill", 3.0)) >= 0.0:
        raise ValueError(
            "config.method.swap_keep_distill must be >= 0 (0: the decision "
            f"directions alone), got {method_cfg.swap_keep_distill}."
        )
    if not float(method_cfg.get("swap_weight_down", 0.5)) >= 0.0:
        raise ValueError(
            "config.method.swap_weight_down scales the swap term of a diff past "
            f"swap_keep_above, >= 0 (0: off), got {method_cfg.swap_weight_down}."
        )
    if not float(method_cfg.get("swap_weight_up", 2.0)) >= 1.0:
        raise ValueError(
            "config.method.swap_weight_up scales the swap term of a diff short "
            f"of swap_raise_below, >= 1 (1: kept), got {method_cfg.swap_weight_up}."
        )
    if (
        not 0.0
        <= float(method_cfg.get("swap_raise_below", 0.6))
        <= float(method_cfg.get("swap_keep_above", 1.0))
    ):
        raise ValueError(
            "config.method.swap_raise_below is a share of the gap to the floor "
            "in [0, swap_keep_above] (0: never raised), got "
            f"{method_cfg.swap_raise_below}."
        )
    if int(method_cfg.get("swap_reread_train", 1000)) < 10:
        raise ValueError(
            "config.method.swap_reread_train (training rows the re-read's probe "
            f"is fit on) must be at least 10, got {method_cfg.swap_reread_train}."
        )


def read_step(ctx, total_steps: int) -> int | None:
    """The global step after which the groups are chosen again; None when
    the re-read is off or there is nothing to re-read (no prefix reads: the
    swaps are off, ``swap_target`` is 0, or ``auto`` chose another
    objective)."""
    at = float(ctx.config.method.get("swap_reread_at", 0.0))
    if at <= 0.0 or not getattr(ctx, "swap_reads", None):
        return None
    if not getattr(ctx, "swap_ranked", None):
        return None
    return int(min(max(round(at * total_steps), 1), max(total_steps - 1, 1)))


def _mode(ctx) -> str:
    return ctx.config.method.get("swap_reread_mode", "groups")


def frozen_switches(ctx) -> tuple[str, dict[str, jax.Array]] | None:
    """The key and the value before the read of the switches the mode adds
    to ``frozen`` (mode "decision": ``swap_keep``, every attribute 0; mode
    "weight": ``swap_scale``, every attribute 1), or None for mode "groups"
    or the re-read off. A ValueError when the mode is on but the read could
    never run (no prefix reads: its floors come from them)."""
    mode = _mode(ctx)
    if mode not in _SWITCHES or not float(ctx.config.method.get("swap_reread_at", 0.0)):
        return None
    if read_step(ctx, 2) is None:
        raise ValueError(
            f"config.method.swap_reread_mode={mode!r} reads the diffs against "
            "the swaps' prefix reads, which this run has none of: set "
            "config.method.swap_target > 0 (objective 'swap' and 'auto' set "
            "0.75), or swap_reread_mode='groups'."
        )
    key, before = _SWITCHES[mode]
    return key, {a: jnp.full((), before, jnp.float32) for a in (ctx.swap_tables or {})}


def frozen_tables(ctx) -> dict[str, jax.Array]:
    """The swap tables as step inputs (``frozen["swap_tables"]``)."""
    return {
        a: jnp.asarray(np.asarray(t, np.int32))
        for a, t in (getattr(ctx, "swap_tables", None) or {}).items()
    }


def _first_rows(split, n: int):
    """The first ``n`` rows of a TokenizedSplit."""
    if n >= len(split):
        return split
    rows = {
        f.name: getattr(split, f.name)[:n]
        for f in dataclasses.fields(split)
        if f.name not in ("attrs", "extras")
    }
    attrs = {a: v[:n] for a, v in split.attrs.items()}
    extras = {k: v[:n] for k, v in split.extras.items()}
    return type(split)(**rows, attrs=attrs, extras=extras)


def measure(ctx, evaluator, trainable, frozen, phase: str) -> dict[str, dict]:
    """Per attribute with swaps: dev task accuracy and probe leakage of the
    core and of core + that attribute's diff, the floor, the share of the
    gap closed and the cost in task points."""
    core, head = ctx.method.model(ctx, trainable, frozen)
    sparse = ctx.method.exports(ctx, trainable, frozen, phase)
    train = _first_rows(
        ctx.data.splits["train"], int(ctx.config.method.swap_reread_train)
    )
    dev = ctx.data.splits["dev"]

    def read(params):
        acc, h_dev = evaluator.accuracy_and_reps(params, head, "dev")
        return acc, {
            "train": evaluator.forward.represent_split(params, train),
            "dev": h_dev,
        }

    def leak(reps, attr):
        return fresh_linear_leakage(
            reps,
            {"train": train.attrs[attr], "dev": dev.attrs[attr]},
            num_classes=len(ctx.data.attr_classes[attr]),
        )

    core_acc, core_reps = read(core)
    out = {}
    for attr in ctx.swap_reads:
        acc, reps = read(evaluator.compose(core, [sparse[attr]]))
        floor = float(ctx.swap_reads[attr]["floor"])
        core_leak, leakage = leak(core_reps, attr), leak(reps, attr)
        gap = core_leak - floor
        out[attr] = {
            "core_task_accuracy": round(core_acc, 4),
            "task_accuracy": round(acc, 4),
            "core_leakage": round(core_leak, 4),
            "leakage": round(leakage, 4),
            "floor": round(floor, 4),
            "closed": round((core_leak - leakage) / gap, 3) if gap > 0 else 0.0,
            "cost": round(100.0 * (core_acc - acc), 2),
        }
    return out


def choose(ctx, measured: dict[str, dict]) -> dict[str, dict]:
    """Per attribute: the groups chosen again on the reads calibrated to
    ``measured`` (:func:`measure`), with the reads and the reason; in mode
    "decision", whether it keeps the core's decision from now on; in mode
    "weight", the scale of its swap term from now on."""
    if _mode(ctx) == "weight":
        return {attr: _weight_choice(ctx, attr, m) for attr, m in measured.items()}
    if _mode(ctx) == "decision":
        above = float(ctx.config.method.swap_keep_above)
        groups = {a: len(ctx.swap_groups[a]) for a in measured}
        return {
            attr: {
                "groups_before": groups[attr],
                "groups_after": groups[attr],
                "keep_decision": bool(m["closed"] >= above),
                "reason": (
                    f"closed {m['closed']:.3f} of the gap on dev "
                    f"({'>=' if m['closed'] >= above else '<'} {above:g})"
                ),
                "measured": m,
            }
            for attr, m in measured.items()
        }
    target = float(ctx.config.method.swap_target)
    max_drop = float(ctx.config.method.swap_reread_max_drop)
    out = {}
    for attr, m in measured.items():
        record = ctx.swap_reads[attr]
        reads = [swap_budget.PrefixRead(**r) for r in record["reads"]]
        before = len(ctx.swap_groups[attr])
        scaled = swap_budget.calibrated(reads, before, m["closed"], m["cost"])
        after, reason = swap_budget.choose_count(scaled, target, max_drop)
        out[attr] = {
            "groups_before": before,
            "groups_after": int(after),
            "reason": reason,
            "target": target,
            "max_drop": max_drop,
            "measured": m,
            "calibrated": [dataclasses.asdict(r) for r in scaled],
        }
    return out


def _weight_choice(ctx, attr: str, m: dict) -> dict:
    """Mode "weight": the scale of one attribute's swap term and why."""
    cfg = ctx.config.method
    above, below = float(cfg.swap_keep_above), float(cfg.swap_raise_below)
    max_drop = float(cfg.swap_reread_max_drop)
    closed, cost = m["closed"], m.get("cost", 0.0)
    if closed >= above:
        scale, why = float(cfg.swap_weight_down), f">= {above:g}: lowered"
    elif closed < below and cost <= max_drop:
        scale = float(cfg.swap_weight_up)
        why = f"< {below:g} at {cost:g} <= {max_drop:g} points: raised"
    else:
        scale, why = 1.0, "kept"
    groups = len(ctx.swap_groups[attr])
    return {
        "groups_before": groups,
        "groups_after": groups,
        "swap_scale": scale,
        "reason": f"closed {closed:.3f} of the gap on dev at {cost:g} points ({why})",
        "measured": m,
    }


def apply(ctx, chosen: dict[str, dict], frozen: dict) -> dict:
    """Sets ``ctx``'s swap groups and tables to ``chosen``'s counts (in
    place) and returns ``frozen`` with the new tables (and, in mode
    "decision", the new switches; the groups stay)."""
    table = next(iter(ctx.swap_tables.values()))
    for attr, c in chosen.items():
        if "keep_decision" in c or "swap_scale" in c:
            continue
        groups = ctx.swap_ranked[attr][: c["groups_after"]]
        ctx.swap_groups[attr] = groups
        ctx.swap_tables[attr] = objectives.swap_table(groups, table.shape[0])
    out = dict(frozen)
    if KEEP_KEY in frozen:
        out[KEEP_KEY] = {
            a: jnp.asarray(
                float(chosen.get(a, {}).get("keep_decision", False)), jnp.float32
            )
            for a in frozen[KEEP_KEY]
        }
    if SCALE_KEY in frozen:
        out[SCALE_KEY] = {
            a: jnp.asarray(float(chosen.get(a, {}).get("swap_scale", 1.0)), jnp.float32)
            for a in frozen[SCALE_KEY]
        }
    if FROZEN_KEY in frozen:
        out[FROZEN_KEY] = frozen_tables(ctx)
    return out


def reread(ctx, evaluator, workdir, trainable, frozen, phase: str, step: int):
    """Reads, chooses and applies (:func:`measure`, :func:`choose`,
    :func:`apply`); writes ``swap_reread.json``. Returns the new frozen
    inputs and a metrics record."""
    from moddiffy_jax import checkpoints

    trainable, frozen = jax.device_get((trainable, frozen))
    chosen = choose(ctx, measure(ctx, evaluator, trainable, frozen, phase))
    if jax.process_index() == 0:
        checkpoints.write_json_atomic(
            pathlib.Path(workdir) / FILE, {"step": step, "attributes": chosen}
        )
    record = {"phase": phase}
    for attr, c in chosen.items():
        record[f"swap_reread/{attr}/groups"] = c["groups_after"]
        record[f"swap_reread/{attr}/dev_closed"] = c["measured"]["closed"]
        record[f"swap_reread/{attr}/dev_cost"] = c["measured"]["cost"]
        if "keep_decision" in c:
            record[f"swap_reread/{attr}/keep_decision"] = float(c["keep_decision"])
        if "swap_scale" in c:
            record[f"swap_reread/{attr}/swap_scale"] = c["swap_scale"]
    return apply(ctx, chosen, frozen), record


def resume(ctx, workdir, resumed_step: int, frozen: dict) -> tuple[dict | None, dict]:
    """On a resumed run: the saved choice applied to ``ctx`` and ``frozen``
    when the run resumes at or past its step; ``(None, frozen)`` (the file
    left to be rewritten) when it resumes before it or there is none."""
    path = pathlib.Path(workdir) / FILE
    if not path.exists():
        return None, frozen
    saved = json.loads(path.read_text())
    if resumed_step < int(saved["step"]):
        return None, frozen
    return saved, apply(ctx, saved["attributes"], frozen)


def summary(saved: dict) -> dict[str, Any]:
    """What the results keep of a re-read: the step and, per attribute, the
    groups before and after, the reason and the measurement."""
    return {
        "step": saved["step"],
        **{
            a: {
                k: c[k]
                for k in (
                    "groups_before",
                    "groups_after",
                    "keep_decision",
                    "swap_scale",
                    "reason",
                    "measured",
                )
                if k in c
            }
            for a, c in saved["attributes"].items()
        },
    }
