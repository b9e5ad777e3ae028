"""Exports that land whole: a staged directory closed by a manifest.

An export is written into a temporary directory beside ``export/``, closed by
``MANIFEST.json`` (each file's size and SHA-256, the core's fingerprint), then
renamed onto ``export/`` (:func:`staged_export`). Readers call
:func:`verify_export`, which refuses an export without its manifest or with a
file that differs from it. A kill at any point leaves either the previous
export or none, never a half-written one that looks finished.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from moddiffy_jax._files import publish_dir_mode, temp_file_beside

MANIFEST_NAME = "MANIFEST.json"
MANIFEST_FORMAT = "moddiffy_jax.export/1"


class IncompleteExport(FileNotFoundError):
    """An export without its manifest, or whose files differ from it."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(directory: Path, *, fingerprint: str) -> dict[str, Any]:
    """Writes ``directory/MANIFEST.json`` listing every other file under it."""
    files = {
        str(p.relative_to(directory)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != MANIFEST_NAME
    }
    manifest = {
        "format": MANIFEST_FORMAT,
        "base_fingerprint": fingerprint,
        "files": files,
        "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    tmp = temp_file_beside(directory / MANIFEST_NAME)
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)
    os.replace(tmp, directory / MANIFEST_NAME)
    return manifest


def verify_export(export: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a complete export directory.

    Raises:
      IncompleteExport: no manifest (the run stopped while exporting, or has
        not finished), or a listed file missing or different in size or hash.
    """
    export = Path(export)
    fix = (
        "Re-run the run's training command: a finished run exports again from "
        "its last checkpoint."
    )
    path = export / MANIFEST_NAME
    if not path.is_file():
        state = "has no" if export.is_dir() else "is missing, and so is its"
        raise IncompleteExport(
            f"{export} {state} {MANIFEST_NAME}: the export is incomplete (the "
            f"run has not finished, or stopped while exporting). {fix}"
        )
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError):
        raise IncompleteExport(f"{path} is damaged. {fix}") from None
    for name, entry in files.items():
        p = export / name
        if not p.is_file():
            problem = "is missing"
        elif p.stat().st_size != entry["bytes"]:
            problem = f"has {p.stat().st_size} bytes, not {entry['bytes']}"
        elif _sha256(p) != entry["sha256"]:
            problem = "differs from its SHA-256 in the manifest"
        else:
            continue
        raise IncompleteExport(
            f"{p} {problem}: the export in {export} is damaged or was changed "
            f"after it was written. {fix}"
        )
    return manifest


class _Stage:
    """Where an export is being written (``dir``) and where it will land."""

    def __init__(self, directory: Path, final: Path):
        self.dir, self.final = directory, final

    def final_path(self, path: str | os.PathLike) -> Path:
        """``path`` (under ``dir``) as it will be once the export lands."""
        path = Path(path)
        try:
            return self.final / path.relative_to(self.dir)
        except ValueError:
            return path

    def final_paths(self, obj: Any) -> Any:
        """``obj`` (a JSON-like report) with every path string under ``dir``
        rewritten to its final place."""
        if isinstance(obj, dict):
            return {k: self.final_paths(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self.final_paths(v) for v in obj]
        if isinstance(obj, str) and obj.startswith(str(self.dir) + os.sep):
            return str(self.final_path(obj))
        return obj


@contextlib.contextmanager
def staged_export(
    workdir: str | os.PathLike, *, fingerprint: str, write: bool = True
) -> Iterator[_Stage]:
    """Stages ``workdir/export``: write into ``stage.dir``; on success the
    manifest is written and the directory renamed onto ``export/``.

    With ``write=False`` (processes other than 0) ``stage.dir`` is the final
    directory and nothing is written. On an exception the staged files are
    removed and a previous export stays as it was.
    """
    workdir = Path(workdir)
    final = workdir / "export"
    if not write:
        yield _Stage(final, final)
        return
    for stale in workdir.glob(".export-*"):  # left by a killed export
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(dir=workdir, prefix=".export-new-"))
    publish_dir_mode(tmp)
    try:
        yield _Stage(tmp, final)
        write_manifest(tmp, fingerprint=fingerprint)
        if final.exists():
            old = Path(tempfile.mkdtemp(dir=workdir, prefix=".export-old-"))
            os.replace(final, old / "export")
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
