"""Writes tests/fixtures/tiny_roberta/: the config of a tiny RoBERTa and
transformers' torch outputs on it; its weights are not stored.

No RoBERTa checkpoint can be downloaded here, so the model is a tiny
``RobertaModel`` (H = 32, 2 layers, 2 heads, I = 64, 46 positions, one token
type, pad id 1) whose every tensor is :func:`fixture_tensor` of its name and
shape: a seeded numpy draw that the test repeats to write the checkpoint
(``model.safetensors``) itself, so no weights are tracked. ``config.json``
is what ``save_pretrained`` writes; ``parity.npz`` holds four padded id rows
(bos 0, eos 2, pad 1, different lengths), their attention mask, and the
float32 ``last_hidden_state`` / ``pooler_output`` of ``RobertaModel``
(eval mode, eager attention). ``tests/test_bert.py`` checks our encoder
against it.

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


def fixture_tensor(name: str, shape) -> np.ndarray:
    """The fixture's value of tensor ``name`` (transformers' name, torch
    layout): N(0, 0.05) from a seed of the name, plus 1 for LayerNorm scales."""
    seed = int.from_bytes(name.encode(), "little") % (2**63)
    value = np.random.default_rng(seed).normal(0.0, 0.05, size=tuple(shape))
    if name.endswith("LayerNorm.weight"):
        value = value + 1.0
    return value.astype(np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    args = parser.parse_args()

    import torch
    import transformers

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
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(fixture_tensor(name, p.shape)))
    args.out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(args.out)  # config.json only: weights are regenerated

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
