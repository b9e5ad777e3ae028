"""Run-directory storage: Orbax checkpoints for resuming, safetensors exports.

Layout of a run directory (``workdir``)::

    config.json            the resolved config (a run refuses another config)
    checkpoints/<step>/    Orbax: "state" (trainable, optimizer states, step),
                           "meta" (phase, phase step, data iterator state) and,
                           in the fixmask phase, "sparse" (kept indices)
    metrics.jsonl          one JSON object per logged interval / evaluation
    tb/                    TensorBoard event files
    export/                core.safetensors, task_head.safetensors,
                           diffs/<name>.safetensors (SparseDiff files)
    results.json           final evaluation

The frozen base (pretrained weights) is not checkpointed: it is referenced by
model directory and fingerprint in ``config.json`` / the exported files.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from safetensors.numpy import load_file

from moddiffy_jax._files import replace_safetensors, temp_file_beside
from moddiffy_jax.subnets import selection

PARAMS_FORMAT = "moddiffy_jax.params/1"


def save_params(
    path: str | os.PathLike,
    params: Any,
    *,
    metadata: Mapping[str, Any] | None = None,
    overwrite: bool = False,
) -> Path:
    """Writes a params pytree as safetensors (``path/to/leaf`` names), atomically.

    Refuses to replace an existing file unless ``overwrite``.
    """
    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(
            f"{path} already exists; pass overwrite=True or choose another path."
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    flat = {
        k: np.asarray(jax.device_get(v)) for k, v in selection.flatten(params).items()
    }
    meta = {"format": PARAMS_FORMAT, "metadata": json.dumps(dict(metadata or {}))}
    replace_safetensors(path, flat, meta)
    return path


def load_params(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, Any]]:
    """Reads a file written by :func:`save_params`: ``(params, metadata)``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"No params file at {path}.")
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        meta = f.metadata() or {}
    if meta.get("format") != PARAMS_FORMAT:
        raise ValueError(
            f"{path} is not a moddiffy_jax params file (format "
            f"{meta.get('format')!r}, expected {PARAMS_FORMAT!r})."
        )
    return selection.unflatten(load_file(str(path))), json.loads(meta["metadata"])


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_file_beside(path)
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
    os.replace(tmp, path)


class RunCheckpointer:
    """Thin wrapper over an Orbax CheckpointManager with the run's items."""

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int = 2):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=True, enable_async_checkpointing=True
        )
        self.manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "meta", "sparse")
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, meta: Mapping[str, Any], sparse: Any):
        """Saves asynchronously; arrays are copied off device before returning."""
        sparse = sparse if sparse else {"none": np.zeros((), np.int32)}
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                meta=ocp.args.JsonSave(dict(meta)),
                sparse=ocp.args.StandardSave(sparse),
            ),
            force=True,
        )

    def restore_meta(self, step: int) -> tuple[dict[str, Any], Any]:
        """The "meta" and "sparse" items of ``step`` (no target needed)."""
        out = self.manager.restore(
            step,
            args=ocp.args.Composite(
                meta=ocp.args.JsonRestore(), sparse=ocp.args.StandardRestore()
            ),
        )
        sparse = out["sparse"]
        if isinstance(sparse, Mapping) and set(sparse) == {"none"}:
            sparse = {}
        return dict(out["meta"]), sparse

    def restore_state(self, step: int, target: Any) -> Any:
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        try:
            out = self.manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
            )
        except ValueError as e:
            if "tree structures do not match" not in str(e):
                raise
            raise ValueError(
                f"The train state saved at step {step} in {self.directory} has "
                "another layout than this version of the library builds (the "
                "optimizer state now holds, per learning-rate role, only that "
                "role's own leaves: methods/role_partition.py). Resume it with "
                "the version that wrote it, or "
                "start again in a new workdir; the saved files are left as they "
                f"are. Orbax: {str(e)[:300]}"
            ) from e
        return out["state"]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def load_core_run(run_dir: str) -> tuple[Any, Any, str]:
    """Core encoder params and task head exported by a finetune run."""
    if not run_dir:
        raise ValueError(
            "moddiffy_post needs config.method.core_run: the workdir of a finished "
            "finetune run of this library (it holds export/core.safetensors)."
        )
    from moddiffy_jax.manifest import verify_export

    export = Path(run_dir) / "export"
    for name in ("core.safetensors", "task_head.safetensors"):
        if not (export / name).is_file():
            raise FileNotFoundError(
                f"{export / name} is missing: config.method.core_run must be a "
                "finished finetune run (train it with configs/finetune.py first)."
            )
    verify_export(export)
    core, meta = load_params(export / "core.safetensors")
    head, _ = load_params(export / "task_head.safetensors")
    return core, head, meta.get("fingerprint", "")


def check_same_structure(a: Any, b: Any, where: str) -> None:
    fa = {k: np.shape(v) for k, v in selection.flatten(a).items()}
    fb = {k: np.shape(v) for k, v in selection.flatten(b).items()}
    if fa != fb:
        bad = sorted(k for k in set(fa) | set(fb) if fa.get(k) != fb.get(k))
        raise ValueError(
            f"The core of {where} does not match the configured model "
            f"(differing tensors: {bad[:6]}). Use the same config.model as that run."
        )
