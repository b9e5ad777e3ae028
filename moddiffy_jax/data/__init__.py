"""moddiffy_jax.data: sources, balancing, tokenization and the input pipeline.

Typical use::

    config = default_data_config()          # synthetic (generated) data
    ds = build_dataset(config, tokenizer)   # TokenizedDataset
    it = TrainIterator(ds.splits["train"], batch_size=32, seed=0)
    for batch in eval_batches(ds.splits["dev"], 64): ...
"""

from moddiffy_jax.data.balance import balance_train_split, original_train
from moddiffy_jax.data.config import (
    build_dataset,
    default_data_config,
    load_text_dataset,
    truncate_splits,
)
from moddiffy_jax.data.dataset import (
    RawSplit,
    StringColumns,
    TextDataset,
    TokenizedDataset,
    TokenizedSplit,
    encode_splits,
    read_label_file,
    subset_split,
    summarize_dataset,
)
from moddiffy_jax.data.pipeline import (
    TrainIterator,
    eval_batches,
    model_inputs,
    num_eval_batches,
)
from moddiffy_jax.data.sources import SOURCES, get_source
from moddiffy_jax.data.synthetic import generate_synthetic
from moddiffy_jax.data.tabular import bin_labels, load_tabular, read_table
from moddiffy_jax.data.tokenize import (
    padded_length,
    tokenize_dataset,
    tokenize_split,
    trim_padding,
)

__all__ = [
    "SOURCES",
    "RawSplit",
    "StringColumns",
    "TextDataset",
    "TokenizedDataset",
    "TokenizedSplit",
    "TrainIterator",
    "balance_train_split",
    "bin_labels",
    "build_dataset",
    "default_data_config",
    "encode_splits",
    "eval_batches",
    "model_inputs",
    "generate_synthetic",
    "get_source",
    "load_tabular",
    "load_text_dataset",
    "num_eval_batches",
    "original_train",
    "padded_length",
    "read_label_file",
    "read_table",
    "subset_split",
    "summarize_dataset",
    "tokenize_dataset",
    "tokenize_split",
    "trim_padding",
    "truncate_splits",
]
