"""Diff subnetworks: dense hard-concrete diffs, sparse diffs, their algebra and files.

Two representations of "what a debiasing module changes in the base params":

* :class:`DiffState` (phase 1, dense): for each selected leaf a diff ``delta``
  and hard-concrete gate locations ``log_alpha`` of the same shape (plus one
  scalar group gate per leaf in the structured variant). The effective params
  are ``base + z * delta`` (:func:`apply_dense_diff`), the sparsity term is the
  expected L0 (:func:`l0_penalty`).
* :class:`SparseDiff` (after pruning; fixmask phase and inference): for each
  selected leaf the flat indices and values of its non-zero entries. Several
  compose as ``base + sum_k w_k * diff_k`` (:func:`apply_diffs`) with the
  diffs passed to jitted code as arguments.

Phase 1 -> fixmask is the host-side transform
``prune_to_sparsity(dense_diff_values(state), keep=...)``.

Every transform is pure: the base is never modified, so there is nothing to
revert. Trees are the nested dicts of :mod:`moddiffy_jax.subnets.selection`;
a *subtree* holds only the selected leaves, addressed by "/"-joined paths.

This module gathers the public names of four smaller ones:
:mod:`~moddiffy_jax.subnets.dense_diff` (phase 1),
:mod:`~moddiffy_jax.subnets.sparse_diff` (sparse diffs, their algebra and
magnitude pruning), :mod:`~moddiffy_jax.subnets.diff_files` (the file format)
and :mod:`~moddiffy_jax.subnets.packed` (one compiled function for any K
diffs).
"""

from moddiffy_jax.subnets.dense_diff import (
    CLOSED_LOG_ALPHA,
    FIXED_LOG_ALPHA,
    DiffState,
    apply_dense_diff,
    close_gates,
    dense_diff_values,
    diff_gates,
    fix_gates,
    fixed_kept,
    init_diff,
    is_fixed,
    l0_penalty,
    open_entries,
)
from moddiffy_jax.subnets.diff_files import (
    FORMAT_NAME,
    FORMAT_VERSION,
    METADATA_KEY,
    check_base,
    load_sparse_diff,
    save_sparse_diff,
)
from moddiffy_jax.subnets.packed import PackedDiffs, apply_packed, pack_diffs, unpack
from moddiffy_jax.subnets.sparse_diff import (
    PyTree,
    Rules,
    SparseDiff,
    apply_diffs,
    apply_sparse_values,
    fingerprint,
    magnitude_keep_mask,
    prune_to_sparsity,
    pruning_diff,
)

__all__ = [
    "CLOSED_LOG_ALPHA",
    "FIXED_LOG_ALPHA",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "METADATA_KEY",
    "DiffState",
    "PackedDiffs",
    "PyTree",
    "Rules",
    "SparseDiff",
    "apply_dense_diff",
    "apply_diffs",
    "apply_packed",
    "apply_sparse_values",
    "check_base",
    "close_gates",
    "dense_diff_values",
    "diff_gates",
    "fix_gates",
    "fixed_kept",
    "fingerprint",
    "init_diff",
    "is_fixed",
    "l0_penalty",
    "load_sparse_diff",
    "magnitude_keep_mask",
    "open_entries",
    "pack_diffs",
    "prune_to_sparsity",
    "pruning_diff",
    "save_sparse_diff",
    "unpack",
]
