r"""``python -m moddiffy_jax.hf_export``: a run's core plus chosen diffs as a
standard Hugging Face BERT directory.

The directory holds ``config.json`` (``architectures`` ["BertModel"], or
["RobertaModel"] for a RoBERTa base), ``model.safetensors`` in transformers'
tensor names (torch layout: Linear weights are (out, in)), the tokenizer
files of the run's tokenizer, and two files of ours: the task head
(``moddiffy_task_head.safetensors``, our names) and ``moddiffy.json`` (the
run, the diffs and weights merged in, the fingerprints of the core and of the
merged encoder). transformers' ``BertModel.from_pretrained(DIR)`` and
``AutoTokenizer.from_pretrained(DIR)`` load it; so does this library
(``--config.model.dir=DIR``), e.g. as the base of a new run::

    python -m moddiffy_jax.hf_export --workdir=runs/moddiffy_par \
        --out=exports/par_gender --diff=gender=1.0
    python -m moddiffy_jax.hf_export --workdir=runs/moddiffy_par \
        --out=exports/par_both --diff=gender --diff=age=0.5

``--diff=NAME`` merges the run's ``export/diffs/NAME.safetensors`` with
weight 1 (``NAME=W``: weight W); without ``--diff`` the core alone is
written. The directory is written beside its final path and renamed into
place, so a crash leaves no half-written export; an existing ``--out`` is
refused unless ``--overwrite``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from absl import flags

FLAGS = flags.FlagValues()
flags.DEFINE_string("workdir", None, "Finished run directory.", flag_values=FLAGS)
flags.DEFINE_string("out", None, "Directory to write.", flag_values=FLAGS)
flags.DEFINE_multi_string(
    "diff", [], "NAME or NAME=WEIGHT: a diff to merge (repeat).", flag_values=FLAGS
)
flags.DEFINE_bool(
    "overwrite", False, "Replace an existing --out directory.", flag_values=FLAGS
)

TOKENIZER_FILES = (
    "vocab.txt",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)
HEAD_FILE = "moddiffy_task_head.safetensors"
INFO_FILE = "moddiffy.json"


def hf_state_dict(params: Mapping[str, Any], prefix: str = "") -> dict[str, np.ndarray]:
    """Our BERT encoder params as transformers ``BertModel`` tensors (names
    after ``prefix``, e.g. "bert.").

    The inverse of :func:`moddiffy_jax.models.bert_files.convert_hf_state_dict`:
    ``layer_N`` -> ``layer.N``, ``kernel`` -> ``weight`` (transposed),
    LayerNorm ``scale`` -> ``weight``, ``embedding`` -> ``weight``.

    Raises:
      ValueError: adapter parameters, which a plain BERT has no place for.
    """
    from moddiffy_jax.models.bert_files import _flatten

    out = {}
    for path, leaf in _flatten(params).items():
        parts = path.split("/")
        if any(p.startswith("adapter") for p in parts):
            raise ValueError(
                f"{path}: bottleneck adapters have no place in a plain BERT "
                "checkpoint; export a run of a method without adapters."
            )
        *module, name = parts
        module = [
            f"layer.{m.removeprefix('layer_')}" if m.startswith("layer_") else m
            for m in module
        ]
        array = np.asarray(leaf, np.float32)
        if name == "kernel":
            name, array = "weight", array.T
        elif name in ("scale", "embedding"):
            name = "weight"
        out[prefix + ".".join([*module, name])] = np.ascontiguousarray(array)
    return out


def hf_config(bert_config: Any, base: Mapping[str, Any] | None = None) -> dict:
    """The ``config.json`` of a BertConfig: the base model's file with our
    fields (when the run started from one), else the fields alone."""
    d = dict(base or {})
    d.update(
        {
            f.name: getattr(bert_config, f.name)
            for f in dataclasses.fields(bert_config)
            if f.name != "adapter_reduction_factor"
        }
    )
    arch = "BertModel" if bert_config.model_type == "bert" else "RobertaModel"
    d.update(architectures=[arch], position_embedding_type="absolute")
    return d


def parse_diffs(items: Sequence[str]) -> dict[str, float]:
    """``["gender", "age=0.5"]`` -> ``{"gender": 1.0, "age": 0.5}``."""
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            weight = float(value) if sep else 1.0
        except ValueError:
            raise ValueError(
                f"--diff={item!r}: the weight {value!r} is not a number "
                "(use NAME or NAME=WEIGHT)."
            ) from None
        if not name or name in out:
            raise ValueError(f"--diff={item!r}: give each diff once, by name.")
        out[name] = weight
    return out


def export_hf(
    workdir: str | Path,
    out: str | Path,
    diffs: Mapping[str, float] | None = None,
    *,
    overwrite: bool = False,
) -> Path:
    """Writes the run's core plus ``diffs`` ({name: weight}) to ``out``.

    Raises:
      FileNotFoundError: an unfinished run (no complete export).
      ValueError: an unknown diff (the message lists the run's diffs), an
        existing ``out`` without ``overwrite``, adapters in the core, or a
        run whose model is not a BERT encoder.
    """
    import safetensors.numpy

    from moddiffy_jax import checkpoints
    from moddiffy_jax.config_lib import VISION_DATA
    from moddiffy_jax.eval import composition
    from moddiffy_jax.methods import joint_erasure
    from moddiffy_jax.models import bert_files, text
    from moddiffy_jax.models.bert_model import BertConfig
    from moddiffy_jax.subnets import diffs as diffs_lib

    workdir, out = Path(workdir), Path(out)
    diffs = dict(diffs or {})
    if out.exists() and not overwrite:
        raise ValueError(
            f"--out {out} exists; choose a new directory or pass --overwrite."
        )
    config = composition.load_run_config(workdir)
    if config.data.source in VISION_DATA.values():
        raise ValueError(
            f"{workdir} is a vision run ({config.data.source}); only BERT runs "
            "export to a Hugging Face BERT directory."
        )
    artifacts = composition.load_artifacts(workdir)  # manifest, fingerprints
    unknown = sorted(set(diffs) - set(artifacts.diffs))
    if unknown:
        raise ValueError(
            f"{workdir} has no diff {unknown}; its diffs: "
            f"{sorted(artifacts.diffs) or 'none'}."
        )
    names = sorted(diffs)
    added = [artifacts.diffs[n] for n in names]
    weights = [diffs[n] for n in names]
    # Two or more diffs at weight 1, one or more erased: their correction
    # (methods/joint_erasure.py), as the run's composition table adds it.
    fix = joint_erasure.correction_for(artifacts.joint, diffs)
    if fix is not None:
        added, weights = [*added, fix], [*weights, 1.0]
    params = diffs_lib.apply_diffs(artifacts.core, added, weights)
    tensors = hf_state_dict(params)
    model = config.model
    base_json: dict | None = None
    if model.init == "pretrained" or model.dir:
        model_dir = bert_files.resolve_model_dir(model.dir or None)
        base_json = json.loads((model_dir / "config.json").read_text())
        bert_config = BertConfig.from_hf_dict(base_json)
    else:
        bert_config = text.random_bert_config(model)
    # The tensors must be what our loader reads back for this config.
    bert_files.convert_hf_state_dict(tensors, bert_config, source=f"{workdir} core")
    tok_dir = bert_files.resolve_model_dir(model.tokenizer_dir or model.dir or None)

    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}-new-", dir=out.parent))
    try:
        safetensors.numpy.save_file(
            tensors, str(stage / bert_files.SAFETENSORS_FILE), metadata={"format": "pt"}
        )
        (stage / "config.json").write_text(
            json.dumps(hf_config(bert_config, base_json), indent=2, sort_keys=True)
            + "\n"
        )
        for name in TOKENIZER_FILES:
            if (tok_dir / name).is_file():
                shutil.copyfile(tok_dir / name, stage / name)
        checkpoints.save_params(stage / HEAD_FILE, artifacts.head, overwrite=True)
        info = {
            "run": str(workdir.resolve()),
            "method": config.method.name,
            "diffs": {n: diffs[n] for n in names},
            **({"joint_correction": fix.name} if fix is not None else {}),
            "core_fingerprint": diffs_lib.fingerprint(artifacts.core),
            "encoder_fingerprint": diffs_lib.fingerprint(params),
            "task_head": HEAD_FILE,
            "representation": "the [CLS] vector of last_hidden_state, into the head",
        }
        (stage / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
        # The permissions a plain mkdir / open() would give (mkdtemp and the
        # safetensors writer make them private): a shareable directory.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(stage, 0o777 & ~umask)
        for f in stage.iterdir():
            os.chmod(f, 0o666 & ~umask)
        if out.exists():
            old = out.with_name(f".{out.name}-old")
            shutil.rmtree(old, ignore_errors=True)
            out.rename(old)
            stage.rename(out)
            shutil.rmtree(old)
        else:
            stage.rename(out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the CLI; returns the exit status (2 for a bad run or flag)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        FLAGS.unparse_flags()
        rest = FLAGS([sys.argv[0]] + argv)[1:]
        if rest or not FLAGS.workdir or not FLAGS.out:
            raise ValueError(
                "give --workdir=RUN and --out=DIR (and --diff=NAME[=W] per diff); "
                f"unexpected arguments: {rest}"
            )
        out = export_hf(
            FLAGS.workdir, FLAGS.out, parse_diffs(FLAGS.diff), overwrite=FLAGS.overwrite
        )
    except (flags.Error, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"written: {out} (transformers: BertModel.from_pretrained('{out}'))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
