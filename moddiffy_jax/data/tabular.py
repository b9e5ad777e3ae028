"""Generic tabular loader: CSV, TSV, JSON lines (or a JSON array) and Parquet.

A column mapping says which column is the text, the optional second segment,
the task label and each protected attribute. Splits come either from a split
column (with configurable values, e.g. ``dev`` stored as ``val``) or from one
file per split. Labels are read as ``str(value)``, as the reference code does.

Pickle files are refused: convert them once, on trusted files only, with
``scripts/convert_pickle_dataset.py``.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Mapping, Sequence

from absl import logging

from moddiffy_jax.data import random_split
from moddiffy_jax.data.dataset import StringColumns, TextDataset, encode_splits

FORMATS = ("csv", "tsv", "jsonl", "parquet")
_SUFFIX_FORMATS = {
    ".csv": "csv",
    ".tsv": "tsv",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",
    ".parquet": "parquet",
    ".pq": "parquet",
}
_PICKLE_SUFFIXES = (".pkl", ".pickle")


def read_table(path: str, *, file_format: str = "") -> dict[str, list]:
    """Reads a table file into columns.

    Args:
      path: file path; relative paths are relative to the working directory
        (run from the repository root).
      file_format: one of ``csv``, ``tsv``, ``jsonl``, ``parquet``, or ``""``
        to infer it from the suffix (``.json`` holding a JSON array of objects
        is accepted as well as JSON lines).

    Returns:
      Column name -> list of values (strings for CSV/TSV; JSON values
      otherwise; ``None`` where a JSON row lacks a key).

    Raises:
      ValueError: a pickle path, an unknown format, or malformed rows.
      FileNotFoundError: the file does not exist.
      ImportError: Parquet without pyarrow.
    """
    if str(path).lower().endswith(_PICKLE_SUFFIXES) or file_format in (
        "pkl",
        "pickle",
    ):
        raise ValueError(
            f"Refusing to read pickle file {path!r}: unpickling runs arbitrary code, "
            "so library code never does it. Convert it once (only if you trust the "
            "file) with `python scripts/convert_pickle_dataset.py IN.pkl OUT.jsonl` "
            "and point the config at the JSONL file."
        )
    if not file_format:
        suffix = os.path.splitext(str(path))[1].lower()
        file_format = _SUFFIX_FORMATS.get(suffix, "")
        if not file_format:
            raise ValueError(
                f"Cannot infer the format of {path!r} from suffix {suffix!r}; known "
                f"suffixes {sorted(_SUFFIX_FORMATS)}. Set data.file_format to one of "
                f"{list(FORMATS)}."
            )
    if file_format not in FORMATS:
        raise ValueError(
            f"Unknown file_format {file_format!r}; valid: {list(FORMATS)}."
        )
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"Data file {path!r} not found (resolved to {os.path.abspath(path)!r}, "
            f"working directory {os.getcwd()!r}). Relative paths in configs are "
            "relative to the repository root."
        )
    try:
        if file_format in ("csv", "tsv"):
            return _read_csv(path, delimiter="," if file_format == "csv" else "\t")
        if file_format == "jsonl":
            return _read_json(path)
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path!r} is not UTF-8 text (byte {e.object[e.start]:#x} at offset "
            f"{e.start}). Save it as UTF-8, e.g. `iconv -f latin1 -t utf-8 IN > OUT` "
            "or pandas' to_csv(..., encoding='utf-8')."
        ) from None
    return _read_parquet(path)


def _read_csv(path: str, *, delimiter: str) -> dict[str, list]:
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.reader(f, delimiter=delimiter)
        try:
            header = next(reader)
        except StopIteration:
            raise ValueError(f"{path!r} is empty (no header row).") from None
        columns: dict[str, list] = {h: [] for h in header}
        if len(columns) != len(header):
            raise ValueError(f"{path!r} has duplicate column names: {header}.")
        for line_no, row in enumerate(reader, start=2):
            if not row:
                continue
            if len(row) != len(header):
                raise ValueError(
                    f"{path!r} record {line_no} has {len(row)} fields, header has "
                    f"{len(header)}."
                )
            for h, v in zip(header, row, strict=True):
                columns[h].append(v)
    return columns


def _read_json(path: str) -> dict[str, list]:
    with open(path, encoding="utf-8") as f:
        content = f.read()
    if content.lstrip().startswith("["):
        rows = json.loads(content)
    else:
        rows = []
        for line_no, line in enumerate(content.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path!r} line {line_no} is not JSON: {e}") from e
    names: dict[str, None] = {}
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(
                f"{path!r} row {i} is a {type(row).__name__}, expected an object."
            )
        names.update(dict.fromkeys(row))
    return {n: [row.get(n) for row in rows] for n in names}


def _read_parquet(path: str) -> dict[str, list]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(
            f"Reading Parquet ({path!r}) needs pyarrow, which is not installed: "
            "`pip install pyarrow` (or convert the file to CSV/JSONL)."
        ) from e
    return pq.read_table(path).to_pydict()


def load_tabular(
    *,
    name: str,
    path: str = "",
    split_files: Mapping[str, str] | None = None,
    file_format: str = "",
    text_column: str,
    text_pair_column: str = "",
    task_column: str,
    attributes: Sequence[str],
    attr_columns: Mapping[str, str] | None = None,
    split_column: str = "split",
    split_names: Mapping[str, str] | None = None,
    splits: Sequence[str] = ("train", "dev", "test"),
    task_classes: Sequence[str] | None = None,
    attr_classes: Mapping[str, Sequence[str]] | None = None,
    attr_bins: Mapping[str, Sequence[float]] | None = None,
    missing: str = "error",
    split_shares: Sequence[float] = (),
    split_seed: int = 0,
) -> TextDataset:
    """Loads a labelled text dataset from table files with a column mapping.

    Exactly one of ``path`` (one file with a split column) and ``split_files``
    (one file per split) must be given.

    Args:
      name: dataset name for reports.
      path: single file holding every split, told apart by ``split_column``.
      split_files: split name -> file, for one file per split.
      file_format: ``csv``/``tsv``/``jsonl``/``parquet``, ``""`` infers it.
      text_column: column with the input text.
      text_pair_column: column with a second segment, ``""`` for none.
      task_column: column with the task label.
      attributes: protected attribute names, in order.
      attr_columns: attribute name -> column; attributes not listed use their
        own name as the column.
      split_column: column holding the split value (``path`` mode).
      split_names: split name -> value in the split column, e.g.
        ``{"train": "train", "dev": "val", "test": "test"}``; defaults to the
        identity.
      splits: which splits to load (``train`` is required).
      task_classes: explicit task classes (order kept), or ``None`` for the
        sorted train labels.
      attr_classes: attribute name -> explicit classes.
      attr_bins: attribute name -> increasing bin edges for a numeric column
        (see :func:`bin_labels`); its classes are the bins, in order.
      missing: ``"error"`` (a row with an empty text, task label or
        attribute value is an error naming it) or ``"drop"`` (such rows are
        left out of their split, and the count per split and column is
        logged).
      split_shares: for ``path`` mode with no split column: each split's
        share of the file's rows (one per split in ``splits``, summing to 1);
        the rows are split at random, stratified by the task label and the
        attributes (:mod:`moddiffy_jax.data.random_split`). Empty: the split
        column says.
      split_seed: the random split's seed.

    Returns:
      The encoded :class:`TextDataset` (``synthetic=False``).

    Raises:
      ValueError: missing columns (the message lists the available ones), split
        values matching no configured split, empty splits, unknown labels,
        single-class attributes in train, missing label values, a numeric
        attribute with many values and no bins, a bin with no train example.
    """
    splits = tuple(splits)
    if "train" not in splits:
        raise ValueError(f"data.splits must include 'train', got {list(splits)}.")
    if not text_column or not task_column:
        raise ValueError(
            "Set data.columns.text and data.columns.task (the text and task label "
            "column names) for the tabular source."
        )
    if not attributes:
        raise ValueError(
            "Set data.attributes (the protected attribute names) for the tabular "
            "source, and data.columns.attributes.<name> where the column name differs."
        )
    attr_columns = dict(attr_columns or {})
    extra = sorted(set(attr_columns) - set(attributes))
    if extra:
        raise ValueError(
            f"data.columns.attributes maps {extra}, which are not in data.attributes "
            f"{list(attributes)}."
        )
    attr_columns = {a: attr_columns.get(a) or a for a in attributes}
    attr_bins = {a: tuple(e) for a, e in (attr_bins or {}).items() if len(e)}
    extra = sorted(set(attr_bins) - set(attributes))
    if extra:
        raise ValueError(
            f"data.attr_bins names {extra}, which are not in data.attributes "
            f"{list(attributes)}."
        )
    both = sorted(a for a in attr_bins if (attr_classes or {}).get(a))
    if both:
        raise ValueError(
            f"data.attr_bins and data.attr_classes (or attr_label_files) both set "
            f"the classes of {both}; keep one: the bins name their own classes."
        )
    edges = {a: _check_edges(a, e) for a, e in attr_bins.items()}
    wanted = {"data.columns.text": text_column, "data.columns.task": task_column}
    if text_pair_column:
        wanted["data.columns.text_pair"] = text_pair_column
    for a in attributes:
        wanted[f"data.columns.attributes.{a}"] = attr_columns[a]

    split_files = {k: v for k, v in (split_files or {}).items() if v}
    if path and split_files:
        raise ValueError(
            "Set either data.path (one file with a split column) or data.split_files "
            f"(one file per split), not both (got path={path!r}, "
            f"split_files={split_files})."
        )
    tables: dict[str, tuple[str, dict[str, list]]] = {}
    if split_shares and split_files:
        raise ValueError(
            "data.split_shares splits one file (data.path) at random; with "
            "data.split_files each split has its own file already: leave "
            "data.split_shares empty, or give the whole table as data.path."
        )
    if path:
        shares = random_split.check_shares(split_shares, splits) if split_shares else ()
        table = read_table(path, file_format=file_format)
        _check_columns(table, wanted, where=path)
        if shares:
            tables = random_split.split_table(
                table,
                path=path,
                splits=splits,
                shares=shares,
                strata=[task_column, *(attr_columns[a] for a in attributes)],
                seed=split_seed,
            )
            logging.info(
                "Split %s at random (data.split_shares, data.seed=%d%s): %s rows.",
                path,
                split_seed,
                f"; its column {split_column!r} not read" * (split_column in table),
                {s: len(t[text_column]) for s, (_, t) in tables.items()},
            )
        elif split_column not in table:
            raise ValueError(
                f"Split column {split_column!r} (data.split_column) not found in "
                f"{path!r}. Available columns: {list(table)}. Name the column "
                "that holds each row's split in data.split_column, or, for a file "
                "with no split column, set data.split_shares (e.g. "
                "--config.data.split_shares='(0.8, 0.1, 0.1)') to split its rows "
                "at random, stratified by task label and attributes and seeded "
                "by data.seed."
            )
        else:
            tables = _split_by_column(
                table,
                path=path,
                split_column=split_column,
                split_names=dict(split_names or {s: s for s in splits}),
                splits=splits,
            )
    elif split_files:
        no_file = [s for s in splits if s not in split_files]
        if no_file:
            raise ValueError(
                f"No file for split(s) {no_file} in data.split_files {split_files}; "
                "set data.split_files.<split> or drop it from data.splits."
            )
        for s in splits:
            table = read_table(split_files[s], file_format=file_format)
            _check_columns(table, wanted, where=split_files[s])
            tables[s] = (split_files[s], table)
    else:
        raise ValueError(
            f"Dataset {name!r}: set data.path (one file with a split column) or "
            "data.split_files.<split> (one file per split)."
        )

    if missing not in MISSING:
        raise ValueError(
            f"data.missing={missing!r} is not one of {MISSING} (error: a row "
            "with an empty text or label is an error; drop: such rows are left "
            "out)."
        )
    if missing == "drop":
        needed = [text_column, task_column, *(attr_columns[a] for a in attributes)]
        tables = {
            s: (where, _drop_missing(table, needed, where=where, split=s))
            for s, (where, table) in tables.items()
        }
    raw = {}
    for s, (where, table) in tables.items():
        raw[s] = StringColumns(
            text=_text(table[text_column], column=text_column, where=where, split=s),
            text_pair=(
                _text(
                    table[text_pair_column],
                    column=text_pair_column,
                    where=where,
                    split=s,
                )
                if text_pair_column
                else None
            ),
            task=_labels(table[task_column], column=task_column, where=where, split=s),
            attrs={
                a: _labels(
                    table[attr_columns[a]], column=attr_columns[a], where=where, split=s
                )
                for a in attributes
            },
        )
    attr_classes = dict(attr_classes or {})
    for a, e in edges.items():
        for s, cols in raw.items():
            cols.attrs[a] = _binned(
                cols.attrs[a], e, column=attr_columns[a], attribute=a, split=s
            )
        attr_classes[a] = bin_labels(e)
        _check_bins_filled(raw["train"].attrs[a], attr_classes[a], attribute=a)
    for a in attributes:
        if a not in attr_classes:
            _refuse_raw_numbers(
                raw["train"].attrs[a], column=attr_columns[a], attribute=a
            )
    return encode_splits(
        raw,
        attributes=tuple(attributes),
        task_column=task_column,
        attr_columns=attr_columns,
        task_classes=task_classes,
        attr_classes=attr_classes,
        name=name,
        synthetic=False,
    )


MISSING = ("error", "drop")


def _is_missing(value) -> bool:
    if value is None:
        return True
    if isinstance(value, float) and value != value:  # NaN (Parquet, JSON)
        return True
    return isinstance(value, str) and not value.strip()


def _drop_missing(
    table: Mapping[str, list], columns: Sequence[str], *, where: str, split: str
) -> dict[str, list]:
    """``table`` without the rows that hold an empty value in ``columns``;
    the count per column is logged (a row may count in several)."""
    counts = {c: 0 for c in columns}
    keep = []
    for i in range(len(table[columns[0]])):
        empty = [c for c in columns if _is_missing(table[c][i])]
        for c in empty:
            counts[c] += 1
        if not empty:
            keep.append(i)
    dropped = len(table[columns[0]]) - len(keep)
    if dropped:
        logging.warning(
            "data.missing='drop': %d of %d rows of split %r (%s) left out for "
            "an empty value (per column: %s).",
            dropped,
            len(table[columns[0]]),
            split,
            where,
            {c: n for c, n in counts.items() if n},
        )
    return {k: [col[i] for i in keep] for k, col in table.items()}


# An attribute column whose train values are all numbers and take more than
# this many distinct values is a measurement (an age in years), not classes:
# one class per value would give a probe tens of classes, most of them a
# handful of rows, and dev or test values train never saw.
MAX_NUMERIC_CLASSES = 20


def bin_labels(edges: Sequence[float]) -> tuple[str, ...]:
    """The class names of the bins cut at ``edges`` (increasing):
    ``<e0``, ``[e0,e1)``, ..., ``>=ek``; a value equal to an edge goes to
    the bin that starts there (PAN16's age groups 18-24, 25-34, 35-49,
    50-64, 65-xx are ``edges=(25, 35, 50, 65)``)."""
    e = [f"{float(x):g}" for x in edges]
    middle = [f"[{lo},{hi})" for lo, hi in zip(e[:-1], e[1:], strict=True)]
    return (f"<{e[0]}", *middle, f">={e[-1]}")


def _check_edges(attribute: str, edges: Sequence) -> tuple[float, ...]:
    try:
        out = tuple(float(x) for x in edges)
    except (TypeError, ValueError):
        raise ValueError(
            f"data.attr_bins.{attribute} = {tuple(edges)!r}: bin edges must be "
            "numbers, e.g. (25, 35, 50, 65)."
        ) from None
    if any(b <= a for a, b in zip(out[:-1], out[1:], strict=True)) or any(
        x != x for x in out
    ):
        raise ValueError(
            f"data.attr_bins.{attribute} = {tuple(edges)!r}: bin edges must be "
            "strictly increasing numbers, e.g. (25, 35, 50, 65)."
        )
    return out


def _as_number(value: str) -> float | None:
    try:
        x = float(value)
    except ValueError:
        return None
    return x if x == x else None  # NaN is no number here


def _binned(
    values: Sequence[str],
    edges: Sequence[float],
    *,
    column: str,
    attribute: str,
    split: str,
) -> list[str]:
    names = bin_labels(edges)
    out = []
    for row, v in enumerate(values):
        x = _as_number(v)
        if x is None:
            raise ValueError(
                f"Value {v!r} in column {column!r} of split {split!r} (row {row}) "
                f"is not a number, and data.attr_bins.{attribute} cuts the column "
                "into numeric bins. Clean the file, or drop the bins to read the "
                "column's values as classes."
            )
        out.append(names[sum(x >= e for e in edges)])
    return out


def _check_bins_filled(
    train: Sequence[str], names: Sequence[str], *, attribute: str
) -> None:
    empty = [n for n in names if n not in set(train)]
    if empty:
        raise ValueError(
            f"The bins {empty} of data.attr_bins.{attribute} hold no train "
            "example; a probe cannot learn a class it never sees. Move or drop "
            "edges so every bin has train examples."
        )


def _refuse_raw_numbers(train: Sequence[str], *, column: str, attribute: str) -> None:
    distinct = set(train)
    if len(distinct) <= MAX_NUMERIC_CLASSES:
        return
    numbers = [_as_number(v) for v in distinct]
    if any(x is None for x in numbers):
        return
    values = sorted(float(v) for v in train)
    # The train quartiles as an example cut (three significant digits).
    quartiles = sorted(
        {float(f"{values[len(values) * q // 4]:.3g}") for q in (1, 2, 3)} - {values[0]}
    )
    example = ", ".join(f"{x:g}" for x in quartiles) + (
        "," if len(quartiles) == 1 else ""
    )
    raise ValueError(
        f"Attribute {attribute!r} (column {column!r}) has {len(distinct)} distinct "
        f"numeric values in train ({values[0]:g} to {values[-1]:g}): read as "
        "classes, each value would be its own class. Cut it into groups with "
        f"data.attr_bins, e.g. at its train quartiles: "
        f"--config.data.attr_bins=\"{{'{attribute}': ({example})}}\" (classes "
        f"{', '.join(bin_labels(quartiles))}), or list the classes you mean in "
        "data.attr_classes."
    )


def _check_columns(
    table: Mapping[str, list], wanted: Mapping[str, str], *, where: str
) -> None:
    missing = {key: col for key, col in wanted.items() if col not in table}
    if missing:
        listed = ", ".join(f"{col!r} ({key})" for key, col in missing.items())
        raise ValueError(
            f"Column(s) {listed} not found in {where!r}. Available columns: "
            f"{list(table)}. Fix the column mapping in the data config."
        )


def _split_by_column(
    table: Mapping[str, list],
    *,
    path: str,
    split_column: str,
    split_names: Mapping[str, str],
    splits: Sequence[str],
) -> dict[str, tuple[str, dict[str, list]]]:
    missing = [s for s in splits if s not in split_names]
    if missing:
        raise ValueError(
            f"data.split_names has no value for split(s) {missing} "
            f"(got {dict(split_names)})."
        )
    value_to_split = {str(v): s for s, v in split_names.items()}
    rows: dict[str, list[int]] = {s: [] for s in splits}
    unknown: dict[str, int] = {}
    for i, value in enumerate(table[split_column]):
        s = value_to_split.get(str(value))
        if s is None:
            unknown[str(value)] = unknown.get(str(value), 0) + 1
        elif s in rows:
            rows[s].append(i)
    if unknown:
        raise ValueError(
            f"Split column {split_column!r} of {path!r} has values "
            f"{dict(sorted(unknown.items())[:10])} (value: row count) that match no "
            f"configured split name {dict(split_names)}. Map them in "
            "data.split_names, e.g. data.split_names.dev = 'val'."
        )
    return {
        s: (
            f"{path} [{split_column}={split_names[s]!r}]",
            {k: [col[i] for i in idx] for k, col in table.items()},
        )
        for s, idx in rows.items()
    }


def _text(values: list, *, column: str, where: str, split: str) -> list[str]:
    for row, v in enumerate(values):
        if v is None:
            raise ValueError(
                f"Missing text in column {column!r} of split {split!r} ({where}), "
                f"row {row}. Fill or drop the row, or set data.missing='drop' to "
                "leave such rows out."
            )
    empty = [row for row, v in enumerate(values) if not str(v).strip()]
    if empty:
        raise ValueError(
            f"{len(empty)} empty text(s) in column {column!r} of split {split!r} "
            f"({where}), rows {empty[:5]}{' ...' if len(empty) > 5 else ''}: an "
            "empty input says nothing about its labels. Drop or fill those rows, "
            "or set data.missing='drop' to leave them out."
        )
    return [str(v) for v in values]


def _labels(values: list, *, column: str, where: str, split: str) -> list[str]:
    out = []
    for row, v in enumerate(values):
        if _is_missing(v):  # None, a blank string or NaN
            raise ValueError(
                f"Missing label in column {column!r} of split {split!r} ({where}), "
                f"row {row}. Clean the file (drop or label the row), or set "
                "data.missing='drop' to leave such rows out."
            )
        out.append(str(v).strip())
    return out
