r"""Does transformers load a ``moddiffy_jax.hf_export`` directory as the same
encoder? Two sides, two environments (torch is never a dependency here):

    # 1. this library's venv: export a run (core + diffs) and our forward
    python -m moddiffy_jax.hf_export --workdir=runs/ffw_dw --out=/tmp/hf --diff=ffw
    python benchmarks/hf_export_parity.py --side=ours --dir=/tmp/hf --npz=/tmp/ours.npz
    # 2. a torch venv with transformers: their forward, compared
    python benchmarks/hf_export_parity.py --side=transformers --dir=/tmp/hf --npz=/tmp/ours.npz

Both sides tokenize the same sentences with the directory's own tokenizer
(ours through transformers' tokenizer classes too), run the encoder in
float32 and eval mode, and the second prints the max-abs difference of
``last_hidden_state`` and of the pooler output over real tokens.
"""

import argparse

import numpy as np

SENTENCES = [
    "a diff removes what the probe reads",
    "bias mitigation on demand, alone or together",
    "ok",
    "the quick brown fox jumps over the lazy dog near the river bank today",
]


def _tokens(directory):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    enc = tok(SENTENCES, padding=True, return_tensors="np")
    return {k: np.asarray(v) for k, v in enc.items()}


def ours(directory, npz):
    import jax.numpy as jnp

    from moddiffy_jax.models import bert_files
    from moddiffy_jax.models.bert_model import BertEncoder

    config, params = bert_files.load_pretrained(directory)
    enc = _tokens(directory)
    out = BertEncoder(config).apply(
        {"params": params},
        jnp.asarray(enc["input_ids"]),
        jnp.asarray(enc["attention_mask"]),
        jnp.asarray(enc.get("token_type_ids", np.zeros_like(enc["input_ids"]))),
        deterministic=True,
    )
    np.savez(
        npz,
        last=np.asarray(out.last_hidden_state),
        pooled=np.asarray(out.pooler_output),
        mask=enc["attention_mask"],
    )
    print(f"ours: {npz}")


def theirs(directory, npz):
    import torch
    from transformers import BertModel

    model = BertModel.from_pretrained(directory, local_files_only=True).eval()
    enc = {k: torch.from_numpy(v) for k, v in _tokens(directory).items()}
    with torch.no_grad():
        out = model(**enc)
    ref = np.load(npz)
    mask = ref["mask"].astype(bool)
    last = np.abs(out.last_hidden_state.numpy() - ref["last"])[mask].max()
    pooled = np.abs(out.pooler_output.numpy() - ref["pooled"]).max()
    print(
        f"max |transformers - ours|: last_hidden_state {last:.2e}, pooler {pooled:.2e}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--side", choices=["ours", "transformers"], required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--npz", required=True)
    args = parser.parse_args()
    (ours if args.side == "ours" else theirs)(args.dir, args.npz)
