"""Known-bias and OOD rows of a composition table.

Bias-aligned / bias-conflicting accuracy for splits carrying the bias
model's log-probs (``data.bias``), the enabled OOD sets of a run's
``config.eval.ood``, and :func:`ood_and_bias_rows`, which computes both for
any ``predict`` callable (the training loop's end-of-run table uses it
without the probe machinery). :mod:`moddiffy_jax.eval.composition`
re-exports these names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ml_collections
import numpy as np

from moddiffy_jax.data import bias as bias_lib
from moddiffy_jax.eval import metrics as metrics_lib
from moddiffy_jax.eval import ood as ood_lib


def _aligned_mask(split: Any) -> np.ndarray | None:
    """Bias-aligned mask [N] of a split carrying ``bias_logprobs``, else None."""
    extras = getattr(split, "extras", {})
    if bias_lib.BIAS_KEY not in extras:
        return None
    return bias_lib.bias_aligned(extras[bias_lib.BIAS_KEY], split.task)


def bias_split_metrics(split: Any, predictions: np.ndarray) -> dict[str, float]:
    """Accuracy on the bias-aligned and bias-conflicting examples of a split.

    Args:
      split: a TokenizedSplit carrying ``extras["bias_logprobs"]`` [N, C].
      predictions: int [N] task predictions in row order.

    Returns:
      ``{"bias_aligned_acc", "bias_conflicting_acc", "bias_unbiased_acc"}``
      (``NaN`` for an empty subset), or ``{}`` when the split has no bias
      log-probs.
    """
    aligned = _aligned_mask(split)
    if aligned is None:
        return {}
    acc = metrics_lib.bias_aligned_conflicting_accuracy(
        split.task, predictions, aligned
    )
    return {f"bias_{k}_acc": v for k, v in acc.items()}


def load_run_ood_sets(
    config: ml_collections.ConfigDict,
    task_classes: Sequence[str],
    tokenizer: Any = None,
) -> dict[str, ood_lib.OODSet]:
    """The enabled OOD sets of a run's ``config.eval.ood`` ({} if none).

    Run configs saved before ``eval.ood`` existed have no such field and get
    ``{}``.

    Args:
      config: the run's full config.
      task_classes: the model's task classes (``ctx.data.task_classes``).
      tokenizer: the run's tokenizer; ``None`` loads the one of
        ``config.model`` (only when some entry is enabled).

    Returns:
      name -> :class:`~moddiffy_jax.eval.ood.OODSet`.
    """
    ood_config = config.eval.ood if "ood" in config.eval else None
    if not ood_lib.enabled_entries(ood_config):
        return {}
    if tokenizer is None:
        from moddiffy_jax.models import text as text_lib

        tokenizer = text_lib.load_tokenizer_for(config.model)
    return ood_lib.load_ood_sets(
        ood_config,
        tokenizer,
        max_length=config.data.max_length,
        task_classes=tuple(task_classes),
    )


def ood_and_bias_rows(
    ctx: Any,
    predict: Callable[[Any, Any], np.ndarray],
    params_by_row: Mapping[str, Any],
    *,
    splits: Sequence[str] = ("dev", "test"),
    ood_sets: Mapping[str, ood_lib.OODSet] | None = None,
    tokenizer: Any = None,
) -> dict[str, dict[str, Any]]:
    """OOD metrics and bias-aligned/conflicting accuracy for several models.

    For the training loop's end-of-run table, without the probe machinery::

        def predict(params, split):          # split: a TokenizedSplit
            enc, head = params
            ...                               # argmax over eval_batches(split)
            return preds                      # int [N], row order
        extra = ood_and_bias_rows(
            ctx, predict, {"core": (core, head), "core+gender": (composed, head)}
        )
        for label, fields in extra.items():
            results["composition"][label].update(fields)

    Args:
      ctx: anything with ``.config`` (the run config) and ``.data`` (the
        TokenizedDataset), e.g. ``train.Context``.
      predict: ``predict(params, split) -> int [N]`` task predictions of the
        model ``params`` on a TokenizedSplit (one of ``ctx.data.splits`` or an
        OOD set's ``split``), in row order.
      params_by_row: row label -> whatever ``predict`` takes as ``params``.
      splits: the run's splits for the aligned/conflicting accuracy (those
        without ``extras["bias_logprobs"]`` or absent are skipped).
      ood_sets: preloaded sets (reuse them across calls); ``None`` loads
        ``ctx.config.eval.ood`` via :func:`load_run_ood_sets`.
      tokenizer: used only when loading the OOD sets (``None``: the run's).

    Returns:
      row label -> ``{"{split}_bias_aligned_acc", "{split}_bias_conflicting_acc"
      (bias runs only), "ood": {name: metrics} (when OOD sets exist)}``; an
      empty dict per row when neither applies.
    """
    if ood_sets is None:
        ood_sets = load_run_ood_sets(ctx.config, ctx.data.task_classes, tokenizer)
    bias_splits = [
        s
        for s in splits
        if s in ctx.data.splits and _aligned_mask(ctx.data.splits[s]) is not None
    ]
    rows: dict[str, dict[str, Any]] = {}
    for label, params in params_by_row.items():
        row: dict[str, Any] = {}
        for s in bias_splits:
            split = ctx.data.splits[s]
            acc = bias_split_metrics(split, np.asarray(predict(params, split)))
            row[f"{s}_bias_aligned_acc"] = acc["bias_aligned_acc"]
            row[f"{s}_bias_conflicting_acc"] = acc["bias_conflicting_acc"]
        if ood_sets:
            row["ood"] = {
                name: ood_lib.ood_metrics(oset, np.asarray(predict(params, oset.split)))
                for name, oset in ood_sets.items()
            }
        rows[label] = row
    return rows
