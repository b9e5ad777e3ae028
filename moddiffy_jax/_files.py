"""Atomic writes: temporary files that get the permissions ``open`` would
give; values made JSON-ready."""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Mapping
from typing import Any

import numpy as np


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def temp_file_beside(path: str | os.PathLike, *, suffix: str = ".tmp") -> str:
    """A new empty file in ``path``'s directory, to ``os.replace`` onto ``path``.

    ``tempfile.mkstemp`` creates files readable by the owner only; the result
    of an atomic write should have the usual ``0o666 & ~umask`` mode instead,
    so that run directories can be shared.
    """
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=suffix)
    os.close(fd)
    publish_mode(tmp)
    return tmp


def publish_mode(tmp: str | os.PathLike) -> None:
    """Gives a finished temporary file the usual ``0o666 & ~umask`` mode.

    Call it after writing and before the rename: some writers (safetensors)
    recreate the file owner-only.
    """
    os.chmod(tmp, 0o666 & ~_umask())


def publish_dir_mode(directory: str | os.PathLike) -> None:
    """Gives a directory made by ``tempfile.mkdtemp`` (owner-only) the usual
    ``0o777 & ~umask`` mode."""
    os.chmod(directory, 0o777 & ~_umask())


def replace_safetensors(
    path: str | os.PathLike, tensors: dict, metadata: dict[str, str]
) -> None:
    """Writes a safetensors file beside ``path`` and renames it onto
    ``path``: an existing file is replaced whole or not at all, and no
    temporary file is left behind on failure."""
    from safetensors.numpy import save_file

    tmp = temp_file_beside(path, suffix=".safetensors")
    try:
        save_file(tensors, tmp, metadata=metadata)
        publish_mode(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def jsonable(obj: Any) -> Any:
    """``obj`` with numpy values as Python ones (NaN as None), for JSON."""
    if isinstance(obj, Mapping):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, (np.floating, float)):
        value = float(obj)
        return None if math.isnan(value) else value
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.ndarray):
        return jsonable(obj.tolist())
    return obj
