"""Named methods and the sub-steps each one runs in a phase."""

from __future__ import annotations

from typing import Any

from moddiffy_jax.methods import adapters, common, diff_pruning, finetune, moddiffy

METHODS: dict[str, common.MethodDef] = {
    m.name: m
    for family in (finetune, adapters, diff_pruning, moddiffy)
    for m in family.METHODS
}


def get_method(name: str) -> common.MethodDef:
    """The method called ``name``; an unknown name lists the valid ones."""
    if name not in METHODS:
        raise ValueError(
            f"Unknown method {name!r}; valid methods are: {', '.join(sorted(METHODS))}."
        )
    return METHODS[name]


def build_substeps(ctx: Any, phase: str, trainable: dict) -> list[common.SubStep]:
    """The sub-steps of ``ctx.method`` in ``phase`` (see methods.common)."""
    method = ctx.method
    optimizer = common.make_optimizer(ctx.config.optim)
    adversarial = ctx.debias is not None and ctx.debias.objective == "adversarial"
    subs = []
    if method.encoder != "frozen":
        updates = [(k,) for k in ("core", "adapters", "task_diff") if k in trainable]
        updates.append(("task_head",))
        if method.debias == "joint" and adversarial:
            updates += [("adversaries", a) for a in ctx.attributes]
        loss = common.make_task_loss(
            ctx.model,
            method,
            phase=phase,
            diff_settings=ctx.diff_settings,
            debias=ctx.debias,
            attributes=ctx.attributes,
        )
        subs.append(common.SubStep("task", tuple(updates), loss, optimizer))
    if method.debias == "modular":
        for attr in ctx.attributes:
            updates = [("diffs", attr)]
            if adversarial:
                updates.append(("adversaries", attr))
            if "task_head" in trainable and not ctx.config.method.freeze_task_head:
                updates.append(("task_head",))
            loss = common.make_debias_loss(
                ctx.model,
                method,
                attr,
                phase=phase,
                diff_settings=ctx.diff_settings,
                debias=ctx.debias,
            )
            subs.append(
                common.SubStep(f"debias/{attr}", tuple(updates), loss, optimizer)
            )
    return subs
