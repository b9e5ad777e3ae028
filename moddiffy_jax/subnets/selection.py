"""Which leaves take part: path rules over flattened parameter names.

A parameter pytree (nested dicts, as produced by flax.linen) is addressed by
"/"-joined key paths, e.g. ``"encoder/layer_3/attention/query/kernel"``.
Rules are regular expressions matched with ``re.fullmatch`` against those
paths. A rule that matches nothing is an error: a typo must never silently
select an empty subnetwork.

A *subtree* is a nested dict with the same structure as the params but only
the selected leaves. Subnetwork states (diff values, gate logits, mask scores)
are subtrees, so they are plain pytrees that optax and Orbax handle directly.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax

PyTree = Any
PATH_SEP = "/"


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_str(keypath: Sequence[Any]) -> str:
    """Turns a jax key path into a "/"-joined name."""
    return PATH_SEP.join(_key_name(k) for k in keypath)


def flatten(tree: PyTree) -> dict[str, Any]:
    """Flattens a pytree into ``{path: leaf}`` in leaf order."""
    flat = {}
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        flat[path_str(keypath)] = leaf
    return flat


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`flatten` for nested-dict trees."""
    out: dict[str, Any] = {}
    for path, leaf in flat.items():
        node = out
        *parents, last = path.split(PATH_SEP)
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ValueError(f"Path {path!r} conflicts with a leaf at {p!r}.")
        if last in node:
            raise ValueError(f"Duplicate path {path!r}.")
        node[last] = leaf
    return out


def tree_paths(tree: PyTree) -> list[str]:
    """All leaf paths of ``tree`` in leaf order."""
    return list(flatten(tree))


def _as_rules(rules: str | Iterable[str]) -> list[str]:
    if isinstance(rules, str):
        return [rules]
    return list(rules)


def _preview(paths: Sequence[str], n: int = 12) -> str:
    shown = ", ".join(paths[:n])
    more = f" ... ({len(paths) - n} more)" if len(paths) > n else ""
    return shown + more


def select_paths(
    tree: PyTree,
    include: str | Iterable[str],
    *,
    exclude: str | Iterable[str] = (),
) -> list[str]:
    """Paths of the leaves matched by any ``include`` rule and no ``exclude`` rule.

    Args:
      tree: a parameter pytree (or a ``{path: leaf}`` dict of one).
      include: regex rules (``re.fullmatch`` on "/"-joined paths).
      exclude: regex rules removing leaves from the selection.

    Returns:
      The selected paths, in the tree's leaf order.

    Raises:
      ValueError: if an include or exclude rule matches no leaf at all, or if
        the selection ends up empty.
    """
    paths = tree_paths(tree)
    include, exclude = _as_rules(include), _as_rules(exclude)
    for kind, rules in (("include", include), ("exclude", exclude)):
        for rule in rules:
            pattern = re.compile(rule)
            if not any(pattern.fullmatch(p) for p in paths):
                raise ValueError(
                    f"The {kind} rule {rule!r} matches no parameter. Rules are "
                    "regexes matched in full against paths such as: "
                    f"{_preview(paths)}"
                )
    inc = [re.compile(r) for r in include]
    exc = [re.compile(r) for r in exclude]
    selected = [
        p
        for p in paths
        if any(r.fullmatch(p) for r in inc) and not any(r.fullmatch(p) for r in exc)
    ]
    if not selected:
        raise ValueError(
            f"The rules include={include} exclude={exclude} select no parameter."
        )
    return selected


def subtree(tree: PyTree, paths: Iterable[str]) -> dict[str, Any]:
    """The nested dict holding only the leaves at ``paths``."""
    flat = flatten(tree)
    missing = [p for p in paths if p not in flat]
    if missing:
        raise KeyError(f"Paths not in the tree: {_preview(missing)}")
    return unflatten({p: flat[p] for p in paths})


def select(
    tree: PyTree,
    include: str | Iterable[str],
    *,
    exclude: str | Iterable[str] = (),
) -> dict[str, Any]:
    """``subtree(tree, select_paths(tree, include, exclude=exclude))``."""
    return subtree(tree, select_paths(tree, include, exclude=exclude))


def merge(tree: PyTree, sub: PyTree) -> PyTree:
    """Returns ``tree`` with the leaves of ``sub`` put in their places.

    Pure: neither argument is modified. Every leaf of ``sub`` must exist in
    ``tree`` with the same path.
    """
    flat_sub = flatten(sub)
    seen = set()

    def replace(keypath, leaf):
        p = path_str(keypath)
        if p in flat_sub:
            seen.add(p)
            return flat_sub[p]
        return leaf

    out = jax.tree_util.tree_map_with_path(replace, tree)
    unknown = [p for p in flat_sub if p not in seen]
    if unknown:
        raise KeyError(f"Subtree paths not in the tree: {_preview(unknown)}")
    return out


def map_subtree(
    fn: Callable[..., Any], tree: PyTree, sub: PyTree, *rest: PyTree
) -> PyTree:
    """Replaces each leaf of ``tree`` named in ``sub`` by ``fn(leaf, sub_leaf, ...)``.

    ``rest`` are further subtrees with the same structure as ``sub``. Leaves
    of ``tree`` outside ``sub`` are returned as they are (same objects).
    """
    flat_tree = flatten(tree)
    flat_sub = flatten(sub)
    flat_rest = [flatten(r) for r in rest]
    new = {}
    for p, s in flat_sub.items():
        if p not in flat_tree:
            raise KeyError(f"Subtree path {p!r} is not in the tree.")
        new[p] = fn(flat_tree[p], s, *(r[p] for r in flat_rest))
    return merge(tree, unflatten(new))


def assign_roles(tree: PyTree, rules: Sequence[tuple[str, str]]) -> PyTree:
    """Gives every leaf a role label from ``(regex, role)`` rules; first match wins.

    The result has the structure of ``tree`` with string leaves, ready for
    ``optax.multi_transform`` / ``optax.partition``.

    Raises:
      ValueError: if a rule matches no leaf, or a leaf is matched by no rule.
    """
    paths = tree_paths(tree)
    compiled = [(re.compile(r), role) for r, role in rules]
    used = [False] * len(compiled)
    roles = {}
    for p in paths:
        for i, (pattern, role) in enumerate(compiled):
            if pattern.fullmatch(p):
                roles[p] = role
                used[i] = True
                break
    unused = [rules[i][0] for i, u in enumerate(used) if not u]
    if unused:
        raise ValueError(
            f"Role rules {unused} match no parameter (or only parameters an "
            f"earlier rule already took). Paths look like: {_preview(paths)}"
        )
    uncovered = [p for p in paths if p not in roles]
    if uncovered:
        raise ValueError(
            f"No role rule covers these parameters: {_preview(uncovered)}. "
            "Add a rule for them (e.g. ('.*', 'frozen'))."
        )
    return jax.tree_util.tree_map_with_path(lambda kp, _: roles[path_str(kp)], tree)
