"""Out-of-distribution evaluation sets and their metrics (SRNets, spec A10).

A run's ``config.eval.ood`` is a ConfigDict of named entries, each shaped like
:func:`default_ood_entry`::

    config.eval.ood.hans = default_ood_entry()      # disabled, source = name
    config.eval.ood.hans.path = ".../heuristics_evaluation_set.txt"
    config.eval.ood.hans.label_map = "mnli_to_hans"
    config.eval.ood.hans.enabled = True

:func:`load_ood_sets` reads and tokenizes every enabled entry with the pair
readers of :mod:`moddiffy_jax.data.nli` and the tokenizer of
:mod:`moddiffy_jax.data.tokenize` (as ``data.build_dataset`` does), and
:func:`ood_metrics` scores a model's predictions on one of them:

* every set: ``accuracy`` after mapping the model's classes to the set's
  classes. ``label_map=""`` maps by class *name* (PAWS for a QQP model, the
  FEVER-Symmetric sets for a FEVER model); a model class that the set does not
  have counts as wrong. ``"mnli_to_hans"`` collapses MNLI's neutral and
  contradiction to non-entailment ([S] ``mask_run_glue.py:507-508``).
* HANS: accuracy per gold label (``entailment``, ``non-entailment``), per
  heuristic (``lexical_overlap``, ``subsequence``, ``constituent``) and per
  pair (``entailment/lexical_overlap``, ...).
* PAWS / QQP: ``f1`` (positive = duplicate ``"1"``), ``non_duplicate_f1``
  (positive ``"0"``), ``average_f1`` (support-weighted), ``duplicate_acc`` and
  ``non_duplicate_acc`` (recall of each class), as [S] logs them.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import ml_collections
import numpy as np

from moddiffy_jax.data import nli
from moddiffy_jax.data.config import default_data_config
from moddiffy_jax.data.dataset import TokenizedSplit
from moddiffy_jax.data.tokenize import tokenize_split

OOD_SOURCES = tuple(nli.LAYOUTS)
LABEL_MAPS = ("", "mnli_to_hans")
# Sources scored with the PAWS metrics (binary, duplicate = "1").
PARAPHRASE_SOURCES = ("paws", "qqp")


def default_ood_entry() -> ml_collections.ConfigDict:
    """Returns one ``config.eval.ood.<name>`` entry with every field.

    The entry is disabled until given a file and enabled.

    Fields:

    - ``source``: the file's reader, one of :data:`OOD_SOURCES` (``hans``,
      ``paws``, ``fever_symmetric``, or any other pair source); empty: the
      entry's name (so ``eval.ood.hans`` reads a HANS file).
    - ``path``: the file (e.g. ``heuristics_evaluation_set.txt``,
      PAWS-QQP ``dev.tsv``, ``sym2/test.jsonl``).
    - ``label_map``: ``""`` (identity by class name) or ``"mnli_to_hans"``.
    - ``enabled``: evaluate this entry (default False).
    """
    return ml_collections.ConfigDict(
        {"source": "", "path": "", "label_map": "", "enabled": False}
    )


def entry_source(name: str, entry: ml_collections.ConfigDict) -> str:
    """The reader of an entry: ``entry.source``, or its name when that is empty.

    Raises:
      ValueError: the result is not one of :data:`OOD_SOURCES`.
    """
    source = entry.source or name
    if source not in OOD_SOURCES:
        what = f"source {entry.source!r}" if entry.source else "an empty source"
        raise ValueError(
            f"eval.ood.{name} has {what} and its name is not a source either; set "
            f"eval.ood.{name}.source to one of {list(OOD_SOURCES)}."
        )
    return source


@dataclasses.dataclass(frozen=True)
class OODSet:
    """One tokenized OOD evaluation set.

    Attributes:
      name: the entry's name in ``config.eval.ood``.
      source: the reader (``hans``, ``paws``, ...), resolved (never empty).
      path: the file read.
      split: the tokenized examples (``N`` rows); ``split.task`` holds the gold
        labels as indices into ``classes``.
      classes: the set's class names (e.g. HANS ``non-entailment``,
        ``entailment``).
      label_map: the configured map (``""`` or ``"mnli_to_hans"``).
      prediction_map: int32 ``[C_model]``: model class index -> index into
        ``classes``, or -1 for a model class the set does not have (always
        wrong).
      meta: per-example string columns, ``name -> [N]`` (``guid``; HANS also
        ``heuristic``, ``subcase``).
    """

    name: str
    source: str
    path: str
    split: TokenizedSplit
    classes: tuple[str, ...]
    label_map: str
    prediction_map: np.ndarray
    meta: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(self.split)

    def map_predictions(self, predictions: np.ndarray) -> np.ndarray:
        """Model class indices ``[N]`` -> this set's class indices ``[N]`` (-1: none).

        Raises:
          ValueError: a prediction outside ``[0, C_model)``.
        """
        pred = np.asarray(predictions)
        c = self.prediction_map.shape[0]
        if pred.size and (pred.min() < 0 or pred.max() >= c):
            raise ValueError(
                f"Predictions for OOD set {self.name!r} must be model class indices "
                f"in [0, {c}); got min {pred.min()}, max {pred.max()}."
            )
        return self.prediction_map[pred.astype(np.int64)]


def prediction_map(
    label_map: str,
    *,
    task_classes: Sequence[str],
    ood_classes: Sequence[str],
    name: str = "",
) -> np.ndarray:
    """Builds the model-class -> OOD-class index map.

    Args:
      label_map: ``""`` (by class name) or ``"mnli_to_hans"``.
      task_classes: the model's task classes (``C_model``).
      ood_classes: the OOD set's classes.
      name: the entry name (for messages).

    Returns:
      int32 ``[C_model]``, -1 where a model class has no OOD counterpart.

    Raises:
      ValueError: an unknown map (lists the valid ones); ``""`` when some OOD
        class is not a model class; ``"mnli_to_hans"`` for a model that is not
        3-way MNLI or a set that is not HANS.
    """
    task_classes, ood_classes = tuple(task_classes), tuple(ood_classes)
    key = f"eval.ood.{name}.label_map" if name else "label_map"
    if label_map == "":
        missing = [c for c in ood_classes if c not in task_classes]
        if missing:
            raise ValueError(
                f"OOD set {name!r} has classes {list(ood_classes)}, but the model's "
                f"task classes are {list(task_classes)} ({missing} missing), so the "
                f"identity map by class name does not apply. Set {key} to one of "
                f"{[m for m in LABEL_MAPS if m]} (e.g. 'mnli_to_hans' for an MNLI "
                "model on HANS)."
            )
        index = {c: i for i, c in enumerate(ood_classes)}
        return np.array([index.get(c, -1) for c in task_classes], dtype=np.int32)
    if label_map == "mnli_to_hans":
        if task_classes != nli.MNLI_CLASSES or ood_classes != nli.HANS_CLASSES:
            raise ValueError(
                f"{key}='mnli_to_hans' maps MNLI classes {list(nli.MNLI_CLASSES)} to "
                f"HANS classes {list(nli.HANS_CLASSES)}; got model classes "
                f"{list(task_classes)} and OOD classes {list(ood_classes)}. Use it "
                "only for an MNLI model on a HANS file (source 'hans')."
            )
        return nli.MNLI_TO_HANS.copy()
    raise ValueError(
        f"Unknown {key} {label_map!r}; valid: {list(LABEL_MAPS)} ('' = identity by "
        "class name)."
    )


def load_ood_set(
    name: str,
    entry: ml_collections.ConfigDict,
    tokenizer: Any,
    *,
    max_length: int,
    task_classes: Sequence[str],
) -> OODSet:
    """Reads, checks and tokenizes one ``config.eval.ood.<name>`` entry.

    Args:
      name: the entry name.
      entry: shaped like :func:`default_ood_entry`.
      tokenizer: the run's Hugging Face tokenizer.
      max_length: token length ``L`` (the run's ``data.max_length``).
      task_classes: the model's task classes.

    Returns:
      The :class:`OODSet`.

    Raises:
      FileNotFoundError: no file at ``entry.path`` (names the config key).
      ValueError: an unknown source or label map, or classes the map cannot
        connect.
    """
    key = f"eval.ood.{name}"
    source = entry_source(name, entry)
    if not entry.path or not os.path.isfile(entry.path):
        raise FileNotFoundError(
            f"{key}.path = {entry.path!r} is not a file. Set it to the "
            f"{source} file (e.g. {_EXAMPLE_FILES.get(source, '...')}), "
            f"or set {key}.enabled = False."
        )
    data_config = default_data_config()
    data_config.source = source
    data_config.splits = ("test",)
    data_config.split_files.test = entry.path
    dataset, rows = nli.load_pair_source(source, data_config)
    classes = tuple(dataset.task_classes)
    mapping = prediction_map(
        entry.label_map, task_classes=task_classes, ood_classes=classes, name=name
    )
    raw = dataset.splits["test"]
    r = rows["test"]
    meta = {"guid": np.asarray(r.guid, dtype=str)}
    meta.update({k: np.asarray(v, dtype=str) for k, v in r.meta.items()})
    return OODSet(
        name=name,
        source=source,
        path=entry.path,
        split=tokenize_split(raw, tokenizer, max_length=max_length),
        classes=classes,
        label_map=entry.label_map,
        prediction_map=mapping,
        meta=meta,
    )


_EXAMPLE_FILES = {
    "hans": "MNLI/hans/heuristics_evaluation_set.txt",
    "paws": "QQP/paws_qqp/dev.tsv or QQP/paws_wiki/test.tsv",
    "fever_symmetric": "fever/sym2/test.jsonl",
}


def enabled_entries(ood_config: ml_collections.ConfigDict | None) -> list[str]:
    """Names of the enabled entries of ``config.eval.ood`` (``None``: none)."""
    if ood_config is None:
        return []
    return [name for name, entry in ood_config.items() if entry.enabled]


def load_ood_sets(
    ood_config: ml_collections.ConfigDict,
    tokenizer: Any,
    *,
    max_length: int,
    task_classes: Sequence[str],
) -> dict[str, OODSet]:
    """Loads every enabled entry of ``config.eval.ood``.

    Args:
      ood_config: name -> entry shaped like :func:`default_ood_entry`.
      tokenizer: the run's tokenizer.
      max_length: token length ``L``.
      task_classes: the model's task classes.

    Returns:
      name -> :class:`OODSet`, in config order; disabled entries are skipped.
    """
    return {
        name: load_ood_set(
            name,
            ood_config[name],
            tokenizer,
            max_length=max_length,
            task_classes=task_classes,
        )
        for name in enabled_entries(ood_config)
    }


# ---------------------------------------------------------------- metrics


def _acc(correct: np.ndarray, mask: np.ndarray) -> float:
    return float(correct[mask].mean()) if mask.any() else float("nan")


def _f1(gold: np.ndarray, pred: np.ndarray, positive: int) -> float:
    tp = np.sum((pred == positive) & (gold == positive))
    fp = np.sum((pred == positive) & (gold != positive))
    fn = np.sum((pred != positive) & (gold == positive))
    denom = 2 * tp + fp + fn
    return float(2 * tp / denom) if denom else 0.0


def hans_metrics(
    gold: np.ndarray,
    pred: np.ndarray,
    heuristic: np.ndarray,
    classes: Sequence[str] = nli.HANS_CLASSES,
) -> dict[str, float]:
    """Per-gold-label, per-heuristic and per-pair HANS accuracy.

    Args:
      gold: int ``[N]`` indices into ``classes``.
      pred: int ``[N]`` mapped predictions (-1 counts as wrong).
      heuristic: str ``[N]`` (``lexical_overlap``, ``subsequence``,
        ``constituent``).
      classes: the HANS class names.

    Returns:
      ``{<class>: acc, <heuristic>: acc, "<class>/<heuristic>": acc}``; an
      empty cell gives ``NaN``.
    """
    correct = gold == pred
    out = {}
    heuristics = sorted(set(heuristic.tolist()))
    for c, cls in enumerate(classes):
        out[cls] = _acc(correct, gold == c)
    for h in heuristics:
        out[h] = _acc(correct, heuristic == h)
    for c, cls in enumerate(classes):
        for h in heuristics:
            out[f"{cls}/{h}"] = _acc(correct, (gold == c) & (heuristic == h))
    return out


def paraphrase_metrics(gold: np.ndarray, pred: np.ndarray) -> dict[str, float]:
    """[S]'s PAWS metrics for binary labels ``0`` (non-duplicate), ``1``.

    Args:
      gold: int ``[N]`` in {0, 1}.
      pred: int ``[N]`` mapped predictions (-1 counts as wrong).

    Returns:
      ``{"f1", "non_duplicate_f1", "average_f1", "duplicate_acc",
      "non_duplicate_acc"}``; an F1 with no positive prediction and no
      positive label is 0 (scikit-learn's ``zero_division`` result), a recall
      over no example is ``NaN``.
    """
    correct = gold == pred
    f1_pos, f1_neg = _f1(gold, pred, 1), _f1(gold, pred, 0)
    n_pos, n_neg = int(np.sum(gold == 1)), int(np.sum(gold == 0))
    return {
        "f1": f1_pos,
        "non_duplicate_f1": f1_neg,
        "average_f1": (n_pos * f1_pos + n_neg * f1_neg) / max(n_pos + n_neg, 1),
        "duplicate_acc": _acc(correct, gold == 1),
        "non_duplicate_acc": _acc(correct, gold == 0),
    }


def ood_metrics(oodset: OODSet, predictions: np.ndarray) -> dict[str, float]:
    """Scores a model's predictions on an OOD set (see the module doc).

    Args:
      oodset: the set.
      predictions: int ``[N]`` argmax predictions over the model's task
        classes, in the set's row order.

    Returns:
      ``{"num_examples", "accuracy", ...}`` plus the HANS or PAWS metrics.

    Raises:
      ValueError: ``predictions`` of the wrong length or out of range.
    """
    pred = np.asarray(predictions)
    n = len(oodset)
    if pred.shape != (n,):
        raise ValueError(
            f"OOD set {oodset.name!r} has {n} examples; got predictions of shape "
            f"{list(pred.shape)}."
        )
    mapped = oodset.map_predictions(pred)
    gold = oodset.split.task
    out = {"num_examples": float(n), "accuracy": float(np.mean(mapped == gold))}
    if oodset.source == "hans" and "heuristic" in oodset.meta:
        out.update(hans_metrics(gold, mapped, oodset.meta["heuristic"], oodset.classes))
    if oodset.source in PARAPHRASE_SOURCES and oodset.classes == ("0", "1"):
        out.update(paraphrase_metrics(gold, mapped))
    return out
