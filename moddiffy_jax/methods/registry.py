"""Named methods and the sub-steps each one runs in a phase."""

from __future__ import annotations

from typing import Any

from moddiffy_jax.methods import (
    adapters,
    common,
    diff_pruning,
    ffw,
    finetune,
    moddiffy,
    srnets,
)

METHODS: dict[str, common.MethodDef] = {
    m.name: m
    for family in (finetune, adapters, diff_pruning, moddiffy, srnets, ffw)
    for m in family.METHODS
}
# Structurally different loops that share the config, data, model, checkpoints
# and export layout but own their driver (FFW: ``moddiffy_jax.surgery.run_ffw``).
DRIVER_METHODS = ("ffw",)


def get_method(name: str) -> common.MethodDef:
    """The method called ``name``; an unknown name lists the valid ones."""
    if name not in METHODS:
        valid = sorted(METHODS)
        raise ValueError(
            f"Unknown method {name!r}; valid methods are: {', '.join(valid)}."
        )
    return METHODS[name]


def phases_of(method: common.MethodDef, config: Any) -> tuple[str, ...]:
    """The phases of ``method`` under ``config`` (IMP has one per round)."""
    if method.encoder == "imp":
        return srnets.phases(config)
    return method.phases


def build_substeps(ctx: Any, phase: str, trainable: dict) -> list[common.SubStep]:
    """The sub-steps of ``ctx.method`` in ``phase`` (see methods.common)."""
    method = ctx.method
    optimizer = common.make_optimizer(ctx.config.optim)
    adversarial = ctx.debias is not None and ctx.debias.objective == "adversarial"
    task_loss = ctx.config.method.task_loss
    if method.encoder == "mask":  # only the scores train
        loss = common.make_task_loss(
            ctx.model,
            method,
            phase=phase,
            diff_settings=None,
            debias=None,
            attributes=(),
            task_loss=task_loss,
        )
        return [common.SubStep("task", (("scores",),), loss, optimizer)]
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
            task_loss=task_loss,
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
                task_loss=task_loss,
            )
            subs.append(
                common.SubStep(f"debias/{attr}", tuple(updates), loss, optimizer)
            )
    return subs
