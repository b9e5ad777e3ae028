"""Binary weight masks: SRNets mask training and iterative magnitude pruning.

Two subnetwork transforms over a frozen parameter pytree ``base``:

* **SRNets mask training** (Liu et al., NeurIPS 2022, scheme ``MaskedLinear1``).
  Every selected matrix ``W`` has a real-valued score tensor ``S`` of the same
  shape (the trainable state) and a per-matrix threshold. The effective weight
  is ``W * M`` with the binary mask ``M = 1[S > threshold]``; the backward pass
  is straight-through, ``dL/dS := dL/dM = (dL/dW_eff) * W``. Thresholds are
  reset host-side (or in a separate jitted call) at logging steps so that each
  matrix keeps an exact number of entries, and stay fixed in between, so the
  sparsity may drift between resets exactly as in the reference trainer.
* **IMP** (iterative magnitude pruning, with or without rewinding): boolean
  masks over the selected matrices; each round prunes a fraction of the
  *remaining* entries of every matrix by smallest ``|w|``.

Tree conventions. ``scores`` and IMP ``masks`` are *subtrees* of the params
(see :mod:`moddiffy_jax.subnets.selection`): nested dicts holding only the
selected leaves, each with the shape of its weight (a Flax ``Dense`` kernel is
``[in, out]``, a PyTorch ``Linear.weight`` is ``[out, in]``: transpose masks
when moving between the two). ``thresholds`` has the structure of ``scores``
with one :class:`Threshold` node per leaf. Masks are ``bool`` arrays
(``uint8`` is accepted on input, e.g. from storage), never ``None``.

Exact counts and ties. A sparsity ``s`` keeps exactly ``round((1 - s) * n)``
entries of an ``n``-entry matrix (Python ``round``: half to even). Entries are
ordered by ``(score, flat index)`` (row-major flat index in the Flax layout),
so ties are broken deterministically: among equal scores the lower flat index
is pruned first. A :class:`Threshold` is the last pruned element of that order,
``(value, index)``, and an entry is kept iff ``(S, i) > (value, index)``
lexicographically. This is the reference's strict ``S > tau`` whenever
``index == -1`` and makes the count exact even with tied scores.

Differences from the reference code (llyx97/sparse-and-robust-PLM):

* Counts. The reference prunes ``k = floor(n * s)`` entries; here
  ``n - round((1 - s) * n)`` are pruned. They agree unless ``n * s`` is
  fractional (then they differ by at most one entry per matrix), and ``round``
  is immune to float noise such as ``100 * 0.29 = 28.999...``.
* Ties. The reference uses a float threshold (the k-th smallest score, reset
  only if it is below ``max(S)``), so tied scores may prune more than ``k``
  entries; the magnitude init likewise prunes every ``|w|`` tied with the k-th
  smallest. Here the ``(value, index)`` threshold prunes exactly the target
  count, so the ``< max(S)`` guard is unnecessary and is not reproduced.
  IMP ties (``torch.topk`` order is unspecified) are broken by flat index too.
* Gradual sparsity. The reference saves the best mask after resetting the
  thresholds to the *initial* sparsity (spec section A4, a bug in gradual
  mode). Nothing here resets to the initial sparsity implicitly: callers
  reset with :func:`reset_thresholds` at the current scheduled target.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from moddiffy_jax.subnets import selection

PyTree = Any
Array = jax.Array

#: Default score threshold tau_0 of the reference (``--threshold``); the
#: magnitude init sets kept scores to ``2 * tau_0``.
DEFAULT_THRESHOLD = 0.01


@flax.struct.dataclass
class Threshold:
    """A per-matrix threshold with a deterministic tie-break.

    An entry with score ``s`` at row-major flat index ``i`` is kept iff
    ``s > value or (s == value and i > index)``. ``index == -1`` gives the
    plain strict threshold ``s > value``; ``value == -inf, index == -1`` keeps
    every (finite or ``-inf``) score.

    Attributes:
      value: scalar array in the dtype of the scores it applies to.
      index: int32 scalar array, a flat index into the matrix or -1.
    """

    value: Array
    index: Array


@flax.struct.dataclass
class MaskState:
    """SRNets mask-training state.

    Attributes:
      scores: subtree of the params; one float32 score per selected matrix
        entry (same shapes as the weights). This is what is trained.
      thresholds: the structure of ``scores`` with a :class:`Threshold` per
        leaf. Not trained; changed only by :func:`reset_thresholds`.
    """

    scores: PyTree
    thresholds: PyTree


def _concrete_float(x: Any) -> float | None:
    """``float(x)``, or None when ``x`` is a tracer."""
    try:
        return float(x)
    except jax.errors.ConcretizationTypeError:
        return None


def _check_fraction(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must lie in [0, 1], got {value}.")


def _num_pruned(n: int, sparsity: float | Array) -> int | Array:
    """Entries to prune in an ``n``-entry matrix: ``n - round((1 - s) * n)``.

    With a concrete ``sparsity`` the count is an exact Python int. A traced
    ``sparsity`` (e.g. a schedule value inside jit) gives an int32 computed in
    float32, which can differ by one only for very large ``n`` at an exact
    half-way point.
    """
    s = _concrete_float(sparsity)
    if s is not None:
        _check_fraction("sparsity", s)
        return n - round((1.0 - s) * n)
    keep = jnp.round((1.0 - jnp.asarray(sparsity, jnp.float32)) * n)
    return n - jnp.clip(keep, 0, n).astype(jnp.int32)


@jax.jit
def _threshold_at(scores: Array, k: Array) -> Threshold:
    """The k-th entry (1-based) in ``(score, flat index)`` order; none if k == 0."""
    flat = jnp.ravel(scores)
    order = jnp.argsort(flat, stable=True)
    last = order[jnp.maximum(k - 1, 0)]
    return Threshold(
        value=jnp.where(k > 0, flat[last], -jnp.inf).astype(flat.dtype),
        index=jnp.where(k > 0, last, -1).astype(jnp.int32),
    )


def _leaf_threshold(scores: Array, sparsity: float | Array) -> Threshold:
    n = int(np.size(scores))
    if n == 0:
        return Threshold(
            value=jnp.asarray(-jnp.inf, scores.dtype), index=jnp.asarray(-1, jnp.int32)
        )
    return _threshold_at(scores, jnp.asarray(_num_pruned(n, sparsity), jnp.int32))


def thresholds_for_sparsity(scores: PyTree, *, sparsity: float | Array) -> PyTree:
    """Per-matrix thresholds that keep exactly ``round((1 - sparsity) * n)`` entries.

    For every leaf, the pruned entries are the first ``n - keep`` in
    ``(score, flat index)`` order, so the count is exact even with tied
    scores (lower flat index pruned first among ties). Jit-able; ``sparsity``
    may be traced (see the module docstring on counts).

    Args:
      scores: subtree of float score arrays, any shapes.
      sparsity: fraction of entries to prune in each matrix, in [0, 1].

    Returns:
      The structure of ``scores`` with one :class:`Threshold` per leaf.
    """
    return jax.tree.map(lambda s: _leaf_threshold(s, sparsity), scores)


def binary_masks(scores: PyTree, thresholds: PyTree) -> PyTree:
    """Boolean masks ``1[(S, i) > (value, index)]`` for each scored matrix.

    Args:
      scores: subtree of float score arrays.
      thresholds: structure of ``scores`` with a :class:`Threshold` per leaf,
        e.g. from :func:`thresholds_for_sparsity`.

    Returns:
      A bool subtree shaped like ``scores``; True means kept.
    """
    return jax.tree.map(_leaf_mask, scores, thresholds)


@jax.jit
def _leaf_mask(scores: Array, threshold: Threshold) -> Array:
    index = jnp.arange(scores.size, dtype=jnp.int32).reshape(scores.shape)
    value = threshold.value
    return (scores > value) | ((scores == value) & (index > threshold.index))


@jax.custom_vjp
def straight_through(scores: Array, mask: Array) -> Array:
    """Returns ``mask`` with the gradient routed to ``scores`` unchanged.

    Forward: ``mask`` (a float 0/1 array of the scores' shape and dtype).
    Backward: the cotangent of the output goes to ``scores`` as is
    (``dL/dS := dL/dM``); ``mask`` gets a zero cotangent.
    """
    del scores
    return mask


def _straight_through_fwd(scores: Array, mask: Array) -> tuple[Array, None]:
    del scores
    return mask, None


def _straight_through_bwd(_: None, g: Array) -> tuple[Array, Array]:
    return g, jnp.zeros_like(g)


straight_through.defvjp(_straight_through_fwd, _straight_through_bwd)


def apply_masks(
    base: PyTree,
    scores: PyTree,
    *,
    sparsity: float | Array | None = None,
    thresholds: PyTree | None = None,
) -> PyTree:
    """Effective params ``base * M(scores)`` with a straight-through gradient.

    The value uses the binary mask; the gradient with respect to ``scores``
    equals the gradient with respect to a real-valued mask at ``M``, i.e.
    ``dL/dS = (dL/dW_eff) * W``. Pure and jit-able; ``base`` is not modified
    and its leaves outside ``scores`` are returned as they are.

    Args:
      base: the frozen parameter pytree.
      scores: subtree of ``base`` with one score per selected entry.
      sparsity: if given, thresholds are recomputed from the scores for this
        exact per-matrix sparsity (a top-k mask every call).
      thresholds: if given, the fixed per-matrix thresholds to use (the
        reference behaviour between resets). Exactly one of ``sparsity`` and
        ``thresholds`` must be given.

    Returns:
      A pytree with the structure of ``base``; masked leaves have the dtype of
      their base leaf.
    """
    if (sparsity is None) == (thresholds is None):
        raise ValueError("Pass exactly one of sparsity= and thresholds=.")
    if thresholds is None:
        thresholds = thresholds_for_sparsity(scores, sparsity=sparsity)
    masks = binary_masks(scores, thresholds)

    def mask_leaf(w: Array, s: Array, m: Array) -> Array:
        return w * straight_through(s, m.astype(s.dtype)).astype(w.dtype)

    return selection.map_subtree(mask_leaf, base, scores, masks)


def _magnitude_keep(weights: PyTree, sparsity: float) -> PyTree:
    mags = jax.tree.map(lambda w: jnp.abs(w).astype(jnp.float32), weights)
    return binary_masks(mags, thresholds_for_sparsity(mags, sparsity=sparsity))


def _fixed_thresholds(scores: PyTree, value: float) -> PyTree:
    return jax.tree.map(
        lambda s: Threshold(
            value=jnp.asarray(value, s.dtype), index=jnp.asarray(-1, jnp.int32)
        ),
        scores,
    )


def _init_magnitude(weights, sparsity, threshold, dtype):
    keep = _magnitude_keep(weights, sparsity)
    scores = jax.tree.map(
        lambda k: jnp.where(k, 2.0 * threshold, 0.0).astype(dtype), keep
    )
    return MaskState(scores=scores, thresholds=_fixed_thresholds(scores, threshold))


def _init_magnitude_soft(weights, sparsity, threshold, dtype):
    del threshold
    scores = jax.tree.map(lambda w: jnp.abs(w).astype(dtype), weights)
    return MaskState(
        scores=scores, thresholds=thresholds_for_sparsity(scores, sparsity=sparsity)
    )


def _init_constant(weights, sparsity, threshold, dtype):
    scores = jax.tree.map(lambda w: jnp.full(w.shape, 2.0 * threshold, dtype), weights)
    return MaskState(
        scores=scores, thresholds=thresholds_for_sparsity(scores, sparsity=sparsity)
    )


_SCORE_INITS: dict[str, Callable[..., MaskState]] = {
    "magnitude": _init_magnitude,
    "magnitude_soft": _init_magnitude_soft,
    "constant": _init_constant,
}


def init_scores(
    params: PyTree,
    include: str | Iterable[str],
    *,
    exclude: str | Iterable[str] = (),
    init: str = "magnitude",
    sparsity: float,
    threshold: float = DEFAULT_THRESHOLD,
    dtype: Any = jnp.float32,
) -> MaskState:
    """Initial SRNets scores and thresholds for the selected matrices.

    In every variant the initial binary mask prunes exactly
    ``n - round((1 - sparsity) * n)`` entries of each matrix.

    * ``"magnitude"`` (reference ``--controlled_init magnitude``, used by all
      scripts): ``S = 2 * threshold`` on the ``round((1 - sparsity) * n)``
      largest-``|w|`` entries (ties: higher flat index kept) and ``S = 0``
      elsewhere, with the fixed threshold ``tau_0 = threshold`` (0.01), so
      ``S`` is in ``{0, 0.02}``. Keep this scale: with AdamW at lr 2e-5 an
      entry needs hundreds of consistent steps to cross the threshold.
    * ``"magnitude_soft"`` (reference init for gradual sparsity):
      ``S = |w|`` and thresholds at ``sparsity`` (the initial sparsity of the
      schedule).
    * ``"constant"``: ``S = 2 * threshold`` everywhere with thresholds at
      ``sparsity``; with all scores tied, the lowest flat indices are pruned
      (so this is meant for ``sparsity=0``, a dense start).

    Args:
      params: the frozen parameter pytree.
      include: path rules selecting the matrices to mask (see
        :func:`selection.select_paths`); biases, LayerNorm and embeddings are
        normally left out.
      exclude: path rules removing leaves from the selection.
      init: one of ``"magnitude"``, ``"magnitude_soft"``, ``"constant"``.
      sparsity: initial per-matrix sparsity in [0, 1].
      threshold: the reference threshold ``tau_0``.
      dtype: the scores' dtype.

    Returns:
      A :class:`MaskState` whose ``scores`` subtree has the selected leaves'
      shapes.

    Raises:
      ValueError: for an unknown ``init`` (the message lists the valid ones),
        a sparsity outside [0, 1], or rules that select nothing.
    """
    if init not in _SCORE_INITS:
        raise ValueError(f"Unknown init {init!r}; valid: {sorted(_SCORE_INITS)}.")
    _check_fraction("sparsity", float(sparsity))
    weights = selection.select(params, include, exclude=exclude)
    return _SCORE_INITS[init](weights, sparsity, threshold, dtype)


def reset_thresholds(state: MaskState, *, sparsity: float | Array) -> MaskState:
    """The reference's logging-step reset: thresholds at an exact target sparsity.

    Args:
      state: current mask state.
      sparsity: the target (e.g. the cubic schedule's current value); may be
        traced.

    Returns:
      ``state`` with ``thresholds = thresholds_for_sparsity(state.scores, ...)``.
    """
    return state.replace(
        thresholds=thresholds_for_sparsity(state.scores, sparsity=sparsity)
    )


def cubic_sparsity_schedule(
    *,
    initial: float,
    final: float,
    begin_step: float,
    end_step: float,
    frequency: float = 1,
) -> Callable[[Any], Array]:
    """Gradual sparsity of Zhu & Gupta (2018), as an optax-style schedule.

    ``s_t = s_f + (s_i - s_f) * (1 - (t - t_0) / (n * dt))**3`` with
    ``t_0 = begin_step``, ``n * dt = end_step - begin_step`` and
    ``dt = frequency``: the value changes only every ``frequency`` steps after
    ``begin_step`` (``t`` is rounded down to ``t_0 + j * dt``). It is
    ``initial`` before ``begin_step`` and ``final`` from ``end_step`` on.
    Steps may be fractional (the reference uses fractional epochs, with
    ``t_0 = 0``, ``t_1 = num_epochs``, ``s_i = 0.7``, ``s_f = 0.9``).

    Args:
      initial: sparsity ``s_i`` at and before ``begin_step``.
      final: sparsity ``s_f`` at and after ``end_step``.
      begin_step: ``t_0``.
      end_step: ``t_1 >= t_0``.
      frequency: update interval ``dt > 0``.

    Returns:
      A function ``step -> sparsity`` (float32 scalar array), jnp-compatible
      and usable on traced steps.
    """
    if end_step < begin_step:
        raise ValueError(f"end_step {end_step} < begin_step {begin_step}.")
    if frequency <= 0:
        raise ValueError(f"frequency must be positive, got {frequency}.")
    span = float(end_step - begin_step)

    def schedule(step: Any) -> Array:
        t = jnp.asarray(step, jnp.float32)
        if span == 0.0:
            return jnp.where(t < begin_step, initial, final).astype(jnp.float32)
        elapsed = jnp.floor(jnp.clip(t - begin_step, 0.0, span) / frequency)
        elapsed = jnp.where(t >= end_step, span, elapsed * frequency)
        frac = jnp.minimum(elapsed / span, 1.0)
        return (final + (initial - final) * (1.0 - frac) ** 3).astype(jnp.float32)

    return jax.jit(schedule)


# --------------------------------------------------------------------------
# Iterative magnitude pruning (IMP).


def init_masks(
    params: PyTree, include: str | Iterable[str], *, exclude: str | Iterable[str] = ()
) -> PyTree:
    """All-True boolean masks for the selected matrices (the IMP start).

    Args:
      params: the parameter pytree.
      include: path rules selecting the matrices to prune (the reference IMP
        prunes the encoder matrices and the pooler, not the classifier).
      exclude: path rules removing leaves from the selection.

    Returns:
      A bool subtree with the selected leaves' shapes.
    """
    weights = selection.select(params, include, exclude=exclude)
    return jax.tree.map(lambda w: jnp.ones(w.shape, bool), weights)


def imp_round_fraction(round_index: int, *, num_rounds: int = 10) -> float:
    """The reference IMP fraction ``1 / (num_rounds - k)`` for round ``k``.

    Pruning this fraction of the remaining weights in rounds ``k = 0 ..
    num_rounds - 1`` removes ``1 / num_rounds`` of the original entries per
    round (10%, 20%, ..., 100% cumulative with the default).
    """
    if not 0 <= round_index < num_rounds:
        raise ValueError(
            f"round_index must be in [0, {num_rounds}), got {round_index}."
        )
    return 1.0 / (num_rounds - round_index)


def imp_prune(params: PyTree, masks: PyTree, *, fraction: float) -> PyTree:
    """One IMP round: per matrix, prune ``fraction`` of the remaining entries.

    For each masked matrix with ``r`` remaining (True) entries, exactly
    ``round(fraction * r)`` more entries are pruned (Python ``round``, as
    PyTorch's ``l1_unstructured`` on the unpruned slice): those with the
    smallest ``|w|`` among the remaining ones, ties broken by lower flat
    index first. Host-side (a phase transition between jitted loops): the
    counts are exact Python ints, so this is not meant to be jitted.

    Args:
      params: current parameters (the trained weights; ``|w|`` is measured on
        them at the remaining entries).
      masks: bool (or uint8) subtree of ``params``; True means kept.
      fraction: fraction of the remaining entries to prune, in [0, 1].

    Returns:
      New bool masks with the structure of ``masks``.
    """
    _check_fraction("fraction", float(fraction))

    def target(n: int, remaining: int) -> int:
        return n - remaining + round(fraction * remaining)

    return _prune_remaining(params, masks, target)


def _prune_remaining(params: PyTree, masks: PyTree, target: Callable) -> PyTree:
    """Per matrix, prunes the ``target(n, remaining)`` first entries in
    (pruned, ``|w|``, flat index) order; the shared body of the IMP rounds."""
    weights = selection.subtree(params, selection.tree_paths(masks))

    def one(w: Array, m: Array) -> Array:
        m = jnp.asarray(m).astype(bool)
        if m.shape != w.shape:
            raise ValueError(f"Mask shape {m.shape} != weight shape {w.shape}.")
        count = target(m.size, int(jnp.sum(m)))
        return _keep_above_rank(w, m, jnp.asarray(count, jnp.int32))

    return jax.tree.map(one, weights, masks)


def imp_prune_to(params: PyTree, masks: PyTree, *, sparsity: float) -> PyTree:
    """An IMP round to an exact cumulative per-matrix sparsity.

    Each masked matrix of ``n`` entries keeps exactly ``round((1 - sparsity)
    * n)`` entries: the largest ``|w|`` among those it still keeps (ties:
    lower flat index pruned first). Pruned entries stay pruned. With
    ``sparsity = s * (k + 1) / R`` in round ``k`` this is the reference's
    schedule (``1 / (R - k)`` of the remaining entries per round for
    ``s = 1``) without its per-round rounding drift. Host-side.

    Args:
      params: current parameters.
      masks: bool (or uint8) subtree of ``params``; True means kept.
      sparsity: cumulative fraction of each matrix to prune, in [0, 1]; it
        must not be below a matrix's current sparsity.

    Returns:
      New bool masks with the structure of ``masks``.
    """
    _check_fraction("sparsity", float(sparsity))

    def target(n: int, remaining: int) -> int:
        count = _num_pruned(n, float(sparsity))
        if count < n - remaining:
            raise ValueError(
                f"Sparsity {sparsity} would un-prune entries ({n - remaining} of {n} "
                "are already pruned); IMP sparsity can only grow."
            )
        return count

    return _prune_remaining(params, masks, target)


@jax.jit
def _keep_above_rank(w: Array, m: Array, target: Array) -> Array:
    """Keeps entries of rank >= target in (pruned first, |w|, flat index) order."""
    n = m.size
    key = jnp.where(m, jnp.abs(w).astype(jnp.float32), -jnp.inf).ravel()
    order = jnp.argsort(key, stable=True)
    ranks = jnp.zeros(n, jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))
    return (ranks >= target).reshape(m.shape)


def apply_binary_masks(params: PyTree, masks: PyTree) -> PyTree:
    """``params`` with masked-out entries set to (positive) zero.

    Args:
      params: a parameter pytree.
      masks: bool (or uint8) subtree of ``params``; True means kept.

    Returns:
      A pytree with the structure and dtypes of ``params``; leaves outside
      ``masks`` are returned as they are. Pure and jit-able.
    """
    return selection.map_subtree(
        lambda w, m: jnp.where(jnp.asarray(m).astype(bool), w, jnp.zeros_like(w)),
        params,
        masks,
    )


def rewind(params: PyTree, masks: PyTree, rewind_params: PyTree) -> PyTree:
    """IMP weight rewinding: reset to ``rewind_params``, then re-apply the masks.

    Every leaf of ``rewind_params`` replaces the leaf at the same path of
    ``params``; then every masked leaf is zeroed where its mask is False. The
    reference rewinds every ``bert.*`` tensor (encoder, embeddings,
    LayerNorm, pooler) to the pre-trained values but *not* the classifier:
    pass ``rewind_params`` as the subtree without the classifier head.

    Args:
      params: current parameter pytree.
      masks: bool subtree of ``params``; True means kept.
      rewind_params: a subtree of ``params`` (or the full tree) holding the
        values to rewind to, e.g. the pre-trained weights.

    Returns:
      A pytree with the structure of ``params``: kept entries of rewound
      leaves equal ``rewind_params`` exactly, pruned entries are 0, leaves
      outside ``rewind_params`` keep their current values (masked).
    """
    return apply_binary_masks(selection.merge(params, rewind_params), masks)


def mask_sparsity(masks: PyTree) -> tuple[Array, dict[str, Array]]:
    """Fraction of pruned (False) entries, overall and per leaf.

    Counts mask entries only (the reference's ``see_weight_rate`` counts zeros
    of ``W * M``, which also includes weights that are exactly zero).

    Args:
      masks: bool (or uint8) subtree.

    Returns:
      ``(overall, per_leaf)``: a float32 scalar over all entries of all
      leaves, and ``{path: float32 scalar}`` keyed by "/"-joined paths.
      Jit-able.
    """
    flat = selection.flatten(masks)
    pruned = {p: jnp.sum(~jnp.asarray(m).astype(bool)) for p, m in flat.items()}
    total = sum(int(np.size(m)) for m in flat.values())
    per_leaf = {
        p: (pruned[p] / max(int(np.size(m)), 1)).astype(jnp.float32)
        for p, m in flat.items()
    }
    overall = (sum(pruned.values()) / max(total, 1)).astype(jnp.float32)
    return overall, per_leaf
