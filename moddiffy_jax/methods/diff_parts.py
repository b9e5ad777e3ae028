"""How one diff's parameters join the encoder's: the static settings, the
sparse add of the fixmask phase, one diff part in either phase, and the
other attributes' diffs a composing debias step sees
(``config.diff.compose_prob``). Re-exported by :mod:`methods.common`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from moddiffy_jax.subnets import diffs as diffs_lib
from moddiffy_jax.subnets import hard_concrete, selection

PyTree = Any


@dataclasses.dataclass(frozen=True)
class DiffSettings:
    """Static hyperparameters of the diffs of one run."""

    hc: hard_concrete.HardConcrete
    straight_through: bool
    l0_weight: float
    # Parameter paths the model reads only by rows (its word embeddings): in
    # training a diff builds just the rows a batch reads (dense_diff.GatedRows).
    gathered: tuple[str, ...] = ()


def add_sparse(
    base: PyTree, indices: Mapping[str, Any], values: Mapping[str, Any]
) -> PyTree:
    """``base`` plus a scatter of ``values`` at flat ``indices`` (nested dicts)."""

    def add(leaf, idx, val):
        flat = leaf.reshape(-1).at[idx].add(val.astype(leaf.dtype))
        return flat.reshape(leaf.shape)

    return selection.map_subtree(add, base, indices, values)


def apply_diff_part(
    base: PyTree,
    part: Any,
    indices: Any,
    *,
    phase: str,
    settings: DiffSettings,
    rng: jax.Array | None,
    train: bool,
) -> PyTree:
    """Adds one diff (a DiffState in ``l0``, sparse values in ``fixmask``, or
    its dense form there: a DiffState with fixed gates, :func:`is_dense`)."""
    if is_dense(phase, part):
        return diffs_lib.apply_dense_diff(
            base,
            part,
            rng=rng,
            hc=settings.hc,
            train=train,
            straight_through=settings.straight_through,
            gathered=settings.gathered,
        )
    return add_sparse(base, indices, part)


def is_dense(phase: str, part: Any) -> bool:
    """Whether a diff part is a DiffState: every part in ``l0``, and in
    ``fixmask`` a diff cut to its dense form (``diff.fixmask_state``). Such a
    part is added through its gates and carries the L0 term, which for fixed
    gates is a constant without gradient, so the fixmask step is the L0
    phase's program."""
    return phase == "l0" or isinstance(part, diffs_lib.DiffState)


def others_present(others: Sequence[str], prob: float, rng: jax.Array) -> dict:
    """One draw per other attribute's diff: whether a composing debias step
    adds it (probability ``prob``)."""
    return {
        other: jax.random.bernoulli(jax.random.fold_in(rng, i), prob)
        for i, other in enumerate(others)
    }


def with_other_diffs(
    method: Any,
    trainable: Mapping[str, Any],
    frozen: Mapping[str, Any],
    others: Sequence[str],
    prob: float,
    rng: jax.Array,
    *,
    phase: str,
    settings: DiffSettings,
    present: Mapping[str, jax.Array] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(trainable, frozen)`` whose core (or frozen base) carries each of the
    ``others``' diffs with probability ``prob`` (one draw per diff and step,
    :func:`others_present` from ``rng`` unless ``present`` gives them;
    deterministic gates in ``l0``; no gradient reaches them).

    A debias step that sees its attribute's diff beside the others' learns a
    removal that still holds when the diffs are composed
    (``config.diff.compose_prob``).
    """
    key = "core" if method.encoder == "full" else "base"
    tree = trainable if key == "core" else frozen
    params = tree[key]
    indices = frozen.get("indices", {}).get("diffs", {})
    if present is None:
        present = others_present(others, prob, rng)
    for other in others:
        part = jax.lax.stop_gradient(trainable["diffs"][other])
        added = apply_diff_part(
            params,
            part,
            indices.get(other),
            phase=phase,
            settings=settings,
            rng=None,
            train=False,
        )
        params = jax.tree.map(
            lambda a, b, p=present[other]: jnp.where(p, a, b), added, params
        )
    if key == "core":
        return {**trainable, "core": params}, dict(frozen)
    return dict(trainable), {**frozen, "base": params}
