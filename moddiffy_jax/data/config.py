"""Data config: every field the builders read, and the two entry points.

``load_text_dataset(config)`` = source -> optional ``max_examples_per_split``
truncation -> optional train balancing. ``build_dataset(config, tokenizer)``
tokenizes that to ``config.max_length`` tokens.
"""

from __future__ import annotations

from typing import Any

import ml_collections
from ml_collections.config_dict import placeholder

from moddiffy_jax.data.balance import balance_train_split
from moddiffy_jax.data.dataset import TextDataset, TokenizedDataset
from moddiffy_jax.data.sources import get_source
from moddiffy_jax.data.tokenize import tokenize_dataset


def default_data_config() -> ml_collections.ConfigDict:
    """Returns the data config with every field the data builders read.

    Empty strings/tuples mean "not set" (use the source's default). Fields:

    - ``source``: registry name (``synthetic``, ``tabular``, ``bios``,
      ``pan16``, ``fcdl18``, ``dwmw17_dialect``).
    - ``name``: dataset name for reports (empty: the source name; the
      synthetic source is always named ``synthetic``).
    - ``seed``: seed of the synthetic generator and of balancing.
    - ``splits``: splits to load; must include ``train``.
    - ``max_length``: token length of every example.
    - ``max_examples_per_split``: keep the first N rows of each split (debug and
      tests); ``None`` keeps all. Vocabularies still come from the full train.
    - ``attributes``: protected attribute names, in order (empty: the source's
      default; required for ``tabular``).
    - ``task_classes``, ``attr_classes.<name>``: explicit class lists (order
      kept); empty: sorted labels of train.
    - ``task_label_file``, ``attr_label_files.<name>``: reference-style label
      files (one label per line, index = line order) instead of class lists.
    - ``path``: one table file holding every split (split column mode).
    - ``split_files.{train,dev,test}``: one table file per split.
    - ``file_format``: ``csv``/``tsv``/``jsonl``/``parquet``; empty: from the
      file suffix.
    - ``split_column``: the column holding the split (``path`` mode).
    - ``split_names.{train,dev,test}``: the value of each split in the split
      column, e.g. ``split_names.dev = "val"``.
    - ``columns.text``, ``columns.text_pair``, ``columns.task``: column names
      (``text_pair`` empty: single-segment input).
    - ``columns.attributes.<name>``: column of attribute ``<name>`` where it
      differs from the name.
    - ``balance.attribute``: upsample train so that this attribute is balanced
      within each task label (empty: off).
    - ``synthetic.*``: parameters of the synthetic generator (sizes, number of
      task classes, per-attribute task correlation, optional dev/test
      correlation, label noise, marker probability).
    """
    c = ml_collections.ConfigDict()
    c.source = "synthetic"
    c.name = ""
    c.seed = 0
    c.splits = ("train", "dev", "test")
    c.max_length = 64
    c.max_examples_per_split = placeholder(int)
    c.attributes = ()
    c.task_classes = ()
    c.attr_classes = ml_collections.ConfigDict()
    c.task_label_file = ""
    c.attr_label_files = ml_collections.ConfigDict()

    c.path = ""
    c.split_files = ml_collections.ConfigDict({"train": "", "dev": "", "test": ""})
    c.file_format = ""
    c.split_column = "split"
    c.split_names = ml_collections.ConfigDict(
        {"train": "train", "dev": "dev", "test": "test"}
    )
    c.columns = ml_collections.ConfigDict(
        {
            "text": "",
            "text_pair": "",
            "task": "",
            "attributes": ml_collections.ConfigDict(),
        }
    )

    c.balance = ml_collections.ConfigDict({"attribute": ""})

    c.synthetic = ml_collections.ConfigDict(
        {
            "num_train": 2000,
            "num_dev": 500,
            "num_test": 500,
            "num_task_classes": 2,
            "attr_task_correlation": ml_collections.ConfigDict(
                {"gender": 0.8, "age": 0.5}
            ),
            "eval_attr_task_correlation": placeholder(float),
            "label_noise": 0.1,
            "attr_marker_prob": 0.9,
        }
    )
    return c


def truncate_splits(dataset: TextDataset, *, max_examples: int) -> TextDataset:
    """Keeps the first ``max_examples`` rows of every split (debug/tests)."""
    if max_examples < 1:
        raise ValueError(f"max_examples_per_split must be >= 1, got {max_examples}.")
    return dataset.replace(
        splits={
            s: split.take(range(min(len(split), max_examples)))
            for s, split in dataset.splits.items()
        }
    )


def load_text_dataset(data_config: ml_collections.ConfigDict) -> TextDataset:
    """Loads the configured source, truncates (optional) and balances (optional).

    Args:
      data_config: a config shaped like :func:`default_data_config`.

    Returns:
      The :class:`TextDataset`.
    """
    dataset = get_source(data_config.source)(data_config)
    if data_config.max_examples_per_split is not None:
        dataset = truncate_splits(
            dataset, max_examples=data_config.max_examples_per_split
        )
    if data_config.balance.attribute:
        dataset = balance_train_split(
            dataset, attribute=data_config.balance.attribute, seed=data_config.seed
        )
    return dataset


def build_dataset(
    data_config: ml_collections.ConfigDict, tokenizer: Any
) -> TokenizedDataset:
    """Loads and tokenizes the configured dataset.

    Args:
      data_config: a config shaped like :func:`default_data_config`.
      tokenizer: any Hugging Face tokenizer.

    Returns:
      The :class:`TokenizedDataset` with ``max_length = data_config.max_length``.
    """
    return tokenize_dataset(
        load_text_dataset(data_config), tokenizer, max_length=data_config.max_length
    )
