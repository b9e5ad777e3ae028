"""SRNets (Liu et al., NeurIPS 2022): sparse and robust subnetworks of a BERT.

Three methods, run by the shared loop (``moddiffy_jax.train``) like every
other method; the paper's three paradigms are configurations of them
(``configs/srnets_*.py``):

* ``srnets_mask``: mask training with straight-through scores on frozen
  weights (``subnets.masks``). Only the scores train; the threshold of every
  matrix is reset to an exact per-matrix sparsity every
  ``config.srnets.reset_every`` steps (the reference's logging steps) and is
  fixed in between. The sparsity target is constant or follows the cubic
  schedule. Paradigm 1 starts from a fine-tuned run
  (``config.method.core_run``: its core and classifier, both frozen);
  paradigm 3 from the pretrained encoder with a random frozen classifier.
* ``srnets_imp``: iterative magnitude pruning. ``config.srnets.imp_rounds``
  rounds; round ``k`` starts by pruning every selected matrix to the exact
  cumulative sparsity ``s * (k + 1) / R`` (smallest ``|w|`` among the
  remaining entries) and optionally rewinding the encoder to its starting
  weights (the classifier is never rewound), then trains ``num_steps / R``
  steps with a fresh optimizer. Paradigm 1 without rewinding (from a
  fine-tuned run), paradigm 2 with rewinding (from the pretrained encoder).
* ``srnets_retrain``: fine-tunes the pretrained encoder with a fixed mask
  found by another run (``config.srnets.mask_run``) and a new classifier:
  paradigm 2's "fine-tune the subnetwork in isolation".

Every method takes ``config.method.task_loss`` (cross-entropy or a known-bias
loss: product of experts, example reweighting, confidence regularization;
see ``objectives.known_bias``) with the bias model's per-example
probabilities carried in the batch (``data.bias``).

Exports. ``srnets_mask``'s mask is saved as a pruning SparseDiff on the
frozen core (``export/diffs/mask.safetensors``: ``-w`` at pruned entries, so
``core + mask`` is the subnetwork and ``evaluate`` shows both rows). IMP and
retrain runs train the subnetwork's weights, so their exported core *is* the
subnetwork; their mask is saved relative to the starting weights as
``export/mask.safetensors`` (``start + mask`` is the pruned initialisation).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from moddiffy_jax import checkpoints
from moddiffy_jax.methods import common, standard
from moddiffy_jax.methods.interface import Method
from moddiffy_jax.subnets import diffs as diffs_lib
from moddiffy_jax.subnets import masks as masks_lib
from moddiffy_jax.subnets import selection

PyTree = Any


#: The matrices the paper prunes, in our BERT's names: Q, K, V, attention
#: output, FFN in and FFN out of every layer. The paper also prunes the pooler;
#: our classifier reads the CLS hidden state, so the pooler is not part of the
#: computation and is left out (masking it would change nothing).
DEFAULT_INCLUDE = (
    r"encoder/layer_\d+/attention/self/(query|key|value)/kernel",
    r"encoder/layer_\d+/attention/output/dense/kernel",
    r"encoder/layer_\d+/(intermediate|output)/dense/kernel",
)
SCHEDULES = ("constant", "cubic")


def default_srnets_config() -> ml_collections.ConfigDict:
    """Every ``config.srnets`` field, with the reference's defaults."""
    c = ml_collections.ConfigDict()
    c.sparsity = 0.5  # per-matrix target (final) sparsity.
    c.initial_sparsity = -1.0  # < 0: same as sparsity (a constant target).
    c.schedule = "constant"  # or "cubic" (Zhu & Gupta), from initial to final.
    c.schedule_end = 1.0  # cubic: fraction of num_steps where the final is reached.
    c.init = "magnitude"  # scores: magnitude | magnitude_soft | constant.
    c.threshold = masks_lib.DEFAULT_THRESHOLD  # tau_0 = 0.01.
    c.reset_every = 50  # steps between threshold resets (reference: 500-1000).
    c.include = DEFAULT_INCLUDE  # encoder matrices (paths inside the encoder).
    c.exclude = ()
    c.mask_classifier = False  # also mask the task classifier's kernel.
    c.imp_rounds = 5  # IMP: rounds; each prunes s / R of the original entries.
    c.rewind = False  # IMP: rewind the encoder to its start after each prune.
    c.mask_run = ""  # srnets_retrain: the run whose mask is retrained.
    return c


def rules(cfg: ml_collections.ConfigDict) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return tuple(cfg.srnets.include), tuple(cfg.srnets.exclude)


def check_config(cfg: ml_collections.ConfigDict) -> None:
    """Clear errors for SRNets settings that cannot work."""
    s = cfg.srnets
    for name in ("sparsity", "initial_sparsity"):
        value = s[name]
        if name == "initial_sparsity" and value < 0:
            continue
        if not 0.0 <= value <= 1.0:
            raise ValueError(
                f"config.srnets.{name}={value} must lie in [0, 1] (a fraction of "
                "each matrix's entries to prune)."
            )
    if s.schedule not in SCHEDULES:
        raise ValueError(
            f"config.srnets.schedule={s.schedule!r}; valid: {list(SCHEDULES)}."
        )
    if s.reset_every < 1:
        raise ValueError("config.srnets.reset_every must be >= 1 (steps).")
    if s.imp_rounds < 1:
        raise ValueError("config.srnets.imp_rounds must be >= 1.")
    if cfg.method.name == "srnets_imp" and cfg.train.num_steps < s.imp_rounds:
        raise ValueError(
            f"config.train.num_steps={cfg.train.num_steps} is less than "
            f"config.srnets.imp_rounds={s.imp_rounds}: every round needs a step."
        )


# --------------------------------------------------------------------------
# Sparsity targets.


def initial_sparsity(cfg: ml_collections.ConfigDict) -> float:
    s = cfg.srnets
    return float(s.sparsity if s.initial_sparsity < 0 else s.initial_sparsity)


def target_sparsity(cfg: ml_collections.ConfigDict, step: int) -> float:
    """The per-matrix sparsity target of mask training at ``step``."""
    s = cfg.srnets
    if s.schedule == "constant":
        return float(s.sparsity)
    end = max(1.0, s.schedule_end * cfg.train.num_steps)
    schedule = masks_lib.cubic_sparsity_schedule(
        initial=initial_sparsity(cfg),
        final=float(s.sparsity),
        begin_step=0,
        end_step=end,
    )
    return float(schedule(step))


def imp_round_sparsity(cfg: ml_collections.ConfigDict, round_index: int) -> float:
    """Cumulative sparsity after IMP round ``round_index`` (0-based)."""
    s = cfg.srnets
    return float(s.sparsity) * (round_index + 1) / s.imp_rounds


def imp_phase_steps(cfg: ml_collections.ConfigDict, round_index: int) -> int:
    """Training steps of IMP round ``round_index`` (the last takes the rest)."""
    rounds, total = cfg.srnets.imp_rounds, cfg.train.num_steps
    per = total // rounds
    return per if round_index < rounds - 1 else total - per * (rounds - 1)


def phases(cfg: ml_collections.ConfigDict) -> tuple[str, ...]:
    if cfg.method.name == "srnets_imp":
        return tuple(f"imp_{k}" for k in range(cfg.srnets.imp_rounds))
    return ("train",)


def imp_round_of(phase: str) -> int:
    match = re.fullmatch(r"imp_(\d+)", phase)
    if match is None:
        raise ValueError(f"{phase!r} is not an IMP phase.")
    return int(match.group(1))


# --------------------------------------------------------------------------
# State.


def masked_tree(encoder: PyTree, head: PyTree) -> dict[str, PyTree]:
    """The tree mask training scores: ``{"core": encoder, "task_head": head}``."""
    return {"core": encoder, "task_head": head}


def mask_rules(
    cfg: ml_collections.ConfigDict,
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Rules over :func:`masked_tree` paths (encoder rules get a ``core/`` prefix)."""
    include, exclude = rules(cfg)
    include = tuple(f"core/{r}" for r in include)
    if cfg.srnets.mask_classifier:
        include += (r"task_head/.*kernel",)
    return include, tuple(f"core/{r}" for r in exclude)


def init_mask_state(
    cfg: ml_collections.ConfigDict, encoder: PyTree, head: PyTree
) -> tuple[dict, dict]:
    """``srnets_mask``: trainable scores and thresholds, frozen encoder and head."""
    include, exclude = mask_rules(cfg)
    state = masks_lib.init_scores(
        masked_tree(encoder, head),
        include,
        exclude=exclude,
        init=cfg.srnets.init,
        sparsity=initial_sparsity(cfg),
        threshold=cfg.srnets.threshold,
    )
    # The thresholds are state but never differentiated: no sub-step lists
    # them, and they change only through `reset_thresholds` (host side).
    trainable = {"scores": state.scores, "thresholds": state.thresholds}
    frozen = {"base": encoder, "task_head": head}
    return trainable, frozen


def reset_thresholds(trainable: dict, sparsity: float | jax.Array) -> dict:
    """``trainable`` with every matrix's threshold at an exact ``sparsity``."""
    thresholds = masks_lib.thresholds_for_sparsity(
        trainable["scores"], sparsity=sparsity
    )
    return {**trainable, "thresholds": thresholds}


def current_masks(trainable: Mapping[str, Any]) -> PyTree:
    """Bool keep-masks (``{"core": ..., "task_head": ...}`` subtree)."""
    return masks_lib.binary_masks(trainable["scores"], trainable["thresholds"])


def init_imp_state(
    cfg: ml_collections.ConfigDict, encoder: PyTree, head: PyTree
) -> tuple[dict, dict]:
    """``srnets_imp``: weights and masks, pruned for round 0 (the reference
    prunes once at step 0)."""
    include, exclude = rules(cfg)
    keep = masks_lib.init_masks(encoder, include, exclude=exclude)
    trainable = {"core": encoder, "task_head": head, "masks": keep}
    frozen = {"start": encoder}
    return imp_prune_round(cfg, trainable, frozen, 0), frozen


def imp_prune_round(
    cfg: ml_collections.ConfigDict, trainable: dict, frozen: Mapping, round_index: int
) -> dict:
    """Host-side transition into IMP round ``round_index``: prune, then rewind."""
    target = imp_round_sparsity(cfg, round_index)
    keep = masks_lib.imp_prune_to(
        trainable["core"], trainable["masks"], sparsity=target
    )
    core = masks_lib.apply_binary_masks(trainable["core"], keep)
    if cfg.srnets.rewind:
        core = masks_lib.rewind(core, keep, frozen["start"])
    return {**trainable, "core": core, "masks": keep}


def load_mask(
    cfg: ml_collections.ConfigDict, encoder: PyTree
) -> tuple[PyTree, dict[str, Any]]:
    """The keep-masks of ``config.srnets.mask_run`` on ``encoder``'s leaves.

    Reads ``export/diffs/mask.safetensors`` (a mask-training run) or
    ``export/mask.safetensors`` (an IMP or retrain run). The mask's base need
    not be ``encoder`` (paradigm 2 retrains a mask found on a fine-tuned model
    from the pretrained weights); the shapes must match.
    """
    run = cfg.srnets.mask_run
    if not run:
        raise ValueError(
            "srnets_retrain needs config.srnets.mask_run: the workdir of a finished "
            "srnets_mask or srnets_imp run (it holds its exported mask)."
        )
    export = Path(run) / "export"
    candidates = [export / "diffs" / "mask.safetensors", export / "mask.safetensors"]
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        raise FileNotFoundError(
            f"No mask in {export} (looked for {[str(p) for p in candidates]}): "
            "config.srnets.mask_run must be a finished srnets_mask or srnets_imp run."
        )
    from moddiffy_jax.manifest import verify_export

    verify_export(export)
    sd = diffs_lib.load_sparse_diff(str(path))
    if sd.info.get("kind") != "pruning":
        raise ValueError(f"{path} is not a pruning mask (info: {sd.info}).")
    flat = selection.flatten(encoder)
    keep = {}
    for p, shape in sd.shapes:
        if p not in flat or tuple(np.shape(flat[p])) != tuple(shape):
            raise ValueError(
                f"The mask of {run} covers {p!r} with shape {shape}, which this "
                "model lacks or shapes differently: use the same config.model as "
                "that run."
            )
        m = np.ones(int(np.prod(shape)), bool)
        m[np.asarray(sd.indices[p])] = False
        keep[p] = jnp.asarray(m.reshape(shape))
    return selection.unflatten(keep), {
        "path": str(path),
        "fingerprint": sd.base_fingerprint,
    }


def sparsity_report(keep: PyTree) -> dict[str, Any]:
    """Overall and per-matrix pruned fraction of bool keep-masks."""
    overall, per_leaf = masks_lib.mask_sparsity(keep)
    return {
        "overall": float(overall),
        "per_matrix": {p: float(v) for p, v in per_leaf.items()},
        "num_masked": int(sum(np.size(m) for m in jax.tree.leaves(keep))),
    }


def mask_change(
    cfg: ml_collections.ConfigDict, encoder: PyTree, head: PyTree, keep: PyTree
) -> float:
    """Fraction of masked entries whose keep/prune decision differs from the
    initial (magnitude) mask: how far mask training moved the subnetwork."""
    init = init_mask_state(cfg, encoder, head)[0]
    keep0 = current_masks(init)
    flat0, flat = selection.flatten(keep0), selection.flatten(keep)
    changed = sum(
        int(np.sum(np.asarray(flat0[p]) != np.asarray(flat[p]))) for p in flat
    )
    return changed / max(sum(int(np.size(m)) for m in flat.values()), 1)


# --------------------------------------------------------------------------
# The loop's hooks (moddiffy_jax.methods.interface).


def _start(ctx, rng: jax.Array) -> tuple[PyTree, PyTree]:
    """Start weights: with ``config.method.core_run`` (paradigm 1) the encoder
    and classifier of a fine-tuned run; otherwise the pretrained encoder and a
    new random classifier (paradigm 3's frozen random classifier, or the
    classifier that IMP and retraining train)."""
    cfg = ctx.config
    if not cfg.method.core_run:
        # The head's key is the one standard.init gives a new head, so one
        # seed starts every family from the same classifier.
        r_head, _ = jax.random.split(rng)
        return ctx.pretrained, ctx.model.init_task_head(r_head)
    encoder, head, _ = checkpoints.load_core_run(cfg.method.core_run)
    checkpoints.check_same_structure(encoder, ctx.pretrained, cfg.method.core_run)
    return encoder, head


def _init_mask(ctx, rng: jax.Array) -> tuple[dict, dict]:
    return init_mask_state(ctx.config, *_start(ctx, rng))


def _init_imp(ctx, rng: jax.Array) -> tuple[dict, dict]:
    trainable, frozen = init_imp_state(ctx.config, *_start(ctx, rng))
    # Copies: the step donates the trainable buffers, and rewinding reads the
    # start weights afterwards.
    return jax.tree.map(jnp.copy, trainable), frozen


def _init_retrain(ctx, rng: jax.Array) -> tuple[dict, dict]:
    if ctx.config.method.core_run:
        raise ValueError(
            "srnets_retrain fine-tunes the pretrained encoder with a found mask; "
            "leave config.method.core_run empty and set config.srnets.mask_run."
        )
    encoder, head = _start(ctx, rng)
    keep, _ = load_mask(ctx.config, encoder)
    trainable = {
        "core": masks_lib.apply_binary_masks(encoder, keep),
        "task_head": head,
    }
    return jax.tree.map(jnp.copy, trainable), {"masks": keep, "start": encoder}


def _mask_substeps(ctx, phase: str, trainable: dict) -> list[common.SubStep]:
    """Only the scores train."""
    loss = common.make_task_loss(
        ctx.model,
        ctx.method,
        phase=phase,
        diff_settings=None,
        debias=None,
        attributes=(),
        task_loss=ctx.config.method.task_loss,
    )
    optimizer = common.make_optimizer(ctx.config.optim)
    return [common.SubStep("task", (("scores",),), loss, optimizer)]


def _reset_step(state: common.TrainState, sparsity: jax.Array) -> common.TrainState:
    return state.replace(trainable=reset_thresholds(state.trainable, sparsity))


_reset_jit = jax.jit(_reset_step, donate_argnums=(0,))


def _mask_after_step(ctx, state, phase: str, phase_step: int, n_steps: int):
    """Every ``srnets.reset_every`` steps: thresholds at the exact target."""
    if phase_step % ctx.config.srnets.reset_every:
        return state, None
    target = target_sparsity(ctx.config, phase_step)
    return _reset_jit(state, jnp.float32(target)), {"mask/target_sparsity": target}


def _mask_model(ctx, trainable: Mapping, frozen: Mapping) -> tuple[PyTree, PyTree]:
    """The dense frozen core and the classifier as masked (the encoder's mask
    is the exported ``mask`` diff)."""
    keep = current_masks(trainable)
    head = frozen["task_head"]
    if "task_head" in keep:
        head = masks_lib.apply_binary_masks(head, keep["task_head"])
    return frozen["base"], head


def _weight_model(ctx, trainable: Mapping, frozen: Mapping) -> tuple[PyTree, PyTree]:
    return common.subnetwork_params(ctx.method, trainable, frozen)


def _mask_exports(ctx, trainable: Mapping, frozen: Mapping, phase: str) -> dict:
    """The current mask on the encoder as a pruning SparseDiff."""
    keep = jax.device_get(current_masks(trainable))
    cfg = ctx.config
    return {
        "mask": diffs_lib.pruning_diff(
            frozen["base"],
            keep["core"],
            name="mask",
            rules=rules(cfg),
            info={
                "method": ctx.method.name,
                "sparsity": cfg.srnets.sparsity,
                "task_loss": cfg.method.task_loss,
            },
        )
    }


def _sparsity(keep: Mapping[str, Any]) -> dict[str, Any]:
    out = {"sparsity": sparsity_report(keep["core"])}
    if "task_head" in keep:
        out["classifier_sparsity"] = sparsity_report(keep["task_head"])
    return out


def _mask_report(ctx, trainable, frozen, export_dir: Path, chief: bool) -> dict:
    keep = jax.device_get(current_masks(trainable))
    out = _sparsity(keep)
    out["mask_changed_vs_init"] = mask_change(
        ctx.config, frozen["base"], frozen["task_head"], keep
    )
    return out


def _weight_report(ctx, trainable, frozen, export_dir: Path, chief: bool) -> dict:
    """Sparsity, and the mask relative to the start weights beside the exported
    subnetwork (``start + mask`` is the pruned initialisation a retrain run
    starts from)."""
    masks = trainable["masks"] if "masks" in trainable else frozen["masks"]
    keep = {"core": jax.device_get(masks)}
    if chief:
        sd = diffs_lib.pruning_diff(
            frozen["start"],
            keep["core"],
            name="mask",
            rules=rules(ctx.config),
            info={"method": ctx.method.name, "of": "start weights"},
        )
        diffs_lib.save_sparse_diff(export_dir / "mask.safetensors", sd, overwrite=True)
    return _sparsity(keep)


def _imp_steps(cfg: ml_collections.ConfigDict, phase: str) -> int:
    return imp_phase_steps(cfg, imp_round_of(phase))


def _imp_transition(ctx, trainable: dict, frozen: dict, next_phase: str):
    """Into the next IMP round: prune (and rewind)."""
    round_index = imp_round_of(next_phase)
    return imp_prune_round(ctx.config, trainable, frozen, round_index), frozen


def _sections() -> dict[str, ml_collections.ConfigDict]:
    return {"srnets": default_srnets_config()}


SRNETS_MASK = Method(
    name="srnets_mask",
    encoder="mask",
    debias="none",
    description="SRNets mask training on frozen weights (straight-through scores).",
    init=_init_mask,
    substeps=_mask_substeps,
    model=_mask_model,
    after_step=_mask_after_step,
    exports=_mask_exports,
    report=_mask_report,
    check_config=check_config,
    config_sections=_sections,
)
SRNETS_IMP = Method(
    name="srnets_imp",
    encoder="imp",
    debias="none",
    description="Iterative magnitude pruning, with or without rewinding.",
    init=_init_imp,
    substeps=standard.substeps,
    model=_weight_model,
    phases_of=phases,
    phase_steps=_imp_steps,
    transition=_imp_transition,
    report=_weight_report,
    check_config=check_config,
    config_sections=_sections,
)
SRNETS_RETRAIN = Method(
    name="srnets_retrain",
    encoder="retrain",
    debias="none",
    description="Fine-tunes the pretrained encoder with a fixed mask of another run.",
    init=_init_retrain,
    substeps=standard.substeps,
    model=_weight_model,
    report=_weight_report,
    check_config=check_config,
    config_sections=_sections,
)
METHODS = (SRNETS_MASK, SRNETS_IMP, SRNETS_RETRAIN)
