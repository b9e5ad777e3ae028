"""Dense (phase-1) diffs: per-entry deltas behind hard-concrete gates.

For each selected leaf a :class:`DiffState` holds a diff ``delta`` and gate
locations ``log_alpha`` of the same shape (plus one scalar group gate per leaf
in the structured variant). The effective params are ``base + z * delta``
(:func:`apply_dense_diff`), the sparsity term is the expected L0
(:func:`l0_penalty`). Pure transforms: the base is never modified.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from moddiffy_jax.subnets import noise
from moddiffy_jax.subnets.hard_concrete import (
    HardConcrete,
    deterministic_gates,
    expected_l0,
    gate_from_uniform,
    sample_gate_list,
    sample_gates,
)
from moddiffy_jax.subnets.selection import (
    flatten,
    map_subtree,
    path_str,
    select,
)

PyTree = Any

# -----------------------------------------------------------------------------
# Dense (phase-1) diffs.
# -----------------------------------------------------------------------------


@flax.struct.dataclass
class DiffState:
    """Trainable state of one dense hard-concrete diff (phase 1).

    All fields are subtrees of the base params (nested dicts holding only the
    selected leaves), so the state is a plain pytree for optax and Orbax.

    Attributes:
      delta: the diff; each leaf has the shape and dtype of its base leaf and
        starts at zero.
      log_alpha: gate locations, one per entry of ``delta`` (same shapes,
        float32), initialised to ``hc.init_log_alpha``.
      group_log_alpha: structured variant only: one float32 scalar (shape
        ``()``) per selected leaf, same nested structure as ``delta``. An
        empty dict in the unstructured case.
    """

    delta: PyTree
    log_alpha: PyTree
    group_log_alpha: PyTree

    @property
    def structured(self) -> bool:
        """Whether the state carries one group gate per leaf."""
        return bool(jax.tree.leaves(self.group_log_alpha))


def init_diff(
    params: PyTree,
    include: str | Sequence[str],
    *,
    exclude: str | Sequence[str] = (),
    hc: HardConcrete = HardConcrete(),
    structured: bool = False,
) -> DiffState:
    """Creates a zero diff over the leaves of ``params`` selected by path rules.

    Args:
      params: the base parameter pytree (nested dicts).
      include: regex rules (``re.fullmatch`` on "/"-joined paths) selecting
        the leaves that get a diff.
      exclude: regex rules removing leaves from the selection.
      hc: hard-concrete hyperparameters (``init_log_alpha`` is used).
      structured: also create one group gate per selected leaf (spec §2.4).

    Returns:
      A :class:`DiffState` whose ``delta`` is zeros shaped like the selected
      leaves (their dtype), ``log_alpha`` float32 filled with
      ``hc.init_log_alpha``, ``group_log_alpha`` scalars or ``{}``.

    Raises:
      ValueError: from the selection, if a rule matches nothing.
    """
    sub = select(params, include, exclude=exclude)
    delta = jax.tree.map(jnp.zeros_like, sub)
    log_alpha = jax.tree.map(
        lambda x: jnp.full(jnp.shape(x), hc.init_log_alpha, jnp.float32), sub
    )
    group = (
        jax.tree.map(lambda _: jnp.full((), hc.init_log_alpha, jnp.float32), sub)
        if structured
        else {}
    )
    return DiffState(delta=delta, log_alpha=log_alpha, group_log_alpha=group)


def diff_gates(
    state: DiffState,
    rng: jax.Array | None,
    *,
    hc: HardConcrete = HardConcrete(),
    train: bool,
) -> PyTree:
    """The gates ``z`` of a diff, one per entry of ``state.delta``.

    In training, ``z`` is sampled with a distinct key per leaf (and, in the
    structured variant, the group gates with keys from a second split of
    ``rng``); otherwise it is the deterministic gate. Structured: ``z = z_elem
    * z_group`` with the scalar group gate broadcast over the leaf.

    Args:
      state: the dense diff.
      rng: a PRNG key; required when ``train`` is True, ignored otherwise.
      hc: hard-concrete hyperparameters.
      train: sample (True) or use the deterministic gate (False).

    Returns:
      A subtree shaped like ``state.delta`` with float32 gates in ``[0, 1]``.
    """
    structured = state.structured
    if train:
        if rng is None:
            raise ValueError("diff_gates(train=True) needs an rng key.")
        if structured:
            rng, group_rng = jax.random.split(rng)
            z_group = sample_gates(state.group_log_alpha, group_rng, hc=hc)
        z = sample_gates(state.log_alpha, rng, hc=hc)
    else:
        z = deterministic_gates(state.log_alpha, hc=hc)
        if structured:
            z_group = deterministic_gates(state.group_log_alpha, hc=hc)
    if structured:
        z = jax.tree.map(lambda a, b: a * b, z, z_group)
    return z


def apply_dense_diff(
    base: PyTree,
    state: DiffState,
    *,
    rng: jax.Array | None = None,
    hc: HardConcrete = HardConcrete(),
    train: bool,
    straight_through: bool = True,
    gathered: Sequence[str] = (),
) -> PyTree:
    """Effective params ``base + z * delta`` on the selected leaves.

    Pure: ``base`` is not modified and its unselected leaves are returned as
    they are. The value is ``base + z * delta`` in both modes; they differ in
    the gradient reaching ``delta`` (``g`` is the gradient wrt the effective
    leaf):

    * ``straight_through=True`` (MoDDiffy [M], spec §2.1/§13.1): built as
      ``base + z * delta + (delta - stop_gradient(delta))``, which equals the
      reference's ``f - sg(f - w0) + z * (f - w0)`` with ``f = w0 + delta``.
      Gradient wrt ``delta`` is ``(1 + z) * g``: entries whose gate is closed
      keep learning, as in full fine-tuning.
    * ``straight_through=False`` (DiffPruning [G]): gradient wrt ``delta`` is
      ``z * g``.

    In both, the gradient wrt ``log_alpha`` is ``g * delta * dz/dlog_alpha``.

    Args:
      base: the frozen parameter pytree.
      state: the dense diff (subtrees of ``base``).
      rng: a PRNG key; required when ``train`` is True.
      hc: hard-concrete hyperparameters.
      train: sample the gates (True) or use deterministic gates (False).
      straight_through: the gradient convention above.
      gathered: paths (``selection.flatten`` form) of 2-D leaves that the
        model reads only by rows (its word embeddings, ``model.gathered_rows``):
        in training they are returned as :class:`GatedRows`, computed for the
        rows a batch reads. Unstructured diffs only.

    Returns:
      A pytree with the structure, shapes and dtypes of ``base`` (with
      :class:`GatedRows` at the ``gathered`` paths in training).
    """
    if train and gathered and not state.structured:
        return _apply_with_gathered_rows(
            base, state, rng, hc, straight_through, tuple(gathered)
        )
    z = diff_gates(state, rng, hc=hc, train=train)
    return map_subtree(
        lambda w0, d, g, la: _combine(w0, d, g, straight_through, la),
        base,
        state.delta,
        z,
        state.log_alpha,
    )


def _combine(w0, delta, gate, straight_through: bool, log_alpha=None):
    """``w0 + gate * delta`` (plus the straight-through term), in ``w0``'s dtype.

    Entries whose gate is fixed (:data:`FIXED_LOG_ALPHA`, the dense form of the
    fixmask phase) get no straight-through term: their gradient is ``z * g``,
    the kept entries' ``g`` and the dropped ones' 0, as a sparse diff's. The
    term adds an exact zero to the value either way."""
    out = w0 + gate.astype(delta.dtype) * delta
    if straight_through:
        through = delta - jax.lax.stop_gradient(delta)
        if log_alpha is not None:
            through = jnp.where(
                jnp.abs(log_alpha) < FIXED_BELOW, through, jnp.zeros_like(through)
            )
        out = out + through
    return out.astype(jnp.result_type(w0))


@flax.struct.dataclass
class GatedRows:
    """A gated-diff table that is only ever read by rows (word embeddings).

    ``take_rows(ids)`` is ``jnp.take(base + z * delta, ids, axis=0)`` with the
    gates ``z`` of the rows read and nothing else: the noise of those rows is
    the full draw's (``noise.uniform_rows``), so the values are the dense
    table's bit for bit, while the forward and backward passes touch
    ``len(ids)`` rows instead of the whole vocabulary. Each distinct row is
    built once and indexed, so a repeated id's gradients are summed before
    the gate's backward, as for the dense table: the gradients equal the
    dense table's exactly (an unread row's may be +0.0 where it was -0.0).
    """

    base: jax.Array
    delta: jax.Array
    log_alpha: jax.Array
    key: jax.Array
    hc: HardConcrete = flax.struct.field(pytree_node=False)
    straight_through: bool = flax.struct.field(pytree_node=False)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.base.shape)

    @property
    def dtype(self):
        return self.base.dtype

    def take_rows(self, ids: jax.Array) -> jax.Array:
        flat = jnp.asarray(ids).reshape(-1)
        # Each distinct row once: a repeated id's gradients are summed onto
        # its row (in occurrence order, as the dense table's scatter sums
        # them) before the gate's backward, so the gradients are the dense
        # table's bit for bit.
        rows, inverse = jnp.unique(
            flat, size=flat.shape[0], fill_value=flat[0], return_inverse=True
        )
        u = noise.uniform_rows(self.key, self.base.shape, rows)
        log_alpha = jnp.take(self.log_alpha, rows, axis=0)
        gate = gate_from_uniform(log_alpha, u, hc=self.hc)
        table = _combine(
            jnp.take(self.base, rows, axis=0),
            jnp.take(self.delta, rows, axis=0),
            gate,
            self.straight_through,
            log_alpha,
        )
        out = jnp.take(table, inverse.reshape(-1), axis=0)
        return out.reshape(tuple(jnp.shape(ids)) + self.base.shape[1:])


def _apply_with_gathered_rows(base, state, rng, hc, straight_through, gathered):
    """:func:`apply_dense_diff` in training with the leaves at paths
    ``gathered`` left as :class:`GatedRows`; every leaf's key is the one
    :func:`~moddiffy_jax.subnets.hard_concrete.sample_gates` gives it."""
    if rng is None:
        raise ValueError("apply_dense_diff(train=True) needs an rng key.")
    leaves, treedef = jax.tree.flatten(state.log_alpha)
    keys = jax.tree.unflatten(treedef, list(jax.random.split(rng, len(leaves))))
    flat_base = flatten(base)
    flat_la, flat_delta, flat_keys = (
        flatten(state.log_alpha),
        flatten(state.delta),
        flatten(keys),
    )
    new, dense = {}, []
    for path, la in flat_la.items():
        w0, delta, key = flat_base[path], flat_delta[path], flat_keys[path]
        if path in gathered and jnp.ndim(w0) == 2:
            new[path] = GatedRows(w0, delta, la, key, hc, straight_through)
        else:
            dense.append(path)
    gates = sample_gate_list(
        [flat_la[p] for p in dense], [flat_keys[p] for p in dense], hc=hc
    )
    for path, gate in zip(dense, gates, strict=True):
        new[path] = _combine(
            flat_base[path], flat_delta[path], gate, straight_through, flat_la[path]
        )
    # Not selection.merge: it would flatten the GatedRows values as subtrees.
    return jax.tree_util.tree_map_with_path(
        lambda keypath, leaf: new.get(path_str(keypath), leaf), base
    )


def l0_penalty(state: DiffState, *, hc: HardConcrete = HardConcrete()) -> jax.Array:
    """Expected number of open gates: ``sum sigmoid(log_alpha - beta log(-l/r))``.

    This is the references' additive form (spec §2.3/§2.4): in the structured
    variant each leaf's group gate adds its own ``P(z_group > 0)`` once per
    tensor, ``sum_i P(z_i > 0) + P(z_group > 0)``, rather than the product
    ``sum_i P(z_i > 0) P(z_group > 0)``. Scale it by the penalty weight
    (1.25e-7 in the references) outside.

    Args:
      state: the dense diff.
      hc: hard-concrete hyperparameters.

    Returns:
      A float32 scalar.
    """
    return expected_l0(state.log_alpha, hc=hc) + expected_l0(
        state.group_log_alpha, hc=hc
    )


def dense_diff_values(state: DiffState, *, hc: HardConcrete = HardConcrete()) -> PyTree:
    """The diff in evaluation mode: deterministic ``z * delta`` (what pruning ranks).

    Args:
      state: the dense diff.
      hc: hard-concrete hyperparameters.

    Returns:
      A subtree shaped like ``state.delta`` (same dtypes).
    """
    z = diff_gates(state, None, hc=hc, train=False)
    return jax.tree.map(lambda d, g: g.astype(d.dtype) * d, state.delta, z)


#: Gate location of a closed entry: its deterministic gate and every sample
#: are exactly 0 (the noise's log-odds are bounded by ``log((1 - eps) / eps)``),
#: so the entry gets no gradient and stays closed.
CLOSED_LOG_ALPHA = -50.0

#: Gate location of an entry fixed by the cut to the fixmask phase in its
#: dense form (:func:`fix_gates`): ``+FIXED_LOG_ALPHA`` kept (every sample and
#: the deterministic gate exactly 1), ``-FIXED_LOG_ALPHA`` dropped (exactly
#: 0). Neither gets a gradient (the gate, the L0 term and their derivatives
#: saturate), and :func:`_combine` gives fixed entries no straight-through
#: term, so the dense step trains exactly the kept entries, as the sparse one.
FIXED_LOG_ALPHA = 1e6
#: Gates at or beyond this magnitude count as fixed (an L0 phase's gates stay
#: far below it; the fixed ones far above, whatever their optimizer does).
FIXED_BELOW = 1e5


def open_entries(state: DiffState) -> PyTree:
    """Bool subtree shaped like ``state.delta``: True where the gate is not
    closed for good by :func:`close_gates` (what a later cut may keep)."""
    return jax.tree.map(lambda la: la > CLOSED_LOG_ALPHA / 2, state.log_alpha)


def close_gates(state: DiffState, keep: PyTree) -> DiffState:
    """Closes every entry outside ``keep``: ``delta = 0`` and a shut gate.

    Gradual pruning inside the L0 phase (a host-side transform between jitted
    steps) uses this, so the later exact cut finds the budget already met.

    Args:
      state: an unstructured dense diff.
      keep: bool subtree shaped like ``state.delta``; True keeps the entry.

    Returns:
      The new state (``state`` is not modified).
    """
    if state.structured:
        raise ValueError("close_gates supports unstructured diffs only.")
    delta = jax.tree.map(
        lambda d, k: jnp.where(k, d, jnp.zeros_like(d)), state.delta, keep
    )
    log_alpha = jax.tree.map(
        lambda la, k: jnp.where(k, la, jnp.asarray(CLOSED_LOG_ALPHA, la.dtype)),
        state.log_alpha,
        keep,
    )
    return state.replace(delta=delta, log_alpha=log_alpha)


def fix_gates(state: DiffState, kept: PyTree, values: PyTree) -> DiffState:
    """The dense form of a cut diff: ``values`` at the ``kept`` entries (bool
    subtree shaped like ``state.delta``), every gate fixed open there and shut
    elsewhere (:data:`FIXED_LOG_ALPHA`), ``delta`` zero elsewhere.

    Its effective params, gradients and exports are those of the sparse diff
    of the same entries and values: an unstructured diff only."""
    if state.structured:
        raise ValueError(
            "fix_gates: a structured diff has group gates; use its sparse form."
        )
    delta = jax.tree.map(
        lambda d, k, v: jnp.where(k, jnp.asarray(v, d.dtype), jnp.zeros_like(d)),
        state.delta,
        kept,
        values,
    )
    log_alpha = jax.tree.map(
        lambda la, k: jnp.where(k, FIXED_LOG_ALPHA, -FIXED_LOG_ALPHA).astype(la.dtype),
        state.log_alpha,
        kept,
    )
    return state.replace(delta=delta, log_alpha=log_alpha)


def fixed_kept(state: DiffState) -> PyTree:
    """Bool subtree shaped like ``state.delta``: the kept entries of a diff in
    the dense form of :func:`fix_gates`."""
    return jax.tree.map(lambda la: la >= FIXED_BELOW, state.log_alpha)


def is_fixed(state: DiffState) -> bool:
    """Whether every gate of ``state`` is fixed (:func:`fix_gates`); host-side."""
    leaves = jax.tree.leaves(state.log_alpha)
    return bool(leaves) and all(
        bool(np.all(np.abs(np.asarray(la)) >= FIXED_BELOW)) for la in leaves
    )
