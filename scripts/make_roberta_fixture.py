"""Writes tests/fixtures/tiny_roberta/: a tiny random RoBERTa checkpoint and
transformers' torch outputs on it.

No RoBERTa checkpoint can be downloaded here, so the checkpoint is a tiny
``RobertaModel`` (H = 32, 2 layers, 2 heads, I = 64, 46 positions, one token
type, pad id 1) from a fixed torch seed, every tensor then moved by a little
noise so that biases and LayerNorm parameters are not at their initial
0 / 1. ``config.json`` and ``model.safetensors`` are written as
``save_pretrained`` writes them (names ``embeddings.*``, ``encoder.*``,
``pooler.*``); ``parity.npz`` holds four padded id rows (bos 0, eos 2, pad 1,
different lengths), their attention mask, and the float32
``last_hidden_state`` / ``pooler_output`` of ``RobertaModel`` (eval mode,
eager attention). ``tests/test_bert.py`` checks our encoder against it.

Run in a separate venv with torch (never in this project's environment)::

    python3 -m venv /work/torchvenv
    /work/torchvenv/bin/pip install torch==2.13.0 "transformers>=5,<6" safetensors numpy
    /work/torchvenv/bin/python scripts/make_roberta_fixture.py
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np

DEFAULT_OUT = (
    pathlib.Path(__file__).resolve().parents[1] / "tests/fixtures/tiny_roberta"
)
LENGTHS = (12, 7, 3, 10)
PAD, BOS, EOS, VOCAB = 1, 0, 2, 99


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    args = parser.parse_args()

    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.RobertaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=46,
        type_vocab_size=1,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        layer_norm_eps=1e-5,
        attn_implementation="eager",
    )
    model = transformers.RobertaModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)

    rng = np.random.default_rng(0)
    width = max(LENGTHS)
    ids = np.full((len(LENGTHS), width), PAD, np.int64)
    for row, n in enumerate(LENGTHS):
        ids[row, :n] = rng.integers(3, VOCAB, size=n)
        ids[row, 0], ids[row, n - 1] = BOS, EOS
    mask = (ids != PAD).astype(np.int64)
    with torch.no_grad():
        out = model(
            input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)
        )
    np.savez(
        args.out / "parity.npz",
        input_ids=ids.astype(np.int32),
        attention_mask=mask.astype(np.int32),
        last_hidden_state=out.last_hidden_state.numpy().astype(np.float32),
        pooler_output=out.pooler_output.numpy().astype(np.float32),
        torch_version=np.asarray(torch.__version__),
        transformers_version=np.asarray(transformers.__version__),
    )
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
