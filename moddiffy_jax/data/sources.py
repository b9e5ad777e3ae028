"""Data sources: a plain dict registry from source name to loader.

Every loader takes the data ``ConfigDict`` (see
:func:`moddiffy_jax.data.config.default_data_config`) and returns a
:class:`TextDataset`:

- ``synthetic``: generated in code (the default; marked synthetic everywhere).
- ``tabular``: CSV/TSV/JSONL/Parquet with a column mapping.
- ``bios``, ``pan16``, ``fcdl18``: the MoDDiffy reference layouts, read from
  JSONL/CSV exports of the reference lists of dicts (one file per split); empty
  column fields take the reference keys.
- ``dwmw17_dialect``: the DWMW17 tweets with dialect labels (one CSV with a
  split column), referenced by path.
"""

from __future__ import annotations

from collections.abc import Callable

import ml_collections

from moddiffy_jax.data.dataset import TextDataset, read_label_file
from moddiffy_jax.data.nli import make_pair_loader
from moddiffy_jax.data.synthetic import generate_synthetic
from moddiffy_jax.data.tabular import load_tabular

DWMW17_PATH = "../shared/data/dwmw17_dialect/dwmw17_dialect.csv"


def load_synthetic(config: ml_collections.ConfigDict) -> TextDataset:
    """Generates the synthetic dataset from ``config.synthetic`` and ``config.seed``."""
    bins = len(config.get("attr_bins", {}))
    if (
        config.task_classes
        or len(config.attr_classes)
        or config.task_label_file
        or bins
    ):
        raise ValueError(
            "The synthetic source defines its own classes; leave data.task_classes, "
            "data.attr_classes, data.attr_bins and data.task_label_file empty."
        )
    syn = config.synthetic
    return generate_synthetic(
        seed=config.seed,
        num_train=syn.num_train,
        num_dev=syn.num_dev if "dev" in config.splits else 0,
        num_test=syn.num_test if "test" in config.splits else 0,
        num_task_classes=syn.num_task_classes,
        attributes=tuple(config.attributes) or ("gender", "age"),
        attr_task_correlation=dict(syn.attr_task_correlation),
        eval_attr_task_correlation=syn.eval_attr_task_correlation,
        label_noise=syn.label_noise,
        attr_marker_prob=syn.attr_marker_prob,
    )


def _preset(
    *,
    text: str,
    task: str,
    attributes: dict[str, str],
    path: str = "",
    split_column: str = "",
) -> Callable[[ml_collections.ConfigDict], TextDataset]:
    """Makes a loader that fills empty config fields with a layout's defaults."""

    def load(config: ml_collections.ConfigDict) -> TextDataset:
        names = tuple(config.attributes) or tuple(attributes)
        columns = {a: attributes.get(a, a) for a in names}
        columns.update({k: v for k, v in config.columns.attributes.items() if v})
        return _load_tabular(
            config,
            path=config.path or path,
            split_column=config.split_column or split_column,
            text=config.columns.text or text,
            task=config.columns.task or task,
            attributes=names,
            attr_columns=columns,
        )

    load.__doc__ = (
        f"Loads the layout text={text!r}, task={task!r}, attributes={attributes}."
    )
    return load


def load_tabular_source(config: ml_collections.ConfigDict) -> TextDataset:
    """Loads any table with the column mapping of ``config.columns``."""
    return _load_tabular(
        config,
        path=config.path,
        split_column=config.split_column or "split",
        text=config.columns.text,
        task=config.columns.task,
        attributes=tuple(config.attributes),
        attr_columns=dict(config.columns.attributes),
    )


def _load_tabular(
    config: ml_collections.ConfigDict,
    *,
    path: str,
    split_column: str,
    text: str,
    task: str,
    attributes: tuple[str, ...],
    attr_columns: dict[str, str],
) -> TextDataset:
    task_classes = tuple(config.task_classes)
    if config.task_label_file:
        if task_classes:
            raise ValueError("Set data.task_classes or data.task_label_file, not both.")
        task_classes = read_label_file(config.task_label_file)
    attr_classes = {k: tuple(v) for k, v in config.attr_classes.items() if v}
    for a, label_file in config.attr_label_files.items():
        if not label_file:
            continue
        if a in attr_classes:
            raise ValueError(
                f"Set data.attr_classes.{a} or data.attr_label_files.{a}, not both."
            )
        attr_classes[a] = read_label_file(label_file)
    split_files = dict(config.split_files)
    return load_tabular(
        name=config.name or config.source,
        path="" if any(split_files.values()) and not config.path else path,
        split_files=split_files,
        file_format=config.file_format,
        text_column=text,
        text_pair_column=config.columns.text_pair,
        task_column=task,
        attributes=attributes,
        attr_columns=attr_columns,
        split_column=split_column,
        split_names=dict(config.split_names),
        splits=tuple(config.splits),
        task_classes=task_classes or None,
        attr_classes=attr_classes,
        attr_bins={k: tuple(v) for k, v in config.get("attr_bins", {}).items()},
        missing=config.get("missing", "error"),
        split_shares=tuple(config.get("split_shares", ())),
        split_seed=int(config.get("seed", 0)),
    )


SOURCES: dict[str, Callable[[ml_collections.ConfigDict], TextDataset]] = {
    "synthetic": load_synthetic,
    "tabular": load_tabular_source,
    "bios": _preset(text="bio", task="title", attributes={"gender": "gender"}),
    "pan16": _preset(
        text="text",
        task="task_label",
        attributes={"gender": "gender", "age": "age"},
    ),
    "fcdl18": _preset(text="tweet", task="label", attributes={"dialect": "dialect"}),
    "dwmw17_dialect": _preset(
        text="text",
        task="label",
        attributes={"dialect": "dialect"},
        path=DWMW17_PATH,
        split_column="split",
    ),
    # SRNets sentence-pair datasets (nli.py): fixed [S] class order, no attributes.
    "mnli": make_pair_loader("mnli"),
    "hans": make_pair_loader("hans"),
    "qqp": make_pair_loader("qqp"),
    "paws": make_pair_loader("paws"),
    "fever": make_pair_loader("fever"),
    "fever_symmetric": make_pair_loader("fever_symmetric"),
}


def get_source(name: str) -> Callable[[ml_collections.ConfigDict], TextDataset]:
    """Returns the loader registered as ``name``.

    Raises:
      ValueError: unknown name; the message lists the valid ones.
    """
    try:
        return SOURCES[name]
    except KeyError:
        raise ValueError(
            f"Unknown data source {name!r}; valid sources: {sorted(SOURCES)}."
        ) from None
