"""Fixed-length tokenization of a :class:`TextDataset` with any HF tokenizer.

Every split is padded/truncated to ``max_length`` tokens, so every batch has
the same shape and jitted steps compile once. The reference code computed its
length from *character* counts (which gave 200 in practice); here the length
is in tokens, given by the config (default 64).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from moddiffy_jax.data.dataset import (
    RawSplit,
    TextDataset,
    TokenizedDataset,
    TokenizedSplit,
)


def tokenize_split(
    split: RawSplit, tokenizer: Any, *, max_length: int, chunk_size: int = 4096
) -> TokenizedSplit:
    """Tokenizes one split to int32 arrays of shape ``[N, max_length]``.

    Args:
      split: the raw split.
      tokenizer: a Hugging Face tokenizer (callable with ``padding``,
        ``truncation``, ``max_length``, ``return_tensors="np"``).
      max_length: token length ``L`` (special tokens included).
      chunk_size: texts per tokenizer call (bounds peak memory).

    Returns:
      A :class:`TokenizedSplit`; ``token_type_ids`` are zeros if the tokenizer
      does not produce them.
    """
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2, got {max_length}.")
    n = len(split)
    out = {
        k: np.zeros((n, max_length), np.int32)
        for k in ("input_ids", "attention_mask", "token_type_ids")
    }
    for start in range(0, n, chunk_size):
        stop = min(start + chunk_size, n)
        enc = tokenizer(
            split.text[start:stop],
            None if split.text_pair is None else split.text_pair[start:stop],
            padding="max_length",
            truncation=True,
            max_length=max_length,
            return_tensors="np",
            return_attention_mask=True,
            return_token_type_ids=True,
        )
        for k in out:
            if k in enc:
                arr = np.asarray(enc[k])
                if arr.shape != (stop - start, max_length):
                    raise ValueError(
                        f"Tokenizer returned {k} of shape {arr.shape}, expected "
                        f"{(stop - start, max_length)}."
                    )
                out[k][start:stop] = arr
            elif k != "token_type_ids":
                raise ValueError(f"Tokenizer output lacks {k!r}.")
    return TokenizedSplit(
        **out,
        task=split.task.astype(np.int32),
        attrs={k: v.astype(np.int32) for k, v in split.attrs.items()},
    )


def tokenize_dataset(
    dataset: TextDataset, tokenizer: Any, *, max_length: int
) -> TokenizedDataset:
    """Tokenizes every split of ``dataset``.

    Args:
      dataset: the raw dataset.
      tokenizer: a Hugging Face tokenizer.
      max_length: token length ``L``.

    Returns:
      A :class:`TokenizedDataset` with the same splits, classes, name and
      synthetic flag.
    """
    return TokenizedDataset(
        splits={
            s: tokenize_split(split, tokenizer, max_length=max_length)
            for s, split in dataset.splits.items()
        },
        task_classes=dataset.task_classes,
        attr_classes=dict(dataset.attr_classes),
        name=dataset.name,
        synthetic=dataset.synthetic,
        max_length=max_length,
    )
