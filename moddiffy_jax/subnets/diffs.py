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
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from moddiffy_jax._files import publish_mode, temp_file_beside
from moddiffy_jax.subnets.hard_concrete import (
    HardConcrete,
    deterministic_gates,
    expected_l0,
    sample_gates,
)
from moddiffy_jax.subnets.selection import (
    flatten,
    map_subtree,
    merge,
    select,
    unflatten,
)

PyTree = Any
Rules = tuple[tuple[str, ...], tuple[str, ...]]

FORMAT_NAME = "moddiffy_sparse_diff"
FORMAT_VERSION = 1
METADATA_KEY = "moddiffy_sparse_diff"
_MAX_LEAF_SIZE = 2**31 - 1  # flat indices are int32

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

    Returns:
      A pytree with the structure, shapes and dtypes of ``base``.
    """
    z = diff_gates(state, rng, hc=hc, train=train)

    def combine(w0, delta, gate):
        gated = gate.astype(delta.dtype) * delta
        out = w0 + gated
        if straight_through:
            out = out + (delta - jax.lax.stop_gradient(delta))
        return out.astype(jnp.result_type(w0))

    return map_subtree(combine, base, state.delta, z)


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


def magnitude_keep_mask(
    values_subtree: PyTree, *, keep: int | float, scope: str = "global"
) -> PyTree:
    """Bool subtree marking the entries :func:`prune_to_sparsity` would keep."""
    sd = prune_to_sparsity(values_subtree, keep=keep, scope=scope)
    out = {}
    for path, leaf in flatten(values_subtree).items():
        mask = np.zeros(np.size(leaf), bool)
        mask[np.asarray(sd.indices[path])] = True
        out[path] = mask.reshape(np.shape(leaf))
    return unflatten(out)


# -----------------------------------------------------------------------------
# Fingerprints.
# -----------------------------------------------------------------------------


def _host(x: Any) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(jax.device_get(x)))


def fingerprint(params: PyTree) -> str:
    """A short content hash of a parameter pytree.

    SHA-256 over the leaves sorted by path, each contributing its path, shape,
    dtype and raw bytes (copied to host). Any change of a value, shape, dtype
    or path changes it.

    Args:
      params: a pytree of arrays.

    Returns:
      The first 16 hex characters of the digest.
    """
    h = hashlib.sha256()
    flat = flatten(params)
    for path in sorted(flat):
        a = _host(flat[path])
        header = json.dumps([path, list(a.shape), str(a.dtype)]).encode()
        h.update(len(header).to_bytes(8, "little"))
        h.update(header)
        data = a.reshape(-1).view(np.uint8)
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:16]


# -----------------------------------------------------------------------------
# Sparse diffs.
# -----------------------------------------------------------------------------


def _normalize_rules(rules: Any) -> Rules:
    """Rules in any accepted form -> ``(include_rules, exclude_rules)`` tuples.

    Accepted: a str; a sequence of str (include rules); an ``(include,
    exclude)`` pair whose items are str or sequences of str; a mapping with
    keys ``include`` / ``exclude``.
    """
    if isinstance(rules, str):
        return ((rules,), ())
    if isinstance(rules, Mapping):
        unknown = set(rules) - {"include", "exclude"}
        if unknown:
            raise ValueError(
                f"Unknown rule kinds {sorted(unknown)}; valid: include, exclude."
            )
        inc, exc = rules.get("include", ()), rules.get("exclude", ())
        inc = (inc,) if isinstance(inc, str) else tuple(inc)
        exc = (exc,) if isinstance(exc, str) else tuple(exc)
        return (tuple(map(str, inc)), tuple(map(str, exc)))
    rules = tuple(rules)
    if len(rules) == 2 and not all(isinstance(r, str) for r in rules):
        # (include, exclude), each a str or a sequence of str.
        return _normalize_rules({"include": rules[0], "exclude": rules[1]})
    if not all(isinstance(r, str) for r in rules):
        raise TypeError(
            "rules must be a str, a sequence of str (include rules), an "
            f"(include, exclude) pair or a mapping; got {rules!r}."
        )
    return (rules, ())


def _info_json(info: Mapping[str, Any] | None) -> str:
    try:
        return json.dumps(dict(info or {}), sort_keys=True)
    except TypeError as e:
        raise TypeError(f"SparseDiff info must be JSON-serialisable: {e}") from e


@flax.struct.dataclass
class SparseDiff:
    """A sparse diff: the non-zero entries of one debiasing module.

    Pytree leaves are ``indices`` and ``values``; everything else is static
    metadata (part of the tree structure, hence of jit's cache key).

    Invariants (guaranteed by the constructors :meth:`from_dense`,
    :func:`prune_to_sparsity`, :meth:`add` and :func:`load_sparse_diff`):
    within each leaf the indices are unique, sorted ascending and in range.

    Attributes:
      indices: ``{path: int32[nnz_leaf]}``, flat indices into the leaf at
        ``path`` (a flat dict keyed by "/"-joined paths).
      values: ``{path: dtype[nnz_leaf]}``, the diff values at those indices.
      shapes: static ``((path, shape), ...)`` of every selected leaf, in the
        base's leaf order.
      dtype: static name of the values' dtype, e.g. ``"float32"``.
      name: static label, e.g. the protected attribute (``"gender"``).
      base_fingerprint: static :func:`fingerprint` of the base params the diff
        was trained on ("" if unknown).
      rules: static ``(include_rules, exclude_rules)`` that selected the leaves.
      info_json: static JSON text of free-form info (sparsity target, method);
        read it as the dict :attr:`info`.

    Because the descriptive metadata (name, base_fingerprint, rules, info) is
    static, jitted code retraces for each distinct value of it. To switch
    attributes without recompiling, pass ``diff.without_metadata()`` (only
    shapes and dtype remain static; diffs pruned with the same budget then
    share one compiled function).
    """

    indices: dict[str, jax.Array]
    values: dict[str, jax.Array]
    shapes: tuple[tuple[str, tuple[int, ...]], ...] = flax.struct.field(
        pytree_node=False
    )
    dtype: str = flax.struct.field(pytree_node=False)
    name: str = flax.struct.field(pytree_node=False, default="")
    base_fingerprint: str = flax.struct.field(pytree_node=False, default="")
    rules: Rules = flax.struct.field(pytree_node=False, default=((), ()))
    info_json: str = flax.struct.field(pytree_node=False, default="{}")

    # -- metadata ---------------------------------------------------------

    @property
    def info(self) -> dict[str, Any]:
        """Free-form info as a (fresh) dict."""
        return json.loads(self.info_json)

    @property
    def paths(self) -> tuple[str, ...]:
        """Paths of the selected leaves, in leaf order."""
        return tuple(p for p, _ in self.shapes)

    def without_metadata(self) -> SparseDiff:
        """The same diff with name, fingerprint, rules and info cleared.

        Use it for the arguments of jitted code that switches between diffs.
        """
        return self.replace(
            name="", base_fingerprint="", rules=((), ()), info_json="{}"
        )

    # -- counts (static: computed from shapes, valid under jit) -----------

    def nnz_per_leaf(self) -> dict[str, int]:
        """Number of stored entries per leaf."""
        return {p: int(np.shape(self.indices[p])[0]) for p in self.paths}

    def nnz(self) -> int:
        """Total number of stored entries."""
        return sum(self.nnz_per_leaf().values())

    def num_selected(self) -> int:
        """Total number of entries of the selected leaves."""
        return sum(math.prod(s) for _, s in self.shapes)

    def density_per_leaf(self) -> dict[str, float]:
        """Stored entries / leaf size, per leaf."""
        nnz = self.nnz_per_leaf()
        return {p: nnz[p] / max(math.prod(s), 1) for p, s in self.shapes}

    def density(self) -> float:
        """Stored entries / entries of all selected leaves."""
        return self.nnz() / max(self.num_selected(), 1)

    # -- algebra ------------------------------------------------------------

    def to_dense(self) -> dict[str, Any]:
        """Scatters the diff into zeros: a subtree shaped like the selected leaves.

        Jit-able. Returns a nested dict with one ``dtype`` array per selected
        leaf, of that leaf's shape.
        """
        dense = {}
        for p, shape in self.shapes:
            flat = jnp.zeros((math.prod(shape),), self.dtype)
            flat = flat.at[self.indices[p]].add(
                self.values[p].astype(self.dtype),
                indices_are_sorted=True,
                unique_indices=True,
            )
            dense[p] = flat.reshape(shape)
        return unflatten(dense)

    def scale(self, c: float | jax.Array) -> SparseDiff:
        """The diff times a scalar ``c`` (same support; jit-able)."""
        return self.replace(
            values={p: (v * c).astype(v.dtype) for p, v in self.values.items()}
        )

    def add(self, other: SparseDiff, *, name: str | None = None) -> SparseDiff:
        """The sum of two diffs of the same base, on the union of their supports.

        Host-side (the support size is data dependent). Entries in both
        supports are summed once in ``dtype``; entries that sum to exactly zero
        stay in the support.

        Args:
          other: a diff with the same leaf paths, shapes, dtype and base
            fingerprint.
          name: name of the result; default ``"{self.name}+{other.name}"``.

        Returns:
          A new :class:`SparseDiff`. Rules are kept if equal, cleared otherwise.

        Raises:
          ValueError: if the diffs do not share paths, shapes, dtype or base.
        """
        if self.shapes != other.shapes:
            raise ValueError(
                "SparseDiff.add needs the same leaf paths and shapes; got "
                f"{self.shapes} and {other.shapes}."
            )
        if self.dtype != other.dtype:
            raise ValueError(
                f"SparseDiff.add needs equal dtypes; got {self.dtype} and "
                f"{other.dtype}."
            )
        if self.base_fingerprint != other.base_fingerprint:
            raise ValueError(
                "SparseDiff.add needs diffs of the same base; fingerprints "
                f"{self.base_fingerprint!r} and {other.base_fingerprint!r} differ."
            )
        indices, values = {}, {}
        for p in self.paths:
            ia, ib = _host(self.indices[p]), _host(other.indices[p])
            union = np.union1d(ia, ib).astype(np.int32)
            vals = np.zeros(union.shape, dtype=np.dtype(self.dtype))
            vals[np.searchsorted(union, ia)] += _host(self.values[p])
            vals[np.searchsorted(union, ib)] += _host(other.values[p])
            indices[p], values[p] = jnp.asarray(union), jnp.asarray(vals)
        return SparseDiff(
            indices=indices,
            values=values,
            shapes=self.shapes,
            dtype=self.dtype,
            name=f"{self.name}+{other.name}" if name is None else name,
            base_fingerprint=self.base_fingerprint,
            rules=self.rules if self.rules == other.rules else ((), ()),
            info_json=_info_json({"method": "add", "terms": [self.info, other.info]}),
        )

    @classmethod
    def from_dense(
        cls,
        subtree: PyTree,
        *,
        name: str = "",
        base_fingerprint: str = "",
        rules: Any = (),
        info: Mapping[str, Any] | None = None,
    ) -> SparseDiff:
        """Keeps the non-zero entries of a dense subtree (host-side).

        Args:
          subtree: nested dict of arrays (one dtype), e.g. :meth:`to_dense`.
          name: label of the diff.
          base_fingerprint: :func:`fingerprint` of the base params.
          rules: the selection rules: a str, ``[include...]``, an ``(include,
            exclude)`` pair of sequences or ``{"include": [...], "exclude":
            [...]}``; stored as ``(include_tuple, exclude_tuple)``.
          info: JSON-serialisable free-form info.

        Returns:
          A :class:`SparseDiff` storing exactly the entries ``!= 0``.
        """
        arrays = {p: _host(v) for p, v in flatten(subtree).items()}
        dtype = _common_dtype(arrays)
        keep = {p: np.flatnonzero(a.reshape(-1)) for p, a in arrays.items()}
        return _build(
            arrays,
            keep,
            dtype=dtype,
            name=name,
            base_fingerprint=base_fingerprint,
            rules=rules,
            info={"method": "from_dense", **dict(info or {})},
        )


def _common_dtype(arrays: Mapping[str, np.ndarray]) -> np.dtype:
    if not arrays:
        raise ValueError("A sparse diff needs at least one leaf.")
    dtypes = {str(a.dtype) for a in arrays.values()}
    if len(dtypes) != 1:
        raise ValueError(
            f"All leaves of a sparse diff must share one dtype, got {sorted(dtypes)}."
        )
    dtype = next(iter(arrays.values())).dtype
    if not np.issubdtype(dtype, np.floating) and str(dtype) != "bfloat16":
        raise ValueError(f"Diff values must be floating point, got {dtype}.")
    return dtype


def _build(
    arrays: Mapping[str, np.ndarray],
    keep: Mapping[str, np.ndarray],
    *,
    dtype: np.dtype,
    name: str,
    base_fingerprint: str,
    rules: Any,
    info: Mapping[str, Any],
) -> SparseDiff:
    """SparseDiff from host arrays and sorted kept flat indices per leaf."""
    indices, values, shapes = {}, {}, []
    for p, a in arrays.items():
        if a.size > _MAX_LEAF_SIZE:
            raise ValueError(
                f"Leaf {p!r} has {a.size} entries; int32 indices overflow."
            )
        idx = np.asarray(keep[p], dtype=np.int32)
        indices[p] = jnp.asarray(idx)
        values[p] = jnp.asarray(a.reshape(-1)[idx])
        shapes.append((p, tuple(int(d) for d in a.shape)))
    return SparseDiff(
        indices=indices,
        values=values,
        shapes=tuple(shapes),
        dtype=str(dtype),
        name=str(name),
        base_fingerprint=str(base_fingerprint),
        rules=_normalize_rules(rules),
        info_json=_info_json(info),
    )


def pruning_diff(
    base: PyTree,
    keep_masks: PyTree,
    *,
    name: str,
    rules: Any = (),
    info: Mapping[str, Any] | None = None,
) -> SparseDiff:
    """A weight-pruning subnetwork as a :class:`SparseDiff` on ``base``.

    SRNets masks, IMP masks and FFW's final gates all remove weights from a
    frozen base. Stored as a diff whose values are ``-w`` at every pruned
    entry, ``base + diff`` is exactly ``base * mask`` (``w + (-w) == 0`` in
    floating point), so a pruned subnetwork is saved, fingerprinted, loaded
    and composed with the same machinery as a MoDDiffy diff.

    Args:
      base: the params the mask applies to (their fingerprint goes in the diff).
      keep_masks: bool subtree of ``base`` (selected leaves only), True = kept.
      name: label of the diff (e.g. ``"mask"``, ``"ffw_dialect"``).
      rules: the selection rules of the masked leaves (stored as metadata).
      info: JSON-serialisable info; ``{"kind": "pruning"}`` is added.

    Returns:
      A SparseDiff holding ``-w`` at the pruned entries of each masked leaf
      (an entry whose weight is already 0 is stored too, so ``nnz`` is the
      number of pruned entries).
    """
    flat_base = flatten(base)
    flat_keep = flatten(keep_masks)
    missing = sorted(set(flat_keep) - set(flat_base))
    if missing:
        raise ValueError(f"Masks for leaves the base lacks: {missing[:5]}.")
    arrays, keep = {}, {}
    for p, k in flat_keep.items():
        w = _host(flat_base[p])
        k = _host(k).astype(bool)
        if k.shape != w.shape:
            raise ValueError(f"Mask {p!r} has shape {k.shape}, its weight {w.shape}.")
        arrays[p] = -w
        keep[p] = np.flatnonzero(~k.reshape(-1))
    return _build(
        arrays,
        keep,
        dtype=_common_dtype(arrays),
        name=name,
        base_fingerprint=fingerprint(base),
        rules=rules,
        info={"kind": "pruning", **dict(info or {})},
    )


def apply_diffs(
    base: PyTree,
    diffs: Sequence[SparseDiff],
    weights: Sequence[float] | jax.Array | None = None,
) -> PyTree:
    """Effective params ``base + sum_k weights[k] * diffs[k]`` (scatter-add).

    Pure and jit-able with ``diffs`` and ``weights`` as arguments: the compiled
    function depends only on the diffs' leaf paths, shapes, dtype and nnz per
    leaf (and their static metadata, see :class:`SparseDiff`), so switching
    between diffs pruned with the same budget does not recompile. Diffs are
    added one after the other in the given order; the result for leaves
    outside every diff is the base leaf itself.

    Args:
      base: the parameter pytree the diffs were trained on.
      diffs: sparse diffs whose paths are leaves of ``base``.
      weights: one scalar per diff (may be negative, e.g. -1 to remove a diff
        that was merged in); default all ones. A sequence or a ``[K]`` array.

    Returns:
      A pytree with the structure, shapes and dtypes of ``base``.

    Raises:
      ValueError: if a diff names a leaf missing from ``base`` or with another
        shape, or if the number of weights differs from the number of diffs.
        (The base fingerprint is checked on load, not here.)
    """
    diffs = list(diffs)
    if weights is not None and len(weights) != len(diffs):
        raise ValueError(f"Got {len(weights)} weights for {len(diffs)} diffs.")
    flat_base = flatten(base)
    updated: dict[str, jax.Array] = {}
    for k, diff in enumerate(diffs):
        _check_shapes(diff, flat_base)
        for p, _ in diff.shapes:
            leaf = updated[p] if p in updated else jnp.asarray(flat_base[p])
            vals = diff.values[p]
            if weights is not None:
                vals = vals * weights[k]
            flat = (
                leaf.reshape(-1)
                .at[diff.indices[p]]
                .add(
                    vals.astype(leaf.dtype),
                    indices_are_sorted=True,
                    unique_indices=True,
                )
            )
            updated[p] = flat.reshape(leaf.shape)
    if not updated:
        return base
    return merge(base, unflatten(updated))


def _check_shapes(diff: SparseDiff, flat_base: Mapping[str, Any]) -> None:
    problems = []
    for p, shape in diff.shapes:
        if p not in flat_base:
            problems.append(f"{p}: not in the base")
        elif tuple(np.shape(flat_base[p])) != tuple(shape):
            problems.append(
                f"{p}: diff shape {tuple(shape)} != base shape "
                f"{tuple(np.shape(flat_base[p]))}"
            )
    if problems:
        raise ValueError(
            f"Sparse diff {diff.name!r} does not fit the base: " + "; ".join(problems)
        )


def apply_sparse_values(base: PyTree, diff: SparseDiff, values: PyTree) -> PyTree:
    """``base + scatter(values)`` at ``diff``'s indices (the fixmask phase).

    Differentiate with respect to ``values`` (initialised from
    ``diff.values``): the gradient is the effective-params gradient gathered at
    the kept indices, so only kept entries ever move and ``base`` stays frozen.

    Args:
      base: the frozen parameter pytree.
      diff: gives the support (indices) and static shapes.
      values: ``{path: [nnz_leaf]}`` with the structure and shapes of
        ``diff.values``.

    Returns:
      A pytree with the structure, shapes and dtypes of ``base``.
    """
    if set(values) != set(diff.values):
        raise ValueError(
            f"values has paths {sorted(values)}, the diff {sorted(diff.values)}."
        )
    for p, idx in diff.indices.items():
        if np.shape(values[p]) != np.shape(idx):
            raise ValueError(
                f"values[{p!r}] has shape {np.shape(values[p])}, the support "
                f"{np.shape(idx)}."
            )
    return apply_diffs(base, [diff.replace(values=dict(values))])


# -----------------------------------------------------------------------------
# Magnitude pruning.
# -----------------------------------------------------------------------------


def _resolve_keep(keep: int | float, n: int, where: str) -> int:
    if isinstance(keep, bool):
        raise TypeError(f"keep must be an int count or a float fraction, got {keep}.")
    if isinstance(keep, (int, np.integer)):
        if not 0 <= keep <= n:
            raise ValueError(f"keep={keep} entries is outside [0, {n}] for {where}.")
        return int(keep)
    if isinstance(keep, (float, np.floating)):
        if not 0.0 <= keep <= 1.0:
            raise ValueError(f"keep fraction {keep} is outside [0, 1].")
        return int(round(float(keep) * n))
    raise TypeError(f"keep must be an int count or a float fraction, got {keep!r}.")


def _magnitude_dtype(dtype: np.dtype) -> np.dtype:
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def _topk_threshold(magnitudes: np.ndarray, k: int) -> Any:
    """The k-th largest value (k >= 1); reorders ``magnitudes`` in place."""
    n = magnitudes.shape[0]
    magnitudes.partition(n - k)
    return magnitudes[n - k]


def _select_topk(
    leaves: Sequence[tuple[str, np.ndarray]], k: int, mdtype: np.dtype
) -> dict[str, np.ndarray]:
    """Exactly k flat indices per the ordering (|v| desc, leaf order, index asc)."""
    if k == 0:
        return {p: np.zeros((0,), np.int64) for p, _ in leaves}
    magnitudes = np.concatenate(
        [np.abs(a.reshape(-1)).astype(mdtype, copy=False) for _, a in leaves]
    )
    if np.isnan(magnitudes).any():
        raise ValueError("Cannot prune values containing NaN.")
    threshold = _topk_threshold(magnitudes, k)
    del magnitudes
    above = {}
    for p, a in leaves:
        above[p] = np.flatnonzero(np.abs(a.reshape(-1)).astype(mdtype) > threshold)
    remaining = k - sum(len(i) for i in above.values())
    kept = {}
    for p, a in leaves:
        ties = np.zeros((0,), np.int64)
        if remaining > 0:
            ties = np.flatnonzero(np.abs(a.reshape(-1)).astype(mdtype) == threshold)
            ties = ties[:remaining]
            remaining -= len(ties)
        kept[p] = np.sort(np.concatenate([above[p], ties]))
    assert remaining == 0, remaining
    return kept


def prune_to_sparsity(
    values_subtree: PyTree,
    *,
    keep: int | float,
    scope: str = "global",
    name: str = "",
    base_fingerprint: str = "",
    rules: Any = (),
    info: Mapping[str, Any] | None = None,
) -> SparseDiff:
    """Magnitude pruning to an exact number of kept entries (host-side).

    Keeps exactly ``k`` entries with the largest ``|value|``, where ``k =
    keep`` for an int and ``round(keep * N)`` for a float fraction (Python
    rounding, as in the reference), ``N`` being the number of entries of all
    leaves (``scope="global"``, the reference's choice) or of each leaf
    (``scope="per_leaf"``). Ties, including zeros, are broken
    deterministically in favour of the lower global position: leaf order
    first, then flat index. The kept values keep their sign and may be zero.

    Deviation from MoDDiffy [M] (spec §3.2): the reference keeps the entries
    strictly greater than the (k+1)-th largest, i.e. at most k and often far
    fewer when hard-concrete gates zeroed most of the diff. Here the count is
    always k, so diffs pruned with one budget have equal shapes (and share
    compiled code in :func:`apply_diffs`); the extra entries are zeros or ties.

    Memory: about two float32 copies of all values plus the kept indices
    (numpy ``partition`` for the threshold, then one pass per leaf).

    Args:
      values_subtree: nested dict of float arrays (one dtype), e.g.
        :func:`dense_diff_values` of a trained state.
      keep: number (int) or fraction (float in ``[0, 1]``) of entries to keep.
      scope: ``"global"`` (one budget across leaves) or ``"per_leaf"``.
      name: label of the resulting diff.
      base_fingerprint: :func:`fingerprint` of the base params.
      rules: the selection rules, in any form :meth:`SparseDiff.from_dense`
        accepts (stored as metadata).
      info: extra JSON-serialisable info, merged over the pruning settings.

    Returns:
      A :class:`SparseDiff` with ``nnz() == k`` (global) or ``k_leaf`` per leaf.

    Raises:
      ValueError: for an unknown scope, a keep outside its range, NaN values,
        or mixed dtypes.
    """
    arrays = {p: _host(v) for p, v in flatten(values_subtree).items()}
    dtype = _common_dtype(arrays)
    mdtype = _magnitude_dtype(dtype)
    leaves = list(arrays.items())
    if scope == "global":
        k = _resolve_keep(keep, sum(a.size for a in arrays.values()), "all leaves")
        kept = _select_topk(leaves, k, mdtype)
    elif scope == "per_leaf":
        kept = {}
        for p, a in leaves:
            kept.update(
                _select_topk([(p, a)], _resolve_keep(keep, a.size, repr(p)), mdtype)
            )
        k = sum(len(i) for i in kept.values())
    else:
        raise ValueError(f"Unknown scope {scope!r}; valid: 'global', 'per_leaf'.")
    settings = {"method": "magnitude_topk", "scope": scope, "keep": keep, "k": k}
    return _build(
        arrays,
        kept,
        dtype=dtype,
        name=name,
        base_fingerprint=base_fingerprint,
        rules=rules,
        info={**settings, **dict(info or {})},
    )


# -----------------------------------------------------------------------------
# File format.
# -----------------------------------------------------------------------------


def save_sparse_diff(
    path: str | os.PathLike, diff: SparseDiff, *, overwrite: bool = False
) -> str:
    """Writes a sparse diff to a ``.safetensors`` file, atomically.

    Layout: tensors ``"{leaf_path}::indices"`` (int32) and
    ``"{leaf_path}::values"`` (``diff.dtype``) per leaf; the safetensors
    metadata key ``"moddiffy_sparse_diff"`` holds JSON with ``format``,
    ``version``, ``name``, ``shapes`` (``[[leaf_path, [dims]], ...]`` in leaf
    order), ``dtype``, ``base_fingerprint``, ``rules`` (``{"include": [...],
    "exclude": [...]}``) and ``info``. No pickle.

    The file is written to a temporary file in the same directory and then
    moved into place, so readers never see a partial file.

    Args:
      path: destination file.
      diff: the diff to save.
      overwrite: replace an existing file.

    Returns:
      ``path`` as a string.

    Raises:
      FileExistsError: if ``path`` exists and ``overwrite`` is False.
    """
    path = os.fspath(path)
    exists_msg = f"{path} already exists; pass overwrite=True to replace it."
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(exists_msg)
    tensors = {}
    for p in diff.paths:
        tensors[f"{p}::indices"] = _host(diff.indices[p]).astype(np.int32, copy=False)
        tensors[f"{p}::values"] = _host(diff.values[p])
    meta = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "name": diff.name,
        "shapes": [[p, list(s)] for p, s in diff.shapes],
        "dtype": diff.dtype,
        "base_fingerprint": diff.base_fingerprint,
        "rules": {"include": list(diff.rules[0]), "exclude": list(diff.rules[1])},
        "info": diff.info,
    }
    tmp = temp_file_beside(path, suffix=".safetensors")
    try:
        save_file(tensors, tmp, metadata={METADATA_KEY: json.dumps(meta)})
        publish_mode(tmp)
        if overwrite:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)  # atomic, fails if path appeared meanwhile
            except FileExistsError:
                raise FileExistsError(exists_msg) from None
            except OSError:  # filesystem without hard links
                os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _read_meta(path: str, raw: Mapping[str, str] | None) -> dict[str, Any]:
    raw = raw or {}
    if METADATA_KEY not in raw:
        raise ValueError(
            f"{path} is not a moddiffy sparse diff: its safetensors metadata has "
            f"no {METADATA_KEY!r} entry (found keys {sorted(raw)})."
        )
    meta = json.loads(raw[METADATA_KEY])
    if meta.get("format") != FORMAT_NAME or not isinstance(meta.get("version"), int):
        raise ValueError(f"{path} has malformed moddiffy metadata: {meta}.")
    if meta["version"] > FORMAT_VERSION:
        raise ValueError(
            f"{path} uses sparse-diff format version {meta['version']}, but this "
            f"moddiffy_jax reads versions up to {FORMAT_VERSION}; upgrade it."
        )
    return meta


def load_sparse_diff(
    path: str | os.PathLike,
    *,
    base: PyTree | None = None,
    allow_base_mismatch: bool = False,
) -> SparseDiff:
    """Reads a file written by :func:`save_sparse_diff` (no pickle).

    Args:
      path: the ``.safetensors`` file.
      base: if given, the params the diff will be applied to: their
        :func:`fingerprint` must equal the diff's and every diff leaf must
        exist in ``base`` with the same shape.
      allow_base_mismatch: load anyway (with a logged warning) when the base
        check fails. :func:`apply_diffs` still refuses mismatched shapes.

    Returns:
      The :class:`SparseDiff`, arrays as jax arrays.

    Raises:
      ValueError: if the file is not a safetensors moddiffy diff, has a newer
        format version, is internally inconsistent, or (unless
        ``allow_base_mismatch``) does not match ``base``.
    """
    path = os.fspath(path)
    try:
        with safe_open(path, framework="np") as f:
            meta = _read_meta(path, f.metadata())
            names = set(f.keys())
            expected = {
                f"{p}::{kind}"
                for p, _ in meta["shapes"]
                for kind in ("indices", "values")
            }
            if names != expected:
                raise ValueError(
                    f"{path}: tensors {sorted(names ^ expected)} do not match the "
                    "leaves listed in its metadata."
                )
            arrays = {
                p: (f.get_tensor(f"{p}::indices"), f.get_tensor(f"{p}::values"))
                for p, _ in meta["shapes"]
            }
    except SafetensorError as e:
        raise ValueError(f"{path} is not a readable safetensors file: {e}") from e
    shapes = tuple((p, tuple(int(d) for d in s)) for p, s in meta["shapes"])
    indices, values = {}, {}
    for p, shape in shapes:
        idx, vals = arrays[p]
        size = math.prod(shape)
        if (
            idx.dtype != np.int32
            or idx.ndim != 1
            or vals.shape != idx.shape
            or str(vals.dtype) != meta["dtype"]
        ):
            raise ValueError(
                f"{path}: leaf {p!r} has indices {idx.dtype}{list(idx.shape)} and "
                f"values {vals.dtype}{list(vals.shape)}; expected int32 and "
                f"{meta['dtype']} vectors of equal length."
            )
        if idx.size and (idx[0] < 0 or idx[-1] >= size or np.any(np.diff(idx) <= 0)):
            raise ValueError(
                f"{path}: indices of leaf {p!r} are not sorted, unique and within "
                f"[0, {size})."
            )
        indices[p], values[p] = jnp.asarray(idx), jnp.asarray(vals)
    diff = SparseDiff(
        indices=indices,
        values=values,
        shapes=shapes,
        dtype=meta["dtype"],
        name=meta["name"],
        base_fingerprint=meta["base_fingerprint"],
        rules=_normalize_rules(meta["rules"]),
        info_json=_info_json(meta["info"]),
    )
    if base is not None:
        check_base(diff, base, allow_base_mismatch=allow_base_mismatch, source=path)
    return diff


def check_base(
    diff: SparseDiff,
    base: PyTree,
    *,
    allow_base_mismatch: bool = False,
    source: str = "",
) -> None:
    """Checks that ``diff`` was trained on ``base`` (fingerprint, paths, shapes).

    Args:
      diff: the sparse diff.
      base: the parameter pytree it is to be applied to.
      allow_base_mismatch: log a warning instead of raising.
      source: where the diff came from, for messages (e.g. a file path).

    Raises:
      ValueError: on a fingerprint or leaf mismatch, unless
        ``allow_base_mismatch``.
    """
    flat = flatten(base)
    problems = []
    for p, shape in diff.shapes:
        if p not in flat:
            problems.append(f"leaf {p!r} is missing from the base")
        elif tuple(np.shape(flat[p])) != shape:
            problems.append(
                f"leaf {p!r} has shape {tuple(np.shape(flat[p]))} in the base, "
                f"{shape} in the diff"
            )
    actual = fingerprint(base)
    if actual != diff.base_fingerprint:
        problems.insert(
            0,
            f"the diff was trained on base {diff.base_fingerprint!r}, the given "
            f"base has fingerprint {actual!r}",
        )
    if not problems:
        return
    what = f"Sparse diff {diff.name!r}" + (f" from {source}" if source else "")
    msg = f"{what} does not match the base: " + "; ".join(problems)
    if allow_base_mismatch:
        logging.warning("%s (allowed by allow_base_mismatch=True).", msg)
        return
    raise ValueError(msg + ". Pass allow_base_mismatch=True to use it anyway.")


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
