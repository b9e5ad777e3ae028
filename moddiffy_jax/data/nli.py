"""Readers for the SRNets sentence-pair datasets: MNLI, HANS, QQP, PAWS, FEVER.

Each reader parses one local file in the format the SRNets code ([S]) reads
and returns a :class:`PairRows` (texts, string labels, ids); the sources
``mnli``, ``hans``, ``qqp``, ``paws``, ``fever`` and ``fever_symmetric`` turn
the files of a data config into a :class:`TextDataset` with a fixed class list
(the [S] label order) and no protected attribute (``attr_classes == {}``).

File per split: ``data.split_files.<split>`` if set, otherwise
``data.path`` (a directory) joined with the [S] layout's file name
(:data:`LAYOUTS`). TSVs are read like [S]: tab-separated, no quoting,
``utf-8-sig``; columns are found by header name.

HANS has two classes (``non-entailment``, ``entailment``). To score an MNLI
model on HANS, map its 3-way predictions with :func:`mnli_to_hans_predictions`
(neutral and contradiction both count as non-entailment), as [S] does.

:func:`word_overlap_features` computes the hand-crafted overlap features of the
MNLI -> HANS bias-only model (spec A8).
"""

from __future__ import annotations

import csv
import json
import os
import re
from collections.abc import Sequence
from typing import NamedTuple

import ml_collections
import numpy as np

from moddiffy_jax.data.dataset import SPLITS, RawSplit, TextDataset

MNLI_CLASSES = ("contradiction", "entailment", "neutral")
HANS_CLASSES = ("non-entailment", "entailment")
QQP_CLASSES = ("0", "1")
PAWS_CLASSES = ("0", "1")
FEVER_CLASSES = ("SUPPORTS", "REFUTES", "NOT ENOUGH INFO")

# MNLI class index -> HANS class index: contradiction (0) -> non-entailment (0),
# entailment (1) -> entailment (1), neutral (2) -> non-entailment (0).
MNLI_TO_HANS = np.array([0, 1, 0], dtype=np.int32)

# Per source: split -> file name inside ``data.path`` ([S] directory layout).
# MNLI's GLUE test labels are hidden, so "test" is dev_mismatched; HANS,
# PAWS dev/test and FEVER-Symmetric are evaluation sets.
LAYOUTS: dict[str, dict[str, str]] = {
    "mnli": {
        "train": "train.tsv",
        "dev": "dev_matched.tsv",
        "test": "dev_mismatched.tsv",
    },
    "hans": {
        "train": "heuristics_train_set.txt",
        "test": "heuristics_evaluation_set.txt",
    },
    "qqp": {"train": "train.tsv", "dev": "dev.tsv"},
    "paws": {"train": "train.tsv", "dev": "dev.tsv", "test": "test.tsv"},
    "fever": {"train": "fever.train.jsonl", "dev": "fever.dev.jsonl"},
    "fever_symmetric": {"dev": "dev.jsonl", "test": "test.jsonl"},
}

OVERLAP_FEATURE_NAMES = ("h-is-subseq", "all-in-p", "percent-in-p", "log-len-diff")

_TOKEN_RE = re.compile(r"\w+|[^\w\s]", re.UNICODE)


class PairRows(NamedTuple):
    """The rows of one file, in file order.

    Attributes:
      text: ``N`` first segments (premise / question1 / claim).
      text_pair: ``N`` second segments (hypothesis / question2 / evidence).
      label: ``N`` label strings, stripped.
      guid: ``N`` example ids as [S] builds them (used to attach bias-model
        predictions, spec A8): MNLI ``<split>-<index column>``, QQP
        ``<split>-<id>``, PAWS the id column, HANS the pairID, FEVER
        ``<split>-<line number>`` or the ``id`` field where present.
      meta: extra string columns, ``name -> N`` values (HANS: ``heuristic``,
        ``subcase`` for per-heuristic breakdowns); empty for other files.
    """

    text: list[str]
    text_pair: list[str]
    label: list[str]
    guid: list[str]
    meta: dict[str, list[str]]


# ---------------------------------------------------------------- readers


def _check_file(path: str, what: str) -> None:
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{what} file {path!r} not found. Expected {_FORMATS[what]}. Set "
            "data.split_files.<split> to the file, or data.path to the directory "
            "holding the [S] layout."
        )


def _read_tsv(
    path: str, *, what: str, columns: Sequence[str]
) -> tuple[list[dict[str, str]], list[int]]:
    """Reads a headed TSV like [S] (no quoting, utf-8-sig); returns rows, lines."""
    _check_file(path, what)
    with open(path, encoding="utf-8-sig", newline="") as f:
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(reader, None)
        if header is None:
            raise ValueError(f"{what} file {path!r} is empty (no header row).")
        header = [h.strip() for h in header]
        missing = [c for c in columns if c not in header]
        if missing:
            raise ValueError(
                f"{what} file {path!r} lacks columns {missing}; header is {header}. "
                f"Expected {_FORMATS[what]}."
            )
        index = {c: header.index(c) for c in columns}
        need = max(index.values()) + 1
        rows, lines = [], []
        for line in reader:
            if not line or (len(line) == 1 and not line[0].strip()):
                continue
            if len(line) < need:
                raise ValueError(
                    f"Malformed row at line {reader.line_num} of {what} file "
                    f"{path!r}: {len(line)} tab-separated fields, need at least "
                    f"{need} (columns {list(columns)})."
                )
            rows.append({c: line[i] for c, i in index.items()})
            lines.append(reader.line_num)
    if not rows:
        raise ValueError(f"{what} file {path!r} has a header but no data rows.")
    return rows, lines


def read_mnli_tsv(path: str, *, split: str = "train") -> PairRows:
    """Reads a GLUE MNLI TSV (``train``, ``dev_matched``, ``dev_mismatched``).

    Args:
      path: the TSV; header with ``index``, ``sentence1``, ``sentence2``,
        ``gold_label``.
      split: guid prefix.

    Returns:
      :class:`PairRows` with premise/hypothesis and labels in
      :data:`MNLI_CLASSES`.
    """
    cols = ("index", "sentence1", "sentence2", "gold_label")
    rows, _ = _read_tsv(path, what="MNLI", columns=cols)
    return PairRows(
        text=[r["sentence1"] for r in rows],
        text_pair=[r["sentence2"] for r in rows],
        label=[r["gold_label"].strip() for r in rows],
        guid=[f"{split}-{r['index'].strip()}" for r in rows],
        meta={},
    )


def read_hans_tsv(path: str) -> PairRows:
    """Reads a HANS file (``heuristics_{train,evaluation}_set.txt``).

    Args:
      path: the tab-separated file with header ``gold_label``, ...,
        ``sentence1``, ``sentence2``, ``pairID``, ``heuristic``, ``subcase``.

    Returns:
      :class:`PairRows` with labels in :data:`HANS_CLASSES` and
      ``meta = {"heuristic", "subcase"}``.
    """
    cols = ("gold_label", "sentence1", "sentence2", "pairID", "heuristic", "subcase")
    rows, _ = _read_tsv(path, what="HANS", columns=cols)
    return PairRows(
        text=[r["sentence1"] for r in rows],
        text_pair=[r["sentence2"] for r in rows],
        label=[r["gold_label"].strip() for r in rows],
        guid=[r["pairID"].strip() for r in rows],
        meta={
            "heuristic": [r["heuristic"].strip() for r in rows],
            "subcase": [r["subcase"].strip() for r in rows],
        },
    )


def read_qqp_tsv(path: str, *, split: str = "train") -> PairRows:
    """Reads a GLUE QQP TSV (``train.tsv``, ``dev.tsv``).

    Unlike [S], which silently skips rows with too few fields, a short row is
    an error.

    Args:
      path: the TSV; header with ``id``, ``question1``, ``question2``,
        ``is_duplicate``.
      split: guid prefix.

    Returns:
      :class:`PairRows` with labels in :data:`QQP_CLASSES`.
    """
    cols = ("id", "question1", "question2", "is_duplicate")
    rows, _ = _read_tsv(path, what="QQP", columns=cols)
    return PairRows(
        text=[r["question1"] for r in rows],
        text_pair=[r["question2"] for r in rows],
        label=[r["is_duplicate"].strip() for r in rows],
        guid=[f"{split}-{r['id'].strip()}" for r in rows],
        meta={},
    )


def read_paws_tsv(path: str) -> PairRows:
    """Reads a PAWS TSV (PAWS-QQP or PAWS-Wiki ``train``/``dev``/``test``).

    Args:
      path: the TSV; header ``id``, ``sentence1``, ``sentence2``, ``label``.

    Returns:
      :class:`PairRows` with labels in :data:`PAWS_CLASSES`.
    """
    cols = ("id", "sentence1", "sentence2", "label")
    rows, _ = _read_tsv(path, what="PAWS", columns=cols)
    return PairRows(
        text=[r["sentence1"] for r in rows],
        text_pair=[r["sentence2"] for r in rows],
        label=[r["label"].strip() for r in rows],
        guid=[r["id"].strip() for r in rows],
        meta={},
    )


def read_fever_jsonl(
    path: str, *, split: str = "train", what: str = "FEVER"
) -> PairRows:
    """Reads processed FEVER or FEVER-Symmetric JSON lines.

    Each line holds ``claim``, the evidence text in ``evidence`` or
    ``evidence_sentence``, and the label in ``gold_label`` or ``label``
    (``SUPPORTS``/``REFUTES``/``NOT ENOUGH INFO``).

    Args:
      path: the ``.jsonl`` file.
      split: guid prefix when a line has no ``id``.
      what: ``"FEVER"`` or ``"FEVER-Symmetric"`` (for messages).

    Returns:
      :class:`PairRows` with claim/evidence; guid ``id`` or
      ``<split>-<line number>`` (0-based over non-blank lines).

    Raises:
      ValueError: a line that is not a JSON object, lacks a field, or has
        evidence that is not a string (the raw FEVER release stores evidence
        as sentence ids; use the Symmetric authors' processed files).
    """
    _check_file(path, what)
    text, pair, label, guid = [], [], [], []
    with open(path, encoding="utf-8-sig") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"line {line_no} of {what} file {path!r}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"Malformed row at {where}: not JSON ({e}).") from e
            if not isinstance(obj, dict):
                raise ValueError(f"Malformed row at {where}: not a JSON object.")
            values = {}
            for field, keys in (
                ("claim", ("claim",)),
                ("evidence", ("evidence", "evidence_sentence")),
                ("label", ("gold_label", "label")),
            ):
                key = next((k for k in keys if k in obj), None)
                if key is None:
                    raise ValueError(
                        f"Malformed row at {where}: no {' or '.join(keys)} field "
                        f"(keys: {sorted(obj)})."
                    )
                if not isinstance(obj[key], str):
                    raise ValueError(
                        f"Malformed row at {where}: {key!r} is "
                        f"{type(obj[key]).__name__}, expected a string. "
                        f"Expected {_FORMATS[what]}."
                    )
                values[field] = obj[key]
            text.append(values["claim"])
            pair.append(values["evidence"])
            label.append(values["label"].strip())
            guid.append(str(obj["id"]) if "id" in obj else f"{split}-{len(guid)}")
    if not text:
        raise ValueError(f"{what} file {path!r} has no rows.")
    return PairRows(text=text, text_pair=pair, label=label, guid=guid, meta={})


_FORMATS = {
    "MNLI": "a GLUE MNLI TSV (header with sentence1, sentence2, gold_label)",
    "HANS": (
        "a HANS heuristics_*_set.txt TSV (header with gold_label, sentence1, "
        "sentence2, pairID, heuristic, subcase)"
    ),
    "QQP": "a GLUE QQP TSV (header with id, question1, question2, is_duplicate)",
    "PAWS": "a PAWS TSV (header id, sentence1, sentence2, label)",
    "FEVER": (
        "processed FEVER JSON lines (claim, evidence, gold_label/label) as "
        "released by the FEVER-Symmetric authors"
    ),
    "FEVER-Symmetric": (
        "FEVER-Symmetric JSON lines (claim, evidence or evidence_sentence, "
        "gold_label or label)"
    ),
}


# ---------------------------------------------------------------- sources


def _reader(source: str, path: str, split: str) -> PairRows:
    if source == "mnli":
        return read_mnli_tsv(path, split=split)
    if source == "hans":
        return read_hans_tsv(path)
    if source == "qqp":
        return read_qqp_tsv(path, split=split)
    if source == "paws":
        return read_paws_tsv(path)
    what = "FEVER" if source == "fever" else "FEVER-Symmetric"
    return read_fever_jsonl(path, split=split, what=what)


_CLASSES = {
    "mnli": MNLI_CLASSES,
    "hans": HANS_CLASSES,
    "qqp": QQP_CLASSES,
    "paws": PAWS_CLASSES,
    "fever": FEVER_CLASSES,
    "fever_symmetric": FEVER_CLASSES,
}


def split_paths(source: str, config: ml_collections.ConfigDict) -> dict[str, str]:
    """Returns split -> file path for ``config.splits``.

    ``data.split_files.<split>`` wins; otherwise ``data.path`` joined with the
    source's :data:`LAYOUTS` file name.

    Raises:
      ValueError: a requested split with neither (names both fields).
    """
    layout = LAYOUTS[source]
    split_files = dict(config.split_files)
    paths = {}
    for split in config.splits:
        if split not in SPLITS:
            raise ValueError(f"Unknown split {split!r}; valid: {list(SPLITS)}.")
        if split_files.get(split):
            paths[split] = split_files[split]
        elif config.path and split in layout:
            paths[split] = os.path.join(config.path, layout[split])
        else:
            where = (
                f"data.path (a directory; its layout has {dict(layout)})"
                if split in layout
                else f"data.path does not cover it (layout: {dict(layout)})"
            )
            raise ValueError(
                f"No file for split {split!r} of source {source!r}: set "
                f"data.split_files.{split}, or {where}, or drop {split!r} from "
                "data.splits."
            )
    return paths


def load_pair_source(
    source: str, config: ml_collections.ConfigDict
) -> tuple[TextDataset, dict[str, PairRows]]:
    """Loads one of the NLI/paraphrase/fact-checking sources.

    Args:
      source: a key of :data:`LAYOUTS`.
      config: a data config (see :func:`default_data_config`); reads ``splits``,
        ``path``, ``split_files``, ``name``, ``task_classes`` (must be empty or
        equal to the fixed list) and ``attributes`` (must be empty).

    Returns:
      ``(dataset, rows)``: the :class:`TextDataset` (fixed ``task_classes`` in
      [S] order, ``attr_classes == {}``, every split's ``attrs == {}``) and
      split -> :class:`PairRows` (ids and HANS heuristics).

    Raises:
      ValueError: protected attributes or other class lists requested, a
        label outside the class list (names file, row and value), or a train
        split with a single class.
    """
    classes = _CLASSES[source]
    if tuple(config.attributes) or len(config.attr_classes):
        raise ValueError(
            f"Source {source!r} has no protected attribute; leave data.attributes "
            "and data.attr_classes empty."
        )
    if config.task_classes and tuple(config.task_classes) != classes:
        raise ValueError(
            f"Source {source!r} has the fixed class list {list(classes)}; leave "
            f"data.task_classes empty (got {list(config.task_classes)})."
        )
    index = {c: i for i, c in enumerate(classes)}
    splits, rows = {}, {}
    for split, path in split_paths(source, config).items():
        r = _reader(source, path, split)
        task = np.empty(len(r.label), dtype=np.int32)
        for i, value in enumerate(r.label):
            if value not in index:
                raise ValueError(
                    f"Unknown label {value!r} in row {i} (guid {r.guid[i]!r}) of "
                    f"{path!r}; {source} labels are {list(classes)}."
                )
            task[i] = index[value]
        if split == "train" and len(np.unique(task)) < 2:
            raise ValueError(
                f"The train split {path!r} of {source!r} has a single class; "
                "accuracy over it is undefined."
            )
        splits[split] = RawSplit(
            text=r.text, text_pair=r.text_pair, task=task, attrs={}
        )
        rows[split] = r
    dataset = TextDataset(
        splits=splits,
        task_classes=classes,
        attr_classes={},
        name=config.name or source,
        synthetic=False,
    )
    return dataset, rows


def make_pair_loader(source: str):
    """Returns ``fn(config) -> TextDataset`` for the ``SOURCES`` registry."""

    def load(config: ml_collections.ConfigDict) -> TextDataset:
        return load_pair_source(source, config)[0]

    load.__doc__ = f"Loads the {source!r} files of ``config`` (see ``nli.py``)."
    return load


# ---------------------------------------------------------------- evaluation


def mnli_to_hans_predictions(predictions: np.ndarray) -> np.ndarray:
    """Maps MNLI class indices to HANS class indices.

    Predicted neutral and contradiction both count as non-entailment; this is
    [S]'s collapse of argmax predictions (``mask_run_glue.py:507-508``).

    Args:
      predictions: int ``[...]`` indices into :data:`MNLI_CLASSES`.

    Returns:
      int32 ``[...]`` indices into :data:`HANS_CLASSES`.
    """
    predictions = np.asarray(predictions)
    if predictions.size and (predictions.min() < 0 or predictions.max() > 2):
        raise ValueError("MNLI predictions must be class indices in {0, 1, 2}.")
    return MNLI_TO_HANS[predictions]


# ---------------------------------------------------------------- bias features


def _tokens(text: str) -> list[str]:
    return [t.lower() for t in _TOKEN_RE.findall(text)]


def _is_contiguous_subseq(h: list[str], p: list[str]) -> bool:
    n = len(h)
    return n > 0 and any(p[i : i + n] == h for i in range(len(p) - n + 1))


def word_overlap_features(
    premise: Sequence[str] | str, hypothesis: Sequence[str] | str
) -> np.ndarray:
    """Word-overlap features of the MNLI -> HANS bias-only model (spec A8).

    Texts are lowercased and split into words and punctuation marks (a regex
    stand-in for [D]'s NLTK+punct tokenizer). Columns, named in
    :data:`OVERLAP_FEATURE_NAMES`:

    0. ``h-is-subseq``: the hypothesis is a contiguous subsequence of the
       premise (0/1).
    1. ``all-in-p``: every hypothesis token occurs in the premise (0/1).
    2. ``percent-in-p``: fraction of hypothesis tokens in the premise (0 for
       an empty hypothesis).
    3. ``log-len-diff``: ``log(max(|p| - |h|, 1))`` in tokens.

    The fastText similarity features of [D] are not included.

    Args:
      premise: ``N`` premises (or one string).
      hypothesis: ``N`` hypotheses (or one string).

    Returns:
      float32 ``[N, 4]``.
    """
    if isinstance(premise, str):
        premise = [premise]
    if isinstance(hypothesis, str):
        hypothesis = [hypothesis]
    if len(premise) != len(hypothesis):
        raise ValueError(f"{len(premise)} premises but {len(hypothesis)} hypotheses.")
    out = np.zeros((len(premise), len(OVERLAP_FEATURE_NAMES)), dtype=np.float32)
    for i, (p_text, h_text) in enumerate(zip(premise, hypothesis, strict=True)):
        p, h = _tokens(p_text), _tokens(h_text)
        p_words = set(p)
        n_in = sum(w in p_words for w in h)
        out[i, 0] = _is_contiguous_subseq(h, p)
        out[i, 1] = bool(h) and n_in == len(h)
        out[i, 2] = n_in / len(h) if h else 0.0
        out[i, 3] = np.log(max(len(p) - len(h), 1))
    return out
