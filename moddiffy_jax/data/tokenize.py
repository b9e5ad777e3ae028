"""Fixed-length tokenization of a :class:`TextDataset` with any HF tokenizer.

Every split is padded/truncated to ``max_length`` tokens, so every batch has
the same shape and jitted steps compile once. The reference code computed its
length from *character* counts (which gave 200 in practice); here the length
is in tokens, given by the config (default 64). :func:`trim_padding` then
drops the trailing columns that are padding in every example of every split
(``data.trim_padding``): sentences of 14 tokens padded to 32 spend more than
half of every forward and backward pass on padding.
"""

from __future__ import annotations

import dataclasses
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


def padded_length(dataset: TokenizedDataset, *, multiple: int = 8) -> int:
    """The shortest token length that drops no real token of any split.

    One past the last column where any example of any split has a real token,
    rounded up to a multiple of ``multiple`` (so a few lengths cover many
    datasets) and never above ``dataset.max_length``. A tokenizer that pads
    on the left has real tokens in the last column, so nothing is dropped.
    """
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}.")
    used = 1
    for split in dataset.splits.values():
        columns = np.flatnonzero(np.any(split.attention_mask != 0, axis=0))
        if columns.size:
            used = max(used, int(columns[-1]) + 1)
    used = max(used, 2)  # [CLS] ... [SEP]: tokenize_split's own minimum
    return min(dataset.max_length, -(-used // multiple) * multiple)


def trim_padding(dataset: TokenizedDataset, *, multiple: int = 8) -> TokenizedDataset:
    """Cuts every split to :func:`padded_length` tokens.

    Only columns that are padding in every example are dropped, so the model
    sees the same tokens and attention masks: its outputs are those of the
    padded batch up to float rounding (masked keys get no attention weight),
    and each step does the work of the real length.
    """
    length = padded_length(dataset, multiple=multiple)
    if length == dataset.max_length:
        return dataset
    splits = {
        name: dataclasses.replace(
            split,
            input_ids=np.ascontiguousarray(split.input_ids[:, :length]),
            attention_mask=np.ascontiguousarray(split.attention_mask[:, :length]),
            token_type_ids=np.ascontiguousarray(split.token_type_ids[:, :length]),
        )
        for name, split in dataset.splits.items()
    }
    return dataset.replace(splits=splits, max_length=length)
