"""moddiffy_jax.subnets: pure pytree transforms that define subnetworks.

One concept per module:

* :mod:`~moddiffy_jax.subnets.selection`: which leaves (path rules, subtrees).
* :mod:`~moddiffy_jax.subnets.hard_concrete`: hard-concrete gates and the
  expected-L0 penalty.
* :mod:`~moddiffy_jax.subnets.diffs`: dense and sparse diffs, their algebra,
  magnitude pruning and the sparse-diff file format.
* :mod:`~moddiffy_jax.subnets.masks`: straight-through, magnitude and IMP masks.
* :mod:`~moddiffy_jax.subnets.gates`: FFW gates.
"""

from moddiffy_jax.subnets.diffs import (
    FORMAT_VERSION,
    DiffState,
    PackedDiffs,
    SparseDiff,
    apply_dense_diff,
    apply_diffs,
    apply_packed,
    apply_sparse_values,
    check_base,
    dense_diff_values,
    diff_gates,
    fingerprint,
    init_diff,
    l0_penalty,
    load_sparse_diff,
    pack_diffs,
    prune_to_sparsity,
    save_sparse_diff,
    unpack,
)
from moddiffy_jax.subnets.hard_concrete import (
    HardConcrete,
    deterministic_gate,
    deterministic_gates,
    expected_l0,
    prob_nonzero,
    sample_gate,
    sample_gates,
    sample_gates_n,
)
from moddiffy_jax.subnets.selection import (
    assign_roles,
    flatten,
    map_subtree,
    merge,
    path_str,
    select,
    select_paths,
    subtree,
    tree_paths,
    unflatten,
)

# -----------------------------------------------------------------------------
# masks and gates (written by another engineer): exported as modules only.
# LEAD: reconcile here, e.g. re-export their public names and extend __all__.
# -----------------------------------------------------------------------------
from moddiffy_jax.subnets import gates, masks  # noqa: E402  isort: skip

__all__ = [
    # selection
    "assign_roles",
    "flatten",
    "map_subtree",
    "merge",
    "path_str",
    "select",
    "select_paths",
    "subtree",
    "tree_paths",
    "unflatten",
    # hard_concrete
    "HardConcrete",
    "deterministic_gate",
    "deterministic_gates",
    "expected_l0",
    "prob_nonzero",
    "sample_gate",
    "sample_gates",
    "sample_gates_n",
    # diffs
    "FORMAT_VERSION",
    "DiffState",
    "PackedDiffs",
    "SparseDiff",
    "apply_dense_diff",
    "apply_diffs",
    "apply_packed",
    "apply_sparse_values",
    "check_base",
    "dense_diff_values",
    "diff_gates",
    "fingerprint",
    "init_diff",
    "l0_penalty",
    "load_sparse_diff",
    "pack_diffs",
    "prune_to_sparsity",
    "save_sparse_diff",
    "unpack",
    # modules
    "gates",
    "masks",
]
