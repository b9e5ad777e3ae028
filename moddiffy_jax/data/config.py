"""Data config: every field the builders read, and the two entry points.

``load_text_dataset(config)`` = source -> optional ``max_examples_per_split``
truncation -> optional train balancing -> optional bias-only model
(``config.bias``). ``build_dataset(config, tokenizer)`` tokenizes that to
``config.max_length`` tokens; per-example extras (``bias_logprobs``) travel
with the rows.
"""

from __future__ import annotations

from typing import Any

import ml_collections
from ml_collections.config_dict import placeholder

from moddiffy_jax.data import bias as bias_lib
from moddiffy_jax.data.balance import balance_train_split
from moddiffy_jax.data.dataset import (
    TextDataset,
    TokenizedDataset,
    dataset_with_extras,
)
from moddiffy_jax.data.sources import get_source
from moddiffy_jax.data.tokenize import tokenize_dataset, trim_padding


def default_data_config() -> ml_collections.ConfigDict:
    """Returns the data config with every field the data builders read.

    Empty strings/tuples mean "not set" (use the source's default). Fields:

    - ``source``: registry name (``synthetic``, ``tabular``, ``bios``,
      ``pan16``, ``fcdl18``, ``dwmw17_dialect``).
    - ``name``: dataset name for reports (empty: the source name; the
      synthetic source is always named ``synthetic``).
    - ``seed``: seed of the synthetic generator, of balancing and of the
      random split (``split_shares``).
    - ``splits``: splits to load; must include ``train``.
    - ``max_length``: token length of every example (the most it may be).
    - ``trim_padding``: cut the token axis to the longest example over all
      splits, rounded up to a multiple of 8 (only columns that are padding
      in every example go; outputs are unchanged up to float rounding).
      Runs whose config lacks the field were made without it.
    - ``max_examples_per_split``: keep the first N rows of each split (debug and
      tests); ``None`` keeps all. Vocabularies still come from the full train.
    - ``attributes``: protected attribute names, in order (empty: the source's
      default; required for ``tabular``).
    - ``task_classes``, ``attr_classes.<name>``: explicit class lists (order
      kept); empty: sorted labels of train.
    - ``task_label_file``, ``attr_label_files.<name>``: reference-style label
      files (one label per line, index = line order) instead of class lists.
    - ``attr_bins.<name>``: increasing bin edges that cut a numeric attribute
      column (an age in years) into classes ``<e0``, ``[e0,e1)``, ...,
      ``>=ek`` (tabular sources). On the command line these maps are set
      whole: ``--config.data.attr_bins="{'age': (25, 35, 50, 65)}"``.
    - ``missing``: ``"error"`` (default: a row with an empty text, task label
      or attribute value is an error that names it) or ``"drop"`` (such rows
      are left out of their split; the counts are logged). Tabular sources.
    - ``path``: one table file holding every split (split column mode).
    - ``split_files.{train,dev,test}``: one table file per split.
    - ``file_format``: ``csv``/``tsv``/``jsonl``/``parquet``; empty: from the
      file suffix.
    - ``split_column``: the column holding the split (``path`` mode).
    - ``split_names.{train,dev,test}``: the value of each split in the split
      column, e.g. ``split_names.dev = "val"``.
    - ``split_shares``: for one file with no split column (``path`` mode):
      each split's share of its rows, in the order of ``splits``, e.g.
      ``(0.8, 0.1, 0.1)``; the rows are split at random, stratified by the
      task label and the attributes, seeded by ``seed`` (the same file and
      seed give the same split). Empty (default): the split column says.
    - ``columns.text``, ``columns.text_pair``, ``columns.task``: column names
      (``text_pair`` empty: single-segment input).
    - ``columns.attributes.<name>``: column of attribute ``<name>`` where it
      differs from the name.
    - ``balance.attribute``: upsample train so that this attribute is balanced
      within each task label (empty: off).
    - ``synthetic.*``: parameters of the synthetic generator (sizes, number of
      task classes, per-attribute task correlation, optional dev/test
      correlation, label noise, marker probability).
    - ``bias.*``: the bias-only model whose log-probabilities every split
      carries as ``extras["bias_logprobs"]`` [N, C] (``bias.source`` empty:
      none); see :func:`moddiffy_jax.data.bias.default_bias_config`.
    """
    c = ml_collections.ConfigDict()
    c.source = "synthetic"
    c.name = ""
    c.seed = 0
    c.splits = ("train", "dev", "test")
    c.max_length = 64
    c.trim_padding = True
    # trim_padding rounds the kept length up to a multiple of this (8: the
    # lanes accelerators' kernels tile by; 1: the longest example's length,
    # size_for_cpu's choice: on a CPU every padded column is work).
    c.trim_multiple = 8
    c.max_examples_per_split = placeholder(int)
    c.attributes = ()
    c.task_classes = ()
    c.attr_classes = ml_collections.ConfigDict()
    c.task_label_file = ""
    c.attr_label_files = ml_collections.ConfigDict()
    c.attr_bins = ml_collections.ConfigDict()

    c.missing = "error"
    c.path = ""
    c.split_files = ml_collections.ConfigDict({"train": "", "dev": "", "test": ""})
    c.file_format = ""
    c.split_column = "split"
    c.split_shares = ()
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
    c.bias = bias_lib.default_bias_config()
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
    """Loads the source, truncates and balances (optional), adds bias log-probs.

    With ``data.bias.source``: ``"file"`` arrays are attached to the rows as
    the source read them (the files are row-aligned with the split files) and
    carried through truncation and balancing; a fitted bias model
    (``"attribute"``/``"features"``) is trained on the final train rows and
    applied to the final rows of every split. Either way the splits carry
    ``extras["bias_logprobs"]`` and ``dataset.bias_summary`` describes the
    model. A config without a ``bias`` field (older runs) means no bias model.

    Args:
      data_config: a config shaped like :func:`default_data_config`.

    Returns:
      The :class:`TextDataset`.
    """
    bias_config = data_config.bias if "bias" in data_config else None
    bias_source = bias_config.source if bias_config is not None else ""
    if bias_source:
        bias_lib.check_bias_config(bias_config)
    dataset = get_source(data_config.source)(data_config)
    summary = {}
    if bias_source == "file":
        extras, summary = bias_lib.compute_bias_extras(dataset, bias_config)
        dataset = dataset_with_extras(dataset, extras)
    if data_config.max_examples_per_split is not None:
        dataset = truncate_splits(
            dataset, max_examples=data_config.max_examples_per_split
        )
    if data_config.balance.attribute:
        dataset = balance_train_split(
            dataset, attribute=data_config.balance.attribute, seed=data_config.seed
        )
    if bias_source == "file":
        # Recount on the final rows (truncation/balancing changed them).
        summary["splits"] = bias_lib.summarize_bias_splits(dataset)
        dataset = dataset.replace(bias_summary=summary)
    elif bias_source:
        extras, summary = bias_lib.compute_bias_extras(dataset, bias_config)
        dataset = dataset_with_extras(dataset, extras).replace(bias_summary=summary)
    return dataset


def build_dataset(
    data_config: ml_collections.ConfigDict, tokenizer: Any
) -> TokenizedDataset:
    """Loads and tokenizes the configured dataset.

    Args:
      data_config: a config shaped like :func:`default_data_config`.
      tokenizer: any Hugging Face tokenizer.

    Returns:
      The :class:`TokenizedDataset` with ``max_length = data_config.max_length``
      (shorter with ``data_config.trim_padding``: :func:`trim_padding`);
      every split keeps its text split's ``extras`` (row for row) and the
      dataset its ``bias_summary``.
    """
    text = load_text_dataset(data_config)
    tokenized = tokenize_dataset(text, tokenizer, max_length=data_config.max_length)
    if data_config.get("trim_padding", False):  # absent: a run made before it
        multiple = data_config.get("trim_multiple", 8)
        if not isinstance(multiple, int) or multiple < 1:
            raise ValueError(
                f"config.data.trim_multiple={multiple!r}: the kept token length "
                "is rounded up to a multiple of it; use a whole number >= 1 "
                "(8 on accelerators, 1 on a CPU)."
            )
        tokenized = trim_padding(tokenized, multiple=multiple)
    extras = {s: split.extras for s, split in text.splits.items() if split.extras}
    return dataset_with_extras(tokenized, extras).replace(
        bias_summary=dict(text.bias_summary), train_originals=text.train_originals
    )
