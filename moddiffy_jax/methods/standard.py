"""Hooks shared by the dense families (fine-tuning, adapters) and the diff family.

Each builds the state named in :mod:`moddiffy_jax.methods.common` from the
method's ``encoder`` and ``debias`` fields: a task head (trained, or frozen
from a finished run), the core or base params, adapters, the diffs' dense
states, and the removal terms' running statistics and adversaries.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from moddiffy_jax import checkpoints
from moddiffy_jax.methods import attribute_weights, common, removal, word_rows
from moddiffy_jax.methods.interface import Method
from moddiffy_jax.subnets import diffs as diffs_lib
from moddiffy_jax.subnets import selection

PyTree = Any


def diff_rules(config) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return tuple(config.diff.include), tuple(config.diff.exclude)


def _new_diff(ctx, encoder: PyTree) -> diffs_lib.DiffState:
    include, exclude = diff_rules(ctx.config)
    return diffs_lib.init_diff(
        encoder,
        include,
        exclude=exclude,
        hc=ctx.diff_settings.hc,
        structured=ctx.config.diff.structured,
    )


def init(ctx, rng: jax.Array) -> tuple[dict, dict]:
    """Trainable and frozen parts at the start of the first phase."""
    cfg, method, model = ctx.config, ctx.method, ctx.model
    if method.encoder not in common.ENCODER_MODES:
        raise ValueError(
            f"Method {method.name!r}: the standard hooks know the encoder labels "
            f"{common.ENCODER_MODES}, not {method.encoder!r}; give the method its "
            "own init, substeps and encoder_and_head."
        )
    r_head, r_adv = jax.random.split(rng)
    trainable: dict[str, Any] = {}
    frozen: dict[str, Any] = {}
    encoder = ctx.pretrained
    if method.encoder == "frozen":
        encoder, head, _ = checkpoints.load_core_run(cfg.method.core_run)
        checkpoints.check_same_structure(encoder, ctx.pretrained, cfg.method.core_run)
        frozen["task_head"] = head
    else:
        trainable["task_head"] = model.init_task_head(r_head)
    if method.encoder == "full":
        trainable["core"] = encoder
    elif method.encoder == "adapter":
        adapter_paths = selection.select_paths(encoder, model.adapter_rule)
        # Copies: the step donates the trainable buffers, which must not be
        # shared with the frozen base.
        trainable["adapters"] = jax.tree.map(
            jnp.copy, selection.subtree(encoder, adapter_paths)
        )
        frozen["base"] = encoder
    else:
        frozen["base"] = encoder
    if method.encoder == "diff":
        trainable["task_diff"] = _new_diff(ctx, encoder)
    if method.debias == "modular":
        trainable["diffs"] = {attr: _new_diff(ctx, encoder) for attr in ctx.attributes}
        for attr, tokens in (getattr(ctx, "word_tokens", None) or {}).items():
            trainable["diffs"][attr] = word_rows.restrict(
                trainable["diffs"][attr], tokens
            )
    trainable.update(removal_parts(ctx, r_adv))
    if getattr(ctx, "swap_tables", None) and method.debias == "modular":
        # Step inputs, not constants: methods/swap_reread.py may change them.
        from moddiffy_jax.methods import swap_reread

        frozen[swap_reread.FROZEN_KEY] = swap_reread.frozen_tables(ctx)
        # swap_reread_mode "decision" or "weight": their switches.
        switches = swap_reread.frozen_switches(ctx)
        if switches is not None:
            frozen[switches[0]] = switches[1]
    return trainable, frozen


def removal_parts(ctx, rng: jax.Array) -> dict[str, Any]:
    """The removal terms' state: running statistics, task guard, adversaries."""
    debias, model, out = ctx.debias, ctx.model, {}
    if debias is None:
        return out
    modular = ctx.method.debias == "modular"
    if debias.objective == "mmd":
        if debias.mmd_whiten:
            out[removal.MMD_STATS] = removal.init_mmd_stats(
                model.feature_dim, ctx.attributes
            )
        if attribute_weights.uses_weight(debias, "fisher_weight"):
            out[removal.FISHER_STATS] = removal.init_fisher_stats(
                debias, model.feature_dim, ctx.attributes
            )
        if debias.removal_memory > 0:
            out[removal.REMOVAL_MEMORY] = removal.init_memory(
                debias, model.feature_dim, ctx.attributes, ctx.config.train.batch_size
            )
        if attribute_weights.uses_weight(debias, "target_weight") and modular:
            out[removal.TARGET_STATS] = removal.init_target_stats(
                debias, model.feature_dim, ctx.attributes
            )
    if debias.task_guard and modular:
        out[removal.TASK_GUARD] = removal.init_task_guard(ctx.attributes)
    if debias.objective == "adversarial":
        out["adversaries"] = {
            attr: model.init_adversary(attr, jax.random.fold_in(rng, i))
            for i, attr in enumerate(ctx.attributes)
        }
    return out


def substeps(ctx, phase: str, trainable: dict) -> list[common.SubStep]:
    """A task sub-step (unless the encoder is frozen), then one debias sub-step
    per attribute for modular methods."""
    method = ctx.method
    optimizer = common.make_optimizer(ctx.config.optim)
    adversarial = ctx.debias is not None and ctx.debias.objective == "adversarial"
    task_loss = ctx.config.method.task_loss
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
        head = "task_head" in trainable and not ctx.config.method.freeze_task_head
        # diff.compose_prob > 0: each debias step sees the other attributes'
        # diffs too (common.with_other_diffs); its loss then reads them by
        # name, so it is written for its own attribute, not shared.
        compose = float(ctx.config.get("diff", {}).get("compose_prob", 0.0))
        tables = getattr(ctx, "swap_tables", None) or {}
        # swap_compose: a composing step's twin swaps the added diffs' words too.
        other_tables = tables if ctx.debias and ctx.debias.swap_compose else {}
        shared_losses: dict[str, Any] = {}
        for attr in ctx.attributes:
            # Attributes whose removal terms read equal settings share one
            # loss, written for common.SHARED_ATTRIBUTE (common.SubStep): their
            # debias sub-steps trace and compile once.
            settings = ctx.debias and removal.attribute_settings(
                ctx.debias, attr, common.SHARED_ATTRIBUTE
            )
            # Counterfactual swaps read the attribute's own swap table.
            swaps = tables.get(attr)
            if compose > 0.0 or swaps is not None:
                settings = None
            name = attr if settings is None else common.SHARED_ATTRIBUTE
            updates = [("diffs", name)]
            if adversarial:
                updates.append(("adversaries", name))
            if head:
                updates.append(("task_head",))

            def make_loss(name=name, settings=settings, swaps=swaps):
                return common.make_debias_loss(
                    ctx.model,
                    method,
                    name,
                    phase=phase,
                    diff_settings=ctx.diff_settings,
                    debias=ctx.debias if settings is None else settings,
                    task_loss=task_loss,
                    others=tuple(a for a in ctx.attributes if a != name),
                    others_prob=compose,
                    swap_table=swaps,
                    other_swap_tables=other_tables,
                )

            if settings is None:
                sub = common.SubStep(
                    f"debias/{attr}", tuple(updates), make_loss(), optimizer
                )
            else:
                if repr(settings) not in shared_losses:
                    shared_losses[repr(settings)] = make_loss()
                loss = shared_losses[repr(settings)]
                sub = common.SubStep(
                    f"debias/{attr}",
                    tuple(updates),
                    loss,
                    optimizer,
                    attribute=attr,
                    attributes=tuple(ctx.attributes),
                )
            subs.append(sub)
    return subs


def model(ctx, trainable: Mapping, frozen: Mapping) -> tuple[PyTree, PyTree]:
    """The exported core (the trained core, or the base with adapters merged)
    and task head."""
    core = trainable["core"] if "core" in trainable else frozen["base"]
    if "adapters" in trainable:
        core = selection.merge(core, trainable["adapters"])
    head = trainable["task_head"] if "task_head" in trainable else frozen["task_head"]
    return core, head


def method(name: str, encoder: str, debias: str, description: str, **hooks) -> Method:
    """A :class:`Method` on the standard init, sub-steps and model; ``hooks``
    add to or replace them (the diff family's phases, pruning and exports)."""
    standard = {"init": init, "substeps": substeps, "model": model}
    return Method(
        name=name,
        encoder=encoder,
        debias=debias,
        description=description,
        **(standard | hooks),
    )
