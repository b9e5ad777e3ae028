"""Erasers fitted on composed diffs: one correction per set of diffs.

Each attribute's eraser (:mod:`moddiffy_jax.methods.erasure_refit`) is fit
on the core with *its own* diff added. Composed, two such erasers remove
little: each reads a coordinate that the other diff has moved (measured on
the main job's MMD diffs, stop 55: core + both closes 0.18 of gender's gap
and 0.12 of age's, where each diff alone passes its floor). Fitting the same
rows again on the composed model, one attribute after the other, passes
both floors at the same task cost (offline, stop 55: gender 0.854, age
0.720; floors 0.892, 0.748).

So when training ends, for every set of two or more diffs of which at
least one is erased, this module fits their erasers again, in the rows each
diff's own eraser holds, on ``core + the trained parts of those diffs``
(each erased diff with its own eraser taken out; a diff without one, as a
swap diff beside an MMD diff in a mixed ``auto`` run, added as it is: its
words' removal moves the coordinates the other's eraser reads, stop 78),
attribute after attribute in the run's order, each fit
reading the model with the previous ones written in (``diff.erasure_rounds``
times over). What it stores is the
*correction*: the new erasers minus the diffs' own, as a sparse diff over
those rows of the last FFN output kernel and its bias, named
``gender+age``. Adding it to ``core + gender + age`` gives exactly the
refit composition; it applies to that set only, at weight 1 each (the
composition table adds it to that row; with other weights it is left
out). Its size is at most the sum of the diffs' eraser rows (half of one
diff's budget per attribute at the default share).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from moddiffy_jax.methods import erasure_refit as er
from moddiffy_jax.subnets import diffs as diffs_lib

#: Joins the attribute names of a correction: ``gender+age``.
SEPARATOR = "+"


def joint_name(subset: Sequence[str]) -> str:
    return SEPARATOR.join(subset)


def is_joint(name: str) -> bool:
    """Whether ``name`` names a correction (``gender+age``), not a diff."""
    return SEPARATOR in name


def members(name: str) -> frozenset[str]:
    """The attributes a correction applies to, as a set."""
    return frozenset(name.split(SEPARATOR))


def split_joint(
    diffs: Mapping[str, diffs_lib.SparseDiff],
) -> tuple[dict[str, diffs_lib.SparseDiff], dict[str, diffs_lib.SparseDiff]]:
    """``(diffs, corrections)`` of a mapping holding both."""
    plain = {n: d for n, d in diffs.items() if not is_joint(n)}
    joint = {n: d for n, d in diffs.items() if is_joint(n)}
    return plain, joint


def correction_for(
    joint: Mapping[str, diffs_lib.SparseDiff], weights: Mapping[str, float]
) -> diffs_lib.SparseDiff | None:
    """The correction to add to a composition of the diffs in ``weights``
    (name -> weight; weight 0 = left out): the one fitted for exactly the
    diffs added, where each has weight 1; else None."""
    added = frozenset(n for n, w in weights.items() if w != 0.0)
    if len(added) < 2 or any(weights[n] != 1.0 for n in added):
        return None
    return next((d for n, d in joint.items() if members(n) == added), None)


def subsets(names: Sequence[str], max_size: int | None = None) -> list[tuple]:
    """Every set of two or more ``names``, smaller first, in their order."""
    top = len(names) if max_size is None else min(max_size, len(names))
    return [c for r in range(2, top + 1) for c in itertools.combinations(names, r)]


def negated(additions: Mapping) -> dict:
    return {p: (idx, -np.asarray(val)) for p, (idx, val) in additions.items()}


def as_diff(
    template: diffs_lib.SparseDiff,
    paths: Sequence[str],
    name: str,
    additions: Sequence[Mapping] = (),
    info: Mapping | None = None,
) -> diffs_lib.SparseDiff:
    """A sparse diff over ``paths`` only (shapes and base from ``template``)
    holding the sum of ``additions`` (each path -> (flat indices, values))."""
    shapes = dict(template.shapes)
    dtype = np.dtype(template.dtype)
    sd = dataclasses.replace(
        template,
        indices={p: np.zeros(0, np.int32) for p in paths},
        values={p: np.zeros(0, dtype) for p in paths},
        shapes=tuple((p, tuple(shapes[p])) for p in paths),
        name=name,
        info_json=json.dumps(dict(info or {}), sort_keys=True),
    )
    for extra in additions:
        sd = er.add_entries(sd, extra)
    return sd


def correction(
    ctx: Any,
    core: Any,
    refits: Mapping[str, er.Refit],
    subset: Sequence[str],
    settings: er.Settings,
    compose: Any,
    forward: Any,
    plain: Mapping[str, diffs_lib.SparseDiff] | None = None,
) -> tuple[diffs_lib.SparseDiff, dict]:
    """The correction of ``subset`` (attribute names, each with its
    :class:`~moddiffy_jax.methods.erasure_refit.Refit`, or in ``plain``: a
    diff without an eraser, as one trained with the swaps, added as it is
    while the others' erasers are fitted on the composition) and a record.

    ``compose(params, [sparse diffs]) -> params``; ``forward`` gives the
    split's batches.
    """
    plain = plain or {}
    erased = [a for a in subset if a in refits]
    bert = ctx.model.bert_config
    paths = er.output_paths(bert.num_hidden_layers)
    split = er.fit_split(ctx, settings)
    task = np.asarray(split.task)
    fn = er.feature_fn(ctx.model)
    # core + each diff without its own eraser.
    trained = [
        er.add_entries(refits[a].diff, negated(refits[a].additions))
        if a in refits
        else plain[a]
        for a in subset
    ]
    params = compose(core, trained)
    template = refits[erased[0]].diff
    new, record = [], {}
    for _ in range(settings.rounds):
        for attribute in erased:
            y, g = er.features(fn, forward, params, split)
            labels = np.asarray(split.attrs[attribute])
            additions, fit = er.write_eraser(
                y, g, task, labels, refits[attribute].units, paths, settings.ridge
            )
            record.setdefault(attribute, fit)
            new.append(additions)
            params = compose(params, [as_diff(template, paths, attribute, [additions])])
    y, _ = er.features(fn, forward, params, split)
    for attribute in erased:
        labels = np.asarray(split.attrs[attribute])
        after = er.fit_eraser(y, task, labels, ridge=settings.ridge)
        record[attribute]["separation_after"] = after.separation
    name = joint_name(subset)
    own = [negated(refits[a].additions) for a in erased]
    info = {"joint": list(subset), "ridge": settings.ridge}
    sd = as_diff(template, paths, name, new + own, info)
    return sd, {"attributes": record, "nnz": int(sd.nnz())}
