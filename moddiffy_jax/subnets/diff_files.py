"""The sparse-diff file format: safetensors, a JSON header, the base's fingerprint."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from absl import logging
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from moddiffy_jax._files import publish_mode, temp_file_beside
from moddiffy_jax.subnets.selection import (
    flatten,
)
from moddiffy_jax.subnets.sparse_diff import (
    SparseDiff,
    _host,
    _info_json,
    _normalize_rules,
    fingerprint,
)

PyTree = Any

FORMAT_NAME = "moddiffy_sparse_diff"
FORMAT_VERSION = 1
METADATA_KEY = "moddiffy_sparse_diff"


# -----------------------------------------------------------------------------
# File format.
# -----------------------------------------------------------------------------


def save_sparse_diff(
    path: str | os.PathLike, diff: SparseDiff, *, overwrite: bool = False
) -> str:
    """Writes a sparse diff to a ``.safetensors`` file, atomically.

    Layout: tensors ``"{leaf_path}::indices"`` (int32) and
    ``"{leaf_path}::values"`` (``diff.dtype``) per leaf; the safetensors
    metadata key ``"moddiffy_sparse_diff"`` holds JSON with ``format``,
    ``version``, ``name``, ``shapes`` (``[[leaf_path, [dims]], ...]`` in leaf
    order), ``dtype``, ``base_fingerprint``, ``rules`` (``{"include": [...],
    "exclude": [...]}``) and ``info``. No pickle.

    The file is written to a temporary file in the same directory and then
    moved into place, so readers never see a partial file.

    Args:
      path: destination file.
      diff: the diff to save.
      overwrite: replace an existing file.

    Returns:
      ``path`` as a string.

    Raises:
      FileExistsError: if ``path`` exists and ``overwrite`` is False.
    """
    path = os.fspath(path)
    exists_msg = f"{path} already exists; pass overwrite=True to replace it."
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(exists_msg)
    tensors = {}
    for p in diff.paths:
        tensors[f"{p}::indices"] = _host(diff.indices[p]).astype(np.int32, copy=False)
        tensors[f"{p}::values"] = _host(diff.values[p])
    meta = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "name": diff.name,
        "shapes": [[p, list(s)] for p, s in diff.shapes],
        "dtype": diff.dtype,
        "base_fingerprint": diff.base_fingerprint,
        "rules": {"include": list(diff.rules[0]), "exclude": list(diff.rules[1])},
        "info": diff.info,
    }
    tmp = temp_file_beside(path, suffix=".safetensors")
    try:
        save_file(tensors, tmp, metadata={METADATA_KEY: json.dumps(meta)})
        publish_mode(tmp)
        if overwrite:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)  # atomic, fails if path appeared meanwhile
            except FileExistsError:
                raise FileExistsError(exists_msg) from None
            except OSError:  # filesystem without hard links
                os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _read_meta(path: str, raw: Mapping[str, str] | None) -> dict[str, Any]:
    raw = raw or {}
    if METADATA_KEY not in raw:
        raise ValueError(
            f"{path} is not a moddiffy sparse diff: its safetensors metadata has "
            f"no {METADATA_KEY!r} entry (found keys {sorted(raw)})."
        )
    meta = json.loads(raw[METADATA_KEY])
    if meta.get("format") != FORMAT_NAME or not isinstance(meta.get("version"), int):
        raise ValueError(f"{path} has malformed moddiffy metadata: {meta}.")
    if meta["version"] > FORMAT_VERSION:
        raise ValueError(
            f"{path} uses sparse-diff format version {meta['version']}, but this "
            f"moddiffy_jax reads versions up to {FORMAT_VERSION}; upgrade it."
        )
    return meta


def load_sparse_diff(
    path: str | os.PathLike,
    *,
    base: PyTree | None = None,
    allow_base_mismatch: bool = False,
) -> SparseDiff:
    """Reads a file written by :func:`save_sparse_diff` (no pickle).

    Args:
      path: the ``.safetensors`` file.
      base: if given, the params the diff will be applied to: their
        :func:`fingerprint` must equal the diff's and every diff leaf must
        exist in ``base`` with the same shape.
      allow_base_mismatch: load anyway (with a logged warning) when the base
        check fails. :func:`apply_diffs` still refuses mismatched shapes.

    Returns:
      The :class:`SparseDiff`, arrays as jax arrays.

    Raises:
      ValueError: if the file is not a safetensors moddiffy diff, has a newer
        format version, is internally inconsistent, or (unless
        ``allow_base_mismatch``) does not match ``base``.
    """
    path = os.fspath(path)
    try:
        with safe_open(path, framework="np") as f:
            meta = _read_meta(path, f.metadata())
            names = set(f.keys())
            expected = {
                f"{p}::{kind}"
                for p, _ in meta["shapes"]
                for kind in ("indices", "values")
            }
            if names != expected:
                raise ValueError(
                    f"{path}: tensors {sorted(names ^ expected)} do not match the "
                    "leaves listed in its metadata."
                )
            arrays = {
                p: (f.get_tensor(f"{p}::indices"), f.get_tensor(f"{p}::values"))
                for p, _ in meta["shapes"]
            }
    except SafetensorError as e:
        raise ValueError(f"{path} is not a readable safetensors file: {e}") from e
    shapes = tuple((p, tuple(int(d) for d in s)) for p, s in meta["shapes"])
    indices, values = {}, {}
    for p, shape in shapes:
        idx, vals = arrays[p]
        size = math.prod(shape)
        if (
            idx.dtype != np.int32
            or idx.ndim != 1
            or vals.shape != idx.shape
            or str(vals.dtype) != meta["dtype"]
        ):
            raise ValueError(
                f"{path}: leaf {p!r} has indices {idx.dtype}{list(idx.shape)} and "
                f"values {vals.dtype}{list(vals.shape)}; expected int32 and "
                f"{meta['dtype']} vectors of equal length."
            )
        if idx.size and (idx[0] < 0 or idx[-1] >= size or np.any(np.diff(idx) <= 0)):
            raise ValueError(
                f"{path}: indices of leaf {p!r} are not sorted, unique and within "
                f"[0, {size})."
            )
        indices[p], values[p] = jnp.asarray(idx), jnp.asarray(vals)
    diff = SparseDiff(
        indices=indices,
        values=values,
        shapes=shapes,
        dtype=meta["dtype"],
        name=meta["name"],
        base_fingerprint=meta["base_fingerprint"],
        rules=_normalize_rules(meta["rules"]),
        info_json=_info_json(meta["info"]),
    )
    if base is not None:
        check_base(diff, base, allow_base_mismatch=allow_base_mismatch, source=path)
    return diff


def check_base(
    diff: SparseDiff,
    base: PyTree,
    *,
    allow_base_mismatch: bool = False,
    source: str = "",
) -> None:
    """Checks that ``diff`` was trained on ``base`` (fingerprint, paths, shapes).

    Args:
      diff: the sparse diff.
      base: the parameter pytree it is to be applied to.
      allow_base_mismatch: log a warning instead of raising.
      source: where the diff came from, for messages (e.g. a file path).

    Raises:
      ValueError: on a fingerprint or leaf mismatch, unless
        ``allow_base_mismatch``.
    """
    flat = flatten(base)
    problems = []
    for p, shape in diff.shapes:
        if p not in flat:
            problems.append(f"leaf {p!r} is missing from the base")
        elif tuple(np.shape(flat[p])) != shape:
            problems.append(
                f"leaf {p!r} has shape {tuple(np.shape(flat[p]))} in the base, "
                f"{shape} in the diff"
            )
    actual = fingerprint(base)
    if actual != diff.base_fingerprint:
        problems.insert(
            0,
            f"the diff was trained on base {diff.base_fingerprint!r}, the given "
            f"base has fingerprint {actual!r}",
        )
    if not problems:
        return
    what = f"Sparse diff {diff.name!r}" + (f" from {source}" if source else "")
    msg = f"{what} does not match the base: " + "; ".join(problems)
    if allow_base_mismatch:
        logging.warning("%s (allowed by allow_base_mismatch=True).", msg)
        return
    raise ValueError(msg + ". Pass allow_base_mismatch=True to use it anyway.")
