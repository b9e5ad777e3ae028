"""Reading a finished run directory back, from what it holds only.

The layout is the one :mod:`moddiffy_jax.checkpoints` writes::

    config.json                  required
    export/diffs/<name>.safetensors   required (unless ``require_diffs=False``)
    export/core.safetensors      optional: its metadata gives the core fingerprint
    metrics.jsonl                optional
    results.json                 optional (final evaluation)
    eval/results.json            optional: composition results with leakage

Nothing is imported from the training code: a run directory copied to a laptop
can be analysed without the data or the pretrained model.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from absl import logging
from safetensors import SafetensorError, safe_open

from moddiffy_jax.subnets.diffs import SparseDiff, load_sparse_diff

DIFF_SUFFIX = ".safetensors"


class RunError(ValueError):
    """A run directory is missing, partial or holds an unreadable file."""


@dataclasses.dataclass(frozen=True)
class Run:
    """A run directory read back; diffs are loaded on first use and cached.

    Attributes:
      path: the run directory (absolute).
      config: ``config.json`` as a dict.
      results: ``results.json`` as a dict, or None if the run has none.
      metrics: the records of ``metrics.jsonl`` in file order (``[]`` if none).
      diff_files: ``{name: path}`` of ``export/diffs/<name>.safetensors``,
        sorted by name.
      core_fingerprint: fingerprint of the exported core params (from the
        metadata of ``export/core.safetensors``, else ``results.json``'s
        ``core_fingerprint``; "" if neither is there).
      eval_results: ``eval/results.json`` as a dict, or None.
    """

    path: Path
    config: dict[str, Any]
    results: dict[str, Any] | None
    metrics: list[dict[str, Any]]
    diff_files: dict[str, Path]
    core_fingerprint: str
    eval_results: dict[str, Any] | None = None
    _cache: dict[str, SparseDiff] = dataclasses.field(
        default_factory=dict, repr=False, compare=False
    )

    @property
    def name(self) -> str:
        """The run directory's base name."""
        return self.path.name

    @property
    def diff_names(self) -> tuple[str, ...]:
        """Names of the exported diffs, sorted."""
        return tuple(self.diff_files)

    def diff(self, name: str) -> SparseDiff:
        """The exported diff ``name`` (loaded from its file once, then cached).

        Raises:
          KeyError: for an unknown name (the message lists the valid ones).
          RunError: if the file cannot be read as a sparse diff.
        """
        if name not in self.diff_files:
            raise KeyError(
                f"Run {self.path} has no diff {name!r}; valid: "
                f"{', '.join(self.diff_names) or '(none)'}."
            )
        if name not in self._cache:
            file = self.diff_files[name]
            try:
                self._cache[name] = load_sparse_diff(file)
            except (ValueError, OSError) as e:
                raise RunError(f"Unreadable diff file {file}: {e}") from e
        return self._cache[name]

    def diffs(self) -> dict[str, SparseDiff]:
        """All exported diffs ``{name: SparseDiff}``, sorted by name."""
        return {n: self.diff(n) for n in self.diff_names}


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RunError(f"Cannot read {what} {path}: {e}") from e


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Reads a ``metrics.jsonl`` file, skipping (with a warning) broken lines.

    A run stopped mid-write can leave a truncated last line; it is skipped
    rather than making the whole run unreadable.

    Args:
      path: the JSON-lines file.

    Returns:
      One dict per valid line, in file order; ``[]`` if the file is missing.
    """
    path = Path(path)
    if not path.is_file():
        return []
    records, bad = [], []
    with path.open() as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                bad.append(lineno)
                continue
            if isinstance(rec, dict):
                records.append(rec)
            else:
                bad.append(lineno)
    if bad:
        logging.warning("%s: skipped %d unreadable line(s): %s", path, len(bad), bad)
    return records


def _core_fingerprint(run_dir: Path, results: Mapping[str, Any] | None) -> str:
    core = run_dir / "export" / "core.safetensors"
    if core.is_file():
        try:
            with safe_open(str(core), framework="numpy") as f:
                meta = f.metadata() or {}
            fp = json.loads(meta.get("metadata", "{}")).get("fingerprint", "")
            if fp:
                return str(fp)
        except (SafetensorError, OSError, json.JSONDecodeError) as e:
            logging.warning("Cannot read the metadata of %s: %s", core, e)
    if results and results.get("core_fingerprint"):
        return str(results["core_fingerprint"])
    return ""


def load_run(
    run_dir: str | os.PathLike,
    *,
    load_diffs: bool = False,
    require_diffs: bool = True,
) -> Run:
    """Reads a run directory written by :func:`moddiffy_jax.train.train_and_evaluate`.

    Args:
      run_dir: the run directory (``--workdir`` of the training command).
      load_diffs: load (and so validate) every diff file now instead of on
        first use.
      require_diffs: raise if the run exported no diff (``export/diffs``
        missing or empty). Set False to read e.g. a plain fine-tuning run.

    Returns:
      A :class:`Run`.

    Raises:
      RunError: if ``run_dir`` is not a directory, has no ``config.json``, has
        no ``export/diffs/*.safetensors`` (with ``require_diffs``), an export
        whose files differ from its manifest, or holds an
        unreadable JSON file or (with ``load_diffs``) diff file. The message
        names the path and what is missing.
    """
    path = Path(run_dir).absolute()
    if not path.is_dir():
        raise RunError(f"{path} is not a directory (expected a run directory).")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise RunError(
            f"{path} is not a run directory: {config_path.name} is missing "
            "(training writes it first, so this is not a run or not this library's)."
        )
    config = _read_json(config_path, "config")
    results_path = path / "results.json"
    results = _read_json(results_path, "results") if results_path.is_file() else None
    # Exports land whole (export.staged_export); one that carries a manifest
    # is checked against it. Hand-assembled directories without one are read.
    if (path / "export" / "MANIFEST.json").is_file():
        from moddiffy_jax.manifest import IncompleteExport, verify_export

        try:
            verify_export(path / "export")
        except IncompleteExport as e:
            raise RunError(f"Partial run directory {path}: {e}") from None
    diffs_dir = path / "export" / "diffs"
    files = sorted(diffs_dir.glob(f"*{DIFF_SUFFIX}")) if diffs_dir.is_dir() else []
    files = [f for f in files if not f.name.startswith(".")]  # temp files
    if require_diffs and not files:
        state = "is empty" if diffs_dir.is_dir() else "is missing"
        hint = (
            "the run has not finished (results.json is missing too)"
            if results is None
            else "the method exported no diff"
        )
        raise RunError(
            f"Partial run directory {path}: {diffs_dir} {state}, so there are no "
            f"exported diffs (*{DIFF_SUFFIX}); {hint}."
        )
    eval_path = path / "eval" / "results.json"
    eval_results = (
        _read_json(eval_path, "eval results") if eval_path.is_file() else None
    )
    run = Run(
        path=path,
        config=config,
        results=results,
        metrics=read_metrics(path / "metrics.jsonl"),
        diff_files={f.name[: -len(DIFF_SUFFIX)]: f for f in files},
        core_fingerprint=_core_fingerprint(path, results),
        eval_results=eval_results,
    )
    if load_diffs:
        run.diffs()
    return run


# -----------------------------------------------------------------------------
# Composition results (task accuracy and leakage per configuration).
# -----------------------------------------------------------------------------


def _mean_std(value: Any) -> tuple[float, float | None] | None:
    """A number, ``{"mean", "std"}`` or ``[mean, std]`` -> (mean, std)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value), None
    if isinstance(value, Mapping):
        mean = value.get("mean", value.get("value"))
        if isinstance(mean, (int, float)) and not isinstance(mean, bool):
            std = value.get("std")
            ok = isinstance(std, (int, float)) and not isinstance(std, bool)
            return float(mean), float(std) if ok else None
    if isinstance(value, (list, tuple)) and len(value) == 2:
        if all(isinstance(v, (int, float)) for v in value):
            return float(value[0]), float(value[1])
    return None


def composition_points(
    results: Mapping[str, Any] | None,
    *,
    split: str = "test",
    label_prefix: str = "",
) -> list[dict[str, Any]]:
    """Trade-off points from a results dict with a ``"composition"`` table.

    Tolerant reader for ``eval/results.json`` (and ``results.json``), whose
    ``"composition"`` maps a configuration label to a row like::

        {"dev_task_acc": 0.81, "test_task_acc": 0.80,
         "leakage": {"gender": {"mean": 0.55, "std": 0.01}, ...}}

    A task accuracy or a leakage value may be a number, ``{"mean", "std"}`` or
    ``[mean, std]``; ``"{split}_task_acc_std"`` is read as the task std if
    present. The task accuracy of ``split`` is used, else the other split's
    (``test`` <-> ``dev``). Rows without a task accuracy or without any
    leakage value are skipped (logged).

    Args:
      results: the parsed JSON (None gives ``[]``).
      split: preferred split, ``"test"`` or ``"dev"``.
      label_prefix: prepended to each label (e.g. ``"run/"``).

    Returns:
      Points for :func:`moddiffy_jax.analysis.plots.plot_tradeoff`: dicts with
      ``label``, ``task_acc``, ``leakage`` (``{attr: float}``) and, where
      known, ``task_std`` and ``leakage_std`` (``{attr: float}``).
    """
    if not results or not isinstance(results.get("composition"), Mapping):
        return []
    other = {"test": "dev", "dev": "test"}.get(split, "dev")
    points, skipped = [], []
    for label, row in results["composition"].items():
        if not isinstance(row, Mapping):
            skipped.append(label)
            continue
        task = None
        for s in (split, other):
            task = _mean_std(row.get(f"{s}_task_acc"))
            if task is not None:
                if task[1] is None:
                    std = _mean_std(row.get(f"{s}_task_acc_std"))
                    task = (task[0], std[0] if std else None)
                break
        leakage, leakage_std = {}, {}
        raw = row.get("leakage")
        for attr, value in raw.items() if isinstance(raw, Mapping) else ():
            ms = _mean_std(value)
            if ms is None or not math.isfinite(ms[0]):
                continue
            leakage[attr] = ms[0]
            if ms[1] is not None:
                leakage_std[attr] = ms[1]
        if task is None or not leakage:
            skipped.append(label)
            continue
        point: dict[str, Any] = {
            "label": f"{label_prefix}{label}",
            "task_acc": task[0],
            "leakage": leakage,
        }
        if task[1] is not None:
            point["task_std"] = task[1]
        if leakage_std:
            point["leakage_std"] = leakage_std
        points.append(point)
    if skipped:
        logging.info(
            "Composition rows without task accuracy or leakage skipped: %s", skipped
        )
    return points
