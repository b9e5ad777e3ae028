r"""What hiding an attribute's words could remove at best, read on a run's core.

Word-level removal (counterfactual swaps, token merges, one-sided swaps)
makes a diff read an example as it reads the example with the attribute's
words hidden. Its best case is the core reading inputs whose telling
tokens are gone outright. This script replaces the ``K`` tokens that tell
the attribute most beyond the task label (``I(token present; attribute |
task)`` on the training split, :func:`moddiffy_jax.methods.word_rows.
conditional_information`; special and ``[unused]`` tokens left out) by
``[MASK]`` in every split, encodes them with the run's core and reads,
per ``K``:

* the core head's test accuracy on the masked inputs (no refit), and a
  linear task probe refit on the masked train vectors (test balanced
  accuracy): what of the task the masked words took with them;
* the attribute's leakage on test under the library's linear probe and
  converged MLP (fit on train, chosen on dev), beside the floor;
* the share of test examples that hold a masked token.

If the converged MLP still reads the attribute near the core's level once
the masked tokens touch nearly every example, no word-level removal can
meet a bar under that probe on this data.

Usage::

    python benchmarks/mask_bound.py --run runs/finetune_dwmw17 --ks 0,25,50,100 \
        --out /tmp/mask_bound.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import numpy as np


def ranked_tokens(split, attribute: str, vocab: int, skip: set[int]) -> list[int]:
    """Token ids by ``I(token present; attribute | task)`` on ``split``, best
    first, those scoring 0 and those in ``skip`` left out."""
    from moddiffy_jax.methods import word_rows

    info = word_rows.conditional_information(
        split.input_ids, split.attention_mask, split.task, split.attrs[attribute], vocab
    )
    order = np.lexsort((np.arange(info.size), -info))
    return [int(t) for t in order if info[t] > 0 and int(t) not in skip]


def main() -> None:
    from moddiffy_jax import train
    from moddiffy_jax.eval import composition, probes, removal
    from moddiffy_jax.models import text as text_lib

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, type=Path)
    p.add_argument("--ks", default="0,25,50,100")
    p.add_argument("--attribute", default="", help="default: the run's first")
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args()

    config = composition.load_run_config(args.run)
    art = composition.load_artifacts(args.run)
    ctx = train.build_context(config)
    rep = composition.Representer(ctx, 128)
    tokenizer = text_lib.load_tokenizer_for(config.model)
    attr = args.attribute or list(ctx.attributes)[0]
    splits = ctx.data.splits
    vocab = len(tokenizer.get_vocab())
    unused = {
        i
        for t, i in tokenizer.get_vocab().items()
        if t.startswith("[unused") and t.endswith("]")
    }
    order = ranked_tokens(
        splits["train"], attr, vocab, set(tokenizer.all_special_ids) | unused
    )
    n_task = len(ctx.data.task_classes)
    n_attr = len(ctx.data.attr_classes[attr])
    labels = {s: np.asarray(splits[s].attrs[attr]) for s in ("train", "dev", "test")}
    task = {s: np.asarray(splits[s].task) for s in ("train", "dev", "test")}
    out = {
        "run": str(args.run),
        "attribute": attr,
        "floor": removal.leakage_floor(
            task["train"],
            labels["train"],
            task["test"],
            labels["test"],
            num_task_classes=n_task,
            num_attr_classes=n_attr,
        ),
        "chance": 1.0 / n_attr,
        "top_tokens": tokenizer.convert_ids_to_tokens(order[:50]),
        "rows": {},
    }
    print(f"floor {out['floor']:.3f}; top tokens {out['top_tokens'][:20]}", flush=True)
    for k in [int(x) for x in args.ks.split(",")]:
        start = time.time()
        masked = np.asarray(order[:k], np.int64)
        h, touched = {}, 0.0
        for s in ("train", "dev", "test"):
            ids = np.asarray(splits[s].input_ids)
            hit = np.isin(ids, masked) & (np.asarray(splits[s].attention_mask) > 0)
            new = np.where(hit, tokenizer.mask_token_id, ids).astype(ids.dtype)
            h[s] = rep.represent_split(
                art.core, dataclasses.replace(splits[s], input_ids=new)
            )
            if s == "test":
                touched = float(hit.any(1).mean())
        splits_of = ("train", "dev", "test")
        reads = [x for s in splits_of for x in (h[s], labels[s])]
        lin = probes.linear_probe(
            *reads, num_classes=n_attr, tol=1e-4, class_weighted=True
        )
        conv = probes.converged_mlp_probe(*reads, num_classes=n_attr)
        task_reads = [x for s in splits_of for x in (h[s], task[s])]
        task_probe = probes.linear_probe(
            *task_reads, num_classes=n_task, tol=1e-4, class_weighted=True
        )
        row = {
            "test_rows_touched": touched,
            "core_head_test_acc": float(
                np.mean(rep.predict(art.head, h["test"]) == task["test"])
            ),
            "task_probe_test_balanced_acc": float(task_probe.test_balanced_accuracy),
            "lin": float(lin.test_balanced_accuracy),
            "conv": float(conv["test_balanced_accuracy"]),
        }
        out["rows"][k] = row
        print(k, json.dumps(row), f"{time.time() - start:.0f} s", flush=True)
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
