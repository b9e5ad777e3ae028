"""Writes a SYNTHETIC CSV with two attributes carried two ways: ``gender``
by words with counterparts (she / he, emma / john: the main job's
markers), ``style`` by word order alone (the time phrase before the
sentence or after it: both orders hold the same tokens, so no bag of tokens
reads it and no token swap can remove it). ``objective=auto`` then swaps
gender's words and gives style the MMD recipe in one run (stop 78,
docs/efficacy.md); with ``--config.method.auto_mix=False`` both take the MMD.

Sizes, task words, label noise, marker rate and gender's correlation with
the task (0.8) are the main job's; style follows the task label with
correlation 0.5 (the main job's age) and its order with probability 0.9.

    python benchmarks/mixed_carriers.py --out /tmp/mixed.csv
    python -m moddiffy_jax.main --config=configs/moddiffy_par.py \\
      --workdir=/tmp/mixed_run --config.data.source=tabular \\
      --config.data.path=/tmp/mixed.csv --config.data.columns.text=text \\
      --config.data.columns.task=label --config.data.attributes="('gender', 'style')"
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import numpy as np

from moddiffy_jax.data import synthetic

STYLE = ("fronted", "trailing")
ORDERS = {
    "fronted": "{when} , {subj} {verb} the {topic} was {filler} {task} .",
    "trailing": "{subj} {verb} the {topic} was {filler} {task} , {when} .",
}
SIZES = {"train": 2000, "dev": 2000, "test": 3000}  # the main job's


def rows(split: str, size: int, seed: int) -> list[dict[str, str]]:
    """One split's rows (its own random stream)."""
    rng = np.random.default_rng([seed, list(SIZES).index(split)])
    classes = synthetic.TASK_CLASSES[2]
    genders = tuple(synthetic.ATTR_MARKERS["gender"])
    out = []
    for _ in range(size):
        task = int(rng.integers(2))
        text_class = 1 - task if rng.random() < 0.1 else task  # label noise
        gender = task if rng.random() < 0.8 else int(rng.integers(2))
        style = task if rng.random() < 0.5 else int(rng.integers(2))
        order = style if rng.random() < 0.9 else int(rng.integers(2))
        if rng.random() < 0.9:
            subjects = synthetic.ATTR_MARKERS["gender"][genders[gender]]
        else:
            subjects = synthetic.NEUTRAL["gender"]
        words = {
            "subj": subjects[rng.integers(len(subjects))],
            "when": synthetic.NEUTRAL["age"][rng.integers(5)],
            "verb": synthetic.VERBS[rng.integers(len(synthetic.VERBS))],
            "topic": synthetic.TOPICS[rng.integers(len(synthetic.TOPICS))],
            "filler": synthetic.FILLERS[rng.integers(len(synthetic.FILLERS))],
        }
        pool = synthetic.TASK_WORDS[classes[text_class]]
        words["task"] = pool[rng.integers(len(pool))]
        out.append(
            {
                "text": ORDERS[STYLE[order]].format(**words),
                "label": classes[task],
                "gender": genders[gender],
                "style": STYLE[style],
                "split": split,
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    table = [r for s, n in SIZES.items() for r in rows(s, n, args.seed)]
    with args.out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)
    print(f"{len(table)} SYNTHETIC rows -> {args.out}")


if __name__ == "__main__":
    main()
