"""Tidy tables: lists of flat dicts, written as CSV."""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def _cell(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return ""
    return value


def write_csv(
    rows: Sequence[Mapping[str, Any]],
    path: str | os.PathLike,
    *,
    columns: Sequence[str] | None = None,
) -> Path:
    """Writes tidy rows as a CSV file (parent directories are created).

    Args:
      rows: flat dicts, one per row. NaN floats are written as empty cells.
      path: destination file.
      columns: column order; default the keys of all rows in first-seen order.

    Returns:
      ``path`` as a :class:`~pathlib.Path`.

    Raises:
      ValueError: if a row has a key that is not in ``columns``.
    """
    path = Path(path)
    if columns is None:
        columns = list(dict.fromkeys(k for row in rows for k in row))
    columns = list(columns)
    for row in rows:
        extra = set(row) - set(columns)
        if extra:
            raise ValueError(
                f"Row has keys {sorted(extra)} outside the columns {columns}."
            )
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _cell(v) for k, v in row.items()})
    return path
