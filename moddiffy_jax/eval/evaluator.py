"""Deterministic task accuracy of any encoder params, and the composition table."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from moddiffy_jax.eval.forward import Forward
from moddiffy_jax.methods import joint_erasure
from moddiffy_jax.subnets import diffs as diffs_lib

if TYPE_CHECKING:
    from moddiffy_jax.context import Context


class Evaluator:
    """Deterministic task accuracy of any encoder-params configuration."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.forward = Forward(ctx.model, ctx.config.eval.batch_size)
        self._apply_packed = jax.jit(diffs_lib.apply_packed)

    def compose(
        self,
        base: Any,
        diffs: Sequence[diffs_lib.SparseDiff],
        weights: Sequence[float] | None = None,
    ) -> Any:
        """``base + sum_k w_k diff_k``; one compiled program for any weights."""
        if not diffs:
            return base
        packed, _ = diffs_lib.pack_diffs(list(diffs))
        w = jnp.asarray(weights if weights is not None else [1.0] * len(diffs))
        return self._apply_packed(base, packed, w.astype(jnp.float32))

    def predict(self, enc_params: Any, head_params: Any, split: Any) -> np.ndarray:
        """Task predictions (int [N], row order) on a split object."""
        logits = self.forward.logits_split(enc_params, head_params, split)
        return np.argmax(logits, -1)

    def task_accuracy(self, enc_params: Any, head_params: Any, split: str) -> float:
        return self.accuracy_and_reps(enc_params, head_params, split)[0]

    def accuracy_and_reps(
        self,
        enc_params: Any,
        head_params: Any,
        split: str,
        parts_out: dict[str, Any] | None = None,
    ) -> tuple[float, np.ndarray]:
        """Task accuracy on the run's split named ``split`` and the CLS
        representations [N, H] it was read from (the leakage probes reuse
        them). ``parts_out``, if given, receives ``split -> (x, g)``, the
        last layer's parts (:func:`discriminant_diff.core_parts`) from the
        same pass."""
        from moddiffy_jax.eval import discriminant_diff

        data = self.ctx.data.splits[split]
        if parts_out is None:
            h = self.forward.represent_split(enc_params, data)
        else:
            h, *parts = discriminant_diff.core_parts(self.forward, enc_params, data)
            parts_out[split] = tuple(parts)
        pred = self.forward.predict(head_params, h)
        return float(np.mean(pred == np.asarray(data.task))), h


def subsets(names: Sequence[str], max_size: int | None = None) -> list[tuple]:
    """The empty subset, every single name, then every larger subset in order."""
    top = len(names) if max_size is None else min(max_size, len(names))
    return [()] + [
        c for r in range(1, top + 1) for c in itertools.combinations(names, r)
    ]


def subset_label(
    subset: Sequence[str], weights: Mapping[str, float] | None = None
) -> str:
    """``core``, ``core+gender``, ``core+0.5*gender+age``..."""
    weights = weights or {}
    if not subset:
        return "core"
    parts = [n if weights.get(n, 1.0) == 1.0 else f"{weights[n]:g}*{n}" for n in subset]
    return "core+" + "+".join(parts)


def compositions(
    evaluator: Evaluator,
    core: Any,
    diffs: Mapping[str, diffs_lib.SparseDiff],
    names: Sequence[str] | None = None,
    *,
    weights: Mapping[str, float] | None = None,
    max_subset_size: int | None = None,
) -> Iterator[tuple[str, tuple, Any]]:
    """``(label, subset, encoder params)`` of the core and every subset of diffs.

    A ``task`` diff (DiffPrun, LoRA) is part of the model: it is added to the
    core in every row. ``names`` orders the attribute diffs (default: the
    order of ``diffs``); ``weights`` scales them (default 1). A correction
    in ``diffs`` (``gender+age``, methods/joint_erasure.py) is added to the
    row of exactly its diffs when each has weight 1.
    """
    weights = dict(weights or {})
    diffs, joint = joint_erasure.split_joint(diffs)
    base = core
    if "task" in diffs:
        base = evaluator.compose(core, [diffs["task"]])
    names = [n for n in (names or diffs) if n != "task"]
    attr_diffs = [diffs[n] for n in names]
    for subset in subsets(names, max_subset_size):
        w = [weights.get(n, 1.0) if n in subset else 0.0 for n in names]
        fix = joint_erasure.correction_for(joint, dict(zip(names, w, strict=True)))
        if fix is not None:
            params = evaluator.compose(base, [*attr_diffs, fix], [*w, 1.0])
        else:
            params = evaluator.compose(base, attr_diffs, w) if names else base
        yield subset_label(subset, weights), subset, params


def composition_table(
    ctx: Context,
    evaluator: Evaluator,
    core: Any,
    head: Any,
    sparse: Mapping[str, diffs_lib.SparseDiff],
    splits: Sequence[str],
    params_out: dict[str, Any] | None = None,
    reps_out: dict[str, dict[str, np.ndarray]] | None = None,
    parts_out: dict[str, Any] | None = None,
) -> dict[str, dict[str, float]]:
    """Task accuracy for the core, each diff, and every larger subset of diffs.

    ``params_out``, if given, receives ``label -> (encoder params, head)``;
    ``reps_out`` receives ``label -> {split: representations [N, H]}``, which
    the composition matrix's probes (``composition.evaluate_run``'s
    ``known_reps``) then need not encode again; ``parts_out`` the core row's
    last-layer parts by split (its ``known_parts``).
    """
    rows = {}
    for label, subset, params in compositions(evaluator, core, sparse):
        row = {}
        keep = parts_out if not subset else None
        for s in splits:
            row[f"{s}_task_acc"], h = evaluator.accuracy_and_reps(params, head, s, keep)
            if reps_out is not None:
                reps_out.setdefault(label, {})[s] = h
        rows[label] = row
        if params_out is not None:
            params_out[label] = (params, head)
    return rows
