"""Converts a MoDDiffy reference dataset (a pickled list of dicts) to JSON lines.

SECURITY WARNING: unpickling executes arbitrary code embedded in the file. Run
this ONLY on files you trust (e.g. ones you produced yourself or downloaded
from the authors and checked). The library never unpickles; this script is the
one explicit, audited conversion step, and it refuses to run without
``--trusted``.

Usage (once per split file)::

    python scripts/convert_pickle_dataset.py --trusted \
        /data/bios/train.pkl /data/bios/train.jsonl
    python scripts/convert_pickle_dataset.py --trusted --keys bio,title,gender \
        /data/bios/val.pkl /data/bios/dev.jsonl

Each dict becomes one JSON object per line. numpy scalars become Python
numbers, numpy arrays lists; any other non-JSON value is an error (pass
``--keys`` to keep only the fields you need). Then point the data config at the
JSONL files, e.g. ``data.source = "bios"`` and ``data.split_files.train =
".../train.jsonl"``.
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys


def _to_json(value):
    # numpy values without importing numpy unless it is there.
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(
        f"Value of type {type(value).__name__} is not JSON-serialisable; drop the "
        "field with --keys or convert it yourself."
    )


def convert(input_path: str, output_path: str, *, keys: list[str] | None) -> int:
    """Reads the pickled list of dicts and writes JSON lines; returns the row count."""
    with open(input_path, "rb") as f:
        rows = pickle.load(f)  # noqa: S301 -- trusted input only, see module doc.
    if not isinstance(rows, list | tuple):
        raise SystemExit(
            f"{input_path}: expected a list of dicts, got {type(rows).__name__}."
        )
    with open(output_path, "w", encoding="utf-8") as out:
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise SystemExit(
                    f"{input_path}: row {i} is a {type(row).__name__}, expected dict."
                )
            if keys is not None:
                missing = [k for k in keys if k not in row]
                if missing:
                    raise SystemExit(
                        f"{input_path}: row {i} lacks keys {missing}; it has "
                        f"{sorted(map(str, row))}."
                    )
                row = {k: row[k] for k in keys}
            out.write(json.dumps(row, ensure_ascii=False, default=_to_json) + "\n")
    return len(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("input", help="pickled list of dicts (.pkl)")
    parser.add_argument("output", help="JSON lines file to write (.jsonl)")
    parser.add_argument(
        "--keys", default="", help="comma-separated keys to keep (default: all)"
    )
    parser.add_argument(
        "--trusted",
        action="store_true",
        help="confirm that the input is a trusted file (unpickling runs code)",
    )
    args = parser.parse_args(argv)
    sys.stderr.write(
        "WARNING: unpickling can execute arbitrary code. Only convert files you "
        "trust.\n"
    )
    if not args.trusted:
        sys.stderr.write("Refusing to unpickle without --trusted.\n")
        return 2
    keys = [k for k in args.keys.split(",") if k] or None
    n = convert(args.input, args.output, keys=keys)
    sys.stderr.write(f"Wrote {n} rows to {args.output}.\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
