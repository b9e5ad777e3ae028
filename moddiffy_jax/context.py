"""The run context: data, model, pretrained params and settings, built from a config.

``build_context(config)`` validates the config against its method and the
dataset (unknown attributes, prune settings, task losses) and builds what
every training loop and evaluation needs.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

from moddiffy_jax import checkpoints, objectives, parallel
from moddiffy_jax.eval.forward import Forward
from moddiffy_jax.methods import common, removal
from moddiffy_jax.methods import registry as method_registry
from moddiffy_jax.subnets import hard_concrete


@dataclasses.dataclass
class Context:
    config: ml_collections.ConfigDict
    method: common.MethodDef
    data: Any
    model: Any
    pretrained: Any
    attributes: tuple[str, ...]
    mesh: Any
    diff_settings: common.DiffSettings | None  # None: the config has no diff.
    debias: removal.DebiasSettings | None
    # config.diff.word_rows > 0: per attribute, the token ids whose word rows
    # its diff may change (methods/word_rows.py); None: every row.
    word_tokens: dict[str, np.ndarray] | None = None
    # config.method.swap_weight > 0: per attribute, the [vocab] token
    # permutation that swaps its counterpart tokens (objectives/
    # counterfactual.py) and the groups it swaps; None: no swaps.
    swap_tables: dict[str, np.ndarray] | None = None
    swap_groups: dict[str, list[np.ndarray]] | None = None
    # swap_target > 0: per attribute, every counterpart group in rank order
    # (swap_groups is a prefix; methods/swap_reread.py may choose another).
    swap_ranked: dict[str, list[np.ndarray]] | None = None
    # config.method.swap_target > 0: per attribute, the bag-of-tokens reads
    # that chose its groups (methods/swap_budget.GroupChoice.to_json()).
    swap_reads: dict[str, dict] | None = None
    # config.method.objective == "auto": what it chose and the reads behind
    # the choice (resolve_objective); None for a named objective.
    objective_choice: dict | None = None


def is_vision(config: ml_collections.ConfigDict) -> bool:
    """Whether ``config.data.source`` is an image benchmark (data/vision.py)."""
    from moddiffy_jax.data import vision as vision_data

    return vision_data.is_vision_config(config)


def build_context(config: ml_collections.ConfigDict) -> Context:
    from moddiffy_jax import data as data_lib
    from moddiffy_jax.models import text as text_lib

    method = method_registry.get_method(config.method.name)
    if config.method.task_loss not in common.TASK_LOSSES:
        raise ValueError(
            f"config.method.task_loss={config.method.task_loss!r}; valid: "
            f"{list(common.TASK_LOSSES)}."
        )
    method.check_config(config)
    if "swap_reread_at" in config.method:
        from moddiffy_jax.methods import swap_reread

        swap_reread.check_config(config.method)
    vision = is_vision(config)
    if vision:
        from moddiffy_jax.data import vision as vision_data

        if method.debias != "none" or method.encoder not in ("full", "frozen"):
            raise ValueError(
                f"Method {method.name!r} is for text encoders; on image data use "
                "finetune (vanilla training) or ffw (configs/ffw_*.py)."
            )
        dataset = vision_data.build_vision_dataset(config.data)
    else:
        tokenizer = text_lib.load_tokenizer_for(config.model)
        dataset = data_lib.build_dataset(config.data, tokenizer)
    attributes = tuple(config.method.attributes) or tuple(dataset.attr_classes)
    check_attribute_names(attributes)
    unknown = [a for a in attributes if a not in dataset.attr_classes]
    if unknown:
        raise ValueError(
            f"config.method.attributes names {unknown}, which the dataset does "
            f"not have; its attributes are {sorted(dataset.attr_classes)}."
        )
    attr_classes = {a: len(dataset.attr_classes[a]) for a in attributes}
    if not vision:
        _check_vocabulary(dataset, config)
    if vision:
        from moddiffy_jax.models import vision as vision_models

        model, pretrained = vision_models.build_vision_model(
            config.model.vision,
            num_task_classes=len(dataset.task_classes),
            image_shape=dataset.image_shape,
            rng=jax.random.PRNGKey(config.seed),
        )
    else:
        model, pretrained = text_lib.build_model(
            config.model,
            num_task_classes=len(dataset.task_classes),
            attr_classes=attr_classes,
            adversary=config.method.get("adversary"),
            rng=jax.random.PRNGKey(config.seed),
            with_adapters=method.encoder == "adapter",
        )
    found: dict = {}  # auto's groups and reads, for _swaps to reuse
    config, objective_choice = resolve_objective(
        config, method, dataset, attributes, pretrained, attr_classes, found
    )
    diff_settings = None
    if "diff" in config:  # only the diff family's configs carry it.
        check_prune_config(config.diff)
        check_frozen_core(config)
        check_compose(config, method)
        from moddiffy_jax.methods.moddiffy import dense_fixmask

        dense_fixmask(config)  # a bad diff.fixmask_state fails before training
        diff_settings = common.DiffSettings(
            hc=hard_concrete.HardConcrete(
                left=config.diff.left,
                right=config.diff.right,
                temperature=config.diff.temperature,
                init_log_alpha=config.diff.init_log_alpha,
            ),
            straight_through=config.diff.straight_through,
            l0_weight=config.diff.l0_weight,
            gathered=tuple(getattr(model, "gathered_rows", ())),
        )
    debias = None
    if method.debias != "none":
        debias = removal.settings_from_config(
            config.method,
            attr_classes=attr_classes,
            attr_prior=_attr_tables(dataset, attributes, conditional=True),
            attr_joint=_attr_tables(dataset, attributes, conditional=False),
            num_task_classes=len(dataset.task_classes),
            batch_size=config.train.batch_size,
        )
        if debias.task_projection and method.debias != "modular":
            raise ValueError(
                "config.method.task_projection=True projects the removal "
                "gradient of a modular debias step (a diff per attribute); "
                f"method {config.method.name!r} trains its removal jointly with "
                "the task: set it to False."
            )
    word_tokens = _word_tokens(config, method, dataset, attributes, pretrained)
    swap_ranked: dict = {}
    swap_groups, swap_tables, swap_reads = _swaps(
        method,
        debias,
        dataset,
        attributes,
        pretrained,
        attr_classes,
        found,
        swap_ranked,
    )
    debias, swap_reads = _gap_weights(
        config, debias, dataset, attributes, attr_classes, swap_groups, swap_reads
    )
    debias = _guard_start(config, debias, len(dataset.splits["train"]))
    if config.method.task_loss == "conf_reg":
        dataset = _with_teacher_probs(config, dataset, model)
    mesh = parallel.make_mesh(config.num_devices or None)
    parallel.check_batch_size(config.train.batch_size, mesh)
    _check_erasure(config, method, model, pretrained)
    return Context(
        config=config,
        method=method,
        data=dataset,
        model=model,
        pretrained=pretrained,
        attributes=attributes,
        mesh=mesh,
        diff_settings=diff_settings,
        debias=debias,
        word_tokens=word_tokens,
        swap_tables=swap_tables,
        swap_groups=swap_groups,
        swap_ranked=swap_ranked or None,
        swap_reads=swap_reads,
        objective_choice=objective_choice,
    )


def _check_erasure(config, method, model, pretrained) -> None:
    """At start-up, not after training: ``diff.erasure='on'`` needs a BERT
    whose last FFN output the diffs cover ('auto' skips where it cannot)."""
    d = config.get("diff")
    if d is None or method.debias != "modular" or d.get("erasure", "off") != "on":
        return
    if not d.get("erasure_share", 0.0):
        return
    from moddiffy_jax.methods import erasure_refit, standard
    from moddiffy_jax.subnets import selection

    include, exclude = standard.diff_rules(config)
    paths = set(selection.select_paths(pretrained, include, exclude=exclude))
    erasure_refit.check_model(model, paths, d.get("word_rows", 0))


def _swaps(
    method,
    debias,
    dataset,
    attributes,
    pretrained,
    attr_classes,
    found=None,
    ranked=None,
):
    """``config.method.swap_weight > 0``: per attribute, its counterpart
    groups among the tokens that tell it beyond the task label on the
    training split (methods/token_merge.py), paired by the pretrained word
    rows, and the swap table they make (objectives/counterfactual.py); with
    ``swap_target > 0``, the prefix of the groups methods/swap_budget.py
    chooses and its reads (``found``: an attribute's groups and choice that
    resolve_objective already read). ``(None, None, None)`` when the swaps
    are off. ``ranked`` (a dict) receives every attribute's groups in rank
    order where a prefix is chosen. A ValueError names what is missing."""
    from moddiffy_jax.methods import attribute_weights, word_rows
    from moddiffy_jax.subnets import selection

    if debias is None or not attribute_weights.uses_weight(debias, "swap_weight"):
        return None, None, None
    table = selection.flatten(pretrained).get(word_rows.WORD_TABLE)
    if method.debias != "modular" or table is None:
        raise ValueError(
            "config.method.swap_weight > 0 swaps an attribute's "
            f"tokens in the debias steps of attribute diffs; method {method.name!r} "
            "on this model has none (it needs a modular debiasing method on a "
            "text encoder): set it to 0."
        )
    table = np.asarray(table)
    _swap_order(debias)  # named before any read, also where none is made
    groups_of, tables, reads = {}, {}, {}
    for attr in attributes:
        if attribute_weights.for_attribute(debias, attr).swap_weight <= 0.0:
            continue
        groups, choice = (found or {}).get(attr, (None, None))
        if groups is None:
            groups = _counterpart_groups(dataset, attr, table, debias)
        if not groups:
            raise ValueError(
                f"config.method.swap_weight > 0, but attribute {attr!r} has no "
                "counterpart tokens on the training split (no token of one class "
                "with a telling token of another): its swap would change nothing. "
                "Set swap_weight=0 or raise swap_candidates."
            )
        if debias.swap_one_sided and not debias.swap_target > 0.0:
            raise ValueError(
                "config.method.swap_one_sided=True adds a one-sided step to the "
                "choice of swap groups, which swap_target > 0 makes; with "
                "swap_target=0 every group is swapped: set swap_target (0.75 in "
                "the swap recipe) or swap_one_sided=False."
            )
        if debias.swap_target > 0.0:
            if "dev" not in dataset.splits:
                raise ValueError(
                    "config.method.swap_target > 0 reads each prefix of the swap "
                    "groups on the dev split; this dataset has none: set "
                    "swap_target=0 (every group) or give the data a dev split."
                )
            if choice is None:
                choice = _read_groups(dataset, attr, groups, attr_classes, debias)
            logging.info(
                "swap_target %.2f for %s: %d of %d groups (%s)",
                debias.swap_target,
                attr,
                choice.chosen,
                len(groups),
                choice.reason,
            )
            reads[attr] = choice.to_json()
            if choice.order:  # swap_order "efficiency"
                groups = [groups[i] for i in choice.order]
            if ranked is not None:
                ranked[attr] = [np.asarray(g, np.int64) for g in groups]
            groups = groups[: choice.chosen]
            if choice.one_sided is not None:  # swap_one_sided
                groups = [*groups, choice.one_sided.group]
        logging.info("swap groups for %s: %s", attr, [g.tolist() for g in groups])
        groups_of[attr] = [np.asarray(g, np.int64) for g in groups]
        tables[attr] = objectives.swap_table(groups_of[attr], table.shape[0])
    return groups_of, tables, reads or None


def _guard_start(config, debias, num_train):
    """``config.method.task_guard_start_share > 0``: the task guard's start
    step, that share of the L0 phase's steps (train.*epochs resolved)."""
    share = float(config.method.get("task_guard_start_share", 0.0))
    if not 0.0 <= share <= 1.0:
        raise ValueError(
            "config.method.task_guard_start_share must be in [0, 1] (a share "
            f"of the L0 phase's steps; 0: task_guard_start), got {share}."
        )
    if debias is None or share == 0.0 or "l0_steps" not in config.train:
        return debias
    from moddiffy_jax import config_lib

    steps = config_lib.resolve_epochs(config, num_train).train.l0_steps
    return dataclasses.replace(debias, task_guard_start=round(share * steps))


def _gap_weights(config, debias, dataset, attributes, attr_classes, groups, reads):
    """``config.method.swap_gap_reference > 0``: each swapped attribute's
    swap weight in proportion to its read gap (methods/swap_budget.gap_weight),
    except where ``attribute_weights`` names the attribute's ``swap_weight``;
    the weight and the gap are recorded in the attribute's read (results.json
    ``swap_reads``). The read is deterministic, so a resumed run gets the same
    weights. Returns ``(debias, reads)``."""
    from moddiffy_jax.methods import attribute_weights, swap_budget

    reference = float(config.method.get("swap_gap_reference", 0.0))
    if not reference > 0.0 or not groups:
        if reference < 0.0:
            raise ValueError(
                "config.method.swap_gap_reference must be >= 0 (0: every "
                f"attribute at swap_weight), got {reference}."
            )
        return debias, reads
    reads = dict(reads or {})
    table = {a: dict(w) for a, w in debias.attribute_weights.items()}
    for attr in attributes:
        if attr not in groups:
            continue
        if attr in reads:
            choice = reads[attr]
            gap = float(choice["reads"][0]["leakage"]) - float(choice["floor"])
        else:  # swap_target 0: every group swapped, the no-group read alone.
            if "dev" not in dataset.splits:
                raise ValueError(
                    "config.method.swap_gap_reference > 0 reads each attribute's "
                    "gap on the dev split; this dataset has none: set "
                    "swap_gap_reference=0 or give the data a dev split."
                )
            choice = _read_groups(
                dataset, attr, groups[attr], attr_classes, debias, every=True
            )
            gap = swap_budget.read_gap(choice)
            choice = {"floor": choice.floor, "reads": [choice.to_json()["reads"][0]]}
        own = attribute_weights.for_attribute(debias, attr).swap_weight
        given = "swap_weight" in table.get(attr, {})
        weight = own if given else swap_budget.gap_weight(own, gap, reference)
        table.setdefault(attr, {})["swap_weight"] = weight
        reads[attr] = {
            **choice,
            "gap": round(gap, 4),
            "swap_weight": round(weight, 3),
            "swap_weight_from": "attribute_weights" if given else "gap",
        }
        logging.info(
            "swap weight for %s: %.2f (read gap %.3f, reference %.3f%s)",
            attr,
            weight,
            gap,
            reference,
            ", set in attribute_weights" if given else "",
        )
    return dataclasses.replace(debias, attribute_weights=table), reads


def _counterpart_groups(dataset, attr, table, fields) -> list:
    """The attribute's counterpart groups on the training split (among the
    ``fields.swap_candidates`` most telling tokens; methods/token_merge.py)."""
    from moddiffy_jax.methods import token_merge, word_rows

    train = dataset.splits["train"]
    ranked = word_rows.attribute_tokens(
        train, [attr], fields.swap_candidates, fields.swap_share, table.shape[0]
    )[attr]
    return token_merge.counterpart_groups(train, attr, ranked, table)


#: ``config.method.swap_order``: the ranked groups' prefixes, or
#: methods/swap_budget.efficient_order's.
SWAP_ORDERS = ("rank", "efficiency")


def _swap_order(fields) -> str:
    """``fields.swap_order``, or a ValueError naming the allowed ones."""
    order = getattr(fields, "swap_order", "rank")
    if order not in SWAP_ORDERS:
        raise ValueError(
            f"config.method.swap_order={order!r} is not one of {SWAP_ORDERS} "
            "(the order the swap groups' prefixes are read in)."
        )
    return order


def _read_groups(dataset, attr, groups, attr_classes, fields, every=False):
    """methods/swap_budget.choose_groups of ``groups`` (train as read, not
    data.balance's copies, and dev); ``every``: the reads of no group and of
    every group only."""
    from moddiffy_jax import data as data_lib
    from moddiffy_jax.methods import swap_budget

    order = _swap_order(fields)
    train = data_lib.original_train(dataset).splits["train"]
    fillers = None
    if getattr(fields, "swap_one_sided", False) and not every:
        from moddiffy_jax.methods import one_sided

        fillers = one_sided.attribute_fillers(
            train,
            attr,
            groups,
            list(dataset.attr_classes),
            fields.swap_candidates,
            fields.swap_share,
        )
        logging.info("one-sided fillers for %s: %s", attr, fillers.tolist())
    return swap_budget.choose_groups(
        train,
        dataset.splits["dev"],
        attr,
        groups,
        num_task_classes=len(dataset.task_classes),
        num_attr_classes=int(attr_classes[attr]),
        target=fields.swap_target,
        max_drop=fields.swap_max_drop,
        counts=(0, len(groups)) if every else None,
        efficient=order == "efficiency" and not every,
        fillers=fillers,
    )


def resolve_objective(
    config, method, dataset, attributes, pretrained, attr_classes, found=None
):
    """``config.method.objective == "auto"``: per attribute, the
    counterfactual swaps (config_lib.swap_preset) where a bag-of-tokens read
    of its counterpart groups (methods/swap_budget.py) says the groups the
    swaps would take close at least ``method.auto_swap_closed`` of the gap
    to the floor within ``swap_max_drop`` points; else the MMD recipe (an
    attribute spread over words with no counterparts, as dwmw17's dialect,
    or no text, no dev split, or no modular diffs). Where some attributes
    take the swaps and others the MMD, one run trains each its own way
    (config_lib.mixed_preset), unless ``method.auto_mix`` is off: then every
    attribute takes the MMD recipe. Returns the resolved config
    (``objective`` "swap" or "mmd"; the requested one is what config.json
    keeps) and what was chosen and why (``objective`` "swap", "mmd" or
    "mixed", ``attributes``: each one's); ``(config, None)`` for a named
    objective. ``found`` (a dict) receives each swapped attribute's groups
    and budget choice, which the swaps' tables reuse."""
    from moddiffy_jax import config_lib
    from moddiffy_jax.methods import word_rows
    from moddiffy_jax.subnets import selection

    if config.method.get("objective") != "auto":
        return config, None
    swaps = config.copy_and_resolve_references()
    with swaps.unlocked():
        config_lib.swap_preset(swaps, keep_changed=True)
    need = float(config.method.get("auto_swap_closed", 0.5))
    table = selection.flatten(pretrained).get(word_rows.WORD_TABLE)
    reads, why, short = {}, "", {}  # short: attribute -> why not its swaps
    if method.debias != "modular" or table is None:
        why = "the swaps need attribute diffs on a text encoder"
    elif "dev" not in dataset.splits:
        why = "the swaps' read needs a dev split"
    for attr in attributes if not why else ():
        groups = _counterpart_groups(dataset, attr, np.asarray(table), swaps.method)
        if not groups:
            short[attr] = f"{attr} has no counterpart tokens"
            continue
        # Every group is the most the swaps can remove: where even that read
        # falls short, the prefixes need no reading (dwmw17: 2 fits, not 62).
        most = _read_groups(dataset, attr, groups, attr_classes, swaps.method, True)
        read, budget, choice = most.reads[-1], "", None
        # swap_target 0 swaps every group: that read is the one to judge.
        if read.closed >= need and swaps.method.swap_target > 0.0:
            choice = _read_groups(dataset, attr, groups, attr_classes, swaps.method)
            if found is not None:
                found[attr] = (groups, choice)
            read, budget = (
                choice.final(),
                f" within {choice.max_drop:g} points",
            )
        reads[attr] = {"groups": read.groups, "of": len(groups)}
        if choice is not None and choice.one_sided is not None:
            reads[attr]["one_sided"] = choice.one_sided.word  # after those groups
        reads[attr].update(closed=read.closed, cost=read.cost)
        if read.closed < need or (budget and read.cost > choice.max_drop):
            short[attr] = (
                f"{attr}'s swaps close {read.closed:.2f} of its gap (< {need:.2f})"
                + budget
            )
    swapped = [a for a in attributes if not why and a not in short]
    # A config.json without the field (a run from before stop 78) was
    # trained with every attribute on the MMD where one fell short.
    mixed = bool(swapped and short and config.method.get("auto_mix", False))
    chosen = "mixed" if mixed else "mmd" if why or short else "swap"
    for attr in list(found or {}):  # the swaps' tables: swapped attributes only
        if chosen == "mmd" or attr in short:
            del found[attr]
    if chosen == "swap":
        resolved = swaps
    else:
        resolved = config.copy_and_resolve_references()
        with resolved.unlocked():
            if mixed:
                config_lib.mixed_preset(resolved, swapped, list(short), attributes)
            resolved.method.objective = "mmd"
    resolved.lock()
    choice = {"objective": chosen, "closed_needed": need, "reads": reads}
    choice["attributes"] = {
        a: "swap" if a in swapped and chosen != "mmd" else "mmd" for a in attributes
    }
    choice["reason"] = why or "; ".join(short.values())
    if chosen == "swap":
        choice["reason"] = "every attribute's swaps close enough of its gap"
    elif mixed:
        choice["reason"] += f"; the swaps for {', '.join(swapped)}"
    logging.info("objective auto: %s (%s)", chosen, choice["reason"])
    return resolved, choice


def _word_tokens(config, method, dataset, attributes, pretrained):
    """``config.diff.word_rows``: each attribute's tokens (word_rows.py), or
    None; a ValueError naming the field for a bad value or a run without
    attribute diffs on a word table."""
    from moddiffy_jax.methods import word_rows
    from moddiffy_jax.subnets import selection

    if "diff" not in config:
        return None
    k, share = config.diff.get("word_rows", 0), config.diff.get("word_rows_share", 0.1)
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(
            f"config.diff.word_rows={k!r}: give a whole number of tokens >= 0 "
            "(0 lets every word row change)."
        )
    if not 0.0 <= float(share) <= 1.0:
        raise ValueError(
            f"config.diff.word_rows_share={share!r}: a share of the best "
            "token's score, in [0, 1]."
        )
    if k == 0:
        return None
    table = selection.flatten(pretrained).get(word_rows.WORD_TABLE)
    if config.diff.structured:
        raise ValueError(
            f"config.diff.word_rows={k} closes single rows of the word table; "
            "a structured diff gates whole tensors: set diff.structured=False "
            "or word_rows=0."
        )
    if method.debias != "modular" or table is None:
        raise ValueError(
            f"config.diff.word_rows={k} restricts the word rows of attribute "
            f"diffs; method {method.name!r} on this model has none (it needs a "
            "modular debiasing method on a text encoder): set it to 0."
        )
    return word_rows.attribute_tokens(
        dataset.splits["train"], attributes, k, float(share), int(table.shape[0])
    )


# Names a diff file or a report column is made of: no path separators, no
# leading dot, and not the name of the task diff (``export/diffs/task``).
_ATTRIBUTE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
RESERVED_NAMES = ("task",)


def check_attribute_names(attributes) -> None:
    """Attribute names become file names (``export/diffs/<name>.safetensors``)
    and config keys: refuse duplicates, path-like names and reserved ones."""
    seen = set()
    for a in attributes:
        if a in seen:
            raise ValueError(
                f"The attribute list {list(attributes)} names {a!r} twice; list "
                "each protected attribute once (config.method.attributes or "
                "config.data.attributes)."
            )
        seen.add(a)
        if a in RESERVED_NAMES:
            raise ValueError(
                f"The attribute name {a!r} is reserved (the task's own diff is "
                "exported under it); rename the attribute, e.g. with "
                f"config.data.columns.attributes.{a}_attr = {a!r}."
            )
        if not _ATTRIBUTE_NAME.fullmatch(str(a)) or ".." in str(a):
            raise ValueError(
                f"The attribute name {a!r} cannot be a file name (its diff is "
                "saved as export/diffs/<name>.safetensors): use letters, digits, "
                "'_', '-' or '.', starting with a letter or digit; map the "
                "column to such a name with config.data.columns.attributes.<name>."
            )


def _check_vocabulary(dataset, config) -> None:
    """Token ids beyond the model's embedding table would index past it (NaN
    losses on CPU, garbage on accelerators): refuse them up front."""
    from moddiffy_jax.models import bert as bert_lib

    model_cfg = config.model
    if model_cfg.init == "random" and not model_cfg.dir:
        vocab = int(model_cfg.vocab_size)
    else:
        directory = bert_lib.resolve_model_dir(model_cfg.dir or None)
        vocab = bert_lib.BertConfig.from_json(directory / "config.json").vocab_size
    top = max(
        (int(np.max(s.input_ids)) for s in dataset.splits.values() if len(s)),
        default=-1,
    )
    if top >= vocab:
        raise ValueError(
            f"The tokenizer produced token id {top}, but the model's vocabulary "
            f"has {vocab} entries (config.model.vocab_size / the model's "
            "config.json): the tokenizer does not belong to this model. Use the "
            "model's own tokenizer (config.model.tokenizer_dir empty) or a model "
            "whose vocabulary covers the tokenizer's."
        )


def _attr_tables(dataset, attributes, *, conditional: bool) -> dict[str, tuple]:
    """Per attribute, on train (add-one smoothed), as [T][C] nested tuples:
    P(attribute | task label) if ``conditional``, else P(task, attribute)."""
    train = dataset.splits["train"]
    out = {}
    for a in attributes:
        counts = np.ones((len(dataset.task_classes), len(dataset.attr_classes[a])))
        np.add.at(counts, (np.asarray(train.task), np.asarray(train.attrs[a])), 1.0)
        counts /= counts.sum(1, keepdims=True) if conditional else counts.sum()
        out[a] = tuple(tuple(float(x) for x in row) for row in counts)
    return out


def _with_teacher_probs(config, dataset, model):
    """Attaches ``teacher_probs`` of ``config.method.teacher_run`` to the train split.

    Confidence regularization distils a standard fine-tuned teacher (spec
    A7); its probabilities are computed here, deterministically (no dropout),
    once per run, rather than read from a file written by another script.
    """
    from moddiffy_jax.data import dataset as dataset_lib

    if not config.method.teacher_run:
        raise ValueError(
            "config.method.task_loss='conf_reg' needs config.method.teacher_run: "
            "the workdir of a finished finetune run (with task_loss='ce'), whose "
            "model is the teacher."
        )
    core, head, _ = checkpoints.load_core_run(config.method.teacher_run)

    train = dataset.splits["train"]
    logits = Forward(model, config.eval.batch_size).logits_split(core, head, train)
    probs = np.asarray(jax.nn.softmax(jnp.asarray(logits), axis=-1), np.float32)
    splits = dict(dataset.splits)
    splits["train"] = dataset_lib.with_extras(train, teacher_probs=probs)
    return dataclasses.replace(dataset, splits=splits)


PRUNE_SCHEDULES = ("gradual", "final")


PRUNE_SCORES = ("magnitude", "taylor")


def check_frozen_core(config: ml_collections.ConfigDict) -> None:
    """``diff.freeze_core_in_fixmask`` stops the task sub-step: only
    MoDDiffy-par trains a core beside its diffs, and the task guard reads the
    core's accuracy from that sub-step."""
    if not config.diff.get("freeze_core_in_fixmask", False):
        return
    if config.method.name != "moddiffy_par":
        raise ValueError(
            "config.diff.freeze_core_in_fixmask=True stops the core's task "
            "steps in the fixmask phase; only moddiffy_par trains a core beside "
            f"its diffs (method {config.method.name!r}): set it to False."
        )
    if config.method.get("task_guard", False):
        raise ValueError(
            "config.diff.freeze_core_in_fixmask=True with config.method."
            "task_guard=True: the guard compares each diff with the core's "
            "accuracy from the task step, which the fixmask phase then skips; "
            "turn one of them off."
        )


def check_compose(config: ml_collections.ConfigDict, method) -> None:
    """``diff.compose_prob``: a probability, for attribute diffs on a trained
    core or a frozen base (methods/common.with_other_diffs)."""
    p = config.diff.get("compose_prob", 0.0)
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p <= 1:
        raise ValueError(
            f"config.diff.compose_prob={p!r}: the probability that a debias "
            "step sees each other attribute's diff, in [0, 1] (0: only its own)."
        )
    if p > 0 and (
        method.debias != "modular" or method.encoder not in ("full", "frozen")
    ):
        raise ValueError(
            f"config.diff.compose_prob={p} adds the other attributes' diffs "
            "in each debias step; it needs attribute diffs on a core or a "
            f"frozen encoder (moddiffy_par, moddiffy_post), not {method.name!r}: "
            "set it to 0."
        )


def check_prune_config(d: ml_collections.ConfigDict) -> None:
    """Fails at start-up, not at the first pruning event, on a bad diff config.

    Runs made before these fields existed (their config.json lacks them) used
    the final cut with magnitude scores.
    """
    schedule = d.get("prune_schedule", "final")
    score = d.get("prune_score", "magnitude")
    for key, value, valid in (
        ("prune_schedule", schedule, PRUNE_SCHEDULES),
        ("prune_score", score, PRUNE_SCORES),
    ):
        if value not in valid:
            raise ValueError(f"config.diff.{key}={value!r} is not one of {valid}.")
    keep = d.get("keep", None)
    if isinstance(keep, bool) or not isinstance(keep, (int, float)):
        raise ValueError(f"config.diff.keep={keep!r} must be a number.")
    if isinstance(keep, float) and not 0.0 < keep <= 1.0:
        raise ValueError(
            f"config.diff.keep={keep!r}: a float keep is the share of entries "
            "kept, in (0, 1] (0.01 keeps 1%); for a number of entries give an "
            "int with diff.prune_schedule='final'."
        )
    if isinstance(keep, int) and keep < 1:
        raise ValueError(f"config.diff.keep={keep!r} keeps no entry; use >= 1.")
    if schedule == "gradual" and not isinstance(keep, float):
        raise ValueError(
            "diff.prune_schedule='gradual' needs diff.keep as a fraction in (0, 1], "
            f"got {keep!r}; use prune_schedule='final' for a count."
        )
    if d.get("erasure", "off") not in ("auto", "on", "off"):
        raise ValueError(
            f"config.diff.erasure={d.erasure!r} is not one of ('auto', 'on', "
            "'off') (auto: the attribute diffs trained without counterfactual "
            "swaps)."
        )
    share = d.get("erasure_share", 0.0)
    if (
        isinstance(share, bool)
        or not isinstance(share, (int, float))
        or not 0 <= share < 1
    ):
        raise ValueError(
            f"config.diff.erasure_share={share!r}: the share of each attribute "
            "diff's budget given to its closed-form eraser, in [0, 1) (0: off)."
        )
    rounds = d.get("erasure_rounds", 1)
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(
            f"config.diff.erasure_rounds={rounds!r}: how many times each eraser "
            "is fit in its rows, each on the model the previous fits erased; an "
            "int >= 1 (1: once)."
        )
    erasing = share and d.get("erasure", "off") == "on"
    if erasing and (d.get("scope", "global") != "global" or d.structured):
        raise ValueError(
            "config.diff.erasure='on' writes whole rows of one matrix, which a "
            "per-leaf or structured budget cannot hold: set diff.scope='global' "
            "and diff.structured=False, or diff.erasure='auto' (skips it here) "
            "or 'off'."
        )
    if schedule == "gradual" and d.structured:
        raise ValueError(
            "config.diff.prune_schedule='gradual' prunes entries, not whole "
            "tensors: set config.diff.prune_schedule='final' with diff.structured."
        )
