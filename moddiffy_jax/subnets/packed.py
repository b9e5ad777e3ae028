"""Packed diffs: one compiled function for any K sparse diffs of one selection."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from moddiffy_jax.subnets.selection import (
    flatten,
    merge,
    unflatten,
)
from moddiffy_jax.subnets.sparse_diff import _MAX_LEAF_SIZE, SparseDiff, _host

PyTree = Any


# -----------------------------------------------------------------------------
# Packed diffs: one compiled function for any K diffs of one selection.
# -----------------------------------------------------------------------------


@flax.struct.dataclass
class PackedDiffs:
    """K sparse diffs of one selection, packed into two ``[K, nnz]`` arrays.

    :func:`apply_diffs` compiles per leaf paths and nnz *per leaf*; diffs
    pruned to one global budget have the same total nnz but a different split
    over the leaves, so swapping them recompiles. Packed, the per-leaf split
    becomes data: indices address the concatenation of all selected leaves'
    flattened entries, so jitted code depends only on ``K``, the capacity
    ``nnz``, the selection (``paths_shapes``), ``dtype`` and
    ``base_fingerprint``. Build it with :func:`pack_diffs`, apply it with
    :func:`apply_packed`.

    Diff names are deliberately not stored (they would be static, hence part
    of jit's cache key); :func:`pack_diffs` returns them alongside.

    Padding: row ``k`` holds diff ``k``'s entries first (leaf order, then
    flat index ascending) and is padded at the end with index
    ``num_selected`` (one past the last entry, the *pad index*) and value 0.
    :func:`apply_packed` drops out-of-range indices, so padding never touches
    the params whatever the weights (even inf or NaN), and :func:`unpack`
    recovers every diff exactly, stored zeros included.

    Attributes:
      indices: ``int32[K, nnz]``, positions in the concatenation of the
        selected leaves' flattened entries, in ``paths_shapes`` order; the pad
        index ``num_selected`` marks unused slots.
      values: ``dtype[K, nnz]``, the diff values (0 in unused slots).
      paths_shapes: static ``((path, shape), ...)`` of every selected leaf, in
        the base's leaf order (:attr:`SparseDiff.shapes` of the packed diffs).
      dtype: static name of the values' dtype, e.g. ``"float32"``.
      base_fingerprint: static :func:`fingerprint` of the base params shared by
        the packed diffs ("" if unknown). Constant for one base, so it does not
        cause retraces when switching diffs.
    """

    indices: jax.Array
    values: jax.Array
    paths_shapes: tuple[tuple[str, tuple[int, ...]], ...] = flax.struct.field(
        pytree_node=False
    )
    dtype: str = flax.struct.field(pytree_node=False)
    base_fingerprint: str = flax.struct.field(pytree_node=False, default="")

    @property
    def paths(self) -> tuple[str, ...]:
        """Paths of the selected leaves, in leaf order."""
        return tuple(p for p, _ in self.paths_shapes)

    @property
    def num_diffs(self) -> int:
        """K, the number of packed diffs (static)."""
        return int(np.shape(self.indices)[0])

    @property
    def capacity(self) -> int:
        """nnz, the number of slots per diff (static)."""
        return int(np.shape(self.indices)[1])

    @property
    def num_selected(self) -> int:
        """N, the total number of entries of the selected leaves (the pad index)."""
        return sum(math.prod(s) for _, s in self.paths_shapes)

    def offsets(self) -> tuple[int, ...]:
        """Start of each selected leaf in the concatenation (static, len = leaves)."""
        sizes = [math.prod(s) for _, s in self.paths_shapes]
        return tuple(int(o) for o in np.cumsum([0, *sizes[:-1]]))


def pack_diffs(
    diffs: Sequence[SparseDiff], *, nnz: int | None = None
) -> tuple[PackedDiffs, tuple[str, ...]]:
    """Packs K sparse diffs of one selection into a :class:`PackedDiffs` (host-side).

    Args:
      diffs: K >= 1 sparse diffs sharing dtype and base fingerprint, e.g. one
        per protected attribute, pruned with any budgets and scopes. Their
        leaves may differ (the pack covers the union); a leaf in several
        diffs must have one shape.
      nnz: capacity (slots per diff). Default: the largest ``diff.nnz()``.
        Pass a fixed capacity so that packs of diffs with different budgets
        (or a different largest diff) share one compiled function.

    Returns:
      ``(packed, names)``: ``packed.indices`` int32 ``[K, nnz]`` and
      ``packed.values`` ``[K, nnz]`` (see :class:`PackedDiffs` for the layout
      and padding), and ``names[k] == diffs[k].name``.

    Raises:
      ValueError: if ``diffs`` is empty; if the diffs differ in leaf paths,
        shapes, dtype or base fingerprint; if ``nnz`` is smaller than a diff's
        nnz; if a diff index is out of its leaf's range; or if the selected
        leaves hold 2**31 - 1 entries or more (int32 indices).
    """
    diffs = list(diffs)
    if not diffs:
        raise ValueError("pack_diffs needs at least one diff.")
    first = diffs[0]
    for k, d in enumerate(diffs[1:], start=1):
        for what, a, b in (
            ("dtype", first.dtype, d.dtype),
            ("base fingerprint", first.base_fingerprint, d.base_fingerprint),
        ):
            if a != b:
                raise ValueError(
                    f"pack_diffs needs diffs with the same {what}: diff 0 "
                    f"({first.name!r}) has {a!r}, diff {k} ({d.name!r}) has {b!r}."
                )
    # The union of the diffs' leaves (a MoDDiffy diff over every tensor and a
    # pruning over the kernels only pack together); a leaf must have one shape.
    union: dict[str, tuple[int, ...]] = {}
    owner: dict[str, int] = {}
    for k, d in enumerate(diffs):
        for p, shape in d.shapes:
            if p in union and union[p] != tuple(shape):
                raise ValueError(
                    f"pack_diffs needs one shape per leaf: {p!r} is {union[p]} in "
                    f"diff {owner[p]} ({diffs[owner[p]].name!r}) and {tuple(shape)} "
                    f"in diff {k} ({d.name!r})."
                )
            union.setdefault(p, tuple(shape))
            owner.setdefault(p, k)
    shapes = tuple(union.items())
    sizes = [math.prod(s) for _, s in shapes]
    total = sum(sizes)
    if total > _MAX_LEAF_SIZE - 1:
        raise ValueError(
            f"The selected leaves hold {total} entries; packed int32 indices "
            f"(pad index {total} included) need fewer than {_MAX_LEAF_SIZE}."
        )
    offsets = np.cumsum([0, *sizes[:-1]])
    offset_of = {p: int(o) for (p, _), o in zip(shapes, offsets, strict=True)}
    size_of = dict(zip(union, sizes, strict=True))
    largest = max(d.nnz() for d in diffs)
    if nnz is None:
        nnz = largest
    elif not isinstance(nnz, (int, np.integer)) or isinstance(nnz, bool) or nnz < 0:
        raise ValueError(f"nnz must be a non-negative int, got {nnz!r}.")
    elif nnz < largest:
        raise ValueError(
            f"nnz={nnz} is below the largest diff's nnz ({largest}: "
            f"{[d.name for d in diffs if d.nnz() == largest]})."
        )
    nnz = int(nnz)
    dtype = jnp.dtype(first.dtype)
    indices = np.full((len(diffs), nnz), total, np.int32)
    values = np.zeros((len(diffs), nnz), dtype)
    for k, d in enumerate(diffs):
        idx_parts, val_parts = [], []
        for p, _ in d.shapes:
            size, off = size_of[p], offset_of[p]
            idx = _host(d.indices[p]).astype(np.int64)
            if idx.size and (idx.min() < 0 or idx.max() >= size):
                raise ValueError(
                    f"Diff {k} ({d.name!r}): indices of leaf {p!r} are outside "
                    f"[0, {size})."
                )
            idx_parts.append(idx + off)
            val_parts.append(_host(d.values[p]))
        n = d.nnz()
        if n:
            indices[k, :n] = np.concatenate(idx_parts)
            values[k, :n] = np.concatenate(val_parts)
    packed = PackedDiffs(
        indices=jnp.asarray(indices),
        values=jnp.asarray(values),
        paths_shapes=shapes,
        dtype=first.dtype,
        base_fingerprint=first.base_fingerprint,
    )
    return packed, tuple(d.name for d in diffs)


def apply_packed(
    base: PyTree, packed: PackedDiffs, weights: Sequence[float] | jax.Array
) -> PyTree:
    """Effective params ``base + sum_k weights[k] * diff_k`` for packed diffs.

    One scatter-add of all ``K * nnz`` weighted values into a flat zero buffer
    of the ``N`` selected entries (padding dropped), split at static offsets,
    reshaped, cast to each base leaf's dtype and added to it. Pure and
    jit-able with ``packed`` and ``weights`` as arguments: the compiled
    function depends only on ``K``, ``nnz``, ``packed``'s static fields and
    the weights' dtype, so switching diffs (same K, same capacity) or weights
    never recompiles.

    Numerics: where supports are disjoint the result equals
    :func:`apply_diffs` bitwise; where they overlap, the weighted values are
    summed first (in an unspecified order) and then added to the base, so it
    matches :func:`apply_diffs` only up to rounding. Every selected entry gets
    ``+ 0`` at least, so an entry ``-0.0`` in the base becomes ``+0.0``.
    Unselected leaves are returned as they are. Memory: one extra buffer of
    ``N`` entries (in the dtype of ``weights * values``).

    Args:
      base: the parameter pytree the diffs were trained on (not checked
        against ``packed.base_fingerprint``; see :func:`check_base`).
      packed: from :func:`pack_diffs`, its leaves present in ``base`` with the
        same shapes.
      weights: ``[K]`` one scalar per diff (may be 0 to disable a diff, or
        negative); a float array or a sequence of floats.

    Returns:
      A pytree with the structure, shapes and dtypes of ``base``.

    Raises:
      ValueError: (at trace time) if ``weights`` does not have shape ``[K]``
        or a packed leaf is missing from ``base`` or has another shape.
    """
    weights = jnp.asarray(weights)
    if weights.shape != (packed.num_diffs,):
        raise ValueError(
            f"weights has shape {weights.shape}; expected ({packed.num_diffs},), "
            "one weight per packed diff."
        )
    flat_base = flatten(base)
    problems = []
    for p, shape in packed.paths_shapes:
        if p not in flat_base:
            problems.append(f"{p}: not in the base")
        elif tuple(np.shape(flat_base[p])) != tuple(shape):
            problems.append(
                f"{p}: packed shape {tuple(shape)} != base shape "
                f"{tuple(np.shape(flat_base[p]))}"
            )
    if problems:
        raise ValueError("Packed diffs do not fit the base: " + "; ".join(problems))
    updates = weights[:, None] * packed.values
    flat = jnp.zeros((packed.num_selected,), updates.dtype)
    flat = flat.at[packed.indices.reshape(-1)].add(updates.reshape(-1), mode="drop")
    updated = {}
    for (p, shape), off in zip(packed.paths_shapes, packed.offsets(), strict=True):
        leaf = jnp.asarray(flat_base[p])
        seg = jax.lax.slice_in_dim(flat, off, off + math.prod(shape))
        updated[p] = leaf + seg.reshape(shape).astype(leaf.dtype)
    return merge(base, unflatten(updated))


def unpack(packed: PackedDiffs, names: Sequence[str], k: int) -> SparseDiff:
    """Diff ``k`` of a pack as a :class:`SparseDiff`, padding dropped (host-side).

    Exact inverse of :func:`pack_diffs` for indices and values (stored zeros
    are kept: only slots holding the pad index are dropped). Rules and info
    are not packed, so they come back empty.

    Args:
      packed: from :func:`pack_diffs`.
      names: the names returned with it (``len(names) == K``).
      k: which diff, ``0 <= k < K``.

    Returns:
      A :class:`SparseDiff` named ``names[k]`` with ``packed``'s shapes, dtype
      and base fingerprint.

    Raises:
      ValueError: if ``names`` does not have K entries or ``k`` is out of range.
    """
    if len(names) != packed.num_diffs:
        raise ValueError(f"Got {len(names)} names for {packed.num_diffs} diffs.")
    if not 0 <= k < packed.num_diffs:
        raise ValueError(f"k={k} is outside [0, {packed.num_diffs}).")
    idx = _host(packed.indices[k]).astype(np.int64)
    vals = _host(packed.values[k])
    keep = idx != packed.num_selected
    idx, vals = idx[keep], vals[keep]
    indices, values = {}, {}
    for (p, shape), off in zip(packed.paths_shapes, packed.offsets(), strict=True):
        in_leaf = (idx >= off) & (idx < off + math.prod(shape))
        indices[p] = jnp.asarray((idx[in_leaf] - off).astype(np.int32))
        values[p] = jnp.asarray(vals[in_leaf])
    return SparseDiff(
        indices=indices,
        values=values,
        shapes=packed.paths_shapes,
        dtype=packed.dtype,
        name=str(names[k]),
        base_fingerprint=packed.base_fingerprint,
    )
