"""Export a project text dataset to the MoDDiffy reference's pickle input format.

The official PyTorch reference (CPJKU/ModularizedDebiasing, ``src/data_handler.py``)
reads one pickled list of dicts per split, each dict holding a task label, one
entry per protected attribute and the text, plus plain-text label files with one
class name per line (line order = integer code). We write the class *names* in
the order of ``ds.task_classes`` / ``ds.attr_classes[attr]``, so the reference's
integer coding equals ours. A ``labels.npz`` with our integer labels is written
next to the pickles for cross-checking the reference's own encoding.

Usage (project venv):
    python benchmarks/reference/export_synthetic.py                       # main job
    python benchmarks/reference/export_synthetic.py --data data=dwmw17 \
        --out /work/ref/data/dwmw17
"""

import argparse
import json
import pickle
from pathlib import Path

import numpy as np

from moddiffy_jax.config_lib import experiment_config
from moddiffy_jax.data.config import load_text_dataset

# Reference split file names (its cfg keys train_pkl / val_pkl / test_pkl).
SPLITS = {"train": "train.pkl", "dev": "val.pkl", "test": "test.pkl"}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experiment", default="moddiffy_par")
    p.add_argument("--data", default=None, help='override, e.g. "data=dwmw17"')
    p.add_argument("--out", default="/work/ref/data/synthetic")
    a = p.parse_args()

    c = experiment_config(a.experiment, a.data)
    ds = load_text_dataset(c.data)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    (out / "labels_task.txt").write_text("\n".join(ds.task_classes) + "\n")
    for attr in ds.attributes:
        (out / f"labels_protected_{attr}.txt").write_text(
            "\n".join(ds.attr_classes[attr]) + "\n"
        )

    labels, summary = {}, {}
    for split, fname in SPLITS.items():
        s = ds.splits[split]
        assert s.text_pair is None, "the reference takes single-segment text only"
        rows = []
        for i, text in enumerate(s.text):
            d = {"text": text, "task_label": ds.task_classes[int(s.task[i])]}
            for attr in ds.attributes:
                d[attr] = ds.attr_classes[attr][int(s.attrs[attr][i])]
            rows.append(d)
        with open(out / fname, "wb") as f:
            pickle.dump(rows, f)
        labels[f"{split}_task"] = np.asarray(s.task, np.int64)
        for attr in ds.attributes:
            labels[f"{split}_{attr}"] = np.asarray(s.attrs[attr], np.int64)
        summary[split] = len(rows)
    np.savez(out / "labels.npz", **labels)
    meta = {
        "name": ds.name,
        "attributes": list(ds.attributes),
        "task_classes": list(ds.task_classes),
        "attr_classes": {k: list(v) for k, v in ds.attr_classes.items()},
        "sizes": summary,
        "experiment": a.experiment,
        "data_override": a.data,
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
