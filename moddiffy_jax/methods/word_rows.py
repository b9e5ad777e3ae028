"""Which word-embedding rows an attribute's diff may change (``config.diff.word_rows``).

Where text carries an attribute through words (names, pronouns, dialect
spellings), a diff that removes it has to move the rows of those words;
moving any other row only costs the task and, when two diffs are added
together, makes them collide on the rows both rewrote (docs/efficacy.md,
"Stop 26"). With ``word_rows = k > 0`` each attribute's diff may change
only the word rows of at most ``k`` tokens whose presence in an example
says most about the attribute beyond the task label (each scoring at least
``word_rows_share`` times the best token's score), on the training split:
the conditional mutual information

    I(token present; attribute | task label)
        = sum_y P(y) sum_{x, a} P(x, a | y) log P(x, a | y) / (P(x | y) P(a | y))

from counts (one count per example a token occurs in, padding left out).
A token that follows only the task label scores 0, one that is in every
example scores 0, and a frequent token that tells the attribute apart
scores highest. The rest of the word table is closed (its gates shut, as
the pruning closes entries); the other parameters of the diff are untouched.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from moddiffy_jax.subnets import diffs as diffs_lib
from moddiffy_jax.subnets import selection

#: The flattened path of a BERT encoder's word-embedding table.
WORD_TABLE = "embeddings/word_embeddings/embedding"


def conditional_information(
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    task: np.ndarray,
    attribute: np.ndarray,
    vocab: int,
) -> np.ndarray:
    """``I(token present; attribute | task label)`` in nats, one per token id
    (``[vocab]``; 0 for tokens that never occur)."""
    rows, tokens = _present(input_ids, attention_mask, vocab)
    task, attribute = np.asarray(task), np.asarray(attribute)
    n_y, n_a = int(task.max()) + 1, int(attribute.max()) + 1
    # n[y, a]: examples; c[y, a, t]: examples of (y, a) holding token t.
    n = np.zeros((n_y, n_a))
    np.add.at(n, (task, attribute), 1.0)
    c = np.zeros((n_y, n_a, vocab))
    np.add.at(c, (task[rows], attribute[rows], tokens), 1.0)
    total = n.sum()
    info = np.zeros(vocab)
    for y in range(n_y):
        ny = n[y].sum()
        if ny == 0:
            continue
        p_a = n[y] / ny  # [A]
        p_x1 = c[y].sum(0) / ny  # [V]
        for present in (True, False):
            joint = (c[y] if present else n[y][:, None] - c[y]) / ny  # [A, V]
            p_x = p_x1 if present else 1.0 - p_x1
            denom = p_a[:, None] * p_x[None, :]
            with np.errstate(divide="ignore", invalid="ignore"):
                term = np.where(joint > 0, joint * np.log(joint / denom), 0.0)
            info += (ny / total) * term.sum(0)
    return np.maximum(info, 0.0)


def _present(input_ids, attention_mask, vocab):
    """``(rows, tokens)``: each (example, distinct token) pair once, padding
    left out (the sparse example-by-token presence matrix)."""
    ids = np.where(np.asarray(attention_mask) > 0, np.asarray(input_ids), -1)
    n = ids.shape[0]
    key = np.unique(np.arange(n, dtype=np.int64)[:, None] * (vocab + 1) + ids + 1)
    rows, tokens = np.divmod(key, vocab + 1)
    keep = tokens > 0  # 0 is the padding marker (-1 + 1)
    return rows[keep], tokens[keep] - 1


def top_tokens(info: np.ndarray, k: int, share: float = 0.0) -> np.ndarray:
    """The ids of at most ``k`` tokens, best first (ties by id), each scoring
    above 0 and at least ``share`` times the best score."""
    order = np.lexsort((np.arange(info.size), -info))
    best = float(info[order[0]]) if info.size else 0.0
    order = order[(info[order] > 0.0) & (info[order] >= share * best)]
    return np.asarray(order[:k], np.int32)


def attribute_tokens(
    split: object, attributes: Sequence[str], k: int, share: float, vocab: int
) -> dict[str, np.ndarray]:
    """Per attribute, the token ids whose word rows its diff may change
    (:func:`top_tokens` of :func:`conditional_information` on ``split``)."""
    out = {}
    for attr in attributes:
        info = conditional_information(
            split.input_ids, split.attention_mask, split.task, split.attrs[attr], vocab
        )
        out[attr] = top_tokens(info, k, share)
    return out


def restrict(state: diffs_lib.DiffState, token_ids: np.ndarray) -> diffs_lib.DiffState:
    """``state`` with every word-table row outside ``token_ids`` closed
    (:func:`~moddiffy_jax.subnets.dense_diff.close_gates`); other leaves,
    and a diff without a word table, unchanged."""
    flat = selection.flatten(state.delta)
    if WORD_TABLE not in flat:
        return state
    rows = np.zeros(flat[WORD_TABLE].shape[0], bool)
    rows[np.asarray(token_ids, np.int64)] = True
    keep = {
        p: (jnp.asarray(rows)[:, None] if p == WORD_TABLE else True)
        & jnp.ones(np.shape(leaf), bool)
        for p, leaf in flat.items()
    }
    return diffs_lib.close_gates(state, selection.unflatten(keep))


def describe(tokens: Mapping[str, np.ndarray], tokenizer=None) -> dict[str, list]:
    """``{attribute: [token, ...]}`` (strings with ``tokenizer``, else ids)."""
    out = {}
    for attr, ids in tokens.items():
        ids = [int(i) for i in ids]
        out[attr] = tokenizer.convert_ids_to_tokens(ids) if tokenizer else ids
    return out


__all__ = [
    "WORD_TABLE",
    "attribute_tokens",
    "conditional_information",
    "describe",
    "restrict",
    "top_tokens",
]
