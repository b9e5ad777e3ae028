"""Dataset containers and the one place where string labels become integers.

Every source (synthetic, tabular files, the reference layouts) produces raw
string labels per split and hands them to :func:`encode_splits`, which builds
the label vocabularies from the train split (sorted) or takes them from an
explicit list, and checks the things that would otherwise fail late: empty
splits, labels in dev/test that train never saw, attributes with a single
class in train.

Shapes: ``N`` is the number of examples of a split, ``L`` the token length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

SPLITS = ("train", "dev", "test")


@dataclasses.dataclass(frozen=True)
class RawSplit:
    """One split of a text dataset before tokenization.

    Attributes:
      text: ``N`` input texts.
      text_pair: ``N`` second segments (sentence-pair tasks) or ``None``.
      task: int32 ``[N]`` task label indices into ``TextDataset.task_classes``.
      attrs: attribute name -> int32 ``[N]`` indices into
        ``TextDataset.attr_classes[name]``.
      extras: per-example float32 arrays with leading dimension ``N`` (e.g.
        ``"bias_logprobs"`` ``[N, C]``); carried through :meth:`take`, so they
        stay row-aligned through truncation and balancing. Default empty.
    """

    text: list[str]
    text_pair: list[str] | None
    task: np.ndarray
    attrs: dict[str, np.ndarray]
    extras: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        n = len(self.text)
        if self.text_pair is not None and len(self.text_pair) != n:
            raise ValueError(f"text_pair has {len(self.text_pair)} rows, text {n}.")
        arrays = {
            "task": self.task,
            **{f"attrs[{k}]": v for k, v in self.attrs.items()},
        }
        for key, arr in arrays.items():
            if arr.shape != (n,) or arr.dtype != np.int32:
                raise ValueError(
                    f"{key} must be int32 [{n}], got {arr.dtype} {list(arr.shape)}."
                )
        _check_extras(self.extras, n)

    def __len__(self) -> int:
        return len(self.text)

    def take(self, indices: np.ndarray) -> RawSplit:
        """Returns the rows at ``indices`` (int array, repeats allowed)."""
        indices = np.asarray(indices, dtype=np.int64)
        return RawSplit(
            text=[self.text[i] for i in indices],
            text_pair=(
                None if self.text_pair is None else [self.text_pair[i] for i in indices]
            ),
            task=self.task[indices],
            attrs={k: v[indices] for k, v in self.attrs.items()},
            extras={k: v[indices] for k, v in self.extras.items()},
        )


@dataclasses.dataclass(frozen=True)
class TextDataset:
    """A labelled text dataset: splits plus label vocabularies.

    Attributes:
      splits: split name (``train``/``dev``/``test``) -> :class:`RawSplit`.
      task_classes: task label names; index ``i`` is integer label ``i``.
      attr_classes: attribute name -> class names of that attribute.
      name: dataset name for reports (e.g. ``"synthetic"``, ``"dwmw17_dialect"``).
      synthetic: True when the data is generated in code, so that reports can
        say so.
      bias_summary: JSON-serialisable summary of the bias-only model whose
        log-probabilities the splits carry as ``extras["bias_logprobs"]``
        (see :func:`moddiffy_jax.data.bias.compute_bias_extras`); empty when
        no bias model is configured.
      train_originals: where ``data.balance`` upsampled train, how many of
        its first rows are the rows as read (the copies follow); None when
        train is as read (:func:`moddiffy_jax.data.balance.original_train`).
    """

    splits: dict[str, RawSplit]
    task_classes: tuple[str, ...]
    attr_classes: dict[str, tuple[str, ...]]
    name: str
    synthetic: bool
    bias_summary: dict = dataclasses.field(default_factory=dict)
    train_originals: int | None = None

    @property
    def attributes(self) -> tuple[str, ...]:
        """Protected attribute names, in configured order."""
        return tuple(self.attr_classes)

    def replace(self, **changes) -> TextDataset:
        """Returns a copy with ``changes`` applied (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class TokenizedSplit:
    """One tokenized split; every array has leading dimension ``N``.

    Attributes:
      input_ids: int32 ``[N, L]``.
      attention_mask: int32 ``[N, L]`` (1 real token, 0 padding).
      token_type_ids: int32 ``[N, L]``.
      task: int32 ``[N]``.
      attrs: attribute name -> int32 ``[N]``.
      extras: name -> float32 per-example array with leading dimension ``N``,
        e.g. ``"bias_logprobs"`` ``[N, C]`` (log-probabilities of a bias-only
        model over the task classes) or ``"teacher_probs"`` ``[N, C]``.
        Default empty; add arrays with :func:`with_extras`.
    """

    input_ids: np.ndarray
    attention_mask: np.ndarray
    token_type_ids: np.ndarray
    task: np.ndarray
    attrs: dict[str, np.ndarray]
    extras: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        n, length = self.input_ids.shape
        for key in ("input_ids", "attention_mask", "token_type_ids"):
            arr = getattr(self, key)
            if arr.shape != (n, length) or arr.dtype != np.int32:
                raise ValueError(
                    f"{key} must be int32 [{n}, {length}], got {arr.dtype} "
                    f"{list(arr.shape)}."
                )
        for key, arr in {"task": self.task, **self.attrs}.items():
            if arr.shape != (n,) or arr.dtype != np.int32:
                raise ValueError(
                    f"{key} must be int32 [{n}], got {arr.dtype} {list(arr.shape)}."
                )
        _check_extras(self.extras, n)

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def take(self, indices: np.ndarray) -> dict:
        """Returns a batch dict of the rows at ``indices``.

        Returns:
          ``{"input_ids", "attention_mask", "token_type_ids": [B, L] int32,
          "task": [B] int32, "attrs": {name: [B] int32}, "extras": {name:
          [B, ...] float32}}`` with ``B = len(indices)``; ``"extras"`` is
          always present (``{}`` when the split has none).
        """
        indices = np.asarray(indices, dtype=np.int64)
        return {
            "input_ids": self.input_ids[indices],
            "attention_mask": self.attention_mask[indices],
            "token_type_ids": self.token_type_ids[indices],
            "task": self.task[indices],
            "attrs": {k: v[indices] for k, v in self.attrs.items()},
            "extras": {k: v[indices] for k, v in self.extras.items()},
        }


@dataclasses.dataclass(frozen=True)
class TokenizedDataset:
    """Tokenized splits plus the label vocabularies and provenance.

    Attributes:
      splits: split name -> :class:`TokenizedSplit`.
      task_classes: task label names.
      attr_classes: attribute name -> class names.
      name: dataset name for reports.
      synthetic: True when the data is generated in code.
      max_length: token length ``L`` of every split.
      bias_summary: summary of the bias-only model behind
        ``extras["bias_logprobs"]`` (as in :class:`TextDataset`); empty when
        none is configured.
      train_originals: as in :class:`TextDataset`.
    """

    splits: dict[str, TokenizedSplit]
    task_classes: tuple[str, ...]
    attr_classes: dict[str, tuple[str, ...]]
    name: str
    synthetic: bool
    max_length: int
    bias_summary: dict = dataclasses.field(default_factory=dict)
    train_originals: int | None = None

    @property
    def attributes(self) -> tuple[str, ...]:
        """Protected attribute names, in configured order."""
        return tuple(self.attr_classes)

    def replace(self, **changes) -> TokenizedDataset:
        """Returns a copy with ``changes`` applied (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)


SplitT = TypeVar("SplitT", RawSplit, TokenizedSplit)
DatasetT = TypeVar("DatasetT", TextDataset, TokenizedDataset)


def _check_extras(extras: Mapping[str, np.ndarray], n: int) -> None:
    """Checks that every extra is a float32 array with leading dimension ``n``."""
    for key, arr in extras.items():
        if not isinstance(arr, np.ndarray) or arr.ndim < 1 or arr.shape[0] != n:
            shape = list(np.shape(arr))
            raise ValueError(
                f"extras[{key!r}] must have leading dimension {n} (one row per "
                f"example of the split), got shape {shape}. Fix: build it from the "
                "split's final rows (after truncation and balancing)."
            )
        if arr.dtype != np.float32:
            raise ValueError(
                f"extras[{key!r}] must be float32, got {arr.dtype}. Fix: add it "
                "with with_extras(), which casts floating arrays to float32."
            )


def _as_extra(name: str, value) -> np.ndarray:
    arr = np.asarray(value)
    if not np.issubdtype(arr.dtype, np.number) or np.iscomplexobj(arr):
        raise ValueError(
            f"extras[{name!r}] must be numeric (it is cast to float32), got "
            f"{arr.dtype}."
        )
    return arr.astype(np.float32)


def with_extras(split: SplitT, **arrays) -> SplitT:
    """Returns a copy of ``split`` with per-example ``arrays`` added to its extras.

    Works on a :class:`TokenizedSplit` or a :class:`RawSplit`; the split is not
    changed. An existing extra of the same name is replaced.

    Example::

        train = with_extras(ds.splits["train"], bias_logprobs=log_probs)
        next(TrainIterator(train, ...))["extras"]["bias_logprobs"]  # [B, C]

    Args:
      split: the split (``N`` examples).
      **arrays: name -> numeric array with leading dimension ``N`` (cast to
        float32), e.g. ``bias_logprobs`` ``[N, C]``.

    Returns:
      The split with ``extras = {**split.extras, **arrays}``.

    Raises:
      ValueError: an array whose leading dimension is not ``N``.
    """
    extras = dict(split.extras)
    extras.update({k: _as_extra(k, v) for k, v in arrays.items()})
    return dataclasses.replace(split, extras=extras)


def dataset_with_extras(
    dataset: DatasetT, extras: Mapping[str, Mapping[str, np.ndarray]]
) -> DatasetT:
    """Adds per-example extras to several splits of a dataset.

    Args:
      dataset: a :class:`TokenizedDataset` or :class:`TextDataset`.
      extras: split name -> {extra name -> array with leading dimension ``N``
        of that split}. Splits not named keep their extras.

    Returns:
      A copy of ``dataset`` whose named splits carry the arrays (as float32).

    Raises:
      ValueError: a split the dataset does not have, or a misaligned array.
    """
    unknown = sorted(set(extras) - set(dataset.splits))
    if unknown:
        raise ValueError(
            f"Extras given for splits {unknown}, which the dataset does not have "
            f"(its splits: {sorted(dataset.splits)})."
        )
    splits = {
        name: with_extras(split, **extras.get(name, {}))
        for name, split in dataset.splits.items()
    }
    return dataclasses.replace(dataset, splits=splits)


@dataclasses.dataclass(frozen=True)
class StringColumns:
    """One split with string labels, as read by a source (before encoding).

    Attributes:
      text: ``N`` texts.
      text_pair: ``N`` second segments or ``None``.
      task: ``N`` task label strings.
      attrs: attribute name -> ``N`` label strings.
    """

    text: list[str]
    text_pair: list[str] | None
    task: list[str]
    attrs: dict[str, list[str]]

    def __len__(self) -> int:
        return len(self.text)


def summarize_dataset(dataset: TextDataset | TokenizedDataset) -> dict:
    """Returns JSON-serialisable class counts per split, for reports.

    Returns:
      ``{"name", "synthetic", "task_classes", "attr_classes", "splits":
      {split: {"num_examples", "task": {class: count}, "attrs": {name:
      {class: count}}}}}``, plus ``"bias"`` (the bias-model summary) when the
      dataset has one.
    """
    splits = {}
    for split_name, split in dataset.splits.items():
        splits[split_name] = {
            "num_examples": len(split),
            "task": _counts(split.task, dataset.task_classes),
            "attrs": {
                k: _counts(split.attrs[k], dataset.attr_classes[k])
                for k in dataset.attr_classes
            },
        }
    summary = {
        "name": dataset.name,
        "synthetic": dataset.synthetic,
        "task_classes": list(dataset.task_classes),
        "attr_classes": {k: list(v) for k, v in dataset.attr_classes.items()},
        "splits": splits,
    }
    if dataset.bias_summary:
        summary["bias"] = dataset.bias_summary
    return summary


def _counts(labels: np.ndarray, classes: Sequence[str]) -> dict[str, int]:
    counts = np.bincount(labels, minlength=len(classes))
    return {c: int(n) for c, n in zip(classes, counts, strict=True)}


def encode_splits(
    raw: Mapping[str, StringColumns],
    *,
    attributes: Sequence[str],
    task_column: str,
    attr_columns: Mapping[str, str],
    task_classes: Sequence[str] | None = None,
    attr_classes: Mapping[str, Sequence[str]] | None = None,
    name: str,
    synthetic: bool,
) -> TextDataset:
    """Builds label vocabularies and encodes string labels as int32.

    Vocabularies come from the train split (sorted unique values) unless an
    explicit class list is given; explicit lists keep their order.

    Args:
      raw: split name -> string columns; must contain ``"train"``.
      attributes: attribute names, in the order the dataset should keep.
      task_column: the task label's column name in the source (for messages).
      attr_columns: attribute name -> column name in the source (for messages).
      task_classes: explicit task classes, or ``None``/empty to use train's.
      attr_classes: attribute name -> explicit classes (missing or empty: train's).
      name: dataset name.
      synthetic: whether the data is generated in code.

    Returns:
      The encoded :class:`TextDataset`.

    Raises:
      ValueError: no train split, an empty split, a label outside the
        vocabulary, or a task/attribute with fewer than two classes in train.
    """
    if "train" not in raw:
        raise ValueError(
            f"Dataset {name!r} has no 'train' split (got {sorted(raw)}); the label "
            "vocabularies are built from train."
        )
    for split_name, cols in raw.items():
        if len(cols) == 0:
            raise ValueError(
                f"Split {split_name!r} of dataset {name!r} is empty. Check the split "
                "column values / per-split file, or drop the split from data.splits."
            )
    attr_classes = dict(attr_classes or {})
    unknown = sorted(set(attr_classes) - set(attributes))
    if unknown:
        raise ValueError(
            f"attr_classes names attributes {unknown} that are not in the attribute "
            f"list {list(attributes)}."
        )
    train = raw["train"]
    task_vocab = _vocab(train.task, task_classes, column=task_column, label="task")
    attr_vocab = {
        a: _vocab(
            train.attrs[a],
            attr_classes.get(a),
            column=attr_columns[a],
            label=f"attribute {a!r}",
        )
        for a in attributes
    }
    for label, column, values in [("task", task_column, train.task)] + [
        (f"attribute {a!r}", attr_columns[a], train.attrs[a]) for a in attributes
    ]:
        present = sorted(set(values))
        if len(present) < 2:
            raise ValueError(
                f"The {label} (column {column!r}) has a single class {present} in the "
                f"train split of {name!r}; accuracy/balanced accuracy over it is "
                "undefined. Use a dataset where train has at least two classes."
            )
    splits = {}
    for split_name, cols in raw.items():
        splits[split_name] = RawSplit(
            text=list(cols.text),
            text_pair=None if cols.text_pair is None else list(cols.text_pair),
            task=_encode(
                cols.task,
                task_vocab,
                column=task_column,
                split=split_name,
                kind="task_classes",
                explicit=bool(task_classes),
            ),
            attrs={
                a: _encode(
                    cols.attrs[a],
                    attr_vocab[a],
                    column=attr_columns[a],
                    split=split_name,
                    kind=f"attr_classes.{a}",
                    explicit=bool(attr_classes.get(a)),
                )
                for a in attributes
            },
        )
    return TextDataset(
        splits=splits,
        task_classes=tuple(task_vocab),
        attr_classes={a: tuple(attr_vocab[a]) for a in attributes},
        name=name,
        synthetic=synthetic,
    )


def _vocab(
    train_values: Sequence[str],
    classes: Sequence[str] | None,
    *,
    column: str,
    label: str,
) -> list[str]:
    if classes:
        classes = [str(c) for c in classes]
        dupes = sorted({c for c in classes if classes.count(c) > 1})
        if dupes:
            raise ValueError(f"Class list for {label} has duplicates {dupes}.")
        return classes
    return sorted(set(train_values))


def _encode(
    values: Sequence[str],
    vocab: Sequence[str],
    *,
    column: str,
    split: str,
    kind: str,
    explicit: bool,
) -> np.ndarray:
    index = {c: i for i, c in enumerate(vocab)}
    out = np.empty(len(values), dtype=np.int32)
    for row, value in enumerate(values):
        i = index.get(value)
        if i is None:
            source = "the explicit class list" if explicit else "the train split"
            raise ValueError(
                f"Unknown label {value!r} in column {column!r} of split {split!r} "
                f"(row {row}); the vocabulary from {source} is {list(vocab)}. Fix: "
                f"add it to the config's class list (data.{kind}) or clean "
                "the file."
            )
        out[row] = i
    return out


def read_label_file(path: str) -> tuple[str, ...]:
    """Reads a reference-style label file: one label per line, index = line order.

    Blank lines (e.g. a trailing newline) are skipped.

    Args:
      path: text file path.

    Returns:
      The class names in file order.
    """
    with open(path, encoding="utf-8") as f:
        labels = tuple(line.strip() for line in f if line.strip())
    if len(labels) < 2:
        raise ValueError(
            f"Label file {path!r} lists {len(labels)} label(s); need >= 2."
        )
    return labels


def subset_split(split: Any, indices: np.ndarray) -> Any:
    """The rows ``indices`` of a TokenizedSplit or ImageSplit: every array
    field and every dict of arrays (attributes, extras) indexed alike."""
    indices = np.asarray(indices, dtype=np.int64)
    changes = {}
    for field in dataclasses.fields(split):
        value = getattr(split, field.name)
        if isinstance(value, np.ndarray):
            changes[field.name] = value[indices]
        elif isinstance(value, dict):
            changes[field.name] = {k: v[indices] for k, v in value.items()}
    return dataclasses.replace(split, **changes)
