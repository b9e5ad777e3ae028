"""Per-role optimizers whose state holds only each role's own leaves.

``optax.partition`` keeps, for every role, the inner optimizer's state over
the whole parameter tree, with an ``optax.MaskedNode`` wherever a leaf has
another role. With seven learning-rate roles and Adam's two moments that
is a tree of 28,674 nodes for a BERT-base MoDDiffy-par state (12,012 of
them placeholders), which the host flattens and rebuilds on every train
step (13 and 49 ms on the project's CPU; docs/speed.md, stop 52): on a
GPU, time the device waits.

:func:`role_partition` computes the same updates (each leaf through its
role's transformation, elementwise as before) from a state that stores,
per role, the inner state over a flat dict of that role's leaves keyed by
their "/"-joined paths (``selection.flatten``). Roles no leaf has get no
state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import optax

from moddiffy_jax.subnets import selection


class RolePartitionState(NamedTuple):
    """``inner_states[role]``: the role's optimizer state over the dict of
    its leaves keyed by path."""

    inner_states: dict[str, Any]


def role_partition(
    transforms: Mapping[str, optax.GradientTransformation],
    labels: Callable[[Any], Any],
) -> optax.GradientTransformation:
    """Each leaf updated by ``transforms[role]``, ``role`` from ``labels``
    (a function of the tree giving a tree of role names of its structure).

    Raises:
      ValueError: a leaf's role has no transformation.
    """

    def groups(tree) -> dict[str, list[tuple[int, str]]]:
        paths = selection.tree_paths(tree)
        by_role: dict[str, list[tuple[int, str]]] = {}
        for i, (path, role) in enumerate(
            zip(paths, jax.tree.leaves(labels(tree)), strict=True)
        ):
            by_role.setdefault(role, []).append((i, path))
        missing = sorted(set(by_role) - set(transforms))
        if missing:
            raise ValueError(
                f"no optimizer for the role(s) {missing}; roles with one: "
                f"{sorted(transforms)}."
            )
        return by_role

    def init(params):
        leaves = jax.tree.leaves(params)
        return RolePartitionState(
            {
                role: transforms[role].init({p: leaves[i] for i, p in entries})
                for role, entries in groups(params).items()
            }
        )

    def update(updates, state, params=None):
        leaves, treedef = jax.tree.flatten(updates)
        p_leaves = None if params is None else jax.tree.leaves(params)
        out = list(leaves)
        new_states = {}
        for role, entries in groups(updates).items():
            sub = {p: leaves[i] for i, p in entries}
            sub_params = (
                None if p_leaves is None else {p: p_leaves[i] for i, p in entries}
            )
            sub, new_states[role] = transforms[role].update(
                sub, state.inner_states[role], sub_params
            )
            for i, p in entries:
                out[i] = sub[p]
        return jax.tree.unflatten(treedef, out), RolePartitionState(new_states)

    return optax.GradientTransformation(init, update)


def under(flat: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """The entries of a path-keyed dict below ``prefix``, as a nested dict
    (e.g. Adam's ``nu`` of one diff's ``delta``)."""
    head = prefix + selection.PATH_SEP
    return selection.unflatten(
        {p[len(head) :]: v for p, v in flat.items() if p.startswith(head)}
    )
